"""The few-token linear layout: the same products as ``nn.Linear``, and lookahead stays lossless on it."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, DECODE_CASES, build_tiny_model, reference_generate

from rag_lookahead import LookaheadConfig, cpu_linear, generate
from rag_lookahead.cpu_linear import (
    BF16_ONEDNN_TOKENS,
    FEW_TOKENS,
    GEMM_ENV,
    ONEDNN_TOKENS,
    PACKED_TOKENS,
    PackedWeight,
    _reordered_onednn_works,
    bf16_layout_applies,
    bf16_packed_works,
    few_token_linear,
    mkl_packed_works,
    onednn_linear,
    onednn_linear_works,
    packed_kernel,
    restore_linears,
    speed_up_cpu_linears,
    stock_linears,
)
from rag_lookahead.decoding.costs import CostCurve
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.errors import ConfigError

KERNELS = ("mkl", "onednn")


@contextlib.contextmanager
def packed_by(kernel: str):
    """Within: packed weights take ``kernel`` as ``RAG_LOOKAHEAD_CPU_GEMM`` would make them; the
    test is skipped where this torch lacks it (the choice then falls to the other)."""
    before = os.environ.get(GEMM_ENV)
    os.environ[GEMM_ENV] = kernel
    packed_kernel.cache_clear()
    try:
        if packed_kernel(torch.float32) != kernel:
            pytest.skip(f"this torch has no working {kernel} packed kernel")
        yield
    finally:
        if before is None:
            del os.environ[GEMM_ENV]
        else:
            os.environ[GEMM_ENV] = before
        packed_kernel.cache_clear()


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
@pytest.mark.parametrize("kernel", KERNELS)
def test_equals_functional_linear_for_any_shape(kernel, lead, features, outputs, bias, seed, autograd, packed):
    """Every path (MKL packed or oneDNN without autograd, the swapped product, stock) computes the
    same product, whichever kernel packed weights take."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, features, generator=gen)
    weight = torch.randn(outputs, features, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    with packed_by(kernel), torch.set_grad_enabled(autograd):
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


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_weights_take_their_token_counts_only_without_autograd(kernel):
    """Given a packed weight and no autograd, PACKED_TOKENS rows go through MKL's packed GEMM, or
    every row count through oneDNN where that is the packed kernel (their own rounding: bit for
    bit what a fresh packing computes); with autograd the product keeps a gradient."""
    weight, bias = torch.randn(64, 48), torch.randn(64)
    with packed_by(kernel):
        for rows in (1, 2, 3, 7, 16, max(PACKED_TOKENS), 65, 300):
            x = torch.randn(rows, 48)
            packed = PackedWeight()
            with torch.no_grad():
                got = few_token_linear(x, weight, bias, packed)
                takes_packed = rows in PACKED_TOKENS or kernel == "onednn"
                assert set(packed._copies) == ({kernel} if takes_packed else set())
                if takes_packed:
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
        layer.weight.data = torch.randn(64, 48)  # same object, same version, new storage
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight.data += torch.randn(64, 48)  # peft's merge: same object, version and storage
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight.data.copy_(torch.randn(64, 48))
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    restore_linears(layer)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_converted_or_moved_model_lets_its_old_copies_go(kernel):
    """After ``.half()`` (or a move to a GPU) no layer uses its packed copies again: the model's
    watch drops them and its samples of the old storage before the next forward (they held the
    old weights in memory for nothing), and a layer off the CPU computes stock."""
    from rag_lookahead.weight_watch import watch_of

    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Linear(64, 32))
    x = torch.randn(3, 48)
    with packed_by(kernel), torch.no_grad():
        speed_up_cpu_linears(model, min_elements=0)
        model(x)
        packs = [layer._rag_lookahead_packed for layer in model]
        assert all(p._copies for p in packs) and len(watch_of(model)) == 2
        model.half()
        out = model(x.half())
        assert not any(p._copies for p in packs) and len(watch_of(model)) == 0
        torch.testing.assert_close(out, model[1](model[0](x.half())))
        model.float()  # back: packed again from the weights as they are
        torch.testing.assert_close(model(x), torch.nn.functional.linear(model[0](x), model[1].weight, model[1].bias))
        assert all(p._copies for p in packs) and len(watch_of(model)) == 2
        model.to("meta")  # stands in for a GPU here: the CPU kernels must not be called on it
        assert model(x.to("meta")).device.type == "meta" and len(watch_of(model)) == 0
    restore_linears(model)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_weights_merged_through_data_are_used_by_every_forward(arch, kernel):
    """peft's ``merge_and_unload`` adds each adapter's product to its layer through
    ``weight.data`` (no version bump, same storage): the packed copies used to keep the weights
    from before the merge, for ``model.generate`` and a plain forward as much as for ours. Every
    forward now follows the merged weights, as the same model without the layout does."""
    model, stock_model = build_tiny_model(arch, "sdpa", 0), build_tiny_model(arch, "sdpa", 0)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    with packed_by(kernel):
        speed_up_cpu_linears(model, min_elements=0)
        try:
            reference_generate(model, prompt, 8, None)  # the copies are made
            generator = torch.Generator().manual_seed(7)
            merged = 0
            for layer, stock in zip(model.modules(), stock_model.modules()):
                if getattr(layer, "_rag_lookahead_packed", None) is not None:
                    delta = torch.randn(layer.weight.shape, generator=generator) * 0.2
                    layer.weight.data += delta
                    stock.weight.data += delta
                    merged += 1
            assert merged
            expected = reference_generate(stock_model, prompt, 24, None)
            assert expected != reference_generate(build_tiny_model(arch, "sdpa", 0), prompt, 24, None)
            assert reference_generate(model, prompt, 24, None) == expected
            result = generate(model, prompt, max_new_tokens=24, pad_token_id=0)
            assert result.sequences[0, len(prompt) :].tolist() == expected
        finally:
            restore_linears(model)


