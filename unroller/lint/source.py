"""Reading a module's source, bounded and safely: only regular files (a FIFO or device is
never opened for reading), at most ``MAX_SOURCE_BYTES``, decoded as Python decodes source.
What cannot be read is an ``_Unreadable`` with the reason, reported as a lint error."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from unroller.files import FileTooLarge, NotRegularFile, read_bounded

MAX_SOURCE_BYTES = 16 * 1024 * 1024  # the most lint reads of one module


class _Unreadable(Exception):
    """A file lint does not read, and why."""


def _read_source(path: Path, limit: int | None = None) -> str:
    """The text of the regular file at ``path`` (a link is followed), at most ``limit``
    bytes (default MAX_SOURCE_BYTES), decoded as Python decodes source (a BOM or coding
    declaration, else UTF-8). A FIFO or device is never opened for reading."""
    limit = MAX_SOURCE_BYTES if limit is None else limit
    try:
        data = read_bounded(path, limit, "it")
    except NotRegularFile as exc:
        raise _Unreadable(str(exc)) from None  # "it is a folder, not a regular file"
    except FileTooLarge:
        size = f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit} bytes"
        raise _Unreadable(f"it is larger than {size}, the most lint reads of one module") from None
    except OSError as exc:
        raise _Unreadable(f"it cannot be read ({exc.strerror or exc})") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except SyntaxError as exc:  # detect_encoding: undecodable first lines, a bad declaration
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise _Unreadable(_not_text(bad)) from None
        raise _Unreadable(f"its encoding declaration is not valid ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise _Unreadable(_not_text(exc)) from None


def _not_text(exc: UnicodeDecodeError) -> str:
    return (
        f"it is not {exc.encoding} text (byte {exc.start}: {exc.reason}); Python source is "
        "UTF-8 unless it declares another encoding"
    )
