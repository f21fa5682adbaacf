"""``unroll check``: every generated file under a folder regenerates byte-identically.

Each ``.py`` file is accounted for: up to date, stale (differs from what the generator
emits now, edited by hand, source broken) or damaged / not generated (see
``unroller.cli.headers``). Regenerating is CPU-bound (black), so many files are checked
in worker processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from unroller.api import PathError, file_kind, generate_source, read_bounded, stale_temps
from unroller.cli.errors import fail
from unroller.cli.headers import checksum_problem, inspect_header, short
from unroller.cli.options import GENERATED
from unroller.cli.shadows import importable_kind, shadow_problem
from unroller.compiler.options import Options
from unroller.errors import ConfigError, ModelError, OptionValueError

PARALLEL_CHECK_FROM = 8  # files; fewer are checked in-process unless --jobs says otherwise


def source_roots(directory: Path) -> tuple[Path, ...]:
    """Where a header's source and compression config may lie: the working directory and
    the folder holding the checked one (the project a generated/ folder belongs to). A
    header is text anyone can write; without a bound it could make check read any file."""
    roots = (Path.cwd().resolve(), directory.resolve().parent)
    return tuple(dict.fromkeys(roots))


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    """Whether ``path``, links followed, lies inside one of ``roots``."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(root) for root in roots)


def resolve_source(
    recorded: str, generated_file: Path | None, roots: tuple[Path, ...]
) -> tuple[Path | None, bool]:
    """A recorded path as the first regular file it names, relative to the working
    directory or else an ancestor of ``generated_file`` (None: the working directory
    only, where the generator itself reads a compression config), if that file lies
    inside ``roots`` (a FIFO or device recorded there is never read); and whether it lies
    outside them (a header pointing elsewhere: damaged, whatever another base holds)."""
    try:
        candidate = Path(recorded)
        ancestors = [] if generated_file is None else list(generated_file.resolve().parents)
        bases = [Path()] if candidate.is_absolute() else [Path.cwd(), *ancestors]
        for base in bases:
            path = base / candidate
            if path.is_file():
                return (path, False) if _inside(path, roots) else (None, True)
    except (OSError, ValueError):  # a name too long, a NUL byte
        return None, False
    return None, False


def _outside(what: str, recorded: str) -> tuple[str, str]:
    return "damaged", (
        f"header damaged: its {what} {short(recorded)} lies outside the working directory "
        "and the folder holding the checked one (check reads nothing else)"
    )


def _regenerate_problem(exc: Exception, recorded: str) -> str:
    """Why regeneration failed, by position only: the message of a model or config error
    may quote the file's text, and the file is whatever a header named, so its content
    must not reach the report (a CI log)."""
    what = "compression config" if isinstance(exc, ConfigError) else f"source {short(recorded)}"
    loc = getattr(exc, "loc", None)
    where = f"an error at line {loc.line}, column {loc.col}" if loc else "an error"
    return f"cannot regenerate: its {what} has {where} (unroll generate on it shows the error)"


def check_file(path: Path, roots: tuple[Path, ...] = ()) -> tuple[str, str]:
    """('ok' | 'stale' | 'damaged' | 'ignored', why) for one .py file under a checked
    folder; its source and compression config must lie inside ``roots``
    (``source_roots``; default: the working directory)."""
    roots = roots or (Path.cwd().resolve(),)
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
    source, outside = resolve_source(recorded, path, roots)
    if outside:
        return _outside("source", recorded)
    if source is None:
        return "damaged", (
            f"header damaged or source gone: its source {short(recorded)} is missing (no such "
            "file relative to the working directory or the file's folders)"
        )
    found = checksum_problem(text)
    if found:
        return found
    try:
        options = Options.from_header(header)
    except OptionValueError as exc:
        return "damaged", f"header damaged: {exc.render('header')}"
    if options.compress_config is not None:
        config, outside = resolve_source(options.compress_config, None, roots)
        if outside:
            return _outside("compression config", options.compress_config)
        if config is None:
            return "stale", f"its compression config {short(options.compress_config)} is missing"
    try:
        fresh = generate_source(source, options, label=recorded)
    except (ModelError, ValueError, ConfigError) as exc:
        return "stale", _regenerate_problem(exc, recorded)
    except Exception as exc:  # noqa: BLE001 - a header the generator chokes on: one line
        return "damaged", f"header damaged: cannot regenerate ({type(exc).__name__})"
    if fresh.encode("utf-8") != data:
        return "stale", "differs from what the generator emits now (unroll diff shows how)"
    return "ok", ""


