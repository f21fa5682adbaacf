"""The CPU allocation events of a ``torch.profiler`` run, in time order.

The CPU allocator keeps no peak counter like CUDA's ``max_memory_allocated``, so peaks on
the CPU are read off the profiler's allocation events. Both the memory model
(``unroller.analysis.memory``: the working memory of a codec call) and the benchmark harness
(``unroller.bench.profiling``: a whole step's peak) read them; the reading lives here, in
the core package, so that the memory model never imports the benchmark harness.
"""

from __future__ import annotations

from typing import Any

__all__ = ["allocation_trace"]


def allocation_trace(prof: Any) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """(time_ns, signed bytes) of every CPU allocation event of ``prof`` (a finished
    ``torch.profiler.profile``) in time order, and the first start time of each op name."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int]] = []
    first_start: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocs.append((event.start_time_ns, int(fields.alloc_size)))
        else:
            name = event.name
            t = event.start_time_ns
            if name not in first_start or t < first_start[name]:
                first_start[name] = t
        stack.extend(event.children)
    allocs.sort(key=lambda a: a[0])
    return allocs, first_start
