"""Few-token linear layers on a CPU at the price of one token: the forwards that verify drafts.

Why: on a CPU, torch computes ``nn.Linear`` as ``x @ W.T`` through the BLAS library, and for a
few rows of ``x`` (2 to a few dozen tokens, what a draft verification feeds) MKL picks a GEMM
kernel that costs 2-4x its one-token kernel, which only reads the weights once. A draft of a
few tokens should cost about what one token costs: the weights are read once either way.

Three kernels, best first where this torch has them:

* **MKL's packed GEMM** (``torch.ops.mkl._mkl_linear`` on a weight reordered once by
  ``_mkl_reorder_linear_weight``, what torch's own compiler uses for frozen fp32 linears), for
  1-``PACKED_TOKENS`` rows. The default model's 72 MLP products (24 layers, 896x4864 twice and
  4864x896), cache-cold, on a 2-core Xeon with AVX-512 (MKL 2024.2, torch 2.13), in ms:
  1/2/3/4/8/16/32/64 rows 42/46/50/54/65/79/107/161 packed (``PACK_HINT`` 64) against stock
  42/46/48/83/108/105/141/222, the swapped product below 42/80/79/80/80/80/107/194 and oneDNN
  48/70/68/66/73/88/127/-. The reordered copy is kept beside the weight (the default fp32
  model's process grew 2.98 -> 4.25 GB resident) and redone if the weight is changed in place
  or replaced; a whole forward of 2/4/8 tokens over a 700-token cache fell from 124/134/134 ms
  to 83/100/119 ms.
* **oneDNN's linear** for ``ONEDNN_TOKENS`` rows, where MKL's packed GEMM is missing: MKL's
  stock kernels are uneven there (12-14 tokens cost more than 16), oneDNN's are not. Per MLP
  (896->4864 twice, 4864->896), best of 5 on a 2-vCPU AMD EPYC: 1 token 3.13 -> 2.09 ms, 12
  tokens 7.4 -> 5.1 ms, 14 tokens 8.3 -> 5.5 ms.
* **The swapped product** ``(W @ x.T).T`` for other ``FEW_TOKENS`` rows: on the same EPYC a
  forward over a 400-token cache took 214 ms for 1 token, 443/521/511 ms for 2/4/8 tokens the
  stock way and 221/236/266 ms this way; 16/32/64 tokens 481/819/1276 ms against 417/610/940.

Packed and oneDNN kernels run only without autograd (``no_grad``/``inference_mode``, where
decoding runs); with autograd on, the swapped product. Only the layout of one matrix product
changes: the same weights, the same sums (the rounding may differ in the last bits, as any
other kernel's would), so a model's output stays its own; long prompts run the stock kernel.

``load_model`` applies this to fp32 models on a CPU; call :func:`speed_up_cpu_linears` on a
model of your own, :func:`restore_linears` to undo it.
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "FEW_TOKENS",
    "MIN_WEIGHT_ELEMENTS",
    "ONEDNN_TOKENS",
    "PACKED_TOKENS",
    "PackedWeight",
    "few_token_linear",
    "mkl_packed_works",
    "onednn_linear",
    "onednn_linear_works",
    "restore_linears",
    "speed_up_cpu_linears",
]

#: token counts (rows of the input) that take the swapped product; measured faster up to 64
FEW_TOKENS = range(2, 65)
#: token counts that take oneDNN's linear where it works (measured faster: see above)
ONEDNN_TOKENS = frozenset({1, *range(6, 29)})
#: token counts that take MKL's packed GEMM where it works (measured faster: see above)
PACKED_TOKENS = range(1, 65)
#: the row count MKL packs the weight for; 64 measured within noise of 32 for 1-32 rows, faster for 48-64
PACK_HINT = 64
#: smaller weights gained nothing measurable (896x896: within +-20% either way), so they keep the stock kernel
MIN_WEIGHT_ELEMENTS = 1 << 20
_MARK = "_rag_lookahead_few_token"
_PACKED = "_rag_lookahead_packed"


def few_token_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: PackedWeight | None = None
) -> torch.Tensor:
    """``functional.linear(x, weight, bias)``: through MKL's packed GEMM for ``PACKED_TOKENS``
    rows of ``x`` (given ``packed``, without autograd, where it works), else oneDNN for
    ``ONEDNN_TOKENS`` rows (without autograd, where it works), as ``(weight @ x.T).T`` for other
    few rows, else stock."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fast = rows and not torch.is_grad_enabled()
    if (
        fast
        and packed is not None
        and rows in PACKED_TOKENS
        and x.dtype == weight.dtype
        and not weight.is_inference()
        and mkl_packed_works()
    ):
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        return packed.linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    if fast and rows in ONEDNN_TOKENS and onednn_linear_works():
        return onednn_linear(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if rows not in FEW_TOKENS:
        return functional.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


class PackedWeight:
    """A weight reordered for MKL's packed GEMM, redone when the weight changes.

    Why the check: the copy is the weight's values at packing time; a weight edited in place
    (``load_state_dict``, fine-tuning steps) or replaced would otherwise keep computing with
    the old values. The weight's identity and version counter say whether it is still the same
    (inference tensors have no version counter: ``few_token_linear`` does not pack them).
    """

    def __init__(self) -> None:
        self._source: weakref.ref | None = None  # the tensor packed (a weak reference: a freed one never matches)
        self._version = -1
        self._packed: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        source = self._source() if self._source is not None else None
        if source is not weight or weight._version != self._version or self._packed is None:
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_HINT)
            self._source, self._version = weakref.ref(weight), weight._version
        # the row count must be x's own: MKL computes garbage for any other
        return torch.ops.mkl._mkl_linear(x, self._packed, weight, bias, x.shape[0])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear of a 2-D ``x`` (torch's private op: its call convention lives here only)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def mkl_packed_works() -> bool:
    """Whether this torch has MKL's packed linear and it computes ``functional.linear`` (checked once)."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    return _computes_linear(lambda x, weight, bias: PackedWeight().linear(x, weight, bias))


@functools.cache
def onednn_linear_works() -> bool:
    """Whether this torch has oneDNN's linear op and it computes ``functional.linear`` (checked once)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return _computes_linear(onednn_linear)


def _computes_linear(kernel) -> bool:
    """Whether ``kernel(x, weight, bias)`` runs here and equals ``functional.linear`` on a small case."""
    try:
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, wherever the first call comes from
            generator = torch.Generator().manual_seed(0)
            x, weight, bias = (torch.randn(shape, generator=generator) for shape in ((3, 40), (24, 40), (24,)))
            out = kernel(x, weight, bias)
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False
    return out.shape == (3, 24) and torch.allclose(out, functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_token_linear(x, self.weight, self.bias, getattr(self, _PACKED))


def speed_up_cpu_linears(model: nn.Module, min_elements: int = MIN_WEIGHT_ELEMENTS) -> int:
    """Give every fp32 ``nn.Linear`` on the CPU with at least ``min_elements`` weights the few-token
    product; returns how many layers have it (calling again changes nothing)."""
    count = 0
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if not getattr(module, _MARK, False):
            weight = module.weight
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < min_elements:
                continue
            module.forward = types.MethodType(_forward, module)
            # packed on first use, so loading stays as fast; not the output layer (a vocabulary
            # of rows: ~1 GB and 1.2 s more for the default model, and greedy steps screen it)
            setattr(module, _PACKED, None if module is output else PackedWeight())
            setattr(module, _MARK, True)
        count += 1
    _layout_changed(model, count)
    return count


def restore_linears(model: nn.Module) -> None:
    """Undo :func:`speed_up_cpu_linears`: every layer back to the stock ``nn.Linear.forward``."""
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _PACKED)
            delattr(module, _MARK)
    _layout_changed(model, 0)


def _layout_changed(model: nn.Module, count: int) -> None:
    """Forget the forward costs measured under the other layout (the count is in the cost file's key)."""
    from rag_lookahead.decoding.profile import profile_of

    if getattr(model, "_rag_lookahead_few_token_linears", 0) != count:
        profile_of(model).forget_costs()
    model._rag_lookahead_few_token_linears = count
