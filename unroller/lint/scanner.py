"""The scan of one module's source: its torch calls, the host-only functions it skips, and
the modules it imports with what it uses of each (for the linter to follow)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .hostonly import _host_only_marks, _is_host_only
from .kinds import ATEN, AUTOGRAD, DYNAMIC, MODULE, OPS, OPS_REFERENCE, SYNTAX, TENSOR
from .report import HostOnly, LintCall
from .resolve import _LIBRARY, _MISSING, _ROOT, _UNREADABLE, _USER, _Found
from .restrictions import _check_restriction, _literal
from .selection import _select, _span
from .supported import SupportedOps, _canonical
from .torchnames import (
    _UNKNOWN,
    _certainly_not_tensor,
    _classify,
    _is_torch,
    _non_tensor_annotation,
    _ops_reason,
    _tensor_methods,
    _torch_object,
)

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


def _uniq(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


class _ModuleScanner:
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
    ) -> None:
        self.path = path
        self.selection = selection
        self.source = source
        self.module = module
        self.is_package = is_package
        self.ops = ops
        self.resolve = resolve
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
        if level == 0:
            return module
        if self.module is None:
            return None
        parts = self.module.split(".")
        if not self.is_package:
            parts = parts[:-1]
        if level > 1:
            parts = parts[: len(parts) - (level - 1)]
        if not parts:
            return None
        return ".".join(parts + ([module] if module else []))

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
                self._record(base, None, node, f"from {base} import *", found)
                continue
            sub = f"{base}.{a.name}"
            sub_found = self.resolve(sub) if found.is_package else _Found(_MISSING)
            if sub_found.kind in (_ROOT, _USER, _UNREADABLE):  # a submodule
                self._import_module(sub, local, node, sub_found)
            else:
                self._record(base, a.name, node, f"from {base} import {a.name}", found)

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
        picked = _select(tree.body, self.selection, lambda f: _is_host_only(f, marks))
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

    def _reference(self, node: ast.Attribute | ast.Name) -> None:
        """A torch object named other than by calling it: ``torch.ops`` anywhere (an error),
        a torch function or torch.nn module (checked as a call to it: it may be called
        through a variable), a tensor method taken as a bound method (``f = x.erf``)."""
        if id(node) in self.consumed or isinstance(node.ctx, (ast.Store, ast.Del)):
            return
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute):
            return  # the outermost attribute of the chain reports
        if isinstance(parent, ast.Call) and parent.func is node:
            return  # reported as a call
        q = self._qual(node)
        if q is None:
            if isinstance(node, ast.Attribute):
                self._method_reference(node, node.attr, node.value)
            return
        if not _is_torch(q):
            return
        if q == "torch.ops" or q.startswith("torch.ops."):
            self._add(node, q, OPS_REFERENCE, False, _ops_reason(q))
            return
        kind, short = _classify(q)
        obj = _torch_object(q)
        if isinstance(obj, type):
            if not (
                issubclass(obj, torch.nn.Module)
                and obj is not torch.nn.Module
                and kind == MODULE
                and not self._type_test(node)
            ):
                return
        elif isinstance(obj, type(torch)):
            if isinstance(parent, (ast.Assign, ast.AnnAssign)) and all(
                isinstance(t, ast.Name)
                for t in (parent.targets if isinstance(parent, ast.Assign) else [parent.target])
            ):
                return  # `F2 = torch.nn.functional`: an alias, followed like an import
            self._add(
                node,
                q,
                DYNAMIC,
                True,
                "a torch module used as a value: what is called through it elsewhere cannot "
                "be checked",
                warning=True,
            )
            return
        elif obj is _UNKNOWN or not callable(obj):
            return
        self._check_reference(node, kind, short)

    def _type_test(self, node: ast.AST) -> bool:
        """``node`` is (in) the class argument of isinstance/issubclass, or an except type."""
        parent = self.parents.get(node)
        while isinstance(parent, ast.Tuple):
            node, parent = parent, self.parents.get(parent)
        if isinstance(parent, ast.ExceptHandler):
            return True
        return (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id in ("isinstance", "issubclass")
            and node is not parent.func
        )

    def _method_reference(self, node: ast.AST, name: str, receiver: ast.AST) -> None:
        """``receiver.name`` taken without a call (or ``getattr(receiver, "name")``): if the
        receiver is a tensor, a bound method that may be called through a variable. Data
        attributes of other objects share these names (``device.type``, ``cfg.norm``), so
        only a name the platform does not support is reported, as a warning."""
        if name.startswith("_") or name not in self.tensor_methods:
            return
        if self._not_a_tensor(receiver) or self._annotated_not_tensor(receiver, strict=False):
            return
        allowed, reason = self.ops.lookup(TENSOR, name)
        if not allowed:
            self._add(
                node,
                _canonical(TENSOR, name),
                TENSOR,
                True,
                f"named without a call on an object of unknown type: if it is a tensor, "
                f"the method may be called through a variable and it is {reason}",
                warning=True,
            )

    def _check_reference(self, node: ast.AST, kind: str, short: str) -> None:
        canonical = _canonical(kind, short)
        allowed, reason = self.ops.lookup(kind, short)
        how = "named without a call (it may be called through a variable)"
        if allowed and self.ops.restrictions.get(canonical):
            args = ", ".join(_uniq(r.arg for r in self.ops.restrictions[canonical] if r.arg))
            self._add(
                node,
                canonical,
                kind,
                True,
                f"{how}: its arguments ({args or 'restricted'}) cannot be checked",
                warning=True,
            )
            return
        self._add(node, canonical, kind, allowed, f"{reason}; {how}")

    def _call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and "getattr" not in self.aliases:
            self._getattr(node)
            return
        q = self._qual(func)
        if q is not None:
            if _is_torch(q):
                self._torch_call(node, func, q)
            elif q == "importlib.import_module":
                self._dynamic_import(node)
            return  # a function of some other module (K.conv2d, math.prod, C.make)
        if isinstance(func, ast.Name) and func.id == "__import__" and func.id not in self.aliases:
            self._dynamic_import(node)
        elif (
            isinstance(func, ast.Name)
            and func.id in ("eval", "exec")
            and func.id not in self.aliases
        ):
            self._add(
                func,
                f"{func.id}(...)",
                DYNAMIC,
                True,
                "code run from a string cannot be checked",
                warning=True,
            )
        elif isinstance(func, ast.Attribute):
            self._method_call(node, func)

    def _dynamic_import(self, node: ast.Call) -> None:
        if self._imported_by_call(node) is None:
            self._add(
                node.func,
                f"{ast.unparse(node.func)}({', '.join(ast.unparse(a) for a in node.args)})",
                DYNAMIC,
                True,
                "a module imported by a computed name cannot be checked",
                warning=True,
            )

    def _getattr(self, node: ast.Call) -> None:
        if len(node.args) < 2:
            return
        receiver, name = node.args[0], node.args[1]
        target = self._qual(receiver)
        literal = name.value if isinstance(name, ast.Constant) else None
        if target and _is_torch(target):
            self._mark_consumed(receiver)
            if isinstance(literal, str):
                kind, short = _classify(f"{target}.{literal}")
                self._check(node, func_node=node.func, kind=kind, short=short, call=None)
            else:
                self._add(
                    node.func,
                    f"getattr({target}, {ast.unparse(name)})",
                    DYNAMIC,
                    False,
                    "dynamic access to torch cannot be checked",
                )
            return
        if target is not None:
            return  # a followed module (see _module_uses) or another module's object
        if isinstance(literal, str):
            self._method_reference(node.func, literal, receiver)
            return
        if _certainly_not_tensor(receiver):
            return
        self._add(
            node.func,
            f"getattr({ast.unparse(receiver)}, {ast.unparse(name)})",
            DYNAMIC,
            True,
            "an attribute got by a computed name: if it is a torch function or tensor "
            "method, that cannot be checked",
            warning=True,
        )

    def _mark_consumed(self, node: ast.AST) -> None:
        for sub in ast.walk(node):
            self.consumed.add(id(sub))

    def _torch_call(self, node: ast.Call, func: ast.AST, q: str) -> None:
        kind, short = _classify(q)
        self._check(
            node,
            func_node=func,
            kind=kind,
            short=short,
            call=node,
            offset=1 if q.startswith("torch.Tensor.") else 0,
        )

    def _not_a_tensor(self, receiver: ast.AST) -> bool:
        """Receivers that are certainly no tensor: self/cls, super(), literals, displays,
        parameters annotated str/list/dict/..."""
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            return True
        if _certainly_not_tensor(receiver) or self._annotated_not_tensor(receiver):
            return True
        return (
            isinstance(receiver, ast.Call)
            and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super"
        )

    def _method_call(self, node: ast.Call, func: ast.Attribute) -> None:
        name = func.attr
        if name.startswith("_") or name not in self.tensor_methods:
            return
        if self._not_a_tensor(func.value):
            return
        if name in self.ambiguous:
            allowed, reason = self.ops.lookup(TENSOR, name)
            if allowed:
                note = f"; receiver not known, .{name}() is also a str/list/dict/set method"
                self._check(node, func_node=func, kind=TENSOR, short=name, call=node, note=note)
            else:
                self._add(
                    func,
                    _canonical(TENSOR, name),
                    TENSOR,
                    True,
                    f"unknown receiver: .{name}() is also a str/list/dict/set method; "
                    f"as a tensor method it is {reason}",
                    warning=True,
                )
            return
        self._check(node, func_node=func, kind=TENSOR, short=name, call=node)

    def _annotated_not_tensor(self, receiver: ast.AST, strict: bool = True) -> bool:
        """A parameter of the enclosing function annotated str, list, dict, tuple or set
        (``strict=False``: annotated with anything that does not mention Tensor)."""
        if not isinstance(receiver, ast.Name):
            return False
        node: ast.AST | None = receiver
        while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = self.parents.get(node)
        if node is None:
            return False
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg == receiver.id:
                if not strict and arg.annotation is not None:
                    return "Tensor" not in ast.unparse(arg.annotation)
                return _non_tensor_annotation(arg.annotation)
        return False

    def _check(
        self,
        node: ast.Call,
        func_node: ast.AST,
        kind: str,
        short: str,
        call: ast.Call | None,
        offset: int = 0,
        note: str = "",
    ) -> None:
        if kind in (ATEN, OPS):
            self._add(func_node, short, kind, False, _ops_reason(short))
            return
        canonical = _canonical(kind, short)
        allowed, reason = self.ops.lookup(kind, short)
        if not allowed or call is None:
            self._add(func_node, canonical, kind, allowed, reason)
            return
        errors: list[tuple[str, str]] = []
        warnings: list[tuple[str, str]] = []
        for r in self.ops.restrictions.get(canonical, []):
            verdict = _check_restriction(r, call, offset)
            if verdict is not None:
                (errors if verdict[0] == "error" else warnings).append(verdict[1:])
        if errors:
            self._add(
                func_node,
                canonical,
                kind,
                False,
                "; ".join(_uniq(w for _, w in errors)),
                detail=", ".join(d for d, _ in errors if d),
            )
        elif warnings:
            self._add(
                func_node,
                canonical,
                kind,
                True,
                "; ".join(_uniq(w for _, w in warnings)),
                detail=", ".join(d for d, _ in warnings if d),
                warning=True,
            )
        else:
            self._add(func_node, canonical, kind, True, reason + note)
