"""Side-by-side benchmark: transformers greedy, transformers prompt lookup, and lookahead.

Same model, same prompts, one process, methods interleaved prompt by prompt so that machine
noise hits all of them alike. Reports end-to-end and decode-only (after the first token)
tokens per second, speedups over greedy, mean accepted tokens per forward, and whether each
output is token-identical to greedy.

    python -m rag_lookahead.bench --max-new-tokens 256 --json bench.json --plot
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from types import EllipsisType
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
    chat_ids,
    check_method_list,
    check_output_path,
    check_plot,
    check_positive,
    checked_config,
    context_fitted_ids,
    copied_fraction,
    cut_at_eos,
    draft_shape,
    dtype_label,
    eos_pad,
    extra_depth_methods,
    in_turn,
    load_bench_model,
    load_prompts,
    print_json_line,
    print_rows,
    prompts_file,
    report_despite_stdout,
    run_command,
    times,
    write_report,
)
from rag_lookahead.bench.methods import (
    METHODS,
    PROMPT_LOOKUP_TOKENS,
    SAMPLING_METHODS,
    STOCK_METHODS,
    MethodTotals,
    Run,
    baselines,
    prompt_lookup_drafter,
    run_hf,
    run_lookahead,
    sampling_name,
    sampling_runs,
    summarize,
)
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.sampling import SamplingParams
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.greedy_head import full_output_layer
from rag_lookahead.output_files import FileState

PROG = "rag_lookahead bench"


class Budget(Enum):
    auto = "auto"
    fixed = "fixed"


class SeedMode(Enum):
    prompt = "prompt"
    references = "references"
    none = "none"


#: every name --methods takes, the table it is checked against and its help lists (the help left
#: out the sampling methods)
ACCEPTED_METHODS = (*METHODS, *SAMPLING_METHODS)
METHODS_HELP = (
    f"comma-separated, of: {', '.join(ACCEPTED_METHODS)} (default: {', '.join(METHODS[:4])}; "
    f"{', '.join(SAMPLING_METHODS)} run once per --temperatures value). "
    "lookahead starts each prompt with an empty output pool; lookahead_warm keeps one pool across "
    "the prompts of a pass (earlier answers, never the same prompt's), as a RAG session would; "
    "lookahead_unseeded ignores the context passage given with --seed-mode references (drafts from the prompt only); "
    "prompt_lookup_ours is transformers' prompt lookup (same n-gram and draft sizes) run through our loop; "
    "lookahead_full_head is lookahead with the model's full output layer (no greedy_head screen) for that run; "
    "greedy_stock and prompt_lookup_stock are transformers' on torch's stock kernels: its linears, and on a GPU "
    "sdpa's own choice, cuDNN included (greedy and prompt_lookup run on the kernels lookahead runs on: the CPU "
    "layout load_model gives the model, sdpa without cuDNN on a GPU)"
)
TEMPERATURES_HELP = (
    "temperatures for the sampling methods (sample, prompt_lookup_sample, lookahead_sample), comma-separated"
)
SEED_MODE_HELP = "prompt: context in the prompt; references: context only seeds the trie; none: question alone"
COPYING_HELP = "also sum up the prompts whose greedy answer copies at least this share of its tokens from the context"


@dataclass(frozen=True)
class BenchSettings:
    """The options of one run, parsed (methods expanded, temperatures as numbers)."""

    model: str
    dtype: str
    device: str | None
    device_map: str | None
    prompts: str | None
    limit: int | None
    ids: str | None
    max_new_tokens: int
    repeats: int
    methods: tuple[str, ...]  # sampling methods as <method>_t<T>; the extra depths last
    temperatures: tuple[float, ...]
    top_p: float
    seed: int
    decoding_length: int
    budget: str
    branch_length: int
    extra_depths: dict[str, int]  # lookahead_bN -> N
    seed_mode: str
    copying_threshold: float
    json_path: str | None
    plot: bool
    report_seen: FileState | EllipsisType = ...  # what check_output_path found at json_path
    trust_remote_code: bool = False


def expand_methods(
    methods: str, temperatures: str, extra_depths: dict[str, int], branch_length: int
) -> tuple[list[str], list[float]]:
    """The methods to run, in order: greedy ones, each sampling one per temperature, the extra depths.
    No temperature twice (as its methods name it: 0.7 and 0.70 ran the same methods twice)."""
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = set(chosen) - set(ACCEPTED_METHODS)
    try:
        values = [float(t) for t in temperatures.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"takes numbers separated by commas, not {temperatures!r}", param_hint="--temperatures"
        ) from None
    if any(not math.isfinite(t) or t <= 0 for t in values):
        raise typer.BadParameter(
            "must be finite numbers > 0 (greedy is the method greedy)", param_hint="--temperatures"
        )
    names = [sampling_name("sample", t) for t in values]
    if len(set(names)) < len(names):
        raise typer.BadParameter(f"names a temperature twice: {temperatures!r}", param_hint="--temperatures")
    if unknown:
        raise typer.BadParameter(f"unknown methods: {', '.join(sorted(unknown))}", param_hint="--methods")
    check_method_list(chosen, extra_depths, methods, branch_length)
    if not values and any(m in SAMPLING_METHODS for m in chosen):
        raise typer.BadParameter("names no temperature for the sampling methods", param_hint="--temperatures")
    expanded = [m for m in chosen if m not in SAMPLING_METHODS]
    expanded += [sampling_name(m, t) for t in values for m in SAMPLING_METHODS if m in chosen]
    return expanded + list(extra_depths), values


class MethodRunner:
    """Runs one method on one prompt the way the settings say; holds what runs share (the model,
    EOS/pad, a config per lookahead method, the output pool ``lookahead_warm`` keeps for a pass)."""

    def __init__(self, model, tokenizer, settings: BenchSettings, config: LookaheadConfig, prompts: list[dict]):
        self.model, self.tokenizer, self.settings, self.config, self.prompts = (
            model,
            tokenizer,
            settings,
            config,
            prompts,
        )
        self.eos, self.pad = eos_pad(model, tokenizer)
        self.configs = {m: config for m in ("lookahead", "lookahead_full_head", "lookahead_warm", "lookahead_unseeded")}
        for method, branch_length in settings.extra_depths.items():
            self.configs[method] = config.replace(branch_length=branch_length)
        self.warm_pool: OutputPool | None = None  # none during the warm-up: a fresh pool there
        # a sampling method's name -> the method and its exact temperature (the name rounds it)
        self.sampling = sampling_runs(settings.temperatures)

    def new_pass(self) -> None:
        """``lookahead_warm`` starts each pass over the prompts with an empty pool."""
        self.warm_pool = OutputPool(self.config.pool_depth)

    def context_ids(self, prompt: dict) -> list[int]:
        return self.tokenizer.encode(prompt["context"], add_special_tokens=False)

    def run(self, method: str, prompt: dict, repeat: int = -1) -> Run:
        s = self.settings
        # every lookahead variant starts from the same acceptance prior: otherwise each inherits what
        # the variant run just before it (often on the same prompt) left in the model's profile
        from rag_lookahead.decoding.profile import profile_of

        profile_of(self.model).drafts_met.clear()
        ids = chat_ids(self.tokenizer, prompt, with_context=s.seed_mode == "prompt")
        hf_args = (self.model, ids, s.max_new_tokens, self.eos, self.pad)
        sampled = self.sampling.get(method)
        if sampled is not None:
            return self._sample(*sampled, prompt, ids, repeat)
        if method == "greedy":
            return run_hf(*hf_args, None)
        if method == "prompt_lookup":
            return run_hf(*hf_args, PROMPT_LOOKUP_TOKENS)
        if method in STOCK_METHODS:
            return run_hf(*hf_args, STOCK_METHODS[method], stock=True)
        if method == "prompt_lookup_ours":  # every drafted token verified, as transformers does (no cost budget)
            return run_lookahead(*hf_args, self.config.replace(budget="fixed"), drafter=prompt_lookup_drafter())
        seeded = s.seed_mode == "references" and method != "lookahead_unseeded"
        references = self.context_ids(prompt) if seeded else None
        pool = self.warm_pool if method == "lookahead_warm" else None
        if method == "lookahead_full_head":
            with full_output_layer(self.model):
                return run_lookahead(*hf_args, self.configs[method], references, pool)
        return run_lookahead(*hf_args, self.configs[method], references, pool)

    def _sample(self, base: str, temperature: float, prompt: dict, ids: list[int], repeat: int) -> Run:
        """A sampling method, from a seed fixed by the repeat and the prompt (the same for all three)."""
        s = self.settings
        options = {"do_sample": True, "temperature": temperature, "top_p": s.top_p}
        torch.manual_seed(s.seed + 1000 * (repeat + 1) + self.prompts.index(prompt))
        if base == "lookahead_sample":
            references = self.context_ids(prompt) if s.seed_mode == "references" else None
            return run_lookahead(
                self.model, ids, s.max_new_tokens, self.eos, self.pad, self.config, references, None, options
            )
        lookup = PROMPT_LOOKUP_TOKENS if base == "prompt_lookup_sample" else None
        return run_hf(self.model, ids, s.max_new_tokens, self.eos, self.pad, lookup, options)


@dataclass
class Measured:
    totals: dict[str, MethodTotals]
    copying: dict[str, MethodTotals]  # the same, over the prompts whose answers copy
    per_prompt: list[dict]


def measure(runner: MethodRunner, methods: Sequence[str]) -> Measured:
    """Every method on every prompt, ``repeats`` passes, after a warm-up (kernels, and the one-time
    measurement of the model's verify cost curve). The methods' order turns by one from each
    prompt to the next, so none always runs first or last."""
    for method in methods:
        runner.run(method, runner.prompts[0])
    measured = Measured({m: MethodTotals() for m in methods}, {m: MethodTotals() for m in methods}, [])
    for repeat in range(runner.settings.repeats):
        runner.new_pass()
        for n, prompt in enumerate(runner.prompts):
            runs = in_turn(methods, n + repeat, runner.run, prompt, repeat)
            row = prompt_row(runner, prompt, repeat, runs, measured)
            measured.per_prompt.append(row)
            print_json_line(row)
    return measured


def prompt_row(runner: MethodRunner, prompt: dict, repeat: int, runs: dict[str, Run], measured: Measured) -> dict:
    """One prompt's figures per method, added to the totals as they are made. Sampling methods are
    compared with transformers' sampling at their temperature, the others with greedy; where that
    baseline did not run, ``identical_to_greedy`` (and, without greedy, ``copied_from_context``) is None."""
    eos = runner.eos
    greedy = cut_at_eos(runs["greedy"].tokens, eos) if "greedy" in runs else None
    copied = None if greedy is None else round(copied_fraction(greedy, runner.context_ids(prompt)), 3)
    row = {"id": prompt.get("id"), "repeat": repeat, "copied_from_context": copied}
    for m, r in runs.items():
        baseline = baselines(m)[0]
        # a baseline is not compared with itself (it would count as identical by construction)
        compared = baseline in runs and m != baseline
        same = cut_at_eos(r.tokens, eos) == cut_at_eos(runs[baseline].tokens, eos) if compared else None
        measured.totals[m].add(r, same)
        if copied is not None and copied >= runner.settings.copying_threshold:
            measured.copying[m].add(r, same)
        # as the totals count it (Totals.add): tokens of the first forward are not decode tokens
        decode = round(max(len(r.tokens) - r.first_tokens, 0) / r.decode_seconds, 3) if r.decode_seconds else None
        row[m] = {
            "new_tokens": len(r.tokens),
            "seconds": round(r.seconds, 4),
            "decode_tokens_per_second": decode,
            "identical_to_greedy": same,
            "mean_accepted": None if r.mean_accepted is None else round(r.mean_accepted, 3),
        }
        if r.accepted_histogram is not None:  # our loop's steps: tokens gained in one step -> steps
            row[m]["accepted_histogram"] = dict(sorted(r.accepted_histogram.items()))
    return row


def build_report(s: BenchSettings, model, config: LookaheadConfig, prompts: list[dict], measured: Measured) -> dict:
    per_prompt = measured.per_prompt
    copied = [r["copied_from_context"] for r in per_prompt if r["copied_from_context"] is not None]
    return {
        "model": s.model,
        "dtype": dtype_label(model, s.dtype),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "drafts": draft_shape(model),
        "prompts": len(prompts),
        "repeats": s.repeats,
        "max_new_tokens": s.max_new_tokens,
        "seed_mode": s.seed_mode,
        "config": {
            "decoding_length": config.decoding_length,
            "branch_length": config.branch_length,
            "budget": config.budget,
        },
        "sampling": {"temperatures": list(s.temperatures), "top_p": s.top_p, "seed": s.seed},
        "summary": summarize(measured.totals),
        "copying_threshold": s.copying_threshold,
        "copying_runs": sum(c >= s.copying_threshold for c in copied),
        "summary_copying": summarize(measured.copying),
        "mean_copied_from_context": round(statistics.mean(copied), 3) if copied else None,  # None: no greedy
        "per_prompt": per_prompt,
    }


def print_summary(report: dict) -> None:
    """The summary table, and one over the copying prompts where they are not all of them."""

    copying = f"the {report['copying_runs']} prompt runs whose answers copy >= {report['copying_threshold']:.0%}"
    for key, which in (("summary", f"{report['prompts']} prompts x {report['repeats']}"), ("summary_copying", copying)):
        if not report[key] or (key == "summary_copying" and report["copying_runs"] == len(report["per_prompt"])):
            continue  # nothing to sum up, or the same prompts as the table above
        has_stock = any(s.get("vs_prompt_lookup_stock_decode") for s in report[key].values())
        rows = [
            {
                "method": method,
                "tok/s e2e": f"{s['tokens_per_second']:.2f}",
                "tok/s decode": f"{s['decode_tokens_per_second']:.2f}",
                "speedup e2e": times(s["speedup_e2e"]),
                "speedup decode": times(s["speedup_decode"]),
                "vs prompt lookup": times(s["vs_prompt_lookup_decode"]),
                **({"vs PL stock": times(s["vs_prompt_lookup_stock_decode"])} if has_stock else {}),
                "mean accepted": f"{s['mean_accepted']:.2f}" if s["mean_accepted"] else "-",
                "identical": s["identical_to_greedy"],
            }
            for method, s in report[key].items()
        ]
        copied = report["mean_copied_from_context"]
        share = f", {copied:.0%} of answer tokens copied from it" if copied is not None else ""
        where = f"{report['model']} {report['dtype']} on {report['device']}"
        title = f"{where}, batch 1, {which}, context {report['seed_mode']}{share}{chains_note(report['drafts'])}"
        print_rows(title, rows)


def run_bench(s: BenchSettings) -> dict:
    """Load the model, run every method on every prompt, print the tables, write JSON and charts."""
    prompts = load_prompts(s.prompts, s.ids)[: s.limit]  # a bad file or setting fails before the model loads
    config = checked_config(
        s.extra_depths, s.methods, decoding_length=s.decoding_length, branch_length=s.branch_length, budget=s.budget
    )
    model, tokenizer = load_bench_model(s.model, s.dtype, s.device, s.device_map, s.trust_remote_code)
    context_fitted_ids(model, tokenizer, prompts, s.max_new_tokens, with_context=s.seed_mode == "prompt")
    config = config.with_tokenizer(tokenizer)
    measured = measure(MethodRunner(model, tokenizer, s, config, prompts), s.methods)
    report = build_report(s, model, config, prompts, measured)
    print_summary(report)
    if s.json_path:
        write_report(
            s.json_path, report, plots.plot_single if s.plot else None, plots.SINGLE_CHARTS, seen=s.report_seen
        )
    return report


def bench(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    prompts: PromptsOption = None,
    limit: Annotated[int | None, typer.Option(help="use the first N prompts")] = None,
    ids: IdsOption = None,
    max_new_tokens: int = 256,
    repeats: int = 1,
    methods: Annotated[str, typer.Option(help=METHODS_HELP)] = ",".join(METHODS[:4]),
    temperatures: Annotated[str, typer.Option(help=TEMPERATURES_HELP)] = "0.7",
    top_p: Annotated[float, typer.Option(help="top_p of the sampling methods")] = 0.9,
    seed: Annotated[
        int,  # each run seeds torch with seed + 1000 * (repeat + 1) + prompt index: it must stay an int64
        typer.Option(min=0, max=2**62, help="base of each sampling run's torch.manual_seed (0 to 2**62)"),
    ] = 0,
    decoding_length: int = LookaheadConfig.decoding_length,
    budget: Budget = Budget.auto,
    branch_length: BranchLengthOption = DEFAULT_BRANCH_LENGTH,
    extra_branch_length: ExtraBranchLengthOption = "",
    seed_mode: Annotated[SeedMode, typer.Option(help=SEED_MODE_HELP)] = SeedMode.prompt,
    copying_threshold: Annotated[float, typer.Option(min=0.0, max=1.0, help=COPYING_HELP)] = 0.8,
    json_path: JsonOption = None,
    plot: PlotOption = False,
) -> dict:
    """Side-by-side benchmark: transformers greedy, transformers prompt lookup, and lookahead."""
    check_plot(plot, json_path, plots.SINGLE_CHARTS)
    report_seen = check_output_path(json_path, inputs=[prompts_file(prompts)])
    check_positive({"--limit": limit, "--repeats": repeats, "--max-new-tokens": max_new_tokens})
    extra = extra_depth_methods(extra_branch_length)
    chosen, values = expand_methods(methods, temperatures, extra, branch_length)
    SamplingParams(do_sample=True, top_p=top_p)  # a bad --top-p fails here, not after the model loads
    settings = BenchSettings(
        model, dtype, device, device_map, prompts, limit, ids, max_new_tokens, repeats, tuple(chosen), tuple(values),
        top_p, seed, decoding_length, Budget(budget).value, branch_length, extra, SeedMode(seed_mode).value,
        copying_threshold, json_path, plot, report_seen, trust_remote_code,
    )  # fmt: skip
    with report_despite_stdout(json_path):
        return run_bench(settings)


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench [options]``: the report (an exit code for --help)."""
    return run_command(bench, argv, PROG)


if __name__ == "__main__":
    main()