@needs_mkl_packed
def test_inference_tensors_are_not_packed():
    """Weights made under inference_mode have no version counter to check: they take the other kernels."""
    with torch.inference_mode():
        weight = torch.randn(64, 48)
        x = torch.randn(3, 48)
        packed = PackedWeight()
        got = few_token_linear(x, weight, None, packed)
    assert not packed._copies
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_swapped_product_runs_only_for_few_rows():
    weight = torch.randn(64, 32)
    for rows in (1, 2, 64, 65, 300):
        x = torch.randn(rows, 32)
        same = torch.equal(few_token_linear(x, weight), torch.nn.functional.linear(x, weight))
        if rows not in FEW_TOKENS:
            assert same  # the stock kernel itself: bit for bit


@pytest.mark.parametrize("kernel", KERNELS)
def test_patches_large_cpu_linears_only_and_undoes(kernel):
    """Large fp32 linears always; bf16 ones from a smaller size where this CPU takes the bf16
    layout, and fp32 ones from that size where oneDNN packs them; small ones never."""
    with packed_by(kernel):
        _patches_large_linears_only(kernel == "onednn")


def _patches_large_linears_only(onednn: bool):
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024),  # 1M weights: patched
        torch.nn.Linear(1024, 8),  # small: stock
        torch.nn.Linear(1024, 1024).to(torch.bfloat16),  # bf16: patched where the layout applies
        torch.nn.Linear(1024, 1024).to(torch.float16),  # fp16: stock
        torch.nn.Linear(1024, 128),  # fp32 below MIN_WEIGHT_ELEMENTS: stock, unless oneDNN packs fp32
        torch.nn.Linear(1024, 128).to(torch.bfloat16),  # bf16 of that size: patched where the layout applies
        torch.nn.Linear(1024, 32).to(torch.bfloat16),  # below MIN_BF16_WEIGHT_ELEMENTS: stock
    )
    bf16 = bf16_layout_applies()
    profile_of(model).cost_curve = CostCurve([1, 2], [0.1, 0.2])
    assert speed_up_cpu_linears(model) == 1 + 2 * bf16 + onednn
    patched = ["forward" in vars(m) for m in model]
    assert patched == [True, False, bf16, False, onednn, bf16, False]
    assert isinstance(model[0]._rag_lookahead_packed, PackedWeight)
    assert profile_of(model).cost_curve is None  # costs measured under the old layout are forgotten
    assert speed_up_cpu_linears(model) == 1 + 2 * bf16 + onednn  # again: no change
    x = torch.randn(3, 1024)
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    restore_linears(model)
    assert not any("forward" in vars(m) or "_rag_lookahead_packed" in vars(m) for m in model)
    assert model._rag_lookahead_few_token_linears == 0


