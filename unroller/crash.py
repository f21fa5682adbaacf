"""An internal error (a bug in unroller) as one line, with its traceback in a log file.

Every ``unroll`` command and the benchmark harness end an exception they did not expect
in one line on standard error::

    unroll: internal error: KeyError: 1234 (a bug in unroller; rerun with --debug for the
    traceback, or see /tmp/unroller-4242-crash-k2j1x.log)

and exit status ``INTERNAL_ERROR``, distinct from a refused input (2) and from a command's
own "differs" / "fails" (1). The log file (in the temporary folder, made afresh with
``tempfile.mkstemp``: private to the user, never an existing file or link) holds the
command and the full traceback. ``--debug`` (the ``unroll`` root option) or the
environment variable ``UNROLL_DEBUG=1`` let the exception through instead, traceback and
all. ``KeyboardInterrupt`` and ``SystemExit`` are not errors and are never caught here.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

from unroller.compiler import safe

#: Exit status of an internal error (``EX_SOFTWARE`` of sysexits.h).
INTERNAL_ERROR = 70

#: Set to 1 (or any value but 0 and empty) to see internal errors' tracebacks.
DEBUG_ENV = "UNROLL_DEBUG"

#: The longest exception message the one line shows (the log holds all of it).
SHOWN_MESSAGE = 300

_debug = False


def set_debug(on: bool) -> None:
    """``unroll --debug``: let internal errors through with their traceback."""
    global _debug
    _debug = bool(on)


def debugging() -> bool:
    """Whether internal errors keep their traceback (``--debug`` or ``UNROLL_DEBUG``)."""
    return _debug or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def printable(text: object, limit: int = SHOWN_MESSAGE) -> str:
    """``text`` on one line: every line break, escape or other non-printable character
    written as an escape (``safe.comment_text``), cut to ``limit`` characters."""
    shown = str(safe.comment_text(text))
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def describe(exc: BaseException) -> str:
    """``KeyError: 1234``: the exception's type and message, printable, on one line."""
    message = str(exc)
    name = type(exc).__qualname__
    return printable(f"{name}: {message}" if message else name)


def write_log(exc: BaseException, command: str) -> Path | None:
    """A new file in the temporary folder with the command and ``exc``'s traceback; None
    when none can be written (the line then points at --debug only)."""
    from unroller import __version__

    text = (
        f"unroller {__version__}, Python {sys.version.split()[0]}\n"
        f"command: {printable(command, 4000)}\n\n"
        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    try:
        fd, name = tempfile.mkstemp(prefix=f"unroller-{os.getpid()}-crash-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as log:
            log.write(text)
    except (OSError, ValueError):
        return None
    return Path(name)


def crash_line(
    exc: BaseException, command: str, prog: str = "unroll", rerun: str = "--debug"
) -> str:
    """The one line for an internal error ``exc`` of ``command``; writes its log.
    ``rerun``: what shows the traceback (``--debug``, or ``UNROLL_DEBUG=1`` where the
    command line has no such flag)."""
    log = write_log(exc, command)
    where = f", or see {printable(log, 4000)}" if log is not None else ""
    return (
        f"{prog}: internal error: {describe(exc)} (a bug in unroller; rerun with {rerun} "
        f"for the traceback{where})"
    )


def report(exc: BaseException, command: str, prog: str = "unroll", rerun: str = "--debug") -> int:
    """Print ``crash_line`` on standard error; the exit status to end with."""
    print(crash_line(exc, command, prog, rerun), file=sys.stderr, flush=True)
    return INTERNAL_ERROR
