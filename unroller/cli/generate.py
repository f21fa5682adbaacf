"""``unroll generate`` and ``unroll diff``: emit a model's training module, or compare it.

Model-file errors print ``FILE:LINE:COL: error: ...`` with the source line and a caret
and exit with status 2, never a traceback; no output file is written or replaced
(``unroller.cli.output`` says what ``-o`` accepts).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any

import typer

from unroller.api import generate_source, source_label
from unroller.cli.errors import config_error, fail, model_error, print_warnings
from unroller.cli.options import (
    GENERATED,
    TARGET_OPTIONS,
    ModelArg,
    PrecisionsOpt,
    SchemesOpt,
    value_of,
    with_options,
)
from unroller.cli.output import prepare_output, read_existing, write_output
from unroller.cli.stdout import write_stdout
from unroller.cli.target import make_options
from unroller.compiler.codegen import read_header
from unroller.compiler.options import Options
from unroller.compiler.precision import DEFAULT as PRECISION_DEFAULT
from unroller.errors import ConfigError, ModelError


def emit(model: Path, options: Options, label: str | None = None) -> str:
    """The generated module's text; a model or config error ends the command (status 2)."""
    try:
        return generate_source(model, options, label)
    except ModelError as exc:
        raise model_error(exc, model) from None
    except ConfigError as exc:
        raise config_error(exc) from None


@with_options(*TARGET_OPTIONS, "data_parallel", "update_in_backward", "shard", "pipeline")
def generate(
    model: ModelArg,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Output file; '-' or none: stdout. Only a regular file (new or existing) is "
            "written; a symbolic link is followed to the existing regular file it points to, "
            "which is replaced atomically while the link stays (a dangling link is refused).",
        ),
    ] = None,
    option_values: dict[str, Any] | None = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Overwrite a file that was edited by hand or not generated."),
    ] = False,
    mkdir: Annotated[
        bool,
        typer.Option("--mkdir", help="Create the output's folder (and its parents) if missing."),
    ] = False,
) -> None:
    """Generate the training module for MODEL.

    The write is atomic (a temporary .NAME.unroller-tmp-PID-RANDOM beside the target, then
    a rename; removed on failure, and stale ones from interrupted runs are cleaned up).
    Refused, exit status 2: a folder, FIFO, device or socket as output, a missing folder
    (unless --mkdir), a dangling symbolic link, the model file or compress config itself
    (even with --force), and, unless --force, an existing file that was not generated or
    was edited by hand.

    Example: unroll generate models/resnet34.txt --platform gpu --scheme dct-dense -o resnet34.py
    """
    values = option_values or {}
    options = make_options(values)
    compress_config = values.get("compress_config")
    to_stdout = output is None or str(output) == "-"
    inputs = (model, *((compress_config,) if compress_config else ()))
    target = None if to_stdout else prepare_output(output, force, mkdir, inputs=inputs)
    text = emit(model, options)
    print_warnings(model)
    if output is None or target is None:
        write_stdout(text)
        return
    write_output(output, target, text, mkdir)


def find_checked_in(model: Path, options: Options, root: Path = GENERATED) -> Path | None:
    """The file under generated/ whose header records this model, platform, scheme and
    precision (``SCHEME.py``, or ``SCHEME-PRECISION.py`` for another than fp32)."""
    label = source_label(model)
    precision = options.precision
    stem = options.scheme if precision == PRECISION_DEFAULT else f"{options.scheme}-{precision}"
    conventional = root / options.platform / model.stem / f"{stem}.py"
    if conventional.exists():
        return conventional
    for path in sorted(root.rglob("*.py")) if root.is_dir() else []:
        try:
            header = read_header(read_existing(path))
        except OSError:  # PathError included: a FIFO, a device, too big: not a candidate
            continue
        if (
            isinstance(header, dict)
            and header.get("source") == label
            and header.get("platform") == options.platform
            and header.get("scheme") == options.scheme
            and header.get("precision", PRECISION_DEFAULT) == precision
        ):
            return path
    return None


def unified(a: str, b: str, name_a: str, name_b: str) -> str:
    return "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), name_a, name_b
        )
    )


@with_options(*(name for name in TARGET_OPTIONS if name not in ("scheme", "precision")))
def diff(
    model: ModelArg,
    scheme: SchemesOpt = None,
    precision: PrecisionsOpt = None,
    option_values: dict[str, Any] | None = None,
    against: Annotated[
        Path | None, typer.Option(help="The file to compare with (default: the checked-in one).")
    ] = None,
) -> None:
    """Show what would change: emitted code against the checked-in file, scheme against
    scheme, or precision against precision.

    Examples: unroll diff models/quick.txt --platform gpu;
    unroll diff models/quick.txt --scheme nocompress --scheme dct-dense;
    unroll diff models/gpt_tiny.txt --precision fp32 --precision bf16-mixed (the casts);
    unroll diff models/gpt_tiny.txt --scheme quant --recompute-segments blocks --against
    gpt_quant.py (what segment recompute changes in a module generated without it).
    Exit status 1 when there are differences, 0 when none.
    """
    schemes = [value_of(s) for s in scheme or ["nocompress"]]
    precisions = [value_of(p) for p in precision or [PRECISION_DEFAULT]]
    if len(schemes) > 2 or len(precisions) > 2 or len(schemes) + len(precisions) > 3:
        raise fail(
            "give one --scheme and one --precision (against a file), two schemes (scheme "
            "against scheme) or two precisions (precision against precision)"
        )

    def options_for(name: str, chosen: str = precisions[0]) -> Options:
        return make_options(option_values or {}, scheme=name, precision=chosen)

    if len(schemes) == 2:
        a, b = (emit(model, options_for(s)) for s in schemes)
        text = unified(a, b, f"{model} ({schemes[0]})", f"{model} ({schemes[1]})")
    elif len(precisions) == 2:
        a, b = (emit(model, options_for(schemes[0], p)) for p in precisions)
        text = unified(a, b, f"{model} ({precisions[0]})", f"{model} ({precisions[1]})")
    else:
        options = options_for(schemes[0])
        target = against or find_checked_in(model, options)
        if against is not None and not against.is_file():
            raise fail(f"{against} does not exist or is not a regular file")
        if target is None or not target.exists():
            raise fail(
                f"no checked-in file for {model} ({options.platform}, {schemes[0]}, "
                f"{options.precision}) under "
                f"{GENERATED}/; name one with --against FILE"
            )
        try:
            current = read_existing(target)
        except OSError as exc:  # PathError included
            raise fail(f"cannot read {target}: {exc.strerror or exc}") from None
        text = unified(current, emit(model, options), str(target), f"{model} (now)")
    write_stdout(text)
    raise typer.Exit(1 if text else 0)


def register(app: typer.Typer) -> None:
    """Add generate and diff to ``app``."""
    app.command()(generate)
    app.command()(diff)
