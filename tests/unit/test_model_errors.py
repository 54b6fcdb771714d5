"""load_model() on broken folders and bad settings: one ModelLoadError / ConfigError line naming what to fix.

Every model here is the tiny random-weight Qwen2 of ``tiny_models`` with the tiny tokenizer, saved to a
temp folder and damaged there; the embedded model's converted folder is a stand-in in a temp cache
(a tiny model under a valid marker), so nothing is converted and the real cache is never touched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model
from tiny_tokenizer import tiny_tokenizer

from rag_lookahead import embedded_model, models
from rag_lookahead.checks import hub_offline
from rag_lookahead.embedded_model import DEFAULT, MARKER_FILE
from rag_lookahead.errors import ConfigError, ModelLoadError
from rag_lookahead.models import embedded_model_dir, load_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A loadable model folder (config, safetensors, tokenizer files); tests damage copies of it."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_conversion(monkeypatch, tmp_path):
    """An empty temp cache in which a conversion of the embedded model fails the test at once."""
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError("the test started a conversion of the embedded model")

    monkeypatch.setattr(embedded_model, "locate_parts", refuse)
    monkeypatch.setattr(embedded_model, "convert_gguf", refuse)


def _load(name, **kwargs):
    return load_model(name, dtype="fp32", device="cpu", **kwargs)


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


# what each damage does to a model folder, and a word the error must carry about its cause
def _retype_tokenizer(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data["model"]["type"] = "Bogus"
    path.write_text(json.dumps(data), encoding="utf-8")


DAMAGES = {
    "truncated weights": (lambda d: _truncate(d / "model.safetensors", 1000), "SafetensorError"),
    "weights cut inside the header": (lambda d: _truncate(d / "model.safetensors", 4), "SafetensorError"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{not json"), "not a valid JSON"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[]"), "TypeError"),
    # the tokenizers library raises a bare Exception for it, which escaped load_model
    "tokenizer.json of an unknown model type": (lambda d: _retype_tokenizer(d / "tokenizer.json"), "Exception"),
    "tokenizer.json deleted": (lambda d: (d / "tokenizer.json").unlink(), "no vocabulary"),
    "no tokenizer files": (
        lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
        "no vocabulary",
    ),
}


# ---------------------------------------------------------------- local folders


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_broken_local_folder_is_one_model_load_error_naming_it(tiny_folder, tmp_path, damage):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_folder, folder)
    spoil, cause = DAMAGES[damage]
    spoil(folder)
    with pytest.raises(ModelLoadError) as err:
        _load(str(folder))
    msg = _one_line(err)
    assert str(folder) in msg and cause in msg


def test_the_undamaged_folder_loads_from_a_str_and_from_a_path(tiny_folder):
    # the damages above are what breaks the loads: the same folder whole loads either way
    for name in (str(tiny_folder), tiny_folder):
        model, tokenizer = _load(name)
        assert type(model).__name__ == "Qwen2ForCausalLM" and len(tokenizer) > 16


def test_a_path_is_always_a_local_folder_never_an_embedded_name(no_conversion, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="model folder 'default' does not exist"):
        _load(Path("default"))


@pytest.mark.parametrize("name", [None, 42, b"/some/folder", "", "  "])
def test_a_model_name_that_is_not_a_string_or_path_is_a_config_error(name):
    with pytest.raises(ConfigError) as err:
        _load(name)
    assert repr(name) in _one_line(err)


def test_a_file_given_for_a_folder_says_so(tiny_folder):
    with pytest.raises(ModelLoadError) as err:
        _load(str(tiny_folder / "config.json"))
    msg = _one_line(err)
    assert "is a file, not a model folder" in msg and f"('{tiny_folder}')" in msg
    assert "does not exist" not in msg


def test_a_corrupt_gguf_file_is_a_model_load_error(tmp_path):
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00garbage")  # the magic and a version, then a cut-off header
    with pytest.raises(ModelLoadError) as err:
        _load(str(gguf))
    msg = _one_line(err)
    assert str(gguf) in msg and "struct.error" in msg


# ---------------------------------------------------------------- the converted embedded model


def _stand_in(tiny_folder: Path) -> Path:
    """The tiny model where the converted default model belongs (in the temp cache), marked complete."""
    target = embedded_model_dir("default", convert=False)
    shutil.copytree(tiny_folder, target)
    (target / MARKER_FILE).write_text(json.dumps({"sha256": DEFAULT.sha256}))
    return target


def test_the_stand_in_for_the_converted_model_loads(tiny_folder, no_conversion):
    _stand_in(tiny_folder)
    model, _ = _load("default")
    assert model.config.vocab_size == tiny_model("qwen2").config.vocab_size


@pytest.mark.parametrize(
    "damage",
    [
        "truncated weights",
        "weights cut inside the header",
        "tokenizer.json deleted",
        "config.json a list",
        "tokenizer.json of an unknown model type",
    ],
)
def test_a_corrupt_converted_model_says_which_folder_to_delete(tiny_folder, no_conversion, damage):
    target = _stand_in(tiny_folder)
    spoil, cause = DAMAGES[damage]
    spoil(target)
    with pytest.raises(ModelLoadError) as err:
        _load("default")
    msg = _one_line(err)
    assert f"the converted default model in {target} is unreadable" in msg
    assert cause in msg and msg.endswith("delete that folder to reconvert")
    assert target.is_dir()  # said, not done: the user deletes it


def _flash_attention_2_missing() -> bool:
    """Whether transformers would refuse flash_attention_2 here: no flash-attn, no kernels package."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("kernels") is None


