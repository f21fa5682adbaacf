"""Keyword arguments of a model statement: checked against the registry, brought to the
kernels' form, and written back in model syntax.

The graph builder checks every call's keywords here; the lowering and the code generator
read ``explicit_kwargs`` to leave registry defaults out of generated calls. Both sides use
the one ``normalize_arg``, so a default written out and a default left out are the same
value (tests check this).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from unroller.compiler import shapes
from unroller.compiler.ast import BinOp, Call, Expr, Loc, Ref, TupleExpr
from unroller.compiler.registry import ArgSpec, OpSpec
from unroller.compiler.shapes import MAX_DIM
from unroller.errors import ModelError, did_you_mean

#: The largest magnitude of a float argument (the float32 range: kernels take float32).
MAX_FLOAT = 3.4e38
#: The largest magnitude of an integer argument (and of arithmetic in keyword values).
MAX_INT = 2**31 - 1
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "//": 2, "neg": 3}


def render_const(value: Any) -> str:
    """A constant in model syntax; strings as repr() literals so no raw text escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BatchSymbol):
        return shapes.BATCH
    if isinstance(value, tuple):
        inner = ", ".join(render_const(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, str):
        return repr(value)
    return repr(value)


def statement_text(stmt: Call) -> str:
    """An operator call as written in the model file (block parameters by name)."""

    def expr(e: Expr) -> str:
        if isinstance(e, Ref):
            return e.name
        if isinstance(e, TupleExpr):
            items = [expr(i) for i in e.items]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if isinstance(e, BinOp):
            return _arith_text(e)
        return render_const(e.value)

    def _arith_text(e: BinOp) -> str:
        def side(child: Expr, right: bool) -> str:
            """A child in parentheses where it binds looser than ``e`` (or equally, on the
            right: ``a - (b - c)``)."""
            text = expr(child)
            if isinstance(child, BinOp) and child.op != "neg":
                outer = _PRECEDENCE[e.op]
                if _PRECEDENCE[child.op] < outer or right and _PRECEDENCE[child.op] == outer:
                    return f"({text})"
            return text

        if e.op == "neg":
            return f"-{side(e.right, True)}"
        assert e.left is not None
        return f"{side(e.left, False)} {e.op} {side(e.right, True)}"

    parts = [r.name for r in stmt.args] + [f"{kw.name}={expr(kw.value)}" for kw in stmt.kwargs]
    return f"{stmt.target} = {stmt.op}({', '.join(parts)})"


# -- argument validation -------------------------------------------------------------------


class BatchSymbol(str):
    """A bare ``N`` written as a keyword value (the batch size), told apart from the string
    ``"N"``: only ``size`` arguments take it (``expand(t, size=(N, -1, -1))``)."""


def _has_batch_symbol(value: Any) -> bool:
    """Whether ``N`` appears in ``value``, alone or in a tuple (nested ones too)."""
    if isinstance(value, tuple):
        return any(_has_batch_symbol(v) for v in value)
    return isinstance(value, BatchSymbol)


def describe_type(spec: ArgSpec) -> str:
    """What an argument of ``spec``'s type takes, in words, for error messages."""
    return {
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "str": "a string"
        + (f": one of {', '.join(map(repr, spec.choices))}" if spec.choices else ""),
        "pair": "an integer or a pair (h, w)",
        "scale": "a number or a pair (h, w)",
        "dims": "a tuple of integers",
        "size": "a tuple of sizes (positive integers, -1 to keep a dim, N for the batch)",
    }[spec.type]


def normalize_arg(op: str, spec: ArgSpec, value: Any, loc: Loc) -> Any:
    """Check one keyword value against its spec and bring it to the kernels' form."""

    def bad(why: str = "") -> ModelError:
        got = render_const(value)
        return ModelError(
            f"{op}: argument '{spec.name}' must be {describe_type(spec)}{why}, got {got}", loc
        )

    if value is None and spec.optional:
        return None
    if _has_batch_symbol(value) and spec.type != "size":
        raise ModelError(
            f"{op}: argument '{spec.name}' must be {describe_type(spec)}, got N: the batch "
            "size N may appear only in a size tuple (as expand's size=(N, -1, -1))",
            loc,
        )
    if spec.type in ("int", "float", "bool", "str"):
        return _normalize_scalar(spec, value, bad)
    return _normalize_tuple(spec, value, bad)


def _is_int(v: Any) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` to Python, not to a model)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return _is_int(v) or isinstance(v, float)


def _check_bounds(spec: ArgSpec, v: float, bad: Callable[[str], ModelError]) -> None:
    """Refuse a number outside the spec's range, or beyond what any kernel can take."""
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(" (finite)")
    if spec.min is not None and v < spec.min:
        raise bad(f" >= {spec.min}")
    if spec.max is not None and v > spec.max:
        raise bad(f" <= {spec.max}")
    # Whatever the registry says, no kernel takes an integer beyond int32 or a float
    # beyond float32 (torch refuses to convert it at run time).
    if _is_int(v) and abs(v) > MAX_DIM:
        raise bad(f" (at most {MAX_DIM:,} in magnitude)")
    if isinstance(v, float) and abs(v) > MAX_FLOAT:
        raise bad(f" (at most {MAX_FLOAT:g} in magnitude)")


def _normalize_scalar(spec: ArgSpec, value: Any, bad: Callable[[str], ModelError]) -> Any:
    """An ``int``, ``float``, ``bool`` or ``str`` keyword value, checked."""
    if spec.type == "int":
        if not _is_int(value):
            raise bad("")
        _check_bounds(spec, value, bad)
        return value
    if spec.type == "float":
        if not _is_num(value):
            raise bad("")
        _check_bounds(spec, float(value), bad)
        return float(value)
    if spec.type == "bool":
        if not isinstance(value, bool):
            raise bad("")
        return value
    if not isinstance(value, str) or (spec.choices and value not in spec.choices):
        raise bad("")
    return value


def _normalize_tuple(spec: ArgSpec, value: Any, bad: Callable[[str], ModelError]) -> Any:
    """A ``pair``, ``scale``, ``dims`` or ``size`` keyword value, checked, as a tuple
    (a single number stands for the pair of it, or the one-element tuple)."""
    if spec.type in ("pair", "scale"):
        check = _is_int if spec.type == "pair" else _is_num
        items = (value, value) if check(value) else value
        if not isinstance(items, tuple) or len(items) != 2 or not all(check(v) for v in items):
            raise bad("")
        for v in items:
            if spec.type == "scale" and v <= 0:
                raise bad(" > 0")
            _check_bounds(spec, v, bad)
        return tuple(items) if spec.type == "pair" else tuple(float(v) for v in items)
    if spec.type == "dims":
        items = (value,) if _is_int(value) else value
        if not isinstance(items, tuple) or not all(_is_int(v) for v in items):
            raise bad("")
        if not items and not spec.empty:
            raise bad("")
        for v in items:
            _check_bounds(spec, v, bad)
        return tuple(items)
    if spec.type == "size":
        items = value if isinstance(value, tuple) else (value,)
        if not items or not all(isinstance(v, BatchSymbol) or _is_int(v) for v in items):
            raise bad("")
        for v in items:
            if _is_int(v) and (v == 0 or v < -1):
                raise bad("")
            if _is_int(v):
                _check_bounds(spec, v, bad)
        return tuple(shapes.BATCH if isinstance(v, BatchSymbol) else v for v in items)
    raise AssertionError(spec.type)


def check_args(op: OpSpec, stmt: Call, given: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments, every one of ``op``'s: the keywords ``given`` checked and
    normalized, the others filled from their registry defaults; an unknown keyword, or a
    required one left out, is refused where it is written."""
    locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
    for kw in stmt.kwargs:
        if kw.name not in given:
            continue  # a ``tied_`` or ``frozen`` keyword (``unroller.compiler.graph.params``)
        if kw.name not in op.args:
            expected = ", ".join(op.args) or "no keyword arguments"
            raise ModelError(
                f"{op.name} has no argument '{kw.name}'{did_you_mean(kw.name, op.args)} "
                f"(it takes: {expected})",
                kw.loc,
            )
    args: dict[str, Any] = {}
    for name, spec in op.args.items():
        if name in given:
            args[name] = normalize_arg(op.name, spec, given[name], locs[name])
        elif spec.required:
            raise ModelError(
                f"{op.name} needs the argument '{name}' ({describe_type(spec)})", stmt.op_loc
            )
    for name, spec in op.args.items():
        if name not in args:
            if spec.default_from is not None:
                args[name] = args[spec.default_from]
            else:
                args[name] = normalize_arg(op.name, spec, spec.default, stmt.op_loc)
    return args


def normalized_default(op: OpSpec, name: str) -> Any:
    """The registry default of argument ``name`` in the kernels' form, or ``_NO_DEFAULT``
    when it has none (a required argument, one defaulting to another, a derived value)."""
    spec = op.args.get(name)
    if spec is None or spec.default_from is not None or spec.required:
        return _NO_DEFAULT
    return normalize_arg(op.name, spec, spec.default, Loc(0, 0))


def explicit_kwargs(op: OpSpec, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` without the arguments equal to their registry default and without derived
    values that are None ("not needed": kernels default them to None): generated calls leave
    those to the callee, whose defaults are the registry's (tests check this)."""
    return {
        k: v
        for k, v in values.items()
        if normalized_default(op, k) != v and not (v is None and k not in op.args)
    }


_NO_DEFAULT = object()
