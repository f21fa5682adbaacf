"""Files, read and written safely, for every command and module that touches one.

``read_bounded`` reads a regular file only, at most a limit, and never blocks on a FIFO or
reads a device; it raises ``NotRegularFile`` or ``FileTooLarge`` (both ``PathError``), which
carry what each caller needs to word the refusal its own way. ``file_kind`` names a stat
mode for those messages. ``output_target`` says where a write to a path lands (the path
itself, or the regular file a symbolic link points to) and refuses folders, FIFOs, devices,
sockets and dangling links; ``write_atomic`` replaces an output file only once the new
text is complete; ``stale_temps`` finds the temporary files (``.NAME.unroller-tmp-PID-
RANDOM``) an interrupted write left behind. (A generated module is written and imported
by ``unroller.materialize``, through ``write_atomic``.)
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from pathlib import Path

MAX_READ_BYTES = 64 * 1024 * 1024  # the most read from a model, config or existing output file
TEMP_MARK = ".unroller-tmp-"  # write_atomic's temporary files: .NAME.unroller-tmp-PID-RANDOM
STALE_TEMP_SECONDS = 600  # a temporary file this old (or its writer gone) is stale


class PathError(OSError):
    """A path that is not what it must be (a folder, FIFO, device, dangling link, too big)."""


class NotRegularFile(PathError):
    """``read_bounded`` refused a folder, FIFO, device or socket: ``mode`` is what it is,
    ``opened`` whether it was found so only once opened (swapped in after the check)."""

    def __init__(self, message: str, mode: int, opened: bool):
        super().__init__(message)
        self.mode, self.opened = mode, opened


class FileTooLarge(PathError):
    """``read_bounded`` refused a file over ``limit`` bytes: ``size`` is its size when its
    stat said so (None when found by reading past the limit: a file that grew)."""

    def __init__(self, message: str, size: int | None, limit: int):
        super().__init__(message)
        self.size, self.limit = size, limit


_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)
#: the model file's older words (its messages are part of the language's error texts)
_MODEL_WORDS = {"a folder": "a directory", "a character device": "a device"}
_MODEL_WORDS["a block device"] = "a device"


def file_kind(mode: int, model_words: bool = False) -> str:
    """What a stat mode is, for messages: 'a folder', 'a named pipe (FIFO)', ...;
    ``model_words``: as the model file's messages say it ('a directory', 'a device')."""
    name = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return _MODEL_WORDS.get(name, name) if model_words else name


READ_CHUNK = 1 << 20


def size_text(nbytes: int) -> str:
    """A byte limit for a message: MiB when it is at least one, bytes otherwise."""
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def read_limited(handle, limit: int, what: str, size_hint: int | None = None) -> bytes:
    """At most ``limit`` bytes from a binary stream; FileTooLarge beyond that. Never asks the
    stream for more than it is expected to hold (``size_hint``, the file's size) plus a
    chunk at a time: ``read(n)`` reserves n bytes before reading, so ``read(limit + 1)``
    with a 16 GiB limit fails on a small machine whatever the file's size."""
    first = READ_CHUNK if size_hint is None else size_hint + 1
    chunks = [handle.read(min(limit + 1, first))]
    total = len(chunks[0])
    while total <= limit and chunks[-1]:
        chunks.append(handle.read(min(limit + 1 - total, READ_CHUNK)))
        total += len(chunks[-1])
    if total > limit:
        raise FileTooLarge(f"{what} is larger than {size_text(limit)}", None, limit)
    data = [chunk for chunk in chunks if chunk]
    return data[0] if len(data) == 1 else b"".join(data)  # one file-sized copy at most


