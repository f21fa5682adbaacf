"""Names while a model is built: which value or constant a name in a statement means.

A statement refers to values by name (positional arguments) and to constants in its
keyword values (literals, block parameters, integer arithmetic of them). A block body sees
only its own names, so each inlined call gets its own ``Scope``; every full name (``OUT.``
prefixed) is assigned once in the whole model, which the scopes share one record of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unroller.compiler import shapes
from unroller.compiler.ast import BinOp, Call, Const, Expr, Loc, Ref, TupleExpr
from unroller.compiler.graph.args import MAX_INT, BatchSymbol, render_const
from unroller.compiler.graph.model import BlockCall, Value
from unroller.errors import ModelError, did_you_mean


@dataclass
class Scope:
    """Names visible while building: values, and (inside a block) constant parameters."""

    values: dict[str, Value]
    consts: dict[str, Any]
    value_params: set[str]
    defined_at: dict[str, Loc]
    prefix: str
    blocks: tuple[BlockCall, ...]
    stack: tuple[str, ...]  # block names being inlined, for recursion errors
    #: every full name defined so far, in any scope (shared by a scope and those inside it)
    all_names: dict[str, Loc] = field(default_factory=dict)

    def inner(self, target: str, block: str) -> Scope:
        """The empty scope of the body of block ``block`` called as ``target = block(...)``:
        its names are prefixed ``target.``, and ``block`` joins the stack of calls."""
        return Scope(
            values={},
            consts={},
            value_params=set(),
            defined_at={},
            prefix=f"{self.prefix}{target}.",
            blocks=(),
            stack=(*self.stack, block),
            all_names=self.all_names,
        )

    def define(self, local: str, value: Value, loc: Loc) -> None:
        """Bind ``local`` to ``value``, refusing a name already bound here or a full name
        bound anywhere in the model (every name is assigned once)."""
        full = self.prefix + local
        if local in self.values or local in self.consts or full in self.all_names:
            first = self.defined_at.get(local) or self.all_names.get(full)
            where = f" (first defined at line {first.line})" if first else ""
            raise ModelError(
                f"'{full}' is already defined{where}; every name is assigned once", loc
            )
        self.values[local] = value
        self.defined_at[local] = loc
        self.all_names[full] = loc

    def lookup(self, ref: Ref) -> Value:
        """The value a positional argument names, or an error saying what it is instead."""
        if ref.name in self.values:
            return self.values[ref.name]
        if ref.name in self.consts:
            raise ModelError(
                f"'{ref.name}' is a constant block parameter (bound by keyword), not a value",
                ref.loc,
            )
        candidates = list(self.values) + list(self.consts)
        if ref.name.replace(".", "").isdigit() and ref.name[0] != ".":
            # `relu(3)`: a number where a value name goes (names may start with a number,
            # `0.weight` of a root nn.Sequential, so this is found here, not by the parser)
            raise ModelError(
                f"unexpected number '{ref.name}' (expected a value name, a keyword argument "
                "or ')')",
                ref.loc,
                "positional arguments are value names; give constants as key=value",
            )
        raise ModelError(
            f"undefined name '{ref.name}'{did_you_mean(ref.name, candidates)}", ref.loc
        )

    def kwargs(self, stmt: Call) -> dict[str, Any]:
        """The statement's keyword values, each evaluated to a constant."""
        # The parser refuses a keyword given twice, so each name comes once here.
        return {kw.name: self.constant(kw.value) for kw in stmt.kwargs}

    def constant(self, expr: Expr) -> Any:
        """The constant a keyword value denotes; a tensor value's name, or a name that is
        neither a block parameter nor the batch size ``N``, is refused."""
        if isinstance(expr, Const):
            return expr.value
        if isinstance(expr, TupleExpr):
            return tuple(self.constant(item) for item in expr.items)
        if isinstance(expr, BinOp):
            return _arith(self, expr)
        if expr.name in self.consts:
            return self.consts[expr.name]
        if expr.name in self.value_params or expr.name in self.values:
            raise ModelError(
                f"'{expr.name}' is a tensor value; keyword arguments take constants", expr.loc
            )
        if expr.name == shapes.BATCH:
            # The batch size, symbolic: only a size argument (expand's) accepts it; every
            # other argument type refuses it in normalize_arg with a message saying so.
            return BatchSymbol(shapes.BATCH)
        if expr.name.lower() in ("nan", "inf", "infinity"):
            raise ModelError(
                f"undefined constant '{expr.name}': there is no NaN or infinity literal; "
                "keyword values are finite numbers",
                expr.loc,
            )
        hint = did_you_mean(expr.name, self.consts)
        raise ModelError(
            f"undefined constant '{expr.name}'{hint}: keyword values are numbers, true/false, "
            f"strings, tuples, or parameters of the enclosing block",
            expr.loc,
        )


def _arith(scope: Scope, expr: BinOp) -> int:
    """Integer arithmetic of literals and block parameters (``planes * 4``, ``k // 2``)."""
    operands = [expr.right] if expr.left is None else [expr.left, expr.right]
    values = []
    for operand in operands:
        value = scope.constant(operand)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelError(
                f"arithmetic in a keyword value takes integers, got {render_const(value)}",
                operand.loc,
            )
        values.append(value)
    if expr.op == "neg":
        result = -values[0]
    elif expr.op == "+":
        result = values[0] + values[1]
    elif expr.op == "-":
        result = values[0] - values[1]
    elif expr.op == "*":
        result = values[0] * values[1]
    else:  # "//": floor division, as Python and torch shape arithmetic
        if values[1] == 0:
            raise ModelError("integer division by zero in a keyword value", expr.loc)
        result = values[0] // values[1]
    if abs(result) > MAX_INT:
        raise ModelError(
            f"arithmetic in a keyword value gives {result:,}, beyond the integer limit "
            f"of {MAX_INT:,}",
            expr.loc,
        )
    return result
