"""Which top-level statements of a module imported by name count: those defining the names
asked for and, transitively, what they use; and which statement a line belongs to (to
explain, in a chain, why a line was checked)."""

from __future__ import annotations

import ast
import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator

StarBinds = Callable[[ast.ImportFrom], Iterable[str]]


def _bound_names(stmt: ast.stmt, star_binds: StarBinds | None = None) -> set[str]:
    """The names a top-level statement binds in its module; a star import binds what
    ``star_binds`` says it does (nothing known without it)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(a.asname or a.name.split(".")[0] for a in node.names if a.name != "*")
            if star_binds is not None and isinstance(node, ast.ImportFrom):
                if any(a.name == "*" for a in node.names):
                    out.update(star_binds(node))
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp)):
            return
        if isinstance(node, ast.GeneratorExp):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(stmt)
    return out


def _loaded_names(node: ast.AST, host_only: Callable[[ast.AST], bool]) -> Iterator[ast.Name]:
    """Every name a statement mentions, outside the bodies of host-only functions."""
    todo = [node]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and host_only(node):
            continue
        if isinstance(node, ast.Name):
            yield node
        todo.extend(reversed(list(ast.iter_child_nodes(node))))


def _span(stmt: ast.stmt) -> tuple[int, int]:
    """First and last line of a top-level statement, decorators included."""
    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
    return first, stmt.end_lineno or stmt.lineno


def _select(
    body: list[ast.stmt],
    names: Iterable[str],
    host_only: Callable[[ast.AST], bool],
    star_binds: StarBinds | None = None,
) -> dict[int, tuple] | None:
    """The top-level statements that define ``names`` and everything they use, transitively
    (not counting what host-only functions use), plus those that bind nothing (they run at
    import), each (by index) with why it counts: ("name", NAME) one of ``names``, ("use",
    INDEX, NAME, LINE, COL) statement INDEX mentions NAME there (the first such way, breadth
    first), ("import-time",); None if a name is not bound at the top level. A star import
    binds the names ``star_binds`` gives it."""
    where: dict[str, list[int]] = {}
    binds = [_bound_names(stmt, star_binds) for stmt in body]
    for i, bound in enumerate(binds):
        for name in bound:
            where.setdefault(name, []).append(i)
    names = list(names)
    if any(n not in where for n in names):
        return None
    chosen: dict[int, tuple] = {}
    todo: deque[tuple[str, tuple]] = deque((n, ("name", n)) for n in names)

    def take(i: int, reason: tuple) -> None:
        if i not in chosen:
            chosen[i] = reason
            todo.extend(
                (n.id, ("use", i, n.id, n.lineno, n.col_offset))
                for n in _loaded_names(body[i], host_only)
            )

    for i, bound in enumerate(binds):
        if not bound:
            take(i, ("import-time",))
    done: set[str] = set()
    while todo:
        name, reason = todo.popleft()
        if name not in done:
            done.add(name)
            for i in where.get(name, []):
                take(i, reason)
    return chosen


def _statement_at(spans: list[tuple[int, int]], line: int) -> int | None:
    i = bisect.bisect_right([start for start, _ in spans], line) - 1
    return i if i >= 0 and spans[i][1] >= line else None
