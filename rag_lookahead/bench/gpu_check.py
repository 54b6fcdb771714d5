"""One command that says whether rag_lookahead works on this machine's accelerator, and how fast.

    python -m rag_lookahead.bench.gpu_check --json gpu_check.json         # on a GPU: every section, a few minutes
    python -m rag_lookahead.bench.gpu_check --device cpu --small --tiny-only --json out.json   # what CI runs

Sections (each runs on its own: one that fails is reported and the others still run):
  environment  device name and memory, native bf16, TF32 switches, attention kernels installed
  exactness    fp32 with TF32 off: tiny random models of five architectures (and the default
               model unless --small/--tiny-only) at batch 1 and as a left-padded batch of 8,
               token-identical to transformers' greedy decoding of each prompt alone
  speed        batch 1 in --dtype: transformers greedy, its prompt lookup, lookahead
  concurrency  16 requests at once: transformers batched greedy vs our continuous batching
  stress       16 rows x 4k-token prompts decoded together: step time p50/p95, peak memory,
               and the same prompts one row at a time for comparison

Prints one table and writes the figures as JSON; exits 1 when an output differs where it must
not (fp32 exactness) or a section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rag_lookahead.atomic import write_json_atomic
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import device_name, model_devices, synchronize
from rag_lookahead.decoding.loop import DecodeBatch, generate, left_pad
from rag_lookahead.decoding.verify import input_device, supports_tree_mask
from rag_lookahead.tiny import ARCHITECTURES, VOCAB, build_tiny_model

TINY_PAD = 0


@dataclass(frozen=True)
class Sizes:
    """How much each section does: the full check, or ``--small`` (CI on a CPU)."""

    exact_prompts: int = 8  # per architecture; the batch of 8 takes the same prompts together
    exact_new_tokens: int = 32
    speed_prompts: int = 8
    speed_new_tokens: int = 128
    requests: int = 16  # concurrency: requests, all in flight at once
    concurrency_new_tokens: int = 96
    stress_rows: int = 16
    stress_context: int = 4096
    stress_new_tokens: int = 32

    @classmethod
    def small(cls) -> Sizes:
        return cls(
            exact_prompts=8,
            exact_new_tokens=12,
            speed_prompts=1,
            speed_new_tokens=16,
            requests=3,
            concurrency_new_tokens=12,
            stress_rows=3,
            stress_context=160,
            stress_new_tokens=8,
        )


# ---------------------------------------------------------------- environment


def environment(device: torch.device) -> dict[str, Any]:
    """What the results depend on: versions, the device and its capabilities, the matmul switches."""
    import transformers

    from rag_lookahead.models import _cuda_has_native_bf16

    report: dict[str, Any] = {
        "device": str(device),
        "device_name": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "kernels_installed": importlib.util.find_spec("kernels") is not None,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        report.update(
            gpus=torch.cuda.device_count(),
            compute_capability=f"{properties.major}.{properties.minor}",
            memory_gb=round(properties.total_memory / 2**30, 1),
            native_bf16=_cuda_has_native_bf16(device),
        )
    return report


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls at full precision (TF32 off) inside, the caller's settings restored after."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


# ---------------------------------------------------------------- prompts


def synthetic_prompts(count: int, length: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """Token prompts for the tiny models: a short random phrase repeated with changes, so that
    drafts from the prompt are sometimes right and sometimes wrong. Lengths vary (left padding)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        phrase = torch.randint(1, vocab, (8,), generator=generator).tolist()
        size = max(4, length - 3 * (i % 4))
        tokens = [phrase[j % 8] for j in range(size)]
        for position in torch.randint(0, size, (size // 6,), generator=generator).tolist():
            tokens[position] = int(torch.randint(1, vocab, (1,), generator=generator))
        prompts.append(tokens)
    return prompts


def long_prompts(tokenizer, prompts: list[dict], rows: int, length: int) -> list[list[int]]:
    """``rows`` chat prompts of about ``length`` tokens: the bundled passages, rotated per row, as context."""
    from rag_lookahead.bench.single import chat_ids

    passage = tokenizer.encode("\n\n".join(p["context"] for p in prompts), add_special_tokens=False)
    room = max(length - 96, 16)  # the chat template and the question take the rest
    result = []
    for r in range(rows):
        start = r * len(passage) // rows
        tokens = (passage[start:] + passage) * (room // len(passage) + 2)
        text = tokenizer.decode(tokens[:room])
        result.append(chat_ids(tokenizer, {"context": text, "question": prompts[r % len(prompts)]["question"]}))
    return result


# ---------------------------------------------------------------- exactness


def cut_at_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: Sequence[int], pad: int) -> list[int]:
    """transformers' greedy decoding of one unpadded prompt: the reference every output must equal."""
    ids = torch.tensor([prompt], device=input_device(model))
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos) or None,
        pad_token_id=pad,
    )
    return cut_at_eos(out[0, len(prompt) :].tolist(), eos)