def _safe_path_possible() -> bool:
    """Whether the interpreters multiprocessing starts (``python -c ...``) can be kept from
    putting the working directory first on sys.path: with -I or -P given to this one, or
    through PYTHONSAFEPATH (Python 3.11 on, unless -E makes them ignore the environment)."""
    flags = sys.flags
    if flags.isolated or getattr(flags, "safe_path", False):
        return True
    return sys.version_info >= (3, 11) and not flags.ignore_environment


@contextlib.contextmanager
def _safe_path_environment() -> Iterator[None]:
    """PYTHONSAFEPATH=1 while the fork server and the resource tracker start: they run
    ``python -c``, which would otherwise import ``multiprocessing`` (and what it imports)
    from the working directory first, so a ``./multiprocessing/`` or ``./socket.py`` in
    the checked project would run. Restored afterwards (nothing else started here needs it)."""
    saved = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = saved


def _map_files(function, paths: list[Path], jobs: int):
    """``map(function, paths)`` in order, over several processes when that pays: most of a
    check is black formatting each regenerated file, which is CPU-bound. Workers come from
    a fork server (a clean process, not a fork of one that may hold torch's threads),
    started so that no code from the working directory runs (``_safe_path_environment``;
    where Python cannot promise that, everything is checked in this process), and each
    imports torch once, so a handful of files is checked in this process."""
    workers = min(jobs or os.cpu_count() or 1, len(paths))
    if (
        workers <= 1
        or (jobs == 0 and len(paths) < PARALLEL_CHECK_FROM)
        or not _safe_path_possible()
    ):
        yield from map(function, paths)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    with _safe_path_environment():
        forkserver.ensure_running()  # and the resource tracker, both ``python -c``
        pool = ProcessPoolExecutor(workers, mp_context=context)
        results = pool.map(function, paths)  # submits every file: the workers start here
    with pool:
        yield from results


def files_under(directory: Path) -> tuple[list[Path], list[str], list[str], int]:
    """(.py files, problem lines, notes, how many importable non-.py files) under
    ``directory``. Problem lines are folders that could not be listed and byte code or
    extension modules outside ``__pycache__`` (modules import can load that unroller never
    writes); symbolic links to folders are not followed (noted)."""
    found: list[Path] = []
    problems: list[str] = []
    notes: list[str] = []
    others = 0

    def unreadable(exc: OSError) -> None:
        problems.append(f"{exc.filename}: cannot list this folder: {exc.strerror}")

    for folder, dirs, files in os.walk(directory, onerror=unreadable):
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                notes.append(
                    f"{os.path.join(folder, name)}: a symbolic link to a folder, not followed"
                )
        in_cache = os.path.basename(folder) == "__pycache__"
        for name in sorted(files):
            kind = None if in_cache else importable_kind(name)
            if name.endswith(".py"):
                found.append(Path(folder, name))
            elif kind:
                others += 1
                problems.append(
                    f"{Path(folder, name)}: not generated: {kind} that import can load "
                    "(unroller writes only .py files)"
                )
        for stale in stale_temps(folder):
            notes.append(f"{stale}: left by an interrupted write; safe to delete")
    return sorted(found), problems, sorted(notes), others


def _with_shadow(path: Path, verdict: str, why: str) -> tuple[str, str]:
    """The verdict, made 'damaged' when import would load something else than ``path``."""
    if verdict == "ignored" and path.name == "__init__.py":
        return verdict, why
    shadow = shadow_problem(path)
    if shadow is None:
        return verdict, why
    return "damaged", shadow + (f"; and {why}" if why else "")


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
    paths, problems, notes, others = files_under(directory)
    counts = {"ok": 0, "stale": 0, "damaged": len(problems), "ignored": 0}
    for line in problems:
        typer.echo(line, err=True)
    checker = functools.partial(check_file, roots=source_roots(directory))
    for path, (verdict, why) in zip(paths, _map_files(checker, paths, jobs)):
        verdict, why = _with_shadow(path, verdict, why)
        counts[verdict] += 1
        if verdict in ("stale", "damaged"):
            typer.echo(f"{path}: {why}", err=True)
    for line in notes:
        typer.echo(f"note: {line}", err=True)
    ignored = f", {counts['ignored']} empty __init__.py" if counts["ignored"] else ""
    ignored += f", {others} importable non-.py files" if others else ""
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
