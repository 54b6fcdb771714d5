"""Drafters compared without timing noise: each prompt's greedy answer replayed step by step on the host.

Every lossless drafter yields the same tokens; they differ in how many steps an answer takes
and how many tokens each step's forward carries. Both follow from the answer alone: at each
step the drafter proposes from the text so far, the loop's own budget cuts the tree (the row's
``AcceptanceRates`` and ``costs.allocate`` on the model's cost curve), and the row gains the
longest path the answer spells plus the bonus token. So one greedy run per prompt gives every
drafter's steps, and the cost curve prices them, with none of the run-to-run swings of timed
runs on a shared machine (single items move 20-40% between passes on these CPUs). The
predicted speed prices each forward by the curve only: the loop's own overhead and the
machine's drift are left out, so confirm a change found here with ``bench`` before trusting it.

    python -m rag_lookahead.bench.replay --prompts realistic-zh --dtype bf16

``--cost-curve`` prices the forwards by another device's curve (``tokens:ms`` pairs, as
``bench.step_profile`` reports a forward's cost by its size there), to predict that device's
speed from answers decoded here; the answers are the same on any device in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import typer

from rag_lookahead.bench.common import (
    DeviceOption,
    DtypeOption,
    IdsOption,
    JsonOption,
    ModelOption,
    PromptsOption,
    TrustRemoteCodeOption,
    dtype_label,
    eos_pad,
    fresh_pool_answers,
    print_rows,
    prompts_then_model,
    report_despite_stdout,
    run_command,
    write_report,
)
from rag_lookahead.decoding.acceptance import AcceptanceRates
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import CostCurve, StepCosts, allocate, lower_hull
from rag_lookahead.decoding.decode_batch import row_candidates
from rag_lookahead.decoding.drafter import Drafter, PromptLookupDrafter, TrieDrafter
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.errors import InputError

PROG = "python -m rag_lookahead.bench.replay"
#: what each replayed drafter is: prompt lookup verifies its whole chain, as transformers does;
#: lookahead is sized by the cost budget, with a fresh output pool per answer (``bench``'s
#: ``lookahead``) or one pool kept over the answers in order (``bench``'s ``lookahead_warm``);
#: ``lookahead_chains`` drafts the likeliest chain of each tree, as the loop does for a model whose
#: attention does not take a tree mask
DRAFTERS = ("prompt_lookup", "lookahead", "lookahead_warm", "lookahead_chains")
CostCurveOption = Annotated[
    str | None,
    typer.Option(
        "--cost-curve",
        help='price forwards by this curve, "TOKENS:MS,..." (e.g. a GPU\'s, from bench.step_profile), '
        "not the model's own on this machine",
    ),
]


@dataclass
class Replayed:
    """One answer's replay: its decode steps, the tokens they gained and what the forwards cost."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: Replayed) -> None:
        self.steps, self.tokens, self.seconds = (
            self.steps + other.steps,
            self.tokens + other.tokens,
            self.seconds + other.seconds,
        )


def replay(
    drafter: Drafter,
    prompt: list[int],
    answer: list[int],
    eos: frozenset[int],
    curve: CostCurve,
    *,
    budget: bool = True,
    chains: bool = False,
    references: Sequence[Sequence[int]] = (),
) -> Replayed:
    """Replay ``answer`` (greedy, ending at EOS or at its token budget) after ``prompt``: the steps
    our loop takes with ``drafter``, the tokens after the first (which comes with the prefill)
    and the forwards' cost by ``curve``. ``budget``: cut each tree by the cost budget as the loop
    does (else verify every node, as ``budget="fixed"`` does). ``chains``: draft each tree's likeliest
    chain only, as the loop does without a tree mask."""
    # no chooser (the answer gives every token) and no context limit (the answer already ends where it must)
    row = Row(0, list(prompt), len(answer), None, None, acceptance=AcceptanceRates())
    row.take(answer[:1], eos)
    drafter.start(row, references)
    costs = StepCosts(curve)
    costs.observe(1, 1, curve(1))  # a one-row batch's plain step is known, as after the loop's first
    done = Replayed()
    while not row.done:
        candidates = row_candidates(drafter, row, tree_mask=not chains)
        weighed = row.acceptance.weigh(candidates) if budget else candidates
        draft = weighed.top(allocate([weighed], costs)[0]) if budget else weighed
        at = len(row.generated)
        path = draft.path_of(answer[at:])
        gained = row.take(answer[at : at + 1 + len(path)], eos)
        if budget:
            row.acceptance.learn(weighed, gained)
        drafter.observe(row, draft, path)
        done.steps += 1
        done.tokens += len(gained)
        done.seconds += curve(1 + len(draft))
    drafter.retire(row)
    return done


