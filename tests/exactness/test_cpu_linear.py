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
    PACKED_TOKENS,
    PackedWeight,
    few_token_linear,
    mkl_packed_works,
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
    packed=st.booleans(),
)
def test_equals_functional_linear_for_any_shape(lead, features, outputs, bias, seed, autograd, packed):
    """Every path (MKL packed or oneDNN without autograd, the swapped product, stock) computes the same product."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, features, generator=gen)
    weight = torch.randn(outputs, features, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    with torch.set_grad_enabled(autograd):
        got = few_token_linear(x, weight, b, PackedWeight() if packed else None)
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


needs_mkl_packed = pytest.mark.skipif(not mkl_packed_works(), reason="this torch has no working MKL packed linear")


@needs_mkl_packed
def test_packed_weights_take_their_token_counts_only_without_autograd():
    """Given a packed weight and no autograd, PACKED_TOKENS rows go through MKL's packed GEMM
    (its own rounding: bit for bit what a fresh packing computes); with autograd the product
    keeps a gradient."""
    weight, bias = torch.randn(64, 48), torch.randn(64)
    packed = PackedWeight()
    for rows in (1, 2, 3, 7, 16, max(PACKED_TOKENS)):
        x = torch.randn(rows, 48)
        with torch.no_grad():
            got = few_token_linear(x, weight, bias, packed)
            assert torch.equal(got, PackedWeight().linear(x, weight, bias))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    strided = torch.randn(48, 3).t()  # a non-contiguous input (a transposed view)
    with torch.no_grad():
        torch.testing.assert_close(
            few_token_linear(strided, weight, bias, packed),
            torch.nn.functional.linear(strided, weight, bias),
            rtol=1e-5,
            atol=1e-5,
        )
    trained = weight.clone().requires_grad_()
    few_token_linear(torch.randn(5, 48), trained, None, PackedWeight()).sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


@needs_mkl_packed
def test_a_packed_weight_follows_changes_to_the_weight():
    """Edited in place (as load_state_dict does) or replaced, the weight is packed again: the
    product never uses stale values."""
    layer = torch.nn.Linear(48, 64)
    speed_up_cpu_linears(layer, min_elements=0)
    x = torch.randn(3, 48)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # in place: same storage, new version
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert not torch.allclose(layer(x), before)
        layer.load_state_dict({"weight": torch.randn(64, 48), "bias": torch.zeros(64)})
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(64, 48))  # replaced: new storage
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    restore_linears(layer)


@needs_mkl_packed
def test_inference_tensors_are_not_packed():
    """Weights made under inference_mode have no version counter to check: they take the other kernels."""
    with torch.inference_mode():
        weight = torch.randn(64, 48)
        x = torch.randn(3, 48)
        packed = PackedWeight()
        got = few_token_linear(x, weight, None, packed)
    assert packed._packed is None
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


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
    assert isinstance(model[0]._rag_lookahead_packed, PackedWeight)
    assert profile_of(model).cost_curve is None  # costs measured under the old layout are forgotten
    assert speed_up_cpu_linears(model) == 1  # again: no change
    x = torch.randn(3, 1024)
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    restore_linears(model)
    assert not any("forward" in vars(m) or "_rag_lookahead_packed" in vars(m) for m in model)
    assert model._rag_lookahead_few_token_linears == 0


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DECODE_CASES)
def test_lookahead_on_the_few_token_layout_matches_generate(arch, prompt, max_new, budget):
    model = build_tiny_model(arch, "sdpa", 0)  # its own instance: the shared tiny models stay stock
    stock = reference_generate(model, prompt, max_new, None)
    speed_up_cpu_linears(model, min_elements=0)  # every layer, however small
    output = model.get_output_embeddings()
    packed = [m for m in model.modules() if getattr(m, "_rag_lookahead_packed", None) is not None]
    assert packed and output not in packed  # the output layer keeps its weights unpacked
    try:
        patched = reference_generate(model, prompt, max_new, None)
        result = generate(model, prompt, max_new_tokens=max_new, config=LookaheadConfig(budget=budget), pad_token_id=0)
        assert result.sequences[0, len(prompt) :].tolist() == patched == stock
    finally:
        restore_linears(model)
