"""Prefill: new rows' prompts into the packed cache, in one forward or a chunk per decode step.

Unchunked, ``prefill_padded`` runs the new (left-padded) prompts in one forward, and a long prompt
stalls every running row for as long as it takes. Chunked (as vLLM schedules it), a new row waits
in ``ChunkedPrefill`` and its prompt goes through the decode steps a chunk at a time, under one
token budget per step: each chunk rides in the same forward as the running rows' draft trees,
as a chain the 4-D mask keeps to its own row (it is a draft that is accepted whole), so a
running stream waits for at most one chunk between its tokens. The step that carries a prompt's
last chunk also gives the row its first token, and from the next step on it decodes.

Lossless: every chunk token sees exactly its row's earlier columns at its own position, so the
KV entries and the first token's logits are those of the one-forward prefill (up to summation
order).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rag_lookahead.decoding.attention_backends import without_cudnn_attention
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.forward_signature import check_cache_filled
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.decoding.positions import position_origin
from rag_lookahead.decoding.row_attention import ROW_LAYOUT, row_layout, row_local_applies
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.verify import (
    StepInputs,
    input_device,
    is_plain_causal,
    step_inputs,
    step_mask,
)
from rag_lookahead.decoding.windows import full_cache
from rag_lookahead.greedy_head import capture_hidden, greedy_head_of

__all__ = ["ChunkedPrefill", "StepFeed", "forward_feed", "prefill_padded", "step_feed"]


def prefill_padded(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """One forward over left-padded prompts: their cache and the logits of each row's last token."""
    cache = full_cache(model)
    origin = position_origin(model, input_ids.device)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0) + origin
    with without_cudnn_attention(input_ids.device):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
    check_cache_filled(model, cache)
    return cache, logits


