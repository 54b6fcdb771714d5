"""The encoder's int8 linears on random data with the shapes and quirks of real activations."""

from __future__ import annotations

import torch

from rag_lookahead.int8_linear import DenseLinear, quantized_linear


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _activations(rows: int, channels: int, seed: int) -> torch.Tensor:
    """Mostly small values with a few channels 30x larger, as GELU outputs in e5's FFN have (spread
    out, so no two sit side by side in a kernel's pair of products)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=g).abs() * 0.3
    x[:, :: channels // 4] *= 30
    return x


def test_int8_linear_is_close_to_float32_and_smoothing_helps_with_outlier_channels():
    """Smoothing measured 0.54x the plain error on this data (the Xeon, oneDNN); unsmoothed: 1x."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 256, generator=g) * 0.05, torch.randn(96, generator=g)
    x = _activations(120, 256, 1)
    exact = DenseLinear(weight, bias)(x, [(0, 120)])
    plain = quantized_linear(weight, bias)
    assert plain is not None  # this torch build has the kernel (CI's CPU build does)
    peak = x.abs().amax(0)
    smoothed = quantized_linear(weight, bias, peak**0.75 / weight.abs().amax(0) ** 0.25)
    plain_error = _relative_error(plain(x, [(0, 120)]), exact)
    smoothed_error = _relative_error(smoothed(x, [(0, 120)]), exact)
    assert plain_error < 0.05
    assert smoothed_error < 0.7 * plain_error


def test_each_sequence_is_quantized_on_its_own():
    """Rows of a packed batch give exactly what each sequence gives alone, however the other
    sequences' ranges differ (one is 100x larger)."""
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(64, 128, generator=g), torch.randn(64, generator=g)
    linear = quantized_linear(weight, bias)
    a, b = _activations(30, 128, 3), 100 * _activations(50, 128, 4)
    packed = linear(torch.cat([a, b]), [(0, 30), (30, 80)])
    assert torch.equal(packed[:30], linear(a, [(0, 30)]))
    assert torch.equal(packed[30:], linear(b, [(0, 50)]))
    # one range for both would coarsen the small sequence's step 100x
    shared = linear(torch.cat([a, b]), [(0, 80)])[:30]
    exact = DenseLinear(weight, bias)(a, [(0, 30)])
    assert _relative_error(packed[:30], exact) < 0.25 * _relative_error(shared, exact)


def test_quantization_leaves_the_global_engine_alone():
    before = torch.backends.quantized.engine
    quantized_linear(torch.randn(8, 16), torch.zeros(8))
    assert torch.backends.quantized.engine == before
