"""The forward pass: every forward kernel call, with what is kept for backward right after
the tensor is made (compressed once per stored form, or recorded raw), and the forward of
``predict()`` with eval kernels.

Compressing right after the producer lets the raw tensor die as soon as its forward
readers are done; recording the raw tensors once per run of nodes (a block instance, or
the statements between) keeps a block's forward one contiguous run for the outliner.
"""

from __future__ import annotations

from collections.abc import Callable

from unroller.compiler.graph import BlockCall, Node, explicit_kwargs
from unroller.compiler.ir import (
    Assign,
    CallExpr,
    Do,
    Expr,
    Global,
    Layer,
    ModelName,
    RecordRaw,
    Statement,
    Step,
    TupleExpr,
    Var,
    release_dead,
)
from unroller.errors import ModelError

from .context import LoweringContext, const_kwargs, defaults, in_block
from .resolved import RAW, RECOMPUTE, Stashed


def forward_step(ctx: LoweringContext, node: Node, eval_mode: bool = False) -> Step:
    """``out[, extras] = K.op(inputs..., [layer], **non-default args)``."""
    op = node.op
    evaluating = eval_mode and op.has_eval
    args: list[Expr] = [ctx.var(v) for v in node.inputs]
    if node.params or node.buffers:
        args.append(Layer(node.layer, node.cast_params))
    call = CallExpr(
        ctx.kernel(node, f"{op.name}_eval" if evaluating else op.name),
        tuple(args),
        const_kwargs(explicit_kwargs(op, node.kernel_kwargs)),
        defaults(op, node.kernel_kwargs),
    )
    targets: list[Var | None] = [ctx.var(node.output)]
    if op.extras and not evaluating:
        kept = ctx.plan.node(node).kept_extras if not eval_mode else frozenset()
        targets += [ctx.extra(node, e.name) if e.name in kept else None for e in node.extras]
    return ctx.observed(node, ctx.node_step("forward", [Assign(tuple(targets), call)], node))


def stash_step(ctx: LoweringContext, stashed: Stashed, calls: tuple[BlockCall, ...]) -> Step:
    """Right after the tensor is made: compress it (once per form) and record the bytes."""
    raw = ctx.raw_var(stashed.key)
    statements: list[Statement] = []
    packs: list[Expr] = []
    for form in stashed.forms:
        if form.kind == "recompute":
            continue
        source: Expr = raw
        if form.kind == "mask" and form.mask_kernel:
            reader = ctx.node_named[form.mask_node]
            source = CallExpr(
                ctx.kernel(reader, form.mask_kernel),
                (raw,),
                const_kwargs(reader.backward_kwargs),
            )
        packed = ctx.packed_var(stashed.key, form)
        codec = ctx.codec(form)
        statements.append(Assign((packed,), CallExpr(Global(f"{codec}.compress"), (source,))))
        packs.append(TupleExpr((Global(codec), packed)))
    key = ModelName(stashed.key)
    statements.append(Do(CallExpr(Global("K.stash"), (Var("stash"), key, raw, *packs))))
    producer = ctx.graph.nodes[stashed.producer] if stashed.producer >= 0 else None
    labels = " + ".join(f.label() for f in stashed.forms if f.kind != "recompute")
    return Step(
        "forward",
        statements,
        comment=f"keep {stashed.key} as {labels}",
        calls=calls,
        local_comment=f"keep {in_block(stashed.key, calls)} as {labels}",
        stage=ctx.stage(producer),
    )


def stash_raw_step(ctx: LoweringContext, entries: list[Stashed], after: Node | None) -> Step:
    """Record what is kept uncompressed, right after ``after`` (None: before any node),
    the last node of the run of nodes (a block instance, or statements between) that
    made them."""
    items = tuple((ModelName(s.key), ctx.raw_var(s.key)) for s in entries)
    return Step(
        "forward",
        [RecordRaw(Var("stash"), items)],
        comment="kept as they are for backward",
        calls=after.blocks[:1] if after is not None else (),
        stage=ctx.stage(after),
    )


