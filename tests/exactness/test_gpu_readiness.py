"""What a first GPU run needs, checked on the CPU: the mask probe never crashes a process and
reads rounding right, packed steps give sdpa a boolean mask built where the cache lives, cost
curves are keyed by the hardware, GPUs get a dtype they run natively, and the GPU check runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from tiny_models import ARCHITECTURES, build_tiny_model, reference_generate

from rag_lookahead import LookaheadConfig, generate, models
from rag_lookahead.decoding.costs import _curve_key, cpu_name
from rag_lookahead.decoding.loop import DecodeBatch, left_pad
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.decoding.verify import EXACT_TOLERANCE, ROUNDED_TOLERANCE, probe_tolerance, supports_tree_mask
from rag_lookahead.errors import ConfigError


def _count_forwards(model) -> list[int]:
    calls = [0]

    def count(module, args, kwargs):
        calls[0] += 1

    model.register_forward_pre_hook(count, with_kwargs=True)
    return calls


# ---------------------------------------------------------------- the mask probe


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3"])
def test_flash_attention_is_refused_without_a_forward(implementation):
    """Flash kernels read a 4-D mask as padding: on CUDA a device-side assert that no except can catch."""
    model = build_tiny_model("qwen2", seed=11)
    model.config._attn_implementation = implementation
    calls = _count_forwards(model)
    with pytest.warns(UserWarning, match="treats a 4-D mask as a padding mask"):
        assert supports_tree_mask(model) is False
    assert calls[0] == 0


def _refuse_4d_masks(module, args, kwargs):
    """Like a kernel that chokes on a 4-D mask."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 4:
        raise RuntimeError("CUDA error: device-side assert triggered (simulated)")


def test_a_probe_that_raises_falls_back_to_chain_drafts():
    model = build_tiny_model("qwen2", seed=12)
    model.register_forward_pre_hook(_refuse_4d_masks, with_kwargs=True)
    prompt = [4, 5, 6, 7, 4, 5, 6, 7, 4, 5]
    expected = reference_generate(model, prompt, 20, None)
    with pytest.warns(UserWarning, match="probe failed"):
        result = generate(
            model, prompt, max_new_tokens=20, config=LookaheadConfig(budget="fixed"), references=[[prompt + expected]]
        )
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.mean_accepted > 1.5  # chains are still drafted, and run unmasked
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per model
        DecodeBatch(model, LookaheadConfig(), frozenset(), None)


def test_nan_logits_fail_the_probe():
    model = build_tiny_model("qwen2", seed=13)

    def overflow(module, args, output):
        output.logits.fill_(float("nan"))  # what fp16 overflow leaves behind

    model.register_forward_hook(overflow)
    with pytest.warns(UserWarning, match="not finite"):
        assert supports_tree_mask(model) is False


def _tf32_like_noise(scale: float):
    """A forward hook that perturbs the logits by up to ``scale`` of their largest value, differently each call."""
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1
        generator = torch.Generator().manual_seed(calls[0])
        logits = output.logits
        noise = torch.rand(logits.shape, generator=generator) * 2 - 1
        logits.add_(noise * scale * logits.abs().max())

    return hook


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cuda.matmul.allow_tf32 = before[1]


def test_rounded_fp32_matmuls_get_the_rounded_tolerance(matmul_precision):
    """TF32 makes fp32 logits differ by ~1e-3: tree drafts must stay on, not be turned off."""
    matmul_precision("high")
    model = build_tiny_model("qwen2", seed=14)
    model.register_forward_hook(_tf32_like_noise(3e-3))
    assert supports_tree_mask(model) is True
    assert probe_tolerance(torch.float32, torch.device("cuda")) == ROUNDED_TOLERANCE

    matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert probe_tolerance(torch.float32, torch.device("cuda")) == EXACT_TOLERANCE
    torch.backends.cuda.matmul.allow_tf32 = True  # the older switch alone also means TF32
    assert probe_tolerance(torch.float32, torch.device("cuda")) == ROUNDED_TOLERANCE
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = build_tiny_model("qwen2", seed=14)
    exact.register_forward_hook(_tf32_like_noise(3e-3))
    with pytest.warns(UserWarning, match="ignores the tree mask"):
        assert supports_tree_mask(exact) is False  # the same noise is too much for exact fp32


