"""Sizing drafts: the cost budget (``costs.allocate``, ``StepCosts``) and each row's acceptance rates
(pure Python, no model)."""

from __future__ import annotations

import pytest

from rag_lookahead.decoding.acceptance import AcceptanceRates
from rag_lookahead.decoding.costs import CostCurve, StepCosts, allocate, lower_hull
from rag_lookahead.decoding.draft import DraftTree


def _costs(curve, rows_seen):
    costs = StepCosts(curve)
    for rows in rows_seen:
        costs.observe(rows, rows, curve(rows))
    return costs


def _chain(probs):
    n = len(probs)
    return DraftTree(
        tokens=list(range(n)), parents=list(range(-1, n - 1)), depths=list(range(1, n + 1)), probs=list(probs)
    )


# cost per forward: nearly flat for a few tokens, then linear (a CPU)
CPU_CURVE = CostCurve([1, 8, 16, 64, 256, 1024], [0.050, 0.057, 0.066, 0.14, 0.55, 2.2])


def test_draft_nodes_per_row_shrink_as_the_batch_grows():
    costs = _costs(CPU_CURVE, (1, 4, 16, 64))
    draft = _chain([0.6**d for d in range(1, 9)])
    per_row = []
    for rows in (1, 4, 16, 64):
        counts = allocate([draft] * rows, costs)
        assert len(counts) == rows and all(0 <= c <= len(draft) for c in counts)
        per_row.append(sum(counts) / rows)
    assert per_row[0] >= 3
    assert per_row == sorted(per_row, reverse=True)
    assert per_row[-1] == 0
    assert allocate([draft, draft], None) == [len(draft)] * 2  # fixed budget: every candidate


def test_several_rows_draft_only_for_a_clear_gain():
    steep = CostCurve([1, 2, 4, 8], [0.100, 0.190, 0.360, 0.700])  # compute-bound: a token costs almost a step
    sure = _chain([0.95])
    assert allocate([sure], _costs(steep, (1,))) == [1]  # one row: any gain pays (3% here)
    assert allocate([sure, sure], _costs(steep, (2,))) == [0, 0]  # 3% for two rows: not worth finishing apart
    flat = CostCurve([1, 64], [0.100, 0.110])
    assert allocate([_chain([0.9] * 8)] * 2, _costs(flat, (2,))) == [8, 8]  # a clear gain still drafts


def test_a_point_timed_slow_is_lowered_to_the_chord_of_its_neighbours():
    timed = CostCurve([1, 4, 8, 16, 32, 64, 128], [0.077, 0.092, 0.118, 0.154, 0.289, 0.383, 0.751])
    hull = lower_hull(timed)
    assert hull.sizes == timed.sizes
    assert hull(32) <= 0.154 + (0.383 - 0.154) * 16 / 48  # 32 was timed slow: at most its neighbours' chord
    assert all(h <= t for h, t in zip(hull.seconds, timed.seconds))  # never raised
    assert hull(1) == 0.077 and hull(64) == 0.383 and hull(128) == 0.751
    slopes = [(b - a) / (y - x) for x, y, a, b in zip(hull.sizes, hull.sizes[1:], hull.seconds, hull.seconds[1:])]
    assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))  # no extra token costs less than the one before
    assert lower_hull(CPU_CURVE).seconds == CPU_CURVE.seconds  # already convex: unchanged


def test_nodes_go_to_the_rows_likely_to_accept_them():
    costs = _costs(CPU_CURVE, (3,))
    sure, unsure, empty = _chain([0.95] * 10), _chain([0.05] * 10), DraftTree()
    counts = allocate([sure, unsure, empty], costs)
    assert counts[0] >= 5 and counts[1] == 0 and counts[2] == 0
    distrusted = AcceptanceRates()
    for _ in range(10):
        distrusted.observe(sure, [])  # this row's drafts keep failing at the first token
    assert allocate([distrusted.weigh(sure), unsure, empty], costs)[0] == 0


def test_acceptance_rates_learn_how_deep_a_row_keeps_copying():
    costs = _costs(CPU_CURVE, (1,))
    chain = _chain([1.0] * 24)  # a phrase seen once: the counts alone say every node is sure
    paraphrasing, copying = AcceptanceRates(), AcceptanceRates()
    for _ in range(12):
        paraphrasing.observe(chain, [0, 1])  # two tokens accepted, then the answer departs
        copying.observe(chain, list(range(24)))  # the whole draft accepted
    short = paraphrasing.weigh(chain)
    assert short.probs == sorted(short.probs, reverse=True) and short.probs[0] > 0.9 and short.probs[3] < 0.3
    assert allocate([short], costs)[0] <= 8
    assert allocate([copying.weigh(chain)], costs)[0] == 24
    for _ in range(8):  # the paraphrasing row starts quoting: every draft it verifies is accepted
        k = allocate([paraphrasing.weigh(chain)], costs)[0]
        paraphrasing.observe(chain.top(k), list(range(k)))
    assert allocate([paraphrasing.weigh(chain)], costs)[0] == 24
    written_off = AcceptanceRates()
    for _ in range(20):
        written_off.observe(chain, [])
    assert allocate([written_off.weigh(chain)], costs)[0] == 0
    for _ in range(10):  # steps without drafts: the row gets probed again
        written_off.observe(DraftTree(), [])
    assert allocate([written_off.weigh(chain)], costs)[0] >= 1


