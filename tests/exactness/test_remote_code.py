"""Remote-code models are an explicit opt-in, and the tree-mask probe decides tree or chain drafts.

The model folders are built by ``remote_models.remote_folder`` from
``remote_code/modeling_tiny_remote.py``: a config.json whose ``auto_map`` points at classes in a
modeling file next to it, as ChatGLM3 and Qwen-1 ship them on the hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from remote_models import remote_folder

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.loop import DecodeBatch
from rag_lookahead.decoding.verify import supports_tree_mask
from rag_lookahead.errors import ConfigError, ModelLoadError
from rag_lookahead.hf_entry import hf_generate
from rag_lookahead.models import load_model


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_refused_without_the_opt_in(tmp_path):
    folder = remote_folder(tmp_path, "TinyRemoteForCausalLM")
    with pytest.raises(ModelLoadError, match=r"ships its own modeling code.*trust_remote_code=True") as caught:
        load_model(str(folder), dtype=torch.float32, device="cpu")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load_model(str(folder), dtype=torch.float32, device="cpu", trust_remote_code="yes")


def test_loads_with_the_opt_in_and_drafts_trees(tmp_path):
    folder = remote_folder(tmp_path, "TinyRemoteForCausalLM")
    model, tokenizer = load_model(str(folder), dtype=torch.float32, device="cpu", trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteForCausalLM" and type(model).__module__.startswith("transformers_modules")
    assert tokenizer.encode("t5 t6", add_special_tokens=False) == [5, 6]
    assert supports_tree_mask(model)
    assert DecodeBatch(model, LookaheadConfig(), frozenset(), None).tree_mask
    prompt = [7, 3, 9, 4, 11, 2, 8]
    expected = greedy(model, prompt, 20)
    result = generate(
        model, prompt, max_new_tokens=20, references=[[prompt[-2:] + expected]], config=LookaheadConfig(budget="fixed")
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected


def test_attention_that_ignores_the_tree_mask_gets_chains(tmp_path):
    """A Qwen-1-like attention that drops 4-D masks: trees would let branches see each other, so
    the probe falls back to single chains and the output stays model.generate's."""
    folder = remote_folder(tmp_path, "MaskBlindForCausalLM")
    model, _ = load_model(str(folder), dtype=torch.float32, device="cpu", trust_remote_code=True)
    assert type(model).__name__ == "MaskBlindForCausalLM"
    with pytest.warns(UserWarning, match="single chains"):
        assert not supports_tree_mask(model)
    prompt = [7, 3, 9, 4, 11, 2, 8]
    expected = greedy(model, prompt, 20)
    wrong = [(t % 12) + 1 for t in expected]  # a competing branch that a tree would also verify
    result = generate(
        model,
        prompt,
        max_new_tokens=20,
        references=[[prompt[-2:] + expected, prompt[-2:] + wrong]],
        config=LookaheadConfig(budget="fixed"),
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.mean_accepted > 1.5  # chains still accept several tokens a step


def test_serve_takes_the_opt_in(tmp_path, monkeypatch):
    """``serve --trust-remote-code`` loads the model (a Ray replica builds the same app from the
    same config). serve had no such flag, though the refusal told the user to pass it."""
    pytest.importorskip("fastapi")
    from rag_lookahead.serve.app import create_app
    from rag_lookahead.serve.command import config_from_args, parse_args

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))  # no default index to open
    folder = remote_folder(tmp_path, "TinyRemoteForCausalLM")
    config = config_from_args(parse_args([f"--model={folder}", "--trust-remote-code"]), {})
    assert config.trust_remote_code is True
    assert type(create_app(config).state.engine.model).__name__ == "TinyRemoteForCausalLM"
    with pytest.raises(ModelLoadError, match=r"--trust-remote-code \(ask, serve, the benchmarks\)"):
        create_app(config_from_args(parse_args([f"--model={folder}"]), {}))


def test_the_benchmarks_take_the_opt_in(tmp_path):
    """``bench --trust-remote-code`` measures a remote-code model (ChatGLM3's case): no benchmark
    had the flag, so none could load one, though ``ask`` and ``serve`` could. Without it the run
    stops with the loader's one line, which names the benchmarks among the commands that take it."""
    from rag_lookahead.bench import single

    folder = str(remote_folder(tmp_path, "TinyRemoteForCausalLM"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "context": "t5 t6 t7 t8 t5 t6", "question": "t9 t5"}) + "\n")
    argv = ["--model", folder, "--dtype", "fp32", "--device", "cpu", "--prompts", str(prompts)]
    argv += ["--max-new-tokens", "2", "--methods", "greedy,lookahead"]
    report = single.main([*argv, "--trust-remote-code"])
    assert report["model"] == folder and report["prompts"] == 1
    [row] = report["per_prompt"]
    assert row["lookahead"]["identical_to_greedy"]
    with pytest.raises(SystemExit) as refused:
        single.main(argv)
    assert re.fullmatch(
        r"error: model '.*' ships its own modeling code, .*pass --trust-remote-code \(ask, serve, the benchmarks\).*",
        str(refused.value.code),
    )


