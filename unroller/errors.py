"""Errors in model files, reported as ``FILE:LINE:COL: error: ...`` with a caret.

Every problem the front end finds in a model file is a ``ModelError`` carrying a
``Loc``; the CLI formats it with the source line and a caret and exits 2, with no
traceback. Warnings use the same format. Errors in config files (``--compress-config``)
are ``ConfigFileError``s, formatted the same way when they are raised.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from unroller.ast import Loc


class ModelError(Exception):
    """A user error in a model file at a known location."""

    def __init__(self, message: str, loc: Loc | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.hint = hint

    def format(self, filename: str, source: str) -> str:
        return format_diagnostic("error", self.message, self.loc, filename, source, self.hint)


class ConfigError(Exception):
    """A user error outside model files (CLI options, config files); printed as is."""


class OptionError(ConfigError, ValueError):
    """Generator options that cannot be combined (``--pipeline`` on a platform without
    process stages), refused by the code generator itself for callers that skip the
    CLI's checks; the message names the options as they are typed (``--num-ipus``). A
    ``ValueError`` too, for callers that catch the library's ``ValueError``s."""


class ConfigFileError(ConfigError):
    """A ``ConfigError`` at a position in a config file, already formatted like a model-file
    error (``FILE:LINE:COL: error: ...``, the source line and a caret); printed as is.

    ``message`` is the bare message, ``loc`` its position (None: the file as a whole)."""

    def __init__(
        self,
        message: str,
        loc: Loc | None,
        filename: str,
        source: str,
        hint: str | None = None,
    ):
        super().__init__(format_diagnostic("error", message, loc, filename, source, hint))
        self.message = message
        self.loc = loc
        self.filename = filename


SHOWN_LINE = 100  # columns of a long source line shown under a diagnostic


def format_diagnostic(
    severity: str,
    message: str,
    loc: Loc | None,
    filename: str,
    source: str,
    hint: str | None = None,
) -> str:
    """``FILE:LINE:COL: severity: message``, then the source line and a caret line.

    The quoted line shows every non-printable character as ``?`` (one for one, so the
    caret stays under its column, and no escape sequence reaches the terminal), and a
    long line only around the caret.
    """
    if loc is None:
        text = f"{filename}: {severity}: {message}"
    else:
        text = f"{filename}:{loc.line}:{loc.col}: {severity}: {message}"
        lines = source.split("\n")
        if 1 <= loc.line <= len(lines):
            line = lines[loc.line - 1].rstrip("\r").expandtabs(1)
            line = "".join(ch if ch.isprintable() else "?" for ch in line)
            col = loc.col
            width = max(1, min(loc.length, len(line) - col + 1))
            if len(line) > SHOWN_LINE:
                start = max(0, col - 1 - SHOWN_LINE // 2)
                end = start + SHOWN_LINE
                shown = line[start:end]
                if start:
                    shown, col = "..." + shown[3:], col - start
                if end < len(line):
                    shown = shown[:-3] + "..."
                line, width = shown, max(1, min(width, len(shown) - col + 1))
            text += f"\n    {line}\n    {' ' * (col - 1)}^{'~' * (width - 1)}"
    if hint:
        text += f"\n  note: {hint}"
    return text


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt name, or None if nothing is close."""
    matches = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` or an empty string."""
    best = closest(name, candidates)
    return f" (did you mean '{best}'?)" if best else ""


class ModelWarning:
    """A non-fatal diagnostic (e.g. an unused input)."""

    def __init__(self, message: str, loc: Loc | None):
        self.message = message
        self.loc = loc

    def format(self, filename: str, source: str) -> str:
        return format_diagnostic("warning", self.message, self.loc, filename, source)
