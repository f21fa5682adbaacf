"""Operator calls: one model statement ``out = op(inputs..., key=value...)`` made a node.

A call is checked against the operator registry (tensor arity, keyword arguments), its
output type and derived values inferred by the operator's shape rule, its parameters,
buffers and extra outputs sized, and the node linked into the graph as its inputs'
consumer. Errors point at what is wrong in the statement as written: the argument a
shape rule blames, the keyword that is out of range.
"""

from __future__ import annotations

import keyword
from typing import Any

from unroller.compiler import shapes
from unroller.compiler.ast import Call
from unroller.compiler.dtypes import FLOAT_DTYPES
from unroller.compiler.graph.args import check_args, render_const, statement_text
from unroller.compiler.graph.casts import Casts
from unroller.compiler.graph.model import MAX_NODES, Extra, Node, Value
from unroller.compiler.graph.params import (
    ParameterBudget,
    freeze_words,
    frozen_params,
    param_tensors,
    share_word,
    shared_layer,
    tie_words,
    tied_params,
)
from unroller.compiler.graph.scope import Scope
from unroller.compiler.precision import DEFAULT, PRECISIONS, Precision
from unroller.compiler.registry import OpSpec, eval_expr
from unroller.compiler.shapes import ShapeError, TensorType, size_problem
from unroller.errors import ModelError


