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
"""

from __future__ import annotations

import hashlib
import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unroller import shapes
from unroller.ast import (
    BinOp,
    Block,
    BlockParam,
    Call,
    Const,
    Expr,
    Loc,
    ModelAST,
    Ref,
    TupleExpr,
)
from unroller.dtypes import DTYPE_BYTES, FLOAT_DTYPES
from unroller.errors import ModelError, ModelWarning, did_you_mean
from unroller.registry import ArgSpec, OpSpec, eval_expr, load_registry
from unroller.shapes import (
    MAX_DIM,
    ShapeError,
    TensorType,
    size_problem,
)

#: How deeply block calls may nest (a block calling a block calling a block ...).
MAX_BLOCK_DEPTH = 32
#: The most operator calls a model may inline to (code generation takes a few ms each).
MAX_NODES = 10_000
#: The most parameter and buffer elements a model may have, all together.
MAX_PARAMETERS = 2**34
#: The largest magnitude of a float argument (the float32 range: kernels take float32).
MAX_FLOAT = 3.4e38
#: The largest magnitude of an integer argument (and of arithmetic in keyword values).
MAX_INT = 2**31 - 1
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "//": 2, "neg": 3}


@dataclass(eq=False)
class Value:
    """A tensor of the forward pass: a model input or target, or a node's output."""

    name: str
    type: TensorType
    loc: Loc
    producer: Node | None = None
    kind: str = "value"  # "input", "target" or "value"
    consumers: list[tuple[Node, int]] = field(default_factory=list)
    requires_grad: bool = False

    def __repr__(self) -> str:
        return f"Value({self.name}: {self.type})"


@dataclass(eq=False)
class ParamTensor:
    """A parameter or buffer of a node, named as in the torch.nn state dict."""

    name: str  # "weight"
    key: str  # "layer1.0.conv1.weight"
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    present: bool

    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BlockCall:
    """One level of block inlining, for comments in generated code."""

    name: str  # the full OUT name, e.g. "layer1.0"
    block: str
    text: str  # the call statement rendered in model syntax
    #: (parameter name, full name of the value bound to it) for each tensor parameter
    inputs: tuple[tuple[str, str], ...] = ()
    local_text: str = ""  # the call as written (inside a block: that block's names)
    #: where the call statement is in the model file (what an error about it points at)
    loc: Loc | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Extra:
    """An extra output of a node's forward kernel (indices, mask, batch statistics)."""

    name: str
    type: TensorType
    present: bool = True  # False: the kernel returns None for it with these arguments


@dataclass(frozen=True)
class SavedArg:
    """One argument of a node's backward kernel after the output gradient.

    Resolved once, when the graph is built, from the registry's ``saved`` list: an input
    or the output (``value``), an extra output of the forward kernel (``extra``), the
    node's parameters and buffers as one layer handle (``layer``, in place of the first
    parameter entry), or ``none`` for an extra the kernel returns as None with these
    arguments. The stash planner, the byte report and the code generator all read this.
    """

    entry: str  # the registry's saved entry ("x", "output", "save_mean"; "weight" for layer)
    kind: str  # "value", "extra", "layer" or "none"
    key: str = ""  # stash identity of a tensor: the value's name, or "node:extra"
    type: TensorType | None = None
    activation: bool = False  # a compressor may replace it

    @property
    def is_tensor(self) -> bool:
        """A runtime tensor the forward pass makes (kept for backward, maybe compressed)."""
        return self.kind in ("value", "extra")


FROZEN = "frozen"
"""``frozen=true`` on a statement with parameters (``frozen_PARAM=true``: one of them): they
do not train, as ``requires_grad_(False)`` in torch; their gradient is never computed, and a
layer whose inputs need no gradient either has no backward and keeps nothing for it (a
frozen backbone under a trained head)."""

TIED_PREFIX = "tied_"
"""``tied_PARAM="KEY"`` on a statement with parameters: its PARAM is the tensor that the
state-dict key KEY names (another statement's parameter), as ``lm_head.weight =
embed.weight`` ties them in torch; gradients of both uses add up in the one ``.grad``."""
_KEY_PART = r"(?:[A-Za-z_][A-Za-z0-9_]*|0|[1-9][0-9]*)"
_TIED_KEY = re.compile(rf"{_KEY_PART}(?:\.{_KEY_PART})*")


