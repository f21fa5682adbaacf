"""``unroll plan --max-time-ratio R``: the ``auto`` search, shown and checked.

The search (``unroller.analysis.search``) scores every plan of forms, ``--recompute``,
segments and pieces by predicted bytes per sample and predicted step time; this prints each
plan it scored, what it chose and why, and with ``--measure`` times the best plans against
the uncompressed step on this machine (interleaved steps, the median of the per-round
ratios), moving on while one is measured over the limit, and measures the chosen plan's
peak at the two batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

#: --measure: untimed rounds, then timed rounds, each a step of both modules in turn
WARMUP, ROUNDS = 1, 5


def run_search(
    graph: Any,
    probe: Any,
    label: str,
    batch_size: int,
    limit: float,
    moves: dict[str, Any],
    measure: bool,
) -> Any:
    """The search at batches ``batch_size // 2`` and ``batch_size``; ``measure``: its best
    plans timed against the uncompressed step at ``batch_size``."""
    from unroller.analysis.search import search

    batches = (max(1, batch_size // 2), max(2, batch_size))
    timer = _step_ratio(graph, probe, label, batches[1]) if measure else None
    return search(graph, probe, limit, batches, label=label, measure=timer, **moves)


def _stepper(graph: Any, probe: Any, label: str, config: Any, batch: int):
    """One training step of the module generated under ``config``, on the probe's weights
    and a seeded batch, as a function."""
    import torch

    from unroller.analysis.inputs import make_inputs
    from unroller.materialize import model_class

    model = model_class(graph, label, config)()
    model.load_state_dict(probe.state, strict=True)
    model.train()
    inputs = [t.float() if t.is_floating_point() else t for t in make_inputs(graph, batch, seed=1)]

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return model(*inputs)

    return step


def _step_ratio(graph: Any, probe: Any, label: str, batch: int):
    """A function: config -> the median over rounds of its step's time over the
    uncompressed step's, the two taking turns."""
    from unroller.bench.timing import time_interleaved
    from unroller.compiler.schemes import CompressionConfig

    base = _stepper(graph, probe, label, CompressionConfig(), batch)

    def ratio(config: Any) -> float:
        sides = {"plan": _stepper(graph, probe, label, config, batch), "nocompress": base}
        found = time_interleaved(sides, WARMUP, ROUNDS, "nocompress")
        return float(found["plan"]["ratio"]["median"])

    return ratio


def measured_per_sample(graph: Any, probe: Any, label: str, found: Any) -> float:
    """The chosen plan's measured bytes per sample: the slope of its step peak (profiler)
    between the search's two batches."""
    from unroller.bench.profiling import profile_step

    peaks = []
    b1, b2 = found.batches[:2]
    for batch in (b1, b2):
        step = _stepper(graph, probe, label, found.chosen.config, batch)
        step()  # warm: codec constants, allocator
        peaks.append(profile_step(step, "")["peak_bytes"])
    return (peaks[1] - peaks[0]) / (b2 - b1)


def render(found: Any, measured_bytes: float | None, bound: Any = None) -> str:
    """Every plan scored, best first, then the choice and why; ``bound``: the chosen
    plan's ``working_set.WorkingSetBound``."""
    from unroller.analysis.search import LARGE_BATCH

    head = ("plan", "bytes/sample", "time (predicted)", "time (measured)", "")
    rows = [head]
    for c in found.candidates:
        mark = "<- chosen" if c is found.chosen else c.note
        measured = f"{c.measured_ratio:.2f}x" if c.measured_ratio is not None else ""
        rows.append((c.label, f"{c.bytes_per_sample:,.0f}", f"{c.ratio:.2f}x", measured, mark))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            cell.rjust(w) if i in (1, 2, 3) else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    b1, b2 = found.batches[:2]
    more = "".join(
        f", or between {a} and {b} where larger"
        for a, b in zip(found.batches[2::2], found.batches[3::2])
    )
    lines.append(
        f"bytes per sample: the predicted step peak's slope between batch {b1} and {b2}{more}; "
        f"time: against the uncompressed step, predicted the larger at batch {b2} and "
        f"{LARGE_BATCH}, measured at {b2}"
    )
    if found.dropped:
        lines.append(
            f"not planned: {len(found.dropped)} more, over {found.held:.2f}x with no "
            f"codec already (e.g. {found.dropped[0]})"
        )
    lines.append(f"chosen: {found.chosen.label}: {found.why()}")
    if bound is not None:
        statement = bound.at.split(" = ")[0]
        lines.append(
            f"of which its working set: {bound.per_sample:,.0f} bytes per sample (the "
            f"{bound.section} of {statement}), which no forms for this structure go below"
        )
    if measured_bytes is not None:
        predicted = found.chosen.bytes_per_sample
        lines.append(
            f"measured: {measured_bytes:,.0f} bytes per sample "
            f"({measured_bytes / predicted:.3f}x predicted)"
            if predicted
            else f"measured: {measured_bytes:,.0f} bytes per sample"
        )
    lines += found.notes
    return "\n".join(lines)


def header(
    mark: str, model: Path, batch: int, found: Any, measured_bytes: float | None
) -> list[str]:
    """Comment lines of the config written, the first starting with ``mark`` (what tells
    unroll plan the file is its own); user text only as ascii()."""
    c = found.chosen
    lines = [
        f"{mark} --max-time-ratio {found.max_time_ratio:g}: the plan with the least",
        "predicted bytes per sample within that many times the uncompressed step's time.",
        f"model {ascii(str(model))}, batches {found.batches[0]} and {batch}",
        f"chosen: {c.label}",
        f"predicted {c.bytes_per_sample:.0f} bytes per sample, {c.ratio:.3f}x time",
    ]
    if c.measured_ratio is not None:
        lines.append(f"measured time {c.measured_ratio:.3f}x the uncompressed step's")
    if measured_bytes is not None:
        lines.append(f"measured {measured_bytes:.0f} bytes per sample")
    return lines


def echo(graph: Any, found: Any, measured_bytes: float | None) -> None:
    """The search's table and choice, with the chosen plan's working set per sample."""
    from unroller.analysis.working_set import working_set_bound

    batches = (found.batches[0], found.batches[1])
    bound = working_set_bound(graph, found.chosen.config, batches)
    typer.echo(render(found, measured_bytes, bound))
