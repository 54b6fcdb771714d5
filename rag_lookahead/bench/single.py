"""Side-by-side benchmark: transformers greedy, transformers prompt lookup, and lookahead.

Same model, same prompts, one process, methods interleaved prompt by prompt so that machine
noise hits all of them alike. Reports end-to-end and decode-only (after the first token)
tokens per second, speedups over greedy, mean accepted tokens per forward, and whether each
output is token-identical to greedy.

    python -m rag_lookahead.bench.single --max-new-tokens 256 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from rag_lookahead.atomic import write_json_atomic
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.loop import generate
from rag_lookahead.decoding.trie import OutputPool

METHODS = ("greedy", "prompt_lookup", "lookahead", "lookahead_warm", "lookahead_unseeded")
#: sampling methods, run once per --temperatures value as ``<method>_t<T>``; each run starts from
#: the same ``torch.manual_seed``, so in fp32 all three give the same tokens
SAMPLING_METHODS = ("sample", "prompt_lookup_sample", "lookahead_sample")


def sampling_method(method: str) -> tuple[str, float] | None:
    """``("lookahead_sample", 0.7)`` for ``lookahead_sample_t0.7``; None for a greedy method."""
    base, _, temperature = method.rpartition("_t")
    if base in SAMPLING_METHODS:
        return base, float(temperature)
    return None


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # end to end, prefill included
    first_token_seconds: float  # until the first new token exists
    forwards: int | None = None
    mean_accepted: float | None = None

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.first_token_seconds


@dataclass
class MethodTotals:
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    identical: int = 0
    runs: int = 0
    accepted: list[float] = field(default_factory=list)

    def add(self, run: Run, identical: bool) -> None:
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        self.decode_tokens += max(len(run.tokens) - 1, 0)
        self.decode_seconds += run.decode_seconds
        self.identical += identical
        self.runs += 1
        if run.mean_accepted is not None:
            self.accepted.append(run.mean_accepted)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class _FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def add_depth_arguments(parser: argparse.ArgumentParser) -> None:
    """--branch-length, and --extra-branch-length for lookahead at other depths side by side."""
    parser.add_argument("--branch-length", type=int, default=LookaheadConfig.branch_length)
    parser.add_argument(
        "--extra-branch-length",
        default="",
        help="also run lookahead with these branch_lengths (comma-separated; methods lookahead_bN), side by side",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device, --device-map: which model, in what precision, where."""
    parser.add_argument("--model", default="default", help='"default", a hub id or a local model folder')
    parser.add_argument("--dtype", default="bf16", help="bf16, fp16, fp32 or auto (GPU: bf16 where native, else fp16)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--device-map", default=None, help='accelerate device map, e.g. "auto" to spread over GPUs')


def load_bench_model(args: argparse.Namespace):
    """The model and tokenizer named by ``add_model_arguments``' flags."""
    from rag_lookahead.models import load_model

    dtype = None if args.dtype == "auto" else args.dtype
    return load_model(args.model, dtype=dtype, device=args.device, device_map=args.device_map)


def extra_depth_methods(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """The extra methods asked for, ``lookahead_bN`` -> N (a clear parser error on bad input)."""
    try:
        return {f"lookahead_b{int(n)}": int(n) for n in args.extra_branch_length.split(",") if n.strip()}
    except ValueError:
        parser.error(f"--extra-branch-length takes integers separated by commas, not {args.extra_branch_length!r}")


def load_prompts(path: str | None, ids: str | None = None) -> list[dict]:
    """The prompt set (default: the bundled one), optionally only the comma-separated ``ids``."""
    if path:
        text = Path(path).read_text(encoding="utf-8")
    else:
        text = resources.files("rag_lookahead").joinpath("data/bench_prompts.jsonl").read_text(encoding="utf-8")
    prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    if ids:
        wanted = [i.strip() for i in ids.split(",") if i.strip()]
        unknown = sorted(set(wanted) - {p.get("id") for p in prompts})
        if unknown:
            raise SystemExit(f"unknown prompt ids: {', '.join(unknown)}")
        prompts = [p for p in prompts if p.get("id") in wanted]
    return prompts


def chat_ids(tokenizer, prompt: dict, *, with_context: bool = True) -> list[int]:
    """The prompt as the user turn of the model's chat template."""
    if with_context:
        content = f"{prompt['context']}\n\n{prompt['question']}"
    else:
        content = prompt["question"]
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


@torch.inference_mode()
def run_hf(
    model, ids: list[int], max_new_tokens: int, eos, pad, prompt_lookup: int | None, sampling: dict | None = None
) -> Run:
    """transformers' greedy (or, with ``sampling``, its sampling) generate, prompt lookup optional."""
    x = torch.tensor([ids], device=model.device)
    clock = _FirstTokenClock()
    kwargs = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    kwargs.update(sampling or {"do_sample": False})
    start = time.perf_counter()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        streamer=clock,
        **kwargs,
    )
    seconds = time.perf_counter() - start
    first = (clock.first or time.perf_counter()) - start
    return Run(out[0, len(ids) :].tolist(), seconds, first)