@dataclass(eq=False)
class Node:
    """One operator call: ``output = op(inputs..., args...)``."""

    name: str
    op: OpSpec
    inputs: list[Value]
    args: dict[str, Any]
    derived: dict[str, Any]
    output: Value
    params: list[ParamTensor]
    buffers: list[ParamTensor]
    extras: list[Extra]
    loc: Loc
    text: str  # the statement in model syntax, with full names
    local_text: str = ""  # the statement as written (inside a block: the block's own names)
    blocks: tuple[BlockCall, ...] = ()
    index: int = 0
    needs_backward: bool = False
    saved: tuple[SavedArg, ...] = ()  # what the backward kernel reads (needs_backward only)
    #: parameters that are another statement's tensor (``tied_weight="emb.weight"``):
    #: parameter name -> the state-dict key of the tensor it is
    ties: dict[str, str] = field(default_factory=dict)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.op.input_names(len(self.inputs))

    @property
    def layer(self) -> str:
        """The state-dict prefix of the module holding this node's parameters and buffers:
        the node's own name, or for a free parameter its parent ("" at the top level)."""
        return self.name.rpartition(".")[0] if self.op.free else self.name

    @property
    def kernel_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the forward kernel."""
        values = {**self.args, **self.derived}
        return {name: values[name] for name in self.op.kernel_args}

    @property
    def backward_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the backward kernel."""
        values = {**self.args, **self.derived}
        return {name: values[name] for name in self.op.backward_args}

    @property
    def needs(self) -> tuple[bool, ...]:
        """Per input, then per trainable parameter: is that gradient needed?"""
        return tuple(v.requires_grad for v in self.inputs) + tuple(
            p.present and p.trainable for p in self.params
        )

    def __repr__(self) -> str:
        return f"Node({self.name} = {self.op.name})"


@dataclass
class Graph:
    name: str
    inputs: list[Value]  # inputs and targets, in declaration order
    nodes: list[Node]
    loss: Value
    preds: list[Value]
    float_dtype: str
    filename: str
    source: str
    warnings: list[ModelWarning] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @property
    def model_inputs(self) -> list[Value]:
        """The values ``predict()`` takes: inputs, not targets."""
        return [v for v in self.inputs if v.kind == "input"]

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


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


def _statement_text(stmt: Call) -> str:
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


@dataclass
class _Scope:
    """Names visible while building: values, and (inside a block) constant parameters."""

    values: dict[str, Value]
    consts: dict[str, Any]
    value_params: set[str]
    defined_at: dict[str, Loc]
    prefix: str
    blocks: tuple[BlockCall, ...]
    stack: tuple[str, ...]  # block names being inlined, for recursion errors


