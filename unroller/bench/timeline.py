"""Bytes live over one training step, from the profiler's allocation events (CPU).

A step's peak says how much memory it needs, not where: ``record`` runs one step of a
method under ``torch.profiler`` (as ``measure.peak_step`` does, so the curve's maximum is
that step peak) and returns the running total of the step's own allocations against time
normalised to the step (0: its start, 1: its end), with the moment the backward pass
begins, so forward and backward of several methods can be drawn on one axis
(``plots.timeline``). A long step has hundreds of thousands of events; the curve keeps,
per time bucket, its lowest and highest point, so the peak and the troughs survive.
"""

from __future__ import annotations

import gc
from typing import Any

from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

from unroller.bench.peers import Method
from unroller.bench.profiling import STEP_MARK, allocation_trace, first_backward_op, span_of

MAX_POINTS = 2000


def running_totals(allocs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(time_ns, bytes live after the event) for each signed allocation event."""
    out, running = [], 0
    for t, size in allocs:
        running += size
        out.append((t, running))
    return out


def downsample(points: list[tuple[float, int]], max_points: int = MAX_POINTS) -> list:
    """At most ``max_points`` of ``points`` (time order kept): per bucket of consecutive
    points, its lowest and highest; the first and last point stay. The global maximum
    is some bucket's highest, so it is never dropped."""
    if len(points) <= max_points:
        return list(points)
    buckets = max(1, (max_points - 2) // 2)
    size = -(-len(points) // buckets)
    keep = {0, len(points) - 1}
    for start in range(0, len(points), size):
        chunk = range(start, min(start + size, len(points)))
        keep.add(min(chunk, key=lambda i: points[i][1]))
        keep.add(max(chunk, key=lambda i: points[i][1]))
    return [points[i] for i in sorted(keep)]


def _profile(method: Method, batch: list[Tensor]) -> profile:
    """One step of ``method`` under the profiler, prepared as ``measure.peak_step``
    prepares it (gradients None, garbage collected), inside the ``STEP_MARK`` marker."""
    method.module.zero_grad(set_to_none=True)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as p:
        with record_function(STEP_MARK):
            result = method.run(batch, True)
    del result
    return p


def _normalise(t: int, start: int, length: int) -> float:
    return min(1.0, max(0.0, (t - start) / length))


def record(method: Method, batch: list[Tensor], max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The memory timeline of one step of ``method`` on ``batch`` (CPU): ``time`` (0..1)
    and ``bytes`` (live, the step's own allocations: the batch, parameters and buffers
    resident before it are not counted, as in the step peak), ``backward_start`` (0..1,
    None if the marker was not seen), the peak and where it sits. A method without a
    ``backward_mark`` (ours before its first stash) is marked at its first op named
    '...backward...', as ``profiling.backward_marker`` finds it."""
    prof = _profile(method, batch)
    allocs, first_start = allocation_trace(prof)
    totals = running_totals(allocs)
    mark = method.backward_mark or first_backward_op(first_start)
    span = span_of(prof, STEP_MARK)
    if span is None:  # no marker event: the allocation events bound the step
        span = (allocs[0][0], allocs[-1][0]) if allocs else (0, 1)
    start, length = span[0], max(1, span[1] - span[0])
    points = [(0.0, 0)] + [(_normalise(t, start, length), n) for t, n in totals]
    peak_at = max(range(len(points)), key=lambda i: points[i][1])
    kept = downsample(points, max_points)
    at = first_start.get(mark) if mark else None
    live_at_backward = None
    if at is not None:
        live_at_backward = next((n for t, n in reversed(totals) if t < at), 0)
    return {
        "method": method.name,
        "kind": method.kind,
        "scheme": method.scheme,
        "time": [t for t, _ in kept],
        "bytes": [n for _, n in kept],
        "backward_mark": mark,
        "backward_start": None if at is None else _normalise(at, start, length),
        "peak_bytes": points[peak_at][1],
        "peak_time": points[peak_at][0],
        "live_at_backward_bytes": live_at_backward,
        "retained_bytes": totals[-1][1] if totals else 0,
        "step_ms": length / 1e6,
        "allocation_events": len(allocs),
    }
