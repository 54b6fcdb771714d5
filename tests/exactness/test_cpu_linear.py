"""The few-token linear layout: the same products as ``nn.Linear``, and lookahead stays lossless on it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, DECODE_CASES, build_tiny_model, reference_generate

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.cpu_linear import (
    FEW_TOKENS,
    ONEDNN_TOKENS,
    few_token_linear,
    onednn_linear,
    onednn_linear_works,
    restore_linears,
    speed_up_cpu_linears,
)
from rag_lookahead.decoding.costs import CostCurve
from rag_lookahead.decoding.profile import profile_of


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=2),
    features=st.integers(min_value=1, max_value=48),
    outputs=st.integers(min_value=1, max_value=48),
    bias=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**16),
    autograd=st.booleans(),
)
def test_equals_functional_linear_for_any_shape(lead, features, outputs, bias, seed, autograd):
    """Every path (oneDNN without autograd, the swapped product, stock) computes the same product."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, features, generator=gen)
    weight = torch.randn(outputs, features, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    with torch.set_grad_enabled(autograd):
        got = few_token_linear(x, weight, b)
    want = torch.nn.functional.linear(x, weight, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_linear_works(), reason="this torch has no working oneDNN linear")
def test_onednn_takes_its_token_counts_only_without_autograd():
    """Without autograd, ONEDNN_TOKENS rows go through oneDNN (its own rounding); with autograd
    the product keeps a gradient (oneDNN's op has none)."""
    weight = torch.randn(64, 48)
    for rows in sorted(ONEDNN_TOKENS):
        x = torch.randn(rows, 48)
        with torch.no_grad():
            got = few_token_linear(x, weight)
        assert torch.equal(got, onednn_linear(x, weight, None))
    trained = weight.clone().requires_grad_()
    few_token_linear(torch.randn(12, 48), trained).sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


def test_the_swapped_product_runs_only_for_few_rows():
    weight = torch.randn(64, 32)
    for rows in (1, 2, 64, 65, 300):
        x = torch.randn(rows, 32)
        same = torch.equal(few_token_linear(x, weight), torch.nn.functional.linear(x, weight))
        if rows not in FEW_TOKENS:
            assert same  # the stock kernel itself: bit for bit


def test_patches_large_fp32_cpu_linears_only_and_undoes():
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024),  # 1M weights: patched
        torch.nn.Linear(1024, 8),  # small: stock
        torch.nn.Linear(1024, 1024).to(torch.bfloat16),  # not fp32: stock
    )
    profile_of(model).cost_curve = CostCurve([1, 2], [0.1, 0.2])
    assert speed_up_cpu_linears(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])
    assert profile_of(model).cost_curve is None  # costs measured under the old layout are forgotten
    assert speed_up_cpu_linears(model) == 1  # again: no change
    x = torch.randn(3, 1024)
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    restore_linears(model)
    assert not any("forward" in vars(m) for m in model)
    assert model._rag_lookahead_few_token_linears == 0


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DECODE_CASES)
def test_lookahead_on_the_few_token_layout_matches_generate(arch, prompt, max_new, budget):
    model = build_tiny_model(arch, "sdpa", 0)  # its own instance: the shared tiny models stay stock
    stock = reference_generate(model, prompt, max_new, None)
    speed_up_cpu_linears(model, min_elements=0)  # every layer, however small
    try:
        patched = reference_generate(model, prompt, max_new, None)
        result = generate(model, prompt, max_new_tokens=max_new, config=LookaheadConfig(budget=budget), pad_token_id=0)
        assert result.sequences[0, len(prompt) :].tolist() == patched == stock
    finally:
        restore_linears(model)
