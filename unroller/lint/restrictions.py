"""Checks of a call's literal arguments against the argument restrictions of the supported
list (interpolate's mode, max_pool return_indices, ...).

Kept apart from the scanner: a restriction's verdict depends only on the call node."""

from __future__ import annotations

import ast
from typing import Any

from .supported import _NO_DEFAULT, Restriction
from .torchnames import _UNKNOWN


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNKNOWN


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps bools and ints apart and treats tuples as lists."""
    seqs = (list, tuple)
    if isinstance(a, seqs) or isinstance(b, seqs):
        return (
            isinstance(a, seqs)
            and isinstance(b, seqs)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _argument(r: Restriction, call: ast.Call, offset: int) -> ast.AST | None | object:
    """The node passed for r.arg, None if absent, _UNKNOWN if hidden behind * or **."""
    for kw in call.keywords:
        if kw.arg == r.arg:
            return kw.value
    if r.position is not None:
        pos = r.position + offset
        for i, a in enumerate(call.args):
            if isinstance(a, ast.Starred):
                return _UNKNOWN
            if i == pos:
                return a
    if any(kw.arg is None for kw in call.keywords):
        return _UNKNOWN
    return None


def _check_restriction(r: Restriction, call: ast.Call, offset: int) -> tuple[str, str, str] | None:
    """None if fine, else (severity, detail, reason)."""
    if r.manual:
        return "warning", "", r.reason
    node = _argument(r, call, offset)
    if node is _UNKNOWN:
        return "warning", f"{r.arg}=?", f"{r.reason}; {r.arg} is not visible in the call"
    if node is None:
        if r.required:
            return "error", f"{r.arg} missing", r.reason
        if r.default is _NO_DEFAULT:
            return None
        value, shown = r.default, f"{r.arg}={r.default!r} (default)"
    else:
        assert isinstance(node, ast.AST)
        value, shown = _literal(node), f"{r.arg}={ast.unparse(node)}"
        if value is _UNKNOWN:
            if r.required:
                return None  # a tensor expression: given
            return "warning", shown, f"{r.reason}; {r.arg} is not a literal"
    if r.required and value is None:
        return "error", shown, r.reason
    if r.none_only and value is not None:
        return "error", shown, r.reason
    if r.allowed is not None and not any(_same(value, a) for a in r.allowed):
        return "error", shown, r.reason
    if r.forbidden is not None and any(_same(value, f) for f in r.forbidden):
        return "error", shown, r.reason
    return None