class ChunkedPrefill:
    """Rows waiting for their prompt to enter the cache, and each step's budget of prompt tokens.

    At most one row is part-way through its prompt at a time: a row joins only while the budget
    lasts, so the one that uses it up is the first served in the next step.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget  # prompt tokens per step, all rows together
        self.waiting: collections.deque[Row] = collections.deque()
        self.references: dict[Row, Sequence[Sequence[int]]] = {}  # for the drafter, once the row decodes

    def __len__(self) -> int:
        return len(self.waiting)

    def queue(self, row: Row, references: Sequence[Sequence[int]]) -> None:
        self.waiting.append(row)
        self.references[row] = references

    def plan(self, rows: Sequence[Row]) -> tuple[list[Row], dict[Row, list[int]]]:
        """This step's chunks: rows part-way through their prompt first, then waiting rows while
        the budget lasts. Returns the rows that join the batch now and every chunk by row."""
        budget = self.budget
        chunks: dict[Row, list[int]] = {}
        for row in rows:
            if row.prefilling:  # always served, even past the budget, so no row in the cache idles
                chunks[row] = row.next_chunk(budget)
                budget -= len(chunks[row])
        joining = []
        while budget > 0 and self.waiting:
            row = self.waiting.popleft()
            chunks[row] = row.next_chunk(budget)
            budget -= len(chunks[row])
            joining.append(row)
        return joining, chunks

    def drop(self, keep: Callable[[Row], bool]) -> list[Row]:
        """Take the waiting rows that ``keep`` rejects out of the queue; return them."""
        left = [row for row in self.waiting if not keep(row)]
        if left:
            self.waiting = collections.deque(row for row in self.waiting if keep(row))
            for row in left:
                self.references.pop(row, None)
        return left


@dataclass
class StepFeed:
    """What each row feeds one forward: a decoding row its pending token and draft tree, a row
    being prefilled its chunk (root + chain). Only some tokens need logits: the decoding rows'
    first (``decoded`` of them, rows side by side), then the last token of each prompt that ends."""

    roots: list[int] = field(default_factory=list)
    trees: list[DraftTree] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logits_at: list[int] = field(default_factory=list)  # the step's tokens whose logits are computed
    starts: list[int] = field(default_factory=list)  # per row: where its logits start among those (-1: none)
    decoded: int = 0  # how many of the logits are the decoding rows'


def step_feed(rows: Sequence[Row], drafts: Sequence[DraftTree], chunks: dict[Row, list[int]]) -> StepFeed:
    """Every row's tokens for one forward; logits for all of a decoding row's tokens, and for the
    last token of a prompt that ends in this step (its first token is chosen from them)."""
    feed = StepFeed()
    prompt_ends: dict[int, int] = {}  # row -> its prompt's last token in the step
    offset = 0
    for r, (row, draft) in enumerate(zip(rows, drafts)):
        chunk = chunks.get(row)
        feed.positions.append(row.position)
        if chunk is None:
            feed.starts.append(len(feed.logits_at))
            # a row done with no token (its first draw failed): any root, its result is dropped
            feed.roots.append(row.pending if row.generated else row.prompt[-1])
            feed.trees.append(draft)
            size = 1 + len(draft)
            feed.logits_at.extend(range(offset, offset + size))
        else:
            feed.starts.append(-1)
            feed.roots.append(chunk[0])
            feed.trees.append(DraftTree.chain(chunk[1:]))
            size = len(chunk)
            if row.position + size == row.prompt_length:
                prompt_ends[r] = offset + size - 1
        offset += size
    feed.decoded = len(feed.logits_at)
    for r, end in prompt_ends.items():
        feed.starts[r] = len(feed.logits_at)
        feed.logits_at.append(end)
    return feed


def forward_feed(
    model, packed: PackedCache, feed: StepFeed, *, greedy_only: bool = False
) -> tuple[torch.Tensor | Sequence[int], StepInputs]:
    """One forward over every row's feed; the logits (len(logits_at), vocab) of the tokens that need them.

    ``greedy_only``: the caller needs only each position's greedy token, so a sequence of
    len(logits_at) token ids comes back instead of the logits. Where the model has
    ``greedy_head``'s screen, the output layer is skipped (the tokens are resolved lazily);
    without one, they are the logits' argmax.
    """
    device = input_device(model)
    step = step_inputs(feed.roots, feed.trees, feed.positions, device)
    packed.ensure_cache(lambda: full_cache(model), device)
    keep, pick = _logits_to_keep(model, feed.logits_at, step.ids.shape[1])
    # positions always go in, as the model numbers them (see decoding.positions)
    positions = step.positions + origin if (origin := position_origin(model, device)) else step.positions
    kwargs = {"cache": packed.cache, "use_cache": True, "logits_to_keep": keep, "position_ids": positions}
    if not is_plain_causal(packed, feed.trees, feed.positions):
        kwargs["attention_mask"] = step_mask(model, packed.owned, step)
        if row_local_applies(model, len(feed.trees), device):  # the full mask still goes in: see row_attention
            sizes = [1 + len(tree) for tree in feed.trees]
            kwargs[ROW_LAYOUT] = row_layout(packed.row_columns(), sizes, packed.length, device)
    head = greedy_head_of(model) if greedy_only else None
    with (
        capture_hidden() if head is not None else contextlib.nullcontext() as captured,
        without_cudnn_attention(device),
    ):
        logits = model(input_ids=step.ids, **kwargs).logits
    if captured:  # the screened layer computed nothing: its input gives the tokens
        hidden = captured[-1][0]
        return head.argmax(hidden if pick is None else hidden[pick]), step
    logits = logits[0]
    logits = logits if pick is None else logits[pick]
    return (logits.float().argmax(dim=-1).tolist() if greedy_only else logits), step


def _logits_to_keep(model, wanted: list[int], total: int) -> tuple[int | torch.Tensor, torch.Tensor | None]:
    """``logits_to_keep`` for the forward, and which of its rows are ``wanted`` (None: all of them).

    transformers' own models take the positions themselves (in any order); other code only the
    int form (the last n positions), so it computes the logits from the earliest wanted token on.
    The indices stay on the host: the last layers may sit on another device than the inputs.
    """
    if not wanted:
        return 1, torch.zeros(0, dtype=torch.long)
    if wanted == list(range(total - len(wanted), total)):
        return len(wanted), None
    if type(model).__module__.startswith("transformers."):
        return torch.tensor(wanted), None
    first = min(wanted)
    return total - first, torch.tensor([i - first for i in wanted])