def replay_all(
    answers: Sequence[tuple[list[int], list[int]]], eos: frozenset[int], curve: CostCurve, config: LookaheadConfig
) -> dict[str, Replayed]:
    """Every drafter of ``DRAFTERS`` over the (prompt, answer) pairs, in order."""
    depth = config.pool_depth
    totals = {name: Replayed() for name in DRAFTERS}
    warm = OutputPool(depth)
    for prompt, answer in answers:
        totals["prompt_lookup"].add(replay(PromptLookupDrafter(), prompt, answer, eos, curve, budget=False))
        fresh = TrieDrafter(config, OutputPool(depth))
        totals["lookahead"].add(replay(fresh, prompt, answer, eos, curve))
        totals["lookahead_warm"].add(replay(TrieDrafter(config, warm), prompt, answer, eos, curve))
        chained = TrieDrafter(config, OutputPool(depth))
        totals["lookahead_chains"].add(replay(chained, prompt, answer, eos, curve, chains=True))
    return totals


#: the forward times ``--cost-curve`` takes, in ms: 1 us (below a single GPU kernel launch) to
#: 100 s. Outside them the replay's arithmetic broke: 1e-200 ms raised ZeroDivisionError in
#: ``costs.allocate``, 1e-100 ms predicted 1e100 tokens/s
CURVE_MS_RANGE = (1e-3, 1e5)


def parse_curve(text: str) -> CostCurve:
    """``"1:15.4,8:18.3,64:20.5"`` (tokens in a forward : its milliseconds) as a cost curve, put
    through its lower hull as the loop's measured curves are; a clear error for anything else."""
    low, high = CURVE_MS_RANGE
    points = {}
    for part in text.split(","):
        tokens, sep, ms = part.strip().partition(":")
        try:
            size, cost = int(tokens), float(ms)
        except ValueError:
            size = cost = None
        if not sep or size is None or size < 1 or not low <= cost <= high:
            raise InputError(
                f"--cost-curve {text!r}: each point is TOKENS:MS, a whole number of tokens >= 1 and a "
                f"time from {low:g} to {high:.0f} milliseconds (bad point: {part.strip()!r})"
            )
        if size in points:
            raise InputError(f"--cost-curve {text!r}: {size} tokens are given twice")
        points[size] = cost / 1e3
    if len(points) < 2:
        raise InputError(f"--cost-curve {text!r}: give at least two points, e.g. 1:15.4,64:20.5")
    sizes = sorted(points)
    return lower_hull(CostCurve(sizes, [points[s] for s in sizes]))


def rows_of(totals: dict[str, Replayed]) -> list[dict]:
    """The report's table: steps, tokens a step, predicted decode tokens/s and the ratio to prompt lookup."""
    base = totals["prompt_lookup"]
    base_rate = base.tokens / base.seconds if base.seconds else 0.0
    rows = []
    for name, t in totals.items():
        rate = t.tokens / t.seconds if t.seconds else 0.0
        rows.append(
            {
                "drafter": name,
                "steps": t.steps,
                "tokens a step": round(t.tokens / t.steps, 2) if t.steps else 0.0,
                "predicted decode tok/s": round(rate, 2),
                "vs prompt lookup": f"{rate / base_rate:.3f}x" if base_rate else "-",
            }
        )
    return rows


def replay_bench(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    prompts: PromptsOption = None,
    ids: IdsOption = None,
    limit: int | None = None,
    max_new_tokens: int = 128,
    cost_curve_points: CostCurveOption = None,
    json_path: JsonOption = None,
) -> dict:
    """Replay each prompt's greedy answer through prompt lookup and lookahead: steps and predicted speed."""
    from rag_lookahead.decoding.costs import cost_curve

    given = parse_curve(cost_curve_points) if cost_curve_points is not None else None
    chosen, loaded, tokenizer, config, seen = prompts_then_model(
        prompts, ids, limit, max_new_tokens, json_path, model, dtype, device, trust_remote_code=trust_remote_code
    )
    with report_despite_stdout(json_path):
        dtype = dtype_label(loaded, dtype)  # what ran, not the option
        answers = [
            (prompt_ids, result.sequences[0, len(prompt_ids) : len(prompt_ids) + result.stats.new_tokens].tolist())
            for prompt_ids, result in fresh_pool_answers(loaded, tokenizer, chosen, config, max_new_tokens)
        ]
        eos_ids, _ = eos_pad(loaded, tokenizer)
        curve = given or cost_curve(loaded)
        rows = rows_of(replay_all(answers, frozenset(eos_ids), curve, config))
        priced = f"the curve {cost_curve_points}" if given else "its cost curve"
        print_rows(
            f"replayed greedy answers ({len(chosen)} prompts, {model} {dtype}, forwards priced by {priced})", rows
        )
        report = {
            "model": model,
            "dtype": dtype,
            "prompts": len(chosen),
            "max_new_tokens": max_new_tokens,
            "cost_curve_ms": {n: round(1e3 * s, 3) for n, s in zip(curve.sizes, curve.seconds)},
            "drafters": rows,
        }
        if json_path:
            write_report(json_path, report, seen=seen)
    return report


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.replay [options]``: the report (an exit code for --help)."""
    return run_command(replay_bench, argv, PROG)


if __name__ == "__main__":
    main()
