"""Refuse a model that attends both ways: its logits for a token depend on the tokens after it.

Why: the BERT family's ``...ForCausalLM`` (RemBert, BertGeneration, RoFormer, Roberta...) reads
``config.is_decoder``; left False, its attention is bidirectional and it keeps no cache, so
``model.generate`` runs the whole sequence again on every step and each earlier token sees the new
ones. Decoding from a cache cannot give those tokens (they differed from the 13th of 20 on a tiny
RemBert), and running everything again is no speed-up. Not every config that says
``is_decoder=False`` is read, though (GPT-NeoX's, Pythia's, attends causally whatever it says),
so where it says False two short forwards tell: the same tokens but the last, whose earlier
logits must not change. Once per model; other models cost nothing.
"""

from __future__ import annotations

import torch

from rag_lookahead.decoding.attention_backends import without_cudnn_attention
from rag_lookahead.decoding.inputs import vocab_size
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.errors import ConfigError

__all__ = ["check_causal"]

PROBE_TOKENS = 6


def check_causal(model) -> None:
    """Raise ConfigError if the model's config says ``is_decoder=False`` and it attends both ways."""
    from rag_lookahead.decoding.windows import text_config

    if getattr(text_config(model), "is_decoder", None) is not False:
        return
    profile = profile_of(model)
    if profile.attends_ahead is None:
        profile.attends_ahead = _attends_ahead(model)
    if profile.attends_ahead:
        raise ConfigError(
            f"{type(model).__name__} has is_decoder=False in its config, so it attends both ways (each token sees "
            "the ones after it) and model.generate runs the whole sequence again on every step; "
            "load it with is_decoder=True to decode it as a causal decoder"
        )


@torch.inference_mode()
def _attends_ahead(model) -> bool:
    """Whether changing the last of a few tokens changes the logits of the ones before it."""
    from rag_lookahead.decoding.verify import input_device, probe_tolerance

    device = input_device(model)
    vocab = vocab_size(model)
    pad = getattr(model.config, "pad_token_id", None)
    tokens = [t for t in range(1, vocab) if t != pad][: PROBE_TOKENS + 1]  # no padding: some count positions by it
    ids = torch.tensor([tokens[:PROBE_TOKENS]], device=device)
    changed = ids.clone()
    changed[0, -1] = tokens[PROBE_TOKENS]
    with without_cudnn_attention(device):
        first, second = (
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :-1].float()
            for x in (ids, changed)
        )
    error = ((first - second).abs().max() / first.abs().max().clamp_min(1e-6)).item()
    return not error <= probe_tolerance(model.dtype, device)
