"""The backward pass: the seed gradient of the loss, then every node's backward step in
reverse order, each preceded by the restores and remakes of what it reads.

A recomputed segment's backward begins with its recompute (``segments``); one run in
pieces of the batch runs its recompute and backward together, piece by piece
(``pieces``). Both are laid out here, where the segment's backward begins, because the
restores they share with the nodes after them are made once per program.
"""

from __future__ import annotations

from unroller.compiler.ir import Step

from .context import LoweringContext
from .grads import backward_step, seed_step
from .pieces import pieced_steps
from .restore import restore_steps
from .segments import segment_steps


def backward_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: ``steps`` (the forward) followed by the seed and the backward."""
    graph = ctx.graph
    steps = [*steps, seed_step(ctx)]
    owned: dict[int, bool] = {id(graph.loss): True}
    begun: set[str] = set()  # recomputed segments whose backward has begun
    for node in reversed(graph.nodes):
        if not node.needs_backward:
            continue
        segment = ctx.plan.segment_of(node)
        if segment is not None and segment.segment.in_pieces:
            if segment.segment.name not in begun:  # the whole segment's backward, in pieces
                begun.add(segment.segment.name)
                steps += pieced_steps(ctx, segment, node, owned)
            continue
        if segment is not None and segment.segment.name not in begun:
            begun.add(segment.segment.name)
            steps += segment_steps(ctx, segment, node)
        steps += restore_steps(ctx, node)
        steps.append(backward_step(ctx, node, owned))
    return steps