def test_one_node_drafts_do_not_keep_a_row_shallow_for_good():
    """Accepted single-token drafts say nothing about depth: onward drifts back up, so the row
    tries deeper drafts again instead of one-node drafts for the rest of its answer."""
    chain = _chain([1.0] * 24)
    rates = AcceptanceRates()
    for _ in range(6):
        rates.observe(chain, [0])  # the answer departs after one token, every time
    low = rates.onward
    assert low < 0.2
    for _ in range(10):
        rates.observe(chain.top(1), [0])  # cheap one-node drafts, each accepted
    assert rates.onward > 2 * low and rates.first > 0.9


def test_a_draft_tree_finds_the_path_its_tokens_spell():
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 2], depths=[1, 2, 2, 3], probs=[1.0, 0.5, 0.5, 0.5])
    assert tree.path_of([5, 7, 8, 9]) == [0, 2, 3]
    assert tree.path_of([5, 6, 8]) == [0, 1]
    assert tree.path_of([6]) == [] and tree.path_of([]) == []


def test_nodes_the_budget_cut_are_judged_by_the_bonus_token():
    """open_end: the bonus token matched the first cut node, so nothing below it is known to
    fail. A row kept to one-node drafts then learns onward from each step (and recovers fast),
    and a verified failure below still counts as one."""
    chain = _chain([1.0] * 24)
    judged, blind = AcceptanceRates(), AcceptanceRates()
    for rates in (judged, blind):
        for _ in range(6):
            rates.observe(chain, [0])  # the answer departs after one token
    for _ in range(3):
        judged.observe(chain, [0, 1], open_end=True)  # verified [0]; the bonus equals the cut node 1
        blind.observe(chain.top(1), [0])  # the same step judged on the verified node alone
    assert judged.onward > 0.5 > blind.onward
    failing, open_below = AcceptanceRates(), AcceptanceRates()
    failing.observe(chain, [0, 1])  # node 1's child was verified and failed
    open_below.observe(chain, [0, 1], open_end=True)  # node 1's child was never verified
    start = AcceptanceRates().onward
    assert failing.onward < start < open_below.onward  # a failure below lowers it; an open end only adds a hit
    # learn() finds that from the step's tokens: the bonus token 6 spells the cut node 1 (open end)
    cut = DraftTree.chain([5, 6, 7])
    learned, observed = AcceptanceRates(), AcceptanceRates()
    assert learned.learn(cut, [5, 6]) == ([0, 1], True)
    observed.observe(cut, [0, 1], open_end=True)
    assert learned.onward == observed.onward > start
    departed, observed = AcceptanceRates(), AcceptanceRates()
    assert departed.learn(cut, [5, 9]) == ([0], False)  # the bonus token 9 is no node: node 0's child failed
    observed.observe(cut, [0])
    assert departed.onward == observed.onward < start


def test_a_joining_row_starts_from_what_the_batch_has_met():
    costs = _costs(CPU_CURVE, (16,))
    chain = _chain([1.0] * 24)
    workload = AcceptanceRates(decay=0.97)
    for _ in range(40):  # the batch's rows keep paraphrasing after one or two tokens
        workload.observe(chain, [0])
    copying_workload = AcceptanceRates(decay=0.97)
    for _ in range(40):  # another batch's rows copy whole drafts
        copying_workload.observe(chain, list(range(24)))
    informed, trusting = AcceptanceRates(prior=workload), AcceptanceRates(prior=copying_workload)
    assert abs(informed.onward - workload.onward) < 1e-9 and informed.onward < 0.1
    many_trusting = allocate([trusting.weigh(chain)] * 16, costs)
    many_informed = allocate([informed.weigh(chain)] * 16, costs)
    many_fresh = allocate([AcceptanceRates().weigh(chain)] * 16, costs)
    assert sum(many_informed) * 4 <= sum(many_trusting)  # no deep trees where the batch paraphrases
    assert sum(many_informed) <= sum(many_fresh) < sum(many_trusting)  # nothing met yet: a cautious start
    for _ in range(3):  # its own copying soon outweighs the prior
        informed.observe(chain, list(range(24)))
    assert informed.onward > 0.9 and allocate([informed.weigh(chain)], _costs(CPU_CURVE, (1,)))[0] == 24