def _compressed(found: list[Stashed]) -> list[Stashed]:
    """Those with a form to make in the forward (not raw, not only recomputed)."""
    return [s for s in found if s.forms != [RAW] and s.forms != [RECOMPUTE]]


def _raw(found: list[Stashed]) -> list[Stashed]:
    return [s for s in found if s.forms == [RAW]]


def forward_with_stash(
    ctx: LoweringContext,
    nodes: list[Node],
    entries: list[Stashed],
    forward: Callable[[LoweringContext, Node], Step] | None = None,
) -> list[Step]:
    """The forward steps of ``nodes`` with the stash steps of ``entries``: each kept
    form made right after the node that makes the tensor (before the first node when
    the tensor arrives from elsewhere: a model input, or a value another pipeline stage
    made), and what is kept raw recorded once per run of nodes (a block instance, or the
    statements between). ``forward``: each node's step (default ``forward_step``)."""
    forward = forward or forward_step
    made_here = {n.index for n in nodes}
    after: dict[int, list[Stashed]] = {}
    for stashed in entries:
        producer = stashed.producer if stashed.producer in made_here else -1
        after.setdefault(producer, []).append(stashed)
    arrived = after.get(-1, [])
    steps = [stash_step(ctx, s, ()) for s in _compressed(arrived)]
    if _raw(arrived):  # recorded before any block runs
        steps.append(stash_raw_step(ctx, _raw(arrived), None))
    pending: list[Stashed] = []
    for i, n in enumerate(nodes):
        steps.append(forward(ctx, n))
        found = after.get(n.index, [])
        steps += [stash_step(ctx, s, n.blocks) for s in _compressed(found)]
        pending += _raw(found)
        following = nodes[i + 1] if i + 1 < len(nodes) else None
        if pending and (following is None or _run_of(following) is not _run_of(n)):
            # the raw record closes each block instance's run (and each run between)
            steps.append(stash_raw_step(ctx, pending, n))
            pending = []
    return steps


def _run_of(node: Node) -> BlockCall | None:
    """The top-level block instance a node belongs to (None: the model's own statements)."""
    return node.blocks[0] if node.blocks else None


def forward_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: the training forward of every node, keeping what the forward keeps (a
    recomputed segment's own stash is made by its recompute instead)."""
    return steps + forward_with_stash(ctx, ctx.graph.nodes, ctx.plan.forward_entries)


def hand_out_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: each prediction handed out right after the forward made it (after the block
    instance that made it, at the model's level): ``K.hand_out`` keeps it only when the
    step's caller asked (``keep_predictions``), so a training step can also give the
    predictions it computed (dropout drawn, batch statistics) at no cost otherwise."""
    for value in ctx.graph.preds:
        var = ctx.var(value)
        made = [i for i, s in enumerate(steps) if s.section == "forward" and var.name in s.writes()]
        if not made:  # a prediction that is a model input: nothing made
            continue
        at = made[-1] + 1
        run = steps[made[-1]].calls[:1]
        while run and at < len(steps) and steps[at].calls[:1] == run:
            at += 1
        call = CallExpr(Global("K.hand_out"), (Var("stash"), ModelName(value.name), var))
        step = Step(
            "forward",
            [Do(call)],
            comment=f"hand out the prediction {value.name} (kept only when asked)",
            stage=steps[made[-1]].stage,
        )
        steps.insert(at, step)
    return steps


def predict_keep(ctx: LoweringContext) -> set[str]:
    return {ctx.var(v).name for v in ctx.graph.preds} | {"L"}


def predict_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: ``predict()``, the forward with eval kernels of what the predictions need,
    keeping nothing."""
    graph = ctx.graph
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
    steps = steps + [
        forward_step(ctx, n, eval_mode=True) for n in graph.nodes if id(n.output) in needed
    ]
    release_dead(steps, keep=predict_keep(ctx))
    return steps
