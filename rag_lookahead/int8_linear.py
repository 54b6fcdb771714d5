"""int8 linears on the CPU: packing on the faster engine, and the embedding encoder's layers.

:func:`prepack` packs a quantized weight on oneDNN where torch has it (the LLM's output-layer
screen, :mod:`rag_lookahead.greedy_head`, and the encoder below use it). The encoder's layers are
float32 or int8 with each sequence quantized on its own. Why int8 there: embedding a chunk is
compute-bound (~10 GFLOP for a 240-token chunk through e5-small), and on CPUs with int8
dot-product instructions (AVX512-VNNI, AVX-VNNI) torch's dynamic int8 linear runs 2-2.5x the
float32 GEMM's rate. Weights are quantized once per output channel; activations are quantized at
each call with one scale for the whole input, so :class:`Int8Linear` calls it once per sequence:
a text's vector never depends on which other texts shared its batch.

torch marks its quantized-tensor API deprecated; it is used only behind :func:`quantized_linear`,
which returns ``None`` where the kernel is missing, and the encoder checks the int8 model against
float32 before using it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["DenseLinear", "Int8Linear", "Spans", "packing_engine", "prepack", "quantize_and_pack", "quantized_linear"]

Spans = Sequence[tuple[int, int]]  # [start, end) rows of each sequence in a packed batch


class DenseLinear:
    """``x @ W.T + b`` in float32 over the whole packed batch (rows are independent)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor, spans: Spans) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    """Dynamic int8 linear: int8 weights per output channel, each sequence's activations quantized
    with their own range (asymmetric uint8, full range), float32 output with the bias added.

    ``input_scale`` (per input channel): the input is divided by it and the weight's columns were
    multiplied by it (SmoothQuant), so a few channels with large values no longer set the whole
    input's quantization step."""

    def __init__(self, packed, input_scale: torch.Tensor | None = None):
        self.packed, self.input_scale = packed, input_scale

    def __call__(self, x: torch.Tensor, spans: Spans) -> torch.Tensor:
        run = _LINEAR_DYNAMIC
        if self.input_scale is not None:
            x = x / self.input_scale
        if len(spans) == 1:
            return run(x, self.packed, False)
        return torch.cat([run(x[start:end], self.packed, False) for start, end in spans])


#: oneDNN's kernel ran e5-small's four linear shapes in 1.06 ms against fbgemm's 1.18 (240 rows),
#: and the default LLM's int8 output-layer screen (151,936 x 896) in 7.6/11.7/18.6 ms against
#: 12.3/15.4/23.8 for 1/8/16 positions (AVX512-VNNI Xeon); a packed weight keeps its engine
PREFERRED_ENGINE = "onednn"


def packing_engine() -> str:
    """The quantized engine :func:`prepack` packs on."""
    if PREFERRED_ENGINE in torch.backends.quantized.supported_engines:
        return PREFERRED_ENGINE
    return torch.backends.quantized.engine


def prepack(qweight: torch.Tensor, bias: torch.Tensor | None):
    """``torch.ops.quantized.linear_prepack`` on :func:`packing_engine` (the process-wide engine
    setting is restored)."""
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = packing_engine()
        return torch.ops.quantized.linear_prepack(qweight, bias)
    finally:
        torch.backends.quantized.engine = engine


def quantize_and_pack(weight: torch.Tensor, bias: torch.Tensor | None, smallest_scale: float):
    """``(int8 weight, packed weight)``: ``weight`` [out, in] quantized symmetrically per output row
    (scale = the row's largest magnitude / 127, at least ``smallest_scale``), packed by :func:`prepack`."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(smallest_scale).double()
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notices that its quantized-tensor API is deprecated
        quantized = torch.quantize_per_channel(weight, scales, zero, 0, torch.qint8)
        return quantized, prepack(quantized, bias)


def quantized_linear(
    weight: torch.Tensor, bias: torch.Tensor, input_scale: torch.Tensor | None = None
) -> Int8Linear | None:
    """An :class:`Int8Linear` for ``weight`` [out, in], or ``None`` where this torch build cannot make one."""
    if _LINEAR_DYNAMIC is None:
        return None
    if input_scale is not None:
        weight = weight * input_scale
    try:
        return Int8Linear(quantize_and_pack(weight.float(), bias.float(), 1e-12)[1], input_scale)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


try:
    _LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default
except (AttributeError, RuntimeError):  # a torch build without quantized kernels
    _LINEAR_DYNAMIC = None
