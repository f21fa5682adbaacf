"""The host-only marker: functions that run on the host, outside the traced graph, and are
therefore not checked.

The marker is read from comments (which :mod:`ast` drops) by tokenizing the source, so it
lives apart from the AST scanner."""

from __future__ import annotations

import ast
import io
import re
import tokenize

HOST_ONLY_TAG = "unroller-lint: host-only"
_HOST_ONLY_RE = re.compile(r"#\s*unroller-lint:\s*host-only\b")


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    try:
        return list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):  # pragma: no cover - ast parsed it
        return []


def _host_only_marks(source: str) -> tuple[set[int], dict[int, int]]:
    """(lines with a host-only comment, def line -> line of the colon ending its header)."""
    if "host-only" not in source:  # no marker anywhere: skip tokenizing
        return set(), {}
    tokens = _tokens(source)
    marked = {
        t.start[0] for t in tokens if t.type == tokenize.COMMENT and _HOST_ONLY_RE.search(t.string)
    }
    header_end: dict[int, int] = {}
    for i, t in enumerate(tokens):
        if t.type == tokenize.NAME and t.string == "def":
            depth = 0
            for u in tokens[i + 1 :]:
                if u.type == tokenize.OP and u.string in ("(", "[", "{"):
                    depth += 1
                elif u.type == tokenize.OP and u.string in (")", "]", "}"):
                    depth -= 1
                elif u.type == tokenize.OP and u.string == ":" and depth == 0:
                    header_end.setdefault(t.start[0], u.start[0])
                    break
    return marked, header_end


def _is_host_only(
    node: ast.FunctionDef | ast.AsyncFunctionDef, marks: tuple[set[int], dict[int, int]]
) -> bool:
    """Whether ``node`` carries the marker: a comment on a line of its header (``marks``,
    from ``_host_only_marks``), or the tag in its docstring."""
    marked, header_end = marks
    last = header_end.get(node.lineno, node.lineno)
    if any(node.lineno <= ln <= last for ln in marked):
        return True
    doc = ast.get_docstring(node, clean=False)
    return bool(doc and HOST_ONLY_TAG in doc)
