"""PackedCache moves KV columns between rows correctly (pure tensor bookkeeping, no model)."""

from types import SimpleNamespace

import torch

from rag_lookahead.decoding.packed_cache import PackedCache


def _prefill(rows: list[list[int]]):
    """A left-padded two-layer 'cache' whose entries are the token values (pad = -1)."""
    width = max(len(r) for r in rows)
    keys = torch.tensor([[-1] * (width - len(r)) + r for r in rows], dtype=torch.float32)[:, None, :, None]
    layers = [SimpleNamespace(keys=keys.clone(), values=keys.clone() * 10) for _ in range(2)]
    return SimpleNamespace(layers=layers)


def _row_columns(packed: PackedCache, row: int) -> list[int]:
    keys = packed.cache.layers[1].keys[0, 0, :, 0]
    assert torch.equal(packed.cache.layers[1].values[0, 0, :, 0], keys * 10)
    return [int(v) for v in keys[packed.owned[row]]]


def test_rows_keep_their_own_columns_through_join_accept_and_leave():
    packed = PackedCache()
    packed.append_rows(_prefill([[1, 2, 3], [4]]), [3, 1])
    packed.append_rows(_prefill([[6]]), [1])
    assert packed.rows == 3 and packed.length == 5
    assert [_row_columns(packed, r) for r in range(3)] == [[1, 2, 3], [4], [6]]

    # a verify step appended 2 + 1 + 3 tokens; keep row 0's root and 1st node, row 1's root, row 2's root and 2nd node
    step = torch.tensor([7, 70, 8, 9, 90, 91], dtype=torch.float32)[None, None, :, None]
    for layer in packed.cache.layers:
        layer.keys = torch.cat([layer.keys, step], dim=2)
        layer.values = torch.cat([layer.values, step * 10], dim=2)
    packed.keep_new(5, [0, 1, 2, 3, 5], [0, 0, 1, 2, 2])
    assert packed.length == 10
    assert [_row_columns(packed, r) for r in range(3)] == [[1, 2, 3, 7, 70], [4, 8], [6, 9, 91]]

    packed.drop_rows([0, 2])  # row 1 leaves: 2 of 10 columns are dead, below a quarter: kept
    assert packed.length == 10 and [_row_columns(packed, r) for r in range(2)] == [[1, 2, 3, 7, 70], [6, 9, 91]]
    packed.drop_rows([1])  # one row left: its cache is made hole-free
    assert packed.length == 3 and bool(packed.owned.all()) and _row_columns(packed, 0) == [6, 9, 91]
    packed.drop_rows([])
    assert packed.cache is None and packed.rows == 0


def test_dead_columns_are_reclaimed_once_they_are_a_quarter():
    packed = PackedCache()
    packed.append_rows(_prefill([[1], [2], [3, 4, 5]]), [1, 1, 3])
    packed.drop_rows([0, 1])  # 3 of 5 columns dead
    assert packed.length == 2 and [_row_columns(packed, r) for r in range(2)] == [[1], [2]]
    exactly = PackedCache()
    exactly.append_rows(_prefill([[1, 2], [3, 4, 5], [6, 7, 8]]), [2, 3, 3])
    exactly.drop_rows([1, 2])  # 2 of 8 columns dead: exactly a quarter, reclaimed
    assert exactly.length == 6 and [_row_columns(exactly, r) for r in range(2)] == [[3, 4, 5], [6, 7, 8]]


def _host_columns_agree(packed: PackedCache) -> bool:
    """The host-side ``row_columns`` are the columns ``owned`` gives each row."""
    return [cols.tolist() for cols in packed.row_columns()] == [
        packed.owned[r].nonzero().flatten().tolist() for r in range(packed.rows)
    ]


def test_row_columns_follow_joins_chunks_accepts_and_leaves():
    packed = PackedCache()
    packed.append_rows(_prefill([[1, 2, 3], [4]]), [3, 1])
    packed.add_rows(1)  # a chunked-prefill row: no columns yet
    assert _host_columns_agree(packed) and packed.row_columns()[2].tolist() == []
    step = torch.arange(6, dtype=torch.float32)[None, None, :, None]
    for layer in packed.cache.layers:
        layer.keys = torch.cat([layer.keys, step], dim=2)
        layer.values = torch.cat([layer.values, step * 10], dim=2)
    packed.keep_new(4, [0, 2, 3, 4, 5], [0, 1, 2, 2, 2])  # row 2's chunk of 3 and one token each for rows 0, 1
    assert _host_columns_agree(packed) and [c.tolist() for c in packed.row_columns()] == [
        [0, 1, 2, 4],
        [3, 5],
        [6, 7, 8],
    ]
    packed.drop_rows([0, 2])  # 2 of 9 dead: kept as holes
    assert packed.length == 9 and _host_columns_agree(packed)
    packed.append_rows(_prefill([[9, 9]]), [2])
    assert _host_columns_agree(packed)
    packed.drop_rows([1, 2])  # 6 of 11 dead: reclaimed
    assert packed.length == 5 and _host_columns_agree(packed) and packed.hole_free
    assert [c.tolist() for c in packed.row_columns()] == [[0, 1, 2], [3, 4]]


def test_the_last_row_left_gets_a_cache_without_holes_however_few_are_dead():
    """One dead column of ten is under a quarter, but with one row left the cache is compacted
    anyway: only a hole-free single row verifies its chains under the plain causal mask
    (``verify.is_plain_causal``); kept, the hole cost it that path for the rest of its answer."""
    packed = PackedCache()
    packed.append_rows(_prefill([[1, 2, 3, 4, 5, 6, 7, 8, 9], [10]]), [9, 1])
    assert packed.length == 10
    packed.drop_rows([0])
    assert packed.length == 9 and packed.hole_free and _row_columns(packed, 0) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