class OperatorCalls:
    """Makes the nodes of a model's operator calls, in statement order (a topological
    order: a name is defined before it is used), and counts their parameters.

    ``float_dtype`` is the model's floating-point dtype: free parameters and floats made
    from integers (an embedding's output) take it.
    """

    def __init__(
        self, ops: dict[str, OpSpec], float_dtype: str, precision: Precision | None = None
    ):
        self.ops = ops
        self.float_dtype = float_dtype
        self.casts = Casts(precision or PRECISIONS[DEFAULT], ops.get("cast"), float_dtype)
        self.nodes: list[Node] = []
        self.by_name: dict[str, Node] = {}  # what a ``shares="NAME"`` looks up
        self.budget = ParameterBudget()

    def call(self, stmt: Call, scope: Scope) -> Value:
        """The value a statement calling an operator defines, its node made and linked."""
        op = self.ops[stmt.op]
        full_name = scope.prefix + stmt.target
        self._check_arity(op, stmt)
        if len(self.nodes) >= MAX_NODES:
            raise ModelError(
                f"the model has more than {MAX_NODES:,} operator calls once blocks are "
                f"inlined (here: '{full_name}')",
                stmt.op_loc,
            )
        inputs = [scope.lookup(ref) for ref in stmt.args]
        given = scope.kwargs(stmt)
        ties = tie_words(op, stmt)
        freezes = freeze_words(op, stmt)
        shares = share_word(op, stmt)
        plain = {
            k: v
            for k, v in given.items()
            if k not in ties.values() and k not in freezes and k != shares
        }
        args = check_args(op, stmt, plain)
        has_params = bool(shares or op.params_for(args) or op.buffers)
        op = self._low_precision_variant(op, inputs)
        inputs = self.casts.inputs(op, stmt, scope, inputs, has_params, self.nodes)
        result = self._output_of(op, stmt, full_name, inputs, args)
        env = {**args, **result.derived}
        float_dtype = next(
            (v.type.dtype for v in inputs if v.type.dtype in FLOAT_DTYPES), result.type.dtype
        )
        # a mixed precision keeps every parameter in the model's float dtype (master weights)
        held = self.float_dtype if self.casts.precision.mixed else float_dtype
        params = param_tensors(op, op.params_for(args), True, full_name, result, args, held)
        buffers = param_tensors(op, op.buffers, False, full_name, result, args, held)
        owner = None
        if shares:  # the earlier layer's own tensors: no new key, nothing more to count
            others = {*ties.values(), *freezes}
            owner = shared_layer(op, stmt, given, self.by_name, env, params + buffers, others)
            params, buffers = owner.params, owner.buffers
        for name in frozen_params(op, stmt, given, freezes, params):
            next(p for p in params if p.name == name).trainable = False
        if owner is None:
            self.budget.add(op, stmt, full_name, params + buffers)
        value = Value(full_name, result.type, stmt.loc)
        args_text = [v.name for v in inputs]
        kw_text = [f"{k}={render_const(v)}" for k, v in given.items()]
        node = Node(
            name=full_name,
            op=op,
            inputs=inputs,
            args=args,
            derived=result.derived,
            output=value,
            params=params,
            buffers=buffers,
            extras=self._extras(op, inputs, result.type, env, (float_dtype, held)),
            loc=stmt.loc,
            text=f"{full_name} = {op.name}({', '.join(args_text + kw_text)})",
            local_text=statement_text(stmt),
            blocks=scope.blocks,
            index=len(self.nodes),
            ties=dict(owner.ties) if owner else tied_params(op, stmt, given, ties, params),
            shares=owner.name if owner else "",
            cast_params=self.casts.param_dtype(op, has_params),
        )
        value.producer = node
        for position, v in enumerate(inputs):
            v.consumers.append((node, position))
        self.nodes.append(node)
        self.by_name[full_name] = node
        return value

    def _low_precision_variant(self, op: OpSpec, inputs: list[Value]) -> OpSpec:
        """The registry's ``low_precision`` op in place of ``op`` when a mixed precision
        hands it its first input in the low dtype (cross entropy on bf16 logits computes in
        float32 itself, chunk by chunk, instead of after a float32 cast of them all)."""
        low = self.casts.precision.low
        if op.low_precision is None or low is None or not inputs:
            return op
        return self.ops[op.low_precision] if inputs[0].type.dtype == low else op

    @staticmethod
    def _check_arity(op: OpSpec, stmt: Call) -> None:
        """Refuse a call with fewer or more tensor arguments than the operator takes."""
        if op.variadic:
            if not stmt.args:
                raise ModelError(f"{op.name} needs at least one tensor argument", stmt.op_loc)
        elif not op.required_inputs <= len(stmt.args) <= len(op.inputs):
            count = len(op.inputs)
            if op.optional_inputs:
                count = f"{op.required_inputs} to {count}"
            raise ModelError(
                f"{op.name} takes {count} tensor argument(s) "
                f"({', '.join(op.inputs)}), got {len(stmt.args)}",
                stmt.args[len(op.inputs)].loc if len(stmt.args) > len(op.inputs) else stmt.op_loc,
            )

    def _output_of(
        self, op: OpSpec, stmt: Call, full_name: str, inputs: list[Value], args: dict[str, Any]
    ) -> shapes.ShapeResult:
        """The operator's output type and derived values, in the model's float dtype.

        A shape rule's failure is reported at the argument it blames, and a free tensor
        (``parameter``) is named after its attribute, which must not be a Python keyword.
        """
        try:
            result = shapes.rule(op.shape)(op.name, [v.type for v in inputs], args)
        except ShapeError as exc:
            raise self._shape_failure(exc, stmt, full_name, inputs) from None
        if op.free:  # the model's float dtype; the parameter's attribute name
            attribute = full_name.rpartition(".")[2]
            if keyword.iskeyword(attribute):  # `lambda = parameter(...)`: no such attribute
                raise ModelError(
                    f"'{full_name}': a {op.name} is held as the attribute '{attribute}' of the "
                    "generated module, and a Python keyword cannot be one; rename it",
                    stmt.loc,
                )
            result.type = TensorType(self.float_dtype, result.type.shape)
            result.derived = {**result.derived, "name": full_name.rpartition(".")[2]}
        if result.type.dtype == shapes.MODEL_FLOAT:  # a float made from integers (embedding)
            result.type = TensorType(self.float_dtype, result.type.shape)
        problem = size_problem(result.type.shape)
        if problem:
            raise ModelError(
                f"{full_name}: the output of {op.name} would be {result.type}: {problem}",
                stmt.op_loc,
            )
        return result

    @staticmethod
    def _shape_failure(
        exc: ShapeError, stmt: Call, full_name: str, inputs: list[Value]
    ) -> ModelError:
        """A shape rule's error placed at the argument or keyword it names, with a hint
        pointing at the declaration when the culprit is a model input or target."""
        loc, hint = stmt.op_loc, None
        if exc.input_index is not None and exc.input_index < len(stmt.args):
            loc = stmt.args[exc.input_index].loc
            culprit = inputs[exc.input_index]
            if culprit.kind in ("input", "target"):
                hint = (
                    f"{culprit.kind} '{culprit.name}' is declared {culprit.type} at line "
                    f"{culprit.loc.line}"
                )
        elif exc.arg is not None:
            loc = next((kw.loc for kw in stmt.kwargs if kw.name == exc.arg), loc)
        return ModelError(f"{full_name}: {exc.message}", loc, hint)

    @staticmethod
    def _extras(
        op: OpSpec,
        inputs: list[Value],
        output: TensorType,
        env: dict[str, Any],
        dtypes: tuple[str, str],
    ) -> list[Extra]:
        """The call's extra tensors (saved statistics, masks), each shaped like the output,
        like an input, or by its own expression; ``dtypes``: (the call's float dtype, its
        parameters'): an activation extra (a recurrent layer's gates) has the first,
        statistics (a norm's mean, attention's lse) the second, float32 under a mixed
        precision as the kernels keep them."""
        float_dtype, statistics = dtypes
        extras = []
        input_types = dict(zip(op.input_names(len(inputs)), (v.type for v in inputs)))
        for extra in op.extras:
            if extra.like is not None:
                like = output if extra.like == "output" else input_types[extra.like]
                etype = TensorType(extra.dtype or like.dtype, like.shape)
            else:
                shape = tuple(eval_expr(extra.shape or "()", env))
                default = float_dtype if extra.name in op.activations else statistics
                etype = TensorType(extra.dtype or default, shape)
            present = extra.when is None or bool(eval_expr(extra.when, env))
            extras.append(Extra(extra.name, etype, present))
        return extras
