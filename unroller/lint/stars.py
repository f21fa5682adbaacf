"""What ``from module import *`` binds, read from the followed module's source (nothing is
imported): the names of its ``__all__`` where that is a literal list or tuple of strings,
else every public name it binds at the top level, with what its own star imports of
followed modules bind, in turn. That is Python's rule for a star import, except that a
computed ``__all__`` is not evaluated: then every public name counts, which may be more
than the module exports at run time (more is checked, not less, unless that ``__all__``
lists private names).

With these names the linter follows a star import as it follows ``from module import a, b``:
only the definitions behind the names the checked code can reach count, not the whole
module. Where they cannot be known (the module cannot be read or parsed, or it star-imports
a module that is not followed, or the imports form a cycle), ``star_names`` gives None and
the star import makes the whole module count."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from .resolve import _ROOT, _USER, _Found
from .selection import _bound_names
from .source import _Unreadable
from .torchnames import _is_torch

# None: the names cannot be known; being worked out (a cycle of star imports) reads as None
_Cache = dict[Path, frozenset[str] | None]
_PENDING = frozenset({"\0pending"})


def _absolute(module: str | None, level: int, current: str | None, is_package: bool) -> str | None:
    """The absolute name of ``from <level dots><module> import ...`` in module ``current``
    (None: a relative import outside a package)."""
    if level == 0:
        return module
    if current is None:
        return None
    parts = current.split(".")
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    if not parts:
        return None
    return ".".join(parts + ([module] if module else []))


def _literal_all(body: list[ast.stmt]) -> frozenset[str] | None:
    """The names of ``__all__`` when the module binds it once, at the top level, to a literal
    list or tuple of strings; else None."""
    found: frozenset[str] | None = None
    for stmt in body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [stmt.target], stmt.value
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if found is not None or isinstance(stmt, ast.AugAssign):
            return None  # bound more than once: not a literal
        if not isinstance(value, (ast.List, ast.Tuple)) or not all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
        ):
            return None
        found = frozenset(e.value for e in value.elts)  # type: ignore[union-attr]
    return found


def star_names(
    found: _Found, resolve: Callable[[str], _Found], read: Callable[[Path], str], cache: _Cache
) -> frozenset[str] | None:
    """The names ``from <found.module> import *`` binds (see the module's doc), or None;
    ``read``: a module's source (raises _Unreadable)."""
    path = found.path
    if found.kind not in (_ROOT, _USER) or path is None:
        return None
    if path in cache:
        known = cache[path]
        return None if known is _PENDING else known
    cache[path] = _PENDING
    cache[path] = _names(found, path, resolve, read, cache)
    return cache[path]


def _names(
    found: _Found,
    path: Path,
    resolve: Callable[[str], _Found],
    read: Callable[[Path], str],
    cache: _Cache,
) -> frozenset[str] | None:
    try:
        tree = ast.parse(read(path), filename=str(path))
    except (_Unreadable, SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    literal = _literal_all(tree.body)
    if literal is not None:
        return literal
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            base = _absolute(stmt.module, stmt.level, found.module or None, found.is_package)
            if base is None or _is_torch(base):
                return None
            inner = star_names(resolve(base), resolve, read, cache)
            if inner is None:
                return None
            names |= inner
        elif not (isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"):
            names |= _bound_names(stmt)
    return frozenset(n for n in names if not n.startswith("_"))
