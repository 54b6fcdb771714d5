"""Lossless to the last token of the context window, for single rows and batches (fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, reference_generate, tiny_model

from rag_lookahead import LookaheadConfig, generate

LIMIT = 256  # max_position_embeddings of the tiny models
tokens = st.integers(min_value=1, max_value=12)


def _prompt(draw, slack_low: int, slack_high: int) -> list[int]:
    """A repetitive prompt that ends 1-80 tokens before the context limit."""
    slack = draw(st.integers(min_value=slack_low, max_value=slack_high))
    motif = draw(st.lists(tokens, min_size=2, max_size=9))
    return (motif * (LIMIT // len(motif) + 1))[: LIMIT - slack]


@st.composite
def single_cases(draw):
    prompt = _prompt(draw, 1, 80)
    config = LookaheadConfig(
        decoding_length=draw(st.integers(min_value=1, max_value=64)),
        branch_length=draw(st.integers(min_value=1, max_value=24)),
        budget=draw(st.sampled_from(["fixed", "auto"])),
        use_output_pool=False,
    )
    return prompt, config, draw(st.booleans())


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=single_cases())
def test_single_row_fills_the_window_exactly(arch, case):
    prompt, config, seeded = case
    model = tiny_model(arch)
    room = LIMIT - len(prompt)
    expected = reference_generate(model, prompt, room, None)
    references = [[prompt[-3:] + expected]] if seeded else None  # drafts run right up to the end
    result = generate(model, prompt, max_new_tokens=LIMIT, config=config, references=references, pad_token_id=0)
    got = result.sequences[0, len(prompt) :].tolist()
    assert len(got) == room  # no EOS: the window is filled, not cut short
    assert got == expected


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_batch_rows_fill_the_window_exactly(arch, data):
    prompts = [_prompt(data.draw, 1, 80) for _ in range(3)]
    model = tiny_model(arch)
    expected = [reference_generate(model, p, LIMIT - len(p), None) for p in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = LookaheadConfig(
        decoding_length=32, branch_length=data.draw(st.integers(1, 24)), budget="fixed", use_output_pool=False
    )
    references = [[p[-3:] + e] for p, e in zip(prompts, expected)]
    result = generate(model, ids, mask, max_new_tokens=LIMIT, config=config, references=references, pad_token_id=0)
    for row, want in enumerate(expected):
        got = result.sequences[row, width : width + len(want)].tolist()
        assert got == want
        assert set(result.sequences[row, width + len(want) :].tolist()) <= {0}
