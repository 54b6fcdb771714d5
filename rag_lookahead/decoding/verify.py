"""Verify draft trees in one forward of the stock model.

Each row feeds ``[last accepted token] + its draft nodes``; the rows' tokens sit side by side
in one sequence over the packed cache (see ``packed_cache``). A 4-D attention mask lets every
node see its row's cache columns, its ancestors and itself; position ids are the row's length
plus the node's depth, so each node's logits are exactly those plain decoding would compute
after its path. Rows verify different numbers of nodes and nothing is padded.

What happens to the logits is elsewhere: ``sampling`` chooses the token at each node and so
the accepted path, and ``packed_cache`` keeps that path's KV entries (gathered, never
recomputed); ``keep_accepted`` here only hands it the columns. ``supports_tree_mask`` probes
once per model whether its attention honours the mask at all.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from rag_lookahead.decoding.attention_backends import without_cudnn_attention
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.forward_signature import check_cache_filled, check_forward_signature, ignores_position_ids
from rag_lookahead.decoding.inputs import vocab_size
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.sampling import Accepted
from rag_lookahead.decoding.windows import full_cache, sliding_window, text_config
from rag_lookahead.errors import ConfigError


@dataclass
class StepInputs:
    """One verify step's tokens, all rows side by side: ``[pending] + draft nodes`` per row."""

    ids: torch.Tensor  # (1, Q)
    positions: torch.Tensor  # (1, Q): the row's length + the node's depth
    owners: torch.Tensor  # (Q,): the row each token belongs to (all four tensors on the input device)
    tree: torch.Tensor  # (Q, Q) bool: token i may see token j (its ancestors and itself)
    offsets: list[int]  # where each row's tokens start
    last_position: int = 0  # the furthest position among the tokens (known on the host)


def step_inputs(pending: list[int], drafts: list[DraftTree], positions: list[int], device) -> StepInputs:
    """The step's tokens, positions, owners and tree, built on the host and sent to ``device`` in two copies."""
    sizes = [1 + len(d) for d in drafts]
    total = sum(sizes)
    columns = np.zeros((3, total), dtype=np.int64)  # ids, positions, owners: one transfer
    ids, pos, owners = columns
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
    on_device = torch.from_numpy(columns).to(device)
    tree_on_device = torch.from_numpy(tree).to(device)
    return StepInputs(on_device[0:1], on_device[1:2], on_device[2], tree_on_device, offsets, int(pos.max()))


def boolean_mask(model) -> bool:
    """sdpa takes a boolean mask (True: attend) as it is; eager and flex add the mask to the
    scores, so they need the additive float form."""
    return getattr(model.config, "_attn_implementation", None) == "sdpa"


def step_mask(model, owned: torch.Tensor, step: StepInputs) -> torch.Tensor | dict[str, torch.Tensor]:
    """(1, 1, Q, columns + Q) mask on the step's device: each token sees its row's columns and its
    tree path. Boolean (True: attend) for sdpa, else additive (0 / the dtype's minimum). Where the
    model has sliding-window layers and the step reaches past the window, those layers' mask also
    hides the keys outside each token's window (see ``windows``): a mask, or one per layer kind."""
    owned = owned.to(step.tree.device)
    allowed = torch.cat([owned[step.owners], step.tree], dim=1)
    window = sliding_window(model)
    if window is None or not window.reaches(step.last_position):
        return _mask_form(allowed, model)
    column_positions = owned.cumsum(1)[step.owners] - 1  # each column's rank in the query's row
    query_positions = step.positions[0]
    near = torch.cat(
        [window.near(column_positions, query_positions), window.near(query_positions[None], query_positions)], 1
    )
    masks = window.masks(allowed, near)
    if isinstance(masks, dict):
        return {kind: _mask_form(mask, model) for kind, mask in masks.items()}
    return _mask_form(masks, model)


def _mask_form(allowed: torch.Tensor, model) -> torch.Tensor:
    """(Q, K) ``allowed`` as the forward takes it: (1, 1, Q, K), boolean or additive (see ``boolean_mask``)."""
    if boolean_mask(model):
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(model.dtype).min)
    return mask[None, None]


