"""Few-token linear layers on a CPU at the price of one token: the forwards that verify drafts.

Why: on a CPU, torch computes ``nn.Linear`` as ``x @ W.T`` through the BLAS library, and for a
few rows of ``x`` (2 to a few dozen tokens, what a draft verification feeds) MKL picks a GEMM
kernel that costs 2-4x its one-token kernel, which only reads the weights once. Computed the
other way round, ``(W @ x.T).T``, the same product costs about what one token costs up to ~8
tokens. Measured on the default model (fp32, a 2-vCPU AMD EPYC with AVX2, MKL 2024.2, torch
2.13): a forward over a 400-token cache took 214 ms for 1 token, 443/521/511 ms for 2/4/8
tokens the stock way and 221/236/266 ms this way; 16/32/64 tokens 481/819/1276 ms against
417/610/940 ms. Drafts of a few tokens then cost about what a plain step costs.

Only the layout of one matrix product changes: the same weights, the same sums (the rounding
may differ in the last bits, as any other kernel's would), so a model's output stays its own;
long prompts (``FEW_TOKENS`` outside) run the stock kernel untouched.

Where torch has oneDNN, one token and 6-28 tokens go through oneDNN's linear instead (under
``no_grad``/``inference_mode``, where decoding runs; with autograd on, the products above):
MKL's kernels are uneven there (12-14 tokens cost more than 16), oneDNN's are not. Per MLP
(896->4864 twice, 4864->896), best of 5 here: 1 token 3.13 -> 2.09 ms, 12 tokens 7.4 -> 5.1 ms,
14 tokens 8.3 -> 5.5 ms; a whole forward over a 256-token cache (default model, last position's
logits): 1 token 145 -> 99 ms, 12 tokens 264 -> 197 ms, 20 tokens 289 -> 239 ms; 4 and 32+
tokens no faster, so they keep the products above.

``load_model`` applies this to fp32 models on a CPU; call :func:`speed_up_cpu_linears` on a
model of your own, :func:`restore_linears` to undo it.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "FEW_TOKENS",
    "MIN_WEIGHT_ELEMENTS",
    "ONEDNN_TOKENS",
    "few_token_linear",
    "onednn_linear",
    "onednn_linear_works",
    "restore_linears",
    "speed_up_cpu_linears",
]

#: token counts (rows of the input) that take the swapped product; measured faster up to 64
FEW_TOKENS = range(2, 65)
#: token counts that take oneDNN's linear where it works (measured faster: see above)
ONEDNN_TOKENS = frozenset({1, *range(6, 29)})
#: smaller weights gained nothing measurable (896x896: within +-20% either way), so they keep the stock kernel
MIN_WEIGHT_ELEMENTS = 1 << 20
_MARK = "_rag_lookahead_few_token"


def few_token_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``functional.linear(x, weight, bias)``: through oneDNN for ``ONEDNN_TOKENS`` rows of ``x``
    (without autograd, where it works), as ``(weight @ x.T).T`` for other few rows, else stock."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows in ONEDNN_TOKENS and not torch.is_grad_enabled() and onednn_linear_works():
        return onednn_linear(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if rows not in FEW_TOKENS:
        return functional.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear of a 2-D ``x`` (torch's private op: its call convention lives here only)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_linear_works() -> bool:
    """Whether this torch has oneDNN's linear op and it computes ``functional.linear`` (checked once)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(shape, generator=generator) for shape in ((3, 40), (24, 40), (24,)))
    try:
        with torch.no_grad():
            out = onednn_linear(x, weight, bias)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.shape == (3, 24) and torch.allclose(out, functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_token_linear(x, self.weight, self.bias)


def speed_up_cpu_linears(model: nn.Module, min_elements: int = MIN_WEIGHT_ELEMENTS) -> int:
    """Give every fp32 ``nn.Linear`` on the CPU with at least ``min_elements`` weights the few-token
    product; returns how many layers have it (calling again changes nothing)."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if not getattr(module, _MARK, False):
            weight = module.weight
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < min_elements:
                continue
            module.forward = types.MethodType(_forward, module)
            setattr(module, _MARK, True)
        count += 1
    _layout_changed(model, count)
    return count


def restore_linears(model: nn.Module) -> None:
    """Undo :func:`speed_up_cpu_linears`: every layer back to the stock ``nn.Linear.forward``."""
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
    _layout_changed(model, 0)


def _layout_changed(model: nn.Module, count: int) -> None:
    """Forget the forward costs measured under the other layout (the count is in the cost file's key)."""
    from rag_lookahead.decoding.profile import profile_of

    if getattr(model, "_rag_lookahead_few_token_linears", 0) != count:
        profile_of(model).forget_costs()
    model._rag_lookahead_few_token_linears = count