def check_exact(
    model,
    name: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: Sequence[int],
    pad: int,
    config: LookaheadConfig,
) -> list[dict]:
    """Batch 1 and a left-padded batch of all ``prompts``, each row against transformers' greedy of it alone.

    Each row's context pool is also seeded with the first half of its reference answer, so deep
    trees are drafted and partly accepted, and the rest is drafted from the prompt.
    """
    references = [hf_greedy(model, p, max_new_tokens, eos, pad) for p in prompts]
    seeds = [[p + r[: len(r) // 2]] for p, r in zip(prompts, references)]
    eos_ids = list(eos) or None
    single = []
    accepted = []
    for prompt, seed in zip(prompts, seeds):
        result = generate(
            model,
            prompt,
            max_new_tokens=max_new_tokens,
            config=config,
            references=[seed],
            eos_token_id=eos_ids,
            pad_token_id=pad,
        )
        single.append(cut_at_eos(result.sequences[0, len(prompt) :].tolist(), eos))
        accepted.append(result.stats.mean_accepted)
    ids, mask = left_pad(prompts, pad)
    result = generate(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        config=config,
        references=seeds,
        eos_token_id=eos_ids,
        pad_token_id=pad,
    )
    batched = [cut_at_eos(result.sequences[r, ids.shape[1] :].tolist(), eos) for r in range(len(prompts))]
    tree = supports_tree_mask(model)
    return [
        {
            "model": name,
            "batch": 1,
            "rows": len(prompts),
            "identical": sum(a == b for a, b in zip(single, references)),
            "mean_accepted": round(statistics.mean(accepted), 3),
            "tree_mask": tree,
        },
        {
            "model": name,
            "batch": len(prompts),
            "rows": len(prompts),
            "identical": sum(a == b for a, b in zip(batched, references)),
            "mean_accepted": round(result.stats.mean_accepted, 3),
            "tree_mask": tree,
        },
    ]


def exactness_tiny(device: torch.device, sizes: Sizes, attn: str) -> list[dict]:
    rows = []
    with exact_fp32():
        for seed, arch in enumerate(ARCHITECTURES):
            model = build_tiny_model(arch, attn, seed=seed, device=device)
            prompts = synthetic_prompts(sizes.exact_prompts, 24, seed=100 + seed)
            rows += check_exact(
                model, arch, prompts, sizes.exact_new_tokens, (), TINY_PAD, LookaheadConfig(budget="fixed")
            )
    return rows


def exactness_model(load: Callable[..., tuple[Any, Any]], name: str, prompts: list[dict], sizes: Sizes) -> list[dict]:
    from rag_lookahead.bench.single import chat_ids

    with exact_fp32():
        model, tokenizer = load(dtype=torch.float32)
        eos, pad = _eos_pad(model)
        ids = [chat_ids(tokenizer, p) for p in prompts[: sizes.exact_prompts]]
        config = LookaheadConfig(budget="fixed").with_tokenizer(tokenizer)
        rows = check_exact(model, name, ids, sizes.exact_new_tokens, eos, pad, config)
    devices = model_devices(model)
    del model, tokenizer
    _empty_cache(devices)  # room for the model in --dtype
    return rows


# ---------------------------------------------------------------- speed, concurrency, stress


def speed_batch1(
    model, prompts: list[list[int]], max_new_tokens: int, eos: list[int], pad: int, config: LookaheadConfig
) -> dict:
    """Batch-1 decode speed of transformers greedy, its prompt lookup and lookahead, prompt by prompt."""
    from rag_lookahead.bench.single import MethodTotals, run_hf, run_lookahead, summarize

    runners = {
        "greedy": lambda ids: run_hf(model, ids, max_new_tokens, eos, pad, None),
        "prompt_lookup": lambda ids: run_hf(model, ids, max_new_tokens, eos, pad, 10),
        "lookahead": lambda ids: run_lookahead(model, ids, max_new_tokens, eos, pad, config),
    }
    for run in runners.values():  # warm-up: kernels, and the verify cost curve
        run(prompts[0])
    totals = {method: MethodTotals() for method in runners}
    for ids in prompts:
        runs = {method: run(ids) for method, run in runners.items()}
        reference = cut_at_eos(runs["greedy"].tokens, eos)
        for method, result in runs.items():
            totals[method].add(result, cut_at_eos(result.tokens, eos) == reference)
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "summary": summarize(totals)}


@torch.inference_mode()
def hf_batched(model, requests: list[list[int]], max_new_tokens: int, eos: list[int], pad: int) -> list[list[int]]:
    """transformers batched greedy: all requests as one left-padded batch, built on the model's input device."""
    ids, mask = left_pad(requests, pad, input_device(model))
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=pad,
    )
    return [cut_at_eos(out[r, ids.shape[1] :].tolist(), eos) for r in range(len(requests))]


def concurrency(
    model, requests: list[list[int]], max_new_tokens: int, eos: list[int], pad: int, config: LookaheadConfig
) -> dict:
    """All requests in flight at once: transformers batched greedy against our continuous batching."""
    from rag_lookahead.bench.batch import run_continuous

    hf_batched(model, requests[:2], 4, eos, pad)  # warm-up
    run_continuous(model, requests[:2], 2, 4, eos, pad, config)
    report: dict[str, Any] = {"requests": len(requests), "max_new_tokens": max_new_tokens}
    synchronize(model)
    start = time.perf_counter()
    reference = hf_batched(model, requests, max_new_tokens, eos, pad)
    synchronize(model)
    seconds = time.perf_counter() - start
    report["hf_batched"] = {
        "tokens_per_second": round(sum(map(len, reference)) / seconds, 2),
        "seconds": round(seconds, 3),
    }
    # packed rows are kept apart only by the mask: a mask-blind model decodes one request at a time, as the server does
    level = len(requests) if supports_tree_mask(model) else 1
    report["our_concurrency"] = level
    for method, enabled in (("plain", False), ("lookahead", True)):
        start = time.perf_counter()
        outputs, _, accepted = run_continuous(
            model, requests, level, max_new_tokens, eos, pad, config.replace(enabled=enabled)
        )
        synchronize(model)
        seconds = time.perf_counter() - start
        tokens = sum(map(len, outputs))
        report[method] = {
            "tokens_per_second": round(tokens / seconds, 2),
            "seconds": round(seconds, 3),
            "speedup_vs_hf": round(tokens / seconds / report["hf_batched"]["tokens_per_second"], 3),
            "identical": sum(cut_at_eos(o, eos) == r for o, r in zip(outputs, reference)),
            "mean_accepted": round(accepted, 3) if accepted else None,
        }
    return report


def decode_steps(
    model, prompts: list[list[int]], max_new_tokens: int, pad: int, config: LookaheadConfig, admit: int = 4
) -> dict:
    """Decode ``prompts`` together (admitted ``admit`` at a time) to the end; time every step."""
    batch = DecodeBatch(model, config, frozenset(), None)  # no EOS: every row runs its full length
    start = time.perf_counter()
    for first in range(0, len(prompts), admit):
        ids, mask = left_pad(prompts[first : first + admit], pad)
        batch.add(ids, mask, None, max_new_tokens)
    synchronize(model)
    prefill = time.perf_counter() - start
    steps, tokens = [], 0
    start = time.perf_counter()
    while True:
        batch.finish()
        if not batch.rows:
            break
        tick = time.perf_counter()
        gained = batch.verify_and_accept(batch.propose())
        synchronize(model)
        steps.append(time.perf_counter() - tick)
        tokens += sum(map(len, gained))
    seconds = time.perf_counter() - start
    ordered = sorted(steps)
    return {
        "rows": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "prefill_s": round(prefill, 3),
        "steps": len(steps),
        "step_ms_p50": round(1e3 * statistics.median(ordered), 3),
        "step_ms_p95": round(1e3 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
        "decode_tokens_per_second": round(tokens / seconds, 2) if seconds else None,
    }


def stress(model, prompts: list[list[int]], max_new_tokens: int, pad: int, config: LookaheadConfig) -> dict:
    """Every long prompt in one packed batch (step times, peak memory), then the same prompts one
    at a time: whether packing pays over row-by-row decoding at this size on this device."""
    if not supports_tree_mask(model):
        return {
            "skipped": "attention is mask-blind: rows cannot be packed, so they decode one at a time (see concurrency)"
        }
    devices = [d for d in model_devices(model) if d.type == "cuda"]
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    report = decode_steps(model, prompts, max_new_tokens, pad, config)
    if devices:
        report["peak_gpu_memory_gb"] = round(sum(torch.cuda.max_memory_allocated(d) for d in devices) / 2**30, 3)
    else:  # the process's peak resident memory (Linux: KiB)
        report["peak_host_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    alone = [decode_steps(model, [p], max_new_tokens, pad, config) for p in prompts[:2]]
    report["one_row_step_ms_p50"] = round(statistics.mean(a["step_ms_p50"] for a in alone), 3)
    one_row = statistics.mean(a["decode_tokens_per_second"] or 0.0 for a in alone)
    report["one_row_tokens_per_second"] = round(one_row, 2)
    if one_row:
        report["packed_vs_row_by_row"] = round(report["decode_tokens_per_second"] / one_row, 3)
    return report


# ---------------------------------------------------------------- running it all


def _eos_pad(model) -> tuple[list[int], int]:
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = model.generation_config.pad_token_id
    return eos, (eos[0] if pad is None and eos else pad if pad is not None else 0)


def _empty_cache(devices: list[torch.device]) -> None:
    """Hand the GPU memory of tensors no longer referenced back to the driver."""
    for device in devices:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.empty_cache()


def _section(report: dict, name: str, run: Callable[[], Any]) -> None:
    """Run one section into ``report[name]``; a failure is recorded (one line and a traceback) and the check goes on."""
    print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        report[name] = run()
    except Exception as err:  # report it and go on: a first GPU run should say as much as it can
        report[name] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
        traceback.print_exc(file=sys.stderr)
    report.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
    print(f"gpu_check: {name} done in {report['section_seconds'][name]} s", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rag_lookahead.bench.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument(
        "--device-map",
        default=None,
        help='for the real model: handed to from_pretrained, e.g. "auto" (spreads it over all GPUs)',
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="speed, concurrency and stress: bf16, fp16, fp32 (default: bf16 where native, else fp16; CPU: bf16 where fast)",
    )
    parser.add_argument(
        "--attn",
        default="sdpa",
        help="attn_implementation: sdpa, eager, flash_attention_2 (refused tree masks: chains)",
    )
    parser.add_argument("--model", default="default", help='"default" (embedded), a hub id or a local folder')
    parser.add_argument("--small", action="store_true", help="small sizes (CI on a CPU)")
    parser.add_argument(
        "--tiny-only", action="store_true", help="only the tiny random models (no download, no conversion)"
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")
    return parser


def run_check(args: argparse.Namespace) -> dict:
    from rag_lookahead.models import _resolve_device, load_model

    device = _resolve_device(args.device)
    sizes = Sizes.small() if args.small else Sizes()
    report: dict[str, Any] = {
        "settings": {**{k: v for k, v in vars(args).items() if k != "json_path"}, "sizes": asdict(sizes)}
    }
    started = time.perf_counter()
    _section(report, "environment", lambda: environment(device))
    _section(report, "exactness", lambda: exactness_tiny(device, sizes, args.attn))

    def load(dtype=None):
        return load_model(
            args.model,
            dtype=dtype if dtype is not None else args.dtype,
            device=device,
            device_map=args.device_map,
            attn_implementation=args.attn,
        )

    if not (args.small or args.tiny_only):
        from rag_lookahead.bench.single import load_prompts

        _section(report, "exactness_model", lambda: exactness_model(load, args.model, load_prompts(None), sizes))

    model, workload = _workload(args, device, sizes, load, report)
    if model is not None:
        _section(
            report,
            "speed_batch1",
            lambda: speed_batch1(
                model, workload["speed"], sizes.speed_new_tokens, *workload["eos_pad"], workload["config"]
            ),
        )
        _section(
            report,
            "concurrency",
            lambda: concurrency(
                model, workload["requests"], sizes.concurrency_new_tokens, *workload["eos_pad"], workload["config"]
            ),
        )
        _section(
            report,
            "stress",
            lambda: stress(
                workload["stress_model"],
                workload["stress"],
                sizes.stress_new_tokens,
                workload["eos_pad"][1],
                workload["config"],
            ),
        )
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["ok"] = _all_ok(report)
    return report


def _workload(args, device: torch.device, sizes: Sizes, load, report: dict) -> tuple[Any, dict]:
    """The model (in --dtype) and prompts for the timed sections: the real model and the bundled
    prompts, or with --tiny-only a tiny qwen2 and synthetic prompts."""
    workload: dict[str, Any] = {}

    def prepare():
        if args.tiny_only:
            stress_positions = sizes.stress_context + sizes.stress_new_tokens + 64
            model = build_tiny_model(
                "qwen2", args.attn, seed=7, device=device, max_positions=max(256, stress_positions)
            )
            workload.update(
                speed=synthetic_prompts(sizes.speed_prompts, 48, seed=1),
                requests=synthetic_prompts(sizes.requests, 40, seed=2),
                stress=synthetic_prompts(sizes.stress_rows, sizes.stress_context, seed=3),
                stress_model=model,
                eos_pad=([], TINY_PAD),
                config=LookaheadConfig(),
            )
            return model, "tiny qwen2 fp32"
        from rag_lookahead.bench.single import chat_ids, load_prompts

        model, tokenizer = load()
        prompts = load_prompts(None)
        chats = [chat_ids(tokenizer, p) for p in prompts]
        workload.update(
            speed=chats[: sizes.speed_prompts],
            requests=[chats[i % len(chats)] for i in range(sizes.requests)],
            stress=long_prompts(tokenizer, prompts, sizes.stress_rows, sizes.stress_context),
            stress_model=model,
            eos_pad=_eos_pad(model),
            config=LookaheadConfig().with_tokenizer(tokenizer),
        )
        return model, f"{args.model} {model.dtype}".replace("torch.", "")

    loaded: list = []
    _section(report, "model", lambda: loaded.append(prepare()) or _model_report(*loaded[0]))
    return (loaded[0][0], workload) if loaded else (None, workload)


def _model_report(model, label: str) -> dict:
    return {
        "label": label,
        "attn_implementation": model.config._attn_implementation,
        "tree_mask": supports_tree_mask(model),
        "devices": [str(d) for d in model_devices(model)],
        "device_map": getattr(model, "hf_device_map", None),
    }


def _all_ok(report: dict) -> bool:
    """No section failed, and every fp32 row equals transformers' greedy (the tiny models at least ran)."""
    failed = any(isinstance(v, dict) and "error" in v for v in report.values())
    rows = _exact_rows(report)
    return not failed and bool(rows) and all(r["identical"] == r["rows"] for r in rows)


def _exact_rows(report: dict) -> list[dict]:
    return [r for name in ("exactness", "exactness_model") if isinstance(report.get(name), list) for r in report[name]]


def print_table(report: dict) -> None:
    """One table: a line per figure that matters."""
    from rich.console import Console
    from rich.table import Table

    env = report.get("environment", {})
    table = Table(title=f"GPU check: {env.get('device', '?')} ({env.get('device_name', '?')}), {report['seconds']} s")
    for column in ("section", "case", "result", "ok"):
        table.add_column(column)
    for section, case, result, ok in _table_rows(report):
        table.add_row(section, case, result, {True: "yes", False: "NO", None: ""}[ok])
    Console(width=160).print(table)


def _table_rows(report: dict) -> Iterator[tuple[str, str, str, bool | None]]:
    env = report.get("environment", {})
    if "error" not in env:
        extra = (
            f", capability {env['compute_capability']}, {env['memory_gb']} GB, native bf16 {env['native_bf16']}"
            if "compute_capability" in env
            else ""
        )
        yield (
            "environment",
            f"torch {env['torch']}, transformers {env['transformers']}",
            f"TF32 {env['cuda_matmul_allow_tf32']}, flash_attn {env['flash_attn_installed']}{extra}",
            None,
        )
    for name in ("environment", "exactness", "exactness_model", "model", "speed_batch1", "concurrency", "stress"):
        value = report.get(name)
        if isinstance(value, dict) and "error" in value:
            yield name, "failed", value["error"], False
    for r in _exact_rows(report):
        yield (
            "exactness fp32",
            f"{r['model']} batch {r['batch']}",
            f"{r['identical']}/{r['rows']} identical, mean accepted {r['mean_accepted']}, tree mask {r['tree_mask']}",
            r["identical"] == r["rows"],
        )
    model = report.get("model", {})
    if "label" in model:
        yield (
            "model",
            model["label"],
            f"attention {model['attn_implementation']}, tree mask {model['tree_mask']}, on {', '.join(model['devices'])}",
            None,
        )
    speed = report.get("speed_batch1", {})
    for method, s in speed.get("summary", {}).items():
        yield (
            "speed batch 1",
            method,
            f"{s['decode_tokens_per_second']} tok/s decode, x{s['speedup_decode']} greedy, x{s['vs_prompt_lookup_decode']} prompt lookup, {s['identical_to_greedy']} identical",
            None,
        )
    conc = report.get("concurrency", {})
    if "hf_batched" in conc:
        yield (
            f"concurrency {conc['requests']}",
            "hf batched greedy",
            f"{conc['hf_batched']['tokens_per_second']} tok/s",
            None,
        )
        for method in ("plain", "lookahead"):
            c = conc[method]
            yield (
                f"concurrency {conc['requests']}",
                method,
                f"{c['tokens_per_second']} tok/s, x{c['speedup_vs_hf']} hf, {c['identical']}/{conc['requests']} identical to hf, mean accepted {c['mean_accepted']}",
                None,
            )
    st = report.get("stress", {})
    if "skipped" in st:
        yield "stress", "skipped", st["skipped"], None
    if "steps" in st:
        memory = (
            f"peak GPU {st['peak_gpu_memory_gb']} GB"
            if "peak_gpu_memory_gb" in st
            else f"peak host RSS {st['peak_host_rss_gb']} GB"
        )
        yield (
            "stress",
            f"{st['rows']} rows, {st['prompt_tokens']} prompt tokens",
            f"step p50 {st['step_ms_p50']} ms, p95 {st['step_ms_p95']} ms, {memory}, {st['decode_tokens_per_second']} tok/s",
            None,
        )
        yield (
            "stress",
            "one row alone",
            f"step p50 {st['one_row_step_ms_p50']} ms, {st['one_row_tokens_per_second']} tok/s, packed/row-by-row x{st.get('packed_vs_row_by_row')}",
            None,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check, print the table, write the JSON; 0 when everything held, else 1."""
    args = build_parser().parse_args(argv)
    report = run_check(args)
    print_table(report)
    if args.json_path:
        write_json_atomic(args.json_path, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