def test_stock_linears_sets_the_layout_aside_for_a_while():
    """Benchmarks time transformers on torch's stock kernels beside the layout, on one model."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    assert speed_up_cpu_linears(model) == 1
    packed = model[0]._rag_lookahead_packed
    x = torch.randn(5, 1024)
    with torch.no_grad():
        model[0](x)  # packs the copy
        with stock_linears(model) as count:
            assert count == 1 and "forward" not in vars(model[0])
            torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
        assert "forward" in vars(model[0]) and model[0]._rag_lookahead_packed is packed  # the copy is kept
        torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    restore_linears(model)


needs_bf16_packed = pytest.mark.skipif(not bf16_packed_works(), reason="this torch has no working bf16 packed kernels")


@needs_bf16_packed
@settings(max_examples=30, deadline=None)
@given(
    rows=st.sampled_from([*range(1, 70), 1023, 1024, 1025, 2100]),  # and past a widened block
    features=st.integers(min_value=8, max_value=96),
    outputs=st.integers(min_value=1, max_value=64),
    bias=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**16),
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_packed_kernels_compute_the_bf16_product(kernel, rows, features, outputs, bias, seed):
    """A bf16 weight's packed kernels give bf16 outputs within bf16 rounding of the exact product,
    as the stock kernel's are, and equal to it in nearly every element (the sums' order differs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen).bfloat16()
    weight = torch.randn(outputs, features, generator=gen).bfloat16()
    b = torch.randn(outputs, generator=gen).bfloat16() if bias else None
    packed = PackedWeight()
    with packed_by(kernel), torch.no_grad():
        got = few_token_linear(x, weight, b, packed)
    stock = torch.nn.functional.linear(x, weight, b)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == stock.shape
    scale = x.double().abs() @ weight.double().abs().t() + (0 if b is None else b.double().abs())
    assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + 2 * (features + 2) * 2.0**-24 * scale).all()
    assert (got != stock).float().mean() <= 0.02
    if kernel == "onednn":
        assert set(packed._copies) == {"onednn"}  # oneDNN's bf16 copy only, at every row count
        return
    block = cpu_linear._WIDE_BLOCK  # a long input goes to MKL in blocks
    parts = [rows] if rows <= block else [block] * (rows // block) + [rows % block]
    assert set(packed._copies) == {"onednn" if n in BF16_ONEDNN_TOKENS else "mkl" for n in parts if n}


@needs_bf16_packed
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_bf16_packed_weight_follows_changes_to_the_weight(kernel):
    weight = torch.randn(64, 48).bfloat16()
    packed = PackedWeight()
    with packed_by(kernel), torch.no_grad():
        for rows in (4, 40):  # one of each kernel
            x = torch.randn(rows, 48).bfloat16()
            first = few_token_linear(x, weight, None, packed)
            weight.mul_(2.0)
            again = few_token_linear(x, weight, None, packed)
            torch.testing.assert_close(again, torch.nn.functional.linear(x, weight), rtol=2**-7, atol=1e-2)
            assert not torch.allclose(again, first)


def test_the_packed_kernel_is_chosen_once_and_can_be_fixed(monkeypatch):
    """Timed once per dtype (the same answer after), fixed by RAG_LOOKAHEAD_CPU_GEMM, and a
    misspelled value is refused with the variable's name rather than silently timed."""
    monkeypatch.delenv(GEMM_ENV, raising=False)
    packed_kernel.cache_clear()
    chosen = packed_kernel(torch.float32)
    assert chosen in KERNELS and packed_kernel(torch.float32) == chosen
    monkeypatch.setenv(GEMM_ENV, "openblas")
    packed_kernel.cache_clear()
    with pytest.raises(ConfigError, match=GEMM_ENV):
        packed_kernel(torch.float32)
    monkeypatch.setenv(GEMM_ENV, " oneDNN ")
    packed_kernel.cache_clear()
    # (a CPU without AVX512-BF16 has oneDNN, but its reordered bf16 product does not compute linear)
    assert packed_kernel(torch.bfloat16) == "onednn" or not _reordered_onednn_works(torch.bfloat16)
    monkeypatch.delenv(GEMM_ENV)
    packed_kernel.cache_clear()


def test_threads_choosing_the_packed_kernel_at_once_agree(monkeypatch):
    """The first weights packed by two threads at once: the kernels are timed once, and both get
    the one answer (each timed them, and a close race could tell them different kernels)."""
    import threading

    from rag_lookahead import cpu_linear

    if not (mkl_packed_works() and _reordered_onednn_works(torch.float32)):
        pytest.skip("one packed kernel only here: nothing is timed")
    timings = iter([(1.0, 0.5), (0.5, 1.0)] * 4)  # oneDNN wins the first timing, MKL the next

    def timed(dtype):
        time.sleep(0.05)
        return next(timings)

    monkeypatch.delenv(GEMM_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "_time_packed_kernels", timed)
    packed_kernel.cache_clear()
    answers = []
    try:
        threads = [threading.Thread(target=lambda: answers.append(packed_kernel(torch.float32))) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        packed_kernel.cache_clear()
    assert answers == ["onednn"] * 4


def test_the_choice_keys_the_cost_curve(monkeypatch):
    """A forward's cost curve measured under one packed kernel is not reused under the other."""
    from rag_lookahead.decoding.costs import _linears_key

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    model.dtype = torch.float32
    speed_up_cpu_linears(model)
    keys = set()
    try:
        for kernel in KERNELS:
            monkeypatch.setenv(GEMM_ENV, kernel)
            packed_kernel.cache_clear()
            keys.add(_linears_key(model))
    finally:
        monkeypatch.delenv(GEMM_ENV)
        packed_kernel.cache_clear()
        restore_linears(model)
    assert len(keys) == 2 or not (mkl_packed_works() and onednn_linear_works())


def test_the_bf16_layout_needs_room_for_its_copies():
    """Its copies (6 bytes a weight) are made only where they fit in half the available memory."""
    from rag_lookahead.cpu_linear import _fits

    assert _fits(1) and not _fits(1 << 60)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DECODE_CASES)
def test_lookahead_on_the_few_token_layout_matches_generate(arch, kernel, prompt, max_new, budget):
    model = build_tiny_model(arch, "sdpa", 0)  # its own instance: the shared tiny models stay stock
    stock = reference_generate(model, prompt, max_new, None)
    with packed_by(kernel):
        _lookahead_on_the_layout_matches(model, prompt, max_new, budget, stock)


def _lookahead_on_the_layout_matches(model, prompt, max_new, budget, stock):
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


def test_layers_off_the_cpu_never_time_the_cpu_kernels(monkeypatch):
    """A model whose weights are elsewhere (meta here, a GPU in use) gets no layout, and neither
    times the CPU's kernels nor reads RAG_LOOKAHEAD_CPU_GEMM (a bad value used to fail its load)."""
    monkeypatch.setenv(GEMM_ENV, "openblas")
    packed_kernel.cache_clear()
    try:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 128))
        assert speed_up_cpu_linears(model) == 0
    finally:
        monkeypatch.delenv(GEMM_ENV)
        packed_kernel.cache_clear()
