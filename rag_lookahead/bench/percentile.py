"""Percentiles of the benchmarks' timings (p95 latency, p95 step time, p95 gap between deliveries).

One rule for all of them, nearest rank: the p-th percentile of n values is the ceil(p * n)-th
smallest, a value that was measured. Each benchmark took ``sorted[int(p * n)]`` before, one rank
too high where p * n is whole: p95 of 20 latencies was the slowest one, not the 19th.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def nearest_rank(values: Iterable[float], share: float) -> float:
    """The ``share`` percentile of ``values`` (0.95 for p95) by nearest rank: the smallest value that
    at least ``share`` of them do not exceed. p95 of 1..20 is 19, of 1..21 it is 20."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("a percentile of no values")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    rank = math.ceil(round(share * len(ordered), 9))  # 0.07 * 100 is 7.000000000000001: rank 7, not 8
    return ordered[rank - 1]
