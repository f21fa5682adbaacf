"""How every command reports a user error: one line, or ``FILE:LINE:COL`` with a caret.

A user error is never a traceback: commands raise what these helpers return (a
``typer.Exit``, status 2 unless said otherwise) after the message is on standard error.
Model-file and config-file errors keep the compiler-like ``FILE:LINE:COL: error: ...``
form, with the source line and a caret, so editors can jump to them. Nor is an internal
error (an exception no command expects, a bug): ``internal_errors`` makes it one
``unroll: internal error:`` line naming a log file with the traceback (``unroller.crash``),
status 70, unless ``--debug``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import typer

from unroller import crash
from unroller.errors import ConfigError, ConfigFileError, ModelError, OptionValueError

USER_ERROR = 2  # exit status of every refused command line or input file


def fail(message: str, code: int = USER_ERROR) -> typer.Exit:
    """``unroll: error: MESSAGE`` on standard error; raise the result."""
    typer.echo(f"unroll: error: {message}", err=True)
    return typer.Exit(code)


def shown_path(path: object) -> str:
    """A path for a one-line message: as is, or ``ascii()``'d when it holds a line break,
    an escape or another non-printable character (the message must stay one line)."""
    text = str(path)
    return text if text.isprintable() else ascii(text)


def path_error(exc: OSError) -> typer.Exit:
    """An operating-system error about a path the user gave (a name too long, a link loop,
    permission denied, a file system full), as one line instead of a traceback."""
    names = [shown_path(n) for n in (exc.filename, exc.filename2) if n is not None]
    reason = (exc.strerror or type(exc).__name__).rstrip(".")
    return fail(f"{' -> '.join(names)}: {reason[:1].lower()}{reason[1:]}")


Command = TypeVar("Command", bound=Callable[..., Any])


def path_errors(command: Command) -> Command:
    """Wrap a command so that any ``OSError`` naming a file that escapes it ends in one
    ``unroll: error: PATH: reason`` line (status 2): commands check the paths they expect
    to be bad, but every ``open``, ``stat`` or ``mkdir`` of a user path can also fail in
    ways no command lists (ENAMETOOLONG, ELOOP, EACCES, ENOSPC), and those must not be
    tracebacks; nor may a ``PathError`` (a link where none is followed, a FIFO) that a
    command did not expect. Errors that name no file are left alone: they are not the
    user's input."""

    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except OSError as exc:
            from unroller.api import PathError

            if isinstance(exc, PathError):  # the project's own refusal: it names the path
                raise fail(shown_path(exc)) from None
            if exc.filename is None:
                raise
            raise path_error(exc) from None

    return guarded  # type: ignore[return-value]


#: What a command raises on purpose, through to typer (and click, whichever one parses).
PASSED: tuple[type[BaseException], ...] = (
    typer.Exit,
    typer.Abort,
    typer.exceptions.TyperException,
    click.exceptions.Exit,
    click.exceptions.Abort,
    click.ClickException,
)


def _command_line(name: str, params: dict[str, Any]) -> str:
    """What the crash log records of the command: its name and parameter values."""
    shown = " ".join(f"{key}={value!r}" for key, value in params.items())
    return f"unroll {name.replace('_', '-')} {shown}".rstrip()


def internal_errors(command: Command) -> Command:
    """Wrap a command so that an exception it does not expect (a bug: a ``KeyError``
    deep in the generator) ends in one ``unroll: internal error: ...`` line naming the
    exception, ``--debug`` and a log file with the traceback, status
    ``crash.INTERNAL_ERROR``; with ``--debug`` or ``UNROLL_DEBUG=1`` it goes through.
    click's own exits and aborts, ``KeyboardInterrupt`` and ``SystemExit`` pass."""

    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except PASSED:
            raise
        except Exception as exc:
            if crash.debugging():
                raise
            name = getattr(command, "__name__", "command")
            raise typer.Exit(crash.report(exc, _command_line(name, kwargs))) from None

    return guarded  # type: ignore[return-value]


def fail_plain(message: str) -> typer.Exit:
    """A message that is already formatted (``FILE:LINE:COL: error: ...``), printed as is."""
    typer.echo(message, err=True)
    return typer.Exit(USER_ERROR)


def config_error(exc: ConfigError) -> typer.Exit:
    """A config file's error is already ``FILE:LINE:COL: error: ...``; any other is one
    line, an option refused by ``Options`` naming the flags as typed."""
    if isinstance(exc, ConfigFileError):
        return fail_plain(str(exc))
    return fail(exc.render("cli") if isinstance(exc, OptionValueError) else str(exc))


def model_error(exc: ModelError, path: str | Path) -> typer.Exit:
    """``FILE:LINE:COL: error: ...`` with the model's line and a caret under the column;
    an error that no statement is to blame for (a segment or a stage start that an option
    names and the model does not have) is one ``FILE: error: ...`` line, as a compiler
    says what is wrong with a file as a whole."""
    if exc.loc is None:
        note = f" (note: {exc.hint})" if exc.hint else ""
        message = crash.printable(exc.message + note, 2000)
        return fail_plain(f"{shown_path(path)}: error: {message}")
    from unroller.compiler.parser import read_source

    try:  # the same bounded read of a regular file as the parser's: a FIFO never blocks
        source = read_source(path)
    except ModelError:
        source = ""
    typer.echo(exc.format(str(path), source), err=True)
    return typer.Exit(USER_ERROR)


def print_warnings(path: str | Path) -> None:
    """The model's warnings, in the same ``FILE:LINE:COL`` form; a broken model has none
    here (its error is reported where it is loaded)."""
    from unroller.api import load_graph

    try:
        graph = load_graph(path)
    except ModelError:
        return
    for warning in graph.warnings:
        typer.echo(warning.format(str(path), graph.source), err=True)
