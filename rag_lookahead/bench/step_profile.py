"""Where a lookahead decode step's time goes, region by region, on a prompt set.

A step is propose (trie lookups, draft building, sizing the drafts to the cost curve) then
verify-and-accept (the step's inputs and tree mask, the model's forward, choosing the accepted
path: the argmax and its copy to the host, and the KV cache compaction that keeps the accepted
columns). This benchmark times each of those regions around the real functions (on a GPU every
region synchronises the device first and last, so time lands where it is spent), and the
forward by the number of tokens it verified. What the regions do not cover is Python: the loop,
the rows' bookkeeping, the drafter's observations.

    python -m rag_lookahead.bench.step_profile --prompts realistic-en --limit 6
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from rag_lookahead.bench.common import (
    DeviceMapOption,
    DeviceOption,
    DtypeOption,
    IdsOption,
    JsonOption,
    ModelOption,
    PromptsOption,
    TrustRemoteCodeOption,
    chains_note,
    chat_ids,
    draft_shape,
    dtype_label,
    fresh_pool_answers,
    print_rows,
    prompts_then_model,
    report_despite_stdout,
    run_command,
    write_report,
)

PROG = "python -m rag_lookahead.bench.step_profile"
#: the regions, in step order: (name, what it is)
REGIONS = (
    ("propose", "trie lookups, draft trees, sizing to the cost curve"),
    ("inputs and mask", "the step's ids, positions and tree mask"),
    ("forward", "the model's forward over the step's tokens"),
    ("accept", "the screened output layer's logits where read, argmax, copy to the host, longest accepted path"),
    ("kv compaction", "keep the accepted columns of the cache"),
)
#: forward sizes are reported in these buckets (tokens verified in one forward)
SIZE_BUCKETS = ((1, 1), (2, 8), (9, 16), (17, 32), (33, 64), (65, 10**9))


def bucket_of(tokens: int) -> str:
    low, high = next(b for b in SIZE_BUCKETS if b[0] <= tokens <= b[1])
    return str(low) if low == high else (f"{low}-{high}" if high < 10**9 else f"{low}+")


class RegionTimer:
    """Seconds and calls per named region; ``device`` (cuda) is synchronised around each region."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(self, name: str | Callable[..., str], fn: Callable) -> Callable:
        """``fn`` timed under ``name`` (or under ``name(*args, **kwargs)``)."""

        @functools.wraps(fn)
        def run(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                key = name(*args, **kwargs) if callable(name) else name
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        return run


@contextmanager
def instrumented(timer: RegionTimer, model) -> Iterator[None]:
    """Time the step's regions around the real functions while inside the block (restored after)."""
    from rag_lookahead.decoding import decode_batch, prefill
    from rag_lookahead.decoding.decode_batch import DecodeBatch

    in_step = [False]
    real_forward, own_forward = model.forward, "forward" in vars(model)

    def forward_name(*args, **kwargs) -> str:
        ids = kwargs.get("input_ids", args[0] if args else None)
        return f"forward {bucket_of(ids.shape[-1])}" if in_step[0] else "prefill forward"

    def step_region(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            in_step[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                in_step[0] = False

        return run

    patches = [
        (DecodeBatch, "propose", timer.timed("propose", DecodeBatch.propose)),
        (DecodeBatch, "verify_and_accept", step_region(timer.timed("step", DecodeBatch.verify_and_accept))),
        (DecodeBatch, "_accept", timer.timed("accept", DecodeBatch._accept)),
        (decode_batch, "keep_accepted", timer.timed("kv compaction", decode_batch.keep_accepted)),
        (prefill, "step_inputs", timer.timed("inputs and mask", prefill.step_inputs)),
        (prefill, "step_mask", timer.timed("inputs and mask", prefill.step_mask)),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    try:
        for owner, attr, wrapped in patches:
            setattr(owner, attr, wrapped)
        model.forward = timer.timed(forward_name, real_forward)
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
        if own_forward:
            model.forward = real_forward
        else:
            del model.forward  # the class's forward again


def breakdown(timer: RegionTimer) -> tuple[list[dict], list[dict]]:
    """(regions per step, forwards by size): ms per step and share of the step time."""
    steps = timer.calls["step"]
    forward = sum(s for k, s in timer.seconds.items() if k.startswith("forward "))
    measured = {
        "propose": timer.seconds["propose"],
        "inputs and mask": timer.seconds["inputs and mask"],
        "forward": forward,
        "accept": timer.seconds["accept"],
        "kv compaction": timer.seconds["kv compaction"],
    }
    total = timer.seconds["step"] + timer.seconds["propose"]
    measured["python and the rest"] = total - sum(measured.values())
    notes = dict(REGIONS) | {"python and the rest": "the loop, rows' bookkeeping, the drafter's observations"}
    regions = [
        {
            "region": name,
            "ms/step": round(1e3 * seconds / max(steps, 1), 2),
            "share": f"{100 * seconds / total:.1f}%" if total else "-",
            "what": notes[name],
        }
        for name, seconds in measured.items()
    ]
    sizes = []
    for low, _ in SIZE_BUCKETS:
        key = f"forward {bucket_of(low)}"
        if timer.calls.get(key):
            sizes.append(
                {
                    "tokens in the forward": bucket_of(low),
                    "forwards": timer.calls[key],
                    "ms each": round(1e3 * timer.seconds[key] / timer.calls[key], 1),
                }
            )
    return regions, sizes


def profile_steps(model, tokenizer, prompts: list[dict], config, max_new_tokens: int) -> tuple[RegionTimer, int, int]:
    """Every prompt decoded by our loop with the step's regions timed, after an untimed warm-up:
    ``(timer, tokens after each answer's first, decode steps)``."""
    from rag_lookahead.decoding.loop import generate
    from rag_lookahead.decoding.verify import input_device

    generate(model, chat_ids(tokenizer, prompts[0]), max_new_tokens=4, config=config)  # warm-up, untimed
    timer = RegionTimer(input_device(model))
    tokens = steps = 0
    with instrumented(timer, model):
        for _, result in fresh_pool_answers(model, tokenizer, prompts, config, max_new_tokens):
            tokens += result.stats.new_tokens - 1
            steps += result.stats.forward_passes
    return timer, tokens, steps


def step_profile(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    prompts: PromptsOption = None,
    ids: IdsOption = None,
    limit: int | None = None,
    max_new_tokens: int = 128,
    json_path: JsonOption = None,
) -> dict:
    """Where a lookahead decode step's time goes, region by region, on a prompt set."""
    chosen, loaded, tokenizer, config, seen = prompts_then_model(
        prompts, ids, limit, max_new_tokens, json_path, model, dtype, device, device_map, trust_remote_code
    )
    with report_despite_stdout(json_path):
        dtype = dtype_label(loaded, dtype)  # what ran, not the option
        timer, tokens, steps = profile_steps(loaded, tokenizer, chosen, config, max_new_tokens)
        regions, sizes = breakdown(timer)
        shape = draft_shape(loaded)
        title = f"{len(chosen)} prompts, {model} {dtype}: {steps} steps, {tokens / max(steps, 1):.2f} tokens a step"
        title += chains_note(shape)
        print_rows(f"where a step's time goes ({title})", regions)
        print_rows("forward by tokens verified", sizes)
        report = {
            "model": model,
            "dtype": dtype,
            "drafts": shape,
            "prompts": len(chosen),
            "steps": steps,
            "tokens": tokens,
        }
        report |= {"regions": regions, "forward_sizes": sizes}
        if json_path:
            write_report(json_path, report, seen=seen)
    return report


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.step_profile [options]``: the report (an exit code for --help)."""
    return run_command(step_profile, argv, PROG)


if __name__ == "__main__":
    main()
