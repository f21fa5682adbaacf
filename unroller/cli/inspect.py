"""Commands that look at a model or generated code without writing anything:
``unroll graph`` (nodes, saved bytes, the stash, per-stage bytes), ``unroll lint`` (torch
calls a platform cannot run) and ``unroll ops`` (the operator registry)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from unroller.analysis.report import (
    format_dot,
    format_ipus,
    format_stash,
    format_table,
    graph_report,
)
from unroller.api import compression_config, load_graph, read_model_text
from unroller.cli.errors import fail, model_error
from unroller.cli.options import (
    TARGET_OPTIONS,
    ModelArg,
    PlatformOpt,
    value_of,
    with_options,
)
from unroller.cli.stdout import write_stdout
from unroller.cli.target import make_options
from unroller.compiler.pipeline import ipu_report, split
from unroller.compiler.platforms import LINTED, PlatformName
from unroller.compiler.platforms import platform as platform_named
from unroller.compiler.stash import plan_stash
from unroller.errors import ModelError

FORMATS = ("table", "json", "dot")
#: lint checks against a platform's list of supported calls (``platforms.LINTED``: the
#: first whose compiler accepts only a listed set).
LINT_PLATFORM = PlatformName(LINTED.name)


@with_options(*TARGET_OPTIONS)
def graph(
    model: ModelArg,
    batch_size: Annotated[int, typer.Option(min=1, help="Batch size for byte counts.")] = 32,
    fmt: Annotated[str, typer.Option("--format", help="table, json or dot.")] = "table",
    option_values: dict[str, Any] | None = None,
) -> None:
    """Show the node graph: op, output shape, parameters and bytes saved for backward,
    and per saved tensor the form the scheme keeps it in, raw and stored bytes.

    With a pipelined platform (--platform ipu): per stage its parameter bytes, stashed
    bytes (raw and stored) and the bytes crossing each stage boundary.

    Example: unroll graph models/resnet34.txt --batch-size 32 --scheme dct-dense
    """
    options = make_options(option_values or {})
    if fmt not in FORMATS:
        raise fail(f"unknown format '{fmt}' (table, json or dot)")
    try:
        read_model_text(model)
        g = load_graph(model, precision=options.precision)
    except ModelError as exc:
        raise model_error(exc, model) from None
    for warning in g.warnings:
        typer.echo(warning.format(str(model), g.source), err=True)
    try:
        plan = plan_stash(
            g, compression_config(options, g), options.segment_pieces, options.segment_piece_size
        )
    except ModelError as exc:  # a segment the model does not have, or cannot recompute
        raise model_error(exc, model) from None
    stash = plan.report(batch_size)
    per_stage = None
    if platform_named(options.platform).pipelined:
        try:
            pipe = split(g, plan, options.num_ipus, list(options.stage_starts) or None)
        except ModelError as exc:
            raise model_error(exc, model) from None
        per_stage = ipu_report(g, plan, pipe, batch_size)
    if fmt == "dot":
        out = [format_dot(g)]
    elif fmt == "json":
        found = {**graph_report(g, batch_size), "stash": stash}
        if per_stage is not None:
            found["ipus"] = per_stage
        out = [json.dumps(found, indent=2)]
    else:
        out = [format_table(graph_report(g, batch_size)), ""]
        config_path = (option_values or {}).get("compress_config")
        shown = options.scheme if config_path is None else str(config_path)
        out.append(format_stash(stash, shown))
        out += _segment_lines(plan, batch_size)
        if per_stage is not None:
            out += ["", format_ipus(per_stage)]
    write_stdout("".join(f"{line}\n" for line in out))


def _segment_lines(plan: Any, batch: int) -> list[str]:
    """Segment recompute, under the stash table: what the forward keeps through to the
    backward, and which block instances the patterns matched but cannot be recomputed."""
    if not plan.segments and not plan.skipped_segments:
        return []
    own = sum(s.stored_bytes(batch) for s in plan.entries if s.segment is not None)
    total = sum(s.stored_bytes(batch) for s in plan.entries)
    names = ", ".join(s.name for s in plan.segments) or "none"
    lines = [
        "",
        f"segments recomputed in the backward: {names}; the forward keeps "
        f"{total - own:,} bytes through to the backward, the recomputes make the other "
        f"{own:,} again, one segment at a time",
    ]
    lines += [f"not recomputed: {name}: {why}" for name, why in plan.skipped_segments.items()]
    pieced = [s for s in plan.segments if s.in_pieces]
    if pieced:
        lines.append(
            f"in {pieced[0].pieces_text()} (forward, recompute and backward, one "
            f"piece at a time, a piece's own stash raw): {', '.join(s.name for s in pieced)}"
        )
    lines += [
        f"not in pieces (whole batch): {name}: {why}"
        for name, why in plan.unpieced_segments.items()
    ]
    return lines


def lint(
    paths: Annotated[list[Path], typer.Argument(help="Generated modules or folders of them.")],
    platform: PlatformOpt = LINT_PLATFORM,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every call.")] = False,
) -> None:
    """Check every torch call reachable from generated modules against what the platform runs.

    Follows every module they import (unroller kernels and compressors, user operator
    modules from UNROLLER_OPS, and what those call) and fails, with file, line and the
    chain of calls, on any call outside the platform's supported list or any module it
    cannot find or read.

    Example: unroll lint generated/ipu generated/multiipu --platform ipu
    """
    from unroller.lint import lint_paths

    try:
        report = lint_paths(paths, value_of(platform))
    except (FileNotFoundError, ValueError) as exc:
        raise fail(str(exc)) from None
    write_stdout(f"{report.format(verbose=verbose)}\n")
    raise typer.Exit(0 if report.ok else 1)


def ops(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="The operator table of docs/language.md.")
    ] = False,
    update: Annotated[
        Path | None,
        typer.Option(
            "--update",
            help="Rewrite the operator section of this markdown file (docs/language.md).",
        ),
    ] = None,
) -> None:
    """List the operators of the registry with their arguments.

    Example: unroll ops
    """
    from unroller.compiler.registry import load_registry

    if markdown or update is not None:
        from unroller.compiler.reference import operator_table, with_table

        if update is None:
            write_stdout(operator_table())
            return
        from unroller.api import write_atomic

        try:
            page = with_table(update.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise fail(f"{update}: {exc}") from None
        write_atomic(update, page)
        write_stdout(f"updated the operator section of {update}\n")
        return
    out = []
    for name, spec in load_registry().items():
        args = ", ".join(
            (
                a.name
                if a.required
                else f"{a.name}={a.default if a.default_from is None else a.default_from}"
            )
            for a in spec.args.values()
        )
        inputs = (
            "*inputs"
            if spec.variadic
            else ", ".join(
                name if i < spec.required_inputs else f"[{name}]"
                for i, name in enumerate(spec.inputs)
            )
        )
        signature = ", ".join(part for part in (inputs, args) if part)
        out.append(f"{name}({signature})  -- {spec.doc}\n")
    write_stdout("".join(out))


def register(app: typer.Typer) -> None:
    """Add graph, lint and ops to ``app``."""
    app.command()(graph)
    app.command()(lint)
    app.command()(ops)
