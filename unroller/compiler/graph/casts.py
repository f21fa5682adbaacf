"""A mixed precision's casts, written as ``cast`` statements while the graph is built.

Before an operator call is made a node, ``Casts.inputs`` asks the precision policy
(``unroller.compiler.precision``) which dtype the op runs in and replaces each float input
of another dtype by that input cast: a node of the registry's ``cast`` operator, made
right before the call, in the call's block instance (so a block's casts are part of its
function), named ``VALUE.DTYPE`` (``layers.0.norm2.bf16``). One cast serves every call of
the same instance that needs the value in that dtype. The call's shape rule then sees
inputs of one dtype, and its output has that dtype.
"""

from __future__ import annotations

from typing import Any

from unroller.compiler.ast import Call
from unroller.compiler.dtypes import FLOAT_DTYPES
from unroller.compiler.graph.args import render_const
from unroller.compiler.graph.model import Node, Value
from unroller.compiler.graph.scope import Scope
from unroller.compiler.precision import Precision, compute_dtype
from unroller.compiler.registry import OpSpec
from unroller.compiler.shapes import TensorType


class Casts:
    """The casts of one build under ``precision`` (none under a plain one)."""

    def __init__(self, precision: Precision, cast_op: OpSpec | None, model_dtype: str):
        self.precision = precision
        self.cast_op = cast_op
        self.model_dtype = model_dtype
        self.made: dict[tuple[int, str, str], Value] = {}
        self.nodes: list[Node] = []  # every cast node, renamed at the end if a name clashes

    def dtype_of(self, op: OpSpec, inputs: list[Value], has_params: bool) -> str | None:
        """The dtype the call runs in (None: the precision casts nothing for it)."""
        return compute_dtype(
            self.precision,
            op.precision,
            [v.type.dtype for v in inputs],
            self.model_dtype,
            has_params,
        )

    def param_dtype(self, op: OpSpec, has_params: bool) -> str:
        """The dtype the call reads its parameters in, when it is not theirs ("" else): a
        mixed precision's low dtype, for a ``lower`` op."""
        low = self.precision.low
        if has_params and op.precision == "lower" and low and low != self.model_dtype:
            return low
        return ""

    def inputs(
        self,
        op: OpSpec,
        stmt: Call,
        scope: Scope,
        inputs: list[Value],
        has_params: bool,
        nodes: list[Node],
    ) -> list[Value]:
        """``inputs`` with each float one of another dtype than the call's replaced by its
        cast (made now, appended to ``nodes``)."""
        dtype = self.dtype_of(op, inputs, has_params)
        if dtype is None or self.cast_op is None:
            return inputs
        out = []
        for ref, value in zip(stmt.args, inputs):
            if value.type.dtype == dtype or value.type.dtype not in FLOAT_DTYPES:
                out.append(value)
                continue
            key = (id(value), dtype, scope.prefix)
            if key not in self.made:
                self.made[key] = self._cast(value, ref.name, dtype, stmt, scope, nodes)
            out.append(self.made[key])
        return out

    def _cast(
        self, value: Value, local: str, dtype: str, stmt: Call, scope: Scope, nodes: list[Node]
    ) -> Value:
        op = self.cast_op
        assert op is not None
        name = f"{scope.prefix}{local}.{dtype}"
        out = Value(name, TensorType(dtype, value.type.shape), stmt.loc)
        args: dict[str, Any] = {"dtype": dtype}
        node = Node(
            name=name,
            op=op,
            inputs=[value],
            args=args,
            derived={"source": value.type.dtype},
            output=out,
            params=[],
            buffers=[],
            extras=[],
            loc=stmt.loc,
            text=f"{name} = cast({value.name}, dtype={render_const(dtype)})",
            local_text=f"{local}.{dtype} = cast({local}, dtype={render_const(dtype)})",
            blocks=scope.blocks,
            index=len(nodes),
        )
        out.producer = node
        value.consumers.append((node, 0))
        nodes.append(node)
        self.nodes.append(node)
        return out

    def rename_clashes(self, nodes: list[Node]) -> None:
        """A cast named as a statement of the model (``x.bf16 = relu(...)``, written after
        the cast was made) takes a free name instead: ``x.bf16_2``."""
        casts = {id(n) for n in self.nodes}
        written = {n.name for n in nodes if id(n) not in casts}
        taken = written | {n.name for n in self.nodes}
        for node in self.nodes:
            if node.name not in written:
                continue
            old, k = node.name, 2
            while f"{old}_{k}" in taken:
                k += 1
            node.name = node.output.name = f"{old}_{k}"
            node.text = node.text.replace(old, node.name, 1)
            taken.add(node.name)
