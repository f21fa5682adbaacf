"""Errors in model files, reported as ``FILE:LINE:COL: error: ...`` with a caret.

Every problem the front end finds in a model file is a ``ModelError`` carrying a
``Loc``; the CLI formats it with the source line and a caret and exits 2, with no
traceback. Warnings use the same format. Errors in config files (``--compress-config``)
are ``ConfigFileError``s, formatted the same way when they are raised.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

from unroller.compiler.ast import Loc


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


class OptionValueError(OptionError):
    """One ``Options`` field refused, alone or with the fields it does not combine with.

    ``field`` is the field to blame. The message is a template, so that each caller names
    the options as its user wrote them: ``render("cli")`` names the flag as typed
    (``--segment-pieces``), ``render("python")`` the keyword argument (``segment_pieces=``),
    ``render("header")`` the key of a generated file's header (``'segment_pieces'``).
    ``str()`` is the Python form: the library's callers typed arguments, not flags.

    In the template, ``{name}`` is an option, ``{name=}`` an option with its value,
    ``{name=TEXT}`` an option with the value TEXT, and ``{name!}`` a value alone (of a
    field, or of an entry of ``values`` that is not one, such as one bad list item).
    ``flags`` maps each field to its flag; values are shown with every control character
    escaped and huge numbers by their size, so a message stays one short line."""

    def __init__(
        self,
        field: str,
        template: str,
        values: Mapping[str, object],
        flags: Mapping[str, str],
    ):
        self.field = field
        self.template = template
        self.values = dict(values)
        self.flags = dict(flags)
        super().__init__(self.render("python"))

    def render(self, style: str = "python") -> str:
        """The message naming options as ``style`` does: "cli", "python" or "header"."""
        if style not in ("cli", "python", "header"):
            raise ValueError(f"unknown style {style!r} (cli, python or header)")
        return _PLACEHOLDER.sub(lambda m: self._placeholder(m, style), self.template)

    def _placeholder(self, match: re.Match[str], style: str) -> str:
        name, text = match.group(1), match.group(4)
        sign = match.group(2) or match.group(3) or ""
        value: object = text if text else self.values.get(name)
        if sign == "!":
            return shown_value(value)
        if style == "cli":
            flag = self.flags.get(name, "--" + name.replace("_", "-"))
            return flag if not sign else f"{flag}{_cli_value(value)}"
        if style == "header":
            return f"'{name}'" if not sign else f"'{name}' = {shown_value(value)}"
        return f"{name}=" if not sign else f"{name}={shown_value(value)}"


_PLACEHOLDER = re.compile(r"\{(\w+)(?:(!)|(=)([^{}]*))?\}")
SHOWN_VALUE = 60  # characters of a value shown in a message


def shown_value(value: object) -> str:
    """A value for a one-line message: ``ascii()`` (no control character reaches a
    terminal), cut short; an integer too big to print (Python refuses past 4300 digits)
    by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (list, tuple)):
        opening, closing = "[]" if isinstance(value, list) else "()"
        items = [shown_value(v) for v in value[:8]] + (["..."] if len(value) > 8 else [])
        comma = "," if isinstance(value, tuple) and len(value) == 1 else ""
        text = opening + ", ".join(items) + comma + closing
    else:
        text = ascii(value)
    return text if len(text) <= SHOWN_VALUE else text[: SHOWN_VALUE - 3] + "..."


def _cli_value(value: object) -> str:
    """`` VALUE`` as a command line gives it after its flag (nothing for a switch): a list
    comma-separated, a printable word as is, anything else as ``shown_value``."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if isinstance(value, str):
        plain = value.isprintable() and " " not in value and len(value) <= SHOWN_VALUE
        return " " + (value if plain and value else shown_value(value))
    return " " + shown_value(value)


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
