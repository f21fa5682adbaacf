"""Data parallel (``--data-parallel``): gradient buckets all-reduced while the rest of the
backward computes, as DistributedDataParallel does.

Buckets hold the parameters in the order their gradients become final, closed at the
first run boundary (a top-level block instance, or one top-level statement) once they
reach ``bucket_bytes`` (25 MiB by default); ``K.reduce_bucket`` follows the run in which a
bucket's last gradient became final, and ``K.reduce_wait`` ends the step.
"""

from __future__ import annotations

from unroller.compiler.ir import (
    CallExpr,
    Const,
    Do,
    Global,
    ModelName,
    Step,
    TupleExpr,
    Var,
)

from .context import LoweringContext
from .finals import final_after, run_ends


def reductions_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: ``steps`` with the bucket reductions, when the step is data parallel."""
    if not ctx.data_parallel:
        return steps
    final_at = final_after(ctx, steps)
    nbytes = {p.key: p.nbytes() for n in ctx.graph.nodes for p in n.params if p.present}
    out: list[Step] = []
    bucket: list[str] = []
    size = 0
    buckets = 0
    for i, (step, ends) in enumerate(zip(steps, run_ends(ctx, steps))):
        out.append(step)
        for key in final_at.get(i, []):
            bucket.append(key)
            size += nbytes.get(key, 0)
        last = i + 1 == len(steps)
        if bucket and ends and (size >= ctx.bucket_bytes or last):
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


def reduce_step(index: int, keys: list[str], size: int) -> Step:
    names = tuple(ModelName(k) for k in keys)
    return Step(
        "backward",
        [Do(CallExpr(Global("K.reduce_bucket"), (Var("L"), Const(index), TupleExpr(names))))],
        comment=f"all-reduce bucket {index}: {len(keys)} gradients, {size / 2**20:.2f} MiB",
    )
