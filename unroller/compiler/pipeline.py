"""Splitting a model into pipeline stages, one per IPU.

Stages are contiguous runs of nodes in topological order. By default the split
balances each stage's cost: the bytes of its parameters plus the bytes of the tensors
it keeps for backward (after compression: a stashed tensor lives on the IPU of the node
that made it, since it is compressed there). The balance is exact for contiguous
splits (binary search on the largest stage cost). A user may instead name the first
node of each stage after the first. The backward step of a node runs on the IPU that
holds its forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unroller.compiler import safe
from unroller.compiler.dtypes import DTYPE_BYTES
from unroller.compiler.graph import Graph, Value
from unroller.compiler.stash import StashPlan
from unroller.errors import ModelError, did_you_mean

VALID_NUM_IPUS = (1, 2, 4, 8, 16)
PLANNING_BATCH = 32  # the batch the byte costs are weighed at (activations scale with it)


@dataclass
class Pipeline:
    num_ipus: int
    stage_of: dict[str, int]  # node name -> stage (= IPU id)
    starts: list[str] = field(default_factory=list)  # first node of stages 1..K-1

    def stage(self, node_name: str) -> int:
        return self.stage_of.get(node_name, 0)


def node_costs(graph: Graph, plan: StashPlan, batch: int = PLANNING_BATCH) -> list[int]:
    costs = [  # a shared layer's tensors counted once, where it is made
        0 if n.shares else sum(p.nbytes() for p in n.params + n.buffers if p.present)
        for n in graph.nodes
    ]
    for stashed in plan.entries:
        costs[max(stashed.producer, 0)] += stashed.stored_bytes(batch)
    return costs


def balanced_starts(costs: list[int], parts: int) -> list[int]:
    """Indices where stages 1..parts-1 begin, minimising the largest stage cost."""
    n = len(costs)
    if parts > n:
        raise ValueError(f"cannot split {n} nodes into {parts} stages")

    def cuts_for(limit: int) -> list[int] | None:
        cuts, total = [], 0
        for i, c in enumerate(costs):
            if c > limit:
                return None
            if total + c > limit:
                cuts.append(i)
                total = 0
            total += c
        return cuts if len(cuts) <= parts - 1 else None

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if cuts_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    cuts = cuts_for(lo) or []
    # use every IPU: split the largest remaining stages further where cuts are missing
    taken = set(cuts)
    i = n - 1
    while len(cuts) < parts - 1:
        if i not in taken and i > 0:
            cuts.append(i)
            taken.add(i)
        i -= 1
    return sorted(cuts)


def split(
    graph: Graph,
    plan: StashPlan,
    num_ipus: int,
    starts: list[str] | None = None,
    counts: tuple[int, ...] = VALID_NUM_IPUS,
    option: str = "--num-ipus",
    loss_last: bool = False,
) -> Pipeline:
    """Stages of ``num_ipus`` devices (IPUs, or processes for ``--pipeline``; ``counts``
    and ``option``: what the caller accepts and the option to name in errors).
    ``loss_last``: the balanced split keeps the loss on the last stage (statements after
    it, predictions, go with it)."""
    if num_ipus not in counts:
        raise ModelError(f"{option} must be one of {', '.join(map(str, counts))}")
    names = [n.name for n in graph.nodes]
    if num_ipus == 1:
        return Pipeline(1, {name: 0 for name in names})
    if num_ipus > len(names):
        raise ModelError(
            f"model '{graph.name}' has {len(names)} nodes: too few for {num_ipus} stages"
        )
    if starts:
        if len(starts) != num_ipus - 1:
            raise ModelError(
                f"--stage-starts names {len(starts)} stage starts; {num_ipus} stages "
                f"({option} {num_ipus}) need {num_ipus - 1} (the first node of each stage "
                "after the first)"
            )
        missing = [s for s in starts if s not in names]
        if missing:
            raise ModelError(
                f"--stage-starts names unknown node '{safe.comment_text(missing[0][:200])}'"
                f"{did_you_mean(missing[0], names)}"
            )
        cut_indices = [names.index(s) for s in starts]
        if cut_indices != sorted(set(cut_indices)) or cut_indices[0] == 0:
            raise ModelError(
                "--stage-starts must name distinct nodes in model order, after the first node"
            )
    else:
        costs = node_costs(graph, plan)
        loss = graph.loss.producer
        if loss_last and loss is not None:
            end = names.index(loss.name) + 1
            costs = costs[: end - 1] + [sum(costs[end - 1 :])]
            if num_ipus > end:
                raise ModelError(f"the loss is statement {end}: too few for {num_ipus} stages")
        cut_indices = balanced_starts(costs, num_ipus)
    stage_of, stage = {}, 0
    for i, name in enumerate(names):
        if stage < len(cut_indices) and i == cut_indices[stage]:
            stage += 1
        stage_of[name] = stage
    for node in graph.nodes:
        if node.shares and stage_of[node.name] != stage_of[node.shares]:
            raise ModelError(
                f"{node.name} calls the layer of {node.shares} (shares=) on stage "
                f"{stage_of[node.name]}, but that layer is on stage {stage_of[node.shares]}: "
                f"a shared layer's calls go on one stage ({option}; choose --stage-starts)"
            )
    return Pipeline(num_ipus, stage_of, [names[i] for i in cut_indices])


def ipu_report(graph: Graph, plan: StashPlan, pipeline: Pipeline, batch: int) -> dict:
    """Per IPU: parameter bytes, stashed bytes raw and stored; bytes crossing each boundary."""
    k = pipeline.num_ipus
    rows = [
        {
            "ipu": i,
            "nodes": 0,
            "first": None,
            "param_bytes": 0,
            "stash_raw_bytes": 0,
            "stash_stored_bytes": 0,
        }
        for i in range(k)
    ]
    for node in graph.nodes:
        row = rows[pipeline.stage(node.name)]
        row["nodes"] += 1
        row["first"] = row["first"] or node.name
        if not node.shares:  # a shared layer's tensors are its owner's
            row["param_bytes"] += sum(p.nbytes() for p in node.params + node.buffers if p.present)
    for stashed in plan.entries:
        producer = graph.nodes[stashed.producer].name if stashed.producer >= 0 else None
        row = rows[pipeline.stage(producer) if producer else 0]
        row["stash_raw_bytes"] += stashed.raw_bytes(batch)
        row["stash_stored_bytes"] += stashed.stored_bytes(batch)
    boundaries = []
    for b in range(k - 1):
        forward = 0
        for value in [*graph.inputs, *(n.output for n in graph.nodes)]:
            made = pipeline.stage(value.producer.name) if value.producer else 0
            used = [pipeline.stage(n.name) for n, _ in value.consumers]
            if made <= b < max(used, default=-1):
                forward += value.type.numel(batch) * DTYPE_BYTES[value.type.dtype]
        backward = 0  # gradients of the values that cross, where they need one
        for value in (n.output for n in graph.nodes):
            made = pipeline.stage(value.producer.name)
            used = [pipeline.stage(n.name) for n, _ in value.consumers]
            if value.requires_grad and made <= b < max(used, default=-1):
                backward += value.type.numel(batch) * DTYPE_BYTES[value.type.dtype]
        boundaries.append(
            {"between": [b, b + 1], "forward_bytes": forward, "gradient_bytes": backward}
        )
    return {"num_ipus": k, "batch_size": batch, "ipus": rows, "boundaries": boundaries}


@dataclass
class Boundary:
    """A value that crosses from the stage that makes it to later stages that read it: one
    process per stage sends it forward and its gradient back (``unroller.parallel.pipeline``)."""

    value: Value
    source: int  # the stage whose node makes it
    targets: list[int]  # the later stages whose nodes read it, ascending
    grad: bool = False  # a gradient comes back: a reader there has a backward step


def boundaries(graph: Graph, pipeline: Pipeline) -> list[Boundary]:
    """Every value read by a later stage than its producer's, in the order they are made."""
    found = []
    for node in graph.nodes:
        source = pipeline.stage(node.name)
        later = sorted({pipeline.stage(n.name) for n, _ in node.output.consumers} - {source})
        if later and later[0] < source:
            raise ModelError(f"'{node.output.name}' is read before the stage that makes it")
        if later:
            readers = [n for n, _ in node.output.consumers if pipeline.stage(n.name) != source]
            grad = node.output.requires_grad and any(n.needs_backward for n in readers)
            found.append(Boundary(node.output, source, later, grad))
    return found


def stage_inputs(graph: Graph, pipeline: Pipeline, stage: int) -> list[Value]:
    """The model inputs the nodes of one stage read (each process is handed its own)."""
    return [v for v in graph.inputs if any(pipeline.stage(n.name) == stage for n, _ in v.consumers)]


def split_instances(graph: Graph, pipeline: Pipeline) -> set[str]:
    """Top-level block instances whose statements fall on more than one stage."""
    stages: dict[str, set[int]] = {}
    for node in graph.nodes:
        if node.blocks:
            stages.setdefault(node.blocks[0].name, set()).add(pipeline.stage(node.name))
    return {name for name, found in stages.items() if len(found) > 1}
