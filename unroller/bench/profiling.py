"""Peak step memory on the CPU, from the allocation events of the PyTorch profiler.

The CPU allocator keeps no peak counter like CUDA's ``max_memory_allocated``, so one
step runs under ``torch.profiler`` with ``profile_memory=True`` and its allocation and
free events are summed in time order. A marker (the first event of a named op) says
when the backward pass begins, which gives the bytes alive at that moment: what a step
really keeps for backward, next to what it says it keeps. The events are read by
``unroller.analysis.allocations.allocation_trace`` (re-exported here).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

from unroller.analysis.allocations import allocation_trace

BACKWARD_MARK = "unroller.bench::autograd_backward"  # record_function around loss.backward()
SEED_OP = "aten::ones_like"  # the generated step's seed gradient: torch.ones_like(loss)
STEP_MARK = "unroller.bench::step"  # record_function around a whole step (timeline)

__all__ = [
    "BACKWARD_MARK",
    "SEED_OP",
    "STEP_MARK",
    "allocation_trace",
    "backward_marker",
    "first_backward_op",
    "profile_step",
    "span_of",
]


def span_of(prof: profile, name: str) -> tuple[int, int] | None:
    """(start_ns, end_ns) of the first event called ``name`` (a record_function marker),
    or None: the clock the allocation events are read against."""
    found = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name == name and (found is None or event.start_time_ns < found[0]):
            found = (event.start_time_ns, event.end_time_ns)
        stack.extend(event.children)
    return found


def first_backward_op(first_start: dict[str, int]) -> str | None:
    """The name of the earliest op whose name contains 'backward' (from
    ``allocation_trace``'s first start times), or None."""
    found = [(t, name) for name, t in first_start.items() if "backward" in name]
    return min(found)[1] if found else None


def profile_step(run: Callable[[], Any], backward_mark: str) -> dict[str, Any]:
    """Peak, retained and live-at-backward bytes of one step, from the allocation trace."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as p:
        result = run()
    del result
    allocs, first_start = allocation_trace(p)
    mark = first_start.get(backward_mark)
    running = peak = 0
    at_backward = None
    for t, size in allocs:
        if mark is not None and at_backward is None and t >= mark:
            at_backward = running
        running += size
        peak = max(peak, running)
    if mark is not None and at_backward is None:
        at_backward = running
    return {
        "peak_bytes": peak,
        "retained_bytes": running,
        "live_at_backward_bytes": at_backward,
        "allocation_events": len(allocs),
    }


def backward_marker(run: Callable[[], Any]) -> str | None:
    """The first aten op of the step whose name contains 'backward' (the loss backward):
    the marker for generated steps whose compressors call ``SEED_OP`` in the forward."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    del result
    _, first_start = allocation_trace(prof)
    return first_backward_op(first_start)