BAD_LOAD_ARGUMENTS = {  # what each argument error must say about itself
    "misspelt attention": ({"attn_implementation": "eagre"}, "unknown attn_implementation 'eagre'; use one of eager"),
    "attention not a string": ({"attn_implementation": 2}, "attn_implementation must be a string"),
    "flash attention not installed": (
        {"attn_implementation": "flash_attention_2"},
        "attn_implementation 'flash_attention_2' needs the flash-attn package, which is not installed",
    ),
    "integer dtype": ({"dtype": torch.int64}, "dtype torch.int64 cannot hold a model's weights"),
    "float8 dtype": ({"dtype": torch.float8_e4m3fn}, "dtype torch.float8_e4m3fn cannot hold a model's weights"),
}


@pytest.mark.parametrize("bad", BAD_LOAD_ARGUMENTS)
@pytest.mark.parametrize("where", ["embedded", "local folder"])
def test_a_bad_attention_or_dtype_is_a_config_error_not_a_folder_to_delete(tiny_folder, no_conversion, bad, where):
    """transformers refused them inside from_pretrained, and load_model blamed the model: for the
    embedded one, "the converted default model in ... is unreadable; delete that folder to reconvert"."""
    arguments, said = BAD_LOAD_ARGUMENTS[bad]
    if bad == "flash attention not installed" and not _flash_attention_2_missing():
        pytest.skip("flash-attn (or kernels) is installed here")
    name = "default" if where == "embedded" else str(tiny_folder)
    folder = _stand_in(tiny_folder) if where == "embedded" else tiny_folder
    options = {"dtype": "fp32", "device": "cpu", **arguments}
    with pytest.raises(ConfigError) as loading:
        load_model(name, **options)
    msg = _one_line(loading)
    assert msg.startswith(said) and str(folder) not in msg and "delete" not in msg
    with pytest.raises(ConfigError) as checking:  # said before ask's slow sample index too
        models.check_load_options(name, **options)
    assert _one_line(checking) == msg


def test_the_attentions_and_dtypes_transformers_takes_still_load(tiny_folder):
    for arguments in ({"attn_implementation": "eager"}, {"attn_implementation": "paged|eager"}, {"dtype": "bf16"}):
        model, _ = load_model(str(tiny_folder), **{"dtype": "fp32", "device": "cpu", **arguments})
        assert model.config._attn_implementation == arguments.get("attn_implementation", "sdpa")
    model, _ = load_model(str(tiny_folder), dtype=torch.float64, device="cpu")
    assert model.dtype == torch.float64