def input_device(model) -> torch.device:
    """Where the model takes its inputs: its embeddings' device (the first of several under a device map).

    An embedding accelerate offloads (a device map's "cpu" or "disk") keeps its weight on ``meta``
    and runs where its hook says: the inputs go there (they went to ``meta`` and the call failed)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type == "meta":
        hooked = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
        if hooked is not None:
            from accelerate.utils.modeling import normalize_device  # an index: the machine's accelerator's

            return torch.device(normalize_device(hooked))
    return weight.device if isinstance(weight, torch.Tensor) else next(model.parameters()).device


def is_plain_causal(packed: PackedCache, drafts: list[DraftTree], positions: list[int]) -> bool:
    """One row, no holes in its cache, a chain (or no) draft: the causal mask is the tree mask.

    Decided from host-side counts, so a step on a GPU does not wait for the device to answer.
    """
    if len(drafts) != 1 or positions[0] != packed.length or not packed.hole_free:
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


#: Relative logit error the probe allows: exact fp32 differs only by summation order; bf16, fp16
#: and fp32 with TF32 (or other reduced-precision) matmuls round at ~1e-3..1e-2 of the largest logit.
EXACT_TOLERANCE = 1e-3
ROUNDED_TOLERANCE = 5e-2


def mask_blind_reason(model) -> str | None:
    """Why the model's attention cannot take a custom 4-D mask, known without running it; else None.

    Flash attention (2, 3, 4 and hub kernels) reads any mask as a padding mask: a 4-D one makes
    its index gather run out of range, a device-side assert that kills the process's CUDA
    context, so such a model must never see a tree-masked forward, not even the probe's.
    Paged attention ignores the mask; flex attention's CPU kernel corrupts the heap on one.
    """
    for implementation in attention_implementations(model):
        if "flash" in implementation:
            return f"attn_implementation={implementation!r} treats a 4-D mask as a padding mask"
        if "paged" in implementation:
            return f"attn_implementation={implementation!r} ignores custom masks"
        if "flex" in implementation:  # its compiled CPU kernel reads a 4-D mask out of bounds (heap corruption)
            return f"attn_implementation={implementation!r} does not take a 4-D mask"
    column_masked = next((m for m in model.modules() if _masks_by_column(m)), None)
    if column_masked is not None:
        # GPT-Neo (ImageGPT, Bark) slice a fixed causal (local: banded) table by cache length: a
        # tree's or a packed row's columns run ahead of its positions, so its window hid keys it
        # should see, and a packed cache longer than the table broke the forward; a single chain's
        # columns are its positions
        return f"its attention ({type(column_masked).__name__}) masks by cache column from a fixed causal table"
    if ignores_position_ids(model):
        # a tree's node sits at a column past its depth; RoFormer's sinusoid table then ran out at the
        # context end (IndexError), and a probe on small weights could not see the wrong positions
        return "its forward takes no position_ids, so a tree's nodes would be placed by cache column, not by depth"
    config = text_config(model)
    if getattr(config, "attn_temperature_tuning", False) and not all(getattr(config, "no_rope_layers", None) or [1]):
        # Llama-4's NoPE layers scale queries by the cache's length, not by the positions: packed
        # rows, or a tree's columns, would get another scale than a row decoded alone
        return "its NoPE layers scale queries by the cache length (attn_temperature_tuning)"
    return None


def _masks_by_column(module: torch.nn.Module) -> bool:
    """Whether ``module``'s attention slices a square boolean causal table of its own (``bias``,
    shape (1, 1, n, n)) by the cache's length rather than masking by the positions it is given.
    Only a table its code reads counts: CLVP builds one and never uses it."""
    table = getattr(module, "bias", None)
    if not (isinstance(table, torch.Tensor) and table.dtype == torch.bool and table.dim() == 4):
        return False
    return table.shape[-1] == table.shape[-2] and _reads_its_table(type(module))


@functools.cache
def _reads_its_table(cls: type) -> bool:
    """Whether the class's code indexes its ``bias`` table; once per class (a model has one such
    module per layer, and reading a class's source parses its whole file)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source to read (built at run time): assume it is read
        return True
    return "self.bias[" in source


def attention_implementations(model) -> tuple[str, ...]:
    """The attention the model runs: its config's, and a composite model's text model's, which
    ``set_attn_implementation({"text_config": ...})`` sets alone (the top config kept "sdpa" while
    the text model ran flex attention, whose CPU kernel a tree mask corrupts)."""
    config, text = model.config, text_config(model)
    names = [config] if text is config else [config, text]
    return tuple(str(getattr(c, "_attn_implementation", None) or "") for c in names)


def fp32_matmuls_rounded(device: torch.device) -> bool:
    """Whether fp32 matmuls on ``device`` run at reduced precision (TF32 on CUDA, bf16/TF32 via oneDNN).

    torch 2.9+ keeps the setting per backend (``torch.backends.cuda.matmul.fp32_precision``; the
    older ``set_float32_matmul_precision`` and ``allow_tf32`` write it too) and raises on the older
    readers once the new setting was used: that error, inside the tree-mask probe, read as a
    mask-blind model and turned trees and batching off. So the new setting is read where it exists."""
    backend = {"cuda": torch.backends.cuda.matmul, "cpu": getattr(torch.backends.mkldnn, "matmul", None)}.get(
        device.type
    )
    general = getattr(torch.backends, "fp32_precision", None)  # None before torch 2.9
    precision = getattr(backend, "fp32_precision", None)
    if precision is not None or general is not None:
        if precision in (None, "none"):  # unset for this backend, or it has none of its own (mps, xpu)
            precision = general
        return precision in ("tf32", "bf16")
    if torch.get_float32_matmul_precision() != "highest":  # torch before 2.9
        return True
    return device.type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)


