"""Greedy tokens without most of the output layer: an int8 screen with a proven error bound.

Why: a greedy step needs one number per position, the argmax of ``lm_head(hidden)``, but the
output layer computes all of the vocabulary's logits to find it. On the default model (fp32,
151,936 x 896 weights) that product is a quarter of a one-token forward on a CPU (43-54 ms of
~210) and more of a draft verification (66-106 ms for 9-17 tokens, with ``cpu_linear``).

How, and why the token stays exactly the model's: the weights are also kept as int8 (one scale
per vocabulary row), and each hidden vector is written as two signed 7-bit digits. torch's
int8 product (oneDNN where torch has it, else fbgemm) then gives every logit up to an error we
bound from the quantities themselves:
``|W - Ŵ|`` per weight (measured once, at build) times ``|x̂|`` summed, plus ``|W|`` summed times
the digits' leftover ``|x - x̂|`` (measured per call), plus fp32 rounding of both our estimate
and the model's own logit. Every token whose estimate lies within twice that bound of the best
is a candidate, and the candidates' logits are computed exactly in fp32 from the original
weights; any other token is provably below the winner. Usually one token is left, so nothing
is recomputed. As with any other kernel, two logits closer than fp32 rounding may order
differently than in the model's own product; nothing else can change.

What is computed at all: positions are screened when read (``GreedyTokens``). A single row's
walk down its tree asks for one level at a time, with the likeliest nodes below it (see
``sampling.longest_paths``), so a 40-node tree costs one or two products of up to 8 positions;
steps of several rows ask for every position at once (walked by level, they paid more).

bf16 output layers (on a CPU) are screened the same way on their exact fp32 values: their logits
are fp32 sums rounded once more to bf16, so tokens apart by less than that rounding can tie in
the model's own logits; the bound is widened by it and the candidates' logits are computed in
bf16, so the first of tied tokens wins as in the full layer. (As with any bf16 kernel, sums
taken in another order can round differently; bf16 answers were never bit-stable.)

Only where it is sound and measured to pay: fp32 or bf16 weights on a CPU with a quantized engine,
an ``nn.Linear`` output layer without bias, a transformers model whose logits are that layer's
output unchanged (no soft-capping or logit scale). A build-time self-test checks the kernel's sums
against exact arithmetic; if they differ, the model keeps its full output layer. Only greedy
rows without logprobs use it (sampling needs every probability). ``load_model`` applies it to
fp32 and bf16 CPU models, built on the first greedy step; :func:`screen_greedy_head` for your own model,
:func:`restore_greedy_head` undoes it, :func:`full_output_layer` sets it aside for a while.

A screen answers for the weights it was built from: if the layer's weight is changed afterwards
(in place, by ``load_state_dict``, a new ``Parameter``, a move to another device or dtype), the
next step that asks for it builds it afresh, or drops it where it no longer applies (weights
made under ``torch.inference_mode`` have no version counter: an in-place edit of those, inside
inference mode, is not seen; call :func:`restore_greedy_head` after one).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rag_lookahead.cpu_linear import weight_stamp
from rag_lookahead.int8_linear import prepack
from rag_lookahead.weight_watch import ValueSample

__all__ = [
    "GreedyHead",
    "GreedyTokens",
    "SCREEN_WIDTH",
    "capture_hidden",
    "forget_screen",
    "full_output_layer",
    "greedy_head_of",
    "restore_greedy_head",
    "screen_greedy_head",
]

_ATTR = "_rag_lookahead_greedy_head"
_PENDING = "_rag_lookahead_greedy_head_pending"  # screened lazily: built on the first greedy step
_BUILDING = threading.Lock()
#: fp32 rounding of a dot product of n terms, relative to the sum of the terms' magnitudes (n * 2^-24, doubled)
_ROUNDING = 2 * 2.0**-24
#: more candidates than this in a row: compute that row's logits in full instead
_MAX_CANDIDATES = 4096
#: fp32 candidates whose logits lie within this fraction of the best (or a few ulps of their sums
#: of |terms|: ``_tie_band``) are resolved by the full layer (sums of another order can swap them);
#: bf16/fp16 logits are rounded after the sum, so tied ones are equal whatever the order (see
#: ``output_rounding``)
_TIE_BAND = 1e-5
#: most positions screened in one product; above, the full layer costs as little (64 positions: 180 vs 188 ms here)
MOST_POSITIONS = 48
#: positions a screen takes together for little more than one (default model, this EPYC: 1
#: position 10.8 ms, 4: 15.6 ms, 8: 23.8 ms, 16: 48.5 ms); a walk fills a level up with guesses
SCREEN_WIDTH = 8
#: the output layer's values compared before each greedy step (see ``weight_watch``): one layer, so more than a linear's
SCREEN_SAMPLE = 1024
_UNSCREENED = object()  # a position nobody has read yet
_capturing: contextvars.ContextVar[list | None] = contextvars.ContextVar("rag_lookahead_capture", default=None)


@dataclass(eq=False)
class GreedyHead:
    """The int8 screen of one output layer, and the fp32 weights it answers for."""

    weight: torch.Tensor  # (vocab, hidden) fp32 or bf16, the layer's own
    packed: object  # the int8 kernel's packed weights
    row_errors: torch.Tensor  # (vocab,) float64: per vocabulary row, max |W - Ŵ|
    row_l1s: torch.Tensor  # (vocab,) float64: per vocabulary row, sum |W|
    hook: object  # the forward pre-hook on the layer
    layer: nn.Module  # the output layer itself: its forward computes the full logits
    built_from: tuple = field(init=False)  # the layer's weight object, version and storage at build
    sample: ValueSample = field(init=False)  # some of its values at build (edits through .data)
    weight_error: float = field(init=False)  # the largest row error: the shared bound's
    row_l1: float = field(init=False)  # the largest row sum |W|: the shared bound's

    def __reduce__(self):
        # a copied or pickled model computes its full output layer (exact; its int8 kernel's packed
        # weights cannot be copied); screen_greedy_head(copy) gives the copy a screen of its own
        return _no_screen, ()

    def __post_init__(self) -> None:
        self.weight_error, self.row_l1 = float(self.row_errors.max()), float(self.row_l1s.max())
        self.built_from = _weight_state(self.layer)
        self.sample = ValueSample(self.layer.weight, SCREEN_SAMPLE)

    @property
    def current(self) -> bool:
        """Whether the layer still holds the weights this screen was built from."""
        return _weight_state(self.layer) == self.built_from and self.sample.unchanged()

    @property
    def output_rounding(self) -> float:
        """The model's logits' own rounding, relative: none beyond fp32 sums' (counted apart);
        bf16 logits are fp32 sums rounded once more to bf16 (half of its 2^-7 spacing)."""
        return 0.0 if self.weight.dtype == torch.float32 else torch.finfo(self.weight.dtype).eps / 2

    def argmax(self, hidden: torch.Tensor) -> GreedyTokens:
        """``(hidden @ weight.T).argmax(-1)`` for ``hidden`` of shape (n, hidden size), as a sequence
        of n ints computed when read: see :class:`GreedyTokens`."""
        x = hidden.reshape(-1, hidden.shape[-1]).float()
        return GreedyTokens(self, x, [_UNSCREENED] * x.shape[0], {})

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """Every logit of the fp32 rows of ``x`` (exact in the weights' dtype), as the model computes
        them: through the layer's own forward (``cpu_linear``'s layout where it has one), which
        bypasses the capturing hook."""
        return self.layer.forward(x.to(self.weight.dtype)).float()

    @torch.inference_mode()
    def screen(self, x: torch.Tensor) -> tuple[list[int | None], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Screen the rows of ``x`` in one int8 product: each row's token (None where several
        candidates are left), the candidates' threshold, the estimates, and the terms of each
        row's error bound (see ``_bound``)."""
        n = x.shape[0]
        finite = torch.isfinite(x).all(1)
        if not bool(finite.all()):  # an inf/NaN would break the int8 product's input range: such a
            x = x.masked_fill(~finite[:, None], 0.0)  # row is screened as zeros, then left to the full layer
        biggest = x.abs().amax(1, keepdim=True)
        step1 = torch.where(biggest > 0, biggest / 63, torch.ones_like(biggest))
        digit1 = torch.round(x / step1).clamp_(-64, 63)
        step2 = step1 / 126
        digit2 = torch.round((x - digit1 * step1) / step2).clamp_(-64, 63)
        span = torch.zeros(1, x.shape[1])  # -64 and 63 present: the input's scale is exactly 1, zero point 64
        span[0, 0], span[0, -1] = -64, 63
        sums = torch.ops.quantized.linear_dynamic(torch.cat([digit1, digit2, span]), self.packed, True)
        estimate = sums[:n].mul_(step1).add_(sums[n : 2 * n].mul_(step2))

        exact_x = digit1.double() * step1.double() + digit2.double() * step2.double()
        terms = torch.stack(
            [
                (x.double() - exact_x).abs().amax(1)  # the digits' leftover ...
                + _ROUNDING * x.shape[1] * biggest[:, 0].double(),  # ... and the model's own fp32 logit: x sum |W|
                exact_x.abs().sum(1),  # x max |W - Ŵ|
                8 * 2.0**-24 * estimate.abs().amax(1).double(),  # our estimate's rounding
            ],
            1,
        )
        top = estimate.topk(2, dim=1)
        bound = self._bound(self.row_l1, self.weight_error, terms, top.values[:, 0]).float()
        threshold = (top.values[:, 0] - 2 * bound).masked_fill(~finite, float("nan"))
        tokens = top.indices[:, 0].tolist()
        uncertain = ((top.values[:, 1] >= threshold) | ~torch.isfinite(threshold)).tolist()
        return [None if u else t for t, u in zip(tokens, uncertain)], threshold, estimate, terms

    def narrow(self, candidates: torch.Tensor, estimate: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
        """The candidates (ascending vocabulary ids) whose logit can still be the largest, by each
        row's own bound: the screen's threshold uses the worst row's quantization error and sum |W|
        for all rows, and a typical row's error is ~4x smaller (default model: median 0.00025,
        largest 0.00098), so most candidates it leaves are provably below another one.
        ``estimate``: the candidates' estimates; ``terms``: the position's ``screen`` terms."""
        ours = estimate.double()
        bound = self._bound(self.row_l1s[candidates], self.row_errors[candidates], terms, ours)
        return candidates[ours + bound >= (ours - bound).max()]

    def _bound(self, l1, error, terms: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        """How far the model's logit can lie from our ``estimate`` of it (float64), for rows of sum
        |W| ``l1`` and rounding error ``error`` (the largest of any row, or each row's own), given
        the position's ``screen`` terms. In bf16, logits within the model's output rounding of
        each other can tie, so that rounding of the logit itself is added."""
        bound = l1 * terms[..., 0] + error * terms[..., 1] + terms[..., 2]
        if self.output_rounding:
            bound = bound + self.output_rounding * 1.01 * (estimate.abs().double() + bound)
        return bound * (1 + 1e-6) + 1e-6


class GreedyTokens(Sequence):
    """The greedy token of each position, computed when first read.

    Lazy because a verify step reads only the positions along each row's accepted path: a
    40-node tree has 41 positions, of which ~4 are read.
    :meth:`prefetch` screens the positions a walk needs next (a level and its likeliest
    continuation) in one int8 product; a position the screen leaves uncertain gets its candidates' exact logits
    when read. Slicing gives a view that shares all of it.
    """

    def __init__(self, head: GreedyHead, x, tokens: list, uncertain: dict, start: int = 0, stop: int | None = None):
        self._head, self._x, self._tokens, self._uncertain = head, x, tokens, uncertain
        self._start = start
        self._stop = len(tokens) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __iter__(self) -> Iterator[int]:
        self.prefetch(range(len(self)))
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index):
        if isinstance(index, slice):
            begin, end, stride = index.indices(len(self))
            if stride != 1:
                return [self[i] for i in range(begin, end, stride)]
            return GreedyTokens(
                self._head, self._x, self._tokens, self._uncertain, self._start + begin, self._start + end
            )
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        r = self._start + index
        if self._tokens[r] is _UNSCREENED:
            self.prefetch([index])
        if self._tokens[r] is None:
            self._tokens[r] = self._resolve(r)
        return self._tokens[r]

    def screened(self, index: int) -> bool:
        """Whether position ``index`` (of this view) has been screened (read or prefetched)."""
        return self._tokens[self._start + index] is not _UNSCREENED

    @torch.inference_mode()
    def prefetch(self, indices) -> None:
        """Screen these positions (of this view) together, those not screened yet; more than
        ``MOST_POSITIONS`` at once take the full layer's argmax instead (it costs as little then)."""
        todo = [self._start + i for i in indices if self._tokens[self._start + i] is _UNSCREENED]
        if not todo:
            return
        x = self._x[todo]
        if len(todo) > MOST_POSITIONS:
            for r, token in zip(todo, self._head.full(x).argmax(-1).tolist()):
                self._tokens[r] = token
            return
        tokens, threshold, estimate, terms = self._head.screen(x)
        for i, (r, token) in enumerate(zip(todo, tokens)):
            self._tokens[r] = token
            if token is None:
                self._uncertain[r] = (estimate[i], threshold[i], terms[i])

    @torch.inference_mode()
    def _resolve(self, r: int) -> int:
        """The candidates' logits at position ``r`` as the model computes them (fp32, or bf16 from
        fp32 sums), and the first of their maxima, as the full layer's argmax takes."""
        weight = self._head.weight
        x = self._x[r].to(weight.dtype)  # exact: the hidden state came in the weights' dtype
        estimate, threshold, terms = self._uncertain.pop(r)
        candidates = (estimate >= threshold).nonzero()[:, 0]
        if len(candidates) > _MAX_CANDIDATES or not torch.isfinite(threshold):  # also inf/NaN hidden states
            return int(self._head.full(self._x[r : r + 1]).argmax())
        candidates = self._head.narrow(candidates, estimate[candidates], terms)
        if len(candidates) == 1:
            return int(candidates[0])
        rows = weight[candidates]
        logits = (rows @ x).float()
        if not self._head.output_rounding and int((logits >= logits.max() - _tie_band(rows, x, logits)).sum()) > 1:
            # a near-tie: this small product sums in another order than the layer's (bit-identical
            # rows came out 1 ulp apart, the later id first); the layer's own product decides
            return int(self._head.full(self._x[r : r + 1]).argmax())
        return int(candidates[logits.argmax()])


def _tie_band(rows: torch.Tensor, x: torch.Tensor, logits: torch.Tensor) -> float:
    """How close two fp32 logits must be for sums in another order to swap them: a few ulps of the
    largest sum of |terms| (copied rows of 1536 terms came out up to 2 * 2^-24 of it apart, 1.7e-4
    at a best logit near 0), and at least ``_TIE_BAND`` of the best."""
    terms = float((rows.abs().float() @ x.abs().float()).max())
    return max(_TIE_BAND * float(logits.abs().max()), 2.0**-20 * terms)


def _no_screen() -> None:
    return None


def greedy_head_of(model) -> GreedyHead | None:
    """The model's screen, if :func:`screen_greedy_head` gave it one; a lazy screen is built here,
    on first use."""
    layer = _output_layer(model)
    if layer is None:
        return None
    head = getattr(layer, _ATTR, None)
    if head is None and getattr(layer, _PENDING, False):
        with _BUILDING:
            if getattr(layer, _PENDING, False):
                delattr(layer, _PENDING)
                if unsupported_reason(model) is None:  # the model may have moved or changed dtype since
                    _attach(model, layer)
        head = getattr(layer, _ATTR, None)
    elif head is not None and not head.current:
        with _BUILDING:
            head = getattr(layer, _ATTR, None)
            if head is not None and not head.current:  # the weights changed: screen them afresh
                _detach(model, layer, head)
                if unsupported_reason(model) is None:
                    _attach(model, layer)
            head = getattr(layer, _ATTR, None)
    return head


def screen_greedy_head(model, *, lazy: bool = False) -> bool:
    """Give the model's output layer the int8 screen where it is sound (see the module); returns
    whether the model has one now (calling again changes nothing).

    ``lazy``: only check here that the screen applies, and build it (quantize, pack, self-test:
    ~3.5 s and ~280 MB for the default model) on the first greedy step that asks for it, so a
    load that never decodes greedily never pays; True then means "will have one", unless the
    build's self-test fails on this CPU."""
    layer = _output_layer(model)
    if lazy and layer is not None and getattr(layer, _PENDING, False):
        return True
    if greedy_head_of(model) is not None:
        return True
    if unsupported_reason(model) is not None:
        return False
    if lazy:
        setattr(layer, _PENDING, True)
        return True
    return _attach(model, layer)


def _output_layer(model) -> nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _attach(model, layer: nn.Linear) -> bool:
    """Build the screen of ``layer`` and hook it in (False: the int8 kernel failed the self-test)."""
    built = _build(layer.weight.detach().float())  # bf16 weights: their exact fp32 values
    if built is None:
        return False
    _hook_in(model, layer, GreedyHead(layer.weight.detach(), *built, hook=None, layer=layer))
    return True


def _weight_state(layer: nn.Module) -> tuple:
    """What identifies the layer's weights: the object and its :func:`~rag_lookahead.cpu_linear.weight_stamp`
    (the screen holds the built weights' storage, so a new object at a freed one's id has other storage)."""
    return id(layer.weight), *weight_stamp(layer.weight)


def _hook_in(model, layer: nn.Module, head: GreedyHead) -> None:
    for key, hook in list(layer._forward_pre_hooks.items()):  # one a copied model brought along
        if hook is _capture_input:
            del layer._forward_pre_hooks[key]
    head.hook = layer.register_forward_pre_hook(_capture_input)
    setattr(layer, _ATTR, head)
    _head_changed(model)


def _detach(model, layer: nn.Module, head: GreedyHead) -> None:
    head.hook.remove()
    delattr(layer, _ATTR)
    _head_changed(model)


def restore_greedy_head(model) -> bool:
    """Undo :func:`screen_greedy_head`: the full output layer for every step again; returns
    whether the model had a screen (built or still to be built)."""
    layer = _output_layer(model)
    if layer is None:
        return False
    with _BUILDING:
        if getattr(layer, _PENDING, False):
            delattr(layer, _PENDING)
            return True
    head = getattr(layer, _ATTR, None)
    if head is not None:
        _detach(model, layer, head)
    return head is not None


def forget_screen(model) -> int:
    """Have the screen (if built) made again from the layer's weights at the next greedy step."""
    layer = _output_layer(model)
    head = getattr(layer, _ATTR, None) if layer is not None else None
    if head is None:
        return 0
    head.built_from = ()
    return 1


@contextlib.contextmanager
def full_output_layer(model) -> Iterator[bool]:
    """Within: the model's full output layer for every step, its screen (if any) set aside, not
    dropped, and hooked in again on leaving (benchmarks compare both without rebuilding it).
    Yields whether a screen was set aside; each layer's forward costs are kept for the next switch."""
    head = greedy_head_of(model)
    if head is None:
        yield False
        return
    from rag_lookahead.decoding.profile import profile_of

    # each layer keeps its own costs across switches: forgetting them forced every run's first step
    # plain, dropped the step times learned so far, and re-timed the curve under RECALIBRATE
    profile = profile_of(model)
    screened = (profile.cost_curve, profile.step_costs)
    layer = _output_layer(model)
    _detach(model, layer, head)
    profile.cost_curve, profile.step_costs = profile.costs_set_aside.pop("full output layer", (None, None))
    try:
        yield True
    finally:
        profile.costs_set_aside["full output layer"] = (profile.cost_curve, profile.step_costs)
        _hook_in(model, layer, head)
        profile.cost_curve, profile.step_costs = screened


def unsupported_reason(model) -> str | None:
    """Why the screen does not apply to this model (None: it does)."""
    if not type(model).__module__.startswith("transformers."):
        return "only transformers' own model classes (remote code may change the logits after the layer)"
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"the model changes its logits after the output layer ({name})"
    layer = _output_layer(model)
    if type(layer) is not nn.Linear or layer.bias is not None:
        return "the output layer is not a plain nn.Linear without bias"
    weight = layer.weight
    if weight.shape[0] < 2:
        return "a vocabulary of one token needs no screen"
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return "only fp32 or bf16 weights on a CPU (torch's int8 kernels)"
    if not set(torch.backends.quantized.supported_engines) & {"fbgemm", "x86"}:
        return "this torch build has no fbgemm/x86 quantized engine"
    return None


@contextlib.contextmanager
def capture_hidden() -> Iterator[list]:
    """Within: a screened output layer records its input in the yielded list and computes nothing
    (its output has no vocabulary columns). The caller owns the model's logits then."""
    captured: list = []
    token = _capturing.set(captured)
    try:
        yield captured
    finally:
        _capturing.reset(token)


def _capture_input(module: nn.Module, args: tuple) -> tuple | None:
    captured = _capturing.get()
    if captured is None or getattr(module, _ATTR, None) is None:
        return None
    hidden = args[0]
    captured.append(hidden)
    return (hidden[..., :0, :],) + tuple(args[1:])


def _build(weight: torch.Tensor) -> tuple | None:
    """Quantize and pack the weights, and prove on them that the int8 kernel sums exactly (None: it
    does not). Returns the packed weights and each row's largest error and sum |W|.

    Rows are quantized symmetrically (scale = the row's largest magnitude / 127) a block at a time,
    each block's temporaries reused in place, sizes summed in fp32 (widened by their rounding), the
    self-test's heaviest rows found from those sums: 2.1-2.9 s against 6.0-6.9 s before (the default
    model's 151,936 x 896 layer, 2-core Xeon, alternated, 4 each), paid by every process that decodes
    greedily. The errors are measured on the digits actually packed."""
    vocab = weight.shape[0]
    ints = torch.empty(weight.shape, dtype=torch.int8)
    scales32 = torch.empty(vocab)
    row_errors = torch.empty(vocab, dtype=torch.float64)
    row_l1s = torch.empty(vocab, dtype=torch.float64)
    for rows in torch.split(torch.arange(vocab), 16384):  # bounded memory
        block = weight[rows]
        magnitudes = block.abs()
        largest = magnitudes.amax(1)
        # an fp32 sum of n terms is within (n - 1) * 2^-24 of their size: widened, it bounds sum |W|
        row_l1s[rows] = magnitudes.sum(1).double() * (1 + 2.0**-23 * block.shape[1])
        scale = (largest / 127).clamp_min(1e-30)
        scales32[rows] = scale
        digits = torch.div(block, scale[:, None], out=magnitudes).round_()
        ints[rows] = digits.to(torch.int8)
        restored = digits.mul_(scale[:, None])
        # plus the fp32 rounding of the difference itself
        row_errors[rows] = restored.sub_(block).abs_().amax(1).double() + 2.0**-22 * largest.double()
    used_scales = scales32.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notices that its quantized-tensor API is deprecated
        quantized = torch._make_per_channel_quantized_tensor(ints, used_scales, torch.zeros(vocab, dtype=torch.long), 0)
        packed = prepack(quantized, None)
    heaviest = (row_l1s / used_scales).topk(min(64, vocab)).indices  # ~ the rows' sums of |digits|
    if not _sums_exactly(packed, ints, used_scales, heaviest):
        return None
    return packed, row_errors, row_l1s


def _sums_exactly(packed, ints: torch.Tensor, scales: torch.Tensor, heaviest: torch.Tensor) -> bool:
    """The int8 kernel on extreme and random digits (and the span row) against exact integer sums,
    on random rows and the ``heaviest`` (largest sums of |digits|: any saturation shows there first)."""
    generator = torch.Generator().manual_seed(0)
    width = ints.shape[1]
    digits = torch.randint(-64, 64, (4, width), generator=generator).float()
    digits[0], digits[1] = 63, -64  # the largest products: any int16 saturation would show here
    digits[2, ::2] = 63
    digits[2, 1::2] = -64
    digits[3, 0], digits[3, -1] = -64, 63
    rows = torch.randperm(ints.shape[0], generator=generator)[:2048]
    rows = torch.cat([rows, heaviest])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.ops.quantized.linear_dynamic(digits, packed, True)[:, rows].double()
    want = (digits.double() @ ints[rows].double().T) * scales[rows]
    return bool(((got - want).abs() <= 4 * 2.0**-24 * want.abs() + 1e-30).all())


def _head_changed(model) -> None:
    """Forget forward costs timed with the other output layer (the screen is in the cost file's key)."""
    from rag_lookahead.decoding.profile import profile_of

    profile_of(model).forget_costs()