def read_bounded(
    path: str | Path,
    limit: int = MAX_READ_BYTES,
    what: str | None = None,
    *,
    follow_links: bool = True,
) -> bytes:
    """The bytes of the regular file at ``path`` (a symbolic link is followed), at most
    ``limit`` of them. Anything else (folder, FIFO, device, socket, a bigger file) raises
    ``NotRegularFile`` or ``FileTooLarge`` without being read: a FIFO never blocks,
    /dev/zero is never read. Their messages name the file as ``what`` (default: the path);
    a caller with words of its own rewords them from the exceptions' fields. Other OSErrors
    (a missing file, no permission) pass through as they are. ``follow_links=False``: a
    symbolic link is refused as ``NotRegularFile`` (checked with ``lstat``, and opened with
    ``O_NOFOLLOW`` should one be swapped in after the check), for folders whose files must
    be the files themselves (the cache of generated code)."""
    path = Path(path)
    what = str(path) if what is None else what
    _check_readable(what, os.stat(path) if follow_links else os.lstat(path), limit, opened=False)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_links and os.path.islink(path):  # ELOOP: a link swapped in
            raise NotRegularFile(
                f"{what} is a symbolic link, not a regular file", stat.S_IFLNK, True
            ) from exc
        raise
    with os.fdopen(fd, "rb") as handle:
        # the file opened, should it have changed meanwhile
        info = os.fstat(fd)
        _check_readable(what, info, limit, opened=True)
        return read_limited(handle, limit, what, info.st_size)


def _check_readable(what: str, info: os.stat_result, limit: int, opened: bool) -> None:
    """Refuse a non-regular file, or one whose size already says it is too big (so a
    sparse many-gigabyte file is refused without reading ``limit`` bytes of it)."""
    if not stat.S_ISREG(info.st_mode):
        message = f"{what} is {file_kind(info.st_mode)}, not a regular file"
        raise NotRegularFile(message, info.st_mode, opened)
    if info.st_size > limit:
        raise FileTooLarge(f"{what} is larger than {size_text(limit)}", info.st_size, limit)


UNSAFE_FOLDER = "is writable by others or not ours"
"""How a folder that code is run from is refused (the generated-code and native-kernel
caches say it in the same words: ``private_folder_problem``)."""


def private_folder_problem(path: str | Path, what: str = "cache folder") -> str | None:
    """Why ``path`` may not hold code this process runs (a cached module it imports, a
    library it loads), or None when it may: it must be a folder (a link to one is
    followed: ``~/.cache`` on another disk is common) owned by this user that neither group
    nor others can write, and no folder above it may be writable by others without the
    sticky bit (whoever can rename our folder away could put theirs in its place). The
    words are shared, so both caches refuse alike: ``WHAT PATH is writable by others or
    not ours``."""
    message = f"{what} {path} {UNSAFE_FOLDER}"
    try:
        info = os.stat(path)
    except OSError:
        return message
    uid = os.getuid() if hasattr(os, "getuid") else None
    if not stat.S_ISDIR(info.st_mode) or (uid is not None and info.st_uid != uid):
        return message
    if info.st_mode & 0o022:
        return message
    for above in Path(os.path.realpath(path)).parents:
        try:
            mode = os.stat(above).st_mode
        except OSError:
            return message
        if mode & 0o022 and not mode & stat.S_ISVTX:
            return f"{message} ({above} above it is writable by others)"
    return None


def check_private_folder(path: str | Path, what: str = "cache folder") -> None:
    """Raise ``PathError`` with ``private_folder_problem``'s words unless ``path`` may hold
    code this process runs."""
    problem = private_folder_problem(path, what)
    if problem is not None:
        raise PathError(problem)


