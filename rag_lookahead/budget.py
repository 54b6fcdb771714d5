"""How many draft nodes to verify: chosen from what a forward of n tokens costs.

On a GPU at batch 1 a forward of 64 tokens costs about what one token costs, so a large tree
is free. On a CPU it is not (0.5B bf16 here: ~50 ms for 1 token, ~66 ms for 16), so each
extra node must pay for itself. The cost curve is measured once per model (a few forwards
over a dummy cache) and the drafter's acceptance estimates, corrected by how well they
predicted so far, give the expected gain; the size with the best gain per second wins.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

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


@torch.inference_mode()
def measure_cost(model, *, context: int = 256, sizes=(1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 2) -> CostCurve:
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
    return CostCurve(list(sizes), seconds)


def cost_curve(model) -> CostCurve:
    """The model's cost curve, measured on first use and then remembered."""
    curve = _CURVES.get(model)
    if curve is None:
        curve = _CURVES[model] = measure_cost(model)
    return curve


class Budget:
    """Chooses draft sizes and learns how far to trust the drafter's probabilities."""

    def __init__(self, curve: CostCurve | None) -> None:
        self.curve = curve  # None: fixed budget, verify every candidate
        self.trust = 1.0  # observed accepted / predicted accepted, smoothed
        self._predicted = 0.0
        self._observed = 0.0

    def size(self, draft: DraftTree, rows: int, widest_other: int = 0) -> int:
        """Nodes of ``draft`` worth verifying when ``rows`` rows share the forward."""
        if self.curve is None or not draft.tokens:
            return len(draft)
        probs = sorted(draft.probs, reverse=True)
        best_k, best_rate, gain = 0, 1.0 / self.curve(rows), 1.0
        for k, prob in enumerate(probs, start=1):
            gain += self.trust * prob
            width = max(k, widest_other)
            rate = gain / self.curve(rows * (1 + width))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe(self, draft: DraftTree, accepted: int) -> None:
        """Update trust with one step's predicted versus accepted draft tokens."""
        if not draft.tokens:
            return
        depth_probs: dict[int, float] = {}
        for depth, prob in zip(draft.depths, draft.probs):
            depth_probs[depth] = depth_probs.get(depth, 0.0) + prob
        predicted = sum(min(p, 1.0) for p in depth_probs.values())  # expected accepted path length
        self._predicted = 0.9 * self._predicted + predicted
        self._observed = 0.9 * self._observed + accepted
        if self._predicted > 0:
            self.trust = min(1.0, max(0.05, self._observed / self._predicted))
