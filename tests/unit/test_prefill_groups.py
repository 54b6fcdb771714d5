"""How rows joining together are split into prefill forwards (``decode_batch.prefill_groups``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rag_lookahead.decoding.decode_batch import prefill_groups


@given(st.lists(st.integers(min_value=1, max_value=400), max_size=40), st.integers(min_value=1, max_value=2048))
def test_groups_cover_every_row_in_order_within_the_budget(lengths, most):
    groups = prefill_groups(lengths, most)
    assert [r for g in groups for r in range(len(lengths))[g]] == list(range(len(lengths)))
    for g in groups:
        rows = lengths[g]
        assert rows, "no empty group"
        assert len(rows) == 1 or max(rows) * len(rows) <= most  # a longer prompt stands alone
    for before, after in zip(groups, groups[1:]):  # greedy: the next row would not have fitted
        joined = lengths[before.start : after.start + 1]
        assert max(joined) * len(joined) > most


def test_examples():
    assert prefill_groups([200] * 32, 1024) == [slice(i, min(i + 5, 32)) for i in range(0, 32, 5)]
    assert prefill_groups([3000, 10, 10], 1024) == [slice(0, 1), slice(1, 3)]
    assert prefill_groups([], 1024) == []