def test_a_remote_code_folder_is_refused_before_slow_work(tmp_path, monkeypatch):
    """``ask``, ``bench.rag`` and ``bench.session`` check the model before they build an index, and
    ``bench.quality`` every name of ``--models`` before the first runs; a folder that ships its own
    code passed those checks and was refused only when it loaded (``bench.quality --models
    default,<folder>`` after the whole run on ``default``, its report lost)."""
    from rag_lookahead.bench.quality import model_names
    from rag_lookahead.models import check_load_options

    folder = str(remote_folder(tmp_path, "TinyRemoteForCausalLM"))
    with pytest.raises(ModelLoadError, match=r"ships its own modeling code.*--trust-remote-code"):
        check_load_options(folder)
    assert check_load_options(folder, trust_remote_code=True) == folder
    with pytest.raises(ModelLoadError, match="ships its own modeling code"):
        model_names(f"default,{folder}", "fp32", "cpu")
    assert model_names(f"default,{folder}", "fp32", "cpu", trust_remote_code=True) == ["default", folder]
    # a type transformers has is loaded with transformers' code without the opt-in, as from_pretrained does
    config_file = Path(folder) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "llama"}))
    assert check_load_options(folder) == folder
    # a .gguf file carries its own config: the config.json beside it is not what transformers reads
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "tiny_remote"}))
    (Path(folder) / "model-q4.gguf").write_bytes(b"")
    assert check_load_options(str(Path(folder) / "model-q4.gguf")) == str(Path(folder) / "model-q4.gguf")


def test_gpu_check_refuses_a_remote_code_folder_before_its_sections(tmp_path, monkeypatch):
    """Without --trust-remote-code, gpu-check ran its environment and tiny sections first, then
    failed its "model" row with a ~45-line traceback; it is one line before any section now, as
    for every other benchmark. With the flag the sections run (here: reach ``run_check``)."""
    from rag_lookahead.bench import gpu_check

    folder = str(remote_folder(tmp_path, "TinyRemoteForCausalLM"))
    ran = []
    monkeypatch.setattr(gpu_check, "run_check", lambda settings: ran.append(settings) or {"ok": True})
    monkeypatch.setattr(gpu_check, "print_table", lambda report: None)
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--device", "cpu", "--model", folder])
    assert done.value.code == (
        f"error: model '{folder}' ships its own modeling code, which is not run by default: if you trust its"
        " source, pass --trust-remote-code (ask, serve, the benchmarks) or trust_remote_code=True"
        " (load_model, LookaheadLLM.from_model_id, ChatLookahead)"
    )
    assert ran == []
    assert gpu_check.main(["--device", "cpu", "--model", folder, "--trust-remote-code"]) == 0
    assert [s.trust_remote_code for s in ran] == [True]


def test_langchain_takes_the_opt_in(tmp_path):
    """``LookaheadLLM.from_model_id(..., trust_remote_code=True)`` and ``ChatLookahead(model=...,
    trust_remote_code=True)`` load the model: the first passed the keyword on as a LookaheadLLM
    setting after loading without it, the second refused it as an unknown field."""
    from rag_lookahead.langchain.chat_model import ChatLookahead
    from rag_lookahead.langchain.llm import LookaheadLLM

    folder = str(remote_folder(tmp_path, "TinyRemoteForCausalLM"))
    llm = LookaheadLLM.from_model_id(folder, trust_remote_code=True, max_new_tokens=4)
    assert type(llm.model).__name__ == "TinyRemoteForCausalLM"
    assert llm.invoke("t5 t6")
    chat = ChatLookahead(model=folder, trust_remote_code=True, max_tokens=4)
    assert type(chat._engine.model).__name__ == "TinyRemoteForCausalLM"
    assert chat.invoke("t5 t6").content
    # a chat model without the opt-in is refused the remote-code model the one above holds loaded
    with pytest.raises(ModelLoadError, match=r"trust_remote_code=True \(load_model, LookaheadLLM"):
        ChatLookahead(model=folder)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        ChatLookahead(model=folder, trust_remote_code="yes")


BEFORE_5_24 = (
    r"LegacyCacheForCausalLM's forward takes past_key_values \(code written before transformers 5\.24\), not cache"
)
SWALLOWED = (
    r"LegacyKwargsForCausalLM's forward takes past_key_values \(code written before transformers 5\.24\) and"
    r" \*\*kwargs, which took the cache rag_lookahead passes as cache= and left it empty"
)


