"""The replay takes exactly the steps the real loop takes on the same answer (a tiny model's)."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model, tiny_model

from rag_lookahead.bench.replay import DRAFTERS, Replayed, parse_curve, replay, replay_all, rows_of
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import CostCurve
from rag_lookahead.decoding.drafter import PromptLookupDrafter, TrieDrafter
from rag_lookahead.decoding.loop import generate
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.errors import InputError

CURVE = CostCurve([1, 8, 16, 64], [0.07, 0.08, 0.10, 0.24])
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 4 + [5, 6], [3, 4, 3, 4, 12, 13, 14, 15, 3, 4, 12], [21, 22, 23, 24, 21, 22]]


def _fixed(drafter_of, tree_mask: bool = True):
    """(prompt, answer, the loop's decode steps) with every candidate verified (fixed budget);
    ``tree_mask`` False: the model counts as one whose attention takes no tree mask (chains)."""
    model = build_tiny_model("qwen2", seed=0) if not tree_mask else tiny_model("qwen2")  # the cached one keeps its mask
    profile_of(model).tree_mask = tree_mask
    config = LookaheadConfig(budget="fixed", decoding_length=12, branch_length=6)
    runs = []
    for prompt in PROMPTS:
        result = generate(
            model, prompt, max_new_tokens=20, config=config, eos_token_id=None, drafter=drafter_of(config)
        )
        runs.append((prompt, result.sequences[0, len(prompt) :].tolist(), result.stats.forward_passes))
    return config, runs


@pytest.mark.parametrize("kind", ["trie", "prompt_lookup"])
def test_a_fixed_budget_replay_takes_the_loops_own_steps(kind):
    def drafter_of(config):
        return TrieDrafter(config, OutputPool(config.pool_depth)) if kind == "trie" else PromptLookupDrafter()

    config, runs = _fixed(drafter_of)
    assert any(steps < len(answer) - 1 for _, answer, steps in runs)  # drafts were accepted somewhere
    for prompt, answer, steps in runs:
        replayed = replay(drafter_of(config), prompt, answer, frozenset(), CURVE, budget=False)
        assert replayed.steps == steps
        assert replayed.tokens == len(answer) - 1


def test_an_answer_ending_at_eos_stops_there_and_a_one_token_answer_takes_no_step():
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    done = replay(PromptLookupDrafter(), prompt, [3, 4, 99], frozenset({99}), CURVE, budget=False)
    assert (done.steps, done.tokens) == (1, 2)  # "3" came with the prefill; "4" drafted, EOS the bonus
    assert replay(PromptLookupDrafter(), prompt, [99], frozenset({99}), CURVE) == Replayed()


def test_each_step_is_priced_as_a_forward_of_its_draft_and_the_token_before_it():
    sizes = []

    class Noting(PromptLookupDrafter):
        def observe(self, row, draft, path):
            sizes.append(len(draft))
            super().observe(row, draft, path)

    curve = parse_curve("1:10,16:40")  # 10 ms + 2 ms a token
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 2 + [1, 2]
    done = replay(
        Noting(), prompt, [3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 99], frozenset({99}), curve, budget=False
    )
    assert done.steps == len(sizes) > 0 and any(sizes)
    assert done.seconds == pytest.approx(sum(0.010 + 0.002 * size for size in sizes))


def test_the_table_gives_tokens_a_step_and_the_rate_over_prompt_lookups():
    rows = rows_of({"prompt_lookup": Replayed(10, 20, 1.0), "lookahead": Replayed(5, 20, 0.5)})
    assert rows[1]["tokens a step"] == 4.0 and rows[1]["predicted decode tok/s"] == 40.0
    assert rows[1]["vs prompt lookup"] == "2.000x" and rows[0]["vs prompt lookup"] == "1.000x"


def test_the_budgeted_replay_gains_every_answer_token_and_prices_each_step():
    config = LookaheadConfig(decoding_length=12, branch_length=6)
    prompt = [5, 6, 7, 8, 9, 10, 11] * 4 + [5, 6]
    answer = [7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]
    totals = replay_all([(prompt, answer)] * 2, frozenset(), CURVE, config)
    assert set(totals) == set(DRAFTERS)
    for t in totals.values():
        assert t.tokens == 2 * (len(answer) - 1)
        assert CURVE(1) * t.steps <= t.seconds <= CURVE(13) * t.steps
        assert t.steps < t.tokens  # the answer copies the prompt: steps gain several tokens
    rows = rows_of(totals)
    assert [r["drafter"] for r in rows] == list(DRAFTERS) and rows[0]["vs prompt lookup"] == "1.000x"


def test_a_chains_replay_takes_the_steps_of_the_loop_without_a_tree_mask():
    def drafter_of(config):
        return TrieDrafter(config, OutputPool(config.pool_depth))

    config, runs = _fixed(drafter_of, tree_mask=False)
    for prompt, answer, steps in runs:
        replayed = replay(drafter_of(config), prompt, answer, frozenset(), CURVE, budget=False, chains=True)
        assert replayed.steps == steps
        assert replayed.tokens == len(answer) - 1


def test_a_given_cost_curve_is_read_in_milliseconds_and_put_through_its_lower_hull():
    curve = parse_curve(" 64:20.5, 1:15.4,8:30,16:18.3")
    assert curve.sizes == [1, 8, 16, 64]
    assert curve(1) == pytest.approx(0.0154) and curve(64) == pytest.approx(0.0205)
    chord = lambda n: 0.0154 + (0.0205 - 0.0154) * (n - 1) / 63  # noqa: E731
    assert curve(8) == pytest.approx(chord(8)) and curve(16) == pytest.approx(chord(16))  # both sat above it


# 1e-200 ms raised ZeroDivisionError in costs.allocate, 1e-100 ms predicted 1e100 tokens/s
OUT_OF_RANGE = ["1:1e-200,2:1e-200", "1:1e-100,8:4", "1:15,8:0.0001", "1:15,8:2e5", "1:inf,8:4"]


@pytest.mark.parametrize(
    "text", ["", "1:15", "1:15,x", "0:3,8:4", "1:-2,8:4", "1:15,8", "1:15,1:16", "1:nan,8:4", *OUT_OF_RANGE]
)
def test_a_bad_cost_curve_is_refused_with_the_point_named(text):
    with pytest.raises(InputError, match="--cost-curve"):
        parse_curve(text)


def test_lookahead_warm_drafts_from_the_answers_before_it():
    """``lookahead_warm`` keeps one pool over the answers: the second of two equal answers comes
    whole from the first (in two steps, the budget's), where a fresh pool per answer drafts nothing
    from tokens never seen."""
    config = LookaheadConfig()
    answer = list(range(20, 61))  # 41 distinct tokens, none in the prompt
    totals = replay_all([([1, 2, 3], answer)] * 2, frozenset(), CURVE, config)
    assert totals["lookahead"].steps == 2 * (len(answer) - 1) == 80  # one token a step
    assert totals["lookahead_warm"].steps == len(answer) - 1 + 2 == 42  # the second answer in two steps
    assert totals["lookahead_warm"].tokens == totals["lookahead"].tokens


def test_a_budgeted_replay_learns_the_rows_acceptance_as_the_loop_does():
    """Each step's outcome feeds the row's acceptance rates, which size the next drafts: an answer
    that keeps repeating is drafted deeper as its drafts keep being accepted."""
    config = LookaheadConfig()
    done = replay(
        TrieDrafter(config, OutputPool(config.pool_depth)), [1, 2, 3], [5, 6, 7, 8, 9] * 12, frozenset(), CURVE
    )
    assert (done.steps, done.tokens) == (10, 59)  # 12 steps where nothing was learned
