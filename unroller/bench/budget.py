"""The largest batch whose peak memory fits a budget: predicted by a linear fit, confirmed.

The total peak of one step (``own_total``: the step's own peak, ``measure.peak_step``, plus
the method's parameters, buffers and batch resident before it, on the CPU and on CUDA
alike, so other models resident on the device do not count) grows with the batch through
the activations, their gradients and the batch, while the parameters, their gradients and
most workspaces stay: ``peak(n) = a + b * n``. ``METHOD`` says how the line is measured
and the prediction confirmed (it goes into the results). Batches are multiples of
``granularity`` (on the IPU: replicas x micro-batches).

The "quarter" budget (``quarter_budget``) is what a user filling an accelerator has:
weights, their gradients and the optimizer state (SGD with momentum: one buffer per
parameter) are a quarter of it. The benchmark's step makes no optimizer state, so the
momentum bytes are ``reserved``: added to every measured total before it is compared with
the budget. A step too slow to measure (beyond ``largest``, the largest batch the caller
lets the search measure) leaves the max batch predicted by the line, marked unconfirmed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from unroller.bench.measure import peak_step
from unroller.bench.models import state_bytes, tensor_bytes
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
    "probes). Total peak = the step's own peak + the method's parameters, buffers and batch "
    "(+ the optimizer state under the quarter budget). A batch whose step is predicted to "
    "take over --max-step-seconds (the time phase's ms per sample x batch) is not measured: "
    "the largest batch under that limit is measured instead; when the search stops short of "
    "a confirmation (that limit, or a batch predicted to need over half the memory), the "
    "max batch is the prediction of the line through the two measured batches nearest the "
    "limit, marked unconfirmed"
)
QUARTER_METHOD = (
    "'quarter' budget = 4 x (parameters + parameter gradients + optimizer state) = 12 x the "
    "model's parameter bytes, the optimizer being SGD with momentum (one buffer per "
    "parameter; buffers such as batch-norm statistics not counted): the weights and what "
    "goes with them are a quarter of it; for a model whose weights are small (the U-Nets, "
    "the spec-v2 models) that is less than a step needs, so the budget is the larger of it "
    "and the 'auto' budget (autograd's predicted total peak at the preset's factor x the "
    "run's batch): the weights are then at most a quarter. The benchmark's step makes no "
    "optimizer state, so the momentum bytes (1 x the parameter bytes) are added to every "
    "measured total peak before it is compared with the budget"
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


def parameter_bytes(module: torch.nn.Module) -> int:
    return tensor_bytes(module.parameters())


def quarter_budget(module: torch.nn.Module) -> int:
    """4 x (parameters + their gradients + one momentum buffer each): the weights and what
    goes with them are a quarter of it."""
    return 4 * 3 * parameter_bytes(module)


def optimizer_state_bytes(module: torch.nn.Module) -> int:
    """SGD with momentum: one buffer the size of each parameter."""
    return parameter_bytes(module)


def own_total(found: dict[str, Any], module: torch.nn.Module, batch: list[Tensor]) -> int:
    """The total peak of a step counting only what is its own. On CUDA the step peak plus
    the module's parameters and buffers and the batch, since ``total_peak_bytes`` there
    also holds every other model resident on the device; on the CPU ``total_peak_bytes``
    is already exactly that."""
    if found.get("how") == "cuda":
        return int(found["step_peak_bytes"]) + state_bytes(module) + tensor_bytes(batch)
    return int(found["total_peak_bytes"])


def measure_step(method: Method, batch: list[Tensor], device: torch.device) -> dict[str, Any]:
    """``peak_step`` of one step; a method that compiles (``Method.compiles``) first steps
    once untimed, so a compilation for a new batch size is not measured."""
    if getattr(method, "compiles", False):
        method.step(batch)
    return peak_step(method, batch, device)


def measure_total(method: Method, batch: list[Tensor], device: torch.device) -> int:
    """``own_total`` of one measured step (``measure_step``)."""
    return own_total(measure_step(method, batch, device), method.module, batch)


def largest_batch(
    ms_per_sample: float | None, seconds: float | None, granularity: int = 1
) -> int | None:
    """The largest batch whose step is predicted to take at most ``seconds`` (None: no
    limit), from the time per sample measured at a small batch (on CPUs close to constant;
    on accelerators an overestimate, so the limit errs on the safe side)."""
    if seconds is None or not ms_per_sample:
        return None
    units = math.floor(seconds * 1e3 / (ms_per_sample * granularity))
    return max(1, units) * granularity


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
        points.append((n, measure_total(method, batch, device)))
        del batch
    a, b = fit_line(points)
    return {"intercept_bytes": a, "bytes_per_sample": b, "points": points}


def auto_budget(fit: dict[str, Any], batch: int, factor: float) -> int:
    """'auto': the predicted total peak of ``fit`` (autograd's) at ``factor`` x ``batch``,
    rounded up to a whole MiB."""
    mib = 1024 * 1024
    peak = fit["intercept_bytes"] + fit["bytes_per_sample"] * factor * batch
    return int(math.ceil(peak / mib)) * mib


def _line_guess(line: tuple[float, float], room: int, g: int, hi: int | None) -> int:
    """The line's max batch, below ``hi`` when known (0 when the line bounds nothing)."""
    guess = predict_max(*line, room, g) or 0
    return guess if hi is None else min(guess, hi - g)


def search(
    method: Method,
    make_batch: Callable[[int], list[Tensor]],
    budget: int,
    fit: dict[str, Any],
    device: torch.device,
    granularity: int = 1,
    progress: Callable[[str], None] | None = None,
    reserved: int = 0,
    largest: int | None = None,
) -> dict[str, Any]:
    """Predict (from ``probe_fit``'s line) and confirm the largest batch under ``budget``,
    counting ``reserved`` bytes on top of every measured total.

    Each further measurement is the batch predicted by the line through the two measured
    points nearest the limit (the largest batch known to fit, lo, and the smallest known
    not to, hi; before hi is known, the two largest measured batches), kept strictly
    between lo and hi; a prediction of lo itself measures lo + 1 step, the confirmation
    that the next batch does not fit. A batch over ``largest`` is replaced by ``largest``
    (once). Stops when hi = lo + 1 step, after ``MAX_STEPS`` measurements, or when the next
    batch would need too much memory or time; then the max batch is the line's prediction,
    unconfirmed."""
    g = granularity
    room = budget - reserved
    measured: dict[int, int] = dict(fit["points"])
    predicted = predict_max(fit["intercept_bytes"], fit["bytes_per_sample"], room, g)
    limit = available_memory(device)
    cap = None if largest is None else max(g, largest // g * g)
    notes: list[str] = []

    def bracket() -> tuple[int, int | None]:
        lo = max((n for n, p in measured.items() if p <= room), default=0)
        hi = min((n for n, p in measured.items() if p > room and n > lo), default=None)
        return lo, hi

    def line() -> tuple[float, float]:
        lo, hi = bracket()
        if hi is not None and lo in measured:
            return fit_line([(lo, measured[lo]), (hi, measured[hi])])
        return fit_line(sorted(measured.items())[-2:])

    def next_batch() -> int:
        lo, hi = bracket()
        a, b = line()
        guess = predict_max(a, b, room, g)
        n = max(lo + g, 2 * max(lo, g) if guess is None else guess)
        return n if hi is None else min(n, hi - g)

    steps, stopped = 0, False
    while True:
        lo, hi = bracket()
        if hi is not None and hi <= lo + g:
            break
        if steps == MAX_STEPS:
            notes.append(f"stopped after {MAX_STEPS} measurements beyond the probes")
            break
        n = next_batch()
        if cap is not None and n > cap:
            if cap in measured or cap <= lo:
                notes.append(
                    f"batch {n} not measured: its step is predicted to take over the "
                    f"time limit (--max-step-seconds: batch {cap} at most)"
                )
                stopped = True
                break
            n = cap
        a, b = line()
        if limit is not None and a + b * n > MEMORY_SHARE * limit:
            notes.append(f"batch {n} not measured: predicted over {MEMORY_SHARE:.0%} of memory")
            stopped = True
            break
        if progress:
            progress(f"{method.name}: batch {n}")
        batch = make_batch(n)
        measured[n] = measure_total(method, batch, device)
        del batch
        steps += 1
    lo, hi = bracket()
    confirmed = hi is not None and hi <= lo + g
    best = max(lo, _line_guess(line(), room, g, hi)) if stopped and not confirmed else lo
    return {
        "budget_bytes": budget,
        "reserved_bytes": reserved,
        "intercept_bytes": fit["intercept_bytes"],
        "bytes_per_sample": fit["bytes_per_sample"],
        "predicted_max_batch": predicted,
        "max_batch": best,
        "measured_max_batch": lo,
        "confirmed": confirmed,
        "basis": "measured" if best == lo else "predicted",
        "largest_measurable": cap,
        "measured": [{"batch": n, "total_peak_bytes": p} for n, p in sorted(measured.items())],
        "notes": notes,
    }
