"""Every row's KV entries in one batch-1 cache, kept apart by a mask.

Why not one cache row per request: rows draft different numbers of nodes and accept different
numbers of tokens. In a (rows, width) layout every row is padded to the widest tree, and on a
CPU a forward's cost grows with the tokens it carries, so a row with nothing to draft pays for
the padding as if it had. Here the rows' new tokens sit side by side in one sequence (no
padding), their cache columns are interleaved in one cache, and ``owned[r, c]`` says that
column c belongs to row r; the 4-D attention mask built from it keeps every row to its own
columns and its own tree.

The ownership matrix lives on the cache's device, so a step's mask is built there and no
(rows, columns) matrix crosses to a GPU per step; how many columns each row owns is also
counted on the host, so deciding whether a step needs a mask never waits for the device.
The owner of each column is kept on the host too (``row_columns``): row-local attention
(``row_attention``) gathers each row's columns with it, without a device round trip per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from rag_lookahead.decoding.forward_signature import EMPTY_CACHE, cache_left_empty


class PackedCache:
    """A ``DynamicCache`` of batch 1 plus the owner of each column."""

    def __init__(self) -> None:
        self.cache = None  # transformers DynamicCache, batch 1
        self.owned = torch.zeros((0, 0), dtype=torch.bool)  # (rows, columns), on the cache's device
        self._row_columns: list[int] = []  # per row: how many columns it owns (host copy of owned.sum(1))
        self._owner = np.zeros(0, dtype=np.int64)  # per column: the row that owns it, -1 none (host copy of owned)

    @property
    def length(self) -> int:
        return self.owned.shape[1]

    @property
    def rows(self) -> int:
        return self.owned.shape[0]

    @property
    def hole_free(self) -> bool:
        """Every column belongs to some row (with one row: its cache is contiguous)."""
        return sum(self._row_columns) == self.length

    def append_rows(self, prefill_cache, lengths: list[int]) -> None:
        """Add rows from a left-padded prefill cache; row r's entries are its last ``lengths[r]`` columns."""
        if cache_left_empty(prefill_cache):  # prefill_padded says why where it can (forward_signature)
            # a forward that takes **kwargs but keeps no cache (OpenAI GPT) leaves it empty
            raise NotImplementedError(EMPTY_CACHE)
        width = prefill_cache.layers[0].keys.shape[2]
        starts = [width - n for n in lengths]

        def packed(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.shape[0] == 1 and starts[0] == 0:
                return tensor
            return torch.cat([tensor[r : r + 1, :, start:] for r, start in enumerate(starts)], dim=2)

        for index, layer in enumerate(prefill_cache.layers):
            keys, values = packed(layer.keys), packed(layer.values)
            if self.cache is None:
                layer.keys, layer.values = keys, values
            else:
                mine = self.cache.layers[index]
                mine.keys = torch.cat([mine.keys, keys], dim=2)
                mine.values = torch.cat([mine.values, values], dim=2)
        if self.cache is None:
            self.cache = prefill_cache
        device = self.cache.layers[0].keys.device
        block = torch.block_diag(*(torch.ones((1, n), dtype=torch.bool) for n in lengths))
        self.owned = torch.block_diag(self.owned.to(device), block.to(device))
        self._owner = np.concatenate([self._owner, np.repeat(np.arange(self.rows - len(lengths), self.rows), lengths)])
        self._row_columns += [int(n) for n in lengths]

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """Within: appends that fail part-way (out of memory in a layer's concatenation, say) are
        undone, so the rows and their columns never disagree. Grown layers are cut back to their
        old length (a view, as ``DynamicCache.crop`` does) rather than kept whole beside the new
        ones, which would double the cache's memory while rows join."""
        cache, length = self.cache, self.length
        bookkeeping = (self.owned, self._owner, list(self._row_columns))
        try:
            yield
        except BaseException:
            if cache is None:
                self.cache = None
            else:
                for layer in cache.layers:
                    if layer.keys.shape[2] > length:
                        layer.keys = layer.keys[:, :, :length]
                    if layer.values.shape[2] > length:
                        layer.values = layer.values[:, :, :length]
            self.owned, self._owner, self._row_columns = bookkeeping
            raise

    def row_columns(self) -> list[np.ndarray]:
        """Per row, the columns it owns in ascending order (host-side, from ``owned``'s host copy)."""
        order = np.argsort(self._owner, kind="stable")
        ends = np.cumsum(self._row_columns)
        starts = ends - np.asarray(self._row_columns, dtype=np.int64)
        dead = self.length - int(ends[-1]) if len(ends) else 0
        return [order[dead + start : dead + end] for start, end in zip(starts, ends)]

    def add_rows(self, count: int) -> None:
        """Rows that own no columns yet: under chunked prefill a prompt arrives a chunk per step,
        each chunk's columns kept by ``keep_new`` like a fully accepted draft."""
        empty = torch.zeros((count, self.length), dtype=torch.bool, device=self.owned.device)
        self.owned = torch.cat([self.owned, empty], dim=0)
        self._row_columns += [0] * count

    def ensure_cache(self, new_cache, device: torch.device) -> None:
        """Start an empty cache (``new_cache()``) for a forward that fills it; ``owned`` moves to ``device``."""
        if self.cache is None:
            self.cache = new_cache()
            self.owned = self.owned.to(device)

    def keep_new(self, start: int, keep: list[int], owners: list[int]) -> None:
        """After a verify step: of the columns from ``start`` on, keep ``keep`` (owned by ``owners``)."""
        count = len(keep)
        if keep != list(range(count)):
            index = None
            for layer in self.cache.layers:
                if index is None or index.device != layer.keys.device:
                    index = torch.tensor(keep, device=layer.keys.device)
                layer.keys[:, :, start : start + count] = layer.keys[:, :, start:].index_select(2, index)
                layer.values[:, :, start : start + count] = layer.values[:, :, start:].index_select(2, index)
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, : start + count]
            layer.values = layer.values[:, :, : start + count]
        block = torch.zeros((self.rows, count), dtype=torch.bool)
        block[torch.tensor(owners, dtype=torch.long), torch.arange(count)] = True
        self.owned = torch.cat([self.owned[:, :start], block.to(self.owned.device)], dim=1)
        self._owner = np.concatenate([self._owner[:start], np.asarray(owners, dtype=np.int64)])
        for owner in owners:
            self._row_columns[owner] += 1

    def drop_rows(self, stay: list[int]) -> None:
        """Keep only rows ``stay``; reclaim the columns nobody owns once they are a quarter of the
        cache, or when one row is left (its cache then has no holes and runs unmasked)."""
        if not stay:
            self.cache, self.owned, self._row_columns = None, torch.zeros((0, 0), dtype=torch.bool), []
            self._owner = np.zeros(0, dtype=np.int64)
            return
        renumber = np.full(self.rows + 1, -1, dtype=np.int64)  # old row + 1 -> new row (-1: left or none)
        renumber[np.asarray(stay, dtype=np.int64) + 1] = np.arange(len(stay))
        self._owner = renumber[self._owner + 1]
        self.owned = self.owned[torch.tensor(stay, dtype=torch.long, device=self.owned.device)]
        self._row_columns = [self._row_columns[r] for r in stay]
        dead = self.length - sum(self._row_columns)
        if dead and (4 * dead >= self.length or len(stay) == 1):
            index = torch.from_numpy(np.flatnonzero(self._owner >= 0)).to(self.owned.device)
            for layer in self.cache.layers:
                cols = index.to(layer.keys.device)
                layer.keys = layer.keys.index_select(2, cols)
                layer.values = layer.values.index_select(2, cols)
            self.owned = self.owned[:, index]
            self._owner = self._owner[self._owner >= 0]
