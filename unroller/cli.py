"""The `unroll` command line: generate, diff, check, graph, ops.

Model-file errors print ``FILE:LINE:COL: error: ...`` with the source line and a caret
and exit with status 2, never a traceback; no output file is written or replaced.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from unroller import __version__
from unroller.api import generate_source, load_graph, read_model_text, source_label, write_atomic
from unroller.codegen import PLATFORMS, SCHEMES, Options, edited_by_hand, read_header
from unroller.errors import ConfigError, ModelError
from unroller.pipeline import VALID_NUM_IPUS, ipu_report, split
from unroller.report import format_dot, format_ipus, format_stash, format_table, graph_report
from unroller.stash import plan_stash

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Generate PyTorch training code with an unrolled backward pass.\n\n"
    "Example: unroll generate models/quick.txt --platform gpu -o generated/gpu/quick/nocompress.py",
    rich_markup_mode=None,
)

DEFAULT_GENERATED = Path("generated")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"unroll: error: {message}", err=True)
    return typer.Exit(code)


def report_model_error(exc: ModelError, path: str | Path) -> typer.Exit:
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        source = ""
    typer.echo(exc.format(str(path), source), err=True)
    return typer.Exit(2)


def print_warnings(path: str | Path) -> None:
    try:
        graph = load_graph(path)
    except ModelError:
        return
    for warning in graph.warnings:
        typer.echo(warning.format(str(path), graph.source), err=True)


def make_options(
    platform: str,
    scheme: str,
    compress_config: Path | None = None,
    opt_level: int = 1,
    num_ipus: int = 1,
    stage_starts: str | None = None,
) -> Options:
    if platform not in PLATFORMS:
        raise fail(f"unknown platform '{platform}' (known: {', '.join(PLATFORMS)})")
    if scheme not in SCHEMES:
        raise fail(f"unknown scheme '{scheme}' (known: {', '.join(SCHEMES)})")
    options = Options(
        platform=platform,
        scheme=scheme,
        compress_config=source_label(compress_config) if compress_config else None,
        opt_level=opt_level,
        num_ipus=num_ipus,
        stage_starts=tuple(s.strip() for s in stage_starts.split(",")) if stage_starts else (),
    )
    if platform != "ipu" and (num_ipus != 1 or stage_starts):
        raise fail("--num-ipus and --stage-starts are for --platform ipu")
    if num_ipus not in VALID_NUM_IPUS:
        raise fail(f"--num-ipus must be one of {', '.join(map(str, VALID_NUM_IPUS))}")
    try:
        options.compression()  # reads and checks the config file now
    except ConfigError as exc:
        raise fail_plain(str(exc)) from None
    return options


def fail_plain(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(2)


def emit(model: Path, options: Options, label: str | None = None) -> str:
    try:
        return generate_source(model, options, label)
    except ModelError as exc:
        raise report_model_error(exc, model) from None
    except ConfigError as exc:
        raise fail_plain(str(exc)) from None


PlatformOpt = Annotated[
    str, typer.Option("--platform", "-p", help="gpu (plain PyTorch) or ipu (PopTorch).")
]
NumIpusOpt = Annotated[
    int, typer.Option("--num-ipus", help="ipu: pipeline stages, one per IPU (1, 2, 4, 8, 16).")
]
StagesOpt = Annotated[
    str | None,
    typer.Option(
        "--stage-starts",
        help="ipu: comma-separated first node of each stage after the first "
        "(default: balance parameter + stashed bytes).",
    ),
]
SchemeOpt = Annotated[
    str, typer.Option(help="Compression scheme: nocompress, dct-first, dct-dense or quant.")
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--compress-config", help="TOML file with a default and rules (replaces the scheme's)."
    ),
]
OptLevelOpt = Annotated[
    int, typer.Option("--opt-level", min=0, max=1, help="0: no compression and no masks.")
]


@app.command()
def generate(
    model: Annotated[Path, typer.Argument(help="The model file (.txt).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file; '-' or none: stdout.")
    ] = None,
    platform: PlatformOpt = "gpu",
    scheme: SchemeOpt = "nocompress",
    compress_config: ConfigOpt = None,
    opt_level: OptLevelOpt = 1,
    num_ipus: NumIpusOpt = 1,
    stage_starts: StagesOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite a file that was edited by hand.")
    ] = False,
) -> None:
    """Generate the training module for MODEL.

    Example: unroll generate models/resnet34.txt --platform gpu --scheme dct-dense -o resnet34.py
    """
    options = make_options(platform, scheme, compress_config, opt_level, num_ipus, stage_starts)
    text = emit(model, options)
    print_warnings(model)
    if output is None or str(output) == "-":
        sys.stdout.write(text)
        return
    if output.is_dir():
        raise fail(f"{output} is a folder; give the output file's name")
    if output.exists() and not force:
        existing = output.read_text(encoding="utf-8", errors="replace")
        if read_header(existing) is None:
            raise fail(
                f"{output} exists and was not generated by unroller; use --force to replace it"
            )
        if edited_by_hand(existing):
            raise fail(
                f"{output} was edited by hand since it was generated; use --force to replace it"
            )
    try:
        write_atomic(output, text)
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {output}", err=True)


def find_checked_in(model: Path, options: Options, root: Path = DEFAULT_GENERATED) -> Path | None:
    """The file under generated/ whose header records this model, platform and scheme."""
    label = source_label(model)
    conventional = root / options.platform / model.stem / f"{options.scheme}.py"
    if conventional.exists():
        return conventional
    for path in sorted(root.rglob("*.py")) if root.is_dir() else []:
        header = read_header(path.read_text(encoding="utf-8", errors="replace"))
        if (
            header
            and header.get("source") == label
            and header.get("platform") == options.platform
            and header.get("scheme") == options.scheme
        ):
            return path
    return None


def unified(a: str, b: str, name_a: str, name_b: str) -> str:
    return "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), name_a, name_b
        )
    )


@app.command()
def diff(
    model: Annotated[Path, typer.Argument(help="The model file.")],
    platform: PlatformOpt = "gpu",
    scheme: Annotated[
        list[str] | None, typer.Option(help="A scheme; give two to compare schemes.")
    ] = None,
    compress_config: ConfigOpt = None,
    opt_level: OptLevelOpt = 1,
    num_ipus: NumIpusOpt = 1,
    stage_starts: StagesOpt = None,
    against: Annotated[
        Path | None, typer.Option(help="The file to compare with (default: the checked-in one).")
    ] = None,
) -> None:
    """Show what would change: emitted code against the checked-in file, or scheme against scheme.

    Examples: unroll diff models/quick.txt --platform gpu;
    unroll diff models/quick.txt --scheme nocompress --scheme dct-dense.
    Exit status 1 when there are differences, 0 when none.
    """
    schemes = scheme or ["nocompress"]
    if len(schemes) > 2:
        raise fail("give one --scheme (against a file) or two (scheme against scheme)")
    if len(schemes) == 2:
        a, b = (
            emit(
                model,
                make_options(platform, s, compress_config, opt_level, num_ipus, stage_starts),
            )
            for s in schemes
        )
        text = unified(a, b, f"{model} ({schemes[0]})", f"{model} ({schemes[1]})")
    else:
        options = make_options(
            platform, schemes[0], compress_config, opt_level, num_ipus, stage_starts
        )
        target = against or find_checked_in(model, options)
        if against is not None and not against.is_file():
            raise fail(f"{against} does not exist or is not a file")
        if target is None or not target.exists():
            raise fail(
                f"no checked-in file for {model} ({platform}, {schemes[0]}) under "
                f"{DEFAULT_GENERATED}/; name one with --against FILE"
            )
        current = target.read_text(encoding="utf-8")
        text = unified(current, emit(model, options), str(target), f"{model} (now)")
    sys.stdout.write(text)
    raise typer.Exit(1 if text else 0)


def resolve_source(recorded: str, generated_file: Path) -> Path | None:
    """A recorded source path, relative to the working directory or an ancestor of the file."""
    candidate = Path(recorded)
    if candidate.is_absolute():
        return candidate if candidate.exists() else None
    for base in (Path.cwd(), *generated_file.resolve().parents):
        if (base / candidate).exists():
            return base / candidate
    return None


@app.command()
def check(
    directory: Annotated[
        Path, typer.Argument(help="Folder of generated files.")
    ] = DEFAULT_GENERATED,
) -> None:
    """Check that every generated file regenerates byte-identically from its recorded source.

    Example: unroll check generated. Exit status 1 lists the stale files.
    """
    if not directory.is_dir():
        raise fail(f"{directory} is not a folder")
    stale: list[str] = []
    checked = 0
    for path in sorted(directory.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        header = read_header(text)
        if header is None:
            continue
        checked += 1
        source = resolve_source(header.get("source", ""), path)
        if source is None:
            stale.append(f"{path}: its source {header.get('source')!r} is missing")
            continue
        options = Options.from_header(header)
        if options.compress_config is not None:
            config = resolve_source(options.compress_config, path)
            if config is None:
                stale.append(
                    f"{path}: its compression config {options.compress_config!r} is missing"
                )
                continue
        try:
            fresh = generate_source(source, options, label=header["source"])
        except (ModelError, ValueError, ConfigError) as exc:
            stale.append(f"{path}: cannot regenerate ({getattr(exc, 'message', exc)})")
            continue
        if fresh != text:
            stale.append(
                f"{path}: differs from what the generator emits now (unroll diff shows how)"
            )
    for line in stale:
        typer.echo(line, err=True)
    typer.echo(f"{checked - len(stale)} of {checked} generated files up to date", err=True)
    raise typer.Exit(1 if stale else 0)


@app.command()
def graph(
    model: Annotated[Path, typer.Argument(help="The model file.")],
    batch_size: Annotated[int, typer.Option(min=1, help="Batch size for byte counts.")] = 32,
    fmt: Annotated[str, typer.Option("--format", help="table, json or dot.")] = "table",
    scheme: SchemeOpt = "nocompress",
    compress_config: ConfigOpt = None,
    opt_level: OptLevelOpt = 1,
    platform: PlatformOpt = "gpu",
    num_ipus: NumIpusOpt = 1,
    stage_starts: StagesOpt = None,
) -> None:
    """Show the node graph: op, output shape, parameters and bytes saved for backward,
    and per saved tensor the form the scheme keeps it in, raw and stored bytes.

    With --platform ipu: per IPU its parameter bytes, stashed bytes (raw and stored) and
    the bytes crossing each stage boundary.

    Example: unroll graph models/resnet34.txt --batch-size 32 --scheme dct-dense
    """
    options = make_options(platform, scheme, compress_config, opt_level, num_ipus, stage_starts)
    if fmt not in ("table", "json", "dot"):
        raise fail(f"unknown format '{fmt}' (table, json or dot)")
    try:
        read_model_text(model)
        g = load_graph(model)
    except ModelError as exc:
        raise report_model_error(exc, model) from None
    for warning in g.warnings:
        typer.echo(warning.format(str(model), g.source), err=True)
    plan = plan_stash(g, options.compression())
    stash = plan.report(batch_size)
    per_ipu = None
    if platform == "ipu":
        try:
            pipe = split(g, plan, num_ipus, list(options.stage_starts) or None)
        except ModelError as exc:
            raise report_model_error(exc, model) from None
        per_ipu = ipu_report(g, plan, pipe, batch_size)
    if fmt == "dot":
        typer.echo(format_dot(g))
    elif fmt == "json":
        found = {**graph_report(g, batch_size), "stash": stash}
        if per_ipu is not None:
            found["ipus"] = per_ipu
        typer.echo(json.dumps(found, indent=2))
    else:
        typer.echo(format_table(graph_report(g, batch_size)))
        typer.echo("")
        typer.echo(format_stash(stash, scheme if compress_config is None else str(compress_config)))
        if per_ipu is not None:
            typer.echo("")
            typer.echo(format_ipus(per_ipu))


@app.command()
def lint(
    paths: Annotated[list[Path], typer.Argument(help="Generated modules or folders of them.")],
    platform: PlatformOpt = "ipu",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every call.")] = False,
) -> None:
    """Check every torch call reachable from generated modules against what the platform runs.

    Follows the modules they import from the unroller package (kernels, compressors) and
    fails, with file and line, on any call outside the platform's supported list.

    Example: unroll lint generated/ipu generated/multiipu --platform ipu
    """
    from unroller.lint import lint_paths

    try:
        report = lint_paths(paths, platform)
    except (FileNotFoundError, ValueError) as exc:
        raise fail(str(exc)) from None
    typer.echo(report.format(verbose=verbose))
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def ops() -> None:
    """List the operators of the registry with their arguments.

    Example: unroll ops
    """
    from unroller.registry import load_registry

    for name, spec in load_registry().items():
        args = ", ".join(
            (
                a.name
                if a.required
                else f"{a.name}={a.default if a.default_from is None else a.default_from}"
            )
            for a in spec.args.values()
        )
        inputs = "*inputs" if spec.variadic else ", ".join(spec.inputs)
        typer.echo(f"{name}({inputs}{', ' + args if args else ''})  -- {spec.doc}")


@app.command(
    add_help_option=False,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bench(ctx: typer.Context) -> None:
    """Benchmark the generated step against autograd and its peers (what make bench runs).

    Every argument goes to the harness (python -m benchmarks.run, in the project's
    checkout); `unroll bench --help` lists them.

    Example: unroll bench --benchmark resnet34 --scheme dct-dense --memory-budget 2GiB
    """
    try:
        from benchmarks.run import main as run_bench
    except ImportError as exc:
        raise fail(
            f"the benchmark harness is not importable here ({exc}): run from a checkout"
        ) from None
    raise typer.Exit(run_bench(list(ctx.args), prog="unroll bench"))


def _register_training_commands() -> None:
    from unroller.cli_train import register

    register(app)


_register_training_commands()


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"unroller {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=version_callback, is_eager=True, help="Show the version."
        ),
    ] = False,
) -> None:
    """unroll: PyTorch code with an unrolled backward pass, for activation compression."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
