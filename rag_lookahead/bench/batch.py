"""Throughput benchmark: many requests at once, batched.

The same requests go through (a) transformers batched greedy ``generate`` with left padding, in
static waves of ``concurrency`` requests, (b) our engine with drafting off and (c) with drafting
on, both keeping ``concurrency`` requests in flight (a finished request's slot is refilled at
once, as in the server). Reports requests/s, tokens/s, p50/p95 latency (from a request's start
to its last token) and whether every output equals the single-request greedy output.

    python -m rag_lookahead.bench.batch --concurrency 1,4,16 --requests 16 --json batch.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rag_lookahead.atomic import write_json_atomic
from rag_lookahead.bench.single import (
    _print_rows,
    add_depth_arguments,
    add_model_arguments,
    chat_ids,
    copied_fraction,
    cut_at_eos,
    extra_depth_methods,
    load_bench_model,
    load_prompts,
)
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.loop import DecodeBatch, left_pad
from rag_lookahead.decoding.verify import input_device


def run_hf_waves(model, requests, level, max_new_tokens, eos, pad):
    """transformers: padded static batches of ``level`` requests; a wave returns all rows together."""
    outputs, latencies = [], []
    for first in range(0, len(requests), level):
        rows = requests[first : first + level]
        ids, mask = left_pad(rows, pad, input_device(model))
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=sorted(eos),
                pad_token_id=pad,
            )
        seconds = time.perf_counter() - start
        outputs += [cut_at_eos(out[r, ids.shape[1] :].tolist(), eos) for r in range(len(rows))]
        latencies += [seconds] * len(rows)
    return outputs, latencies, None


def run_continuous(model, requests, level, max_new_tokens, eos, pad, config):
    """Our engine: at most ``level`` rows decode together; a finished row's slot goes to the next
    request at once (continuous batching, as the server does). Latency: admission to last token."""
    batch = DecodeBatch(model, config, frozenset(eos), None)  # requests repeat: no pool of earlier answers
    waiting = list(enumerate(requests))
    outputs: dict[int, list[int]] = {}
    admitted: dict[int, float] = {}
    latencies: dict[int, float] = {}
    row_steps = gained = 0
    while waiting or batch.rows:
        for row in batch.finish():
            outputs[row.index] = row.generated
            latencies[row.index] = time.perf_counter() - admitted[row.index]
        free = level - len(batch.rows)
        if waiting and free > 0:
            joining, waiting = waiting[:free], waiting[free:]
            ids, mask = left_pad([r for _, r in joining], pad)
            for key, _ in joining:
                admitted[key] = time.perf_counter()
            batch.add(ids, mask, None, max_new_tokens, keys=[key for key, _ in joining])
            continue  # a prefill's first token may already finish a row
        if batch.rows:
            new = batch.verify_and_accept(batch.propose())
            row_steps += len(new)
            gained += sum(len(t) for t in new)
    ordered = [outputs[i] for i in range(len(requests))]
    return ordered, [latencies[i] for i in range(len(requests))], gained / row_steps if row_steps else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m rag_lookahead.bench.batch", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--ids", default=None, help="use only these prompt ids (comma-separated)")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level (prompts cycled)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--methods", default="hf_greedy,plain,lookahead")
    add_depth_arguments(parser)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over all levels and methods (timing drifts: compare within a pass)",
    )
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)

    model, tokenizer = load_bench_model(args)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    pad = model.generation_config.pad_token_id
    pad = min(eos) if pad is None else pad
    config = LookaheadConfig(branch_length=args.branch_length).with_tokenizer(tokenizer)
    prompts = load_prompts(args.prompts, args.ids)
    requests = [chat_ids(tokenizer, prompts[i % len(prompts)]) for i in range(args.requests)]
    contexts = [
        tokenizer.encode(prompts[i % len(prompts)]["context"], add_special_tokens=False) for i in range(args.requests)
    ]
    methods = [m for m in args.methods.split(",") if m]
    depths = extra_depth_methods(parser, args)
    unknown = set(methods) - {"hf_greedy", "plain", "lookahead"}
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))} (choose from hf_greedy, plain, lookahead)")
    methods += list(depths)
    levels = [int(c) for c in args.concurrency.split(",")]

    run_continuous(model, requests[:2], 2, 8, eos, pad, config)  # warm-up and cost curve
    run_hf_waves(model, requests[:2], 2, 8, eos, pad)
    single = {}
    results = []
    for repeat, level in ((r, c) for r in range(args.repeats) for c in levels):
        for method in methods:
            start = time.perf_counter()
            if method == "hf_greedy":
                outputs, latencies, accepted = run_hf_waves(model, requests, level, args.max_new_tokens, eos, pad)
            else:
                method_config = config.replace(
                    enabled=method != "plain", branch_length=depths.get(method, config.branch_length)
                )
                outputs, latencies, accepted = run_continuous(
                    model, requests, level, args.max_new_tokens, eos, pad, method_config
                )
            tokens = sum(len(o) for o in outputs)
            seconds = time.perf_counter() - start
            if level == 1 and method == methods[0] and not single:
                single = {i: o for i, o in enumerate(outputs)}
            identical = sum(o == single.get(i) for i, o in enumerate(outputs)) if single else None
            lat = sorted(latencies)
            row = {
                "pass": repeat,
                "concurrency": level,
                "method": method,
                "requests_per_second": round(len(requests) / seconds, 4),
                "tokens_per_second": round(tokens / seconds, 3),
                "p50_latency_s": round(statistics.median(lat), 3),
                "p95_latency_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3),
                "identical_to_single": f"{identical}/{len(outputs)}" if identical is not None else "-",
                "mean_accepted": round(accepted, 3) if accepted else "-",
            }
            results.append(row)
            print(row, flush=True)
    for r in results:
        base = next(
            (
                b
                for b in results
                if (b["pass"], b["concurrency"], b["method"]) == (r["pass"], r["concurrency"], "hf_greedy")
            ),
            None,
        )
        if base:
            r["speedup_vs_hf"] = round(r["tokens_per_second"] / base["tokens_per_second"], 3)
    copied = [copied_fraction(single[i], contexts[i]) for i in single]
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "requests": len(requests),
        "prompt_ids": sorted({p.get("id") for p in prompts}),
        "mean_copied_from_context": round(statistics.mean(copied), 3) if copied else None,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
    }
    share = f", {report['mean_copied_from_context']:.0%} of answer tokens copied from the context" if copied else ""
    _print_rows(f"{args.model} {args.dtype}, {len(requests)} requests at each concurrency{share}", results)
    if args.json_path:
        write_json_atomic(args.json_path, report)
    return report


if __name__ == "__main__":
    main()