def probe_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The relative logit error below which the tree-masked logits count as equal to the branch runs."""
    exact = dtype in (torch.float32, torch.float64) and not fp32_matmuls_rounded(device)
    return EXACT_TOLERANCE if exact else ROUNDED_TOLERANCE


def supports_tree_mask(model) -> bool:
    """Probe once per model: do tree-masked logits equal each branch run on its own? (The verdict is
    kept in the model's ``ModelProfile``.)

    A model whose attention ignores a custom 4-D mask would let one branch see another; such
    models fall back to single-chain drafts, which need no mask, with one warning. Attention
    known to choke on 4-D masks is refused without a forward; a probe that raises, or logits
    that are not finite (fp16 overflow), also mean chains, never a dead ``generate``. A forward
    that cannot take the cache at all is a ConfigError (``forward_signature``), not a probe that
    failed: chains would fail on it just the same; so is one whose ``past_key_values`` and
    ``**kwargs`` took our ``cache=`` unread, found by the probe's first forward.
    """
    profile = profile_of(model)
    attention = "|".join(attention_implementations(model))
    # a verdict reached under sdpa, kept after a switch to flex attention, fed flex's CPU kernel
    # tree masks: the heap was corrupted ("double free or corruption"); None: a verdict set by hand
    if profile.tree_mask is not None and profile.tree_mask_attention in (None, attention):
        return profile.tree_mask
    check_forward_signature(model)  # once per model, as the verdict: one that has a verdict passed it
    reason = mask_blind_reason(model)
    if reason is None:
        try:
            reason = _probe_tree_mask(model)
        except ConfigError:  # the model cannot decode at all, with trees or chains
            raise
        except Exception as err:  # e.g. a kernel that refuses the mask, out of memory
            reason = f"the tree-mask probe failed ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    if reason is not None:
        warnings.warn(
            f"{type(model).__name__}: {reason}; drafting single chains only "
            "(still lossless, fewer tokens accepted per step)",
            stacklevel=2,
        )
    profile.tree_mask, profile.tree_mask_reason, profile.tree_mask_attention = reason is None, reason, attention
    return reason is None


@torch.inference_mode()
def _probe_tree_mask(model) -> str | None:
    """Run two 2-token branches as one tree and each on its own; None if they agree, else why not.

    Every forward here, the prefix's and each branch's too, goes through a 4-D mask as a tree
    step does: on a GPU an unmasked forward takes another kernel (flash rather than memory-efficient
    attention), whose bf16 rounding alone came to the tolerance (a relative error of 0.051 on an
    H200), and the probe is to judge the mask, not the kernels."""
    device = input_device(model)
    vocab = vocab_size(model)  # (a composite model's config may hold it in its text config only)
    gen = torch.Generator().manual_seed(1234)
    prefix = torch.randint(0, vocab, (6,), generator=gen).tolist()
    a, b = torch.randint(0, vocab, (2, 2), generator=gen).tolist()
    draft = DraftTree(tokens=[a[0], a[1], b[0], b[1]], parents=[-1, 0, -1, 2], depths=[1, 2, 1, 2], probs=[1.0] * 4)
    cache = full_cache(model)
    _masked_forward(model, prefix[0], DraftTree.chain(prefix[1:-1]), 0, cache)
    check_cache_filled(model, cache)  # no fault of the mask: the forward never wrote its KV cache
    tree_logits = _masked_forward(model, prefix[-1], draft, len(prefix) - 1, cache)
    tolerance = probe_tolerance(model.dtype, device)
    for branch, rows in ((a, [0, 1, 2]), (b, [0, 3, 4])):
        ref = _masked_forward(model, prefix[0], DraftTree.chain(prefix[1:] + branch), 0, None)[-3:]
        ours = tree_logits[rows]
        if not (bool(torch.isfinite(ours).all()) and bool(torch.isfinite(ref).all())):
            return f"its logits are not finite in {model.dtype} (overflow?), so the tree mask cannot be checked"
        error = ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        if not error <= tolerance:
            return f"attention ignores the tree mask (relative logit error {error:.2g} > {tolerance:g})"
    return None


def _masked_forward(model, root: int, draft: DraftTree, position: int, cache) -> torch.Tensor:
    """One row's step (``root`` at ``position``, then ``draft``) over ``cache``'s columns (all the
    row's; None: no cache), under the step's 4-D mask and the kernels the steps use: its logits."""
    device = input_device(model)
    step = step_inputs([root], [draft], [position], device)
    owned = torch.ones((1, position), dtype=torch.bool, device=device)
    mask = step_mask(model, owned, step)
    kwargs = {"cache": cache, "use_cache": True} if cache is not None else {}
    with without_cudnn_attention(device):
        return model(input_ids=step.ids, attention_mask=mask, position_ids=step.positions, **kwargs).logits[0]
