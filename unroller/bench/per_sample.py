"""Bytes per sample: the slope of a method's measured step peak between two batch sizes.

Why a slope and not only the max batch: the max batch under a budget mixes what grows with
the batch (activations, their gradients, the batch) with what does not (parameter
gradients, workspaces), so its ratio between two methods depends on the budget chosen. As
the budget grows the fixed part weighs less and the ratio of max batches tends to the
inverse ratio of the two methods' bytes per extra sample: the slope is that large-budget
limit, one figure per method that no budget choice moves. It is measured, not predicted:
``step_peak(b) - step_peak(a)`` over ``b - a``, the step peaks of the memory phase
(``unroller.bench.measure.peak_step``) at two batches.

A slope is only reported when the peak grew between the two batches. Equal peaks (the
peak is set by bytes that do not scale with the batch, or the measurement missed the
step's allocations) and a peak that falls as the batch grows (a measurement fault, or an
allocator reusing memory differently) give no figure, with the reason, so no goal is
judged on a slope of zero or below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

METHOD = (
    "bytes per sample = (step peak at batch B - step peak at batch A) / (B - A), the step "
    "peaks measured as the memory phase measures them (one step each; the run's batch and "
    "twice it unless --per-sample-batches A,B): the bytes each extra sample adds to the "
    "step's peak, which is the large-budget limit of the max-batch ratio (the fixed bytes "
    "of a step, such as parameter gradients, cancel; the batch itself, resident before the "
    "step and the same for every method, is not in it); vs autograd = the method's slope / "
    "autograd's. No figure when the peak did not grow between A and B (equal peaks, or a "
    "lower peak at B): the reason is given instead"
)


def slope(points: Sequence[tuple[int, int | None]]) -> dict[str, Any]:
    """The bytes per sample between two measured ``(batch, step peak bytes)`` points.

    Returns ``batches`` and ``step_peak_bytes`` (in batch order), ``bytes_per_sample``
    (None when there is no figure) and ``problem`` (None, or why there is no figure).
    Two points of the same batch are a caller's error (ValueError): no slope is defined.
    """
    if len(points) != 2:
        raise ValueError(f"a slope needs two (batch, peak) points, got {len(points)}")
    (a, peak_a), (b, peak_b) = sorted(points, key=lambda p: p[0])
    if a == b:
        raise ValueError(f"a slope needs two different batch sizes, got {a} twice")
    found: dict[str, Any] = {
        "batches": [a, b],
        "step_peak_bytes": [peak_a, peak_b],
        "bytes_per_sample": None,
        "problem": None,
    }
    if peak_a is None or peak_b is None:
        missing = ", ".join(str(n) for n, p in ((a, peak_a), (b, peak_b)) if p is None)
        found["problem"] = f"step peak not measured at batch {missing}"
    elif peak_b == peak_a:
        found["problem"] = (
            f"equal step peaks at batch {a} and {b} ({peak_a} bytes): the peak is set by "
            "bytes that do not grow with the batch there; measure larger batches"
        )
    elif peak_b < peak_a:
        found["problem"] = (
            f"the step peak fell from {peak_a} bytes at batch {a} to {peak_b} at batch {b}: "
            "not a per-sample figure (a measurement fault or a changed allocation pattern)"
        )
    else:
        found["bytes_per_sample"] = (peak_b - peak_a) / (b - a)
    return found


def bytes_per_sample(found: dict[str, Any] | None) -> float | None:
    """The slope of a ``slope`` result (a record's ``per_sample``), or None."""
    return None if not found else found.get("bytes_per_sample")


def ratio(found: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    """A method's bytes per sample over the baseline's (autograd's): below 1 keeps less
    per sample; None when either has no figure or the batches differ (slopes over
    different ranges are not compared)."""
    mine, theirs = bytes_per_sample(found), bytes_per_sample(base)
    if mine is None or not theirs or found["batches"] != base["batches"]:
        return None
    return mine / theirs


def batches_label(found: dict[str, Any] | None) -> str:
    """``b4->b8``: the two batches a slope is measured between."""
    if not found:
        return "n/a"
    a, b = found["batches"]
    return f"b{a}->b{b}"
