"""``unroll check``: every generated file under a folder regenerates byte-identically.

Each ``.py`` file is accounted for: up to date, stale (differs from what the generator
emits now, edited by hand, source broken) or damaged / not generated (see
``unroller.cli.headers``). Regenerating is CPU-bound (black), so many files are checked
in worker processes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated

import typer

from unroller.api import PathError, file_kind, generate_source, read_bounded, stale_temps
from unroller.cli.errors import fail
from unroller.cli.headers import checksum_problem, inspect_header
from unroller.cli.options import GENERATED
from unroller.codegen import Options
from unroller.errors import ConfigError, ModelError

PARALLEL_CHECK_FROM = 8  # files; fewer are checked in-process unless --jobs says otherwise


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


def check(
    directory: Annotated[Path, typer.Argument(help="Folder of generated files.")] = GENERATED,
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


def register(app: typer.Typer) -> None:
    """Add check to ``app``."""
    app.command()(check)
