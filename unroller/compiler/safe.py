"""What may reach generated source: validated identifiers, repr()'d literals, escaped prose.

The security model of the code generator rests on this module. Every piece of text a
template interpolates must be a ``Code`` value, and ``Code`` values are made only here:

* ``identifier`` / ``dotted``: a Python identifier (or dotted module path) that is not a
  keyword, checked character by character;
* ``literal``: ``repr()`` of a constant whose type is checked recursively (None, bool,
  int, finite float, str, tuples and lists of those) — never ``nan``/``inf``, never an
  object whose repr could be arbitrary text;
* ``doc_text``: prose for a docstring, with backslashes, quotes and every non-printable
  character escaped, so the docstring still ends where the template ends it;
* ``comment_text``: prose for a ``#`` comment, with every line break and non-printable
  character escaped, so the comment cannot end early;
* ``code``: a line the emitter assembled from the above (the emitter is the only caller).

The template environment (``codegen.render``) refuses, at render time, any interpolated
value that is not ``Code`` (or a plain int), so a user string pasted raw is an error in
the generator, not a hole in the generated module.
"""

from __future__ import annotations

import keyword
import math
from typing import Any


class Code(str):
    """Text vetted to be placed in generated source as is."""

    __slots__ = ()


class UnsafeText(ValueError):
    """A value that cannot be emitted safely (a generator bug or an unvalidated input)."""


def identifier(name: str) -> Code:
    """A Python identifier: ASCII letters, digits and underscores, not a keyword."""
    if (
        not isinstance(name, str)
        or not name.isascii()
        or not name.isidentifier()
        or keyword.iskeyword(name)
    ):
        raise UnsafeText(f"not a safe identifier: {name!r}")
    return Code(name)


def dotted(path: str) -> Code:
    """A dotted module path such as ``unroller.runtime.gpu``, every part an identifier."""
    if not isinstance(path, str) or not path:
        raise UnsafeText(f"not a safe module path: {path!r}")
    for part in path.split("."):
        identifier(part)
    return Code(path)


_SCALARS = (type(None), bool, int, str)


def _check_literal(value: Any, depth: int = 0) -> None:
    if depth > 16:
        raise UnsafeText("literal nested too deeply")
    if type(value) in _SCALARS:
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise UnsafeText(f"not a finite number: {value!r}")
        return
    if type(value) in (tuple, list):
        for item in value:
            _check_literal(item, depth + 1)
        return
    raise UnsafeText(f"cannot emit a {type(value).__name__} as a literal: {value!r}")


def literal(value: Any) -> Code:
    """``repr()`` of a constant whose type (recursively) has a faithful repr."""
    _check_literal(value)
    return Code(repr(value))


def kwargs(values: dict[str, Any]) -> Code:
    """``key=literal, ...`` for keyword arguments."""
    return Code(", ".join(f"{identifier(k)}={literal(v)}" for k, v in values.items()))


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def doc_text(text: Any) -> Code:
    """Prose for the inside of a ``\"\"\"`` docstring (not a raw string): reads back as ``text``.

    Backslashes and double quotes are escaped, so no ``\"\"\"`` and no escape sequence of
    the user's survive; non-printable characters (line breaks included) become escapes.
    """
    out = []
    for ch in str(text):
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(_escape(ch))
    return Code("".join(out))


def comment_text(text: Any) -> Code:
    """Prose for a ``#`` comment: one physical line whatever ``text`` holds."""
    return Code("".join(ch if ch.isprintable() else _escape(ch) for ch in str(text)))


def code(text: str) -> Code:
    """A line the emitter built from identifiers, literals and fixed template text."""
    if "\n" in text or "\r" in text:
        raise UnsafeText(f"a generated line holds a line break: {text!r}")
    return Code(text)


def template_value(value: Any) -> Any:
    """Jinja ``finalize``: let through only vetted text (and plain integers)."""
    if isinstance(value, Code) or type(value) is int:
        return value
    raise UnsafeText(
        f"a template interpolates unvetted text {value!r}: pass it through "
        "unroller.compiler.safe (identifier, literal, doc_text, comment_text)"
    )
