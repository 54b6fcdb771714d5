"""Throughput benchmark: many requests at once, batched.

The same requests go through (a) transformers batched greedy ``generate`` with left padding, in
static waves of ``concurrency`` requests, (b) our engine with drafting off and (c) with drafting
on, both keeping ``concurrency`` requests in flight (a finished request's slot is refilled at
once, as in the server). Reports requests/s, tokens/s, p50/p95 latency (from a request's start
to its last token) and whether every output equals the single-request greedy output.

    python -m rag_lookahead.bench.batch --concurrency 1,4,16 --requests 16 --json batch.json --plot
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import torch
import typer

from rag_lookahead.bench import plots
from rag_lookahead.bench.common import (
    DEFAULT_BRANCH_LENGTH,
    BranchLengthOption,
    DeviceMapOption,
    DeviceOption,
    DtypeOption,
    ExtraBranchLengthOption,
    IdsOption,
    JsonOption,
    ModelOption,
    PlotOption,
    PromptsOption,
    TrustRemoteCodeOption,
    chains_note,
    check_method_list,
    check_output_path,
    check_plot,
    check_positive,
    checked_config,
    context_fitted_ids,
    copied_fraction,
    draft_shape,
    dtype_label,
    eos_pad,
    extra_depth_methods,
    hf_batched,
    in_turn,
    load_bench_model,
    load_prompts,
    print_json_line,
    print_rows,
    prompts_file,
    report_despite_stdout,
    run_command,
    write_report,
)
from rag_lookahead.bench.percentile import nearest_rank
from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.loop import DecodeBatch, left_pad
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.errors import ConfigError

PROG = "python -m rag_lookahead.bench.batch"
BASE_METHODS = ("hf_greedy", "plain", "lookahead")
#: also: transformers greedy on torch's stock kernels (``transformers_kernels``: the model as transformers runs it;
#: "hf_greedy" runs on the layout ``load_model`` gives the model, as ours does)
STOCK_METHOD = "hf_greedy_stock"
#: every name --methods takes, the table it is checked against and its help lists (the help listed none)
ACCEPTED_METHODS = (*BASE_METHODS, STOCK_METHOD)
METHODS_HELP = f"comma-separated, of: {', '.join(ACCEPTED_METHODS)}"


def run_hf_waves(model, requests, level, max_new_tokens, eos, pad, stock: bool = False):
    """transformers: padded static batches of ``level`` requests; a wave returns all rows together
    (``stock``: on torch's own kernels, see ``transformers_kernels``)."""
    outputs, latencies = [], []
    for first in range(0, len(requests), level):
        rows = requests[first : first + level]
        start = time.perf_counter()
        outputs += hf_batched(model, rows, max_new_tokens, eos, pad, stock)
        latencies += [time.perf_counter() - start] * len(rows)
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
        for row in batch.retire():
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
            batch.raise_row_failure()
            row_steps += len(new)
            gained += sum(len(t) for t in new)
    ordered = [outputs[i] for i in range(len(requests))]
    return ordered, [latencies[i] for i in range(len(requests))], gained / row_steps if row_steps else None


@dataclass
class Workload:
    """What every (level, method) run shares: the model, its EOS/pad, the requests and the config."""

    model: object
    eos: list[int]
    pad: int
    requests: list[list[int]]
    config: LookaheadConfig
    depths: dict[str, int]  # lookahead_bN -> N
    max_new_tokens: int

    def run(self, method: str, level: int):
        """``(outputs, latencies, mean accepted)`` of one method at one concurrency."""
        if method in ("hf_greedy", STOCK_METHOD):
            stock = method == STOCK_METHOD
            return run_hf_waves(self.model, self.requests, level, self.max_new_tokens, self.eos, self.pad, stock)
        config = self.config.replace(
            enabled=method != "plain", branch_length=self.depths.get(method, self.config.branch_length)
        )
        # every run from the same acceptance prior, not the one the run before it (another level,
        # depth or pass) left in the model's profile
        profile_of(self.model).drafts_met.clear()
        return run_continuous(self.model, self.requests, level, self.max_new_tokens, self.eos, self.pad, config)


def timed_run(work: Workload, method: str, level: int, repeat: int) -> tuple[dict, list[list[int]]]:
    """One method at one concurrency, timed: its row (printed as it is made) and its outputs."""
    start = time.perf_counter()
    produced, latencies, accepted = work.run(method, level)
    tokens = sum(len(o) for o in produced)
    seconds = time.perf_counter() - start
    lat = sorted(latencies)
    row = {
        "pass": repeat,
        "concurrency": level,
        "method": method,
        "requests_per_second": round(len(work.requests) / seconds, 4),
        "tokens_per_second": round(tokens / seconds, 3),
        "p50_latency_s": round(statistics.median(lat), 3),
        "p95_latency_s": round(nearest_rank(lat, 0.95), 3),
        "identical_to_single": None,  # filled in once the single-request outputs exist
        "mean_accepted": None if accepted is None else round(accepted, 3),  # None: transformers' (no drafts)
    }
    print_json_line(row)
    return row, produced


def measure(work: Workload, methods: list[str], levels: list[int], repeats: int) -> tuple[list[dict], dict]:
    """One row per (pass, level, method); and the single-request greedy outputs (transformers',
    ``hf_greedy`` at concurrency 1, first pass) that every row is compared with once all have run.
    Without that run they are decoded after the timed ones, untimed, so every figure is checked;
    the row that is the reference holds None (the table's "-"), never itself as identical."""
    results, outputs = [], []
    for turn, (repeat, level) in enumerate((r, c) for r in range(repeats) for c in levels):
        # no method always first or last after a level change; rows listed in the order asked
        runs = in_turn(methods, turn, functools.partial(timed_run, work), level, repeat)
        for row, produced in runs.values():
            results.append(row)
            outputs.append(produced)
    reference = single_reference(results)
    if reference is None:
        print("decoding each request alone with transformers (untimed), to check every run against it", flush=True)
        produced, _, _ = run_hf_waves(work.model, work.requests, 1, work.max_new_tokens, work.eos, work.pad)
        single = dict(enumerate(produced))
    else:
        single = dict(enumerate(outputs[reference]))
    for n, (row, produced) in enumerate(zip(results, outputs)):
        same = sum(o == single[i] for i, o in enumerate(produced))
        row["identical_to_single"] = None if n == reference else f"{same}/{len(produced)}"
    return results, single


def single_reference(results: list[dict]) -> int | None:
    """The row whose outputs are transformers' greedy run alone (the first ``hf_greedy`` row at
    concurrency 1), or None when no such row ran."""
    for n, row in enumerate(results):
        if row["method"] == "hf_greedy" and row["concurrency"] == 1:
            return n
    return None


def add_speedups(results: list[dict]) -> None:
    """``speedup_vs_hf`` (``_vs_hf_stock``): tokens/s over transformers' on the model's layout (on
    stock kernels) at the same pass and concurrency, where it ran."""
    for baseline, key in (("hf_greedy", "speedup_vs_hf"), (STOCK_METHOD, "speedup_vs_hf_stock")):
        hf: dict[tuple[int, int], dict] = {}
        for r in results:
            if r["method"] == baseline:
                hf.setdefault((r["pass"], r["concurrency"]), r)
        for r in results:
            base = hf.get((r["pass"], r["concurrency"]))
            if base:
                r[key] = round(r["tokens_per_second"] / base["tokens_per_second"], 3)


def parse_methods(methods: str, extra_branch_length: str, branch_length: int) -> tuple[list[str], dict[str, int]]:
    """The methods to run (the extra depths last) and the extra depths, ``lookahead_bN`` -> N."""
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    depths = extra_depth_methods(extra_branch_length)
    unknown = set(chosen) - set(ACCEPTED_METHODS)
    if unknown:
        raise typer.BadParameter(
            f"unknown methods: {', '.join(sorted(unknown))} (choose from {', '.join(ACCEPTED_METHODS)})",
            param_hint="--methods",
        )
    check_method_list(chosen, depths, methods, branch_length)
    return chosen + list(depths), depths


def concurrency_levels(concurrency: str) -> list[int]:
    """The ``--concurrency`` levels, each an integer >= 1 and none twice (ConfigError naming the
    first bad one): a level given twice ran twice, its baselines compared with themselves."""
    levels = []
    for part in concurrency.split(","):
        try:
            level = int(part)
        except ValueError:
            raise ConfigError(f"--concurrency takes integers >= 1 separated by commas, not {concurrency!r}") from None
        if level in levels:
            raise ConfigError(f"--concurrency names the level {level} twice: {concurrency!r}")
        levels.append(positive_int("--concurrency", level))
    return levels


def batch(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    prompts: PromptsOption = None,
    ids: IdsOption = None,
    requests: Annotated[int, typer.Option(help="requests per concurrency level (prompts cycled)")] = 16,
    concurrency: str = "1,4,16",
    max_new_tokens: int = 96,
    methods: Annotated[str, typer.Option(help=METHODS_HELP)] = ",".join(BASE_METHODS),
    branch_length: BranchLengthOption = DEFAULT_BRANCH_LENGTH,
    extra_branch_length: ExtraBranchLengthOption = "",
    repeats: Annotated[
        int, typer.Option(help="passes over all levels and methods (timing drifts: compare within a pass)")
    ] = 1,
    json_path: JsonOption = None,
    plot: PlotOption = False,
) -> dict:
    """Throughput benchmark: many requests at once, batched."""
    check_plot(plot, json_path, plots.BATCH_CHARTS)
    seen = check_output_path(json_path, inputs=[prompts_file(prompts)])
    check_positive({"--requests": requests, "--max-new-tokens": max_new_tokens, "--repeats": repeats})
    levels = concurrency_levels(concurrency)
    chosen, depths = parse_methods(methods, extra_branch_length, branch_length)
    config = checked_config(depths, chosen, branch_length=branch_length)
    prompt_set = load_prompts(prompts, ids)  # a bad file or setting fails before the model loads
    with report_despite_stdout(json_path):
        loaded, tokenizer = load_bench_model(model, dtype, device, device_map, trust_remote_code)
        work, cycled = workload(loaded, tokenizer, prompt_set, requests, config, depths, max_new_tokens)
        results, single = warmed_measure(work, chosen, levels, repeats)
        contexts = [tokenizer.encode(p["context"], add_special_tokens=False) for p in cycled]
        copied = [copied_fraction(single[i], contexts[i]) for i in single]
        report = {
            "model": model,
            "dtype": dtype_label(loaded, dtype),  # what ran, not the option
            "threads": torch.get_num_threads(),
            "drafts": draft_shape(loaded),
            "requests": len(work.requests),
            "prompt_ids": sorted({p.get("id") for p in cycled}),  # those that ran (--requests may take fewer)
            "mean_copied_from_context": round(statistics.mean(copied), 3) if copied else None,
            "max_new_tokens": max_new_tokens,
            "results": results,
        }
        print_report(report)
        if json_path:
            write_report(json_path, report, plots.plot_batch if plot else None, plots.BATCH_CHARTS, seen=seen)
    return report


def workload(model, tokenizer, prompt_set: list[dict], requests: int, config, depths, max_new_tokens: int):
    """``(Workload, the prompt of each request)``: ``requests`` requests cycling over the prompts,
    each prompt they use first checked to fit the model's context with its answer (before any run)."""
    used = prompt_set[:requests]
    fitted = context_fitted_ids(model, tokenizer, used, max_new_tokens)
    cycle = [i % len(used) for i in range(requests)]
    eos, pad = eos_pad(model, tokenizer)
    config = config.with_tokenizer(tokenizer)
    work = Workload(model, eos, pad, [fitted[i] for i in cycle], config, depths, max_new_tokens)
    return work, [used[i] for i in cycle]


def warmed_measure(work: Workload, methods: list[str], levels: list[int], repeats: int) -> tuple[list[dict], dict]:
    """:func:`measure` with speedups, after an untimed warm-up (kernels, and our cost curve)."""
    run_continuous(work.model, work.requests[:2], 2, 8, work.eos, work.pad, work.config)
    run_hf_waves(work.model, work.requests[:2], 2, 8, work.eos, work.pad)
    if STOCK_METHOD in methods:
        run_hf_waves(work.model, work.requests[:2], 2, 8, work.eos, work.pad, stock=True)
    results, single = measure(work, methods, levels, repeats)
    add_speedups(results)
    return results, single


def print_report(report: dict) -> None:
    """The results table, titled with the model, the requests and the share copied from the context."""
    copied = report["mean_copied_from_context"]
    share = f", {copied:.0%} of answer tokens copied from the context" if copied is not None else ""
    title = (
        f"{report['model']} {report['dtype']}, {report['requests']} requests at each concurrency{share}"
        f"{chains_note(report['drafts'])}"
    )
    print_rows(title, report["results"])


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.batch [options]``: the report (an exit code for --help)."""
    return run_command(batch, argv, PROG)


if __name__ == "__main__":
    main()
