"""The scanner's imports: every module the checked code imports, resolved (the user's own
code, a library, the standard library, missing or unreadable), with the names it uses
from each, so that the linter follows the user's modules and reports the rest."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

from .kinds import DYNAMIC, OPS_REFERENCE
from .resolve import _LIBRARY, _MISSING, _ROOT, _UNREADABLE, _USER, _Found
from .selection import _bound_names
from .torchnames import _is_torch, _ops_reason

_UNUSED = ""  # _Import.name of a module imported and never used by the checked code


@dataclass(frozen=True)
class _Import:
    """A module the checked code imports: the name it uses in it (None: all of it;
    _UNUSED: none), and where (the import, or the use that names it)."""

    module: str
    name: str | None
    line: int
    col: int
    text: str
    found: _Found


class _ImportScan:
    """The import half of ``scanner._ModuleScanner``: records an ``_Import`` for each
    import statement (or ``importlib`` call) the checked code holds."""

    def _imports(self, nodes: Iterable[ast.AST]) -> None:
        """The modules the checked code imports and what it uses of each (self.imports), and
        its torch imports that are errors by themselves (star imports, torch.ops)."""
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._import_module(a.name, a.asname or a.name.split(".")[0], node)
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)

    def _import_from(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module, node.level)
        if base is None:
            shown = "." * node.level + (node.module or "")
            found = _Found(
                _MISSING,
                why=f"cannot resolve the relative import 'from {shown} import ...': "
                "this module is not part of a package",
            )
            for a in node.names:
                self._unfollowed(shown, a.asname or a.name, node, found)
            return
        if _is_torch(base):
            if any(a.name == "*" for a in node.names):
                self._add(
                    node,
                    f"from {base} import *",
                    DYNAMIC,
                    False,
                    "a star import hides which torch names are called",
                )
            if base == "torch.ops" or base.startswith("torch.ops."):
                for a in node.names:
                    q = f"{base}.{a.name}"
                    self._add(node, q, OPS_REFERENCE, False, _ops_reason(q))
            return
        if base == "__future__":
            return
        found = self.resolve(base)
        if found.kind == _LIBRARY:
            return
        for a in node.names:
            local = a.asname or a.name
            if found.kind in (_MISSING, _UNREADABLE):
                self._unfollowed(base, local, node, found)
                continue
            if a.name == "*":
                self._star(base, node, found)
                continue
            sub = f"{base}.{a.name}"
            sub_found = self.resolve(sub) if found.is_package else _Found(_MISSING)
            if sub_found.kind in (_ROOT, _USER, _UNREADABLE):  # a submodule
                self._import_module(sub, local, node, sub_found)
            else:
                self._record(base, a.name, node, f"from {base} import {a.name}", found)

    def _star_binds(self, node: ast.ImportFrom) -> frozenset[str]:
        """The names a star import binds here, where they can be known (else none)."""
        base = self._absolute(node.module, node.level)
        if base is None or _is_torch(base):
            return frozenset()
        return self.star_names(self.resolve(base)) or frozenset()

    def _star(self, base: str, node: ast.ImportFrom, found: _Found) -> None:
        """``from base import *`` of a followed module: each name it binds that the checked
        code can reach (all of them in a module checked whole, else those asked for or
        used), but those a later top-level statement binds again (its own definition
        replaces the imported one); the whole module where the names cannot be known."""
        names = self.star_names(found)
        text = f"from {base} import *"
        if names is None:
            self._record(base, None, node, text, found)
            return
        if self.selection is not None:
            names = names & (self.selection | set(self.name_uses))
        names = names - self._rebound_after(node)
        for name in sorted(names):
            self._record(base, name, node, text, found)
        if not names:
            self._record(base, _UNUSED, node, text, found)

    def _rebound_after(self, node: ast.stmt) -> set[str]:
        """Names the top-level statements after ``node`` bind unconditionally (definitions,
        assignments and imports by name; not within if, try, for or with)."""
        if node not in self.body:
            return set()
        out: set[str] = set()
        for stmt in self.body[self.body.index(node) + 1 :]:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)):
                out |= _bound_names(stmt)
        return out

    def _import_module(
        self, module: str, local: str, node: ast.stmt, found: _Found | None = None
    ) -> None:
        """``import module as local`` (or ``from package import module as local``)."""
        if _is_torch(module) or module == "__future__":
            return
        found = found or self.resolve(module)
        if found.kind == _LIBRARY:
            return
        text = ast.unparse(node)
        if found.kind in (_MISSING, _UNREADABLE):
            self._unfollowed(module, local, node, found)
        elif found.kind == _ROOT:
            self._record(module, None, node, text, found)  # package modules count whole
        else:
            uses = self._module_uses(module, local)
            if not uses:
                self._record(module, _UNUSED, node, text, found)
            for name, where, shown in uses:
                self._record(module, name, where, shown, found)

    def _module_uses(self, module: str, local: str) -> list[tuple[str | None, ast.AST, str]]:
        """(name used, where, how) for each use of the module bound to ``local`` in the
        checked code: ``K2.clip`` and ``getattr(K2, "clip")`` use clip; anything else (the
        module passed around, getattr with a variable) uses all of it (None)."""
        uses: list[tuple[str | None, ast.AST, str]] = []
        for name_node in self.name_uses.get(local, ()):
            outer: ast.AST = name_node
            while isinstance(parent := self.parents.get(outer), ast.Attribute):
                outer = parent
            q = self._qual(outer)
            if q is None:
                continue
            if q.startswith(module + "."):
                uses.append((q[len(module) + 1 :].split(".")[0], outer, ast.unparse(outer)))
                continue
            if q != module and not module.startswith(q + "."):
                continue  # another module under the same top-level package
            parent = self.parents.get(outer)
            if (
                isinstance(parent, ast.Call)
                and isinstance(parent.func, ast.Name)
                and parent.func.id == "getattr"
                and len(parent.args) >= 2
                and parent.args[0] is outer
            ):
                attr = parent.args[1]
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                    uses.append((attr.value, parent, ast.unparse(parent)))
                    continue
                self._add(
                    parent.func,
                    f"getattr({ast.unparse(outer)}, {ast.unparse(attr)})",
                    DYNAMIC,
                    True,
                    f"dynamic access to module {module}: all of it was checked",
                    warning=True,
                )
            uses.append((None, outer, ast.unparse(outer)))
        return uses

    def _record(
        self, module: str, name: str | None, node: ast.AST, text: str, found: _Found
    ) -> None:
        line = node.lineno  # type: ignore[attr-defined]
        col = self._col(line, node.col_offset)  # type: ignore[attr-defined]
        self.imports.append(_Import(module, name, line, col, text, found))

    def _unfollowed(self, module: str, local: str, node: ast.stmt, found: _Found) -> None:
        """An import that cannot be followed: an error where the checked code uses what it
        binds, else a warning."""
        used = found.root or bool(self.name_uses.get(local))
        self._record(module, None if used else _UNUSED, node, ast.unparse(node), found)
