"""Run folders: where ``unroll train`` writes, and what it refuses to touch there.

A run folder holds one training run: ``model.py`` (the generated module),
``metrics.jsonl``, ``run.json``, ``checkpoint.pt`` and the marker ``.unroller-run``,
written first, which says that unroller made the folder. ``unroll train -o DIR`` writes
only into a folder that is new, empty, or marked (a run it made before, which a resume
continues); any other folder may hold the user's own ``model.py`` or ``metrics.jsonl``,
so it is refused unless ``--force``. A folder made before the marker existed is accepted
when the run resumes from the verified checkpoint inside it.

Symbolic links are never followed inside a run folder, ``--force`` or not: a run file
that is a link (or a folder, FIFO, device, socket) is refused before anything is
written, and every write replaces a regular file through a temporary file and a rename
(``api.write_atomic(..., follow_links=False)``). The folder given as ``-o`` may itself be
a link to a folder: that is the user's own path. Every refusal and every failed write
(a full disk, a read-only folder) is one ``RunFolderError`` line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from unroller.api import PathError, file_kind, read_bounded, write_atomic
from unroller.errors import ConfigError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
RUN_INFO = "run.json"
GENERATED = "model.py"
MARKER = ".unroller-run"
MARKER_TEXT = (
    "unroller run folder: `unroll train` writes model.py, metrics.jsonl, run.json and "
    "checkpoint.pt here\n"
)
RUN_FILES = (MARKER, GENERATED, METRICS, RUN_INFO, CHECKPOINT)
"""Every file ``train`` writes in a run folder."""


class TrainError(ConfigError):
    """A training run that cannot start or continue (printed as is, exit 2)."""


class RunFolderError(TrainError):
    """A run folder that cannot be used or written."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def check_run_folder(out: Path, *, force: bool = False, ours: bool = False) -> None:
    """Refuse, before anything is written, a run folder ``train`` must not write into:
    not a folder, a run file that is a link or not a regular file, or (unless ``force``
    or ``ours``: the caller knows the folder is a run's) a non-empty folder without the
    marker."""
    try:
        info = os.stat(out)  # -o itself may be a link to a folder: the user's own path
    except FileNotFoundError:
        if os.path.islink(out):
            raise RunFolderError(
                f"--out {out} is a symbolic link to {os.path.realpath(out)}, which does not exist"
            ) from None
        return  # a new folder
    except NotADirectoryError:
        raise RunFolderError(f"--out {out}: a part of the path is not a folder") from None
    except OSError as exc:
        raise RunFolderError(
            f"--out {out}: cannot use it as the run folder ({_reason(exc)})"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise RunFolderError(
            f"--out {out} is {file_kind(info.st_mode)}, not a folder; give the run folder's path"
        )
    for name in RUN_FILES:
        check_run_file(out / name)
    if force or ours or is_marked(out):
        return
    if _has_entries(out):
        raise RunFolderError(
            f"--out {out} is not empty and is not a run folder unroller made (it has no "
            f"{MARKER}); choose a new or empty folder, or --force to write into it"
        )


def check_run_file(path: Path) -> None:
    """Refuse a run file that is a symbolic link, a folder, a FIFO, a device or a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunFolderError(f"{path}: cannot use it ({_reason(exc)})") from None
    if stat.S_ISLNK(mode):
        raise RunFolderError(
            f"{path} is a symbolic link; unroll train never follows links inside a run "
            "folder (remove it)"
        )
    if not stat.S_ISREG(mode):
        raise RunFolderError(f"{path} is {file_kind(mode)}, not a regular file (remove it)")


def is_marked(out: Path) -> bool:
    """Whether ``out`` holds unroller's marker (a regular file, not a link, that says so)."""
    marker = out / MARKER
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        return read_bounded(marker, 4096).startswith(MARKER_TEXT.encode("utf-8"))
    except OSError:
        return False


def _has_entries(out: Path) -> bool:
    try:
        with os.scandir(out) as entries:
            return next(entries, None) is not None  # one is enough: never lists a huge folder
    except OSError as exc:
        raise RunFolderError(f"--out {out}: cannot list the folder ({_reason(exc)})") from None


def claim_run_folder(out: Path) -> None:
    """Create ``out`` if needed and mark it as a run folder, before any other run file."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFolderError(f"--out {out}: cannot create the folder ({_reason(exc)})") from None
    if not is_marked(out):
        write_run_file(out / MARKER, MARKER_TEXT)


def write_run_file(path: Path, data: str | bytes) -> None:
    """Replace the run file ``path`` atomically, never through a link; RunFolderError
    (one line) if it cannot be written, the previous file then intact."""
    try:
        write_atomic(path, data, parents=False, follow_links=False)
    except PathError as exc:
        raise RunFolderError(str(exc)) from None
    except OSError as exc:
        raise RunFolderError(f"cannot write {path}: {_reason(exc)}") from None


def read_run_file(path: Path) -> bytes | None:
    """The bytes of a run file (bounded, a regular file, not a link); None if absent."""
    check_run_file(path)
    try:
        return read_bounded(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunFolderError(f"cannot read {path}: {_reason(exc)}") from None
