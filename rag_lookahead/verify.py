"""Verify draft trees in one forward of the stock model and keep the accepted KV entries.

Each row feeds ``[last accepted token] + its draft nodes``; the rows' tokens sit side by side
in one sequence over a packed cache (see ``packed_cache``). A 4-D attention mask lets every
node see its row's cache columns, its ancestors and itself; position ids are the row's length
plus the node's depth. The token chosen at each node (greedy, or drawn: see ``sampling``) then
tells which path of the tree plain decoding would have produced: we walk it from the root,
keep the KV entries of that path (``packed_cache`` gathers them, nothing is recomputed) and take
the bonus token from the last node of the path. Rows accept different numbers of tokens and
nothing is padded.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .draft import DraftTree
from .packed_cache import PackedCache
from .sampling import Accepted


@dataclass
class StepInputs:
    """One verify step's tokens, all rows side by side: ``[pending] + draft nodes`` per row."""

    ids: torch.Tensor  # (1, Q)
    positions: torch.Tensor  # (1, Q): the row's length + the node's depth
    owners: torch.Tensor  # (Q,): the row each token belongs to
    tree: torch.Tensor  # (Q, Q) bool: token i may see token j (its ancestors and itself)
    offsets: list[int]  # where each row's tokens start


def step_inputs(pending: list[int], drafts: list[DraftTree], positions: list[int], device) -> StepInputs:
    sizes = [1 + len(d) for d in drafts]
    total = sum(sizes)
    ids = np.zeros(total, dtype=np.int64)
    pos = np.zeros(total, dtype=np.int64)
    owners = np.zeros(total, dtype=np.int64)
    tree = np.zeros((total, total), dtype=bool)
    offsets = []
    o = 0
    for r, (draft, n) in enumerate(zip(drafts, sizes)):
        offsets.append(o)
        ids[o] = pending[r]
        ids[o + 1 : o + n] = draft.tokens
        pos[o] = positions[r]
        pos[o + 1 : o + n] = positions[r] + np.asarray(draft.depths, dtype=np.int64)
        owners[o : o + n] = r
        tree[o, o] = True
        for i, parent in enumerate(draft.parents, start=o + 1):
            tree[i] = tree[o + 1 + parent]
            tree[i, i] = True
        o += n
    return StepInputs(
        torch.from_numpy(ids)[None].to(device),
        torch.from_numpy(pos)[None].to(device),
        torch.from_numpy(owners),
        torch.from_numpy(tree),
        offsets,
    )


def step_mask(valid: torch.Tensor, step: StepInputs, dtype, device) -> torch.Tensor:
    """(1, 1, Q, columns + Q) additive mask: each token sees its row's columns and its tree path."""
    allowed = torch.cat([valid[step.owners], step.tree], dim=1).to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def forward_tree(model, packed: PackedCache, pending, drafts, positions) -> tuple[torch.Tensor, StepInputs]:
    """One forward over every row's tree; returns the logits (Q, vocab) of every token, rows side by side."""
    device = next(model.parameters()).device
    step = step_inputs(pending, drafts, positions, device)
    if is_plain_causal(packed.valid, drafts, positions):
        # what transformers itself runs for one row: same kernels, so bf16 rounds as greedy does
        logits = model(input_ids=step.ids, cache=packed.cache, use_cache=True).logits
    else:
        mask = step_mask(packed.valid, step, model.dtype, device)
        logits = model(input_ids=step.ids, attention_mask=mask, position_ids=step.positions, cache=packed.cache, use_cache=True).logits
    return logits[0], step


def is_plain_causal(valid: torch.Tensor, drafts: list[DraftTree], positions: list[int]) -> bool:
    """One row, no holes in its cache, a chain (or no) draft: the causal mask is the tree mask."""
    if len(drafts) != 1 or positions[0] != valid.shape[1] or not bool(valid.all()):
        return False
    return all(parent == i - 1 for i, parent in enumerate(drafts[0].parents))


def keep_accepted(packed: PackedCache, start: int, step: StepInputs, accepted: list[Accepted]) -> None:
    """Keep each row's root and accepted nodes among the step's columns (gathered, not recomputed)."""
    keep, owners = [], []
    for r, (offset, result) in enumerate(zip(step.offsets, accepted)):
        keep.append(offset)
        keep.extend(offset + 1 + node for node in result.nodes)
        owners.extend([r] * (1 + len(result.nodes)))
    packed.keep_new(start, keep, owners)


def check_cache(cache) -> None:
    """Only the plain dynamic cache can be compacted by slicing; say so clearly otherwise."""
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"rag_lookahead supports full-attention dynamic caches only; this model uses {type(layer).__name__}"
            )


_TREE_MASK_OK: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


@torch.inference_mode()
def supports_tree_mask(model) -> bool:
    """Probe once per model: do tree-masked logits equal each branch run on its own?

    A model whose attention ignores a custom 4-D mask would let one branch see another;
    such models fall back to single-chain drafts, which need no mask, with one warning.
    """
    known = _TREE_MASK_OK.get(model)
    if known is not None:
        return known
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    prefix = torch.randint(0, vocab, (1, 6), generator=gen).to(device)
    a, b = torch.randint(0, vocab, (2, 2), generator=gen).tolist()
    draft = DraftTree(tokens=[a[0], a[1], b[0], b[1]], parents=[-1, 0, -1, 2], depths=[1, 2, 1, 2], probs=[1.0] * 4)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix[:, :-1], cache=cache, use_cache=True)
    step = step_inputs([int(prefix[0, -1])], [draft], [5], device)
    mask = step_mask(torch.ones((1, 5), dtype=torch.bool), step, model.dtype, device)
    tree_logits = model(input_ids=step.ids, attention_mask=mask, position_ids=step.positions, cache=cache, use_cache=True).logits[0]
    ok = True
    for branch, rows in ((a, [0, 1, 2]), (b, [0, 3, 4])):
        full = torch.cat([prefix, torch.tensor([branch], device=device)], dim=1)
        ref = model(input_ids=full).logits[0, -3:]
        scale = ref.abs().max().clamp_min(1e-6)
        tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
        if ((tree_logits[rows] - ref).abs().max() / scale).item() > tolerance:
            ok = False
    if not ok:
        warnings.warn(
            f"{type(model).__name__}: attention ignores the tree mask; drafting single chains only "
            "(still lossless, fewer tokens accepted per step)",
            stacklevel=3,
        )
    _TREE_MASK_OK[model] = ok
    return ok
