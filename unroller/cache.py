"""The on-disk cache: where it lies, which folders may hold it, and how big it grows.

Two kinds of things are cached, both code this process runs: one-shot
``unroller.unroll``'s generated modules (``generated/LABEL_DIGEST.py``, imported by
``unroller.materialize``) and the native codec kernels (``native/kernels-KEY.so``, loaded
by ``unroller.compress.native``). So the cache is trusted only as far as its folder is:
a folder others can write to, or owned by another user, is refused
(``files.private_folder_problem``, the same words for both); an entry is only ever a
regular file (a link, FIFO or folder in its place is refused, never followed or opened
blocking); and the generated folder is bounded (``limits``): each new entry evicts the
least recently used ones beyond ``UNROLLER_CACHE_MAX_ENTRIES`` files or
``UNROLLER_CACHE_MAX_MB`` MiB. ``unroll cache info`` / ``clean`` show and empty it.

Root: ``$UNROLLER_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/unroller``, else
``~/.cache/unroller`` (``oneshot.cache_dir()`` is its ``generated`` folder).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from unroller.files import (
    PathError,
    check_private_folder,
    file_kind,
    private_folder_problem,
    stale_temps,
)

MAX_ENTRIES = 256
"""Default bound on the generated modules kept (``UNROLLER_CACHE_MAX_ENTRIES``)."""
MAX_MB = 256
"""Default bound on their total size in MiB (``UNROLLER_CACHE_MAX_MB``)."""
ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*_[0-9a-f]{20}\.py$")
"""A generated cache entry's name: ``LABEL_DIGEST.py`` (``materialize.DIGEST_CHARS``)."""
LIBRARY = re.compile(r"^kernels-[0-9a-f]{24}\.so$")
"""A native kernel library's name (``native._key``)."""
BYTECODE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*_[0-9a-f]{20})\.[A-Za-z0-9_-]+\.pyc$")
"""Byte code an older unroller let Python write for an entry (``__pycache__``): never read
now, removed with its entry."""


