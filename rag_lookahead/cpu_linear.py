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

**bf16 weights** (on a CPU with AVX512-BF16 but no AMX tiles, the only kind measured): bf16
GEMMs of a few dozen rows there run at ~130 GFLOP/s, below fp32's ~260, so a draft of 32-64
tokens cost 290-500 ms a forward against ~85 ms for one token. Two packed copies, made on
first use: oneDNN's reordered bf16 weight for ``BF16_ONEDNN_TOKENS`` rows, and MKL's packed
fp32 copy of the same values for more rows (batched steps and prompts too: per MLP, 64/256/1024
rows 11.6/42.7/200 ms stock against 6.8/24.5/121 ms), whose sums are rounded to bf16 once at
the end. That is what a bf16 GEMM computes (products of bf16 values are exact in
fp32, summed in fp32, rounded once) in another order, so the output differs from stock only in
the last bit now and then, as any other bf16 kernel's would (bf16 answers were never
bit-stable across batch shapes; see the README). The default model's forward over a 256-token
cache, stock -> this layout (output layer included), 2 threads: 1/8/16/32/48/64 tokens
83-98/133-145/185/287-294/389-391/493-497 ms -> 66-68/111/153-154/219-222/272-282/327-337 ms.
Cost: 6 bytes more per weight (the default model: ~2.7 GB; 2 bytes where oneDNN packs every row
count, below, and MKL's copy is not made), so :func:`speed_up_cpu_linears` applies it only while
that stays under half the memory available.

**Which packed kernel, measured per machine.** MKL's GEMMs are tuned for Intel CPUs; on an AMD
EPYC (AVX512-BF16, 2 vCPUs) they ran 2.4-6.5x slower than oneDNN's at every row count, cache-warm
per MLP, in ms: fp32 1/16/64/512 rows MKL packed 3.06/8.50/14.5/78.8 against oneDNN on a
reordered weight 1.00/1.73/5.71/32.4; bf16 17/32/64 rows MKL on the fp32 copy 8.92/11.2/16.8
against oneDNN's bf16 1.37/2.80/3.90. There the default model's bf16 forward of 24/32/64 tokens
over a 700-token cache took 348-366/399-436/617-703 ms with MKL and 74-85/94-97/151-157 ms with
oneDNN, and a 700-token prompt 4.8-6.4 s against 1.3-1.9 s (two rounds each way). So the first
packed product of each dtype times both kernels on a 32-row product (:func:`packed_kernel`) and
oneDNN takes every row count where it needs at most 3/4 of MKL's time (here: 0.21-0.49); elsewhere (the Xeon
above: MKL the faster) the row bands above stay. ``RAG_LOOKAHEAD_CPU_GEMM=mkl`` or ``onednn`` fixes the choice.

