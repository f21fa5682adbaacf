"""The `unroll` command line: generate, diff, check, graph, ops.

Model-file errors print ``FILE:LINE:COL: error: ...`` with the source line and a caret
and exit with status 2, never a traceback; no output file is written or replaced.

Output paths (``generate -o``): only regular files are written, atomically (a temporary
``.NAME.unroller-tmp-PID-RANDOM`` beside the target, then a rename); a folder, FIFO,
device or socket is refused, and so is a missing folder unless ``--mkdir``. A symbolic
link is followed to the existing regular file it points to, which is replaced while the
link stays; a dangling link, a link loop or a link to anything else is refused. An
existing target is read (to refuse hand-edited or foreign files) only if it is a regular
file of at most 64 MiB. A full or closed standard output is an error (status 2).
"""

from __future__ import annotations

import difflib
import errno
import io
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Annotated

import typer

from unroller import __version__
from unroller.api import (
    PathError,
    file_kind,
    generate_source,
    load_graph,
    output_target,
    read_bounded,
    read_model_text,
    source_label,
    stale_temps,
    write_atomic,
)
from unroller.codegen import (
    CHECKSUM_TAG,
    HEADER_TAG,
    PLATFORMS,
    SCHEMES,
    Options,
    body_checksum,
    edited_by_hand,
    read_header,
)
from unroller.errors import ConfigError, ModelError
from unroller.pipeline import VALID_NUM_IPUS, ipu_report, split
from unroller.report import format_dot, format_ipus, format_stash, format_table, graph_report
from unroller.stash import plan_stash

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Generate PyTorch training code with an unrolled backward pass.\n\n"
    "Example: unroll generate models/quick.txt --platform gpu -o generated/gpu/quick/nocompress.py"
    " --mkdir",
    rich_markup_mode=None,
)

DEFAULT_GENERATED = Path("generated")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"unroll: error: {message}", err=True)
    return typer.Exit(code)


def report_model_error(exc: ModelError, path: str | Path) -> typer.Exit:
    from unroller.parser import read_source

    try:  # the same bounded read of a regular file as the parser's: a FIFO never blocks
        source = read_source(path)
    except ModelError:
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


def _silence_stdout() -> None:
    """Point the stdout descriptor at /dev/null, so what is still buffered there cannot
    fail again (with a second message) when the interpreter exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


def write_stdout(text: str) -> None:
    """Write to standard output and flush: a full device (ENOSPC) or any other write
    error is a one-line error with status 2; a reader that went away (EPIPE), status 2
    without a message."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        _silence_stdout()
        if exc.errno == errno.EPIPE:
            raise typer.Exit(2) from None
        raise fail(f"cannot write to standard output: {exc.strerror or exc}") from None


