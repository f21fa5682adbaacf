"""Graph -> step IR -> the platform's Jinja template -> black -> source text.

``Emitter`` lays out the training step as ``ir.Step`` values: every forward kernel
call, then the seed gradient of the loss, then every backward kernel call in reverse
topological order, summing gradients where a value has several consumers, handing
parameter gradients where the platform wants them, and deleting each tensor right
after its last use. ``render`` turns the steps into lines (``ir.render_steps``) and the
platform's template arranges them into a module; black formats it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
from collections.abc import Callable
from typing import Any

import black
import jinja2

from unroller import __version__, safe
from unroller.errors import ModelError, OptionError
from unroller.graph import BlockCall, Graph, Node, SavedArg, Value, explicit_kwargs
from unroller.ir import (
    AddTo,
    Assign,
    Attr,
    CallExpr,
    Const,
    Do,
    Expr,
    Global,
    Layer,
    ModelName,
    RecordRaw,
    Return,
    Statement,
    Step,
    TupleExpr,
    Var,
    Yield,
    release_dead,
    render_expr,
    render_steps,
)
from unroller.names import RESERVED, Namer
from unroller.options import Options
from unroller.outline import Function, Outliner, relative, rename_vars
from unroller.pipeline import (
    Boundary,
    Pipeline,
    boundaries,
    split,
    split_instances,
    stage_inputs,
)
from unroller.platforms import GPU, Platform
from unroller.platforms import platform as get_platform
from unroller.resources import resource_dir
from unroller.schemes import SCHEMES, Codec, CompressionConfig, builtin
from unroller.shapes import TensorType
from unroller.stash import (
    Form,
    Segment,
    Stashed,
    StashPlan,
    always_there,
    changes_state,
    plan_stash,
    rerun_nodes,
    value_form,
    value_producers,
    wire_codec,
)

RECOMPUTE_SECTION = "recompute"
"""The section of a segment's recompute steps (its forward again, in the backward): a run
of its own for the outliner, rendered inside the backward."""
HEADER_TAG = "# unroller: "
CHECKSUM_TAG = "# unroller-checksum: "
# Generated code favours one line per step over the 100 columns of hand-written code.
GENERATED_LINE_LENGTH = 120


BUCKET_BYTES = 25 * 2**20
"""Data parallel: the size at which a gradient bucket closes (DistributedDataParallel's)."""


ACCUMULATORS = ("K.accumulate", "K.accumulate_fresh")
"""The calls that add parameter gradients into ``.grad`` (``Platform.grads == "accumulate"``)."""


def called_name(expr: Any) -> str:
    """The dotted name a statement's call calls (``K.accumulate``); "" for anything else."""
    return expr.func.dotted if isinstance(expr, CallExpr) and isinstance(expr.func, Global) else ""


def _split_batch(value: Var, segment: Segment) -> CallExpr:
    """``value`` split along the batch as ``segment`` runs: ``value.split(P)`` for pieces of
    P samples, else ``value.tensor_split(K)`` for K pieces (views either way)."""
    if segment.piece_size:
        return CallExpr(Attr(value, "split"), (Const(segment.piece_size),))
    return CallExpr(Attr(value, "tensor_split"), (Const(segment.pieces),))


StepObserver = Callable[[Step, Node], None]
"""Told of each step the emitter makes for a node, with that node: the memory model reads
which statement belongs to which op (its kernel's working memory) without the emitter
knowing about it, and without replacing the emitter's methods."""


class Emitter:
    """Builds the step program (``ir.Step``) of one graph for one platform and pipeline."""

    def __init__(
        self,
        graph: Graph,
        plan: StashPlan | None = None,
        platform: Platform | str = GPU,
        pipeline: Pipeline | None = None,
        data_parallel: bool = False,
        bucket_bytes: int | None = None,
        observer: StepObserver | None = None,
    ):
        self.graph = graph
        self.observer = observer
        self.data_parallel = data_parallel
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        self.node_named = {node.name: node for node in graph.nodes}
        self.platform = get_platform(platform) if isinstance(platform, str) else platform
        self.pipeline = pipeline or Pipeline(1, {})
        self.plan = plan if plan is not None else plan_stash(graph, builtin("nocompress"))
        self.codec_names: dict[Codec, str] = {}
        for codec in self.plan.codecs():
            base = f"CODEC_{codec.name.upper()}"
            same = sum(1 for c in self.codec_names if c.name == codec.name)
            self.codec_names[codec] = f"{base}_{same + 1}" if same else base
        self.names = Namer(RESERVED | set(self.codec_names.values()))
        self.key_of: dict[str, tuple[str, ...]] = {}  # variable -> its structured key
        self.kernel_alias: dict[str, str] = {self.platform.kernels: "K"}
        for value in graph.inputs:
            self.var(value)
        for node in graph.nodes:
            self.var(node.output)
        self.restored: dict[tuple[str, Form], Var] = {}
        self.recomputed: dict[str, Var] = {}  # value -> its remade variable (--recompute)
        self.private_count = 0  # variables of one recompute's own (Emitter.remade)
        self.producers = value_producers(graph)
        self.stashed = self.plan.by_key()
        self.segment_of: dict[int, Segment] = {  # node index -> its recomputed segment
            n.index: segment for segment in self.plan.segments for n in segment.nodes
        }
        #: segments run in pieces: (the loop's header step, its last step, the segment)
        self.piece_loops: list[tuple[Step, Step, Segment]] = []
        for node in graph.nodes:
            self.check_supported(node)

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

    @staticmethod
    def needs_implied(node: Node) -> bool:
        """Can the backward call leave ``needs`` out? When every gradient is wanted: every
        backward kernel takes ``needs=None`` to mean all of them."""
        return all(node.needs)

    def stage(self, node: Node | None) -> int:
        return self.pipeline.stage(node.name) if node is not None else 0

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

    def kernel(self, node: Node, func: str) -> Global:
        module = self.kernel_module(node)
        if module not in self.kernel_alias:
            self.kernel_alias[module] = f"K{len(self.kernel_alias) + 1}"
        return Global(f"{self.kernel_alias[module]}.{func}")

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

    @staticmethod
    def kwargs(op_kwargs: dict[str, Any]) -> tuple[tuple[str, Expr], ...]:
        return tuple((k, Const(v)) for k, v in op_kwargs.items())

    @staticmethod
    def off(kwargs: tuple[tuple[str, Expr], ...]) -> tuple[tuple[str, Expr], ...]:
        """The backward kernels' flags a call leaves off (False, their default)."""
        given = {k for k, _ in kwargs}
        return tuple((k, Const(False)) for k in ("in_place", "consume") if k not in given)

    @staticmethod
    def defaults(op: Any, values: dict[str, Any]) -> tuple[tuple[str, Expr], ...]:
        """The arguments of ``values`` a call leaves out as equal to the registry default
        (``CallExpr.defaults``: outlining passes one where block instances differ in it)."""
        explicit = explicit_kwargs(op, values)
        return tuple((k, Const(v)) for k, v in values.items() if k in op.args and k not in explicit)

    # -- forward -------------------------------------------------------------------------

    def forward_step(self, node: Node, eval_mode: bool = False) -> Step:
        """``out[, extras] = K.op(inputs..., [layer], **non-default args)``."""
        op = node.op
        evaluating = eval_mode and op.has_eval
        args: list[Expr] = [self.var(v) for v in node.inputs]
        if node.params or node.buffers:
            args.append(Layer(node.layer))
        call = CallExpr(
            self.kernel(node, f"{op.name}_eval" if evaluating else op.name),
            tuple(args),
            self.kwargs(explicit_kwargs(op, node.kernel_kwargs)),
            self.defaults(op, node.kernel_kwargs),
        )
        targets: list[Var | None] = [self.var(node.output)]
        if op.extras and not evaluating:
            kept = {a.entry for a in node.saved if a.kind == "extra"} if not eval_mode else set()
            targets += [self.extra(node, e.name) if e.name in kept else None for e in node.extras]
        return self.observed(node, self.node_step("forward", [Assign(tuple(targets), call)], node))

    # -- backward ------------------------------------------------------------------------

    def saved_arg(self, node: Node, arg: SavedArg) -> Expr:
        if arg.kind == "layer":
            return Layer(node.layer)
        if arg.kind == "none":
            return Const(None)
        found = self.plan.form_for(node, arg.entry)
        if found is not None and found[1].kind == "recompute":
            return self.recomputed[found[0].key]
        if found is not None and found[1].kind != "raw":
            # restored once for the whole batch ahead of a segment run in pieces, or here
            restored = self.restored.get((found[0].key, found[1]))
            return restored or self.restored_var(found[0].key, found[1])
        return self.raw_var(arg.key)

    def backward_step(self, node: Node, owned: dict[int, bool], pieces: bool = False) -> Step:
        """One backward kernel call, gradient sums for fan-out, parameter gradients.

        ``owned`` maps each value that already has a gradient to whether that tensor is
        exclusively ours (then later contributions are added in place, as autograd's
        input buffers do) or may alias another gradient (then the sum is out of place).
        ``pieces``: the call runs once per piece of the batch (``pieced_steps``); an op whose
        kernel can add its parameter gradients into ``.grad`` itself (registry
        ``backward_accumulates``) is then asked to (``accumulate=True``), so that no piece
        makes parameter-sized gradients only to add them.
        """
        op = node.op
        lean = self.lean()
        into_grad = pieces and op.backward_accumulates and self.platform.grads == "accumulate"
        in_place = (  # the input's gradient may overwrite g: g is ours, and dead after this
            lean
            and op.backward_in_place
            and owned.get(id(node.output), False)
            and bool(node.inputs)
            and node.inputs[0].requires_grad
            and node.inputs[0].type == node.output.type
        )
        targets, sums, add_into = self.input_grad_targets(node, owned, lean)
        param_targets, param_grads = self.param_grad_targets(node, into_grad)
        targets += param_targets
        kwargs = self.kwargs(explicit_kwargs(op, node.backward_kwargs))
        if op.backward_pieces and lean:
            kwargs += (("piece_bytes", Const(self.platform.piece_bytes)),)
        if add_into is not None:
            kwargs += (("add_into", add_into),)
        elif in_place:
            kwargs += (("in_place", Const(True)),)
        if lean and node.inputs and node.inputs[0].requires_grad and self.consumable(node):
            kwargs += (("consume", Const(True)),)
        if into_grad and any(p.present for p in node.params):
            kwargs += (("accumulate", Const(True)),)
        call = CallExpr(
            self.kernel(node, f"{op.name}_backward"),
            (self.grad(node.output), *(self.saved_arg(node, a) for a in node.saved)),
            (*kwargs, *(() if self.needs_implied(node) else (("needs", Const(node.needs)),))),
            (*self.defaults(op, node.backward_kwargs), *self.off(kwargs)),
        )
        statements: list[Statement] = [Assign(tuple(targets), call, unpack=len(targets) == 1)]
        statements += sums
        for owner, grads in param_grads.items():
            statements.append(Do(self.param_grads(owner, tuple(grads), op.fresh_param_grads)))
        return self.observed(node, self.node_step("backward", statements, node))

    def input_grad_targets(
        self, node: Node, owned: dict[int, bool], lean: bool
    ) -> tuple[list[Var | None], list[Statement], Var | None]:
        """Where a backward call puts each input's gradient: the gradient itself when it is
        the first, else a partial summed into it afterwards (or, for a kernel that can, the
        total it adds into). Returns the targets (None: no gradient), the sums and the
        add-into variable; ``owned`` is updated as in ``backward_step``."""
        op = node.op
        targets: list[Var | None] = []
        sums: list[Statement] = []
        add_into: Var | None = None  # the kernel adds the input's gradient into the total
        for position, value in enumerate(node.inputs):
            if not value.requires_grad:
                targets.append(None)
            elif id(value) not in owned:
                owned[id(value)] = not op.grad_aliases
                targets.append(self.grad(value))
            elif position == 0 and lean and owned[id(value)] and op.backward_add_into:
                add_into = self.grad(value)
                targets.append(add_into)
            else:
                partial = self.name("partial", value.name, node.output.name, str(position))
                targets.append(partial)
                mine = owned[id(value)]  # else: add into the part when it is a new tensor
                into = lean and not mine and not op.grad_aliases
                sums.append(AddTo(self.grad(value), partial, in_place=mine, into_part=into))
                owned[id(value)] = True
        return targets, sums, add_into

    def param_grad_targets(
        self, node: Node, into_grad: bool
    ) -> tuple[list[Var | None], dict[str, list[tuple[str, Expr]]]]:
        """Where a backward call puts each parameter's gradient (None: absent, or added into
        ``.grad`` by the kernel), and those gradients by the module holding them (a
        parameter "out_proj.weight" is held by the node's submodule out_proj; a free
        parameter by its parent)."""
        targets: list[Var | None] = []
        param_grads: dict[str, list[tuple[str, Expr]]] = {}
        for p in node.params:
            if not p.present or into_grad:  # none, or the kernel adds it into .grad itself
                targets.append(None)
                continue
            # One name per parameter kind (grad_weight, grad_bias), reused by every layer:
            # each is handed over on the next line, so a per-layer name would only be noise.
            grad = self.name("pgrad", p.name)
            targets.append(grad)
            owner, _, attr = p.key.rpartition(".")
            param_grads.setdefault(owner, []).append((attr, grad))
        return targets, param_grads

    def consumable(self, node: Node) -> bool:
        """May the backward overwrite its saved extras named in ``backward_consumes``? Each
        must reach it as a tensor this code owns and nothing else reads: kept raw (the
        forward's own output), or restored into a new tensor from a compressed form; never
        a packed form restored piece by piece, and never one a segment's recompute reads."""
        consumed = node.op.backward_consumes
        if not consumed:
            return False
        for arg in node.saved:
            if arg.entry not in consumed:
                continue
            if arg.kind != "extra":
                return False  # the kernel returned no such extra (None) with these arguments
            found = self.plan.form_for(node, arg.entry)
            if found is None:
                return False
            stashed, form = found
            if stashed.segment_readers or any(n is not node for n, _, _ in stashed.readers):
                return False
            if form.kind == "recompute" or self.restored_in_pieces(stashed, form):
                return False
        return True

    def lean(self) -> bool:
        """Does the step shrink its backward working set (the platform's ``piece_bytes``):
        kernels in pieces of the batch and in place, inputs restored a piece at a time? Only
        where the step already differs from autograd's rounding: under lossy schemes, and
        with segments run in pieces of the batch (their parameter gradients are summed piece
        by piece); a plain nocompress step keeps autograd's kernels and summation order."""
        pieced = any(s.in_pieces for s in self.plan.segments)
        return self.platform.piece_bytes > 0 and (self.plan.config.lossy or pieced)

    def restored_in_pieces(self, stashed: Stashed, form: Form) -> bool:
        """Is a compressed form read only as the first saved entry of backward kernels that
        run in pieces? Then it is handed over packed (``K.restore_in_pieces``) and each
        kernel decompresses one piece of the batch at a time."""
        if not self.lean() or form.kind != "codec":
            return False
        readers = [(n, saved) for n, saved, f in stashed.readers if f == form]
        return bool(readers) and all(
            n.op.backward_pieces and saved.entry == n.op.saved[0] for n, saved in readers
        )

    def param_grads(
        self, owner: str, grads: tuple[tuple[str, Expr], ...], fresh: bool = False
    ) -> CallExpr:
        """Where the platform wants the gradients of the parameters module ``owner`` holds;
        ``fresh``: the kernel made them and nothing else holds them (the registry's
        ``fresh_param_grads``), so the first becomes ``.grad`` without a copy."""
        if self.platform.grads == "accumulate":  # into each parameter's .grad
            kernel = "K.accumulate_fresh" if fresh else "K.accumulate"
            return CallExpr(Global(kernel), (Layer(owner),), grads)
        # "collect": into the step's dict, by state-dict name, for the surrogate loss
        return CallExpr(Global("K.collect"), (Var("grads"), Var("L"), ModelName(owner)), grads)

    # -- whole methods -------------------------------------------------------------------

    def stash_step(self, stashed: Stashed, calls: tuple[BlockCall, ...]) -> Step:
        """Right after the tensor is made: compress it (once per form) and record the bytes."""
        raw = self.raw_var(stashed.key)
        statements: list[Statement] = []
        packs: list[Expr] = []
        for form in stashed.forms:
            if form.kind == "recompute":
                continue
            source: Expr = raw
            if form.kind == "mask" and form.mask_kernel:
                reader = self.node_named[form.mask_node]
                source = CallExpr(
                    self.kernel(reader, form.mask_kernel),
                    (raw,),
                    self.kwargs(reader.backward_kwargs),
                )
            packed = self.packed_var(stashed.key, form)
            codec = self.codec_names[form.codec]
            statements.append(Assign((packed,), CallExpr(Global(f"{codec}.compress"), (source,))))
            packs.append(TupleExpr((Global(codec), packed)))
        key = ModelName(stashed.key)
        statements.append(Do(CallExpr(Global("K.stash"), (Var("stash"), key, raw, *packs))))
        producer = self.graph.nodes[stashed.producer] if stashed.producer >= 0 else None
        labels = " + ".join(f.label() for f in stashed.forms if f.kind != "recompute")
        return Step(
            "forward",
            statements,
            comment=f"keep {stashed.key} as {labels}",
            calls=calls,
            local_comment=f"keep {_relative(stashed.key, calls)} as {labels}",
            stage=self.stage(producer),
        )

    def stash_raw_step(self, entries: list[Stashed], after: Node | None) -> Step:
        """Record what is kept uncompressed, right after ``after`` (None: before any node),
        the last node of the run of nodes (a block instance, or statements between) that
        made them."""
        items = tuple((ModelName(s.key), self.raw_var(s.key)) for s in entries)
        return Step(
            "forward",
            [RecordRaw(Var("stash"), items)],
            comment="kept as they are for backward",
            calls=after.blocks[:1] if after is not None else (),
            stage=self.stage(after),
        )

    def restore_steps(self, node: Node) -> list[Step]:
        """Right before a backward step: decompress what it reads, unless already done, and
        remake what is recomputed (``--recompute``)."""
        steps: list[Step] = []
        for stashed, _, form in self.plan.reads_of(node):
            if form.kind == "recompute":
                self.remade(stashed.key, node, steps)
            elif form.kind != "raw":
                self.restore(stashed, form, node, steps)
        return steps

    def restore(
        self, stashed: Stashed, form: Form, node: Node, steps: list[Step], shared: bool = True
    ) -> Var:
        """The restored variable of one stored form; its decompress step is appended to
        ``steps`` the first time (``node``: the backward step that needs it). ``shared``
        False: a variable of its own, for one recompute, so that the tensor is freed right
        after it instead of living on until its own reader's backward step."""
        if (stashed.key, form) in self.restored:
            return self.restored[(stashed.key, form)]
        if shared:
            restored = self.restored_var(stashed.key, form)
            self.restored[(stashed.key, form)] = restored
        else:
            suffix = "mask" if form.kind == "mask" else "restored"
            restored = self.name("restored", stashed.key, suffix, str(form), self._private())
        logical = form.type or stashed.type
        dtype: Expr
        if form.kind == "mask":
            dtype = Global("torch.bool")
        else:
            dtype = Attr(self.grad(node.output), "dtype")
        codec = self.codec_names[form.codec]
        args = (self.packed_var(stashed.key, form), Const(tuple(logical.shape[1:])), dtype)
        if shared and self.restored_in_pieces(stashed, form):
            call = CallExpr(Global("K.restore_in_pieces"), (Global(codec), *args))
        else:
            call = CallExpr(Global(f"{codec}.decompress"), args)
        steps.append(
            Step(
                "backward",
                [Assign((restored,), call)],
                comment=f"restore {stashed.key}: {form.label()}",
                calls=node.blocks,
                local_comment=f"restore {_relative(stashed.key, node.blocks)}: {form.label()}",
                stage=self.stage(node),
            )
        )
        return restored

    def remade(self, name: str, reader: Node, steps: list[Step], shared: bool = True) -> Var:
        """The value ``name`` as the backward of ``reader`` reads it: kept raw, restored from
        its compressed form, there anyway, or remade by its producer's recompute kernel from
        those (recursively, as ``stash.plan_recompute`` planned it).

        What a recompute makes on the way (the restored inputs, the intermediate values) is
        its own (``shared`` False) and freed as soon as the remade value is made: reusing a
        tensor restored for a later reader would keep it alive until then, which costs more
        memory than decompressing it twice."""
        producer = self.producers[name]
        if producer is None:
            return self.var(self._input(name))
        if always_there(self.producers, name):
            return self.var(producer.output)
        stashed = self.stashed.get(name)
        form = value_form(stashed) if stashed is not None else None
        if form is not None:
            if form.kind == "raw":
                return self.raw_var(name)
            return self.restore(stashed, form, reader, steps, shared)
        if shared and name in self.recomputed:
            return self.recomputed[name]
        op = producer.op
        assert op.recompute is not None, f"{name} is not recomputable"
        args: list[Expr] = [self.remade(v.name, reader, steps, False) for v in producer.inputs]
        if producer.params or producer.buffers:
            args.append(Layer(producer.layer))
        kwargs = self.kwargs(explicit_kwargs(op, producer.kernel_kwargs))
        defaults = self.defaults(op, producer.kernel_kwargs)
        call = CallExpr(self.kernel(producer, op.recompute.kernel), tuple(args), kwargs, defaults)
        if shared:
            target = self.name("recomputed", name)
            self.recomputed[name] = target
        else:
            target = self.name("recomputed", name, self._private())
        targets: list[Var | None] = [target]
        if op.recompute.kernel == op.name and op.extras:  # the forward: its extras unused
            targets += [None] * len(producer.extras)
        steps.append(
            self.recompute_step(
                producer,
                Step(
                    "backward",
                    [Assign(tuple(targets), call)],
                    comment=f"recompute {producer.text}",
                    calls=reader.blocks,
                    local_comment=f"recompute {producer.local_text}",
                    stage=self.stage(reader),
                ),
            )
        )
        return target

    def _private(self) -> str:
        self.private_count += 1
        return str(self.private_count)

    def recompute_step(self, producer: Node, step: Step) -> Step:
        """``step``, which remakes ``producer``'s output in the backward, told to the
        observer."""
        return self.observed(producer, step)

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
        """``step``, made for ``node`` (its forward, its backward, or a recompute of its
        output), told to the observer (``StepObserver``) if there is one."""
        if self.observer is not None:
            self.observer(step, node)
        return step

    def _input(self, name: str) -> Value:
        return next(v for v in self.graph.inputs if v.name == name)

    # -- segment recompute ---------------------------------------------------------------

    def segment_steps(
        self, segment: Segment, reader: Node, restore_inputs: bool = True
    ) -> list[Step]:
        """When ``segment``'s backward begins (right before ``reader``'s backward step, its
        last statement with one): its inputs restored from what the forward kept, then its
        forward statements again, each followed by the stash steps of the tensors only the
        recompute makes, exactly as the forward makes them without segment recompute. The
        steps are section ``recompute``: a run of their own, which the outliner turns into a
        call of the block's recompute function. A statement none of those tensors depends on
        (what only the rest of the graph reads, such as the block's last residual sum) is
        left out: the forward made it already."""
        nodes = rerun_nodes(segment, [self.stashed[key].producer for key in segment.internal])
        read = {v.name for n in nodes for v in n.inputs}
        steps: list[Step] = []
        for name in segment.inputs:
            if name not in read:
                continue
            stashed = self.stashed[name]
            form = value_form(stashed)
            assert form is not None, f"{name} is not kept for {segment.name}"
            if form.kind != "raw" and restore_inputs:
                steps.append(self.restore_input(stashed, form, reader, segment))
        entries = [_remade_part(self.stashed[key]) for key in segment.internal]
        steps += self.forward_with_stash(nodes, entries, self.segment_forward_step)
        for step in steps:
            step.section = RECOMPUTE_SECTION
        return steps

    def restore_input(self, stashed: Stashed, form: Form, reader: Node, segment: Segment) -> Step:
        """A segment input decompressed into its own variable for the recompute: the
        forward's statements read it by that name, and the forward's tensor is long gone."""
        call = CallExpr(
            Global(f"{self.codec_names[form.codec]}.decompress"),
            (
                self.packed_var(stashed.key, form),
                Const(tuple(stashed.type.shape[1:])),
                Attr(self.grad(reader.output), "dtype"),
            ),
        )
        calls = (segment.call,)
        return Step(
            RECOMPUTE_SECTION,
            [Assign((self.raw_var(stashed.key),), call)],
            comment=f"restore {stashed.key}: {form.label()} (input of {segment.name})",
            calls=calls,
            local_comment=f"restore {_relative(stashed.key, calls)}: {form.label()}",
            stage=self.stage(reader),
        )

    def pieced_steps(self, segment: Segment, reader: Node, owned: dict[int, bool]) -> list[Step]:
        """``segment``'s recompute and backward run in ``segment.pieces`` pieces of the batch
        (``stash.plan_pieces``), one piece at a time, so that their working set is a piece's.

        Its inputs kept compressed are restored once for the whole batch; each value the
        steps read from outside (inputs, the output gradients) is split into views along
        the batch (``tensor_split(K)``: K pieces differing by at most one sample; or
        ``split(P)``: pieces of P samples, the last one smaller), and each piece
        runs the segment's recompute and backward steps, renamed to the piece's variables.
        The parameter gradients accumulate into ``.grad`` piece after piece (summed in
        another order than one whole-batch kernel: equal to rounding, not bit for bit);
        each input's gradient is copied into its slice of one whole-batch tensor, added to
        what the input had from elsewhere when it had some. The header step (the loop) and
        the last step of a piece are recorded in ``piece_loops`` for rendering."""
        nodes = [n for n in reversed(segment.nodes) if n.needs_backward]
        outside = _outside_values(segment)
        steps = self.restore_segment_inputs(segment, nodes, reader)
        before = {id(v): owned.pop(id(v)) for v in outside if id(v) in owned}
        body = self.segment_steps(segment, reader, restore_inputs=False)
        for node in nodes:
            body += self.restore_steps(node)
            body.append(self.backward_step(node, owned, pieces=True))
        graded = [v for v in outside if id(v) in owned]
        free = _free_reads(body)
        mapping = self.piece_names(segment, free, graded)
        for step in body:  # in place: the memory model knows the steps by identity
            step.statements = rename_vars(step, mapping).statements
        anchor = Var(next(n for n in free if self.key_of[n][0] == "grad"))
        full: dict[str, Var] = {}
        for value in graded:
            if id(value) in before:  # the input has a gradient from elsewhere: add to it
                full[value.name] = self.name("partial", value.name, segment.name, "pieces")
            else:
                full[value.name] = self.grad(value)
        reused = self.reusable_output_grads(segment, graded, before, free, owned)
        if graded:
            steps.append(self.whole_batch_grads(graded, full, reused, anchor))
        slots = {v.name: self.name("slot", *self.key_of[self.grad(v).name]) for v in graded}
        targets = tuple(Var(mapping[n]) for n in free) + tuple(slots[v.name] for v in graded)
        splits = [Var(n) for n in free] + [full[v.name] for v in graded]
        split = tuple(_split_batch(t, segment) for t in splits)
        header = Step(
            "backward",
            [Assign(targets, CallExpr(Global("zip"), split))],
            comment=(
                f"[pieces] {segment.call.text}: its recompute and backward in "
                f"{segment.pieces_text()}"
            ),
        )
        steps += [header, *body]
        if graded:
            copies: list[Statement] = [
                Do(CallExpr(Attr(slots[v.name], "copy_"), (Var(mapping[self.grad(v).name]),)))
                for v in graded
            ]
            steps.append(Step("backward", copies, comment="the piece's input gradients"))
        self.piece_loops.append((header, steps[-1], segment))
        for value in graded:
            if id(value) in before:
                add = AddTo(self.grad(value), full[value.name], in_place=before[id(value)])
                steps.append(
                    Step("backward", [add], comment=f"grad {value.name}: add {segment.name}'s")
                )
            owned[id(value)] = True
        for key, flag in before.items():
            owned.setdefault(key, flag)
        return steps

    def restore_segment_inputs(
        self, segment: Segment, nodes: list[Node], reader: Node
    ) -> list[Step]:
        """Steps restoring, once for the whole batch, the segment's inputs that are kept
        compressed and read by its recompute or its backward (``pieced_steps``)."""
        rerun = rerun_nodes(segment, [self.stashed[key].producer for key in segment.internal])
        read = {v.name for n in rerun for v in n.inputs}
        read |= {stashed.key for n in nodes for stashed, _, _ in self.plan.reads_of(n)}
        steps: list[Step] = []
        for name in segment.inputs:
            stashed = self.stashed[name]
            form = value_form(stashed)
            if name in read and form is not None and form.kind != "raw":
                step = self.restore_input(stashed, form, reader, segment)
                step.section, step.calls = "backward", ()
                step.comment = (
                    f"restore {name}: {form.label()} (input of {segment.name}, whole batch)"
                )
                steps.append(step)
                self.restored[(name, form)] = self.raw_var(name)
        return steps

    def piece_names(self, segment: Segment, free: list[str], graded: list[Value]) -> dict[str, str]:
        """Whole-batch variable -> the name of its piece, for the values a pieced segment
        reads from outside (each must have the batch dim first) and the gradients of its
        inputs."""
        mapping: dict[str, str] = {}
        for name in free:
            found = self.key_type(name)
            if found is None or not found.shape or found.shape[0] != "N":
                raise ModelError(
                    f"segment {segment.name} cannot run in pieces: it reads {name}, which has "
                    "no batch dimension first"
                )
            mapping[name] = self.name("piece", *self.key_of[name]).name
        for value in graded:
            grad = self.grad(value).name
            mapping[grad] = self.name("piece", *self.key_of[grad]).name
        return mapping

    def whole_batch_grads(
        self, graded: list[Value], full: dict[str, Var], reused: dict[str, str], anchor: Var
    ) -> Step:
        """The step allocating the whole-batch input gradients a pieced segment fills piece
        by piece: new tensors sized from ``anchor``'s batch, or an output gradient's memory
        when ``reusable_output_grads`` found one free."""
        size = CallExpr(Attr(anchor, "size"), (Const(0),))
        allocations: list[Statement] = [
            Assign(
                (full[v.name],),
                (
                    Var(reused[v.name])
                    if v.name in reused
                    else CallExpr(
                        Attr(anchor, "new_empty"),
                        (TupleExpr((size, *(Const(d) for d in v.type.shape[1:]))),),
                    )
                ),
            )
            for v in graded
        ]
        what = ", ".join(
            f"grad {v.name}"
            + (f" (in grad {self.key_of[reused[v.name]][1]}'s memory)" if v.name in reused else "")
            for v in graded
        )
        return Step("backward", allocations, comment=f"{what}: filled piece by piece")

    def reusable_output_grads(
        self,
        segment: Segment,
        graded: list[Value],
        before: dict[int, bool],
        free: list[str],
        owned: dict[int, bool],
    ) -> dict[str, str]:
        """Input gradients of a pieced segment that can be written over an output gradient
        of the same type, piece by piece (a transformer block: [N, L, E] in and out): input
        name -> the output gradient's variable. A piece's input gradient is copied into its
        slice once the piece's backward is done, and that slice of the output gradient is
        read by nothing after it, so the whole-batch input gradient needs no memory of its
        own. Only an output gradient this code owns alone (no other value's gradient
        aliases it: ``owned``), read by nothing after the loop, and only for an input with
        no gradient from elsewhere."""
        outputs = {n.output.name: n.output for n in segment.nodes}
        candidates = []
        for name in free:
            key = self.key_of.get(name, ())
            value = outputs.get(key[1]) if len(key) > 1 and key[0] == "grad" else None
            if value is not None and owned.get(id(value), False):
                candidates.append((name, value))
        found: dict[str, str] = {}
        for value in graded:
            if id(value) in before:
                continue
            for i, (name, out) in enumerate(candidates):
                if (
                    out.type.shape[1:] == value.type.shape[1:]
                    and out.type.dtype == value.type.dtype
                ):
                    found[value.name] = name
                    del candidates[i]
                    break
        return found

    def pieced_forward(self, segment: Segment, steps: list[Step]) -> list[Step]:
        """The forward of a segment run in pieces, in pieces as well: it keeps nothing for
        its own backward (its recompute makes that), so each piece of its inputs gives the
        piece of its outputs, copied into whole-batch tensors; what the forward keeps of
        those outputs for others (the next segment's input, compressed) is kept after the
        loop, from the whole tensors. Left whole (``steps`` as they are) when an output's
        dtype is not that of a batch tensor it reads (nothing to allocate it like)."""
        run = [
            i
            for i, step in enumerate(steps)
            if step.section == "forward" and step.calls[:1] == (segment.call,)
        ]
        if not run or run != list(range(run[0], run[-1] + 1)):
            return steps
        keeping = [steps[i] for i in run if _keeps(steps[i])]
        body = [steps[i] for i in run if not _keeps(steps[i])]
        free = _free_reads(body)
        written = {name for step in body for name in step.writes()}
        later = [*keeping, *steps[run[-1] + 1 :]]
        outputs = [n for n in dict.fromkeys(written) if any(n in s.reads() for s in later)]
        types = {name: self.key_type(name) for name in [*free, *outputs]}
        if any(t is None or not t.shape or t.shape[0] != "N" for t in types.values()):
            return steps
        anchors = {types[n].dtype: n for n in reversed(free)}
        if not outputs or any(types[n].dtype not in anchors for n in outputs):
            return steps
        mapping = {n: self.name("piece", *self.key_of[n]).name for n in [*free, *outputs]}
        for step in body:  # in place: the memory model knows the steps by identity
            step.statements = rename_vars(step, mapping).statements
        allocations: list[Statement] = []
        for name in outputs:
            anchor = Var(anchors[types[name].dtype])
            size = CallExpr(Attr(anchor, "size"), (Const(0),))
            shape = TupleExpr((size, *(Const(d) for d in types[name].shape[1:])))
            allocations.append(Assign((Var(name),), CallExpr(Attr(anchor, "new_empty"), (shape,))))
        slots = {n: self.name("slot", *self.key_of[n]) for n in outputs}
        targets = tuple(Var(mapping[n]) for n in free) + tuple(slots[n] for n in outputs)
        splits = [Var(n) for n in [*free, *outputs]]
        split = tuple(_split_batch(v, segment) for v in splits)
        header = Step(
            "forward",
            [Assign(targets, CallExpr(Global("zip"), split))],
            comment=f"[pieces] {segment.call.text}: its forward in {segment.pieces_text()}",
        )
        copies: list[Statement] = [
            Do(CallExpr(Attr(slots[n], "copy_"), (Var(mapping[n]),))) for n in outputs
        ]
        copy = Step("forward", copies, comment="the piece's outputs")
        self.piece_loops.append((header, copy, segment))
        what = ", ".join(self.key_of[n][-1] for n in outputs)
        made = Step("forward", allocations, comment=f"{what}: filled piece by piece")
        for step in keeping:  # from the whole outputs, at the top level
            step.calls = ()
        start, end = run[0], run[-1] + 1
        return [*steps[:start], made, header, *body, copy, *keeping, *steps[end:]]

    def key_type(self, name: str) -> TensorType | None:
        """The tensor type of a variable, from its structured key (None: not a tensor of the
        graph, such as a packed form)."""
        key = self.key_of.get(name)
        if key is None:
            return None
        if key[0] in ("value", "grad", "recomputed", "partial", "restored"):
            value = key[1].split(":")[0]
            if key[0] == "restored" or ":" in key[1]:
                stashed = self.stashed.get(key[1])
                return stashed.type if stashed is not None else None
            found = self.producers.get(value, False)
            if found is None:
                return self._input(value).type
            return found.output.type if found else None
        if key[0] == "extra":
            node = self.node_named[key[1]]
            return next(e.type for e in node.extras if e.name == key[2])
        return None

    def segment_forward_step(self, node: Node) -> Step:
        """A statement of a recomputed segment: its forward step, or for an op that updates
        buffers (batch norm) its registry recompute kernel, which makes the output with the
        batch's statistics and leaves the running ones alone (the statistics its backward
        reads stay those the forward kept)."""
        if not changes_state(node):
            return self.forward_step(node)
        op = node.op
        assert op.recompute is not None, f"{node.name} cannot be recomputed"
        args: list[Expr] = [self.var(v) for v in node.inputs]
        args.append(Layer(node.layer))
        kwargs = self.kwargs(explicit_kwargs(op, node.kernel_kwargs))
        defaults = self.defaults(op, node.kernel_kwargs)
        call = CallExpr(self.kernel(node, op.recompute.kernel), tuple(args), kwargs, defaults)
        step = self.node_step("forward", [Assign((self.var(node.output),), call)], node)
        return self.recompute_step(node, step)

    def forward_with_stash(
        self,
        nodes: list[Node],
        entries: list[Stashed],
        forward: Callable[[Node], Step] | None = None,
    ) -> list[Step]:
        """The forward steps of ``nodes`` with the stash steps of ``entries``: each kept
        form made right after the node that makes the tensor (before the first node when
        the tensor arrives from elsewhere: a model input, or a value another pipeline stage
        made), and what is kept raw recorded once per run of nodes (a block instance, or the
        statements between). ``forward``: each node's step (default ``forward_step``)."""
        forward = forward or self.forward_step
        made_here = {n.index for n in nodes}
        after: dict[int, list[Stashed]] = {}
        for stashed in entries:
            producer = stashed.producer if stashed.producer in made_here else -1
            after.setdefault(producer, []).append(stashed)

        def compressed(found: list[Stashed]) -> list[Stashed]:
            """Those with a form to make in the forward (not raw, not only recomputed)."""
            return [s for s in found if s.forms != [Form("raw")] and s.forms != [Form("recompute")]]

        def raw(found: list[Stashed]) -> list[Stashed]:
            return [s for s in found if s.forms == [Form("raw")]]

        arrived = after.get(-1, [])
        steps = [self.stash_step(s, ()) for s in compressed(arrived)]
        if raw(arrived):  # recorded before any block runs
            steps.append(self.stash_raw_step(raw(arrived), None))
        pending: list[Stashed] = []
        for i, n in enumerate(nodes):
            steps.append(forward(n))
            found = after.get(n.index, [])
            steps += [self.stash_step(s, n.blocks) for s in compressed(found)]
            pending += raw(found)
            following = nodes[i + 1] if i + 1 < len(nodes) else None
            if pending and (following is None or _run_of(following) is not _run_of(n)):
                # the raw record closes each block instance's run (and each run between)
                steps.append(self.stash_raw_step(pending, n))
                pending = []
        return steps

    def training_steps(self) -> list[Step]:
        graph = self.graph
        kept = [  # the rest: a segment's recompute makes them
            e if e.segment is None else dataclasses.replace(e, forms=e.segment_keeps)
            for e in self.plan.entries
            if e.segment is None or e.segment_keeps
        ]
        steps = self.forward_with_stash(graph.nodes, kept)
        for segment in self.plan.segments:
            if segment.in_pieces:
                steps = self.pieced_forward(segment, steps)
        loss = self.var(graph.loss)
        seed = CallExpr(Global("torch.ones_like"), (loss,))
        steps.append(
            Step(
                "backward",
                [Assign((self.grad(graph.loss),), seed)],
                comment="d loss / d loss = 1",
                stage=self.stage(graph.loss.producer),
            )
        )
        owned: dict[int, bool] = {id(graph.loss): True}
        begun: set[str] = set()  # recomputed segments whose backward has begun
        for node in reversed(graph.nodes):
            if node.needs_backward:
                segment = self.segment_of.get(node.index)
                if segment is not None and segment.in_pieces:
                    if segment.name not in begun:  # the whole segment's backward, in pieces
                        begun.add(segment.name)
                        steps += self.pieced_steps(segment, node, owned)
                    continue
                if segment is not None and segment.name not in begun:
                    begun.add(segment.name)
                    steps += self.segment_steps(segment, node)
                steps += self.restore_steps(node)
                steps.append(self.backward_step(node, owned))
        if self.data_parallel:
            steps = self.with_reductions(steps)
        # A forward step whose output is saved by a backward step must keep it alive:
        # liveness sees the read in the backward step, so nothing more to do here.
        release_dead(steps, keep=self.training_keep())
        return steps

    def with_reductions(self, steps: list[Step]) -> list[Step]:
        """Data parallel: ``K.reduce_bucket`` right after the backward run (a top-level
        block instance, or one top-level statement) in which a bucket's last gradient
        became final, so that its all-reduce runs while the rest of the backward computes;
        ``K.reduce_wait`` at the end. Buckets hold the parameters in the order their
        gradients become final, closed at the first run boundary once they reach
        ``BUCKET_BYTES`` (DistributedDataParallel's 25 MiB)."""
        last: dict[str, int] = {}  # parameter key -> the last step that accumulates it
        nbytes: dict[str, int] = {}
        for node in self.graph.nodes:
            for p in node.params:
                if p.present:
                    nbytes[p.key] = p.nbytes()
        for i, step in enumerate(steps):
            for statement in step.statements:
                if isinstance(statement, Do) and called_name(statement.value) in ACCUMULATORS:
                    owner = statement.value.args[0]
                    prefix = f"{owner.path}." if isinstance(owner, Layer) and owner.path else ""
                    for attr, _ in statement.value.kwargs:
                        last[prefix + attr] = i
        final_at: dict[int, list[str]] = {}
        for key, i in last.items():
            final_at.setdefault(i, []).append(key)
        out: list[Step] = []
        bucket: list[str] = []
        size = 0
        buckets = 0
        for i, step in enumerate(steps):
            out.append(step)
            for key in final_at.get(i, []):
                bucket.append(key)
                size += nbytes.get(key, 0)
            following = steps[i + 1] if i + 1 < len(steps) else None
            # a top-level statement is a run of its own; a block instance's steps are one
            boundary = following is None or not step.calls or following.calls[:1] != step.calls[:1]
            if bucket and boundary and (size >= self.bucket_bytes or following is None):
                out.append(self.reduce_step(buckets, bucket, size))
                buckets += 1
                bucket, size = [], 0
        if bucket:
            out.append(self.reduce_step(buckets, bucket, size))
        out.append(
            Step(
                "backward",
                [Do(CallExpr(Global("K.reduce_wait"), (Var("L"),)))],
                comment="wait for the all-reduces: every gradient is the average over processes",
            )
        )
        return out

    def stage_program(self, stage: int, crossing: list[Boundary]) -> list[Step]:
        """One pipeline stage's program (``--pipeline``), run as a generator by
        ``unroller.pipeline_parallel``: its nodes' forward (given the model inputs it reads
        and the boundary values it receives), ``yield`` of the values later stages read
        (the last stage: the loss) and resumption with their gradients (the last stage: the
        seed, the micro-batch's share of the loss), its nodes' backward, and ``return`` of
        the gradients of what it received. Each stage keeps for backward, and compresses,
        what its own backward steps read: a tensor made on one stage and read by a later
        one's backward is received there and kept there."""
        graph = self.graph
        self.restored, self.recomputed = {}, {}
        here = [n for n in graph.nodes if self.stage(n) == stage]
        received = [b for b in crossing if stage in b.targets]
        sent = [b for b in crossing if b.source == stage]
        last = stage == self.pipeline.num_ipus - 1
        if last != (self.stage(graph.loss.producer) == stage):
            raise ModelError(
                f"the loss '{graph.loss.name}' must be made on the last pipeline stage, and "
                "the split puts statements after it on a later one: give --stage-starts "
                "that begin every stage at or before the loss"
            )

        def own_forms(stashed: Stashed) -> Stashed | None:
            """The entry as this stage keeps it: the forms its own backward steps read."""
            readers = [r for r in stashed.readers if self.stage(r[0]) == stage]
            forms = list(dict.fromkeys(form for _, _, form in readers))
            if not forms:
                return None
            if any(f.kind == "recompute" for f in forms):
                raise ModelError("--recompute is not available with --pipeline")
            if stashed.segment is not None or stashed.segment_readers:
                raise ModelError("segment recompute is not available with --pipeline")
            return dataclasses.replace(stashed, readers=readers, forms=forms)

        entries = [e for e in map(own_forms, self.plan.entries) if e is not None]
        steps = self.forward_with_stash(here, entries)
        owned: dict[int, bool] = {}
        if last:
            handed, grads = [graph.loss], [self.grad(graph.loss)]
            comment = "hand over the loss; resumed with its seed gradient (the share of the batch)"
        else:
            handed = [b.value for b in sent]
            grads = [self.grad(b.value) if b.grad else None for b in sent]
            later = sorted({t for b in sent for t in b.targets})
            comment = (
                f"send {', '.join(v.name for v in handed)} to stage "
                f"{', '.join(map(str, later))}; resumed with the gradients sent back"
            )
        for value, grad in zip(handed, grads):
            if grad is not None:
                owned[id(value)] = True
        steps.append(
            Step("exchange", [Yield(tuple(grads), tuple(self.var(v) for v in handed))], comment)
        )
        for node in reversed(here):
            if node.needs_backward:
                steps += self.restore_steps(node)
                steps.append(self.backward_step(node, owned))
        back = tuple(self.grad(b.value) if id(b.value) in owned else Const(None) for b in received)
        what = ", ".join(f"grad {b.value.name}" for b in received if id(b.value) in owned)
        what = what or "nothing"
        steps.append(Step("exchange", [Return(back)], f"gradients sent back: {what}"))
        for step in steps:
            step.stage = stage
        release_dead(steps, keep={"stash", "L"})
        return steps

    def reduce_step(self, index: int, keys: list[str], size: int) -> Step:
        names = tuple(ModelName(k) for k in keys)
        return Step(
            "backward",
            [Do(CallExpr(Global("K.reduce_bucket"), (Var("L"), Const(index), TupleExpr(names))))],
            comment=f"all-reduce bucket {index}: {len(keys)} gradients, {size / 2**20:.2f} MiB",
        )

    def training_keep(self) -> set[str]:
        return {self.var(self.graph.loss).name, "grads", "stash", "L"}

    def predict_keep(self) -> set[str]:
        return {self.var(v).name for v in self.graph.preds} | {"L"}

    def outliner(self, programs: int = 1) -> Outliner:
        """Turns block runs into shared functions, with names no model name can take
        (``programs``: how many step programs share them; each may need its own variant of
        a block's function, as the stages of ``--pipeline`` keep different forms)."""

        def global_name(key: tuple[str, ...], base: str) -> str:
            return self.names("\0".join(key), base or base_name(key))

        reserved = RESERVED | set(self.codec_names.values()) | set(self.kernel_alias.values())
        outliner = Outliner(self.key_of, base_name, global_name, frozenset(reserved))
        counts: dict[str, int] = {}
        seen: set[str] = set()
        for node in self.graph.nodes:
            if node.blocks and node.blocks[0].name not in seen:
                seen.add(node.blocks[0].name)
                counts[node.blocks[0].block] = counts.get(node.blocks[0].block, 0) + programs
        # a recompute function's name is claimed only when a segment is recomputed, so
        # that every other module keeps the names it always had
        extra = (RECOMPUTE_SECTION,) if self.plan.segments else ()
        outliner.reserve(sorted(counts), counts, extra)
        return outliner

    def predict_steps(self) -> list[Step]:
        graph = self.graph
        needed: set[int] = {id(v) for v in graph.preds}
        for node in reversed(graph.nodes):
            if id(node.output) in needed:
                needed.update(id(v) for v in node.inputs)
        for value in graph.inputs:
            if value.kind == "target" and id(value) in needed:
                raise ModelError(
                    f"a prediction depends on target '{value.name}'; predict() takes only inputs",
                    value.loc,
                )
        steps = [
            self.forward_step(n, eval_mode=True) for n in graph.nodes if id(n.output) in needed
        ]
        release_dead(steps, keep=self.predict_keep())
        return steps


def _keeps(step: Step) -> bool:
    """Is ``step`` a stash step (compress and record, or record raw)?"""
    return any(
        isinstance(s, RecordRaw) or (isinstance(s, Do) and called_name(s.value) == "K.stash")
        for s in step.statements
    )


def _outside_values(segment: Segment) -> list[Value]:
    """The values a segment's nodes read that it does not make, each once, in order."""
    made = {n.output.name for n in segment.nodes}
    outside: list[Value] = []
    for node in segment.nodes:
        for value in node.inputs:
            if value.name not in made and all(value is not o for o in outside):
                outside.append(value)
    return outside


def _free_reads(steps: list[Step]) -> list[str]:
    """Variables ``steps`` read before writing them, in order, but the method's own (``L``,
    ``stash``, ``grads``): what a piece of a segment takes from outside."""
    free: dict[str, None] = {}
    written: set[str] = set()
    for step in steps:
        for name, kind in step.events():
            if kind == "r" and name not in written:
                free.setdefault(name)
            elif kind == "w":
                written.add(name)
    return [n for n in free if n not in ("L", "stash", "grads")]


def render_training(
    steps: list[Step], loops: list[tuple[Step, Step, Segment]], stage_block: str | None = None
) -> list[safe.Code]:
    """``render_steps`` of the training program, with each segment run in pieces as a
    ``for`` loop: its header step (``zip`` of the pieces) becomes the ``for`` line, the
    steps up to the loop's last one its body, and what the header step releases (the
    whole-batch tensors) is released after the loop."""
    if not loops:
        return render_steps(steps, stage_block)
    where = {id(step): i for i, step in enumerate(steps)}
    lines: list[safe.Code] = []
    start = 0
    for header, last, _ in loops:
        at, end = where[id(header)], where[id(last)]
        lines += _continued(render_steps(steps[start:at]), start)
        assign = header.statements[0]
        assert isinstance(assign, Assign)
        names = ", ".join(safe.identifier(t.name) for t in assign.targets if t is not None)
        lines.append(safe.Code(f"# {safe.comment_text(header.comment)}"))
        lines.append(safe.Code(f"for {names} in {render_expr(assign.value)}:"))
        body = _continued(render_steps(steps[at + 1 : end + 1]), 1)
        lines += [safe.Code("    " + line if line else line) for line in body]
        if header.release:
            lines.append(safe.Code(f"del {', '.join(map(safe.identifier, header.release))}"))
        start = end + 1
    return lines + _continued(render_steps(steps[start:]), start)


def _continued(lines: list[safe.Code], start: int) -> list[safe.Code]:
    """Lines of a later part of the backward: without the section heading again."""
    if start and len(lines) >= 2 and not lines[0] and lines[1].startswith("# ---- "):
        return lines[2:]
    return lines


def _remade_part(stashed: Stashed) -> Stashed:
    """A segment's own saved tensor as its recompute keeps it: the forms the forward does
    not keep already (``Stashed.segment_keeps``)."""
    if not stashed.segment_keeps:
        return stashed
    forms = [f for f in stashed.forms if f not in stashed.segment_keeps]
    return dataclasses.replace(stashed, forms=forms)


def _run_of(node: Node) -> BlockCall | None:
    """The top-level block instance a node belongs to (None: the model's own statements)."""
    return node.blocks[0] if node.blocks else None


def _relative(name: str, calls: tuple[BlockCall, ...]) -> str:
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


def layer_lines(graph: Graph) -> list[tuple[str, str, str]]:
    """(comment, state-dict prefix, constructor) for each node that has parameters.

    The constructor leaves out keywords equal to the registry default, which the registry
    keeps equal to the torch.nn class's own (``torch.nn.Conv2d(3, 64, (3, 3), bias=False)``).
    The layers of a block instance take one comment, the block call, above the first: each
    line names its layer (``"layer1.0.conv1"``) and the block's statements are shown once,
    in its functions; the comment is "" for the others.
    """
    layers = []
    instance = None
    for node in graph.nodes:
        if not (node.params or node.buffers):
            continue
        spec = node.op.module
        env = {**node.args, **node.derived}
        kwargs = explicit_kwargs(node.op, {k: env[k] for k in spec.kwargs})
        ctor = CallExpr(
            Global(spec.cls),
            tuple(Const(env[a]) for a in spec.args),
            Emitter.kwargs({**kwargs, **dict(spec.fixed)}),
        )
        comment = node.text
        if node.blocks:
            comment = "" if node.blocks[0] is instance else f"[block] {node.blocks[0].text}"
        instance = node.blocks[0] if node.blocks else None
        layers.append(
            (safe.comment_text(comment), safe.literal(node.name), safe.code(render_expr(ctor)))
        )
    return layers


def tie_lines(graph: Graph) -> list[tuple[str, str, str]]:
    """(comment, tied parameter's key, the key of the tensor it is) for each tie
    (``tied_PARAM=``), made after every layer exists."""
    return [
        (
            safe.comment_text(f"{node.name}.{name} is {key}"),
            safe.literal(f"{node.name}.{name}"),
            safe.literal(key),
        )
        for node in graph.nodes
        for name, key in node.ties.items()
    ]


def frozen_lines(graph: Graph) -> list[tuple[str, str]]:
    """(comment, key) for each frozen parameter (``frozen=true``): requires_grad off."""
    return [
        (safe.comment_text(f"{p.key} does not train"), safe.literal(p.key))
        for node in graph.nodes
        for p in node.params
        if p.present and not p.trainable
    ]


def header_comment(
    graph: Graph, source_path: str, options: Options, config: CompressionConfig
) -> str:
    meta = {
        "generator": __version__,
        "source": source_path,
        "sha256": graph.sha256,
        **options.as_dict(),
    }
    if config.sha256 is not None:
        meta["compress_config_sha256"] = config.sha256
    return HEADER_TAG + json.dumps(meta, sort_keys=False)


def render(
    graph: Graph,
    source_path: str,
    options: Options,
    config: CompressionConfig,
    readable: bool = True,
) -> str:
    """The complete generated module, formatted, with header and checksum.

    A pure function of its arguments: ``config`` is already resolved (a config file read,
    the ``auto`` scheme planned: ``unroller.api.compression_config``), so rendering never
    runs a model, reads a file or imports the planner. ``options`` says the platform,
    pipeline and what the header records (tests pass configs no loader would accept, to
    check the emitter on its own). ``readable=False``: not formatted by black, for a
    module only run, never read (verify's and the planner's probe modules): the same
    statements, and black is most of a render's time.
    """
    target = get_platform(options.platform)
    _check_segment_options(options)
    plan = plan_stash(graph, config, options.segment_pieces, options.segment_piece_size)
    _check_pieces(plan, target, options)
    pipeline = _split_stages(graph, plan, target, options)
    staged = pipeline is not None and pipeline.num_ipus > 1
    _check_staged(plan, target, options, staged)
    emitter = Emitter(graph, plan, target, pipeline, options.data_parallel, options.bucket_bytes)
    training_steps, predict_steps = emitter.training_steps(), emitter.predict_steps()
    outliner = emitter.outliner(2 if options.pipeline != 1 else 1)
    training_steps = outliner.outline(training_steps, emitter.training_keep())
    predict_steps = outliner.outline(predict_steps, emitter.predict_keep(), predict=True)
    for step in training_steps:  # a segment's recompute is part of the backward
        if step.section == RECOMPUTE_SECTION:
            step.section = "backward"
    stage_steps: list[list[Step]] = []
    if options.pipeline != 1 and pipeline is not None:
        crossing = boundaries(graph, pipeline)
        split_up = frozenset(split_instances(graph, pipeline))
        for k in range(pipeline.num_ipus):
            program = emitter.stage_program(k, crossing)
            stage_steps.append(outliner.outline(program, {"stash", "L"}, split=split_up))
    outliner.finish()  # every call known: literals that differ become parameters
    loops = [  # a loop's last step may be a block's, now run by the block's call
        (outliner.stand_in(header), outliner.stand_in(last), segment)
        for header, last, segment in emitter.piece_loops
    ]
    training = render_training(training_steps, loops, target.stage_block if staged else None)
    predict = render_steps(predict_steps)
    process_stages: list[dict[str, Any]] = []
    pipeline_meta: dict[str, safe.Code] = {}
    if stage_steps and pipeline is not None:
        for k, steps in enumerate(stage_steps):
            process_stages.append(_stage_view(emitter, graph, pipeline, crossing, k, steps))
        pipeline_meta = _pipeline_meta(graph, plan.config, pipeline, crossing)
    text = _template(target).render(
        **_module_view(graph, emitter, source_path, options, config, plan),
        functions=[_function_view(f, {s.name for s in plan.segments}) for f in outliner.functions],
        training=training,
        predict=predict or [safe.Code("pass")],
        surrogate_groups=[
            (stage, safe.literal(keys)) for stage, keys in _surrogate_groups(graph, pipeline)
        ],
        process_stages=process_stages,
        pipeline_meta=pipeline_meta,
        num_ipus=pipeline.num_ipus if pipeline else 1,
        stages=(
            [(i, safe.doc_text(s)) for i, s in enumerate(["(first node)", *pipeline.starts])]
            if pipeline
            else []
        ),
    )
    return add_checksum(formatted(text, black.format_str) if readable else text)


def _check_segment_options(options: Options) -> None:
    """Refuse a scheme the header cannot name and segment piece options that contradict."""
    if options.scheme not in SCHEMES:
        raise OptionError(
            f"--scheme: unknown scheme '{safe.comment_text(options.scheme)}' "
            f"(known: {', '.join(SCHEMES)})"
        )
    if options.segment_pieces < 1 or options.segment_piece_size < 0:
        raise OptionError("--segment-pieces must be at least 1, --segment-piece-size at least 0")
    if options.segment_pieces != 1 and options.segment_piece_size:
        raise OptionError("--segment-pieces and --segment-piece-size: give one of them")


def _config_name(options: Options) -> str:
    """The compression config as a message names it: its file, or the scheme."""
    if options.compress_config:
        return f"--compress-config {safe.comment_text(options.compress_config)}"
    return f"--scheme {options.scheme}"


def _pieces_source(options: Options) -> str:
    """What asked for segments in pieces, as the user wrote it."""
    if options.segment_pieces != 1:
        return f"--segment-pieces {options.segment_pieces}"
    if options.segment_piece_size:
        return f"--segment-piece-size {options.segment_piece_size}"
    return f"segment_piece_size of {_config_name(options)}"


def _segments_source(options: Options) -> str:
    """What asked for segment recompute, as the user wrote it."""
    if options.recompute_segments:
        return f"--recompute-segments {safe.comment_text(','.join(options.recompute_segments))}"
    return f"recompute_segments of {_config_name(options)}"


def _check_pieces(plan: StashPlan, target: Platform, options: Options) -> None:
    """Refuse a segment in pieces where pieces cannot run: a platform whose gradients do
    not accumulate into ``.grad`` (pieces add into it), or ``--data-parallel`` (whose
    buckets are all-reduced as the backward makes them). The error points at the
    segment's block call and names the option that asked for pieces."""
    pieced = next((s for s in plan.segments if s.in_pieces), None)
    if pieced is None:
        return
    asked = f"segment '{pieced.name}' in {pieced.pieces_text()} ({_pieces_source(options)})"
    if target.grads != "accumulate" or target.pipelined:
        raise ModelError(
            f"{asked}: not for --platform {target.name} (pieces add into .grad)", pieced.call.loc
        )
    if options.data_parallel:
        raise ModelError(f"{asked}: does not combine with --data-parallel yet", pieced.call.loc)


def _check_staged(plan: StashPlan, target: Platform, options: Options, staged: bool) -> None:
    """Refuse segment recompute, and ``--recompute`` under ``--pipeline``, where the step
    is split into stages; the error points at the first statement concerned and names
    both options."""
    stages = (
        f"--num-ipus {options.num_ipus}" if target.pipelined else f"--pipeline {options.pipeline}"
    )
    if plan.segments and staged:
        first = plan.segments[0]
        raise ModelError(
            f"segment '{first.name}' ({_segments_source(options)}): segment recompute is not "
            f"available with more than one pipeline stage ({stages})",
            first.call.loc,
        )
    if options.pipeline == 1 or not staged:
        return
    remade = [(s, n) for s in plan.entries for n, _, f in s.readers if f.kind == "recompute"]
    if remade:
        stashed, node = remade[0]
        source = "--recompute" if options.recompute else f"recompute of {_config_name(options)}"
        raise ModelError(
            f"the backward of '{node.name}' reads '{stashed.key}' remade ({source}): not "
            f"available with {stages}",
            node.loc,
        )


def _split_stages(
    graph: Graph, plan: StashPlan, target: Platform, options: Options
) -> Pipeline | None:
    """The model's pipeline stages: over IPUs for a pipelined platform (``--num-ipus``), over
    processes for ``--pipeline``; None when neither applies. Refuses the options a platform
    does not take and the combinations not supported yet."""
    pipeline = None
    starts = list(options.stage_starts) or None
    if target.pipelined:
        pipeline = split(graph, plan, options.num_ipus, starts)
    elif options.num_ipus != 1:
        raise OptionError(f"--num-ipus is not for --platform {target.name}")
    if options.pipeline != 1:
        if not target.process_stages or target.pipelined:
            raise OptionError(f"--pipeline is not for --platform {target.name}")
        if options.data_parallel:
            raise OptionError("--pipeline and --data-parallel do not combine yet")
        pipeline = split(
            graph, plan, options.pipeline, starts, PROCESS_STAGES, "--pipeline", loss_last=True
        )
    elif options.stage_starts and not target.pipelined:
        raise OptionError(
            f"--stage-starts needs --num-ipus or --pipeline (--platform {target.name})"
        )
    if options.data_parallel and target.pipelined:
        raise OptionError(
            f"--data-parallel is for --platform gpu (--platform {target.name} replicates itself)"
        )
    return pipeline


def _module_view(
    graph: Graph,
    emitter: Emitter,
    source_path: str,
    options: Options,
    config: CompressionConfig,
    plan: StashPlan,
) -> dict[str, Any]:
    """The template's fields that describe the module as a whole: header, imports,
    layers, the inputs' names and checks, the loss and predictions."""
    return dict(
        header=safe.comment_text(header_comment(graph, source_path, options, config)),
        codecs=[
            (safe.identifier(name), safe.literal(codec.name), safe.kwargs(codec.kwargs))
            for codec, name in emitter.codec_names.items()
        ],
        compression=safe.doc_text(_describe(config) + _segments_note(plan)),
        version=safe.doc_text(__version__),
        source_path=safe.doc_text(source_path),
        model_name=safe.doc_text(graph.name),
        platform=safe.doc_text(emitter.platform.name),
        scheme=safe.doc_text(options.scheme),
        kernel_imports=[
            (safe.dotted(module), safe.identifier(alias))
            for module, alias in sorted(emitter.kernel_alias.items(), key=lambda kv: kv[1])
        ],
        layers=layer_lines(graph),
        ties=tie_lines(graph),
        frozen=frozen_lines(graph),
        train_args=[safe.identifier(emitter.var(v).name) for v in graph.inputs],
        train_checks=_input_checks(emitter, graph.inputs),
        predict_checks=_input_checks(emitter, graph.model_inputs),
        predict_args=[safe.identifier(emitter.var(v).name) for v in graph.model_inputs],
        loss=safe.identifier(emitter.var(graph.loss).name),
        preds=[safe.identifier(emitter.var(v).name) for v in graph.preds],
        signature=[safe.doc_text(f"{v.name}: {v.type}") for v in graph.inputs],
        input_specs=safe.literal(
            [
                (v.name, v.kind, v.type.dtype, list(v.type.shape[1:]), _value_range(v))
                for v in graph.inputs
            ]
        ),
    )


@functools.lru_cache(maxsize=128)
def formatted(text: str, format_str: Callable[..., str]) -> str:
    """black's formatting of a rendered module, remembered: black takes ~80% of a render
    (0.7 s for a ResNet), and one process often renders the same text again (``unroll
    check`` after generate, the benchmark harness, the tests). Keyed by the formatter too,
    so a stand-in formatter (the fuzz tests') never serves or poisons black's results."""
    return format_str(text, mode=black.Mode(line_length=GENERATED_LINE_LENGTH))


PROCESS_STAGES = (2, 3, 4, 5, 6, 7, 8)
"""The stage counts ``--pipeline`` accepts (one process each)."""


def _stage_view(
    emitter: Emitter,
    graph: Graph,
    pipeline: Pipeline,
    crossing: list[Boundary],
    stage: int,
    steps: list[Step],
) -> dict[str, Any]:
    """One stage generator for the template: arguments, docstring and the lines of its
    forward, exchange (``yield``), backward and ``return``."""
    cut = next(i for i, s in enumerate(steps) if s.section == "exchange")
    args = [emitter.var(v).name for v in stage_inputs(graph, pipeline, stage)]
    args += [emitter.var(b.value).name for b in crossing if stage in b.targets]
    nodes = [n.name for n in graph.nodes if pipeline.stage(n.name) == stage]
    doc = (
        f"Pipeline stage {stage} of {pipeline.num_ipus}: {nodes[0]} .. {nodes[-1]}, "
        f"{len(nodes)} statement{'s' if len(nodes) != 1 else ''}. A generator: "
        "unroller.pipeline_parallel runs it."
    )
    backward = render_steps(steps[cut + 1 : -1])
    return {
        "index": stage,
        "args": [safe.identifier(a) for a in args],
        "doc": safe.doc_text(doc),
        "forward": render_steps(steps[:cut]) or [safe.Code("pass")],
        "exchange": _plain_lines(steps[cut]),
        "backward": backward or [safe.Code("pass")],
        "ret": _plain_lines(steps[-1]),
    }


def _plain_lines(step: Step) -> list[safe.Code]:
    """A top-level step as lines of its own: comment, code, releases."""
    lines = [f"# {safe.comment_text(step.comment)}", *step.text()]
    if step.release and not isinstance(step.statements[-1], Return):
        lines.append(f"del {', '.join(safe.identifier(name) for name in step.release)}")
    return [safe.Code(line) for line in lines]


def _pipeline_meta(
    graph: Graph, config: CompressionConfig, pipeline: Pipeline, crossing: list[Boundary]
) -> dict[str, safe.Code]:
    """What the pipeline driver needs to know, as literals: per stage the positions of the
    model inputs its generator takes (in the step's order); per boundary value (name, the
    stage that makes it, the stages that read it, shape ("N": the batch), dtype, whether a
    gradient flows back, the codec it and its gradient travel in: (name, ((parameter,
    value), ...)), None for raw)."""
    rows = []
    for b in crossing:
        readers = [n for n, _ in b.value.consumers if pipeline.stage(n.name) != b.source]
        codec = wire_codec(graph, config, b.value, readers)
        rows.append(
            (
                b.value.name,
                b.source,
                tuple(b.targets),
                tuple(b.value.type.shape),
                b.value.type.dtype,
                b.grad,
                (codec.name, codec.params) if codec is not None else None,
            )
        )
    k = pipeline.num_ipus
    return {
        "stages": safe.literal(k),
        "inputs": safe.literal(
            [
                tuple(graph.inputs.index(v) for v in stage_inputs(graph, pipeline, i))
                for i in range(k)
            ]
        ),
        "boundaries": safe.literal(rows),
    }


def _function_view(
    function: Function, recomputed: set[str] = frozenset()
) -> tuple[safe.Code, list[safe.Code], safe.Code, list]:
    """(name, parameters, docstring, body lines) of one block function, for the template;
    ``recomputed``: the block instances recomputed in the backward (segment recompute)."""
    shown = function.instances[:4]
    more = len(function.instances) - len(shown)
    where = ", ".join(shown) + (f" and {more} more" if more else "")
    if function.section == RECOMPUTE_SECTION:
        doc = (
            f"Forward of block `{function.block}` again, where its backward begins (segment "
            f"recompute), for {where}: from its kept inputs, keeping its stash as the "
            "forward does without recompute."
        )
    else:
        what = {"forward": "Forward", "backward": "Backward", "predict": "Prediction"}
        doc = f"{what[function.section]} of block `{function.block}`, for {where}."
        if function.section == "forward" and set(function.instances) <= recomputed:
            doc += " Keeps nothing for its own backward: that recomputes it from its inputs."
    return (
        safe.identifier(function.name),
        [safe.identifier(p) for p in function.signature()],
        safe.doc_text(doc),
        function.body,
    )


def _input_checks(emitter: Emitter, values: list[Value]) -> safe.Code:
    """Arguments of ``K.check_inputs``: (name, tensor, dtype, dims after N) per input."""
    return safe.Code(
        ", ".join(
            f"({safe.literal(v.name)}, {safe.identifier(emitter.var(v).name)}, "
            f"{safe.literal(v.type.dtype)}, {safe.literal(tuple(v.type.shape[1:]))})"
            for v in values
        )
    )


def _join(items: list[safe.Code], separator: str = "") -> safe.Code:
    """Jinja's ``join`` for vetted parts: the separator is the template's own text."""
    return safe.Code(separator.join(safe.template_value(item) for item in items))


@functools.cache
def _template(platform: Platform) -> jinja2.Template:
    """The platform's module template, in an environment that emits only vetted text
    (compiled once per platform and process: compiling took ~10% of a render)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=safe.template_value,
    )
    env.filters["join"] = _join
    return env.get_template(platform.template)


def _value_range(value: Value) -> int:
    """For synthetic data: the class count of a loss's class-index target, 1 for a
    probability (registry ``target``, which verify's inputs read too)."""
    for node, position in value.consumers:
        if node.op.target == "classes" and position == 1:
            return int(node.inputs[0].type.shape[1])
        if node.op.target == "probabilities" and position == 1:
            return 1
    return 0 if value.type.dtype.startswith("f") else 2


def _surrogate_groups(graph: Graph, pipeline: Pipeline | None) -> list[tuple[int, list[str]]]:
    """Parameter keys with gradients, grouped by the pipeline stage that computes them."""
    groups: dict[int, list[str]] = {}
    for node in graph.nodes:
        if node.needs_backward:
            stage = pipeline.stage(node.name) if pipeline else 0
            groups.setdefault(stage, []).extend(p.key for p in node.params if p.present)
    return sorted((k, v) for k, v in groups.items() if v)


def _segments_note(plan: StashPlan) -> str:
    """The docstring's words on segment recompute ("" without it)."""
    if not plan.segments and not plan.config.segments:
        return ""
    names = [s.name for s in plan.segments]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    note = f"; blocks recomputed in the backward: {shown or 'none'}"
    if plan.skipped_segments:
        note += f" ({len(plan.skipped_segments)} not recomputable: see unroll graph)"
    pieced = [s for s in plan.segments if s.in_pieces]
    if pieced:
        note += (
            f", {len(pieced)} of them run in {pieced[0].pieces_text()} (forward, "
            "recompute and backward)"
        )
    if plan.unpieced_segments:
        note += f" ({len(plan.unpieced_segments)} whole: see unroll graph)"
    return note


def _describe(config: CompressionConfig) -> str:
    tensor_rules = [r for r in config.rules if r.tensor is not None]
    if config.default is None and not config.rules:
        parts = ["no compression"]
    elif len(tensor_rules) == len(config.rules) and config.default is None:
        counts: dict[str, int] = {}
        for rule in tensor_rules:
            label = rule.codec.label() if rule.codec else "none"
            counts[label] = counts.get(label, 0) + 1
        parts = [f"{len(tensor_rules)} tensors by name"]
        parts += [f"{n} as {label}" for label, n in counts.items()]
        parts.append("the rest raw")
    else:
        parts = [f"default {config.default.label() if config.default else 'none'}"]
        parts += [
            f"rule{' op=' + repr(r.op) if r.op else ''}{' name=' + repr(r.name) if r.name else ''}"
            f"{' tensor=' + repr(r.tensor) if r.tensor else ''}: "
            f"{r.codec.label() if r.codec else 'none'}"
            for r in config.rules
        ]
    if config.first_only:
        parts.append("first compressible activation only")
    parts.append("1-bit masks" if config.masks else "no masks")
    return "; ".join(parts)


def body_checksum(text: str) -> str:
    body = "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith(CHECKSUM_TAG)
    )
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def add_checksum(text: str) -> str:
    lines = text.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith(HEADER_TAG)) + 1
    lines.insert(index, f"{CHECKSUM_TAG}{body_checksum(text)}\n")
    return "".join(lines)


def read_header(text: str) -> dict[str, Any] | None:
    """The metadata a generated file records, or None if it is not a generated file."""
    for line in text.splitlines()[:10]:
        if line.startswith(HEADER_TAG):
            try:
                found = json.loads(line[len(HEADER_TAG) :])
            except (json.JSONDecodeError, RecursionError):
                return None
            return found if isinstance(found, dict) else None
    return None


def edited_by_hand(text: str) -> bool:
    """True when a generated file's body no longer matches the checksum it carries."""
    for line in text.splitlines()[:10]:
        if line.startswith(CHECKSUM_TAG):
            return line[len(CHECKSUM_TAG) :].strip() != body_checksum(text)
    return True
