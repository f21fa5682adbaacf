"""What a dotted torch name or an expression stands for: the kind of a torch name, the torch
object behind it (looked up without importing anything), tensor method names, and the
receivers that are certainly not tensors.

Kept apart from the scanner: these answers depend only on torch and the expression, not
on the module being scanned."""

from __future__ import annotations

import ast
import functools
import inspect
from typing import Any

import torch

from .kinds import ATEN, FUNCTIONAL, MODULE, OPS, TENSOR, TORCH

_UNKNOWN = object()

# Receivers that are certainly not tensors: literals, displays, comprehensions, f-strings.
_NON_TENSOR_NODES = (
    ast.JoinedStr,
    ast.List,
    ast.Tuple,
    ast.Dict,
    ast.Set,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
_NON_TENSOR_BUILTINS = frozenset(
    {"str", "bytes", "list", "dict", "tuple", "set", "frozenset", "sorted", "repr", "format"}
)
_BUILTIN_TYPES = (str, bytes, list, dict, tuple, set, frozenset, int, float)


def _public_routines(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and inspect.isroutine(getattr(cls, n))}


@functools.lru_cache(maxsize=1)
def _tensor_methods() -> tuple[frozenset[str], frozenset[str]]:
    """(torch.Tensor's public methods, those that are also str/list/dict/... methods)."""
    methods = _public_routines(torch.Tensor)
    container = set().union(*(_public_routines(t) for t in _BUILTIN_TYPES))
    return frozenset(methods), frozenset(methods & container)


def _ops_reason(name: str) -> str:
    if name == "torch.ops.aten" or name.startswith("torch.ops.aten."):
        return "a direct ATen operator: only the listed torch operations are supported"
    return "a torch.ops operator: only the listed torch operations are supported"


def _is_torch(q: str) -> bool:
    return q == "torch" or q.startswith("torch.")


@functools.lru_cache(maxsize=4096)
def _torch_object(q: str) -> Any:
    """What a torch-qualified dotted name stands for, looked up without running any import
    or module ``__getattr__`` hook; _UNKNOWN if torch has no such attribute loaded."""
    obj: Any = torch
    for part in q.split(".")[1:]:
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            return _UNKNOWN
    return obj


def _classify(q: str) -> tuple[str, str]:
    """(kind, name) of a torch-qualified dotted name."""
    rest = q[len("torch.") :] if q.startswith("torch.") else ""
    if rest == "ops" or rest.startswith("ops."):
        return (ATEN if rest == "ops.aten" or rest.startswith("ops.aten.") else OPS), q
    if rest.startswith("nn.functional."):
        return FUNCTIONAL, rest[len("nn.functional.") :]
    if rest.startswith("Tensor."):
        return TENSOR, rest[len("Tensor.") :]
    if rest.startswith("nn.") and "." not in rest[3:]:
        return MODULE, rest[3:]
    return TORCH, rest or "torch"


def _certainly_not_tensor(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, _NON_TENSOR_NODES):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _NON_TENSOR_BUILTINS
    )


def _non_tensor_annotation(ann: ast.AST | None) -> bool:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a string annotation
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(ann, ast.Subscript):
        ann = ann.value
    if isinstance(ann, ast.Attribute):  # typing.List
        ann = ast.Name(ann.attr)
    return isinstance(ann, ast.Name) and ann.id.lower() in _NON_TENSOR_BUILTINS
