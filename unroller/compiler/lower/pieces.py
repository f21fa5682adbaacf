"""Segments run in pieces of the batch (``--segment-pieces``, ``--segment-piece-size``):
their forward, and their recompute and backward, one piece at a time, so that the working
set is a piece's.

Each value the piece's steps read from outside is split into views along the batch
(``tensor_split(K)``: K pieces differing by at most one sample; or ``split(P)``: pieces of
P samples, the last one smaller), and the steps are renamed to the piece's variables. The
loop's header step (``zip`` of the pieces) and its last step are recorded in
``LoweringContext.piece_loops``, where rendering makes them a ``for`` loop and the memory
model walks the body at a piece's batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from unroller.compiler.dtypes import TORCH_DTYPE_NAMES
from unroller.compiler.graph import Node, Value
from unroller.compiler.ir import (
    AddTo,
    Assign,
    Attr,
    CallExpr,
    Const,
    Do,
    Global,
    RecordRaw,
    Statement,
    Step,
    TupleExpr,
    Var,
    called_name,
)
from unroller.compiler.outline import rename_vars
from unroller.compiler.precision import get as get_precision
from unroller.compiler.shapes import TensorType
from unroller.errors import ModelError

from .context import LoweringContext, PieceLoop
from .grads import backward_step
from .resolved import Segment, SegmentPlan
from .restore import restore_steps
from .segments import restore_input, segment_steps


def split_batch(value: Var, segment: Segment) -> CallExpr:
    """``value`` split along the batch as ``segment`` runs: ``value.split(P)`` for pieces of
    P samples, else ``value.tensor_split(K)`` for K pieces (views either way)."""
    if segment.piece_size:
        return CallExpr(Attr(value, "split"), (Const(segment.piece_size),))
    return CallExpr(Attr(value, "tensor_split"), (Const(segment.pieces),))


def pieced_steps(
    ctx: LoweringContext, plan: SegmentPlan, reader: Node, owned: dict[int, bool]
) -> list[Step]:
    """The segment's recompute and backward in pieces of the batch.

    Its inputs kept compressed are restored a piece at a time, at the top of the loop, from
    the piece's rows of their packed form (every compressor packs each sample on its own):
    the whole restored input never exists. The parameter
    gradients accumulate into ``.grad`` piece after piece (summed in another order than
    one whole-batch kernel: equal to rounding, not bit for bit); each input's gradient is
    copied into its slice of one whole-batch tensor, added to what the input had from
    elsewhere when it had some. ``owned``: as ``grads.backward_step`` keeps it."""
    segment = plan.segment
    outside = _outside_values(segment)
    steps: list[Step] = []
    before = {id(v): owned.pop(id(v)) for v in outside if id(v) in owned}
    body = restore_piece_inputs(ctx, plan, reader)
    restored = [name for step in body for name, kind in step.events() if kind == "w"]
    body += segment_steps(ctx, plan, reader, restore_inputs=False)
    for node in plan.backward:
        body += restore_steps(ctx, node)
        body.append(backward_step(ctx, node, owned, pieces=True))
    for stashed, form in plan.whole_batch:  # restored in the loop only, a piece at a time
        ctx.restored.pop((stashed.key, form), None)
    graded = [v for v in outside if id(v) in owned]
    free = _free_reads(body)
    mapping = piece_names(ctx, segment, free, graded, restored)
    for step in body:  # in place: the memory model knows the steps by identity
        step.statements = rename_vars(step, mapping).statements
    anchor = Var(next(n for n in free if ctx.key_of[n][0] == "grad"))
    full: dict[str, Var] = {}
    for value in graded:
        if id(value) in before:  # the input has a gradient from elsewhere: add to it
            full[value.name] = ctx.name("partial", value.name, segment.name, "pieces")
        else:
            full[value.name] = ctx.grad(value)
    reused = reusable_output_grads(ctx, segment, graded, before, free, owned)
    if graded:
        steps.append(whole_batch_grads(ctx, graded, full, reused, anchor))
    steps += _backward_loop(ctx, segment, body, free, graded, mapping, full)
    for value in graded:
        if id(value) in before:
            add = AddTo(ctx.grad(value), full[value.name], in_place=before[id(value)])
            steps.append(
                Step("backward", [add], comment=f"grad {value.name}: add {segment.name}'s")
            )
        owned[id(value)] = True
    for key, flag in before.items():
        owned.setdefault(key, flag)
    return steps


def _backward_loop(
    ctx: LoweringContext,
    segment: Segment,
    body: list[Step],
    free: list[str],
    graded: list[Value],
    mapping: dict[str, str],
    full: dict[str, Var],
) -> list[Step]:
    """The loop of a pieced backward: its header (the pieces of what the body reads from
    outside, and each input gradient's slice), the body, and the copy of the piece's
    input gradients into their slices."""
    slots = {v.name: ctx.name("slot", *ctx.key_of[ctx.grad(v).name]) for v in graded}
    targets = tuple(Var(mapping[n]) for n in free) + tuple(slots[v.name] for v in graded)
    splits = [Var(n) for n in free] + [full[v.name] for v in graded]
    split = tuple(
        split_packed(t, segment) if ctx.key_of[t.name][0] == "packed" else split_batch(t, segment)
        for t in splits
    )
    header = Step(
        "backward",
        [Assign(targets, CallExpr(Global("zip"), split))],
        comment=(
            f"[pieces] {segment.call.text}: its recompute and backward in "
            f"{segment.pieces_text()}"
        ),
    )
    steps = [header, *body]
    if graded:
        copies: list[Statement] = [
            Do(CallExpr(Attr(slots[v.name], "copy_"), (Var(mapping[ctx.grad(v).name]),)))
            for v in graded
        ]
        steps.append(Step("backward", copies, comment="the piece's input gradients"))
    ctx.piece_loops.append(PieceLoop(header, steps[-1], segment))
    return steps


def split_packed(packed: Var, segment: Segment) -> CallExpr:
    """A compressed tensor's packed form split along the batch as ``segment`` runs
    (``K.packed_split``: the same rows per piece as ``split_batch`` gives a tensor)."""
    how = ("size", segment.piece_size) if segment.piece_size else ("pieces", segment.pieces)
    return CallExpr(Global("K.packed_split"), (packed,), ((how[0], Const(how[1])),))


def restore_piece_inputs(ctx: LoweringContext, plan: SegmentPlan, reader: Node) -> list[Step]:
    """Steps restoring, for one piece, the segment's inputs that are kept compressed and
    read by its recompute or its backward (the first steps of the loop's body; the loop
    renames the packed form and the restored tensor to the piece's)."""
    steps: list[Step] = []
    for stashed, form in plan.whole_batch:
        step = restore_input(ctx, stashed, form, reader, plan.segment)
        step.section, step.calls = "backward", ()
        step.comment = (
            f"restore {stashed.key}: {form.label()} (input of {plan.segment.name}, this piece)"
        )
        steps.append(step)
        ctx.restored[(stashed.key, form)] = ctx.raw_var(stashed.key)
    return steps


def piece_names(
    ctx: LoweringContext,
    segment: Segment,
    free: list[str],
    graded: list[Value],
    restored: Sequence[str] = (),
) -> dict[str, str]:
    """Whole-batch variable -> the name of its piece, for the values a pieced segment
    reads from outside (each must have the batch dim first; a packed form has its samples
    as rows), the gradients of its inputs and the inputs it restores itself."""
    mapping: dict[str, str] = {}
    for name in [*restored, *(n for n in free if ctx.key_of[n][0] == "packed")]:
        mapping[name] = ctx.name("piece", *ctx.key_of[name]).name
    for name in free:
        if name in mapping:
            continue
        found = key_type(ctx, name)
        if found is None or not found.shape or found.shape[0] != "N":
            raise ModelError(
                f"segment {segment.name} cannot run in pieces: it reads {name}, which has "
                "no batch dimension first"
            )
        mapping[name] = ctx.name("piece", *ctx.key_of[name]).name
    for value in graded:
        grad = ctx.grad(value).name
        mapping[grad] = ctx.name("piece", *ctx.key_of[grad]).name
    return mapping


def whole_batch_grads(
    ctx: LoweringContext,
    graded: list[Value],
    full: dict[str, Var],
    reused: dict[str, str],
    anchor: Var,
) -> Step:
    """The step allocating the whole-batch input gradients a pieced segment fills piece
    by piece: new tensors sized from ``anchor``'s batch, or an output gradient's memory
    when ``reusable_output_grads`` found one free."""
    size = CallExpr(Attr(anchor, "size"), (Const(0),))
    # a mixed precision's values differ in dtype: each gradient is its value's
    typed = get_precision(ctx.graph.precision).mixed
    allocations: list[Statement] = [
        Assign(
            (full[v.name],),
            (
                Var(reused[v.name])
                if v.name in reused
                else CallExpr(
                    Attr(anchor, "new_empty"),
                    (TupleExpr((size, *(Const(d) for d in v.type.shape[1:]))),),
                    (
                        (("dtype", Global(f"torch.{TORCH_DTYPE_NAMES[v.type.dtype]}")),)
                        if typed
                        else ()
                    ),
                )
            ),
        )
        for v in graded
    ]
    what = ", ".join(
        f"grad {v.name}"
        + (f" (in grad {ctx.key_of[reused[v.name]][1]}'s memory)" if v.name in reused else "")
        for v in graded
    )
    return Step("backward", allocations, comment=f"{what}: filled piece by piece")


def reusable_output_grads(
    ctx: LoweringContext,
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
        key = ctx.key_of.get(name, ())
        value = outputs.get(key[1]) if len(key) > 1 and key[0] == "grad" else None
        if value is not None and owned.get(id(value), False):
            candidates.append((name, value))
    found: dict[str, str] = {}
    for value in graded:
        if id(value) in before:
            continue
        for i, (name, out) in enumerate(candidates):
            if out.type.shape[1:] == value.type.shape[1:] and out.type.dtype == value.type.dtype:
                found[value.name] = name
                del candidates[i]
                break
    return found


def pieced_forward_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: the forward of each segment run in pieces, in pieces as well; whole where the
    forward keeps what some of its statements make (``segment_keep``): in pieces, those
    would be made whole-batch and raw before being kept."""
    for plan in ctx.plan.segments:
        if plan.segment.in_pieces and not plan.segment.kept:
            steps = pieced_forward(ctx, plan.segment, steps)
    return steps


def pieced_forward(ctx: LoweringContext, segment: Segment, steps: list[Step]) -> list[Step]:
    """The forward of a segment run in pieces: it keeps nothing for its own backward (its
    recompute makes that), so each piece of its inputs gives the piece of its outputs,
    copied into whole-batch tensors; what the forward keeps of those outputs for others
    (the next segment's input, compressed) is kept after the loop, from the whole tensors.
    Left whole (``steps`` as they are) when an output's dtype is not that of a batch
    tensor it reads (nothing to allocate it like)."""
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
    types = {name: key_type(ctx, name) for name in [*free, *outputs]}
    if any(t is None or not t.shape or t.shape[0] != "N" for t in types.values()):
        return steps
    anchors = {types[n].dtype: n for n in reversed(free)}
    if not outputs or any(types[n].dtype not in anchors for n in outputs):
        return steps
    mapping = {n: ctx.name("piece", *ctx.key_of[n]).name for n in [*free, *outputs]}
    for step in body:  # in place: the memory model knows the steps by identity
        step.statements = rename_vars(step, mapping).statements
    allocations: list[Statement] = []
    for name in outputs:
        anchor = Var(anchors[types[name].dtype])
        size = CallExpr(Attr(anchor, "size"), (Const(0),))
        shape = TupleExpr((size, *(Const(d) for d in types[name].shape[1:])))
        allocations.append(Assign((Var(name),), CallExpr(Attr(anchor, "new_empty"), (shape,))))
    slots = {n: ctx.name("slot", *ctx.key_of[n]) for n in outputs}
    targets = tuple(Var(mapping[n]) for n in free) + tuple(slots[n] for n in outputs)
    split = tuple(split_batch(Var(n), segment) for n in [*free, *outputs])
    header = Step(
        "forward",
        [Assign(targets, CallExpr(Global("zip"), split))],
        comment=f"[pieces] {segment.call.text}: its forward in {segment.pieces_text()}",
    )
    copies: list[Statement] = [
        Do(CallExpr(Attr(slots[n], "copy_"), (Var(mapping[n]),))) for n in outputs
    ]
    copy = Step("forward", copies, comment="the piece's outputs")
    ctx.piece_loops.append(PieceLoop(header, copy, segment))
    what = ", ".join(ctx.key_of[n][-1] for n in outputs)
    made = Step("forward", allocations, comment=f"{what}: filled piece by piece")
    for step in keeping:  # from the whole outputs, at the top level
        step.calls = ()
    start, end = run[0], run[-1] + 1
    return [*steps[:start], made, header, *body, copy, *keeping, *steps[end:]]


def key_type(ctx: LoweringContext, name: str) -> TensorType | None:
    """The tensor type of a variable, from its structured key (None: not a tensor of the
    graph, such as a packed form)."""
    key = ctx.key_of.get(name)
    if key is None:
        return None
    if key[0] in ("value", "grad", "recomputed", "partial", "restored"):
        value = key[1].split(":")[0]
        if key[0] == "restored" or ":" in key[1]:
            stashed = ctx.plan.stashed.get(key[1])
            return stashed.type if stashed is not None else None
        found = ctx.plan.producers.get(value, False)
        if found is None:
            return next(v for v in ctx.graph.inputs if v.name == value).type
        return found.output.type if found else None
    if key[0] == "extra":
        node = ctx.node_named[key[1]]
        return next(e.type for e in node.extras if e.name == key[2])
    return None


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
