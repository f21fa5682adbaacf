"""Writing a command's result to standard output without a traceback when that fails.

A full device or a closed pipe is a user-visible condition, not a crash: one line and
status 2 (no line when the reader went away, as ``head`` expects).
"""

from __future__ import annotations

import errno
import io
import os
import sys

import typer

from unroller.cli.errors import USER_ERROR, fail


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
            raise typer.Exit(USER_ERROR) from None
        raise fail(f"cannot write to standard output: {exc.strerror or exc}") from None
