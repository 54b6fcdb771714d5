"""Where a model numbers its positions from: the ids ``model.generate`` feeds it, bit for bit.

Why: every forward of ours passes position ids. A model left to count them itself may count
from state an earlier call left on it (Qwen2-VL's ``rope_deltas``: a batch of 3 before made the
next step fail, an image before shifted every position), so they must be the model's own.
``model.generate`` feeds every model whose forward takes position ids ``0, 1, 2...`` after the
padding, and a model's ``prepare_inputs_for_generation`` may shift them: PaliGemma's adds one (its
forward counts from 1 too), and rotary embeddings at positions shifted by one give logits that
differ in their last bits (3e-5 on a tiny fp32 PaliGemma), enough to flip a near-tie. So the
origin is read from what ``generate`` hands the forward (``generate_inputs``), not from how the
forward counts when given none: a Roberta-style decoder counts from ``padding_idx + 1`` (1 with
``padding_idx`` 0, whose own numbering was taken for the origin, and its tokens differed from the
first) yet is fed 0, 1, 2... Only where ``generate`` feeds no positions (the forward takes none,
or its ``prepare_inputs_for_generation`` drops them) does the forward's own numbering count: one
short forward without position ids is compared with the same forward numbered from 0 and from 1,
and the origin is 1 only where the model's own numbering is exactly that, else 0.
"""

from __future__ import annotations

import torch

from rag_lookahead.decoding.attention_backends import without_cudnn_attention
from rag_lookahead.decoding.generate_inputs import prefill_position_ids
from rag_lookahead.decoding.inputs import vocab_size
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.windows import full_cache

__all__ = ["position_origin"]

PROBE_TOKENS = 5


def position_origin(model, device: torch.device) -> int:
    """The position to give a prompt's first token, as ``model.generate`` feeds it: 1 for PaliGemma,
    0 for most; found once per model."""
    profile = profile_of(model)
    if profile.position_origin is None:
        profile.position_origin = _measure_origin(model, device)
    return profile.position_origin


@torch.inference_mode()
def _measure_origin(model, device: torch.device) -> int:
    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(0, vocab_size(model), (1, PROBE_TOKENS), generator=gen).to(device)
    zero = torch.arange(PROBE_TOKENS, device=device).unsqueeze(0)
    fed = prefill_position_ids(model, ids)
    if fed is not None and fed.shape == zero.shape:
        shift = fed.to(device) - zero
        if bool((shift == shift[0, 0]).all()):
            return int(shift[0, 0])

    def logits(**positions) -> torch.Tensor:
        out = model(input_ids=ids, cache=full_cache(model), use_cache=True, **positions).logits
        return out.float()

    with without_cudnn_attention(device):
        own = logits()
        from_zero = logits(position_ids=zero)
        if torch.equal(own, from_zero):
            return 0
        return 1 if torch.equal(own, logits(position_ids=zero + 1)) else 0
