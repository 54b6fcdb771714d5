"""A model with rag_lookahead's layout (packed linears, the screened output layer) can be copied
and pickled like any model: ``copy.deepcopy`` failed on the packed copies (opaque tensors) and
``torch.save`` on their weak references, so a user could not copy a model ``load_model`` gave.
A copy computes from its own weights: it packs them again on first use, and has the full output
layer until ``screen_greedy_head`` gives it a screen of its own."""

from __future__ import annotations

import copy
import io

import torch
from tiny_models import build_tiny_model, reference_generate

from rag_lookahead import generate
from rag_lookahead.cpu_linear import restore_linears, speed_up_cpu_linears
from rag_lookahead.greedy_head import greedy_head_of, restore_greedy_head, screen_greedy_head

PROMPT = [3, 4, 5, 3, 4, 5, 3]


def _laid_out():
    model = build_tiny_model("qwen2", "sdpa", 0)
    assert speed_up_cpu_linears(model, min_elements=0) and screen_greedy_head(model)
    answer = generate(model, PROMPT, max_new_tokens=16, pad_token_id=0).sequences[0, len(PROMPT) :].tolist()
    assert greedy_head_of(model) is not None  # built, and the packed copies made
    return model, answer


def _answer(model) -> list[int]:
    return generate(model, PROMPT, max_new_tokens=16, pad_token_id=0).sequences[0, len(PROMPT) :].tolist()


def test_a_deep_copy_decodes_alike_and_follows_its_own_weights():
    model, answer = _laid_out()
    try:
        twin = copy.deepcopy(model)
        assert greedy_head_of(twin) is None  # the full output layer: exact, if slower
        assert _answer(twin) == answer
        generator = torch.Generator().manual_seed(1)
        for layer in twin.modules():
            if getattr(layer, "_rag_lookahead_packed", None) is not None:
                layer.weight.data += torch.randn(layer.weight.shape, generator=generator) * 0.3
        assert _answer(twin) == reference_generate(twin, PROMPT, 16, None) != answer
        assert _answer(model) == answer  # the original kept its weights and its copies
        assert screen_greedy_head(twin) and greedy_head_of(twin) is not None
        assert _answer(twin) == reference_generate(twin, PROMPT, 16, None)
    finally:
        restore_greedy_head(model)
        restore_linears(model)


def test_a_pickled_model_loads_and_decodes_alike():
    model, answer = _laid_out()
    try:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert _answer(loaded) == answer
    finally:
        restore_greedy_head(model)
        restore_linears(model)
