"""Summaries of timing samples: median, p10, p90, min, max, and the samples themselves.

Every report of the harness states its percentiles the same way (linear interpolation
between order statistics), so figures from different presets can be compared.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1), linear interpolation between order statistics."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no samples")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(samples: Sequence[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "p10": percentile(samples, 0.1),
        "p90": percentile(samples, 0.9),
        "min": min(samples),
        "max": max(samples),
        "samples": list(samples),
    }
