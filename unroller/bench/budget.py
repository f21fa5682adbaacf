"""The largest batch whose peak memory fits a budget: predicted by a linear fit, confirmed.

The total peak of one step (``measure.peak_step``: on the CPU the step's own peak plus the
parameters, buffers and batch resident before it; on CUDA ``max_memory_allocated``) grows
with the batch through the activations, their gradients and the batch, while the
parameters, their gradients and most workspaces stay: ``peak(n) = a + b * n``. ``METHOD``
says how the line is measured and the prediction confirmed (it goes into the results).
Batches are multiples of ``granularity`` (on the IPU: replicas x micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from unroller.bench.measure import peak_step
from unroller.bench.peers import Method

MAX_STEPS = 6  # measurements beyond the two probes
MEMORY_SHARE = 0.5  # of the available memory, the most a confirmation step may need

METHOD = (
    "peak(n) = a + b * n, a line through the total step peaks measured at two small batches "
    "(the run's batch and twice it, unless --probe-batches); predicted max batch = "
    "floor((budget - a) / b); confirmed by a measured step at that batch (must fit) and at "
    "the next (must not), where memory allows; when one disagrees, the line through the "
    "largest measured batch that fits and the smallest that does not (secant) predicts the "
    "next batch to measure, kept strictly between them (at most 6 measurements beyond the "
    "probes)"
)


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares (a, b) of peak = a + b * n; exact through two points."""
    ns = [float(n) for n, _ in points]
    ps = [float(p) for _, p in points]
    mean_n, mean_p = sum(ns) / len(ns), sum(ps) / len(ps)
    var = sum((n - mean_n) ** 2 for n in ns)
    if var == 0:
        raise ValueError("the fit needs at least two different batch sizes")
    b = sum((n - mean_n) * (p - mean_p) for n, p in zip(ns, ps)) / var
    return mean_p - b * mean_n, b


def predict_max(a: float, b: float, budget: int, granularity: int = 1) -> int | None:
    """The largest multiple of ``granularity`` whose predicted peak fits (0: none does;
    None: the peak does not grow with the batch, so the fit bounds nothing)."""
    if b <= 0:
        return None
    units = math.floor((budget - a) / (b * granularity))
    return max(0, units) * granularity


def available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def probe_fit(
    method: Method,
    make_batch: Callable[[int], list[Tensor]],
    probes: tuple[int, int],
    device: torch.device,
    known: dict[int, int] | None = None,
) -> dict[str, Any]:
    """The total peaks at the two probe batches (``known``: already measured, batch ->
    bytes) and the line through them."""
    points = []
    for n in probes:
        if known and n in known:
            points.append((n, known[n]))
            continue
        batch = make_batch(n)
        points.append((n, peak_step(method, batch, device)["total_peak_bytes"]))
        del batch
    a, b = fit_line(points)
    return {"intercept_bytes": a, "bytes_per_sample": b, "points": points}


def auto_budget(fit: dict[str, Any], batch: int, factor: float) -> int:
    """'auto': the predicted total peak of ``fit`` (autograd's) at ``factor`` x ``batch``,
    rounded up to a whole MiB."""
    mib = 1024 * 1024
    peak = fit["intercept_bytes"] + fit["bytes_per_sample"] * factor * batch
    return int(math.ceil(peak / mib)) * mib


def search(
    method: Method,
    make_batch: Callable[[int], list[Tensor]],
    budget: int,
    fit: dict[str, Any],
    device: torch.device,
    granularity: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Predict (from ``probe_fit``'s line) and confirm the largest batch under ``budget``.

    Each further measurement is the batch predicted by the line through the two measured
    points nearest the limit (the largest batch known to fit, lo, and the smallest known
    not to, hi; before hi is known, the two largest measured batches), kept strictly
    between lo and hi; a prediction of lo itself measures lo + 1 step, the confirmation
    that the next batch does not fit. Stops when hi = lo + 1 step, after ``MAX_STEPS``
    measurements, or when the next batch would need too much memory."""
    g = granularity
    measured: dict[int, int] = dict(fit["points"])
    predicted = predict_max(fit["intercept_bytes"], fit["bytes_per_sample"], budget, g)
    limit = available_memory(device)
    notes: list[str] = []

    def bracket() -> tuple[int, int | None]:
        lo = max((n for n, p in measured.items() if p <= budget), default=0)
        hi = min((n for n, p in measured.items() if p > budget and n > lo), default=None)
        return lo, hi

    steps = 0
    while True:
        lo, hi = bracket()
        if hi is not None and hi <= lo + g:
            break
        if steps == MAX_STEPS:
            notes.append(f"stopped after {MAX_STEPS} measurements beyond the probes")
            break
        if hi is not None and lo in measured:
            near = [(lo, measured[lo]), (hi, measured[hi])]
        else:
            near = sorted(measured.items())[-2:]
        a, b = fit_line(near)
        guess = predict_max(a, b, budget, g)
        n = max(lo + g, 2 * max(lo, g) if guess is None else guess)
        if hi is not None:
            n = min(n, hi - g)
        if limit is not None and a + b * n > MEMORY_SHARE * limit:
            notes.append(f"batch {n} not measured: predicted over {MEMORY_SHARE:.0%} of memory")
            break
        if progress:
            progress(f"{method.name}: batch {n}")
        batch = make_batch(n)
        measured[n] = peak_step(method, batch, device)["total_peak_bytes"]
        del batch
        steps += 1
    lo, hi = bracket()
    return {
        "budget_bytes": budget,
        "intercept_bytes": fit["intercept_bytes"],
        "bytes_per_sample": fit["bytes_per_sample"],
        "predicted_max_batch": predicted,
        "max_batch": lo,
        "confirmed": hi is not None and hi <= lo + g,
        "measured": [{"batch": n, "total_peak_bytes": p} for n, p in sorted(measured.items())],
        "notes": notes,
    }
