"""The ONNX importer's exact fallback: an ONNX op no mapper handles but which one ATen
overload computes exactly becomes one ``aten`` statement (the torch importer's
``torch_opaque`` fallback, ``unroller.runtime.opaque`` running it: the forward is that
overload, the backward its vector-Jacobian product under autograd).

``ATEN`` is the table: ONNX op -> a function of the node's view that returns the overload
and its ``call`` text (``t0``.. the tensor inputs, then literals), or refuses what the
overload would not compute exactly (an exclusive or reversed ``CumSum``, a reduction over
the batch dim, operands broadcast across ranks). ``fallback=False`` (``--no-fallback``)
leaves such a node unmapped, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from unroller.importer.aten_ops import Refuse

#: ONNX elementwise ops whose ATen twin takes the one tensor and nothing else (ONNX and
#: torch define each the same way: ``Round`` halves to even in both, ``Sign`` of 0 is 0)
UNARY = {
    name: f"aten.{aten}.default"
    for name, aten in {
        "Exp": "exp",
        "Log": "log",
        "Sqrt": "sqrt",
        "Abs": "abs",
        "Neg": "neg",
        "Reciprocal": "reciprocal",
        "Sin": "sin",
        "Cos": "cos",
        "Tan": "tan",
        "Asin": "asin",
        "Acos": "acos",
        "Atan": "atan",
        "Sinh": "sinh",
        "Cosh": "cosh",
        "Asinh": "asinh",
        "Acosh": "acosh",
        "Atanh": "atanh",
        "Erf": "erf",
        "Sign": "sign",
        "Floor": "floor",
        "Ceil": "ceil",
        "Round": "round",
    }.items()
}


def _unary(op: str) -> Callable:
    def call(view) -> tuple[str, str, list[str]]:
        return op, "t0", [view.value(0)]

    return call


def _same_rank(view) -> list[str]:
    """Both operands data of one rank (broadcasting across ranks would not line up their
    batch dims), their values."""
    if not (view.is_data(0) and view.is_data(1)):
        raise Refuse(f"{view.op} of a constant tensor: no registry operator takes a constant")
    args = [view.value(0), view.value(1)]
    a, b = view.in_shape(0), view.in_shape(1)
    if len(a) != len(b):
        raise Refuse(f"{view.op} of {len(a)}-d and {len(b)}-d tensors: ranks differ")
    return args


def _binary(op: str) -> Callable:
    def call(view) -> tuple[str, str, list[str]]:
        if len(view.inputs()) != 2:
            raise Refuse(f"{view.op} of {len(view.inputs())} tensors (the fallback takes two)")
        return op, "t0, t1", _same_rank(view)

    return call


def _pow(view) -> tuple[str, str, list[str]]:
    """``x ** y`` of two tensors, or of a tensor and a constant scalar exponent."""
    if view.is_data(1):
        return "aten.pow.Tensor_Tensor", "t0, t1", _same_rank(view)
    exponent = np.asarray(view.const(1, "exponent"))
    if exponent.size != 1:
        raise Refuse(f"Pow by a constant tensor {list(exponent.shape)}")
    number = exponent.reshape(()).item()
    if isinstance(number, float) and not np.isfinite(number):
        raise Refuse(f"Pow by {number}")
    return "aten.pow.Tensor_Scalar", f"t0, {number!r}", [view.value(0)]


def _cumsum(view) -> tuple[str, str, list[str]]:
    if int(view.attr("exclusive", 0)) or int(view.attr("reverse", 0)):
        raise Refuse("an exclusive or reversed CumSum: no single ATen op computes it")
    axis = np.asarray(view.const(1, "axis"))
    if axis.size != 1 or axis.dtype.kind not in "iu":
        raise Refuse("a CumSum axis that is not one integer")
    rank = len(view.in_shape(0))
    dim = int(axis.reshape(()))
    if not -rank <= dim < rank or dim % rank == 0:
        raise Refuse(f"a CumSum along axis {dim} (the batch dim or none)")
    return "aten.cumsum.default", f"t0, {dim % rank}", [view.value(0)]


def _reduce_dims(view, since: int) -> tuple[list[int], bool]:
    """The reduced dims (never the batch's) and keepdims; ``axes`` is an input from opset
    ``since``, an attribute before."""
    rank = len(view.in_shape(0))
    if view.opset >= since:
        axes = np.asarray(view.const(1, "axes")).reshape(-1).tolist() if view.has(1) else []
    else:
        axes = list(view.attr("axes", []))
    if not axes:
        raise Refuse("a reduction over every dim includes the batch")
    if any(not -rank <= int(a) < rank for a in axes):
        raise Refuse(f"reducing axes {axes} of a {rank}-d tensor")
    dims = sorted({int(a) % rank for a in axes})
    if 0 in dims:
        raise Refuse("a reduction over the batch dim")
    return dims, bool(int(view.attr("keepdims", 1)))


def _reduce(op: str, since: int, before: str = "") -> Callable:
    """A reduction: ``op(t0, [before,] dims, keepdim)``."""

    def call(view) -> tuple[str, str, list[str]]:
        if not view.has(1) and int(view.attr("noop_with_empty_axes", 0)):
            raise Refuse("a reduction with noop_with_empty_axes and no axes")
        dims, keep = _reduce_dims(view, since)
        return op, f"t0, {before}{dims!r}, {keep!r}", [view.value(0)]

    return call


#: ONNX op -> (its view -> ATen overload, call text, tensor inputs)
ATEN: dict[str, Callable] = {name: _unary(op) for name, op in UNARY.items()}
ATEN.update(
    {
        "Pow": _pow,
        "Max": _binary("aten.maximum.default"),
        "Min": _binary("aten.minimum.default"),
        "CumSum": _cumsum,
        "ReduceL1": _reduce("aten.linalg_vector_norm.default", 18, "1, "),
        "ReduceL2": _reduce("aten.linalg_vector_norm.default", 18, "2, "),
        "ReduceMax": _reduce("aten.amax.default", 18),
        "ReduceMin": _reduce("aten.amin.default", 18),
        "ReduceLogSumExp": _reduce("aten.logsumexp.default", 18),
    }
)


def opaque(view) -> str:
    """The ``aten`` statement of ONNX node ``view`` (``ATEN``), named in a note as the torch
    importer names its opaque statements."""
    op, call, inputs = ATEN[view.op](view)
    name = view.m.add_stmt(view.index, "aten", inputs, None, {"op": op, "call": call})
    view.note(
        f"opaque: {name} = aten({op}): no registry operator computes onnx::{view.op}; run as is"
    )
    return name
