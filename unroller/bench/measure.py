"""Peak step memory of a method, on the CPU or CUDA, and how time and memory are measured.

``TIME_METHOD`` and ``MEMORY_METHODS`` say exactly how (they go into the results).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import Tensor

from unroller.bench.models import state_bytes, tensor_bytes
from unroller.bench.peers import Method
from unroller.bench.profiling import profile_step
from unroller.bench.timing import synchronize

TIME_METHOD = (
    "--warmup untimed rounds, then --iterations rounds in which every method runs one step; "
    "the order within a round rotates by one place each round, so no method always follows "
    "the same one; time.perf_counter around each step (CUDA: synchronised before and "
    "after), the garbage collector off; per method the median, p10 and p90 "
    "(unroller.bench.stats.summary: linear interpolation between order statistics), "
    "samples/s = batch / median, and the time ratio = the median over rounds of its time / autograd's in the same round"
)
MEMORY_SHORT = {
    "cpu": "profiler CPU allocation events (unroller.bench.profiling.profile_step)",
    "cuda": "torch.cuda.max_memory_allocated",
}
MEMORY_METHODS = {
    "cpu": (
        "torch.profiler CPU allocation events of one step (unroller.bench.profiling.profile_step)"
        ": step peak = the largest running total of the step's own allocations (gradients "
        "None before the step); total peak = step peak + parameters, buffers and the batch, "
        "resident before the step; live at backward = the running total when the backward "
        "pass begins"
    ),
    "cuda": (
        "torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats: total "
        "peak = that figure (everything allocated on the device, parameters and batch "
        "included); step peak = total peak - torch.cuda.memory_allocated() just before the step"
    ),
}


def peak_step(method: Method, batch: list[Tensor], device: torch.device) -> dict[str, Any]:
    """Peak memory of one step of ``method`` on ``batch`` (see the module docstring)."""
    method.module.zero_grad(set_to_none=True)
    gc.collect()
    resident = state_bytes(method.module) + tensor_bytes(batch)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        loss = method.run(batch, False)
        synchronize(device)
        total = torch.cuda.max_memory_allocated(device)
        retained = torch.cuda.memory_allocated(device) - before
        del loss
        return {
            "how": "cuda",
            "step_peak_bytes": total - before,
            "total_peak_bytes": total,
            "resident_bytes": before,
            "retained_bytes": retained,
            "live_at_backward_bytes": None,
        }
    mark = method.backward_mark or ""
    found = profile_step(lambda: method.run(batch, True), mark)
    return {
        "how": "cpu-profiler",
        "step_peak_bytes": found["peak_bytes"],
        "total_peak_bytes": found["peak_bytes"] + resident,
        "resident_bytes": resident,
        "retained_bytes": found["retained_bytes"],
        "live_at_backward_bytes": found["live_at_backward_bytes"],
    }
