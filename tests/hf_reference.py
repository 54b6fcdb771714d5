"""transformers' own output, to compare ours with (shared by the exactness and server tests)."""

from __future__ import annotations

import torch


def hf_logits(model, prompt: list[int], max_new: int, seed: int | None = None, **options):
    """transformers' tokens and raw logits per step (``output_logits``), for one unpadded prompt."""
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **options,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]