Packed and oneDNN kernels run only without autograd (``no_grad``/``inference_mode``, where
decoding runs); with autograd on, the swapped product. Only the layout of one matrix product
changes: the same weights, the same sums (the rounding may differ in the last bits, as any
other kernel's would), so a model's output stays its own. Long prompts run the stock kernel,
except where oneDNN is the packed kernel (every row count) or for bf16 (MKL's fp32 copy in blocks).

``load_model`` applies this to fp32 models on a CPU; call :func:`speed_up_cpu_linears` on a
model of your own, :func:`restore_linears` to undo it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional

from rag_lookahead.weight_watch import WeightWatch, watch_of

__all__ = [
    "BF16_ONEDNN_TOKENS",
    "FEW_TOKENS",
    "MIN_BF16_WEIGHT_ELEMENTS",
    "MIN_WEIGHT_ELEMENTS",
    "ONEDNN_TOKENS",
    "PACKED_TOKENS",
    "PackedWeight",
    "bf16_layout_applies",
    "bf16_packed_works",
    "cpu_bf16",
    "few_token_linear",
    "mkl_packed_works",
    "onednn_linear",
    "onednn_linear_works",
    "packed_kernel",
    "restore_linears",
    "speed_up_cpu_linears",
    "stock_linears",
    "weight_stamp",
]

#: token counts (rows of the input) that take the swapped product; measured faster up to 64
FEW_TOKENS = range(2, 65)
#: token counts that take oneDNN's linear where it works (measured faster: see above)
ONEDNN_TOKENS = frozenset({1, *range(6, 29)})
#: token counts that take MKL's packed GEMM where it works (measured faster: see above)
PACKED_TOKENS = range(1, 65)
#: the row count MKL packs the weight for; 64 measured within noise of 32 for 1-32 rows, faster for 48-64
PACK_HINT = 64
#: bf16 row counts that take oneDNN's reordered bf16 weight; more take the packed fp32 copy, however many
BF16_ONEDNN_TOKENS = range(1, 17)
#: rows of a bf16 input widened to fp32 at a time (their temporaries: 4 bytes x rows x (in + out))
_WIDE_BLOCK = 1024
#: a bf16 weight's packed copies: 2 bytes (oneDNN's bf16) + 4 (MKL's fp32) per weight
_BF16_EXTRA_BYTES = 6
#: where MKL is left out: oneDNN's bf16 copy only
_BF16_ONEDNN_EXTRA_BYTES = 2
#: what fixes :func:`packed_kernel`'s choice instead of timing it
GEMM_ENV = "RAG_LOOKAHEAD_CPU_GEMM"
#: oneDNN takes every row count where it needs at most this share of MKL's time: the AMD EPYC
#: measured 0.21 (bf16) to 0.38 (fp32) quiet and up to 0.49 beside a test run, the Xeon ~1.2 (MKL the faster)
_ONEDNN_SHARE = 0.75
_LAYOUT_DTYPES = (torch.float32, torch.bfloat16)
#: smaller fp32 weights gained nothing measurable (896x896: within +-20% either way on an EPYC; 0-5%
#: on the AVX-512 Xeon, 9% slower at 64 tokens), so they keep the stock kernel, except where
#: oneDNN is fp32's packed kernel (see ``_least_elements``)
MIN_WEIGHT_ELEMENTS = 1 << 20
#: bf16 weights from this size (the default model's attention projections, 896x896 and 128x896):
#: stock bf16 GEMMs run at about half the packed kernels' rate there too. A whole forward of the
#: default model over a 256-token cache, 1..64 tokens, stock -> packed, alternated forward by
#: forward (12 each, medians; AVX-512 Xeon, 2 threads): 0.90-0.97x
MIN_BF16_WEIGHT_ELEMENTS = 1 << 16
_MARK = "_rag_lookahead_few_token"
_PACKED = "_rag_lookahead_packed"


def few_token_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: PackedWeight | None = None
) -> torch.Tensor:
    """``functional.linear(x, weight, bias)``: through MKL's packed GEMM for ``PACKED_TOKENS``
    rows of ``x`` (given ``packed``, without autograd, where it works), else oneDNN for
    ``ONEDNN_TOKENS`` rows (without autograd, where it works), as ``(weight @ x.T).T`` for other
    few rows, else stock."""
    if weight.device.type != "cpu":  # a model moved off the CPU after its layers were laid out
        return functional.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fast = rows and not torch.is_grad_enabled()
    if (
        fast
        and packed is not None
        and x.dtype == weight.dtype
        and not weight.is_inference()
        and (
            (weight.dtype == torch.float32 and _fp32_packed_takes(rows))
            or (weight.dtype == torch.bfloat16 and bf16_packed_works())
        )
    ):
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        return packed.linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    if weight.dtype != torch.float32:  # the kernels below were measured for fp32 only
        return functional.linear(x, weight, bias)
    if fast and rows in ONEDNN_TOKENS and onednn_linear_works():
        return onednn_linear(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if rows not in FEW_TOKENS:
        return functional.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


class PackedWeight:
    """A weight's copies reordered for the packed kernels, made on first use, redone when the
    weight changes: MKL's packed fp32 GEMM (of an fp32 weight, or of a bf16 weight's values),
    and for bf16 weights also oneDNN's reordered bf16 weight.

    Why the check: a copy is the weight's values at packing time; a weight edited in place
    (``load_state_dict``, fine-tuning steps) or replaced would otherwise keep computing with
    the old values. The weight's identity and :func:`weight_stamp` say whether it is still the
    same (inference tensors have no version counter: ``few_token_linear`` does not pack them);
    ``watch`` (the model's :class:`~rag_lookahead.weight_watch.WeightWatch`) sees edits through
    ``weight.data``, which that stamp misses.
    """

    def __init__(self, watch: WeightWatch | None = None) -> None:
        self._source: weakref.ref | None = None  # the tensor packed (a weak reference: a freed one never matches)
        self._stamp: tuple | None = None
        self._copies: dict[str, torch.Tensor] = {}
        self._watch = watch

    def __reduce__(self):  # a copied or pickled model packs its own weights again on first use
        return PackedWeight, (self._watch,)

    def forget_copies(self) -> None:
        """Drop the copies (the weight's values moved): made again on next use."""
        self._copies, self._stamp = {}, None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``functional.linear`` of a 2-D ``x`` with the weight's dtype."""
        rows = x.shape[0]
        if packed_kernel(weight.dtype) == "onednn" or (weight.dtype == torch.bfloat16 and rows in BF16_ONEDNN_TOKENS):
            return onednn_linear(x, self._copy(weight, "onednn"), bias)
        if weight.dtype == torch.bfloat16 and rows > _WIDE_BLOCK:  # a long prompt: bounded fp32 temporaries
            return torch.cat([self.linear(part, weight, bias) for part in x.split(_WIDE_BLOCK)])
        return _mkl_product(x, self._copy(weight, "mkl"), weight, bias)

    def _copy(self, weight: torch.Tensor, kind: str) -> torch.Tensor:
        source = self._source() if self._source is not None else None
        stamp = weight_stamp(weight)
        if source is not weight or stamp != self._stamp:
            self._copies = {}
            self._source, self._stamp = weakref.ref(weight), stamp
            if self._watch is not None:
                self._watch.watch(self, weight)
        copy = self._copies.get(kind)
        if copy is None:  # (held here: another thread may forget the copies meanwhile)
            copy = self._copies[kind] = (_mkl_packed if kind == "mkl" else _onednn_packed)(weight.detach())
        return copy


def _mkl_packed(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of a weight's values, in fp32 (a bf16 weight's too)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.float(), PACK_HINT)


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of a weight, in its own dtype."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT)


def _mkl_product(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """MKL's packed product of a 2-D ``x`` with ``packed`` (:func:`_mkl_packed` of ``weight``): an
    fp32 weight's directly; a bf16 weight's in fp32, the sums (and bias) rounded to bf16 once."""
    rows = x.shape[0]  # the row count must be x's own: MKL computes garbage for any other
    if weight.dtype == torch.float32:
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    # MKL checks the original weight's dtype and shape only: a stride-0 fp32 stand-in
    stand_in = torch.zeros((), dtype=torch.float32).expand(weight.shape)
    sums = torch.ops.mkl._mkl_linear(x.float(), packed, stand_in, None, rows)
    if bias is not None:
        sums += bias
    return sums.to(weight.dtype)


def weight_stamp(weight: torch.Tensor) -> tuple:
    """What says a weight object still holds the values a copy of it was made from: its in-place
    version (``mul_``, ``copy_``, ``load_state_dict``), its storage (``weight.data = ...`` keeps
    the version), dtype and device. Inference tensors have no version counter: for them an
    in-place edit inside inference mode goes unseen."""
    version = None if weight.is_inference() else weight._version
    return version, weight.data_ptr(), weight.dtype, weight.device


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear of a 2-D ``x`` (torch's private op: its call convention lives here only)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def mkl_packed_works() -> bool:
    """Whether this torch has MKL's packed linear and it computes ``functional.linear`` (checked once)."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    return _computes_linear(lambda x, weight, bias: _mkl_product(x, _mkl_packed(weight), weight, bias))


@functools.cache
def onednn_linear_works() -> bool:
    """Whether this torch has oneDNN's linear op and it computes ``functional.linear`` (checked once)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return _computes_linear(onednn_linear)


def _fp32_packed_takes(rows: int) -> bool:
    """Whether an fp32 product of ``rows`` rows goes through its packed weight: every row count
    where oneDNN is the packed kernel, else ``PACKED_TOKENS`` where MKL's packed GEMM works."""
    if packed_kernel(torch.float32) == "onednn":
        return True
    return rows in PACKED_TOKENS and mkl_packed_works()


_CHOICE_LOCK = threading.Lock()


def packed_kernel(dtype: torch.dtype) -> str:
    """``"onednn"`` or ``"mkl"`` (see ``_packed_kernel``), chosen once per dtype: two threads
    packing their first weights at once could each time the kernels and get different answers,
    and a weight packed for one kernel would then be run by the other."""
    with _CHOICE_LOCK:
        return _packed_kernel(dtype)


@functools.cache
def _packed_kernel(dtype: torch.dtype) -> str:
    """``"onednn"`` or ``"mkl"``: the kernel a packed weight of ``dtype`` takes outside the row
    counts that always take oneDNN (bf16's ``BF16_ONEDNN_TOKENS``). ``RAG_LOOKAHEAD_CPU_GEMM``
    fixes it; else both are timed once on a 32 x 896 x 4864 product (about 50 ms), and oneDNN wins
    where it needs at most 3/4 of MKL's time (see the module's docstring: 2.4-6.5x faster on an AMD
    EPYC, slower than MKL on a Xeon). The margin keeps the choice, and so the kernels' rounding,
    the same from run to run on those machines; one whose two kernels run close may see it flip
    (fix it with the variable). Without one of the two, the other."""
    fixed = os.environ.get(GEMM_ENV, "").strip().lower()
    if fixed not in ("", "auto", "mkl", "onednn"):
        from rag_lookahead.errors import ConfigError

        raise ConfigError(f"{GEMM_ENV} must be mkl, onednn or auto, got {os.environ[GEMM_ENV]!r}")
    has_onednn = _reordered_onednn_works(dtype)
    if not mkl_packed_works():
        return "onednn" if has_onednn else "mkl"
    if not has_onednn:
        return "mkl"
    if fixed in ("mkl", "onednn"):
        return fixed
    mkl, onednn = _time_packed_kernels(dtype)
    return "onednn" if onednn <= _ONEDNN_SHARE * mkl else "mkl"


packed_kernel.cache_clear = _packed_kernel.cache_clear  # the tests fix the choice per case


@functools.cache
def _reordered_onednn_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear on a weight it reordered runs here and computes ``functional.linear``."""
    if not (onednn_linear_works() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return _computes_linear(lambda x, weight, bias: onednn_linear(x, _onednn_packed(weight), bias), dtype)


def _time_packed_kernels(dtype: torch.dtype, rows: int = 32) -> tuple[float, float]:
    """Best of 7 seconds of MKL's and oneDNN's packed products on one weight, alternated."""
    with torch.inference_mode(False), torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(4864, 896, generator=generator).to(dtype)
        x = torch.randn(rows, 896, generator=generator).to(dtype)
        mkl, onednn = _mkl_packed(weight), _onednn_packed(weight)
        kernels = (lambda: _mkl_product(x, mkl, weight, None), lambda: onednn_linear(x, onednn, None))
        best = [float("inf"), float("inf")]
        for repeat in range(9):
            for i, kernel in enumerate(kernels):
                start = time.perf_counter()
                kernel()
                if repeat >= 2:  # two warm-up rounds
                    best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


@functools.cache
def bf16_packed_works() -> bool:
    """Whether a bf16 weight's packed kernels run here and compute ``functional.linear`` to bf16
    rounding, for rows on either side of ``BF16_ONEDNN_TOKENS`` (checked once)."""
    if not _reordered_onednn_works(torch.bfloat16):
        return False
    if packed_kernel(torch.bfloat16) == "mkl" and not mkl_packed_works():
        return False
    return all(
        _computes_linear(lambda x, weight, bias: PackedWeight().linear(x, weight, bias), torch.bfloat16, rows)
        for rows in (3, max(BF16_ONEDNN_TOKENS) + 3)
    )


def cpu_bf16() -> tuple[bool, bool]:
    """Whether this CPU has native bf16 instructions (oneDNN's view), and AMX tiles."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # private API, any failure: say neither, the safe answer (as models.py always did)
        return False, False


def bf16_layout_applies() -> bool:
    """Whether bf16 linears get the packed layout on this CPU: where it has AVX512-BF16 but no AMX
    tiles (measured there; with AMX, oneDNN's stock bf16 kernels are another story, unmeasured)."""
    native, amx = cpu_bf16()
    return native and not amx and bf16_packed_works()


def _computes_linear(kernel, dtype: torch.dtype = torch.float32, rows: int = 3) -> bool:
    """Whether ``kernel(x, weight, bias)`` runs here and equals ``functional.linear`` on a small
    case (fp32: to 1e-4; bf16: to its rounding, against the exact product)."""
    try:
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, wherever the first call comes from
            generator = torch.Generator().manual_seed(0)
            x, weight, bias = (
                torch.randn(shape, generator=generator).to(dtype) for shape in ((rows, 40), (24, 40), (24,))
            )
            out = kernel(x, weight, bias)
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False
    if out.shape != (rows, 24) or out.dtype != dtype:
        return False
    if dtype == torch.float32:
        return torch.allclose(out, functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    exact = functional.linear(x.double(), weight.double(), bias.double())
    return torch.allclose(out.double(), exact, rtol=2.0**-7, atol=1e-3)


class _FewTokenForward:
    """A layer's ``forward`` through :func:`few_token_linear` (an object, not a bound function,
    so that a copied or pickled model keeps it: pickle looks a bound function up by its name)."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        return few_token_linear(x, layer.weight, layer.bias, getattr(layer, _PACKED))


def speed_up_cpu_linears(model: nn.Module, min_elements: int | None = None) -> int:
    """Give every fp32 ``nn.Linear`` on the CPU with at least ``min_elements`` weights the few-token
    product, and bf16 ones the packed bf16 layout where :func:`bf16_layout_applies` and its copies
    fit in half the available memory; returns how many layers have it (calling again with the same
    ``min_elements`` changes nothing).
    ``min_elements`` None: ``MIN_BF16_WEIGHT_ELEMENTS`` for bf16 weights and for fp32 ones where
    oneDNN is fp32's packed kernel, else ``MIN_WEIGHT_ELEMENTS``."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if getattr(module, _MARK, False):
            chosen.append(module)
        elif weight.device.type == "cpu" and weight.dtype in _LAYOUT_DTYPES:  # only these time the CPU's kernels
            least = _least_elements(weight.dtype) if min_elements is None else min_elements
            if weight.numel() >= least:
                chosen.append(module)
    bf16 = [m for m in chosen if m.weight.dtype == torch.bfloat16 and not getattr(m, _MARK, False)]
    if bf16 and not (bf16_layout_applies() and _fits(sum(m.weight.numel() for m in bf16) * _bf16_extra_bytes())):
        chosen = [m for m in chosen if m not in bf16]
    for module in chosen:
        if not getattr(module, _MARK, False):
            module.forward = _FewTokenForward(module)
            # packed on first use, so loading stays as fast. Not an fp32 output layer: a vocabulary
            # of rows (~1 GB and 1.2 s more for the default model), and greedy steps screen it.
            fp32_output = module is output and module.weight.dtype == torch.float32
            setattr(module, _PACKED, None if fp32_output else PackedWeight(watch_of(model)))
            setattr(module, _MARK, True)
    _layout_changed(model, len(chosen))
    return len(chosen)


@contextlib.contextmanager
def stock_linears(model: nn.Module) -> Iterator[int]:
    """Within: the layers :func:`speed_up_cpu_linears` gave the packed layout run torch's stock
    kernels again, their packed copies kept for after (benchmarks time what a plain transformers
    user runs beside the same model with the layout). Yields how many layers were set aside."""
    marked = [m for m in model.modules() if getattr(m, _MARK, False) and "forward" in vars(m)]
    for module in marked:
        del module.forward
    try:
        yield len(marked)
    finally:
        for module in marked:
            module.forward = _FewTokenForward(module)


def _least_elements(dtype: torch.dtype) -> int:
    """The smallest weight worth the layout: bf16's, or fp32's where oneDNN packs fp32 weights too
    (896x896, fp32, cache-warm, oneDNN against stock: 11 rows 56 against 200 us, 700 rows 2.5
    against 5.6 ms, on the EPYC where it wins)."""
    if dtype == torch.bfloat16 or (dtype == torch.float32 and packed_kernel(torch.float32) == "onednn"):
        return MIN_BF16_WEIGHT_ELEMENTS
    return MIN_WEIGHT_ELEMENTS


def _bf16_extra_bytes() -> int:
    """Bytes a bf16 weight's packed copies take per weight: oneDNN's only, or MKL's fp32 copy too."""
    return _BF16_ONEDNN_EXTRA_BYTES if packed_kernel(torch.bfloat16) == "onednn" else _BF16_EXTRA_BYTES


def _fits(extra_bytes: int) -> bool:
    """Whether ``extra_bytes`` stay under half of the memory available now (Linux; elsewhere: no)."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return extra_bytes < int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return False


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
