"""How many draft nodes to verify: chosen from what a forward of n tokens costs.

On a GPU at batch 1 a forward of 64 tokens costs about what one token costs, so a large tree
is free. On a CPU it is not (0.5B bf16 here: ~95 ms for 1 token, ~120 ms for 16, ~200 ms for 64), so each
extra node must pay for itself. The cost curve is measured once per model (a few forwards
over a dummy cache) and the drafter's acceptance estimates, corrected by how well they
predicted so far, give the expected gain; the size with the best gain per second wins.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .atomic import write_json_atomic
from .draft import DraftTree


@dataclass
class CostCurve:
    """Seconds of one forward that appends ``n`` tokens (all rows together), interpolated."""

    sizes: list[int]
    seconds: list[float]

    def __call__(self, n: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if n <= sizes[0]:
            return secs[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                t = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
                return secs[i - 1] + t * (secs[i] - secs[i - 1])
        slope = (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2])
        return secs[-1] + max(slope, 0.0) * (n - sizes[-1])


_CURVES: "weakref.WeakKeyDictionary[torch.nn.Module, CostCurve]" = weakref.WeakKeyDictionary()


def _curve_key(model) -> str | None:
    """What the cost depends on: the model, its dtype and device, and the CPU threads."""
    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return None  # an in-memory model (tests): nothing stable to key a file on
    params = sum(p.numel() for p in model.parameters())
    device = next(model.parameters()).device
    return f"{name}|{params}|{model.dtype}|{device}|{torch.get_num_threads()}|{torch.__version__}"


def _curve_file() -> Path:
    from .models import cache_dir

    return cache_dir() / "cost_curves.json"


@torch.inference_mode()
def measure_cost(model, *, context: int = 256, sizes=(1, 4, 8, 16, 32, 64, 128), repeats: int = 2) -> CostCurve:
    """Time forwards of each size on top of a ``context``-token cache (median of ``repeats``)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
    seconds = []
    for n in sizes:
        ids = torch.randint(0, vocab, (1, n), generator=generator).to(device)
        positions = torch.arange(context, context + n, device=device)[None]
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - start)
            cache.crop(-n)
        runs = sorted(runs[1:])
        seconds.append(runs[len(runs) // 2])
    for i in range(1, len(seconds)):  # more tokens never cost less; noise must not say otherwise
        seconds[i] = max(seconds[i], seconds[i - 1])
    return CostCurve(list(sizes), seconds)


def cost_curve(model) -> CostCurve:
    """The model's cost curve: measured on first use, then remembered in memory and on disk.

    The file lets a one-shot CLI call skip the measurement; delete it (or set
    RAG_LOOKAHEAD_RECALIBRATE=1) after changing hardware or when it was measured under load.
    """
    curve = _CURVES.get(model)
    if curve is not None:
        return curve
    key = _curve_key(model)
    path = _curve_file() if key else None
    stored = {}
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            stored = {}
    if key in stored and not os.environ.get("RAG_LOOKAHEAD_RECALIBRATE"):
        curve = CostCurve(**stored[key])
    else:
        curve = measure_cost(model)
        if path is not None:
            stored[key] = {"sizes": curve.sizes, "seconds": curve.seconds}
            write_json_atomic(path, stored)
    _CURVES[model] = curve
    return curve


class Trust:
    """How far one row's drafter estimates have held up: accepted / predicted, smoothed."""

    def __init__(self) -> None:
        self.value = 1.0
        self._predicted = 0.0
        self._observed = 0.0

    def observe(self, draft: DraftTree, accepted: int) -> None:
        """Update with one step's verified draft and the number of its nodes accepted."""
        if not draft.tokens:
            return
        self._predicted = 0.9 * self._predicted + expected_accepted(draft.probs)
        self._observed = 0.9 * self._observed + accepted
        if self._predicted > 0:
            self.value = min(1.0, max(0.05, self._observed / self._predicted))


def expected_accepted(probs: list[float]) -> float:
    """Expected accepted path length: the nodes' path probabilities summed (one node a depth at most)."""
    return sum(probs)


class StepCosts:
    """What verify steps really cost, by (rows, width), correcting the batch-1 curve.

    The curve is timed at batch 1 without a mask; a batch of rows with a tree mask over a long,
    holed cache costs more, and by how much depends on the regime. So every step's time is
    remembered, and a width not yet seen for this many rows is predicted from the curve scaled
    like the nearest width that was seen. The first step at a new row count runs plain (width
    0), which measures the regime at the price of one step without drafts.
    """

    def __init__(self, curve: CostCurve) -> None:
        self.curve = curve
        self.seen: dict[tuple[int, int], float] = {}

    def observe(self, rows: int, width: int, seconds: float) -> None:
        old = self.seen.get((rows, width))
        self.seen[(rows, width)] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def known(self, rows: int) -> bool:
        return (rows, 0) in self.seen

    def __call__(self, rows: int, width: int) -> float:
        exact = self.seen.get((rows, width))
        if exact is not None:
            return exact
        predicted = self.curve(rows * (1 + width))
        nearest = min((abs(w - width), w) for r, w in self.seen if r == rows) if self.known(rows) else None
        if nearest is None:
            return predicted
        w = nearest[1]
        return predicted * self.seen[(rows, w)] / self.curve(rows * (1 + w))


_STEP_COSTS: "weakref.WeakKeyDictionary[torch.nn.Module, StepCosts]" = weakref.WeakKeyDictionary()


def step_costs(model) -> StepCosts:
    """The model's measured step costs, shared by every call on it (calibrated once per batch size)."""
    costs = _STEP_COSTS.get(model)
    if costs is None:
        costs = _STEP_COSTS[model] = StepCosts(cost_curve(model))
    return costs


def choose_width(drafts: list[DraftTree], trusts: list[Trust], costs: StepCosts | None) -> int:
    """Draft nodes per row for one forward over all rows, best expected tokens per second.

    Rows share the forward, padded to the widest tree, so the width is chosen jointly: a step
    of width w costs ``costs(rows, w)`` seconds and gains, per row, the bonus token plus the
    trusted probabilities of its w likeliest nodes. As the batch grows the forward becomes
    compute-bound, extra width costs more, and the choice shrinks toward plain decoding
    (width 0) by itself.
    """
    longest = max((len(d) for d in drafts), default=0)
    if costs is None or longest == 0:
        return longest
    rows = len(drafts)
    if not costs.known(rows):
        return 0  # measure this batch size's plain step first
    ranked = [sorted(d.probs, reverse=True) for d in drafts]
    gains = [1.0] * rows
    best_width, best_rate = 0, rows / costs(rows, 0)
    for width in range(1, longest + 1):
        for r, probs in enumerate(ranked):
            if width <= len(probs):
                gains[r] += trusts[r].value * probs[width - 1]
        rate = sum(gains) / costs(rows, width)
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width
