"""The scanner's checks of torch references: each call or reference to a torch function,
``torch.nn`` module, tensor method or ``torch.ops`` entry is classified against the
supported operators (and their argument restrictions) and recorded as a ``LintCall``."""

from __future__ import annotations

import ast
from collections.abc import Iterable

import torch

from .kinds import ATEN, DYNAMIC, MODULE, OPS, OPS_REFERENCE, TENSOR
from .restrictions import _check_restriction
from .supported import _canonical
from .torchnames import (
    _UNKNOWN,
    _certainly_not_tensor,
    _classify,
    _is_torch,
    _non_tensor_annotation,
    _ops_reason,
    _torch_object,
)


class _CallScan:
    """The call half of ``scanner._ModuleScanner``: one ``LintCall`` per torch call or
    reference that the checked code makes."""

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


def _uniq(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
