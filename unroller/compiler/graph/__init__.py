"""From the typed AST to a checked node graph.

The builder inlines block calls (names prefixed by ``OUT.``), validates every call
against the operator registry, infers shapes and dtypes, sizes parameters and
buffers, and records consumers (fan-out), which values need a gradient and which
nodes need a backward step. Statement order is a topological order, because a name
must be defined before it is used and is assigned once.

Sizes are bounded so that nothing the generated module builds can ask for terabytes:
every dim of every tensor (declared, inferred, parameter) is at most ``shapes.MAX_DIM``,
every tensor holds at most ``shapes.MAX_ELEMENTS`` elements per sample, all parameters
together at most ``MAX_PARAMETERS``; block calls nest at most ``MAX_BLOCK_DEPTH`` deep and
a model inlines to at most ``MAX_NODES`` operator calls.

This module runs the build and is where the rest of the package imports the graph from;
each job of the build is a module of its own, readable alone:

- ``graph_model``: the data model (``Graph``, ``Node``, ``Value`` ...) and the limits;
- ``graph_args``: keyword arguments checked and normalized, constants in model syntax;
- ``graph_scope``: names, the values and constants a statement refers to;
- ``graph_ops``: operator calls made nodes (arity, arguments, shapes, extras);
- ``graph_params``: parameters and buffers, the model's budget, ``frozen`` and ``tied_``;
- ``graph_blocks``: block calls inlined;
- ``graph_analysis``: the returned loss, gradients and backward's saved arguments.
"""

from __future__ import annotations

from unroller.compiler.ast import Call, ModelAST
from unroller.compiler.dtypes import FLOAT_DTYPES
from unroller.compiler.graph.analysis import analyse, outputs
from unroller.compiler.graph.args import (
    MAX_FLOAT,
    MAX_INT,
    BatchSymbol,
    describe_type,
    explicit_kwargs,
    normalize_arg,
    normalized_default,
    render_const,
)
from unroller.compiler.graph.blocks import BlockCalls
from unroller.compiler.graph.model import (
    MAX_BLOCK_DEPTH,
    MAX_NODES,
    MAX_PARAMETERS,
    BlockCall,
    Extra,
    Graph,
    Node,
    ParamTensor,
    SavedArg,
    Value,
)
from unroller.compiler.graph.ops import OperatorCalls
from unroller.compiler.graph.params import FROZEN, TIED_PREFIX, check_ties
from unroller.compiler.graph.scope import Scope
from unroller.compiler.precision import get as get_precision
from unroller.compiler.registry import OpSpec, load_registry
from unroller.compiler.shapes import TensorType, size_problem
from unroller.errors import ModelError, did_you_mean

__all__ = [
    "FROZEN",
    "MAX_BLOCK_DEPTH",
    "MAX_FLOAT",
    "MAX_INT",
    "MAX_NODES",
    "MAX_PARAMETERS",
    "TIED_PREFIX",
    "BatchSymbol",
    "BlockCall",
    "Extra",
    "Graph",
    "GraphBuilder",
    "Node",
    "ParamTensor",
    "SavedArg",
    "Value",
    "build_graph",
    "describe_type",
    "explicit_kwargs",
    "normalize_arg",
    "normalized_default",
    "render_const",
]


class GraphBuilder:
    """One build of one model: the declarations, then each statement in order (an
    operator call or a block call), then the checks that need the whole graph."""

    def __init__(
        self, model: ModelAST, registry: dict[str, OpSpec] | None = None, precision: str = "fp32"
    ):
        self.model = model
        self.ops = registry if registry is not None else load_registry()
        self.precision = get_precision(precision)
        self.calls = OperatorCalls(
            self.ops, self.precision.dtype or _float_dtype(model), self.precision
        )
        self.blocks = BlockCalls(self.ops, self._statement)

    def build(self) -> Graph:
        """The model's checked graph, or the first ``ModelError`` in it."""
        model = self.model
        scope = Scope({}, {}, set(), {}, "", (), ())
        inputs = self._declarations(scope)
        self.blocks.register(model.blocks)
        for stmt in model.stmts:
            self._statement(stmt, scope)
        check_ties(self.calls.nodes)
        self.calls.casts.rename_clashes(self.calls.nodes)
        loss, preds = outputs(model, scope)
        graph = Graph(
            name=model.name,
            inputs=inputs,
            nodes=self.calls.nodes,
            loss=loss,
            preds=preds,
            float_dtype=self.calls.float_dtype,
            filename=model.filename,
            source=model.source,
            precision=self.precision.name,
        )
        analyse(graph)
        return graph

    def _declarations(self, scope: Scope) -> list[Value]:
        """The model's inputs and targets, defined in ``scope``; every floating-point one
        has the model's float dtype (the first one's)."""
        model = self.model
        inputs: list[Value] = []
        first_float = next((d for d in model.decls if d.dtype in FLOAT_DTYPES), None)
        for decl in model.decls:
            if first_float and decl.dtype in FLOAT_DTYPES and decl.dtype != first_float.dtype:
                raise ModelError(
                    f"{decl.kind} '{decl.name}' is {decl.dtype} but {first_float.kind} "
                    f"'{first_float.name}' (line {first_float.loc.line}) is {first_float.dtype}: "
                    "every floating-point input and target has the same dtype",
                    decl.dtype_loc,
                )
            problem = size_problem(tuple(decl.dims))
            if problem:
                raise ModelError(f"{decl.kind} '{decl.name}' is too large: {problem}", decl.loc)
            dtype = decl.dtype
            if self.precision.dtype and dtype in FLOAT_DTYPES:  # a plain low precision's
                dtype = self.precision.dtype
            value = Value(decl.name, TensorType(dtype, tuple(decl.dims)), decl.loc)
            value.kind = decl.kind
            scope.define(decl.name, value, decl.loc)
            inputs.append(value)
        return inputs

    def _statement(self, stmt: Call, scope: Scope) -> None:
        """Build one statement in ``scope`` and define its target there."""
        if stmt.op in self.blocks:
            value = self.blocks.call(stmt, scope)
        elif stmt.op in self.ops:
            value = self.calls.call(stmt, scope)
        else:
            known = list(self.ops) + list(self.blocks.blocks)
            raise ModelError(
                f"unknown operator '{stmt.op}'{did_you_mean(stmt.op, known)}", stmt.op_loc
            )
        scope.define(stmt.target, value, stmt.loc)


def _float_dtype(model: ModelAST) -> str:
    """The model's floating-point dtype: its first float input's (or target's), else f32.
    Parameters and floats made from integers (an embedding's output) take it."""
    first_float = next((d for d in model.decls if d.dtype in FLOAT_DTYPES), None)
    return first_float.dtype if first_float else "f32"


def build_graph(
    model: ModelAST, registry: dict[str, OpSpec] | None = None, precision: str = "fp32"
) -> Graph:
    """The checked graph of a parsed model (see the module's docstring), built for a
    ``--precision`` (``unroller.compiler.precision``: a mixed one writes its casts)."""
    return GraphBuilder(model, registry, precision).build()
