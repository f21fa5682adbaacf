"""What every lowering pass shares: the graph, the platform, the resolved stash plan, and
the names of the generated method.

Variables are named from structured keys (``base_name`` says which kinds there are) by
one ``Namer`` for the whole module, in the order the passes ask for them: a name taken
first keeps its plain form, so the passes run in a fixed order and the generated text
stays the same from one run to the next. ``key_of`` records each variable's key, which
the outliner reads to rename a variable by what it is, and the memory model to size it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unroller.compiler.graph import BlockCall, Graph, Node, Value, explicit_kwargs
from unroller.compiler.ir import Const, Expr, Global, Statement, Step, Var
from unroller.compiler.names import RESERVED, Namer
from unroller.compiler.outline import relative
from unroller.compiler.pipeline import Pipeline
from unroller.compiler.platforms import Platform
from unroller.compiler.schemes import Codec
from unroller.errors import ModelError

from .resolved import Form, ResolvedPlan, Segment

StepObserver = Callable[[Step, Node], None]
"""Told of each step the lowering makes for a node, with that node: the memory model reads
which statement belongs to which op (its kernel's working memory) without the lowering
knowing about it."""

BUCKET_BYTES = 25 * 2**20
"""Data parallel: the size at which a gradient bucket closes (DistributedDataParallel's)."""


@dataclass(frozen=True)
class PieceLoop:
    """A segment run in pieces, in a step program: the loop's header step (``zip`` of the
    pieces), the last step of its body, and the segment."""

    header: Step
    last: Step
    segment: Segment


class LoweringContext:
    """The state the passes share while they lay out the step programs of one module."""

    def __init__(
        self,
        graph: Graph,
        plan: ResolvedPlan,
        platform: Platform,
        pipeline: Pipeline | None = None,
        data_parallel: bool = False,
        bucket_bytes: int | None = None,
        observer: StepObserver | None = None,
        update_in_backward: bool = False,
        shard: bool = False,
    ):
        self.graph = graph
        self.update_in_backward = update_in_backward
        self.shard = shard
        self.plan = plan
        self.platform = platform
        self.pipeline = pipeline or Pipeline(1, {})
        self.data_parallel = data_parallel
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        self.observer = observer
        self.node_named = {node.name: node for node in graph.nodes}
        self.codec_names: dict[Codec, str] = {}
        for codec in plan.codecs():
            base = f"CODEC_{codec.name.upper()}"
            same = sum(1 for c in self.codec_names if c.name == codec.name)
            self.codec_names[codec] = f"{base}_{same + 1}" if same else base
        self.names = Namer(RESERVED | set(self.codec_names.values()))
        self.key_of: dict[str, tuple[str, ...]] = {}  # variable -> its structured key
        self.kernel_alias: dict[str, str] = {platform.kernels: "K"}
        for value in graph.inputs:
            self.var(value)
        for node in graph.nodes:
            self.var(node.output)
        #: segments run in pieces, in the order their loops were laid out
        self.piece_loops: list[PieceLoop] = []
        self.private_count = 0  # variables of one remake's own (``private``)
        self.begin_program()
        for node in graph.nodes:
            self.check_supported(node)

    def begin_program(self) -> None:
        """Forget what the previous program restored and remade: each program (the step, a
        pipeline stage) restores what it reads itself."""
        self.restored: dict[tuple[str, Form], Var] = {}
        self.recomputed: dict[str, Var] = {}  # value -> its remade variable (--recompute)

    # -- kernels -------------------------------------------------------------------------

    def kernel_module(self, node: Node) -> str:
        return node.op.kernels.get(self.platform.name, self.platform.kernels)

    def check_supported(self, node: Node) -> None:
        """Refuse, at generate time, what the platform's kernels cannot run."""
        name = self.kernel_module(node)
        module = importlib.import_module(name)
        op = node.op.name
        wanted = [op, f"{op}_backward"] + ([f"{op}_eval"] if node.op.has_eval else [])
        missing = [f for f in wanted if not callable(getattr(module, f, None))]
        if missing:
            raise ModelError(
                f"operator '{op}' has no kernels for platform {self.platform.name} "
                f"({name} lacks {', '.join(missing)})",
                node.loc,
            )
        why = getattr(module, "unsupported", lambda op, args: None)(op, node.args)
        if why:
            raise ModelError(f"{node.name}: {why} (platform {self.platform.name})", node.loc)

    def kernel(self, node: Node, func: str) -> Global:
        module = self.kernel_module(node)
        if module not in self.kernel_alias:
            self.kernel_alias[module] = f"K{len(self.kernel_alias) + 1}"
        return Global(f"{self.kernel_alias[module]}.{func}")

    def codec(self, form: Form) -> str:
        """The module-level name of a form's codec (``CODEC_DCT``)."""
        return self.codec_names[form.codec]

    # -- names ---------------------------------------------------------------------------

    def name(self, *key: str) -> Var:
        """The variable for a structured key (``base_name`` says which kinds there are)."""
        ident = self.names("\0".join(key), base_name(key))
        self.key_of[ident] = key
        return Var(ident)

    def var(self, value: Value) -> Var:
        return self.name("value", value.name)

    def grad(self, value: Value) -> Var:
        return self.name("grad", value.name)

    def extra(self, node: Node, name: str) -> Var:
        return self.name("extra", node.name, name)

    def raw_var(self, key: str) -> Var:
        """The variable of a saved tensor as the forward pass made it."""
        if ":" in key:
            node_name, extra = key.split(":", 1)
            return self.name("extra", node_name, extra)
        return self.name("value", key)

    def packed_var(self, key: str, form: Form) -> Var:
        suffix = "bits" if form.kind == "mask" else form.codec.name
        return self.name("packed", key, suffix, str(form))

    def restored_var(self, key: str, form: Form) -> Var:
        suffix = "mask" if form.kind == "mask" else "restored"
        return self.name("restored", key, suffix, str(form))

    def private(self) -> str:
        """A fresh key part: a variable of one recompute's own."""
        self.private_count += 1
        return str(self.private_count)

    # -- steps ---------------------------------------------------------------------------

    def stage(self, node: Node | None) -> int:
        return self.pipeline.stage(node.name) if node is not None else 0

    def node_step(self, section: str, statements: list[Statement], node: Node) -> Step:
        """A step carrying out ``node`` itself: commented with its statement (whole and
        within its block), placed in its block instances and its pipeline stage."""
        return Step(
            section,
            statements,
            comment=node.text,
            calls=node.blocks,
            local_comment=node.local_text,
            stage=self.stage(node),
        )

    def observed(self, node: Node, step: Step) -> Step:
        """``step``, made for ``node`` (its forward, its backward, or a remake of its
        output), told to the observer (``StepObserver``) if there is one."""
        if self.observer is not None:
            self.observer(step, node)
        return step


def const_kwargs(op_kwargs: dict[str, Any]) -> tuple[tuple[str, Expr], ...]:
    return tuple((k, Const(v)) for k, v in op_kwargs.items())


def off(kwargs: tuple[tuple[str, Expr], ...]) -> tuple[tuple[str, Expr], ...]:
    """The backward kernels' flags a call leaves off (False, their default)."""
    given = {k for k, _ in kwargs}
    return tuple((k, Const(False)) for k in ("in_place", "consume") if k not in given)


def defaults(op: Any, values: dict[str, Any]) -> tuple[tuple[str, Expr], ...]:
    """The arguments of ``values`` a call leaves out as equal to the registry default
    (``CallExpr.defaults``: outlining passes one where block instances differ in it)."""
    explicit = explicit_kwargs(op, values)
    return tuple((k, Const(v)) for k, v in values.items() if k in op.args and k not in explicit)


def in_block(name: str, calls: tuple[BlockCall, ...]) -> str:
    """``name`` as the outermost enclosing block instance names it (for comments inside
    block functions); the name itself outside any block."""
    return relative(name, calls[0]) if calls else name


def base_name(key: tuple[str, ...], rel: Callable[[str], str] = lambda name: name) -> str:
    """The readable name a variable is given, from its structured key.

    ``rel`` maps a model name to the name to show: the identity at module level, the
    block-relative name inside a block function (``layer1.0.conv1`` -> ``conv1``).
    """
    kind = key[0]
    if kind == "value":
        return rel(key[1])
    if kind == "grad":
        return f"grad_{rel(key[1])}"
    if kind == "extra":
        return f"{rel(key[1])}_{key[2]}"
    if kind in ("packed", "restored"):
        stashed, _, extra = key[1].partition(":")
        return f"{rel(stashed)}_{extra + '_' if extra else ''}{key[2]}"
    if kind == "recomputed":
        return f"{rel(key[1])}_recomputed"
    if kind == "piece":  # a segment run in pieces: one piece of the variable
        return f"{base_name(key[1:], rel)}_piece"
    if kind == "slot":  # ... and the piece's slice of a whole-batch gradient
        return f"{base_name(key[1:], rel)}_slot"
    if kind == "partial":
        return f"grad_{rel(key[1])}_from_{rel(key[2])}"
    if kind == "pgrad":
        return f"grad_{key[1]}"
    if kind == "saved":
        return f"{rel(key[1])}_saved"
    raise ValueError(f"unknown variable kind {kind!r}")