@pytest.mark.parametrize(
    "model_class, refusal", [("LegacyCacheForCausalLM", BEFORE_5_24), ("LegacyKwargsForCausalLM", SWALLOWED)]
)
def test_a_forward_that_cannot_take_the_cache_is_refused_in_one_line(tmp_path, model_class, refusal):
    """A forward that names the cache ``past_key_values`` (ChatGLM3's) got our ``cache=``: without a
    ``**kwargs`` a bare TypeError, with one that swallows it a cache never filled; both after a
    warning that the mask probe had failed and chains were "still lossless". Now one ConfigError:
    from the signature before any forward (no ``**kwargs``), or at the probe's first forward,
    which left the cache empty (``**kwargs``: the signature alone cannot tell, see the next test)."""
    folder = remote_folder(tmp_path, model_class)
    model, tokenizer = load_model(str(folder), dtype=torch.float32, device="cpu", trust_remote_code=True)
    prompt = [7, 3, 9, 4, 11, 2, 8]
    assert len(greedy(model, prompt, 4)) == 4  # its own prepare_inputs_for_generation runs it in model.generate
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match=refusal) as caught:
            generate(model, prompt, max_new_tokens=4)
        assert "\n" not in str(caught.value)
        with pytest.raises(ConfigError, match=refusal):
            model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=4, pad_token_id=0, custom_generate=hf_generate
            )
        with pytest.raises(ConfigError, match=refusal):
            supports_tree_mask(model)
        if model_class == "LegacyCacheForCausalLM" and importlib.util.find_spec("fastapi") is not None:
            from rag_lookahead.serve.engine import Engine  # the server's engine, as it is built at start

            with pytest.raises(ConfigError, match=refusal):
                Engine(model, tokenizer)
    assert not [w for w in seen if "single chains" in str(w.message)]


@pytest.mark.filterwarnings("ignore:Both `past_key_values` and `cache` are set:FutureWarning")  # its own call
def test_a_subclass_of_a_native_class_that_passes_kwargs_on_decodes(tmp_path):
    """Remote code written for transformers 5.0-5.23 that subclasses a native class keeps
    ``past_key_values`` in its signature and passes ``**kwargs`` (our ``cache=``) on to the native
    forward, which takes it: it decodes as ``model.generate`` does. It was refused from its
    signature alone ("code written for transformers 4")."""
    folder = remote_folder(tmp_path, "PassesKwargsOnForCausalLM")
    model, _ = load_model(str(folder), dtype=torch.float32, device="cpu", trust_remote_code=True)
    assert type(model).__name__ == "PassesKwargsOnForCausalLM"
    prompt = [7, 3, 9, 4, 11, 2, 8, 7, 3, 9]
    expected = greedy(model, prompt, 16)
    assert supports_tree_mask(model)
    result = generate(
        model, prompt, max_new_tokens=16, references=[[prompt[-2:] + expected]], config=LookaheadConfig(budget="fixed")
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.mean_accepted > 1.5  # the reference's drafts were verified through its cache
    plain = generate(model, prompt, max_new_tokens=16)
    assert plain.sequences[0, len(prompt) :].tolist() == expected


def test_serve_refuses_a_forward_written_before_transformers_5_24_at_start(tmp_path):
    """The server started, logged a traceback from its warm-up and answered 503 to every request:
    now ``serve`` says why in one line and exits 1 before it serves."""
    pytest.importorskip("fastapi")
    folder = remote_folder(tmp_path, "LegacyCacheForCausalLM")
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={folder}", "--trust-remote-code", "--port=0"]
    env = {**os.environ, "RAG_LOOKAHEAD_CACHE": str(tmp_path / "cache")}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired as err:  # it served
        pytest.fail(f"serve started on the model instead of refusing it: {(err.stderr or b'')[-600:]!r}")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-1500:]
    assert len(errors) == 1 and re.search(BEFORE_5_24, errors[0]), run.stderr[-1500:]


def test_serve_refuses_a_remote_code_or_unknown_type_folder_in_one_line(tmp_path):
    """``serve`` (and plain ``bench``) met these folders only in transformers' loader, which first
    printed "You are using a model of type ... to instantiate a model of type ``" on stderr; a
    model_type transformers does not know then failed with a ValueError cut short, after ``ask``
    had indexed the sample corpus."""
    from rag_lookahead.models import check_load_options

    remote = remote_folder(tmp_path / "r", "TinyRemoteForCausalLM")
    config = json.loads((remote / "config.json").read_text())
    config["model_type"] = "frobnicator"
    (remote / "config.json").write_text(json.dumps(config))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "auto_map"}))
    said = {
        remote: r"error: model '.*' ships its own modeling code, which is not run by default: .*",
        unknown: r"error: model folder '.*' has model_type 'frobnicator', which transformers .* does not know: .*",
    }
    for folder, line in said.items():
        run = subprocess.run(
            [sys.executable, "-m", "rag_lookahead", "serve", "--model", str(folder), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path / "home")},
        )
        assert run.returncode == 1 and re.fullmatch(line + "\n", run.stderr), run.stderr
    with pytest.raises(ModelLoadError, match="has model_type 'frobnicator'"):
        check_load_options(str(unknown))  # ask's check, before it indexes
    with pytest.raises(ModelLoadError, match="has model_type 'frobnicator'"):
        load_model(str(unknown))
