"""What ``model.generate`` hands the model's forward, read from the model's own
``prepare_inputs_for_generation`` without running a forward.

Why: our forwards must be fed as ``generate`` feeds them, and that is not always what the forward
does when left to itself. A Roberta-style decoder with ``padding_idx`` 0 counts its own positions
from 1, while ``generate`` feeds it 0, 1, 2...; PaliGemma's ``prepare_inputs_for_generation`` adds
one to what ``generate`` made. And a few models take the whole sequence on every step and slice
off the cached part themselves (CPM-Ant, XLM, which also appends a mask token): a forward of only
the new tokens, as ours are, is not what they expect (they failed deep inside their attention).

Both are read the way ``generate`` asks: ``_prepare_position_ids_for_generation``'s text
positions (0, 1, 2... for an unpadded prompt; the method itself is not called, since some models
keep state from it: Qwen2-VL's ``rope_deltas``), then ``prepare_inputs_for_generation`` with the
keyword arguments ``generate`` passes. A model whose ``prepare_inputs_for_generation`` cannot run
on text alone tells nothing here, and is judged by its forwards as before.
"""

from __future__ import annotations

import torch

from rag_lookahead.decoding.forward_signature import takes_position_ids

__all__ = ["feeds_whole_sequence", "prefill_position_ids"]

PROBE_TOKENS = 5


def _generate_makes_positions(model) -> bool:
    """Whether ``generate`` makes position ids for the model (as transformers decides it)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    return takes_position_ids(model)  # False for a forward without a signature


def _prepared(model, ids: torch.Tensor, cached: int, **kwargs) -> dict | None:
    """``prepare_inputs_for_generation`` for ``ids`` with a cache already holding ``cached`` of
    them, as ``generate`` calls it; None where it cannot run without more than text (images)."""
    from transformers import DynamicCache

    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return None
    cache = DynamicCache()
    if cached:  # its length is all a prepare_inputs reads (some slice by it, not next_sequence_length)
        empty = torch.zeros((1, 1, cached, 1), device=ids.device)
        cache.update(empty, empty, 0)
    n = ids.shape[1]
    model_kwargs = {"attention_mask": torch.ones_like(ids), "cache": cache, "use_cache": True}
    if _generate_makes_positions(model):
        model_kwargs["position_ids"] = torch.arange(n, device=ids.device).unsqueeze(0)
    try:
        prepared = prepare(ids, next_sequence_length=n - cached, **model_kwargs, **kwargs)
    except Exception:  # needs generate's other inputs (pixel values, say): nothing to read here
        return None
    return prepared if isinstance(prepared, dict) else None


def prefill_position_ids(model, ids: torch.Tensor) -> torch.Tensor | None:
    """The position ids ``generate`` hands the forward over the unpadded first prompt ``ids``
    (1, n); None where it hands none (the forward numbers its tokens itself)."""
    prepared = _prepared(model, ids, 0, is_first_iteration=True)
    positions = None if prepared is None else prepared.get("position_ids")
    return positions if isinstance(positions, torch.Tensor) else None


def feeds_whole_sequence(model, device: torch.device) -> bool:
    """Whether ``generate``'s decode step hands the forward more than its one new token (the
    cached ones again, or a token of its own after it), as CPM-Ant's and XLM's do; False where it
    cannot be told."""
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device).unsqueeze(0)
    prepared = _prepared(model, ids, PROBE_TOKENS - 1, is_first_iteration=False)
    fed = None if prepared is None else prepared.get("input_ids")
    return isinstance(fed, torch.Tensor) and fed.shape[-1] != 1