def test_measured_step_costs_override_the_curve():
    draft = _chain([0.9, 0.8, 0.7, 0.6])
    costs = StepCosts(CPU_CURVE)
    assert allocate([draft] * 4, costs) == [0] * 4  # a new batch size: measure plain first
    costs.observe(4, 4, CPU_CURVE(4))
    assert allocate([draft] * 4, costs) == [4] * 4  # the curve says drafting pays
    for tokens in range(5, 21):  # but drafting steps turned out 5x dearer than the curve said
        costs.observe(4, tokens, 5 * CPU_CURVE(tokens))
    assert allocate([draft] * 4, costs) == [0] * 4


def test_a_forward_slowed_by_another_process_does_not_enter_the_curve():
    """The curve is kept on disk, so one contended run must not set it: each size takes its
    fastest run. Here the second of two timed 4-token forwards is made 2 s slower, as a busy CPU would."""
    import time

    from rag_lookahead.decoding.costs import measure_cost
    from rag_lookahead.tiny import build_tiny_model

    model = build_tiny_model("qwen2")
    forward = model.forward
    calls = {"n": 0}

    def sometimes_slow(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[-1] == 4:
            calls["n"] += 1
            if calls["n"] == 3:  # the first call is the warm-up
                time.sleep(2.0)
        return forward(*args, **kwargs)

    model.forward = sometimes_slow
    curve = measure_cost(model, context=16, sizes=(1, 4, 8), repeats=2)
    assert calls["n"] == 3
    assert curve.seconds[1] < 1.0, curve.seconds  # not the slowed run (> 2 s)
    assert curve.seconds == sorted(curve.seconds)  # more tokens never cost less


def test_a_first_row_with_nothing_met_does_not_verify_its_deepest_tree():
    """The model's first row (every ``ask``: a process per question) starts from ``START``, not
    from trust: a phrase seen once is drafted, but not 24 deep on the counts alone; a row whose
    drafts are then accepted whole goes deep within a few steps."""
    costs = _costs(CPU_CURVE, (1,))
    chain = _chain([1.0] * 24)
    fresh = AcceptanceRates()
    assert (fresh.first, fresh.onward) == AcceptanceRates.START
    first = allocate([fresh.weigh(chain)], costs)[0]
    assert 1 <= first < 24
    for _ in range(4):
        k = allocate([fresh.weigh(chain)], costs)[0]
        fresh.observe(chain.top(k), list(range(k)))
    assert allocate([fresh.weigh(chain)], costs)[0] == 24


def test_step_costs_are_safe_to_share_between_threads():
    """Two calls on one model in two threads share its StepCosts: one thread's new (rows, tokens)
    entry must not break the other's estimate (it raised "dictionary changed size")."""
    import sys
    import threading
    import time

    costs = StepCosts(CostCurve([1, 64], [0.1, 0.4]))
    costs.observe(1, 1, 0.1)
    errors: list[BaseException] = []
    stop = threading.Event()

    def estimate() -> None:
        try:
            while not stop.is_set():
                costs(1, 33)
                time.sleep(0)  # lets the writer take the lock (it waited minutes for it)
        except BaseException as err:  # noqa: BLE001 - the test reports whatever broke
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=estimate)
    reader.start()
    try:
        for tokens in range(2, 8_000, 2):  # never 33: the estimate scans every entry for the nearest
            costs.observe(1, tokens, 0.1 + tokens / 1e5)
            if errors:
                break
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(costs.seen) == 4_000  # (1, 1) and the 3,999 even counts


def test_a_curve_goes_on_rising_past_its_largest_timed_size():
    """A step larger than any size timed (many rows, deep drafts) costs more than the largest:
    held flat at the last point, the budget saw the extra tokens as free and drafted them."""
    curve = CostCurve([1, 4, 8], [1.0, 1.5, 2.0])
    assert curve(16) == 3.0  # the last segment's slope, carried on
    assert CostCurve([1, 4, 8], [1.0, 2.0, 1.8])(16) == 1.8  # a falling last segment is not carried on


def test_an_unseen_token_count_is_scaled_like_the_nearest_seen_one():
    """Steps of one row measured at 1, 4 and 40 tokens: a 5-token step is predicted from the
    curve scaled as the 4-token step was (2.0 s where the curve said 1.3), not as the plain
    1-token step was (exactly the curve), and a 35-token one like the 40-token step."""
    curve = CostCurve([1, 64], [1.0, 7.3])  # 0.1 s a token
    costs = StepCosts(curve)
    costs.observe(1, 1, 1.0)
    costs.observe(1, 4, 2.0)
    costs.observe(1, 40, 30.0)
    assert costs(1, 5) == pytest.approx(curve(5) * 2.0 / curve(4))  # 2.154
    assert costs(1, 35) == pytest.approx(curve(35) * 30.0 / curve(40))
    assert costs(1, 4) == 2.0  # a count seen: its own time
