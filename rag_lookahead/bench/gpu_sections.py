"""The GPU check's sections: environment, fp32 exactness, batch-1 speed, concurrency, stress.

Each section is a function that returns its figures as a dict (or rows); :mod:`.gpu_check` runs
them one by one, records a failing one and goes on, and prints the table.
"""

from __future__ import annotations

import contextlib
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_lookahead.bench.common import chat_ids, cut_at_eos, eos_pad, hf_batched, in_turn, peak_rss_gb
from rag_lookahead.bench.percentile import nearest_rank
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import device_name, model_devices, synchronize
from rag_lookahead.decoding.loop import DecodeBatch, generate, left_pad
from rag_lookahead.decoding.verify import fp32_matmuls_rounded, supports_tree_mask
from rag_lookahead.tiny import ARCHITECTURES, VOCAB, build_tiny_model

TINY_PAD = 0  # the tiny random models have no tokenizer: no EOS, and this pad id


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
        "fp32_matmuls_rounded": fp32_matmuls_rounded(device),  # TF32 (or bf16) matmuls in fp32
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
    """fp32 matmuls at full precision (TF32 off) inside, the caller's settings restored after.

    torch 2.9+ keeps them per backend (``fp32_precision``) and raises on the older readers
    (``allow_tf32``) once a caller used that: set and restore them there where they exist."""
    backends = [torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn]
    backends += [b for b in (getattr(torch.backends.mkldnn, "matmul", None),) if b is not None]
    if all(hasattr(b, "fp32_precision") for b in backends):
        saved_new = [b.fp32_precision for b in backends]
        for b in backends:
            b.fp32_precision = "ieee"
        try:
            yield
        finally:
            for b, value in zip(backends, saved_new):
                b.fp32_precision = value
        return
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
    references = [hf_batched(model, [p], max_new_tokens, eos, pad)[0] for p in prompts]
    seeds = [[p + r[: len(r) // 2]] for p, r in zip(prompts, references)]
    decode = {
        "max_new_tokens": max_new_tokens,
        "config": config,
        "eos_token_id": list(eos) or None,
        "pad_token_id": pad,
        "repetition_penalty": 1.0,  # plain greedy, as hf_batched decodes
    }
    single = []
    accepted = []
    for prompt, seed in zip(prompts, seeds):
        result = generate(model, prompt, references=[seed], **decode)
        single.append(cut_at_eos(result.sequences[0, len(prompt) :].tolist(), eos))
        accepted.append(result.stats.mean_accepted)
    ids, mask = left_pad(prompts, pad)
    result = generate(model, ids, mask, references=seeds, **decode)
    batched = [cut_at_eos(result.sequences[r, ids.shape[1] :].tolist(), eos) for r in range(len(prompts))]
    tree = supports_tree_mask(model)

    def row(batch: int, outputs: list[list[int]], mean_accepted: float) -> dict:
        identical = sum(a == b for a, b in zip(outputs, references))
        return {
            "model": name,
            "batch": batch,
            "rows": len(prompts),
            "identical": identical,
            "mean_accepted": round(mean_accepted, 3),
            "tree_mask": tree,
        }

    return [row(1, single, statistics.mean(accepted)), row(len(prompts), batched, result.stats.mean_accepted)]


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
    with exact_fp32():
        model, tokenizer = load(dtype=torch.float32)
        eos, pad = eos_pad(model, tokenizer)
        ids = [chat_ids(tokenizer, p) for p in prompts[: sizes.exact_prompts]]
        config = LookaheadConfig(budget="fixed").with_tokenizer(tokenizer)
        rows = check_exact(model, name, ids, sizes.exact_new_tokens, eos, pad, config)
    devices = model_devices(model)
    del model, tokenizer
    empty_cache(devices)  # room for the model in --dtype
    return rows


# ---------------------------------------------------------------- speed, concurrency, stress


def speed_batch1(
    model, prompts: list[list[int]], max_new_tokens: int, eos: list[int], pad: int, config: LookaheadConfig
) -> dict:
    """Batch-1 decode speed of transformers greedy, its prompt lookup and lookahead, prompt by prompt."""
    from rag_lookahead.bench.common import fresh_acceptance
    from rag_lookahead.bench.methods import PROMPT_LOOKUP_TOKENS, MethodTotals, run_hf, run_lookahead, summarize

    def lookahead(ids):
        with fresh_acceptance(model):  # every run from the same prior, as `bench` runs it
            return run_lookahead(model, ids, max_new_tokens, eos, pad, config)

    runners = {
        "greedy": lambda ids: run_hf(model, ids, max_new_tokens, eos, pad, None),
        "prompt_lookup": lambda ids: run_hf(model, ids, max_new_tokens, eos, pad, PROMPT_LOOKUP_TOKENS),
        "lookahead": lookahead,
    }
    for run in runners.values():  # warm-up: kernels, and the verify cost curve
        run(prompts[0])
    totals = {method: MethodTotals() for method in runners}
    for n, ids in enumerate(prompts):
        runs = in_turn(list(runners), n, lambda method, prompt: runners[method](prompt), ids)  # none always first
        reference = cut_at_eos(runs["greedy"].tokens, eos)
        for method, result in runs.items():  # greedy is not compared with itself
            totals[method].add(result, None if method == "greedy" else cut_at_eos(result.tokens, eos) == reference)
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "summary": summarize(totals)}


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
        batch.retire()
        if not batch.rows:
            break
        tick = time.perf_counter()
        gained = batch.verify_and_accept(batch.propose())
        batch.raise_row_failure()
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
        "step_ms_p95": round(1e3 * nearest_rank(ordered, 0.95), 3),
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
    else:
        report["peak_host_rss_gb"] = round(peak_rss_gb(), 3)
    alone = [decode_steps(model, [p], max_new_tokens, pad, config) for p in prompts[:2]]
    report["one_row_step_ms_p50"] = round(statistics.mean(a["step_ms_p50"] for a in alone), 3)
    one_row = statistics.mean(a["decode_tokens_per_second"] or 0.0 for a in alone)
    report["one_row_tokens_per_second"] = round(one_row, 2)
    if one_row:
        report["packed_vs_row_by_row"] = round(report["decode_tokens_per_second"] / one_row, 3)
    return report


def empty_cache(devices: list[torch.device]) -> None:
    """Hand the GPU memory of tensors no longer referenced back to the driver."""
    for device in devices:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