def read_existing(path: Path) -> str:
    """A file to compare with: a regular file of at most 64 MiB (PathError otherwise)."""
    return read_bounded(path).decode("utf-8", errors="replace")


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
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Output file; '-' or none: stdout. Only a regular file (new or existing) is "
            "written; a symbolic link is followed to the existing regular file it points to, "
            "which is replaced atomically while the link stays (a dangling link is refused).",
        ),
    ] = None,
    platform: PlatformOpt = "gpu",
    scheme: SchemeOpt = "nocompress",
    compress_config: ConfigOpt = None,
    opt_level: OptLevelOpt = 1,
    num_ipus: NumIpusOpt = 1,
    stage_starts: StagesOpt = None,
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
    (unless --mkdir), a dangling symbolic link, and, unless --force, an existing file that
    was not generated or was edited by hand.

    Example: unroll generate models/resnet34.txt --platform gpu --scheme dct-dense -o resnet34.py
    """
    options = make_options(platform, scheme, compress_config, opt_level, num_ipus, stage_starts)
    to_stdout = output is None or str(output) == "-"
    target = None if to_stdout else prepare_output(output, force, mkdir)
    text = emit(model, options)
    print_warnings(model)
    if output is None or target is None:
        write_stdout(text)
        return
    for stale in stale_temps(target.parent, target.name):
        try:
            stale.unlink()
            typer.echo(f"removed {stale} (left by an interrupted write)", err=True)
        except OSError:
            pass
    try:
        write_atomic(output, text, parents=mkdir)
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    shown = f"{output} (-> {target})" if output.is_symlink() else f"{output}"
    typer.echo(f"wrote {shown}", err=True)


def prepare_output(output: Path, force: bool, mkdir: bool) -> Path:
    """The file ``generate -o OUTPUT`` will replace, after refusing what it must not touch."""
    try:
        target = output_target(output)
    except PathError as exc:
        message = str(exc)
        if message.endswith("is a folder") or "to the folder" in message:
            message += "; give the output file's name"
        elif "not a regular file" in message:
            message += "; unroll writes only regular files (-o - for standard output)"
        raise fail(message) from None
    except OSError as exc:  # permission denied on a folder, a name too long, ...
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    folder = target.parent
    if not folder.is_dir():
        if folder.exists() or folder.is_symlink():
            raise fail(f"cannot write {output}: {folder} is not a folder")
        if not mkdir:
            raise fail(f"folder {folder} does not exist (create it, or pass --mkdir)")
    if force or not target.exists():
        return target
    try:
        existing = read_existing(target)
    except PathError as exc:
        raise fail(f"{exc}; it is not a file unroller generated (--force replaces it)") from None
    except OSError as exc:
        raise fail(
            f"cannot read {output} to see whether unroller generated it: "
            f"{exc.strerror or exc} (--force replaces it unread)"
        ) from None
    if read_header(existing) is None:
        raise fail(f"{output} exists and was not generated by unroller; use --force to replace it")
    if edited_by_hand(existing):
        raise fail(f"{output} was edited by hand since it was generated; use --force to replace it")
    return target


def find_checked_in(model: Path, options: Options, root: Path = DEFAULT_GENERATED) -> Path | None:
    """The file under generated/ whose header records this model, platform and scheme."""
    label = source_label(model)
    conventional = root / options.platform / model.stem / f"{options.scheme}.py"
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
            raise fail(f"{against} does not exist or is not a regular file")
        if target is None or not target.exists():
            raise fail(
                f"no checked-in file for {model} ({platform}, {schemes[0]}) under "
                f"{DEFAULT_GENERATED}/; name one with --against FILE"
            )
        try:
            current = read_existing(target)
        except OSError as exc:  # PathError included
            raise fail(f"cannot read {target}: {exc.strerror or exc}") from None
        text = unified(current, emit(model, options), str(target), f"{model} (now)")
    write_stdout(text)
    raise typer.Exit(1 if text else 0)


def resolve_source(recorded: str, generated_file: Path) -> Path | None:
    """A recorded source path, relative to the working directory or an ancestor of the
    file; only a regular file counts (a FIFO or device recorded there is never read)."""
    try:
        candidate = Path(recorded)
        if candidate.is_absolute():
            return candidate if candidate.is_file() else None
        for base in (Path.cwd(), *generated_file.resolve().parents):
            if (base / candidate).is_file():
                return base / candidate
    except (OSError, ValueError):  # a name too long, a NUL byte
        return None
    return None


HEADER_LINES = 10  # read_header and edited_by_hand look at this many first lines
HEADER_LIKE = re.compile(r"^\s*#.*\bunroller\s*:", re.IGNORECASE)  # moved or re-prefixed
GENERATED_SIGNS = ("Generated by unroller", "unroll generate", "import unroller.runtime")


def short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def header_problem(header: object) -> str | None:
    """Why a parsed ``# unroller:`` header cannot say how its file was generated, or None."""
    if not isinstance(header, dict):
        kind = {list: "a list", str: "a string", int: "a number", float: "a number"}.get(
            type(header), "null" if header is None else type(header).__name__
        )
        return f"the header is {kind}, not a JSON object"
    for key in ("source", "platform", "scheme"):
        if key not in header:
            return f"it records no '{key}'"
    for key in ("source", "generator", "sha256", "compress_config", "compress_config_sha256"):
        if key in header and not isinstance(header[key], str):
            return f"'{key}' is {short(header[key])}, not a string"
    if not header["source"].strip() or "\0" in header["source"]:
        return f"'source' is {short(header['source'])}, not a path"
    if header["platform"] not in PLATFORMS:
        return f"unknown platform {short(header['platform'])} (known: {', '.join(PLATFORMS)})"
    if header["scheme"] not in SCHEMES:
        return f"unknown scheme {short(header['scheme'])} (known: {', '.join(SCHEMES)})"
    limits = {"opt_level": (0, 1), "num_ipus": VALID_NUM_IPUS}
    for key, allowed in limits.items():
        value = header.get(key, allowed[-1] if key == "opt_level" else 1)
        if isinstance(value, bool) or value not in allowed:
            return f"'{key}' is {short(value)}, not one of {', '.join(map(str, allowed))}"
    starts = header.get("stage_starts", [])
    if not isinstance(starts, list) or not all(isinstance(x, str) for x in starts):
        return f"'stage_starts' is {short(starts)}, not a list of node names"
    resolution = header.get("resolution")
    if resolution is not None and (
        isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1
    ):
        return f"'resolution' is {short(resolution)}, not a positive whole number"
    return None


