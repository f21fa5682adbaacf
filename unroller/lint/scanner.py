"""The scan of one module's source: its torch calls, the host-only functions it skips, and
the modules it imports with what it uses of each (for the linter to follow).

``_ModuleScanner`` holds the scan's state and walks the tree; its import records live in
``imports`` and its checks of torch calls and references in ``calls``."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .calls import _CallScan
from .hostonly import _host_only_marks, _is_host_only
from .imports import _Import, _ImportScan
from .kinds import AUTOGRAD, SYNTAX
from .report import HostOnly, LintCall
from .resolve import _Found
from .restrictions import _literal
from .selection import _select, _span
from .stars import _absolute
from .supported import SupportedOps
from .torchnames import _is_torch, _tensor_methods


@dataclass
class _Scan:
    calls: list[LintCall]
    host_only: list[HostOnly]
    imports: list[_Import]
    selection: frozenset[str] | None  # the top-level names checked, None: the whole module
    # (first line, last line) of each top-level statement, and why each selected one counts:
    # ("name", NAME) asked for from outside, ("use", STMT, NAME, LINE, COL) named by statement
    # STMT, ("import-time",) it binds nothing; None: the whole module counts
    spans: list[tuple[int, int]] = field(default_factory=list)
    reasons: dict[int, tuple] | None = None


class _ModuleScanner(_ImportScan, _CallScan):
    """Finds the torch calls of one source file."""

    def __init__(
        self,
        path: Path,
        source: str,
        module: str | None,
        is_package: bool,
        ops: SupportedOps,
        selection: frozenset[str] | None,
        resolve: Callable[[str], _Found],
        star_names: Callable[[_Found], frozenset[str] | None] = lambda found: None,
    ) -> None:
        self.path = path
        self.selection = selection
        self.source = source
        self.module = module
        self.is_package = is_package
        self.ops = ops
        self.resolve = resolve
        self.star_names = star_names
        self.body: list[ast.stmt] = []
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.calls: list[LintCall] = []
        self.host_only: list[HostOnly] = []
        self.imports: list[_Import] = []
        self.aliases: dict[str, str] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.consumed: set[int] = set()
        self.name_uses: dict[str, list[ast.Name]] = {}
        self.tensor_methods, self.ambiguous = _tensor_methods()

    # positions -------------------------------------------------------------------------

    def _col(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="replace")) + 1

    def _name_pos(self, node: ast.AST) -> tuple[int, int]:
        """Where the called name starts: the attribute of ``a.b.name``, else the node."""
        if isinstance(node, ast.Attribute) and node.end_lineno is not None:
            start = (node.end_col_offset or 0) - len(node.attr.encode("utf-8"))
            return node.end_lineno, self._col(node.end_lineno, start)
        return node.lineno, self._col(node.lineno, node.col_offset)

    def _add(
        self,
        node: ast.AST,
        name: str,
        kind: str,
        allowed: bool,
        reason: str,
        detail: str = "",
        warning: bool = False,
        at_start: bool = False,
    ) -> None:
        if at_start:
            line, col = node.lineno, self._col(node.lineno, node.col_offset)
        else:
            line, col = self._name_pos(node)
        self.calls.append(
            LintCall(self.path, line, col, name, kind, allowed, reason, detail, warning)
        )

    # names -----------------------------------------------------------------------------

    def _absolute(self, module: str | None, level: int) -> str | None:
        return _absolute(module, level, self.module, self.is_package)

    def _qual(self, node: ast.AST) -> str | None:
        """The dotted name an expression stands for, through the aliases, or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._qual(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            return self._imported_by_call(node)
        return None

    def _imported_by_call(self, node: ast.Call) -> str | None:
        """``__import__("torch")`` -> torch, ``importlib.import_module("torch.nn")`` ->
        torch.nn (string literals only)."""
        if not node.args or not isinstance(node.args[0], ast.Constant):
            return None
        name = node.args[0].value
        if not isinstance(name, str) or not name or name.startswith("."):
            return None
        func = node.func
        if isinstance(func, ast.Name) and func.id == "__import__" and func.id not in self.aliases:
            fromlist = node.args[3] if len(node.args) > 3 else None
            for kw in node.keywords:
                if kw.arg == "fromlist":
                    fromlist = kw.value
            leaf = fromlist is not None and _literal(fromlist) not in (None, (), [])
            return name if leaf else name.split(".")[0]
        if self._qual(func) == "importlib.import_module":
            return name
        return None

    def _collect_aliases(self, nodes: list[ast.AST]) -> None:
        assigns: list[ast.Assign | ast.AnnAssign] = []
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                if base is not None:
                    for a in node.names:
                        if a.name != "*":
                            self.aliases[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                assigns.append(node)
        # simple assignments that rename a torch object: `_aten = torch.ops.aten`
        for _ in range(3):
            changed = False
            for node in assigns:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                q = self._qual(node.value)  # type: ignore[arg-type]
                if q and _is_torch(q):
                    for t in targets:
                        if isinstance(t, ast.Name) and self.aliases.get(t.id) != q:
                            self.aliases[t.id] = q
                            changed = True
            if not changed:
                break

    # imports ---------------------------------------------------------------------------

    def _walk(
        self, node: ast.AST, marks: tuple[set[int], dict[int, int]], scope: tuple[str, ...]
    ) -> Iterator[ast.AST]:
        """ast.walk that skips host-only functions (recording them)."""
        for child in ast.iter_child_nodes(node):
            self.parents[child] = node
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_host_only(child, marks):
                    self.host_only.append(
                        HostOnly(
                            self.path,
                            child.lineno,
                            self._col(child.lineno, child.col_offset),
                            ".".join((*scope, child.name)),
                        )
                    )
                    continue
                inner = (*scope, child.name)
            elif isinstance(child, ast.ClassDef):
                inner = (*scope, child.name)
            yield child
            yield from self._walk(child, marks, inner)

    # the scan --------------------------------------------------------------------------

    def scan(self) -> _Scan:
        try:
            return self._scan()
        except RecursionError:
            self.calls = [
                LintCall(
                    self.path,
                    1,
                    1,
                    "too deeply nested",
                    SYNTAX,
                    False,
                    "the code is nested too deeply to be checked (Python cannot compile it "
                    "either)",
                )
            ]
            return _Scan(self.calls, [], [], None)

    def _scan(self) -> _Scan:
        tree = self._parse()
        if tree is None:
            return _Scan(self.calls, self.host_only, self.imports, None)
        self.body = tree.body
        every = list(ast.walk(tree))
        self._collect_aliases(every)
        marks = _host_only_marks(self.source)
        spans = [_span(stmt) for stmt in tree.body]
        checked, reasons = self._checked(tree, marks)
        nodes = list(self._walk(checked, marks, ()))
        self._index(nodes)
        self._imports(every if reasons is None else ast.walk(checked))
        for node in nodes:
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.ClassDef):
                self._class(node)
        for node in nodes:
            if isinstance(node, (ast.Attribute, ast.Name)):
                self._reference(node)
        self.calls.sort(key=lambda c: (c.line, c.col))
        return _Scan(self.calls, self.host_only, self.imports, self.selection, spans, reasons)

    def _parse(self) -> ast.Module | None:
        """The module's tree, or None with the syntax error recorded as a call."""
        try:
            return ast.parse(self.source, filename=str(self.path))
        except (SyntaxError, ValueError, MemoryError) as exc:
            msg = exc.msg if isinstance(exc, SyntaxError) else str(exc) or type(exc).__name__
            line = getattr(exc, "lineno", None) or 1
            self.calls.append(
                LintCall(
                    self.path,
                    line,
                    getattr(exc, "offset", None) or 1,
                    "syntax error",
                    SYNTAX,
                    False,
                    f"syntax error: {msg}: the file cannot be checked",
                )
            )
            return None

    def _checked(
        self, tree: ast.Module, marks: tuple[set[int], dict[int, int]]
    ) -> tuple[ast.Module, dict[int, tuple] | None]:
        """The part of the module that counts (all of it, or the statements the selection
        needs), and why each selected statement counts (None: the whole module). A selected
        name that is not bound at the top level makes the whole module count."""
        if self.selection is None:
            return ast.Module(body=tree.body, type_ignores=[]), None
        picked = _select(
            tree.body, self.selection, lambda f: _is_host_only(f, marks), self._star_binds
        )
        if picked is None:
            self.selection = None
            return ast.Module(body=tree.body, type_ignores=[]), None
        reasons = {
            i: (*r[:4], self._col(r[3], r[4])) if r[0] == "use" else r for i, r in picked.items()
        }
        body = [stmt for i, stmt in enumerate(tree.body) if i in picked]
        return ast.Module(body=body, type_ignores=[]), reasons

    def _index(self, nodes: list[ast.AST]) -> None:
        """Record the names the checked code loads (to find the uses of each import) and mark
        annotations consumed (a torch class in an annotation is no call)."""
        for node in nodes:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                self.name_uses.setdefault(node.id, []).append(node)
            elif isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
                self._mark_consumed(node.annotation)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
                self._mark_consumed(node.returns)

    def _class(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            q = self._qual(base)
            if q in ("torch.autograd.Function", "torch.autograd.function.Function"):
                self._add(
                    base,
                    "subclass of torch.autograd.Function",
                    AUTOGRAD,
                    False,
                    "torch.autograd.Function with a custom backward is not there",
                    at_start=True,
                )
                self._mark_consumed(base)