class GraphBuilder:
    def __init__(self, model: ModelAST, registry: dict[str, OpSpec] | None = None):
        self.model = model
        self.ops = registry if registry is not None else load_registry()
        self.blocks: dict[str, Block] = {}
        self.nodes: list[Node] = []
        self.all_names: dict[str, Loc] = {}
        self.warnings: list[ModelWarning] = []
        self.parameter_elements = 0
        self.float_dtype = "f32"  # the model's floating-point dtype (its first float input)

    # -- entry point -------------------------------------------------------------------

    def build(self) -> Graph:
        model = self.model
        inputs: list[Value] = []
        scope = _Scope({}, {}, set(), {}, "", (), ())
        first_float = next((d for d in model.decls if d.dtype in FLOAT_DTYPES), None)
        self.float_dtype = first_float.dtype if first_float else "f32"
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
            value = Value(decl.name, TensorType(decl.dtype, tuple(decl.dims)), decl.loc)
            value.kind = decl.kind
            self._define(scope, decl.name, value, decl.loc)
            inputs.append(value)
        for block in model.blocks:
            if block.name in self.ops:
                raise ModelError(
                    f"block '{block.name}' has the name of an operator; choose another name",
                    block.loc,
                )
            if block.name in self.blocks:
                raise ModelError(f"block '{block.name}' is defined twice", block.loc)
            self.blocks[block.name] = block
        for stmt in model.stmts:
            self._statement(stmt, scope)
        self._check_ties()
        loss, preds = self._returns(scope)
        graph = Graph(
            name=model.name,
            inputs=inputs,
            nodes=self.nodes,
            loss=loss,
            preds=preds,
            float_dtype=self.float_dtype,
            filename=model.filename,
            source=model.source,
            warnings=self.warnings,
        )
        self._analyse(graph)
        return graph

    # -- names -------------------------------------------------------------------------

    def _define(self, scope: _Scope, local: str, value: Value, loc: Loc) -> None:
        full = scope.prefix + local
        if local in scope.values or local in scope.consts or full in self.all_names:
            first = scope.defined_at.get(local) or self.all_names.get(full)
            where = f" (first defined at line {first.line})" if first else ""
            raise ModelError(
                f"'{full}' is already defined{where}; every name is assigned once", loc
            )
        scope.values[local] = value
        scope.defined_at[local] = loc
        self.all_names[full] = loc

    def _lookup(self, scope: _Scope, ref: Ref) -> Value:
        if ref.name in scope.values:
            return scope.values[ref.name]
        if ref.name in scope.consts:
            raise ModelError(
                f"'{ref.name}' is a constant block parameter (bound by keyword), not a value",
                ref.loc,
            )
        candidates = list(scope.values) + list(scope.consts)
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

    def _expr(self, scope: _Scope, expr: Expr) -> Any:
        if isinstance(expr, Const):
            return expr.value
        if isinstance(expr, TupleExpr):
            return tuple(self._expr(scope, item) for item in expr.items)
        if isinstance(expr, BinOp):
            return self._arith(scope, expr)
        if expr.name in scope.consts:
            return scope.consts[expr.name]
        if expr.name in scope.value_params or expr.name in scope.values:
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
        hint = did_you_mean(expr.name, scope.consts)
        raise ModelError(
            f"undefined constant '{expr.name}'{hint}: keyword values are numbers, true/false, "
            f"strings, tuples, or parameters of the enclosing block",
            expr.loc,
        )

    def _arith(self, scope: _Scope, expr: BinOp) -> int:
        """Integer arithmetic of literals and block parameters (``planes * 4``, ``k // 2``)."""
        operands = [expr.right] if expr.left is None else [expr.left, expr.right]
        values = []
        for operand in operands:
            value = self._expr(scope, operand)
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

    # -- statements --------------------------------------------------------------------

    def _statement(self, stmt: Call, scope: _Scope) -> None:
        if stmt.op in self.blocks:
            value = self._block_call(stmt, scope)
        elif stmt.op in self.ops:
            value = self._op_call(stmt, scope)
        else:
            known = list(self.ops) + list(self.blocks)
            raise ModelError(
                f"unknown operator '{stmt.op}'{did_you_mean(stmt.op, known)}", stmt.op_loc
            )
        self._define(scope, stmt.target, value, stmt.loc)

    def _op_call(self, stmt: Call, scope: _Scope) -> Value:
        op = self.ops[stmt.op]
        full_name = scope.prefix + stmt.target
        self._check_arity(op, stmt)
        if len(self.nodes) >= MAX_NODES:
            raise ModelError(
                f"the model has more than {MAX_NODES:,} operator calls once blocks are "
                f"inlined (here: '{full_name}')",
                stmt.op_loc,
            )
        inputs = [self._lookup(scope, ref) for ref in stmt.args]
        given = self._kwargs(stmt, scope)
        ties = self._ties(op, stmt, given)
        freezes = self._freezes(op, stmt)
        plain = {k: v for k, v in given.items() if k not in ties.values() and k not in freezes}
        args = self._check_args(op, stmt, plain)
        result = self._output_of(op, stmt, full_name, inputs, args)
        env = {**args, **result.derived}
        float_dtype = next(
            (v.type.dtype for v in inputs if v.type.dtype in FLOAT_DTYPES), result.type.dtype
        )
        params = self._param_tensors(
            op, op.params_for(args), True, full_name, result, args, float_dtype
        )
        buffers = self._param_tensors(op, op.buffers, False, full_name, result, args, float_dtype)
        for name in self._frozen_params(op, stmt, given, freezes, params):
            next(p for p in params if p.name == name).trainable = False
        self._count_parameters(op, stmt, full_name, params + buffers)
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
            extras=self._extras(op, inputs, result.type, env, float_dtype),
            loc=stmt.loc,
            text=f"{full_name} = {op.name}({', '.join(args_text + kw_text)})",
            local_text=_statement_text(stmt),
            blocks=scope.blocks,
            index=len(self.nodes),
            ties=self._tied_params(op, stmt, given, ties, params),
        )
        value.producer = node
        for position, v in enumerate(inputs):
            v.consumers.append((node, position))
        self.nodes.append(node)
        return value

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
    def _param_tensors(
        op: OpSpec,
        specs: tuple,
        trainable: bool,
        full_name: str,
        result: shapes.ShapeResult,
        args: dict[str, Any],
        float_dtype: str,
    ) -> list[ParamTensor]:
        """The parameters (or buffers) ``specs`` of one call, shapes evaluated from its
        arguments and derived values; a free tensor is keyed by the statement's name."""
        env = {**args, **result.derived}
        return [
            ParamTensor(
                name=result.derived["name"] if op.free else spec.name,
                key=full_name if op.free else f"{full_name}.{spec.name}",
                shape=tuple(eval_expr(spec.shape, env)),
                dtype=spec.dtype or float_dtype,
                trainable=trainable,
                present=spec.present(args),
            )
            for spec in specs
        ]

    def _count_parameters(
        self, op: OpSpec, stmt: Call, full_name: str, tensors: list[ParamTensor]
    ) -> None:
        """Add the call's tensors to the model's element count, refusing any tensor, or a
        model total, beyond the limits."""
        for tensor in tensors:
            problem = size_problem(tensor.shape)
            if problem:
                raise ModelError(
                    f"{full_name}: {op.name}'s {tensor.name} would be "
                    f"[{', '.join(map(str, tensor.shape))}]: {problem}",
                    stmt.op_loc,
                )
            self.parameter_elements += math.prod(tensor.shape) if tensor.present else 0
        if self.parameter_elements > MAX_PARAMETERS:
            raise ModelError(
                f"{full_name}: the model's parameters and buffers reach "
                f"{self.parameter_elements:,} elements, more than the limit of "
                f"{MAX_PARAMETERS:,} (2**34)",
                stmt.op_loc,
            )

    @staticmethod
    def _extras(
        op: OpSpec,
        inputs: list[Value],
        output: TensorType,
        env: dict[str, Any],
        float_dtype: str,
    ) -> list[Extra]:
        """The call's extra tensors (saved statistics, masks), each shaped like the output,
        like an input, or by its own expression."""
        extras = []
        input_types = dict(zip(op.input_names(len(inputs)), (v.type for v in inputs)))
        for extra in op.extras:
            if extra.like is not None:
                like = output if extra.like == "output" else input_types[extra.like]
                etype = TensorType(extra.dtype or like.dtype, like.shape)
            else:
                shape = tuple(eval_expr(extra.shape or "()", env))
                etype = TensorType(extra.dtype or float_dtype, shape)
            present = extra.when is None or bool(eval_expr(extra.when, env))
            extras.append(Extra(extra.name, etype, present))
        return extras

    def _kwargs(self, stmt: Call, scope: _Scope) -> dict[str, Any]:
        # The parser refuses a keyword given twice, so each name comes once here.
        return {kw.name: self._expr(scope, kw.value) for kw in stmt.kwargs}

    @staticmethod
    def _ties(op: OpSpec, stmt: Call, given: dict[str, Any]) -> dict[str, str]:
        """The ``tied_PARAM`` keywords of a statement: parameter name -> keyword."""
        return {
            kw.name[len(TIED_PREFIX) :]: kw.name
            for kw in stmt.kwargs
            if kw.name.startswith(TIED_PREFIX) and kw.name not in op.args
        }

    @staticmethod
    def _freezes(op: OpSpec, stmt: Call) -> dict[str, str]:
        """``frozen`` / ``frozen_PARAM`` keywords: keyword -> parameter name ("" for all)."""
        found = {}
        for kw in stmt.kwargs:
            if kw.name in op.args:
                continue
            if kw.name == FROZEN:
                found[kw.name] = ""
            elif kw.name.startswith(FROZEN + "_"):
                found[kw.name] = kw.name[len(FROZEN) + 1 :]
        return found

    @staticmethod
    def _frozen_params(
        op: OpSpec, stmt: Call, given: dict[str, Any], freezes: dict[str, str], params: list
    ) -> list[str]:
        """The parameters ``frozen=true`` / ``frozen_PARAM=true`` freeze, checked."""
        locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
        names = [p.name for p in params if p.present]
        found: list[str] = []
        for word, name in freezes.items():
            if not isinstance(given[word], bool):
                raise ModelError(
                    f"{word} takes true or false, got {render_const(given[word])}", locs[word]
                )
            if not names:
                raise ModelError(f"{op.name} has no parameters to freeze", locs[word])
            if name and name not in names:
                raise ModelError(
                    f"{op.name} has no parameter '{name}' to freeze (its parameters: "
                    f"{', '.join(names)})",
                    locs[word],
                )
            if given[word]:
                found += [name] if name else names
        return found

    @staticmethod
    def _tied_params(
        op: OpSpec, stmt: Call, given: dict[str, Any], ties: dict[str, str], params: list
    ) -> dict[str, str]:
        """Check each ``tied_PARAM="KEY"``: PARAM is a parameter of this statement and KEY a
        state-dict key (checked against the other statements when the graph is done)."""
        locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
        names = [p.name for p in params if p.present]
        found = {}
        for name, word in ties.items():
            if name not in names:
                have = ", ".join(names) or "none"
                raise ModelError(
                    f"{op.name} has no parameter '{name}' to tie (its parameters: {have})",
                    locs[word],
                )
            key = given[word]
            if not isinstance(key, str) or not _TIED_KEY.fullmatch(key):
                raise ModelError(
                    f"{word} takes the state-dict key of another statement's parameter as "
                    'a string ("emb.weight"), got ' + render_const(key),
                    locs[word],
                )
            found[name] = key
        return found

    def _check_ties(self) -> None:
        """Every tie names a parameter of another statement, untied itself, of the same
        shape and dtype."""
        params = {p.key: (node, p) for node in self.nodes for p in node.params if p.present}
        for node in self.nodes:
            for name, key in node.ties.items():
                mine = next(p for p in node.params if p.name == name)
                loc = node.loc
                if key not in params:
                    raise ModelError(
                        f"{node.name}: tied_{name}={key!r} names no parameter of the model"
                        f"{did_you_mean(key, list(params))}",
                        loc,
                    )
                other, theirs = params[key]
                if other is node:
                    raise ModelError(f"{node.name}: tied_{name} names its own parameter", loc)
                if theirs.name in other.ties:
                    raise ModelError(
                        f"{node.name}: tied_{name}={key!r} is tied itself; tie to "
                        f"{other.ties[theirs.name]!r}",
                        loc,
                    )
                if mine.trainable != theirs.trainable:
                    raise ModelError(
                        f"{node.name}: its {name} is tied to {key}, which "
                        f"{'does not train' if mine.trainable else 'trains'}: freeze both "
                        "or neither (they are one tensor)",
                        loc,
                    )
                if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
                    raise ModelError(
                        f"{node.name}: its {name} is {mine.dtype}[{', '.join(map(str, mine.shape))}]"
                        f" but {key} is {theirs.dtype}[{', '.join(map(str, theirs.shape))}]: a tied "
                        "parameter is one tensor",
                        loc,
                    )

    def _check_args(self, op: OpSpec, stmt: Call, given: dict[str, Any]) -> dict[str, Any]:
        locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
        for kw in stmt.kwargs:
            if kw.name not in given:
                continue  # a tie (``_ties``)
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

    # -- blocks ------------------------------------------------------------------------

    def _block_call(self, stmt: Call, scope: _Scope) -> Value:
        block = self.blocks[stmt.op]
        if block.name in scope.stack:
            chain = _chain((*scope.stack, block.name))
            raise ModelError(
                f"recursive block call ({chain}); blocks cannot call themselves", stmt.op_loc
            )
        if len(scope.stack) >= MAX_BLOCK_DEPTH:
            raise ModelError(
                f"block calls nested more than {MAX_BLOCK_DEPTH} deep "
                f"({_chain((*scope.stack, block.name))})",
                stmt.op_loc,
            )
        params: tuple[BlockParam, ...] = block.params
        if len(stmt.args) > len(params):
            raise ModelError(
                f"block '{block.name}' takes at most {len(params)} argument(s) "
                f"({', '.join(p.name for p in params)}), got {len(stmt.args)} values",
                stmt.args[len(params)].loc,
            )
        inner = _Scope(
            values={},
            consts={},
            value_params=set(),
            defined_at={},
            prefix=f"{scope.prefix}{stmt.target}.",
            blocks=(),
            stack=(*scope.stack, block.name),
        )
        for param, ref in zip(params, stmt.args):
            inner.values[param.name] = self._lookup(scope, ref)
            inner.value_params.add(param.name)
        by_name = {p.name: p for p in params}
        for kw in stmt.kwargs:
            if kw.name not in by_name:
                raise ModelError(
                    f"block '{block.name}' has no parameter '{kw.name}'"
                    f"{did_you_mean(kw.name, by_name)}",
                    kw.loc,
                )
            if kw.name in inner.values or kw.name in inner.consts:
                raise ModelError(f"parameter '{kw.name}' of '{block.name}' is bound twice", kw.loc)
            inner.consts[kw.name] = self._expr(scope, kw.value)
        for param in params:
            if param.name in inner.values or param.name in inner.consts:
                continue
            if param.default is None:
                raise ModelError(
                    f"block '{block.name}' needs a value for parameter '{param.name}'",
                    stmt.op_loc,
                )
            inner.consts[param.name] = self._expr(inner, param.default)
        call_args = [scope.values[r.name].name for r in stmt.args]
        call_kw = [f"{k}={render_const(inner.consts[k])}" for k in (kw.name for kw in stmt.kwargs)]
        text = f"{scope.prefix}{stmt.target} = {block.name}({', '.join(call_args + call_kw)})"
        bound = tuple((p.name, inner.values[p.name].name) for p in params if p.name in inner.values)
        call = BlockCall(
            scope.prefix + stmt.target, block.name, text, bound, _statement_text(stmt), stmt.loc
        )
        inner.blocks = (*scope.blocks, call)
        for body_stmt in block.body:
            self._statement(body_stmt, inner)
        return self._lookup(inner, block.ret)

    # -- return, analysis --------------------------------------------------------------

    def _returns(self, scope: _Scope) -> tuple[Value, list[Value]]:
        ret = self.model.ret
        values = [self._lookup(scope, ref) for ref in ret.values]
        loss, loss_ref = values[0], ret.values[0]
        if loss.type.shape != ():
            raise ModelError(
                f"the model must return a scalar loss first; '{loss_ref.name}' is {loss.type}",
                loss_ref.loc,
            )
        if not _is_loss(loss):
            raise ModelError(
                f"'{loss_ref.name}' is a scalar but not produced by a loss op "
                f"(cross_entropy, mse_loss, ...)",
                loss_ref.loc,
            )
        for ref, value in zip(ret.values[1:], values[1:]):
            target = _target_behind(value)
            if target is not None:
                raise ModelError(
                    f"prediction '{ref.name}' depends on target '{target.name}'; "
                    f"predict() takes only inputs",
                    ref.loc,
                )
        return loss, values[1:]

    def _analyse(self, graph: Graph) -> None:
        """Gradient requirements, which nodes reach the loss, and unused-name warnings."""
        for node in graph.nodes:
            node.output.requires_grad = any(p.present and p.trainable for p in node.params) or any(
                v.requires_grad for v in node.inputs
            )
        reaches_loss = {id(graph.loss)}
        for node in reversed(graph.nodes):
            if id(node.output) in reaches_loss:
                for v in node.inputs:
                    reaches_loss.add(id(v))
                node.needs_backward = node.output.requires_grad
        for node in graph.nodes:
            if node.needs_backward:
                node.saved = _saved_args(node)
        used = {id(v) for v in graph.preds} | {id(graph.loss)}
        for value in graph.inputs:
            if not value.consumers:
                self.warnings.append(
                    ModelWarning(f"{value.kind} '{value.name}' is never used", value.loc)
                )
        for node in graph.nodes:
            if not node.output.consumers and id(node.output) not in used:
                self.warnings.append(
                    ModelWarning(
                        f"'{node.name}' is computed but never used (not returned, feeds nothing)",
                        node.loc,
                    )
                )