def test_a_load_of_a_sound_converted_model_that_fails_otherwise_does_not_say_to_delete_it(tiny_folder, no_conversion):
    """Only a fault in its files is worth a 1.3 GB conversion: here a device map sends a layer to disk
    without an offload folder (transformers' ValueError)."""
    target = _stand_in(tiny_folder)
    with pytest.raises(ModelLoadError) as err:
        load_model("default", dtype="fp32", device_map={"": "cpu", "lm_head": "disk"})
    msg = _one_line(err)
    assert msg.startswith(f"could not load the default model from {target}: ValueError: ")
    assert "unreadable" not in msg and "delete" not in msg


@pytest.mark.parametrize("name", ["  default  ", "default\n", "\tdefault"])
def test_a_model_name_is_read_without_surrounding_spaces(tiny_folder, no_conversion, name):
    """`--model " default "` was taken for a hub id ("the hub could not be reached"), while
    `--dtype " fp32 "` was read as fp32."""
    _stand_in(tiny_folder)
    model, _ = _load(name)
    assert model.config.vocab_size == tiny_model("qwen2").config.vocab_size
    assert models.check_load_options(name) == "default"
    assert models.reported_name(name) == DEFAULT.name


@pytest.mark.parametrize("name", ["bad id with spaces", "my-model/", "owner/name/extra", "a--b"])
def test_a_name_that_cannot_be_a_hub_id_says_so_not_that_the_hub_is_unreachable(no_conversion, name):
    """Such names went to the hub, and the error blamed the network ("the hub could not be reached")."""
    for check in (_load, models.check_load_options):
        with pytest.raises(ConfigError) as err:
            check(name)
        msg = _one_line(err)
        assert msg.startswith(f"model {name!r} is neither an embedded model ('default', 'quality'), nor a local")
        assert "nor a hub id: " in msg and "reached" not in msg


@pytest.mark.parametrize(("name", "meant"), [("DEFAULT", "default"), ("Quality", "quality")])
def test_an_embedded_name_in_other_letters_asks_did_you_mean(no_conversion, name, meant):
    for check in (_load, models.check_load_options):
        with pytest.raises(ConfigError) as err:
            check(name)
        assert _one_line(err) == (
            f"no model named {name!r}: did you mean {meant!r}? (the embedded models' names are lowercase)"
        )


def test_a_local_folder_named_like_an_embedded_model_in_capitals_still_loads(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_folder, tmp_path / "DEFAULT")
    model, _ = _load("DEFAULT")
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_check_load_options_says_what_a_load_would_before_reading_any_weights(tiny_folder, tmp_path):
    """The checks ``ask`` runs before it builds the sample index give the load's own errors."""
    (tmp_path / "weights.bin").write_bytes(b"")
    for name in (tmp_path / "missing", str(tmp_path / "missing"), tmp_path, tmp_path / "weights.bin"):
        with pytest.raises(ModelLoadError) as loading:
            _load(name)
        with pytest.raises(ModelLoadError) as checking:
            models.check_load_options(name, dtype="fp32", device="cpu")
        assert _one_line(checking) == _one_line(loading)
    assert models.check_load_options(tiny_folder) == str(tiny_folder)
    with pytest.raises(ConfigError, match="unknown dtype 'bogus'"):
        models.check_load_options(tiny_folder, dtype="bogus")


# ---------------------------------------------------------------- devices named but not there


@pytest.fixture
def no_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("placement", "said"),
    [
        ({"device_map": "cuda"}, "device_map 'cuda' asked for, but torch"),
        ({"device_map": "cuda:0"}, "sees no CUDA GPU"),
        ({"device_map": 0}, "device_map 'cuda:0' asked for"),
        ({"device_map": {"": "cuda:0"}}, "sees no CUDA GPU"),
        ({"device_map": "xpu"}, "device_map 'xpu' asked for, but torch"),
        ({"device": "xpu"}, "device 'xpu' asked for, but torch"),
        ({"device": "cuda"}, "sees no CUDA GPU"),
        (
            {"device": "meta"},
            "device 'meta' holds shapes, not weights",
        ),  # was a NotImplementedError deep in transformers
        ({"device_map": "meta"}, "device_map 'meta' holds shapes, not weights"),
        ({"device_map": {"": "meta"}}, "device_map 'meta' holds shapes, not weights"),
    ],
)
def test_a_missing_accelerator_is_a_config_error_before_any_file_is_read(no_accelerators, placement, said):
    kwargs = {"dtype": "fp32", "device": "cpu", **placement}
    with pytest.raises(ConfigError) as err:
        load_model("./no-such-folder", **kwargs)  # the placement is refused first: no "does not exist"
    assert said in _one_line(err)


