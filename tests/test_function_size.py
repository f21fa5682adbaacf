"""Every function of the generator's core fits on a screen: at most 80 lines.

A long function in the path from model text to generated code is where a change breaks
something it did not mean to touch; splitting it into helpers that each do one thing
keeps each piece reviewable. The limit counts from the ``def`` line to the last line
(``ast``'s ``end_lineno - lineno + 1``), docstring and comments included.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "unroller"

CORE = (
    "parser",
    "ast",
    "graph",
    "shapes",
    "registry",
    "names",
    "outline",
    "ir",
    "stash",
    "schemes",
    "platforms",
    "codegen",
    "lower/__init__",
    "lower/context",
    "lower/resolved",
    "lower/forward",
    "lower/restore",
    "lower/grads",
    "lower/backward",
    "lower/segments",
    "lower/pieces",
    "lower/reductions",
    "lower/stages",
    "safe",
    "errors",
    "pipeline",
)
"""The modules that turn model text into a generated module."""

MAX_LINES = 80


def _long_functions(path: Path) -> list[str]:
    """``file:line name (N lines)`` for each function or method of ``path`` over the limit."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_core_modules_exist():
    """The list above names real modules (a rename must update it, not silently skip)."""
    missing = [name for name in CORE if not (PACKAGE / f"{name}.py").is_file()]
    assert not missing, f"core modules not found: {missing}"


def test_core_functions_are_at_most_80_lines():
    offenders = [f for name in CORE for f in _long_functions(PACKAGE / f"{name}.py")]
    assert not offenders, (
        f"functions longer than {MAX_LINES} lines (split them into helpers that each do "
        "one thing):\n  " + "\n  ".join(offenders)
    )
