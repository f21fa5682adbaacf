"""``unroll plan``: a compression config that fits a memory budget with the least error.

The work is ``unroller.analysis.plan`` (it imports torch, so only when the command runs); this
module reads the model, makes the probe batch, prints the table and writes the config
(through ``unroller.cli.output``, as generate -o: refused outputs are refused before the
work, and nothing is written when no plan fits the budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from unroller.cli.errors import config_error, fail, model_error
from unroller.cli.options import (
    DEFAULT_PRECISION,
    BatchOpt,
    ModelArg,
    PrecisionOpt,
    RecomputeOpt,
    RecomputeSegmentsOpt,
    ResolutionOpt,
    SegmentPieceSizeOpt,
    UpdateInBackwardOpt,
    parse_segments,
    value_of,
)
from unroller.cli.output import prepare_output, write_output
from unroller.cli.target import checked
from unroller.errors import ConfigError, ModelError

BudgetOpt = Annotated[
    str,
    typer.Option(
        "--memory-budget",
        help="Peak bytes of one training step (the step's own allocations: activations, "
        "what is kept for backward, gradients; not the weights or the batch), e.g. 2GiB, "
        "512MiB; 'min': the least any plan reaches, + 10%.",
    ),
]
MaxErrorOpt = Annotated[
    float | None,
    typer.Option(
        "--max-error",
        min=0.0,
        help="Leave out forms whose relative round-trip error on the probe tensor is above E.",
    ),
]
ProbeDataOpt = Annotated[
    str | None,
    typer.Option(
        "--dataset",
        "-d",
        help="Calibrate on a batch of this dataset (as unroll train's --dataset); default: "
        "seeded synthetic inputs of the declared shapes.",
    ),
]
ProbeBatchOpt = Annotated[
    int, typer.Option("--probe-batch", min=1, help="Samples in the probe step.")
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seeds the weights and synthetic inputs.")]
MeasureOpt = Annotated[
    bool,
    typer.Option(
        "--measure",
        help="Also run one step of the planned module at --batch-size on this CPU: its "
        "measured peak (profiler) and gradient error, next to the predicted ones.",
    ),
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Write the compression config (TOML) here, only when the plan fits the budget. "
        "As generate -o: a regular file, atomically; an existing file only if unroll plan "
        "wrote it (or with --force); never the model file.",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Replace an existing -o file that unroll plan did not write."),
]
MkdirOpt = Annotated[
    bool, typer.Option("--mkdir", help="Create the -o file's folder (and its parents) if missing.")
]
MaxTimeRatioOpt = Annotated[
    float | None,
    typer.Option(
        "--max-time-ratio",
        metavar="R",
        help="Search as --scheme auto does, instead of fitting a budget: every plan of "
        "forms, --recompute, segments and pieces, the least predicted bytes per sample "
        "whose predicted step takes at most R times the uncompressed step's; prints every "
        "plan scored and why one won. With --measure, the best plans are timed on this "
        "machine and one measured over R gives way to the next.",
    ),
]
#: The first words of every config unroll plan writes: such a file may be replaced.
PLAN_MARK = "Written by unroll plan"


def plan(
    model: ModelArg,
    batch_size: BatchOpt = 32,
    memory_budget: BudgetOpt = "min",
    max_error: MaxErrorOpt = None,
    dataset: ProbeDataOpt = None,
    probe_batch: ProbeBatchOpt = 4,
    seed: SeedOpt = 0,
    resolution: ResolutionOpt = None,
    precision: PrecisionOpt = DEFAULT_PRECISION,
    measure: MeasureOpt = False,
    recompute: RecomputeOpt = False,
    recompute_segments: RecomputeSegmentsOpt = None,
    segment_piece_size: SegmentPieceSizeOpt = 0,
    max_time_ratio: MaxTimeRatioOpt = None,
    update_in_backward: UpdateInBackwardOpt = False,
    output: OutOpt = None,
    force: ForceOpt = False,
    mkdir: MkdirOpt = False,
) -> None:
    """Choose per saved tensor among raw, quant 8/4/2 bits and DCT forms, so that the
    predicted peak of one step fits the budget with the least predicted gradient error.

    Memory is predicted from the step the generator emits (unroller/analysis/memory.py); the error
    is calibrated by one uncompressed probe step (per tensor: its round-trip error times
    the norm of the parameter gradients it reaches). The output is an ordinary compression
    config: unroll generate MODEL --compress-config plan.toml.

    Example: unroll plan benchmarks/models/resnet34.txt --batch-size 32 --memory-budget 600MiB -o plan.toml

    With --recompute-segments the plan counts those blocks as recomputed (auto: the search
    picks them); --segment-piece-size P plans them run in pieces of at most P samples, and
    the config it writes says so (segment_piece_size).

    With --max-time-ratio R it searches as --scheme auto does (--batch-size B: bytes per
    sample between B/2 and B) and writes the chosen plan's config.

    With --update-in-backward the peaks are those of the step that updates each parameter
    in its backward and frees its gradient (generate with --update-in-backward too).
    """
    from unroller.api import load_graph, source_label
    from unroller.bench.options import parse_bytes

    segments = checked("recompute_segments", parse_segments(recompute_segments))
    checked("segment_piece_size", segment_piece_size)
    checked("resolution", resolution)
    precision = checked("precision", value_of(precision))
    if segment_piece_size and not segments:
        raise fail("--segment-piece-size needs --recompute-segments (pieces of what?)")
    if max_time_ratio is not None:
        checked("max_time_ratio", max_time_ratio)
        _refuse_with_search(memory_budget, max_error, segment_piece_size)
        if update_in_backward:
            raise fail(
                "--max-time-ratio scores bytes per sample, which gradients do not add to: "
                "--update-in-backward changes nothing there (give a --memory-budget instead)"
            )
    if update_in_backward and measure:
        raise fail(
            "--measure times the planned module without an optimizer attached: not with "
            "--update-in-backward yet"
        )
    budget = None
    if memory_budget.strip().lower() != "min":
        try:
            budget = parse_bytes(memory_budget)
        except ValueError as exc:
            raise fail(f"--memory-budget: {exc}") from None
    target = None
    if output is not None:  # refused before the probe step, not after it
        target = prepare_output(
            output, force, mkdir, replaceable=_plan_file_problem, inputs=(model,)
        )
    try:
        graph = load_graph(model, resolution, precision)
        if segments and "auto" not in segments:  # refused before the probe step
            from unroller.compiler.stash import chosen_instances

            chosen_instances(graph, segments)
    except ModelError as exc:
        raise model_error(exc, model) from None
    import unroller.analysis.plan as planner

    try:
        batch = _probe_batch(graph, dataset, probe_batch, seed)
    except ConfigError as exc:
        raise config_error(exc) from None
    label = source_label(model)
    probe = planner.run_probe(graph, batch, probe_batch, seed, label=label)
    if max_time_ratio is not None:
        from unroller.cli import plan_search

        moves = {"recompute": True if recompute else None, "segments": _fixed(segments)}
        found = plan_search.run_search(
            graph, probe, label, batch_size, max_time_ratio, moves, measure
        )
        per_sample = (
            plan_search.measured_per_sample(graph, probe, label, found) if measure else None
        )
        plan_search.echo(graph, found, per_sample)
        if output is not None and target is not None:
            head = plan_search.header(PLAN_MARK, model, batch_size, found, per_sample)
            write_output(output, target, planner.config_toml(found.chosen.config, head), mkdir)
        return
    try:
        found = planner.make_plan(
            graph,
            batch_size,
            budget,
            probe,
            max_error,
            recompute=recompute,
            segments=segments,
            segment_piece_size=segment_piece_size,
            update_in_backward=update_in_backward,
        )
    except ModelError as exc:  # a segment the model does not have, or cannot recompute
        raise model_error(exc, model) from None
    measured = _measure(graph, found, probe, label) if measure else None
    typer.echo(render_table(found))
    typer.echo(summary(found, measured))
    if output is None or target is None:
        raise typer.Exit(0 if found.fits else 1)
    if not found.fits:  # a config that does not do what was asked is not written
        typer.echo(f"{output} not written: no plan fits the memory budget", err=True)
        raise typer.Exit(1)
    header = _header(model, batch_size, memory_budget, max_error, found, measured)
    write_output(output, target, planner.to_toml(found, header), mkdir)


def _refuse_with_search(memory_budget: str, max_error: float | None, piece_size: int) -> None:
    """What --max-time-ratio chooses itself cannot be given beside it."""
    if memory_budget.strip().lower() != "min":
        raise fail("--max-time-ratio searches for the least memory per sample: no --memory-budget")
    if max_error is not None:
        raise fail("--max-time-ratio plans forms as --scheme auto does: no --max-error")
    if piece_size:
        raise fail("--max-time-ratio chooses the piece size: no --segment-piece-size")


def _fixed(segments: tuple[str, ...]) -> tuple[str, ...] | None:
    """--recompute-segments for the search: none given or auto, the search chooses."""
    return None if not segments or "auto" in segments else segments


def _plan_file_problem(existing: str, output: Path) -> str | None:
    """Why -o must not replace ``existing`` without --force: unroll plan did not write it."""
    if existing.startswith(f"# {PLAN_MARK}"):
        return None
    return f"{output} exists and was not written by unroll plan; use --force to replace it"


def _probe_batch(graph: Any, dataset: str | None, size: int, seed: int) -> list | None:
    if dataset is None:
        return None
    from unroller.data import load, signature

    data = load(dataset, signature(graph), seed, train_size=size, test_size=1)
    split = data.train.head(size)
    batch = [split.inputs]
    if split.targets is not None:
        batch.append(split.targets)
    return batch


def _measure(graph: Any, found: Any, probe: Any, label: str) -> dict[str, Any]:
    """One step of the planned module at the plan's batch: profiler peak, gradient error."""
    import unroller.analysis.plan as planner
    from unroller.analysis.inputs import make_inputs
    from unroller.bench.profiling import profile_step
    from unroller.materialize import model_class

    planned = model_class(graph, label, found.config)
    model = planned()
    model.load_state_dict(probe.state, strict=True)
    model.train()
    inputs = [
        t.float() if t.is_floating_point() else t
        for t in make_inputs(graph, found.batch_size, seed=1)
    ]
    model(*inputs)  # warm: codec constants, allocator
    model.zero_grad(set_to_none=True)
    peak = profile_step(lambda: model(*inputs), "")["peak_bytes"]
    error = planner.measured_error(graph, found, probe, label, model_class=planned)
    return {"peak_bytes": peak, "error": error}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def render_table(found: Any) -> str:
    """Per planned tensor: form, bytes, round-trip error, sensitivity, held at the peak."""
    head = ("tensor", "shape", "form", "raw MiB", "stored MiB", "error", "sens.", "at peak")
    rows = [head]
    for r in found.rows:
        shape = "[" + ", ".join(str(d) for d in r.shape) + "]"
        rows.append(
            (
                r.tensor,
                shape,
                r.choice.label,
                _mib(r.raw_bytes),
                _mib(r.stored_bytes),
                f"{r.round_trip_error:.3g}",
                f"{r.sensitivity:.3g}",
                "yes" if r.held_at_peak else "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = {3, 4, 5, 6}
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def summary(found: Any, measured: dict[str, Any] | None) -> str:
    sim, base = found.simulation, found.nocompress
    lines = [
        f"batch {found.batch_size}: predicted peak {_mib(sim.peak_bytes)} MiB "
        f"(nocompress {_mib(base.peak_bytes)} MiB), budget {_mib(found.budget)} MiB: "
        + ("fits" if found.fits else "does NOT fit"),
        f"floor {_mib(sim.floor_bytes)} MiB (stash held + one statement's working set + "
        f".grad); kept for backward {_mib(sim.stash_bytes)} MiB of "
        f"{_mib(sim.stash_raw_bytes)} MiB raw",
        f"predicted relative gradient error {found.predicted_error:.3g} (probe: "
        f"{found.probe_source})",
    ]
    if measured:
        ratio = measured["peak_bytes"] / sim.peak_bytes
        lines.append(
            f"measured: peak {_mib(measured['peak_bytes'])} MiB ({ratio:.3f}x predicted), "
            f"relative gradient error {measured['error']:.3g} on the probe batch"
        )
    if found.segments:
        lines.append(f"blocks recomputed in the backward: {', '.join(found.segments)}")
    lines += found.notes
    return "\n".join(lines)


def _header(model: Path, batch: int, budget: str, max_error, found: Any, measured) -> list[str]:
    """Comment lines of the config; user text only as ascii() (no line breaks)."""
    sim = found.simulation
    lines = [
        f"{PLAN_MARK}: per saved tensor, the form that fits the memory budget",
        "with the least predicted gradient error (rules by tensor name; edit freely).",
        f"model {ascii(str(model))}, batch {batch}, budget {ascii(budget)}"
        + (f", max error {max_error:g}" if max_error is not None else ""),
        f"predicted peak {sim.peak_bytes} bytes (nocompress {found.nocompress.peak_bytes}), "
        f"floor {sim.floor_bytes}, fits: {'yes' if found.fits else 'no'}",
        f"predicted relative gradient error {found.predicted_error:.4g}",
    ]
    if measured:
        lines.append(
            f"measured peak {measured['peak_bytes']} bytes "
            f"({measured['peak_bytes'] / sim.peak_bytes:.3f}x predicted), measured "
            f"gradient error {measured['error']:.4g}"
        )
    lines.append("forms: " + ", ".join(f"{k} {v}" for k, v in _counts(found).items()))
    if found.segments:
        lines.append(f"blocks recomputed in the backward: {len(found.segments)}")
    return lines


def _counts(found: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in found.rows:
        counts[r.choice.label] = counts.get(r.choice.label, 0) + 1
    return counts


def register(app: typer.Typer) -> None:
    """Add plan to ``app``."""
    app.command()(plan)