def root() -> Path:
    """The cache's root folder (see the module docstring)."""
    env = os.environ.get("UNROLLER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "unroller"


def generated_dir() -> Path:
    """Where one-shot generated modules are kept."""
    return root() / "generated"


def native_dir() -> Path:
    """Where the native kernel libraries are kept."""
    return root() / "native"


def is_generated_dir(folder: str | Path) -> bool:
    """Whether ``folder`` is the generated cache (links resolved on both sides), so that a
    caller passing the cache folder gets the cache's rules without saying so."""
    try:
        return os.path.realpath(folder) == os.path.realpath(generated_dir())
    except (OSError, ValueError):
        return False


def prepare(folder: str | Path) -> Path:
    """``folder`` made if missing (readable by this user only) and checked to be ours and
    private; PathError (``... is writable by others or not ours``) if not."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private_folder(folder)
    return folder


def limits() -> tuple[int, int]:
    """The bounds on the generated cache: entries and bytes (from the environment, else
    ``MAX_ENTRIES`` and ``MAX_MB``); ValueError for a value that is not a whole number
    of at least 1."""
    found = []
    for name, default in (
        ("UNROLLER_CACHE_MAX_ENTRIES", MAX_ENTRIES),
        ("UNROLLER_CACHE_MAX_MB", MAX_MB),
    ):
        text = os.environ.get(name, "").strip()
        if not text:
            found.append(default)
            continue
        if not text.isdigit() or int(text) < 1 or len(text) > 12:
            raise ValueError(f"{name}={text!r}: expected a whole number of at least 1")
        found.append(int(text))
    return found[0], found[1] * 2**20


@dataclass(frozen=True)
class Entry:
    """A cache entry as ``lstat`` found it: a regular file with an entry's name."""

    path: Path
    size: int
    mtime_ns: int


def scan(folder: str | Path, pattern: re.Pattern[str] = ENTRY) -> tuple[list[Entry], list[str]]:
    """The entries in ``folder`` (regular files whose names match ``pattern``, links never
    followed), and one line for each thing that has an entry's name but is no regular
    file (a link, FIFO or folder planted there: never touched)."""
    entries: list[Entry] = []
    others: list[str] = []
    try:
        listing = list(os.scandir(folder))
    except FileNotFoundError:
        return [], []
    for item in listing:
        if not pattern.match(item.name):
            continue
        try:
            info = item.stat(follow_symlinks=False)
        except OSError:
            continue
        path = Path(folder) / item.name
        if stat.S_ISREG(info.st_mode):
            entries.append(Entry(path, info.st_size, info.st_mtime_ns))
        else:
            others.append(f"{path}: {file_kind(info.st_mode)}, not a cache entry (left alone)")
    return entries, others


def touch(path: Path) -> None:
    """Mark a cache hit as recently used (its time stamp, never through a link)."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:  # another user's file (refused elsewhere) or a read-only disk
        pass


def evict(folder: str | Path, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used entries of ``folder`` beyond ``limits()``, never
    ``keep`` (the entry just written or read); returns what was removed. Only regular
    files with an entry's name are removed (``os.unlink`` removes a name, never what a
    link points to), with their stale byte code, if any."""
    max_entries, max_bytes = limits()
    entries, _ = scan(folder)
    entries.sort(key=lambda e: (e.path != keep, -e.mtime_ns))  # keep first, then newest
    removed = []
    count = total = 0
    for entry in entries:
        count, total = count + 1, total + entry.size
        if entry.path != keep and (count > max_entries or total > max_bytes):
            remove(entry.path)
            removed.append(entry.path)
            count, total = count - 1, total - entry.size
    return removed


def remove(path: Path) -> None:
    """Remove one entry and the byte code an older unroller left for it."""
    path.unlink(missing_ok=True)
    pycache = path.parent / "__pycache__"
    for item, _ in _bytecode(pycache):
        if item.name.startswith(path.stem + "."):
            item.unlink(missing_ok=True)


def _bytecode(pycache: Path) -> list[tuple[Path, int]]:
    """Regular ``.pyc`` files of entries in ``pycache`` with their sizes."""
    found = []
    try:
        listing = list(os.scandir(pycache))
    except OSError:
        return []
    for item in listing:
        if not BYTECODE.match(item.name):
            continue
        try:
            info = item.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.append((pycache / item.name, info.st_size))
    return found


@dataclass
class Cleaned:
    """What ``clean`` did: files removed, bytes freed, things left alone (one line each)."""

    removed: int = 0
    freed: int = 0
    left: list[str] | None = None


def clean(folder: str | Path, pattern: re.Pattern[str] = ENTRY) -> Cleaned:
    """Remove every entry of ``folder`` (names matching ``pattern``, regular files only),
    the byte code and the stale temporary files of interrupted writes left beside them,
    and an emptied ``__pycache__``; anything else is left alone, and whatever has an
    entry's name without being a regular file is listed. PathError for a folder that is
    not ours (``prepare``'s words)."""
    folder = Path(folder)
    done = Cleaned(left=[])
    if not folder.exists():
        return done
    check_private_folder(folder)
    entries, others = scan(folder, pattern)
    done.left = others
    for entry in entries:
        entry.path.unlink(missing_ok=True)
        done.removed, done.freed = done.removed + 1, done.freed + entry.size
    pycache = folder / "__pycache__"
    for path, size in _bytecode(pycache):
        path.unlink(missing_ok=True)
        done.removed, done.freed = done.removed + 1, done.freed + size
    for path in stale_temps(folder):
        if pattern.match(path.name[1:].split(".unroller-tmp-")[0]):
            path.unlink(missing_ok=True)
            done.removed += 1
    try:
        if not os.path.islink(pycache):
            pycache.rmdir()  # only when empty
    except OSError:
        pass
    return done


def usage(folder: str | Path, pattern: re.Pattern[str] = ENTRY) -> tuple[int, int, str | None]:
    """How many entries ``folder`` holds, their total size, and why the folder would be
    refused (None: it would not, or it does not exist yet)."""
    folder = Path(folder)
    if not folder.exists():
        return 0, 0, None
    entries, _ = scan(folder, pattern)
    return len(entries), sum(e.size for e in entries), private_folder_problem(folder)


__all__ = [
    "ENTRY",
    "LIBRARY",
    "MAX_ENTRIES",
    "MAX_MB",
    "Cleaned",
    "Entry",
    "PathError",
    "clean",
    "evict",
    "generated_dir",
    "is_generated_dir",
    "limits",
    "native_dir",
    "prepare",
    "remove",
    "root",
    "scan",
    "touch",
    "usage",
]