@pytest.fixture
def new_precision_api():
    """torch 2.9+'s per-backend ``fp32_precision`` settings, restored after the test."""
    backends = (torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn, torch.backends.mkldnn.matmul)
    before = [b.fp32_precision for b in backends]
    yield
    for b, value in zip(backends, before):
        b.fp32_precision = value


def test_torchs_newer_precision_setting_is_read_not_taken_for_a_mask_blind_model(new_precision_api):
    """With ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (torch's recommended form now)
    the older readers raise ("mix of the legacy and new APIs"); raised inside the tree-mask probe it
    read as a model that ignores the mask: trees off, batches decoded a row at a time. gpu_check's
    exact-fp32 block raised too."""
    from rag_lookahead.bench.gpu_sections import environment, exact_fp32

    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert probe_tolerance(torch.float32, torch.device("cuda")) == ROUNDED_TOLERANCE
    assert probe_tolerance(torch.float32, torch.device("cpu")) == EXACT_TOLERANCE
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # oneDNN's bf16 matmuls for fp32 on a CPU
    model = build_tiny_model("qwen2", seed=14)
    model.register_forward_hook(_tf32_like_noise(3e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert supports_tree_mask(model) is True
    assert environment(torch.device("cpu"))["fp32_matmuls_rounded"] is True
    with exact_fp32():
        assert probe_tolerance(torch.float32, torch.device("cuda")) == EXACT_TOLERANCE
    torch.backends.fp32_precision = "tf32"  # devices with no setting of their own read the general one
    assert probe_tolerance(torch.float32, torch.device("mps")) == ROUNDED_TOLERANCE
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the caller's setting is back


# ---------------------------------------------------------------- packed steps


@pytest.mark.parametrize(("implementation", "dtype"), [("sdpa", torch.bool), ("eager", torch.float32)])
def test_packed_steps_give_sdpa_a_boolean_mask(implementation, dtype):
    model = build_tiny_model("llama", attn=implementation, seed=15)
    masks = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            masks.append(kwargs["attention_mask"]) if kwargs.get("attention_mask") is not None else None
        ),
        with_kwargs=True,
    )
    prompts = [[1, 2, 3, 1, 2, 3, 1], [9, 8]]
    ids, mask = left_pad(prompts, 0)
    result = generate(model, ids, mask, max_new_tokens=8, config=LookaheadConfig(budget="fixed"), pad_token_id=0)
    for row, prompt in enumerate(prompts):
        assert result.sequences[row, 7:].tolist() == reference_generate(model, prompt, 8, None)
    step_masks = [m for m in masks if m.dim() == 4]
    assert step_masks and all(m.dtype == dtype for m in step_masks)


def test_host_side_column_counts_match_the_ownership_matrix():
    """Whether a step needs a mask is decided from host counts (no GPU sync); they must stay true."""
    layers = [SimpleNamespace(keys=torch.zeros(2, 1, 4, 1), values=torch.zeros(2, 1, 4, 1))]
    packed = PackedCache()
    packed.append_rows(SimpleNamespace(layers=layers), [4, 2])

    def consistent() -> bool:
        counts = packed.owned.sum(dim=1).tolist()
        return counts == packed._row_columns and packed.hole_free == bool(packed.owned.any(dim=0).all())

    assert consistent() and packed.hole_free
    for layer in packed.cache.layers:
        layer.keys = torch.cat([layer.keys, torch.zeros(1, 1, 3, 1)], dim=2)
        layer.values = torch.cat([layer.values, torch.zeros(1, 1, 3, 1)], dim=2)
    packed.keep_new(6, [0, 2], [0, 1])
    assert consistent() and packed.hole_free
    packed.drop_rows([1])  # one row left: compacted, no holes
    assert consistent() and packed.hole_free and packed.length == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ownership_matrix_and_masks_stay_on_the_gpu():
    model = build_tiny_model("qwen2", seed=16, device="cuda")
    ids, mask = left_pad([[1, 2, 3, 1, 2, 3, 1], [9, 8]], 0)
    batch = DecodeBatch(model, LookaheadConfig(budget="fixed"), frozenset(), None)
    batch.add(ids, mask, None, 8)
    batch.verify_and_accept(batch.propose())
    assert batch.packed.owned.device.type == "cuda"


