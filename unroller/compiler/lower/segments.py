"""Segment recompute: where a recomputed block instance's backward begins, its forward
again from the inputs the forward kept, making its own stash exactly as the forward makes
it without segment recompute.

The steps are section ``recompute``: a run of their own, which the outliner turns into a
call of the block's recompute function, rendered inside the backward.
"""

from __future__ import annotations

from unroller.compiler.dtypes import TORCH_DTYPE_NAMES
from unroller.compiler.graph import Node, explicit_kwargs
from unroller.compiler.ir import (
    RECOMPUTE_SECTION,
    Assign,
    Attr,
    CallExpr,
    Const,
    Expr,
    Global,
    Layer,
    Step,
)
from unroller.compiler.precision import get as get_precision

from .context import LoweringContext, const_kwargs, defaults, in_block
from .forward import forward_step, forward_with_stash
from .resolved import Form, Segment, SegmentPlan, Stashed


def segment_steps(
    ctx: LoweringContext, plan: SegmentPlan, reader: Node, restore_inputs: bool = True
) -> list[Step]:
    """When the segment's backward begins (right before ``reader``'s backward step, its
    last statement with one): its inputs restored from what the forward kept, then its
    forward statements again, each followed by the stash steps of the tensors only the
    recompute makes. A statement none of those tensors depends on (what only the rest of
    the graph reads, such as the block's last residual sum) is left out: the forward made
    it already."""
    steps: list[Step] = []
    for stashed, form in plan.inputs:
        assert form is not None, f"{stashed.key} is not kept for {plan.segment.name}"
        if form.kind != "raw" and restore_inputs:
            steps.append(restore_input(ctx, stashed, form, reader, plan.segment))
    steps += forward_with_stash(ctx, plan.rerun, plan.remade, segment_forward_step)
    for step in steps:
        step.section = RECOMPUTE_SECTION
    return steps


def restore_input(
    ctx: LoweringContext, stashed: Stashed, form: Form, reader: Node, segment: Segment
) -> Step:
    """A segment input decompressed into its own variable for the recompute: the
    forward's statements read it by that name, and the forward's tensor is long gone. In
    the step's dtype (its output gradient's), or under a mixed precision, whose values
    differ in dtype, in the value's own (a kept matrix product's output in bf16)."""
    dtype: Expr = Attr(ctx.grad(reader.output), "dtype")
    if get_precision(ctx.graph.precision).mixed:
        dtype = Global(f"torch.{TORCH_DTYPE_NAMES[stashed.type.dtype]}")
    call = CallExpr(
        Global(f"{ctx.codec(form)}.decompress"),
        (ctx.packed_var(stashed.key, form), Const(tuple(stashed.type.shape[1:])), dtype),
    )
    calls = (segment.call,)
    return Step(
        RECOMPUTE_SECTION,
        [Assign((ctx.raw_var(stashed.key),), call)],
        comment=f"restore {stashed.key}: {form.label()} (input of {segment.name})",
        calls=calls,
        local_comment=f"restore {in_block(stashed.key, calls)}: {form.label()}",
        stage=ctx.stage(reader),
    )


def segment_forward_step(ctx: LoweringContext, node: Node) -> Step:
    """A statement of a recomputed segment: its forward step, or for an op that updates
    buffers (batch norm) its registry recompute kernel, which makes the output with the
    batch's statistics and leaves the running ones alone (the statistics its backward
    reads stay those the forward kept)."""
    if not ctx.plan.node(node).recompute_state:
        return forward_step(ctx, node)
    op = node.op
    assert op.recompute is not None, f"{node.name} cannot be recomputed"
    args: list[Expr] = [ctx.var(v) for v in node.inputs]
    args.append(Layer(node.layer, node.cast_params))
    kwargs = const_kwargs(explicit_kwargs(op, node.kernel_kwargs))
    call = CallExpr(
        ctx.kernel(node, op.recompute.kernel), tuple(args), kwargs, defaults(op, node.kernel_kwargs)
    )
    step = ctx.node_step("forward", [Assign((ctx.var(node.output),), call)], node)
    return ctx.observed(node, step)