def inspect_header(text: str) -> tuple[dict | None, str]:
    """The header of a file under a checked folder, or why there is none that works."""
    lines = text.splitlines()
    for line in lines[:HEADER_LINES]:
        if line.startswith(HEADER_TAG):
            try:
                header = json.loads(line[len(HEADER_TAG) :])
            except (ValueError, RecursionError) as exc:
                why = getattr(exc, "msg", None) or type(exc).__name__
                return None, f"header damaged: its '{HEADER_TAG.strip()}' line is not JSON ({why})"
            problem = header_problem(header)
            if problem:
                return None, f"header damaged: {problem}"
            return header, ""
    for number, line in enumerate(lines, 1):
        if HEADER_LIKE.match(line):
            where = "moved" if line.startswith(HEADER_TAG) else "re-prefixed"
            return None, (
                f"header damaged: line {number} looks like a {where} header ({short(line, 40)}); "
                f"'{HEADER_TAG}{{...}}' must be one of the first {HEADER_LINES} lines"
            )
    if any(line.lstrip().startswith(CHECKSUM_TAG.strip()) for line in lines):
        return None, f"header damaged: a '{CHECKSUM_TAG.strip()}' line but no header line"
    for sign in GENERATED_SIGNS:
        if sign in text:
            return None, f"not generated / header damaged: no header, yet it says {sign!r}"
    return None, "not generated by unroller (no header line); only generated files belong here"


def checksum_problem(text: str) -> tuple[str, str] | None:
    """('damaged' | 'stale', why) when the checksum line is missing or does not match."""
    for line in text.splitlines()[:HEADER_LINES]:
        if line.startswith(CHECKSUM_TAG):
            if line[len(CHECKSUM_TAG) :].strip() != body_checksum(text):
                return "stale", "edited after it was generated (its checksum no longer matches)"
            return None
    return "damaged", f"header damaged: no '{CHECKSUM_TAG.strip()}' line"


