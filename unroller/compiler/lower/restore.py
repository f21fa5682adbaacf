"""Saved tensors as a backward step reads them: restored from a compressed form right
before the first reader, or remade by a short chain of recompute kernels (``--recompute``).

A restored form is shared by every later reader of the same program; what a remake makes
on the way is its own and freed right after it, since keeping a tensor restored for a
later reader alive until then costs more memory than decompressing it twice.
"""

from __future__ import annotations

from unroller.compiler.graph import Node, SavedArg, explicit_kwargs
from unroller.compiler.ir import Assign, Attr, CallExpr, Const, Expr, Global, Layer, Step, Var

from .context import LoweringContext, const_kwargs, defaults, in_block
from .resolved import Form, Stashed


def saved_arg(ctx: LoweringContext, node: Node, arg: SavedArg) -> Expr:
    """The argument a backward call passes for one saved entry."""
    if arg.kind == "layer":
        return Layer(node.layer, node.cast_params)
    if arg.kind == "none":
        return Const(None)
    found = ctx.plan.node(node).saved.get(arg.entry)
    if found is not None and found.form.kind == "recompute":
        return ctx.recomputed[found.stashed.key]
    if found is not None and found.form.kind != "raw":
        # restored once for the whole batch ahead of a segment run in pieces, or here
        restored = ctx.restored.get((found.stashed.key, found.form))
        return restored or ctx.restored_var(found.stashed.key, found.form)
    return ctx.raw_var(arg.key)


def restore_steps(ctx: LoweringContext, node: Node) -> list[Step]:
    """Right before a backward step: decompress what it reads, unless already done, and
    remake what is recomputed (``--recompute``)."""
    steps: list[Step] = []
    for read in ctx.plan.node(node).reads:
        if read.form.kind == "recompute":
            remade(ctx, read.stashed.key, node, steps)
        elif read.form.kind != "raw":
            restore(ctx, read.stashed, read.form, node, steps)
    return steps


def restore(
    ctx: LoweringContext,
    stashed: Stashed,
    form: Form,
    node: Node,
    steps: list[Step],
    shared: bool = True,
) -> Var:
    """The restored variable of one stored form; its decompress step is appended to
    ``steps`` the first time (``node``: the backward step that needs it). ``shared``
    False: a variable of its own, for one remake, so that the tensor is freed right
    after it instead of living on until its own reader's backward step."""
    if (stashed.key, form) in ctx.restored:
        return ctx.restored[(stashed.key, form)]
    if shared:
        restored = ctx.restored_var(stashed.key, form)
        ctx.restored[(stashed.key, form)] = restored
    else:
        suffix = "mask" if form.kind == "mask" else "restored"
        restored = ctx.name("restored", stashed.key, suffix, str(form), ctx.private())
    logical = form.type or stashed.type
    dtype: Expr
    if form.kind == "mask":
        dtype = Global("torch.bool")
    else:
        dtype = Attr(ctx.grad(node.output), "dtype")
    codec = ctx.codec(form)
    args = (ctx.packed_var(stashed.key, form), Const(tuple(logical.shape[1:])), dtype)
    if shared and (stashed.key, form) in ctx.plan.in_pieces:
        call = CallExpr(Global("K.restore_in_pieces"), (Global(codec), *args))
    else:
        call = CallExpr(Global(f"{codec}.decompress"), args)
    steps.append(
        Step(
            "backward",
            [Assign((restored,), call)],
            comment=f"restore {stashed.key}: {form.label()}",
            calls=node.blocks,
            local_comment=f"restore {in_block(stashed.key, node.blocks)}: {form.label()}",
            stage=ctx.stage(node),
        )
    )
    return restored


def remade(
    ctx: LoweringContext, name: str, reader: Node, steps: list[Step], shared: bool = True
) -> Var:
    """The value ``name`` as the backward of ``reader`` reads it: kept raw, restored from
    its compressed form, there anyway, or remade by its producer's recompute kernel from
    those (recursively, as ``stash.plan_recompute`` planned it)."""
    source = ctx.plan.sources[name]
    if source.kind in ("input", "there"):
        return ctx.var(source.value)
    if source.kind == "kept":
        if source.form.kind == "raw":
            return ctx.raw_var(name)
        return restore(ctx, source.stashed, source.form, reader, steps, shared)
    if shared and name in ctx.recomputed:
        return ctx.recomputed[name]
    producer = source.producer
    op = producer.op
    assert op.recompute is not None, f"{name} is not recomputable"
    args: list[Expr] = [remade(ctx, v.name, reader, steps, False) for v in producer.inputs]
    if producer.params or producer.buffers:
        args.append(Layer(producer.layer, producer.cast_params))
    kwargs = const_kwargs(explicit_kwargs(op, producer.kernel_kwargs))
    call = CallExpr(
        ctx.kernel(producer, op.recompute.kernel),
        tuple(args),
        kwargs,
        defaults(op, producer.kernel_kwargs),
    )
    if shared:
        target = ctx.name("recomputed", name)
        ctx.recomputed[name] = target
    else:
        target = ctx.name("recomputed", name, ctx.private())
    targets: list[Var | None] = [target]
    if op.recompute.kernel == op.name and op.extras:  # the forward: its extras unused
        targets += [None] * len(producer.extras)
    step = Step(
        "backward",
        [Assign(tuple(targets), call)],
        comment=f"recompute {producer.text}",
        calls=reader.blocks,
        local_comment=f"recompute {producer.local_text}",
        stage=ctx.stage(reader),
    )
    steps.append(ctx.observed(producer, step))
    return target