def run_lookahead(
    model, ids, max_new_tokens, eos, pad, config, references=None, pool=None, sampling: dict | None = None
) -> Run:
    """``pool``: the output pool to draft from; None gives a fresh one (no earlier answers)."""
    pool = pool or OutputPool(config.branch_length + config.max_key_length)
    start = time.perf_counter()
    result = generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        config=config,
        references=[[references]] if references else None,  # one row, one passage
        eos_token_id=eos,
        pad_token_id=pad,
        output_pool=pool,
        **(sampling or {"do_sample": False}),
    )
    seconds = time.perf_counter() - start
    s = result.stats
    return Run(result.sequences[0, len(ids) :].tolist(), seconds, s.prefill_seconds, s.forward_passes, s.mean_accepted)


def cut_at_eos(tokens: list[int], eos) -> list[int]:
    """The tokens up to and including the first EOS (drops any padding after it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def copied_fraction(answer: list[int], source: list[int], n: int = 4) -> float:
    """Share of the answer's tokens that lie in a run of >= n tokens also found in ``source``.

    Tells how much an answer quotes its passage, i.e. how much any drafter could copy.
    """
    if len(answer) < n:
        return 0.0
    grams = {tuple(source[i : i + n]) for i in range(len(source) - n + 1)}
    covered = [False] * len(answer)
    for i in range(len(answer) - n + 1):
        if tuple(answer[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(answer)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="rag_lookahead bench", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--prompts", default=None, help="JSONL with context/question per line (default: bundled set)")
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--ids", default=None, help="use only these prompt ids (comma-separated)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--methods",
        default=",".join(METHODS[:4]),
        help="lookahead starts each prompt with an empty output pool; lookahead_warm keeps one pool across "
        "the prompts of a pass (earlier answers, never the same prompt's), as a RAG session would; "
        "lookahead_unseeded ignores the context passage given with --seed-mode references (drafts from the prompt only)",
    )
    parser.add_argument(
        "--temperatures",
        default="0.7",
        help="temperatures for the sampling methods (sample, prompt_lookup_sample, lookahead_sample), comma-separated",
    )
    parser.add_argument("--top-p", type=float, default=0.9, help="top_p of the sampling methods")
    parser.add_argument("--seed", type=int, default=0, help="base of each sampling run's torch.manual_seed")
    parser.add_argument("--decoding-length", type=int, default=LookaheadConfig.decoding_length)
    parser.add_argument("--budget", default="auto", choices=["auto", "fixed"])
    add_depth_arguments(parser)
    parser.add_argument(
        "--seed-mode",
        default="prompt",
        choices=["prompt", "references", "none"],
        help="prompt: context in the prompt; references: context only seeds the trie; none: question alone",
    )
    parser.add_argument(
        "--copying-threshold",
        type=float,
        default=0.8,
        help="also sum up the prompts whose greedy answer copies at least this share of its tokens from the context",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = parser.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS) - set(SAMPLING_METHODS)
    extra = extra_depth_methods(parser, args)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--temperatures takes numbers separated by commas, not {args.temperatures!r}")
    if any(t <= 0 for t in temperatures):
        parser.error("--temperatures must be > 0 (greedy is the method greedy)")
    methods = [m for m in methods if m not in SAMPLING_METHODS] + [
        f"{m}_t{t:g}" for t in temperatures for m in SAMPLING_METHODS if m in methods
    ]
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    model, tokenizer = load_bench_model(args)
    config = LookaheadConfig(
        decoding_length=args.decoding_length, branch_length=args.branch_length, budget=args.budget
    ).with_tokenizer(tokenizer)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = model.generation_config.pad_token_id
    pad = eos[0] if pad is None else pad
    prompts = load_prompts(args.prompts, args.ids)[: args.limit]
    configs = {"lookahead": config, "lookahead_warm": config, "lookahead_unseeded": config}
    for method, branch_length in extra.items():
        methods.append(method)
        configs[method] = config.replace(branch_length=branch_length)

    def run(method: str, prompt: dict, repeat: int = -1) -> Run:
        ids = chat_ids(tokenizer, prompt, with_context=args.seed_mode == "prompt")
        sampled = sampling_method(method)
        if sampled is not None:
            base, temperature = sampled
            options = {"do_sample": True, "temperature": temperature, "top_p": args.top_p}
            torch.manual_seed(args.seed + 1000 * (repeat + 1) + prompts.index(prompt))
            if base == "lookahead_sample":
                seeded = args.seed_mode == "references"
                references = tokenizer.encode(prompt["context"], add_special_tokens=False) if seeded else None
                return run_lookahead(model, ids, args.max_new_tokens, eos, pad, config, references, None, options)
            return run_hf(
                model, ids, args.max_new_tokens, eos, pad, 10 if base == "prompt_lookup_sample" else None, options
            )
        if method == "greedy":
            return run_hf(model, ids, args.max_new_tokens, eos, pad, None)
        if method == "prompt_lookup":
            return run_hf(model, ids, args.max_new_tokens, eos, pad, 10)
        seeded = args.seed_mode == "references" and method != "lookahead_unseeded"
        references = tokenizer.encode(prompt["context"], add_special_tokens=False) if seeded else None
        pool = warm_pool if method == "lookahead_warm" else None
        return run_lookahead(model, ids, args.max_new_tokens, eos, pad, configs[method], references, pool)

    # warm-up: kernels, and the one-time measurement of the model's verify cost curve
    warm_pool = None
    for method in methods:
        run(method, prompts[0])

    totals = {m: MethodTotals() for m in methods}
    copying = {m: MethodTotals() for m in methods}  # the same, over the prompts whose answers copy
    per_prompt = []
    for repeat in range(args.repeats):
        warm_pool = OutputPool(config.branch_length + config.max_key_length)
        for prompt in prompts:
            runs = {m: run(m, prompt, repeat) for m in methods}
            reference = cut_at_eos(runs["greedy" if "greedy" in runs else methods[0]].tokens, eos)
            context_ids = tokenizer.encode(prompt["context"], add_special_tokens=False)
            row = {
                "id": prompt.get("id"),
                "repeat": repeat,
                "copied_from_context": round(copied_fraction(reference, context_ids), 3),
            }
            for m, r in runs.items():
                baseline = _baselines(m)[
                    0
                ]  # sampling methods are compared with transformers' sample at their temperature
                same = cut_at_eos(r.tokens, eos) == (
                    cut_at_eos(runs[baseline].tokens, eos) if baseline in runs else reference
                )
                totals[m].add(r, same)
                if row["copied_from_context"] >= args.copying_threshold:
                    copying[m].add(r, same)
                row[m] = {
                    "new_tokens": len(r.tokens),
                    "seconds": round(r.seconds, 4),
                    "decode_tokens_per_second": round(max(len(r.tokens) - 1, 0) / r.decode_seconds, 3)
                    if r.decode_seconds
                    else None,
                    "identical_to_greedy": same,
                    "mean_accepted": None if r.mean_accepted is None else round(r.mean_accepted, 3),
                }
            per_prompt.append(row)
            print(json.dumps(row, ensure_ascii=False), flush=True)

    report = {
        "model": args.model,
        "dtype": args.dtype,
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "seed_mode": args.seed_mode,
        "config": {
            "decoding_length": config.decoding_length,
            "branch_length": config.branch_length,
            "budget": config.budget,
        },
        "sampling": {"temperatures": temperatures, "top_p": args.top_p, "seed": args.seed},
        "summary": summarize(totals),
        "copying_threshold": args.copying_threshold,
        "copying_runs": sum(r["copied_from_context"] >= args.copying_threshold for r in per_prompt),
        "summary_copying": summarize(copying),
        "mean_copied_from_context": round(statistics.mean(r["copied_from_context"] for r in per_prompt), 3),
        "per_prompt": per_prompt,
    }
    _print_table(report)
    if args.json_path:
        write_json_atomic(args.json_path, report)
    return report


def _baselines(method: str) -> tuple[str, str]:
    """What a method's speed is compared with: transformers' plain decoding and its prompt lookup,
    greedy for greedy methods, sampling at the same temperature for sampling methods."""
    sampled = sampling_method(method)
    if sampled is None:
        return "greedy", "prompt_lookup"
    return f"sample_t{sampled[1]:g}", f"prompt_lookup_sample_t{sampled[1]:g}"


def summarize(totals: dict[str, MethodTotals]) -> dict[str, dict]:
    """Per method: tokens/s, and decode speedups over transformers' plain decoding and its prompt
    lookup (greedy, or sampling at the method's temperature) where they ran."""

    def ratio(t: MethodTotals, base: MethodTotals | None, decode: bool) -> float | None:
        if base is None or not base.runs:
            return None
        ours, theirs = (
            (t.decode_tokens_per_second, base.decode_tokens_per_second)
            if decode
            else (t.tokens_per_second, base.tokens_per_second)
        )
        return round(ours / theirs, 3) if theirs else None

    return {
        m: {
            "tokens_per_second": round(t.tokens_per_second, 3),
            "decode_tokens_per_second": round(t.decode_tokens_per_second, 3),
            "speedup_e2e": ratio(t, totals.get(_baselines(m)[0]), decode=False),
            "speedup_decode": ratio(t, totals.get(_baselines(m)[0]), decode=True),
            "vs_prompt_lookup_decode": ratio(t, totals.get(_baselines(m)[1]), decode=True),
            "mean_accepted": round(statistics.mean(t.accepted), 3) if t.accepted else None,
            "identical_to_greedy": f"{t.identical}/{t.runs}",
            "new_tokens": t.tokens,
        }
        for m, t in totals.items()
        if t.runs
    }


def _print_table(report: dict) -> None:
    def times(value) -> str:
        return f"{value:.2f}x" if value else "-"

    for key, which in (
        ("summary", f"{report['prompts']} prompts x {report['repeats']}"),
        (
            "summary_copying",
            f"the {report['copying_runs']} prompt runs whose answers copy >= {report['copying_threshold']:.0%}",
        ),
    ):
        if not report[key] or (key == "summary_copying" and report["copying_runs"] == len(report["per_prompt"])):
            continue  # nothing to sum up, or the same prompts as the table above
        rows = [
            {
                "method": method,
                "tok/s e2e": f"{s['tokens_per_second']:.2f}",
                "tok/s decode": f"{s['decode_tokens_per_second']:.2f}",
                "speedup e2e": times(s["speedup_e2e"]),
                "speedup decode": times(s["speedup_decode"]),
                "vs prompt lookup": times(s["vs_prompt_lookup_decode"]),
                "mean accepted": f"{s['mean_accepted']:.2f}" if s["mean_accepted"] else "-",
                "identical": s["identical_to_greedy"],
            }
            for method, s in report[key].items()
        ]
        title = (
            f"{report['model']} {report['dtype']} on {report['device']}, batch 1, {which}, "
            f"context {report['seed_mode']}, {report['mean_copied_from_context']:.0%} of answer tokens copied from it"
        )
        _print_rows(title, rows)


def _print_rows(title: str, rows: list[dict]) -> None:
    """A rich table of dicts that share their keys."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in rows[0]:
        table.add_column(str(column), justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