def test_check_load_options_refuses_a_missing_accelerator(no_accelerators):
    with pytest.raises(ConfigError, match="device 'cuda' asked for, but torch .* sees no CUDA GPU"):
        models.check_load_options("default", device="cuda")


def test_device_map_strategies_and_the_cpu_need_no_accelerator(no_accelerators):
    for device_map in ("auto", "balanced", "sequential", "cpu", {"": "cpu"}):
        assert models.placement(None, device_map) == {"device_map": device_map}


def test_a_device_map_gpu_past_the_last_one_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert models.placement(None, {"": "cuda:0"}) == {"device_map": {"": "cuda:0"}}
    with pytest.raises(ConfigError, match="only 1 CUDA GPU"):
        models.placement(None, {"": "cuda:1"})
    with pytest.raises(ConfigError, match="only 1 CUDA GPU"):
        models.placement(None, 1)


_NO_USER = "~no_such_user_rag_lookahead_h37a"


@pytest.mark.parametrize(
    ("env", "call"),
    [
        ("RAG_LOOKAHEAD_CACHE", lambda: __import__("rag_lookahead.paths").paths.cache_dir()),
        ("RAG_LOOKAHEAD_HOME", lambda: __import__("rag_lookahead.rag.store").rag.store.default_index_dir()),
        (None, lambda: _load(f"{_NO_USER}/model")),
        (None, lambda: __import__("rag_lookahead.rag.index").rag.index.load_index(f"{_NO_USER}/index")),
    ],
)
def test_a_tilde_naming_no_user_is_one_config_error_not_a_runtime_error(monkeypatch, env, call):
    """pathlib's expanduser raises RuntimeError for ~user with no such user: a traceback in the CLI."""
    if env:
        monkeypatch.setenv(env, f"{_NO_USER}/x")
    with pytest.raises(ConfigError) as err:
        call()
    assert _NO_USER in _one_line(err)


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("https://hub.example:abc", "port could not be cast to integer value as 'abc'"),
        ("http://[bad", "invalid IPv6 URL"),
        ("https://hub.example:99999", "port out of range 0-65535"),
    ],
)
def test_an_hf_endpoint_huggingface_hub_cannot_parse_is_one_config_error(tiny_folder, monkeypatch, endpoint, why):
    """huggingface_hub parses $HF_ENDPOINT as it is first imported: every model load was a
    ValueError traceback, a local folder's too (see the next test for the first import itself)."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    for check in (lambda: _load(tiny_folder), lambda: models.check_load_options("default")):
        with pytest.raises(ConfigError) as err:
            check()
        assert _one_line(err).startswith(f"$HF_ENDPOINT {endpoint!r} is not a URL: {why}")


NO_URL = "it needs http:// or https:// and a host"


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("hub.example", NO_URL),  # the probe tried huggingface.co instead
        ("ftp://hub.example", NO_URL),
        ("https://", NO_URL),
        # huggingface_hub fetched "/rag-lookahead-test/.../config.json": an error that named no variable
        ("", "it is set but empty"),
    ],
)
def test_an_hf_endpoint_that_is_no_url_is_refused_where_the_hub_is_asked_only(
    tiny_folder, monkeypatch, tmp_path, endpoint, why
):
    """A value huggingface_hub can import with, but not fetch from, stopped every load: a local
    folder and the embedded model, which never contact the hub, were refused too. It is refused
    where a hub id must be fetched (check_load_options' hub check, load_model, a
    sentence-transformers name), with or without a proxy, and never while the hub is offline."""
    from rag_lookahead.rag.embedders import SentenceTransformerEmbedder

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    model, _ = _load(tiny_folder)
    assert model.config.vocab_size == tiny_model("qwen2").config.vocab_size
    assert models.check_load_options("default", hub=True) == "default"
    assert models.check_load_options(str(tiny_folder), hub=True) == str(tiny_folder)
    hub_id = "rag-lookahead-test/no-such-model"
    for check in (
        lambda: models.check_load_options(hub_id, hub=True),
        lambda: _load(hub_id),
        lambda: SentenceTransformerEmbedder(hub_id),
    ):
        with pytest.raises(ConfigError) as err:
            check()
        assert _one_line(err) == (
            f"$HF_ENDPOINT {endpoint!r} is not a URL: {why}; give one such as https://huggingface.co, or unset it"
        )
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # the reachability probe is skipped
    with pytest.raises(ConfigError, match=r"^\$HF_ENDPOINT"):
        models.check_load_options(hub_id, hub=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is fetched: the cache's refusal, not the variable's
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        models.check_load_options(hub_id, hub=True)
    # a folder is no fetch for sentence-transformers: what is said is about the package or the folder
    with pytest.raises(ModelLoadError, match="sentence-transformers"):
        SentenceTransformerEmbedder(str(tmp_path))
    # nor is a path that names no folder: it was taken for a hub id, and $HF_ENDPOINT was blamed
    from rag_lookahead.rag.embedders import get_embedder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    for name in ("./my-st-model", "~/models/st", "../no-such-st-model"):
        with pytest.raises(ModelLoadError) as err:
            get_embedder(f"st:{name}")
        assert _one_line(err) == f"sentence-transformers model folder '{name}' does not exist"


def test_an_hf_endpoint_is_checked_before_huggingface_hub_is_imported(tiny_folder):
    import os
    import subprocess
    import sys

    code = f"from rag_lookahead.models import load_model; load_model({str(tiny_folder)!r}, dtype='fp32', device='cpu')"
    env = {**os.environ, "HF_ENDPOINT": "https://hub.example:abc"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rag_lookahead.errors.ConfigError: $HF_ENDPOINT 'https://hub.example:abc' is not a URL")
    assert "ValueError:" not in done.stderr  # no second exception, chained or not


@pytest.mark.parametrize("endpoint", ["", "https://hf-mirror.example", "http://[::1]:8080/", "HTTPS://hub.example/x"])
def test_an_hf_endpoint_that_is_a_url_or_empty_loads(tiny_folder, monkeypatch, endpoint):
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    model, _ = _load(tiny_folder)
    assert model.config.vocab_size == tiny_model("qwen2").config.vocab_size


@pytest.mark.parametrize(
    "env",
    [
        {"HF_HUB_OFFLINE": "1"},
        {"HF_HUB_OFFLINE": "TRUE"},
        {"HF_HUB_OFFLINE": "on"},
        {"HF_HUB_OFFLINE": "y"},  # these four were offline for us, online for huggingface_hub
        {"HF_HUB_OFFLINE": "2"},
        {"HF_HUB_OFFLINE": "enable"},
        {"HF_HUB_OFFLINE": " 1"},
        {"HF_HUB_OFFLINE": "0"},
        {"TRANSFORMERS_OFFLINE": "1"},  # missed: we probed the hub that transformers would not ask
        {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},
        {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "yes"},
    ],
    ids=lambda env: ",".join(f"{k}={v!r}" for k, v in env.items()),
)
def test_offline_mode_is_read_as_huggingface_hub_reads_it(monkeypatch, env):
    """The hub is offline for us exactly where huggingface_hub, asked in a process started with
    these variables, says so, and the refusal names the variable that did it."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = "import huggingface_hub; print(huggingface_hub.is_offline_mode())"
    theirs = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean | env, timeout=120, check=True
    ).stdout.strip()
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    offline = hub_offline()
    assert str(bool(offline)) == theirs, (env, offline, theirs)
    if offline:
        with pytest.raises(ModelLoadError) as err:
            models.check_load_options("rag-lookahead-test/no-such-model", hub=True)
        assert f"is neither a local folder nor in the Hugging Face cache ({offline} is set)" in _one_line(err)
