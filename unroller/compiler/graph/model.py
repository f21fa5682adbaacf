"""The graph's data model: values, nodes, their parameters and what backward reads.

``unroller.compiler.graph`` builds these from the typed AST; every later stage (the stash planner,
the lowering, the code generator, the reports) reads them and none builds them, so they
live apart from the builder's code, importable without it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from unroller.compiler.ast import Loc
from unroller.compiler.dtypes import DTYPE_BYTES
from unroller.compiler.registry import OpSpec
from unroller.compiler.shapes import TensorType
from unroller.errors import ModelWarning

#: How deeply block calls may nest (a block calling a block calling a block ...).
MAX_BLOCK_DEPTH = 32
#: The most operator calls a model may inline to (code generation takes a few ms each).
MAX_NODES = 10_000
#: The most parameter and buffer elements a model may have, all together.
MAX_PARAMETERS = 2**34


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
    #: the earlier statement whose layer this one calls (``shares="NAME"``), else "": its
    #: params and buffers are that node's (their keys, ties and trainable flags), so it
    #: adds no state-dict key; its parameter gradients add into the same ``.grad``
    shares: str = ""
    #: a mixed precision's low dtype, which this ``lower`` op reads its parameters in
    #: (through the step's cast cache, ``L.cast``); "" when it reads them as they are
    cast_params: str = ""

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.op.input_names(len(self.inputs))

    @property
    def layer(self) -> str:
        """The state-dict prefix of the module holding this node's parameters and buffers:
        the node's own name, the shared layer's (``shares=``), or for a free parameter its
        parent ("" at the top level)."""
        if self.shares:
            return self.shares
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
    """A checked model: its declared tensors, its nodes in statement order (a topological
    order), the returned loss and predictions, and the warnings the build raised."""

    name: str
    inputs: list[Value]  # inputs and targets, in declaration order
    nodes: list[Node]
    loss: Value
    preds: list[Value]
    float_dtype: str
    filename: str
    source: str
    warnings: list[ModelWarning] = field(default_factory=list)
    #: the ``--precision`` it was built for (``unroller.compiler.precision``)
    precision: str = "fp32"

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