def check_file(path: Path) -> tuple[str, str]:
    """('ok' | 'stale' | 'damaged' | 'ignored', why) for one .py file under a checked folder."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return "damaged", f"a symbolic link to {os.readlink(path)}, which does not exist"
        return "damaged", "vanished while being checked"
    except OSError as exc:
        return "damaged", f"cannot read it: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return "damaged", f"not generated: {file_kind(mode)}, not a regular file"
    try:
        data = read_bounded(path)
    except PathError as exc:
        return "damaged", f"not generated: {exc}"
    except OSError as exc:
        return "damaged", f"cannot read it: {exc.strerror or exc}"
    text = data.decode("utf-8", errors="replace")
    if path.name == "__init__.py" and not text.strip():
        return "ignored", ""
    header, problem = inspect_header(text)
    if header is None:
        return "damaged", problem
    recorded = header["source"]
    source = resolve_source(recorded, path)
    if source is None:
        return "damaged", (
            f"header damaged or source gone: its source {recorded!r} is missing (no such "
            "file relative to the working directory or the file's folders)"
        )
    found = checksum_problem(text)
    if found:
        return found
    options = Options.from_header(header)
    if options.compress_config is not None:
        if resolve_source(options.compress_config, path) is None:
            return "stale", f"its compression config {options.compress_config!r} is missing"
    try:
        fresh = generate_source(source, options, label=recorded)
    except (ModelError, ValueError, ConfigError) as exc:
        return "stale", f"cannot regenerate ({getattr(exc, 'message', exc)})"
    except Exception as exc:  # noqa: BLE001 - a header the generator chokes on: one line
        return "damaged", f"header damaged: cannot regenerate ({type(exc).__name__}: {exc})"
    if fresh.encode("utf-8") != data:
        return "stale", "differs from what the generator emits now (unroll diff shows how)"
    return "ok", ""


def _map_files(function, paths: list[Path], jobs: int):
    """``map(function, paths)`` in order, over several processes when that pays: most of a
    check is black formatting each regenerated file, which is CPU-bound. Workers come from
    a fork server (a clean process, not a fork of one that may hold torch's threads), and
    each imports torch once, so a handful of files is checked in this process."""
    workers = min(jobs or os.cpu_count() or 1, len(paths))
    if workers <= 1 or (jobs == 0 and len(paths) < PARALLEL_CHECK_FROM):
        yield from map(function, paths)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        yield from pool.map(function, paths)


PARALLEL_CHECK_FROM = 8  # files; fewer are checked in-process unless --jobs says otherwise


def files_under(directory: Path) -> tuple[list[Path], list[str], list[str]]:
    """(.py files, folders that could not be listed, notes) under ``directory``;
    symbolic links to folders are not followed (noted)."""
    found: list[Path] = []
    unlisted: list[str] = []
    notes: list[str] = []

    def unreadable(exc: OSError) -> None:
        unlisted.append(f"{exc.filename}: cannot list this folder: {exc.strerror}")

    for folder, dirs, files in os.walk(directory, onerror=unreadable):
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                notes.append(
                    f"{os.path.join(folder, name)}: a symbolic link to a folder, not followed"
                )
        for name in files:
            if name.endswith(".py"):
                found.append(Path(folder, name))
        for stale in stale_temps(folder):
            notes.append(f"{stale}: left by an interrupted write; safe to delete")
    return sorted(found), unlisted, sorted(notes)


@app.command()
def check(
    directory: Annotated[
        Path, typer.Argument(help="Folder of generated files.")
    ] = DEFAULT_GENERATED,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            min=0,
            help="Processes regenerating files (0: one per CPU from 8 files on).",
        ),
    ] = 0,
) -> None:
    """Check that every generated file regenerates byte-identically from its recorded source.

    Every .py file under the folder is accounted for: up to date; stale (differs from what
    the generator emits now, edited by hand, source broken); or damaged / not generated
    (no header, a damaged or moved header, bad header fields, a missing source, not a
    regular file). Only an empty __init__.py may be there besides generated files.
    Stale temporary files of interrupted writes are listed, not counted.

    Example: unroll check generated. Exit status 1 lists the stale and damaged files.
    """
    if not directory.is_dir():
        raise fail(f"{directory} is not a folder")
    paths, unlisted, notes = files_under(directory)
    counts = {"ok": 0, "stale": 0, "damaged": len(unlisted), "ignored": 0}
    for line in unlisted:
        typer.echo(line, err=True)
    for path, (verdict, why) in zip(paths, _map_files(check_file, paths, jobs)):
        counts[verdict] += 1
        if verdict in ("stale", "damaged"):
            typer.echo(f"{path}: {why}", err=True)
    for line in notes:
        typer.echo(f"note: {line}", err=True)
    ignored = f", {counts['ignored']} empty __init__.py" if counts["ignored"] else ""
    typer.echo(
        f"{counts['ok']} up to date, {counts['stale']} stale, "
        f"{counts['damaged']} damaged/not generated "
        f"({len(paths)} .py files under {directory}{ignored})",
        err=True,
    )
    raise typer.Exit(1 if counts["stale"] or counts["damaged"] else 0)


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
        out = [format_dot(g)]
    elif fmt == "json":
        found = {**graph_report(g, batch_size), "stash": stash}
        if per_ipu is not None:
            found["ipus"] = per_ipu
        out = [json.dumps(found, indent=2)]
    else:
        out = [format_table(graph_report(g, batch_size)), ""]
        out.append(format_stash(stash, scheme if compress_config is None else str(compress_config)))
        if per_ipu is not None:
            out += ["", format_ipus(per_ipu)]
    write_stdout("".join(f"{line}\n" for line in out))


@app.command()
def lint(
    paths: Annotated[list[Path], typer.Argument(help="Generated modules or folders of them.")],
    platform: PlatformOpt = "ipu",
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
        report = lint_paths(paths, platform)
    except (FileNotFoundError, ValueError) as exc:
        raise fail(str(exc)) from None
    write_stdout(f"{report.format(verbose=verbose)}\n")
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def ops() -> None:
    """List the operators of the registry with their arguments.

    Example: unroll ops
    """
    from unroller.registry import load_registry

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
        inputs = "*inputs" if spec.variadic else ", ".join(spec.inputs)
        out.append(f"{name}({inputs}{', ' + args if args else ''})  -- {spec.doc}\n")
    write_stdout("".join(out))


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
