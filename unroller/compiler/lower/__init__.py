"""Lowering: a graph and its stash plan -> step programs (lists of ``ir.Step``), pass by pass.

The stash plan is resolved per node first (``resolved.resolve``: what each node keeps, in
which form, where it is restored, whether it is remade), so no pass asks the stash module
anything. A program is then made by running passes in order over one step list, each
pass a module that reads on its own:

- ``forward``: every forward kernel call, what is kept for backward right after it; and
  ``predict()``'s forward with eval kernels;
- ``pieces``: a segment run in pieces of the batch, as loops (its forward here, its
  recompute and backward inside the backward pass);
- ``forward.hand_out_pass``: each prediction handed out after the forward made it
  (kept only when the step's caller asks, ``runtime.common.keep_predictions``);
- ``backward``: the seed, then every node's backward in reverse order, with restores
  (``restore``), gradient sums and parameter gradients (``grads``), and a recomputed
  segment's forward again where its backward begins (``segments``);
- ``reductions``: data-parallel gradient buckets, all-reduced as they become final;
- ``updates``: after the run in which gradients became final (``finals`` says where each
  becomes final), their reduce-scatter (``--shard``) and the optimizer step in the
  backward (``--update-in-backward``);
- ``shards``: each sharded block instance's parameters gathered before its forward and
  its backward, released after (``--shard``);
- ``stages``: one program per pipeline stage (``--pipeline``), from the same pieces;
- liveness last (``ir.release_dead``): each variable released right after its last use.

The pass interface::

    Pass = Callable[[LoweringContext, list[Step]], list[Step]]

A pass takes the steps so far and returns the steps after it (new ones appended, or the
list rewritten); it may update steps in place, but a step it keeps stays the same object,
since the memory model and the renderer know steps by identity (the observer's steps,
``LoweringContext.piece_loops``). Variables come from the context's namer
(``LoweringContext.name``), which hands out identifiers in the order they are asked for:
passes run in a fixed order, so the generated text does not change from run to run. A
later pass (precision casts, optimizer updates, shard gathers) is one more function of
this type in ``TRAINING_PASSES``' order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from unroller.compiler.graph import Graph, Value
from unroller.compiler.ir import Step, Var, release_dead
from unroller.compiler.pipeline import Boundary, Pipeline
from unroller.compiler.platforms import GPU, Platform
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.schemes import builtin
from unroller.compiler.stash import StashPlan, plan_stash

from .backward import backward_pass
from .context import LoweringContext, PieceLoop, StepObserver, base_name
from .forward import forward_pass, hand_out_pass, predict_keep, predict_pass
from .pieces import pieced_forward_pass
from .reductions import reductions_pass
from .resolved import ResolvedPlan, resolve
from .shards import shards_pass
from .stages import stage_program
from .updates import updates_pass

__all__ = [
    "Lowering",
    "LoweringContext",
    "Pass",
    "PieceLoop",
    "ResolvedPlan",
    "StepObserver",
    "TRAINING_PASSES",
    "PREDICT_PASSES",
    "base_name",
    "run_passes",
]

Pass = Callable[[LoweringContext, list[Step]], list[Step]]
"""One lowering pass: the steps so far -> the steps after it (see the module docstring)."""


def training_keep(ctx: LoweringContext) -> set[str]:
    """What the training step holds to its end: the loss it returns, and its own names."""
    return {ctx.var(ctx.graph.loss).name, "grads", "stash", "L", "scaler"}


def release_pass(ctx: LoweringContext, steps: list[Step]) -> list[Step]:
    """Pass: liveness of the training step. A forward step whose output a backward step
    reads keeps it alive: liveness sees that read, so nothing more to do for the stash."""
    release_dead(steps, keep=training_keep(ctx))
    return steps


TRAINING_PASSES: tuple[Pass, ...] = (
    forward_pass,
    pieced_forward_pass,
    hand_out_pass,
    backward_pass,
    reductions_pass,
    updates_pass,
    shards_pass,
    release_pass,
)
"""The training step's passes, in order."""

PREDICT_PASSES: tuple[Pass, ...] = (predict_pass,)
"""``predict()``'s passes (its liveness included)."""


def run_passes(ctx: LoweringContext, passes: Sequence[Pass]) -> list[Step]:
    """The program the passes make, from no steps."""
    steps: list[Step] = []
    for lower in passes:
        steps = lower(ctx, steps)
    return steps


class Lowering:
    """The step programs of one graph for one platform and pipeline: the training step,
    ``predict()`` and, with ``--pipeline``, each stage's program.

    ``plan``: the stash plan (default: nothing compressed); ``observer``: told of each
    step made for a node (``StepObserver``)."""

    def __init__(
        self,
        graph: Graph,
        plan: StashPlan | None = None,
        platform: Platform | str = GPU,
        pipeline: Pipeline | None = None,
        data_parallel: bool = False,
        bucket_bytes: int | None = None,
        observer: StepObserver | None = None,
        update_in_backward: bool = False,
        shard: bool = False,
    ):
        target = get_platform(platform) if isinstance(platform, str) else platform
        plan = plan if plan is not None else plan_stash(graph, builtin("nocompress"))
        self.context = LoweringContext(
            graph,
            resolve(graph, plan, target),
            target,
            pipeline,
            data_parallel,
            bucket_bytes,
            observer,
            update_in_backward,
            shard,
        )

    @property
    def graph(self) -> Graph:
        return self.context.graph

    @property
    def plan(self) -> ResolvedPlan:
        return self.context.plan

    @property
    def key_of(self) -> dict[str, tuple[str, ...]]:
        """Each variable's structured key (``base_name`` says which kinds there are)."""
        return self.context.key_of

    @property
    def piece_loops(self) -> list[PieceLoop]:
        return self.context.piece_loops

    def var(self, value: Value) -> Var:
        return self.context.var(value)

    def raw_var(self, key: str) -> Var:
        """The variable of a saved tensor (stash key) as the forward made it."""
        return self.context.raw_var(key)

    def training_steps(self) -> list[Step]:
        return run_passes(self.context, TRAINING_PASSES)

    def predict_steps(self) -> list[Step]:
        return run_passes(self.context, PREDICT_PASSES)

    def stage_program(self, stage: int, crossing: list[Boundary]) -> list[Step]:
        return stage_program(self.context, stage, crossing)

    def training_keep(self) -> set[str]:
        return training_keep(self.context)

    def predict_keep(self) -> set[str]:
        return predict_keep(self.context)
