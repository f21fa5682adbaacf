"""Step time (interleaved rounds) and peak step memory.

``TIME_METHOD`` and ``MEMORY_METHODS`` say exactly how (they go into the results).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from benchmarks.core_bench import profile_step, summary
from benchmarks.harness.models import state_bytes, tensor_bytes
from benchmarks.harness.peers import Method

TIME_METHOD = (
    "--warmup untimed rounds, then --iterations rounds in which every method runs one step; "
    "the order within a round rotates by one place each round, so no method always follows "
    "the same one; time.perf_counter around each step (CUDA: synchronised before and "
    "after), the garbage collector off; per method the median, p10 and p90 (core_bench."
    "summary: linear interpolation between order statistics), samples/s = batch / median, "
    "and the time ratio = the median over rounds of its time / autograd's in the same round"
)
MEMORY_SHORT = {
    "cpu": "profiler CPU allocation events (core_bench.profile_step)",
    "cuda": "torch.cuda.max_memory_allocated",
}
MEMORY_METHODS = {
    "cpu": (
        "torch.profiler CPU allocation events of one step (benchmarks.core_bench.profile_step)"
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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    sides: dict[str, Callable[[], Tensor]],
    warmup: int,
    iterations: int,
    baseline: str | None,
    device: torch.device,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per side: ``time_ms`` (summary), ``ratio`` (summary of per-round ratios against
    ``baseline``, if given) and ``loss`` (of its last step). ``on_round(k)`` is called
    after each round, warm-up rounds included (k counts from 1)."""
    names = list(sides)
    losses: dict[str, Tensor] = {}

    def one(name: str) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        loss = sides[name]()
        synchronize(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        losses[name] = loss.detach()
        return elapsed

    for r in range(warmup):
        for name in names:
            one(name)
        if on_round:
            on_round(r + 1)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(iterations):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(one(name))
            if on_round:
                on_round(warmup + r + 1)
    finally:
        if was_enabled:
            gc.enable()
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        entry: dict[str, Any] = {"time_ms": summary(samples[name])}
        if baseline is not None:
            ratios = [a / b for a, b in zip(samples[name], samples[baseline])]
            entry["ratio"] = summary(ratios)
        entry["loss"] = float(losses[name].float().mean()) if name in losses else None
        out[name] = entry
    return out


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
