"""Interleaved step timing: every side runs once per round, the order rotating by round.

Timing the methods in turns, rather than one after another, spreads the machine's drift
(other jobs, frequency scaling, a warming cache) over all of them alike; with two sides
the rotation is plain alternation (even rounds: the first side first).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from unroller.bench.stats import summary

CPU = torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    sides: dict[str, Callable[[], Any]],
    warmup: int,
    iterations: int,
    baseline: str | None,
    device: torch.device = CPU,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per side: ``time_ms`` (summary), ``ratio`` (summary of per-round ratios against
    ``baseline``, if given) and ``loss`` (of its last step, when a side returns a tensor;
    else None). ``on_round(k)`` is called after each round, warm-up rounds included (k
    counts from 1). The garbage collector is off while timing."""
    names = list(sides)
    losses: dict[str, Tensor] = {}

    def one(name: str) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        loss = sides[name]()
        synchronize(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        if isinstance(loss, Tensor):
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


def time_pair(
    first: Callable[[], Any], second: Callable[[], Any], warmup: int, repeats: int
) -> dict[str, Any]:
    """Two sides alternating (``time_interleaved``): ``first``, ``second`` and ``ratio``
    (first / second per round) summaries, in ms."""
    found = time_interleaved({"first": first, "second": second}, warmup, repeats, "second")
    return {
        "unit": "ms",
        "first": found["first"]["time_ms"],
        "second": found["second"]["time_ms"],
        "ratio": found["first"]["ratio"],
    }
