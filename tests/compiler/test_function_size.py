"""Every function of the generator's core fits on a screen: at most 80 lines.

A long function in the path from model text to generated code is where a change breaks
something it did not mean to touch; splitting it into helpers that each do one thing
keeps each piece reviewable. The limit counts from the ``def`` line to the last line
(``ast``'s ``end_lineno - lineno + 1``), docstring and comments included.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "unroller"

COMPILER = PACKAGE / "compiler"
CORE = sorted(COMPILER.rglob("*.py")) + [PACKAGE / "errors.py"]
"""The modules that turn model text into a generated module: the compiler package, and
the errors it raises."""

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


def test_the_core_is_the_compiler_package():
    """The scan sees the compiler's stages (a move out of the package would skip them)."""
    names = {path.relative_to(COMPILER).with_suffix("").as_posix() for path in CORE[:-1]}
    stages = {"parser", "graph/__init__", "stash", "lower/backward", "outline", "codegen"}
    assert stages <= names, f"not found in unroller/compiler: {stages - names}"


def test_core_functions_are_at_most_80_lines():
    offenders = [f for path in CORE for f in _long_functions(path)]
    assert not offenders, (
        f"functions longer than {MAX_LINES} lines (split them into helpers that each do "
        "one thing):\n  " + "\n  ".join(offenders)
    )
