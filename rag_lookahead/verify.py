"""Verify draft trees in one forward of the stock model, accept, and compact the KV cache.

Each row feeds ``[last accepted token] + its draft nodes``. A 4-D attention mask lets every
node see the row's valid cache columns, its ancestors and itself; position ids are the row's
length plus the node's depth. The model's greedy choice at each node then tells which path
of the tree is what plain greedy decoding would have produced: we walk it from the root, keep
the KV entries of that path (gathered, not recomputed) and take the bonus token from the last
node of the path. Rows accept different numbers of tokens; the columns a row did not accept
become holes its mask hides from then on.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .draft import DraftTree


@dataclass
class Accepted:
    """One row's outcome of a verify step."""

    nodes: list[int]  # accepted draft node indices, root to leaf
    tokens: list[int]  # their tokens followed by the bonus token


def tree_inputs(pending: list[int], drafts: list[DraftTree], positions: list[int], device):
    """Input ids, position ids and the tree part of the mask for one verify step.

    Rows with fewer nodes than the widest tree are padded with dummy nodes that attend only
    to themselves (a fully masked query row would produce NaNs that then spread into the cache).
    """
    rows, width = len(drafts), 1 + max(len(d) for d in drafts)
    ids = np.zeros((rows, width), dtype=np.int64)
    pos = np.zeros((rows, width), dtype=np.int64)
    allowed = np.zeros((rows, width, width), dtype=bool)
    for r, draft in enumerate(drafts):
        n = 1 + len(draft)
        ids[r, 0] = pending[r]
        ids[r, 1:n] = draft.tokens
        pos[r, 0] = positions[r]
        pos[r, 1:n] = positions[r] + np.asarray(draft.depths, dtype=np.int64)
        pos[r, n:] = positions[r]
        allowed[r, 0, 0] = True
        for i, parent in enumerate(draft.parents, start=1):
            allowed[r, i] = allowed[r, parent + 1]
            allowed[r, i, i] = True
        allowed[r, np.arange(n, width), np.arange(n, width)] = True
    return (
        torch.from_numpy(ids).to(device),
        torch.from_numpy(pos).to(device),
        torch.from_numpy(allowed).to(device),
    )


def additive_mask(cache_valid: torch.Tensor, tree_allowed: torch.Tensor, dtype) -> torch.Tensor:
    """(rows, 1, q, cache + q) float mask: 0 where attention is allowed, dtype-min elsewhere."""
    rows, q, _ = tree_allowed.shape
    allowed = torch.cat([cache_valid[:, None, :].expand(rows, q, -1), tree_allowed], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


@torch.inference_mode()
def forward_tree(model, cache, cache_valid, pending, drafts, positions) -> torch.Tensor:
    """One forward over every row's tree; returns the greedy token at each node, (rows, q)."""
    ids, pos, tree_allowed = tree_inputs(pending, drafts, positions, cache_valid.device)
    if is_plain_causal(cache_valid, drafts, positions):
        # what transformers itself runs for one row: same kernels, so bf16 rounds as greedy does
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
    else:
        mask = additive_mask(cache_valid, tree_allowed, model.dtype)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits
    return logits.float().argmax(dim=-1)  # as transformers does: fp32 logits, first maximum on ties


def is_plain_causal(cache_valid: torch.Tensor, drafts: list[DraftTree], positions: list[int]) -> bool:
    """One row, no holes in its cache, a chain (or no) draft: the causal mask is the tree mask."""
    if len(drafts) != 1 or positions[0] != cache_valid.shape[1] or not bool(cache_valid.all()):
        return False
    return all(parent == i - 1 for i, parent in enumerate(drafts[0].parents))


def longest_path(draft: DraftTree, greedy: list[int]) -> Accepted:
    """Follow the model's greedy choices down the tree; ``greedy[i]`` is for node i-1 (0: root)."""
    children = {(parent, token): i for i, (parent, token) in enumerate(zip(draft.parents, draft.tokens))}
    nodes: list[int] = []
    tokens: list[int] = []
    current = -1
    while True:
        choice = greedy[current + 1]
        tokens.append(choice)
        nxt = children.get((current, choice))
        if nxt is None:
            return Accepted(nodes, tokens)
        nodes.append(nxt)
        current = nxt


def compact_cache(cache, start: int, accepted: list[Accepted]) -> torch.Tensor:
    """Keep, per row, the root and its accepted nodes' KV entries right after ``start``.

    Returns the validity of the kept columns, (rows, 1 + longest path): a row that accepted
    fewer nodes than the longest leaves holes at its end.
    """
    keep_width = 1 + max(len(a.nodes) for a in accepted)
    rows = len(accepted)
    index = np.zeros((rows, keep_width), dtype=np.int64)
    valid = np.zeros((rows, keep_width), dtype=bool)
    for r, a in enumerate(accepted):
        n = 1 + len(a.nodes)
        index[r, 1:n] = np.asarray(a.nodes, dtype=np.int64) + 1
        valid[r, :n] = True
    contiguous = all(a.nodes == list(range(len(a.nodes))) for a in accepted)  # a chain prefix: crop suffices
    end = start + keep_width
    if contiguous:
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, :end]
            layer.values = layer.values[:, :, :end]
    else:
        gather = None
        for layer in cache.layers:
            if gather is None or gather.shape[1] != layer.keys.shape[1] or gather.shape[3] != layer.keys.shape[3]:
                gather = torch.from_numpy(index).to(layer.keys.device)[:, None, :, None].expand(
                    rows, layer.keys.shape[1], keep_width, layer.keys.shape[3]
                )
            layer.keys[:, :, start:end] = layer.keys[:, :, start:].gather(2, gather)
            layer.values[:, :, start:end] = layer.values[:, :, start:].gather(2, gather)
            layer.keys = layer.keys[:, :, :end]
            layer.values = layer.values[:, :, :end]
    return torch.from_numpy(valid)


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
    ids, pos, tree_allowed = tree_inputs([int(prefix[0, -1])], [draft], [5], device)
    cache_valid = torch.ones((1, 5), dtype=torch.bool, device=device)
    mask = additive_mask(cache_valid, tree_allowed, model.dtype)
    tree_logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[0]
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