def output_target(path: str | Path) -> Path:
    """Where a write to ``path`` lands: ``path`` itself (existing or not), or, for a
    symbolic link, the regular file it finally points to (so the link survives the write).
    PathError for a folder, FIFO, device, socket, a dangling link or a link loop."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # new (or its folder is not a folder)
        return path
    if stat.S_ISLNK(mode):
        real = Path(os.path.realpath(path))
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise PathError(
                f"{path} is a symbolic link to {real}, which does not exist "
                "(a link is followed only to an existing regular file)"
            ) from None
        except OSError as exc:
            raise PathError(
                f"{path} is a symbolic link that cannot be followed ({exc.strerror})"
            ) from None
        if stat.S_ISDIR(mode):
            raise PathError(f"{path} is a symbolic link to the folder {real}")
        if not stat.S_ISREG(mode):
            raise PathError(
                f"{path} is a symbolic link to {real}, which is {file_kind(mode)}, "
                "not a regular file"
            )
        return real
    if stat.S_ISDIR(mode):
        raise PathError(f"{path} is a folder")
    if not stat.S_ISREG(mode):
        raise PathError(f"{path} is {file_kind(mode)}, not a regular file")
    return path


def unlinked_target(path: str | Path) -> Path:
    """``output_target`` for a place where links are never followed: a symbolic link at
    ``path`` raises PathError; anything else is checked as ``output_target`` checks it."""
    path = Path(path)
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return path
    if is_link:
        raise PathError(f"{path} is a symbolic link, which is not followed here")
    return output_target(path)


def temp_path(target: Path) -> Path:
    """A fresh, recognisable temporary name beside ``target``."""
    return target.with_name(f".{target.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


_TEMP_RE = re.compile(r"^\.(?P<name>.+?)(?:" + re.escape(TEMP_MARK) + r"(?P<pid>\d+)-[0-9a-f]+)$")


def _running_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # someone else's process, or unknowable
        return True
    return True


def stale_temps(
    directory: str | Path, name: str | None = None, max_age: float = STALE_TEMP_SECONDS
) -> list[Path]:
    """write_atomic's temporary files in ``directory`` (for the target ``name``, or any)
    left behind by an interrupted write: older than ``max_age`` seconds, or written by a
    process no longer running on this machine more than a minute ago."""
    found = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = _TEMP_RE.match(entry.name)
        if not match or (name is not None and match["name"] != name):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        age = now - info.st_mtime
        pid = int(match["pid"])
        gone = pid != os.getpid() and not _running_here(pid) and age > 60
        if age > max_age or gone:
            found.append(Path(directory) / entry.name)
    return sorted(found)


def write_atomic(
    path: str | Path, text: str | bytes, *, parents: bool = True, follow_links: bool = True
) -> Path:
    """Write ``text`` (UTF-8, ``\\n`` line ends) or bytes to ``path`` through a temporary
    file and a rename, so a reader or a crash never sees half a file; returns the file
    written.

    A symbolic link is followed to the existing regular file it points to, which is
    replaced (the link stays a link); a folder, FIFO, device, socket or dangling link
    raises PathError and nothing is written. ``parents=False``: a missing folder is an
    error (FileNotFoundError) instead of being created. The temporary file,
    ``.NAME.unroller-tmp-PID-RANDOM`` beside the target, is removed on any failure,
    KeyboardInterrupt included; the new file keeps the mode of the one it replaces.
    ``follow_links=False``: a symbolic link at ``path`` is refused (PathError) instead of
    followed (inside a run folder a link could point anywhere)."""
    target = output_target(path) if follow_links else unlinked_target(path)
    if parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8") if isinstance(text, str) else text
    tmp = temp_path(target)
    done = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        with os.fdopen(fd, "wb") as handle:
            try:
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
            except FileNotFoundError:
                pass
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):  # swapped for a FIFO, link or folder meanwhile
            raise PathError(f"{target} is no longer a regular file")
        os.replace(tmp, target)
        done = True
    finally:
        if not done:
            tmp.unlink(missing_ok=True)
    _sync_folder(target.parent)
    return target


def _sync_folder(folder: Path) -> None:
    """Make the rename durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def source_label(path: str | Path) -> str:
    """How a generated file names its source: relative to the working directory if inside it."""
    resolved, cwd = Path(path).resolve(), Path.cwd().resolve()
    if resolved.is_relative_to(cwd):
        return resolved.relative_to(cwd).as_posix()
    return resolved.as_posix()
