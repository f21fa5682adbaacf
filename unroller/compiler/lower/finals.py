"""Where each parameter's gradient becomes final in a step program: after the last step
that adds into its ``.grad``.

Data parallel's buckets and the optimizer step in the backward both act on a gradient as
soon as nothing more will be added to it. A step adds to ``.grad`` through a
``K.accumulate``/``K.accumulate_fresh`` statement, or through a backward kernel called
with ``accumulate=True`` (a segment run in pieces adds its parameter gradients inside the
kernel). A tied parameter (``tied_weight=``) is one tensor under two keys: its gradient is
final after the last step adding to either, and it is named by the key it is tied to. A
step inside a pieces loop runs once per piece: what it finishes is final only after the
loop's last step.

What acts on final gradients goes where a run of steps ends (``run_ends``): a top-level
statement, a top-level block instance (one function call in the generated code, so
nothing can go between its statements), a pieces loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from unroller.compiler.ir import ACCUMULATORS, Assign, CallExpr, Const, Do, Layer, Step, called_name

from .context import LoweringContext, PieceLoop


def final_after(ctx: LoweringContext, steps: list[Step]) -> dict[int, list[str]]:
    """Step index -> the parameter keys whose gradient is final after that step, each key
    once (a tied parameter by the key it is tied to), in the order they became final."""
    canonical = _canonical_keys(ctx)
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for statement in step.statements:
            for key in _accumulated(ctx, statement):
                last[canonical.get(key, key)] = i
    loop_last = _loop_last(ctx, steps)
    found: dict[int, list[str]] = {}
    for key, i in last.items():
        found.setdefault(loop_last.get(i, i), []).append(key)
    return found


def _canonical_keys(ctx: LoweringContext) -> dict[str, str]:
    """Each parameter key -> the key of the tensor it is (its tie's, else itself)."""
    return {p.key: node.ties.get(p.name, p.key) for node in ctx.graph.nodes for p in node.params}


def _accumulated(ctx: LoweringContext, statement) -> list[str]:
    """The parameter keys whose ``.grad`` ``statement`` adds to."""
    value = getattr(statement, "value", None)
    if not isinstance(value, CallExpr):
        return []
    if isinstance(statement, Do) and called_name(value) in ACCUMULATORS:
        owner = value.args[0]
        prefix = f"{owner.path}." if isinstance(owner, Layer) and owner.path else ""
        return [prefix + attr for attr, _ in value.kwargs]
    accumulate = dict(value.kwargs).get("accumulate")
    if isinstance(statement, Assign) and isinstance(accumulate, Const) and accumulate.value:
        layers = [a.path for a in value.args if isinstance(a, Layer)]
        return [
            p.key
            for path in layers
            if path in ctx.node_named
            for p in ctx.node_named[path].params
            if p.present and p.trainable
        ]
    return []


def loop_spans(ctx: LoweringContext, steps: list[Step]) -> Iterator[tuple[int, int, PieceLoop]]:
    """Each pieces loop in ``steps``: the index of its header, of its last step, and it."""
    at = {id(step): i for i, step in enumerate(steps)}
    for loop in ctx.piece_loops:
        if id(loop.header) in at and id(loop.last) in at:
            yield at[id(loop.header)], at[id(loop.last)], loop


def _loop_last(ctx: LoweringContext, steps: list[Step]) -> dict[int, int]:
    """Index of each step inside a pieces loop -> the index of the loop's last step."""
    return {k: end for start, end, _ in loop_spans(ctx, steps) for k in range(start, end + 1)}


def run_ends(ctx: LoweringContext, steps: list[Step]) -> list[bool]:
    """Per step: does a run end after it (the last step; not inside a pieces loop; a
    top-level statement, or the next step in another top-level block instance)?"""
    inside = {k for start, end, _ in loop_spans(ctx, steps) for k in range(start, end)}
    ends = []
    for i, step in enumerate(steps):
        following = steps[i + 1] if i + 1 < len(steps) else None
        ends.append(
            following is None
            or i not in inside
            and (not step.calls or following.calls[:1] != step.calls[:1])
        )
    return ends
