"""Sharded parameters (``--shard``): each shard unit's parameters gathered before the steps
that read them and released after, once in the forward and once in the backward (its
recompute, pieces loop and backward together). The units (``shard_units``) are the
top-level block instances and the top-level statements holding parameters of their own
(an LM's embedding and head, its final norm): each is gathered where it is used, so the
largest tensors of a language model are not held through the whole step.

Under FSDP2 (``unroller.parallel.shard``) a unit is one ``fully_shard`` unit:
each rank holds a shard of its parameters, ``K.gather(L, "layers.0")`` all-gathers them
into the full tensors its statements read (``unshard``), ``K.release`` frees those again
(``reshard``). In the backward the release comes right after the unit's last statement,
before the reduce-scatter of the gradients that became final in its run (``updates``):
the full gradients outlive the full parameters (they hang on the unsharded parameter
objects), so the parameters are freed before the reduce-scatter's buffer is made, as
FSDP2 orders its own post-backward. Without a mesh attached both calls do nothing.
"""

from __future__ import annotations

from unroller.compiler.graph import Graph
from unroller.compiler.ir import CallExpr, Const, Do, Global, Layer, Step, Var, called_name, walk
from unroller.compiler.stash import block_instances

from .context import LoweringContext
from .finals import loop_spans


def shards_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: ``steps`` with the gathers and releases, when the step is sharded."""
    if not ctx.shard:
        return steps
    inserts: list[tuple[int, Step]] = []  # (index to insert before, step)
    blocks = {call.name for call, _ in block_instances(ctx.graph)}
    for name in shard_units(ctx.graph):
        for phase in ("forward", "backward"):
            span = (_span if name in blocks else _node_span)(ctx, steps, name, phase)
            if span is None:
                continue
            first, last = span
            inserts.append((first, _call_step("K.gather", name, phase)))
            inserts.append((last + 1, _call_step("K.release", name, phase)))
    out = list(steps)
    # from the end; where a release and a gather meet, the release first (inserted last)
    for index, step in sorted(inserts, key=lambda x: (x[0], _is_gather(x[1])), reverse=True):
        out.insert(index, step)
    return out


def shard_units(graph: Graph) -> tuple[str, ...]:
    """The modules sharded one by one, in graph order: each top-level block instance, and
    each top-level statement whose layer holds parameters of its own (not a free
    parameter, which the model holds; not a shared or tied one, one tensor in two units:
    neither the statement that ties another's tensor nor the one whose tensor is tied, nor
    a block instance holding such a tensor; those the model holds, gathered for the step)."""
    tied = {key for node in graph.nodes for key in node.ties.values()}
    found: list[str] = []
    refused: set[str] = set()
    for node in graph.nodes:
        held = {p.key for p in node.params if p.present}
        if node.blocks:
            name = node.blocks[0].name
            if held & tied:
                refused.add(name)
            elif name not in found:
                found.append(name)
            continue
        own = [p for p in node.params if p.present and p.key.startswith(node.name + ".")]
        if (
            own
            and not node.shares
            and not node.ties
            and not held & tied
            and len(own) == sum(p.present for p in node.params)
        ):
            found.append(node.name)
    return tuple(name for name in found if name not in refused)


#: rows per column from which an embedding or linear unit is computed where its rows live
#: (``unroller.parallel.rows``): more than an MLP's 4x expansion, a vocabulary's shape
ROWS_PER_COLUMN = 5
#: the ops whose kernels compute a row-sharded weight in place
ROW_OPS = ("embedding", "linear")


def row_units(graph: Graph) -> tuple[str, ...]:
    """The shard units never gathered: each a top-level embedding or linear statement whose
    weight has at least ``ROWS_PER_COLUMN`` rows per column (an LM's table and head); under
    FSDP2 their kernels compute where each rank's rows live."""
    units = set(shard_units(graph))
    found = []
    for node in graph.nodes:
        if node.name not in units or node.blocks or node.op.name not in ROW_OPS:
            continue
        weight = next((p for p in node.params if p.name == "weight" and p.present), None)
        if weight is not None and len(weight.shape) == 2:
            rows, cols = weight.shape
            if rows >= ROWS_PER_COLUMN * cols:
                found.append(node.name)
    return tuple(found)


def _node_span(
    ctx: LoweringContext, steps: list[Step], name: str, phase: str
) -> tuple[int, int] | None:
    """The first and last index of the steps in ``phase`` that read top-level statement
    ``name``'s layer (its forward; its backward, gradients and any remake of it)."""
    sections = ("forward",) if phase == "forward" else ("backward", "recompute")
    found = [
        i
        for i, step in enumerate(steps)
        if step.section in sections and not step.calls and _reads_layer(step, name)
    ]
    return (min(found), max(found)) if found else None


def _reads_layer(step: Step, name: str) -> bool:
    for statement in step.statements:
        value = getattr(statement, "value", None)
        if value is not None and any(isinstance(e, Layer) and e.path == name for e in walk(value)):
            return True
    return False


def _is_gather(step: Step) -> bool:
    return called_name(step.statements[0].value) == "K.gather"


def _span(ctx: LoweringContext, steps: list[Step], name: str, phase: str) -> tuple[int, int] | None:
    """The first and last index of the steps of block instance ``name`` in ``phase``
    ("forward"; "backward": its recompute too), a pieces loop of it included whole."""
    sections = ("forward",) if phase == "forward" else ("backward", "recompute")
    found = [
        i
        for i, step in enumerate(steps)
        if step.section in sections and step.calls and step.calls[0].name == name
    ]
    for start, end, loop in loop_spans(ctx, steps):
        if loop.segment.name == name and loop.header.section in sections:
            found += [start, end]
    return (min(found), max(found)) if found else None


def _call_step(func: str, name: str, phase: str) -> Step:
    what = "gather" if func == "K.gather" else "release"
    return Step(
        phase,
        [Do(CallExpr(Global(func), (Var("L"), Const(name))))],
        comment=f"{what} {name}'s parameters ({phase})",
    )