def _saved_args(node: Node) -> tuple[SavedArg, ...]:
    """The backward kernel's arguments after the output gradient (see ``SavedArg``)."""
    names = node.input_names
    layer_entries = {p.name for p in (*node.params, *node.buffers)}
    extras = {e.name: e for e in node.extras}
    found: list[SavedArg] = []
    wanted = dict(zip((*names, *(p.name for p in node.params)), node.needs))
    for entry in node.op.saved:
        readers = node.op.saved_for.get(entry)
        if readers is not None and not any(wanted.get(r, False) for r in readers):
            found.append(SavedArg(entry, "none"))  # only a gradient not needed reads it
            continue
        if entry in layer_entries:
            if not any(a.kind == "layer" for a in found):
                found.append(SavedArg(entry, "layer"))
            continue
        if entry in node.op.inputs and entry not in names:
            found.append(SavedArg(entry, "none"))  # an optional input left out
        elif entry in names:
            value = node.inputs[names.index(entry)]
            # A model input is the caller's tensor: compressing it would free nothing; nor
            # would compressing a value without the batch dim (a free parameter, or made
            # from parameters only), which would perturb weights besides.
            activation = (
                entry in node.op.activations
                and value.producer is not None
                and shapes.BATCH in value.type.shape
            )
            found.append(SavedArg(entry, "value", value.name, value.type, activation))
        elif entry == "output":
            activation = entry in node.op.activations and shapes.BATCH in node.output.type.shape
            found.append(SavedArg(entry, "value", node.output.name, node.output.type, activation))
        elif extras[entry].present:
            activation = entry in node.op.activations
            key = f"{node.name}:{entry}"
            found.append(SavedArg(entry, "extra", key, extras[entry].type, activation))
        else:
            found.append(SavedArg(entry, "none"))
    return tuple(found)


