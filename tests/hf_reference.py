"""transformers' own output, to compare ours with (shared by the exactness and server tests)."""

from __future__ import annotations

import torch


def hf_run(model, prompt: list[int], max_new: int, seed: int | None = None, **options):
    """``model.generate`` on one unpadded prompt, after ``torch.manual_seed(seed)`` where given."""
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, pad_token_id=0, **options)


def hf_logits(model, prompt: list[int], max_new: int, seed: int | None = None, **options):
    """transformers' tokens and raw logits per step (``output_logits``), for one unpadded prompt."""
    out = hf_run(model, prompt, max_new, seed, output_logits=True, return_dict_in_generate=True, **options)
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


#: How close two of transformers' scores must be for a swap to be the order of fp32 sums (README,
#: "fp32 has the same edge, far smaller"): a forward over several tokens sums in another order than
#: one over a single token, ~1e-7 on these models' logits.
FP32_TIE = 1e-6


def equal_up_to_an_fp32_tie(ours: list[int], expected: list[int], scores) -> bool:
    """``ours == expected``, or they part where transformers' own scores for the two tokens lie
    within ``FP32_TIE`` of each other (an exact decoder may then take either; after that they
    differ by construction). ``scores``: transformers' processed scores per step (``output_scores``)."""
    for step, (a, b) in enumerate(zip(ours, expected)):
        if a != b:
            row = scores[step].reshape(-1).float()
            if not (torch.isfinite(row[a]) and torch.isfinite(row[b])):  # a banned token is never a tie
                return False
            largest = float(row[torch.isfinite(row)].abs().max())
            return abs(float(row[a] - row[b])) <= FP32_TIE * max(1.0, largest)
    return len(ours) == len(expected)
