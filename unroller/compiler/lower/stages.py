"""Pipeline stages (``--pipeline K``): one step program per stage, run as a generator by
``unroller.parallel.pipeline``.

A stage's program is its nodes' forward (given the model inputs it reads and the boundary
values it receives), a ``yield`` of the values later stages read (the last stage: the
loss) resumed with their gradients (the last stage: the seed, the micro-batch's share of
the loss), its nodes' backward, and a ``return`` of the gradients of what it received.
Each stage keeps for backward, and compresses, what its own backward steps read: a tensor
made on one stage and read by a later one's backward is received there and kept there.
"""

from __future__ import annotations

import dataclasses

from unroller.compiler.graph import Value
from unroller.compiler.ir import Const, Return, Step, Var, Yield, release_dead
from unroller.compiler.pipeline import Boundary
from unroller.errors import ModelError

from .context import LoweringContext
from .forward import forward_with_stash
from .grads import backward_step
from .resolved import Stashed
from .restore import restore_steps


def stage_program(ctx: LoweringContext, stage: int, crossing: list[Boundary]) -> list[Step]:
    """The program of pipeline stage ``stage`` (``crossing``: the boundary values)."""
    graph = ctx.graph
    ctx.begin_program()
    here = [n for n in graph.nodes if ctx.stage(n) == stage]
    last = stage == ctx.pipeline.num_ipus - 1
    if last != (ctx.stage(graph.loss.producer) == stage):
        raise ModelError(
            f"the loss '{graph.loss.name}' must be made on the last pipeline stage, and "
            "the split puts statements after it on a later one: give --stage-starts "
            "that begin every stage at or before the loss"
        )
    entries = [e for e in (_own_forms(ctx, e, stage) for e in ctx.plan.entries) if e is not None]
    steps = forward_with_stash(ctx, here, entries)
    owned: dict[int, bool] = {}
    steps.append(_exchange(ctx, [b for b in crossing if b.source == stage], last, owned))
    for node in reversed(here):
        if node.needs_backward:
            steps += restore_steps(ctx, node)
            steps.append(backward_step(ctx, node, owned))
    received = [b for b in crossing if stage in b.targets]
    back = tuple(ctx.grad(b.value) if id(b.value) in owned else Const(None) for b in received)
    what = ", ".join(f"grad {b.value.name}" for b in received if id(b.value) in owned)
    what = what or "nothing"
    steps.append(Step("exchange", [Return(back)], f"gradients sent back: {what}"))
    for step in steps:
        step.stage = stage
    release_dead(steps, keep={"stash", "L"})
    return steps


def _own_forms(ctx: LoweringContext, stashed: Stashed, stage: int) -> Stashed | None:
    """The entry as stage ``stage`` keeps it: the forms its own backward steps read."""
    readers = [r for r in stashed.readers if ctx.stage(r[0]) == stage]
    forms = list(dict.fromkeys(form for _, _, form in readers))
    if not forms:
        return None
    if any(f.kind == "recompute" for f in forms):
        raise ModelError("--recompute is not available with --pipeline")
    if stashed.segment is not None or stashed.segment_readers:
        raise ModelError("segment recompute is not available with --pipeline")
    return dataclasses.replace(stashed, readers=readers, forms=forms)


def _exchange(
    ctx: LoweringContext, sent: list[Boundary], last: bool, owned: dict[int, bool]
) -> Step:
    """The ``yield`` between a stage's forward and its backward: what it hands on, resumed
    with their gradients (which it then owns)."""
    graph = ctx.graph
    handed: list[Value]
    grads: list[Var | None]
    if last:
        handed, grads = [graph.loss], [ctx.grad(graph.loss)]
        comment = "hand over the loss; resumed with its seed gradient (the share of the batch)"
    else:
        handed = [b.value for b in sent]
        grads = [ctx.grad(b.value) if b.grad else None for b in sent]
        later = sorted({t for b in sent for t in b.targets})
        comment = (
            f"send {', '.join(v.name for v in handed)} to stage "
            f"{', '.join(map(str, later))}; resumed with the gradients sent back"
        )
    for value, grad in zip(handed, grads):
        if grad is not None:
            owned[id(value)] = True
    return Step("exchange", [Yield(tuple(grads), tuple(ctx.var(v) for v in handed))], comment)