def _chain(names: tuple[str, ...], limit: int = 8) -> str:
    """``a -> b -> c``, with the middle of a long chain left out."""
    if len(names) > limit:
        half = limit // 2
        skipped = len(names) - 2 * half
        names = (*names[:half], f"... {skipped} more ...", *names[-half:])
    return " -> ".join(names)


def _target_behind(value: Value) -> Value | None:
    """A target that ``value`` is computed from (the first found), or None."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.kind == "target":
            return v
        if v.producer is not None:
            stack.extend(v.producer.inputs)
    return None


def _is_loss(value: Value) -> bool:
    """Made by a loss op, or by add/mul of such values (walked without recursion)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer
        if node is None or v.type.shape != ():
            return False
        if node.op.is_loss:
            continue
        if node.op.name not in ("add", "mul"):
            return False
        stack.extend(node.inputs)
    return True


# -- argument validation -------------------------------------------------------------------


class BatchSymbol(str):
    """A bare ``N`` written as a keyword value (the batch size), told apart from the string
    ``"N"``: only ``size`` arguments take it (``expand(t, size=(N, -1, -1))``)."""


def _has_batch_symbol(value: Any) -> bool:
    if isinstance(value, tuple):
        return any(_has_batch_symbol(v) for v in value)
    return isinstance(value, BatchSymbol)


def describe_type(spec: ArgSpec) -> str:
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


def build_graph(model: ModelAST, registry: dict[str, OpSpec] | None = None) -> Graph:
    return GraphBuilder(model, registry).build()


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
