"""Data parallel (``--data-parallel``): gradient buckets all-reduced while the rest of the
backward computes, as DistributedDataParallel does.

Buckets hold the parameters in the order their gradients become final, closed at the
first run boundary (a top-level block instance, or one top-level statement) once they
reach ``bucket_bytes`` (25 MiB by default); ``K.reduce_bucket`` follows the run in which a
bucket's last gradient became final, and ``K.reduce_wait`` ends the step.
"""

from __future__ import annotations

from unroller.compiler.ir import (
    ACCUMULATORS,
    CallExpr,
    Const,
    Do,
    Global,
    Layer,
    ModelName,
    Step,
    TupleExpr,
    Var,
    called_name,
)

from .context import LoweringContext


def reductions_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: ``steps`` with the bucket reductions, when the step is data parallel."""
    if not ctx.data_parallel:
        return steps
    final_at = _final_at(steps)
    nbytes = {p.key: p.nbytes() for n in ctx.graph.nodes for p in n.params if p.present}
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
        if bucket and boundary and (size >= ctx.bucket_bytes or following is None):
            out.append(reduce_step(buckets, bucket, size))
            buckets += 1
            bucket, size = [], 0
    if bucket:
        out.append(reduce_step(buckets, bucket, size))
    out.append(
        Step(
            "backward",
            [Do(CallExpr(Global("K.reduce_wait"), (Var("L"),)))],
            comment="wait for the all-reduces: every gradient is the average over processes",
        )
    )
    return out


def _final_at(steps: list[Step]) -> dict[int, list[str]]:
    """Step index -> the parameter keys whose gradient is final after it (its last
    accumulation)."""
    last: dict[str, int] = {}  # parameter key -> the last step that accumulates it
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
    return final_at


def reduce_step(index: int, keys: list[str], size: int) -> Step:
    names = tuple(ModelName(k) for k in keys)
    return Step(
        "backward",
        [Do(CallExpr(Global("K.reduce_bucket"), (Var("L"), Const(index), TupleExpr(names))))],
        comment=f"all-reduce bucket {index}: {len(keys)} gradients, {size / 2**20:.2f} MiB",
    )
