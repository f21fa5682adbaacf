"""What follows the run of steps in which parameters' gradients became final: their
reduce-scatter to the ranks that own their shards (``--shard``, ``K.scatter_grads``) and
the optimizer step inside the backward (``--update-in-backward``, ``K.update_params``).

A run is one top-level statement, or a top-level block instance's steps (a block's
backward is one function call in the generated code, so nothing can go between its
statements), or a pieces loop. After the run, ``K.update_params(L, names)`` hands the
gradients that became final in it to the optimizer attached to the module
(``unroller.training.in_backward``), which updates those parameters and frees their
gradients: at most one run's gradients and the not-yet-final ones are alive at once,
never the whole network's. Without an optimizer attached the call does nothing.
"""

from __future__ import annotations

from unroller.compiler.ir import CallExpr, Do, Global, ModelName, Step, TupleExpr, Var

from .context import LoweringContext
from .finals import final_after, run_ends


def updates_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: ``steps`` with the reduce-scatters and the updates, when the step shards or
    updates in its backward."""
    if not (ctx.update_in_backward or ctx.shard):
        return steps
    final = final_after(ctx, steps)
    out: list[Step] = []
    ready: list[str] = []
    for i, (step, ends) in enumerate(zip(steps, run_ends(ctx, steps))):
        out.append(step)
        ready += final.get(i, [])
        if ready and ends:
            out.append(update_step(ready, ctx.shard, ctx.update_in_backward))
            ready = []
    return out


FINAL_CALLS = ("K.scatter_grads", "K.update_params")
"""The calls of the steps this pass adds (``shards`` places a release after them)."""


def update_step(keys: list[str], scatter: bool = False, update: bool = True) -> Step:
    names = TupleExpr(tuple(ModelName(k) for k in keys))
    calls = [name for name, wanted in zip(FINAL_CALLS, (scatter, update)) if wanted]
    what = " and ".join(
        {"K.scatter_grads": "reduce-scatter", "K.update_params": "update in the backward"}[c]
        for c in calls
    )
    return Step(
        "backward",
        [Do(CallExpr(Global(call), (Var("L"), names))) for call in calls],
        comment=f"{what}: {_shown(keys)}",
    )


def _shown(keys: list[str]) -> str:
    """The keys in a comment: one or two by name, more by the block they share
    (``layers.1.* (12 parameters)``)."""
    if len(keys) <= 2:
        return ", ".join(keys)
    common = []
    for parts in zip(*(k.split(".")[:-1] for k in keys)):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    where = ".".join(common) + ".*" if common else "the model"
    return f"{where} ({len(keys)} parameters)"