# ---------------------------------------------------------------- cost curves


def test_cost_curve_key_names_the_hardware_and_the_attention_kernel():
    model = build_tiny_model("qwen2", seed=17)
    model.config._name_or_path = "tiny/qwen2"
    key = _curve_key(model)
    assert cpu_name() in key and "sdpa" in key and "float32" in key
    model.config._attn_implementation = "eager"
    assert _curve_key(model) != key
    eager = _curve_key(model)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1}
    assert _curve_key(model) not in (key, eager)


def test_a_gpu_curve_key_says_its_attention_ran_without_cudnn(monkeypatch):
    """Curves timed before our forwards kept sdpa off cuDNN (slow per-shape plans) must not be reused."""
    from rag_lookahead.decoding import costs

    model = build_tiny_model("qwen2", seed=17)
    model.config._name_or_path = "tiny/qwen2"
    assert "without cudnn" not in _curve_key(model)
    monkeypatch.setattr(costs, "model_devices", lambda m: [torch.device("cuda", 0)])
    monkeypatch.setattr(costs, "device_name", lambda d: "NVIDIA H200")
    assert "sdpa without cudnn" in _curve_key(model)


# ---------------------------------------------------------------- dtype and placement at load


def _fake_gpus(monkeypatch, majors: list[int]) -> None:
    """Pretend CUDA is present with GPUs of these compute-capability majors (7: V100, 7.5: T4, 8: A100)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(majors))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(major=majors[index]))
    monkeypatch.setattr(torch.version, "hip", None)


def test_gpus_without_native_bf16_get_fp16(monkeypatch):
    _fake_gpus(monkeypatch, [7, 8])
    assert models.resolve_dtype(None, "cuda:0", None) == torch.float16
    assert models.resolve_dtype(None, "cuda:1", None) == torch.bfloat16
    assert models.resolve_dtype(None, None, None) == torch.float16  # the current device is cuda:0
    assert models.resolve_dtype(None, None, "auto") == torch.float16  # spread over both: the older one decides
    assert models.resolve_dtype(None, None, {"": 1}) == torch.bfloat16
    assert models.resolve_dtype("bf16", "cuda:0", None) == torch.bfloat16  # asked for: given


def test_gpu_weights_are_loaded_onto_the_gpu_not_moved_there(monkeypatch):
    _fake_gpus(monkeypatch, [8])
    assert models.placement("cuda", None) == {"device_map": {"": torch.device("cuda", 0)}}
    assert models.placement("cuda:0", None) == {"device_map": {"": torch.device("cuda", 0)}}
    assert models.placement("cpu", None) == {}
    assert models.placement("cuda", "auto") == {"device_map": "auto"}
    with pytest.raises(ConfigError, match="only 1 CUDA GPU"):
        models.placement("cuda:1", None)


def test_a_missing_gpu_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        models.load_model("./any-folder", device="cuda")


def _tiny_folder(tmp_path):
    """A tiny model with a word-level tokenizer saved as an ordinary model folder."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(96)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w2", unk_token="w1")
    build_tiny_model("qwen2", seed=18).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_load_model_takes_a_device_map(tmp_path):
    folder = _tiny_folder(tmp_path)
    model, _ = models.load_model(str(folder), dtype="fp32", device_map="cpu")
    assert model.device.type == "cpu" and model.dtype == torch.float32
    plain, _ = models.load_model(str(folder), dtype="fp32", device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


# ---------------------------------------------------------------- the GPU check itself


def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    """What CI runs so the check cannot rot (~15 s of CPU). One thread: the tiny models gain
    nothing from more, and threads that outnumber free cores spin (minutes on a busy machine)."""
    out = tmp_path / "check.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rag_lookahead.bench.gpu_check",
            "--device",
            "cpu",
            "--small",
            "--tiny-only",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["environment"]["device"] == "cpu"
    exact = report["exactness"]
    assert {(r["model"], r["batch"]) for r in exact} == {(a, b) for a in ARCHITECTURES for b in (1, 8)}
    assert all(r["identical"] == r["rows"] for r in exact)
    summary = report["speed_batch1"]["summary"]
    assert {"greedy", "prompt_lookup", "lookahead"} <= set(summary)
    assert summary["greedy"]["identical_to_greedy"] is None  # not compared with itself (it read n/n)
    from rag_lookahead.bench.gpu_check import table_rows

    speed = {case: result for section, case, result, _ in table_rows(report) if section == "speed batch 1"}
    assert "None" not in speed["greedy"] and speed["greedy"].endswith(" prompt lookup")  # "..., None identical"
    assert speed["lookahead"].endswith(f", {summary['lookahead']['identical_to_greedy']} identical")
    summary["lookahead"]["vs_prompt_lookup_decode"] = None  # a baseline that did not run or measured 0 tok/s
    report["concurrency"]["lookahead"]["speedup_vs_hf"] = None
    report["stress"]["packed_vs_row_by_row"] = None
    for section, case, result, _ in table_rows(report):
        assert "None" not in result, (section, case, result)  # they read "xNone"
    assert ", - prompt lookup" in dict((c, r) for s, c, r, _ in table_rows(report) if s == "speed batch 1")["lookahead"]
    assert report["concurrency"]["lookahead"]["identical"] == report["concurrency"]["requests"]
    stress = report["stress"]
    assert stress["rows"] >= 2 and 0 < stress["step_ms_p50"] <= stress["step_ms_p95"]
    assert "GPU check" in run.stdout  # the table was printed


def test_serve_takes_a_device_map():
    from rag_lookahead.serve.command import config_from_args, parse_args

    assert config_from_args(parse_args(["--device-map", "auto"]), {}).device_map == "auto"


def test_an_offloaded_embedding_takes_its_inputs_where_it_runs(tmp_path):
    """accelerate keeps an offloaded module's weight on ``meta`` (a device map's "disk"; "cpu" too
    beside GPUs) and runs it on its hook's device: the inputs went to ``meta`` and ``generate``
    failed ("Tensor.item() cannot be called on meta tensors") where ``model.generate`` ran."""
    from accelerate import dispatch_model

    model = build_tiny_model("qwen2")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    expected = reference_generate(model, prompt, 10, None)
    layout = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu"}
    layout |= {"model.rotary_emb": "cpu", "lm_head": "cpu"}
    dispatch_model(model, device_map=layout, offload_dir=str(tmp_path))
    assert model.get_input_embeddings().weight.device.type == "meta"
    config = LookaheadConfig(budget="fixed")
    out = generate(model, prompt, max_new_tokens=10, config=config, eos_token_id=None, pad_token_id=0)
    assert out.sequences[0, len(prompt) :].tolist() == expected
    from rag_lookahead.bench.methods import run_hf  # the benchmarks' transformers baseline, too

    assert run_hf(model, prompt, 10, None, 0, None).tokens == expected


def test_gpu_check_tiny_only_runs_in_the_dtype_asked_for():
    """``--tiny-only --dtype fp16`` ran the tiny model in fp32 while the report's settings said
    fp16: a check of fp16 that never ran fp16."""
    from rag_lookahead.bench.gpu_check import CheckSettings, Sizes, prepared_workload

    report: dict = {}
    settings = CheckSettings(device="cpu", dtype="bf16", tiny_only=True, small=True)
    workload = prepared_workload(settings, torch.device("cpu"), Sizes.small(), None, report)
    assert workload.model.dtype == torch.bfloat16 and workload.label == "tiny qwen2 bfloat16"
    plain = prepared_workload(CheckSettings(device="cpu", tiny_only=True), torch.device("cpu"), Sizes.small(), None, {})
    assert plain.model.dtype == torch.float32 and plain.label == "tiny qwen2 float32"
    auto = CheckSettings(device="cpu", dtype="auto", tiny_only=True)  # the device's own (it failed: model.to("auto"))
    workload = prepared_workload(auto, torch.device("cpu"), Sizes.small(), None, {})
    assert workload.model.dtype == models.resolve_dtype(None, "cpu", None)
