"""The time model of one generated training step: what each move of the planner costs.

``auto`` weighs bytes per sample against time (``--max-time-ratio``), so it needs the time
of a step under a config relative to the uncompressed step, before any code runs and the
same on every machine (a model text gives the same file everywhere). The model counts,
from the graph's shapes and the resolved stash plan (``plan_stash``):

- every op: its forward, ``flops / F + bytes / B + o`` (FLOPs from ``flops.forward_flops``,
  at ``F`` the dense rate, or the thin rate for a weighted op with few multiply-adds per
  output element, a depthwise convolution's, ``flops.is_thin``; bytes: its inputs and
  output; ``o``: the cost of one generated statement, the Python call and the kernel's
  dispatch), and its backward, ``BACKWARD`` times that;
- a recomputed segment: the forward of the ops its recompute runs again (``rerun_nodes``:
  what its own stash depends on, less the statements ``segment_keep`` keeps); in pieces, each piece after the first
  adds ``p`` per op of the segment (its forward, recompute and backward statements run once
  more, on a smaller piece), the cost that makes pieces of one sample slow on small models;
  ``p`` is measured per piece size (pieces of one sample also run their kernels on the
  least work per call);
- ``--recompute``: the forward of each op whose output is remade;
- a compressed tensor: its compress and decompress, per element and per call by codec,
  and the two statements that call them.

The constants (``StepCosts``) are data, ``step_costs.toml`` beside this module, written by
``python -m benchmarks.step_costs --write`` from micro-benchmarks and whole steps on the
machine it runs on (the file names the machine and the date): the two FLOP rates and the
statement cost are fitted to the uncompressed steps of the benchmark models, so the base a
move's cost is set against is the step's as measured, not a matrix product's. A prediction is checked
against a measured step where it decides something: ``unroll plan --measure`` times the
chosen plan against the uncompressed step, and the benchmark reports predicted beside
measured ratios.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

from unroller.analysis.flops import forward_flops, is_thin
from unroller.compiler.dtypes import DTYPE_BYTES
from unroller.compiler.graph import Graph, Node
from unroller.compiler.schemes import CompressionConfig
from unroller.compiler.stash import StashPlan, plan_stash, rerun_nodes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["StepCosts", "StepTime", "costs", "predict_time"]

COSTS_FILE = Path(__file__).with_name("step_costs.toml")
BACKWARD = 2.5  # an op's backward against its forward (two products per weighted layer, and more memory traffic)


@dataclass(frozen=True)
class StepCosts:
    """Seconds per FLOP, per byte moved, per statement and per op and extra piece; per
    codec, seconds per element and per call of a compress and a decompress together."""

    flop_s: float
    byte_s: float
    statement_s: float
    piece_op_s: float
    codec_element_s: dict[str, float] = field(default_factory=dict)
    codec_call_s: dict[str, float] = field(default_factory=dict)
    thin_flop_s: float | None = None  # a thin op's FLOP (``flops.is_thin``); None: flop_s
    #: per piece size measured, the seconds per op and extra piece (``piece_op_s`` where
    #: none): small pieces run their kernels less efficiently as well as more often
    piece_op_by_size: dict[int, float] = field(default_factory=dict)
    #: the model's typical under-prediction of a time ratio, measured against steps
    #: (``benchmarks.step_costs``): the headroom ``auto`` keeps under its limit
    margin: float = 0.0

    def piece_op(self, size: int) -> float:
        """Seconds per op and extra piece for pieces of ``size`` samples: the measured
        size's, else the largest measured size below it, else the smallest measured one's,
        else ``piece_op_s``."""
        if not self.piece_op_by_size:
            return self.piece_op_s
        below = [k for k in self.piece_op_by_size if k <= size]
        key = max(below) if below else min(self.piece_op_by_size)
        return self.piece_op_by_size[key]

    def codec_s(self, label: str, elements: int) -> float:
        """A compress and a decompress of ``elements`` by the codec ``label`` ("quant",
        "dct", "dct-k6"); an unknown codec costs what the dearest known one does, so the
        model never calls it free."""
        per = self.codec_element_s.get(label, max(self.codec_element_s.values(), default=0.0))
        call = self.codec_call_s.get(label, max(self.codec_call_s.values(), default=0.0))
        return elements * per + call


@functools.cache
def costs() -> StepCosts:
    """The constants of ``step_costs.toml``."""
    data = tomllib.loads(COSTS_FILE.read_text())
    return StepCosts(
        flop_s=1.0 / float(data["flops_per_s"]),
        byte_s=1.0 / float(data["bytes_per_s"]),
        statement_s=float(data["statement_us"]) * 1e-6,
        piece_op_s=float(data["piece_op_us"]) * 1e-6,
        codec_element_s={k: float(v) * 1e-9 for k, v in data["codec_ns_per_element"].items()},
        codec_call_s={k: float(v) * 1e-6 for k, v in data["codec_us_per_call"].items()},
        thin_flop_s=1.0 / float(data["thin_flops_per_s"]) if "thin_flops_per_s" in data else None,
        piece_op_by_size={
            int(k): float(v) * 1e-6 for k, v in data.get("piece_op_us_by_size", {}).items()
        },
        margin=float(data.get("time_margin", 0.0)),
    )


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds by part, and against the uncompressed step's."""

    base_s: float  # forward and backward of every op, no recompute, no codec
    recompute_s: float  # segments and remade ops, forward again
    pieces_s: float  # the statement overhead of the extra pieces
    codec_s: float  # compress and decompress

    @property
    def total_s(self) -> float:
        return self.base_s + self.recompute_s + self.pieces_s + self.codec_s

    @property
    def ratio(self) -> float:
        """The step's time over the uncompressed step's (``base_s``)."""
        return self.total_s / self.base_s if self.base_s > 0 else 1.0


def node_forward_s(node: Node, batch: int, c: StepCosts) -> float:
    """Predicted seconds of one op's forward at ``batch``."""
    moved = sum(_bytes(v.type, batch) for v in node.inputs) + _bytes(node.output.type, batch)
    rate = c.thin_flop_s if c.thin_flop_s is not None and is_thin(node) else c.flop_s
    return forward_flops(node, batch) * rate + moved * c.byte_s + c.statement_s


def _bytes(t, batch: int) -> int:
    return t.numel(batch) * DTYPE_BYTES.get(t.dtype, 4)


def predict_time(
    graph: Graph,
    config: CompressionConfig,
    batch: int,
    segment_pieces: int = 1,
    segment_piece_size: int = 0,
    step_costs: StepCosts | None = None,
) -> StepTime:
    """The predicted time of one step of ``graph`` under ``config`` at ``batch`` (see the
    module's docstring)."""
    c = step_costs or costs()
    plan = plan_stash(graph, config, segment_pieces, segment_piece_size)
    forward = {node.name: node_forward_s(node, batch, c) for node in graph.nodes}
    base = sum(forward.values()) * (1.0 + BACKWARD)
    recompute = pieces = 0.0
    by_key = plan.by_key()
    for segment in plan.segments:
        rerun = rerun_nodes(segment, [by_key[key].producer for key in segment.internal])
        recompute += sum(forward[n.name] for n in rerun)
        count = _pieces(segment, batch)
        size = segment.piece_size or -(-batch // count)
        pieces += (count - 1) * len(segment.nodes) * c.piece_op(size)
    made_by = {node.output.name: node.name for node in graph.nodes}
    recompute += sum(forward[made_by[v]] for v in _remade(plan) if v in made_by)
    return StepTime(base, recompute, pieces, _codec_s(plan, batch, c))


def _pieces(segment, batch: int) -> int:
    if segment.piece_size:
        return max(1, -(-batch // segment.piece_size))
    return max(1, min(segment.pieces, batch))


def _remade(plan: StashPlan) -> set[str]:
    """The values ``--recompute`` remakes in the backward."""
    return {
        stashed.key.split(":")[0]
        for stashed in plan.entries
        if any(f.kind == "recompute" for f in stashed.forms)
    }


def codec_label(codec) -> str:
    """The key of a codec in ``step_costs.toml``: its name, and for DCT a keep other than
    the default's 4 (keeping 6 runs another, slower path)."""
    params = dict(codec.params)
    if codec.name == "dct" and params.get("keep", 4) != 4:
        return f"dct-k{params['keep']}"
    return codec.name


def _codec_s(plan: StashPlan, batch: int, c: StepCosts) -> float:
    """Each compressed form: its codec's compress and decompress, and the two generated
    statements that call them (keep it, restore it)."""
    total = 0.0
    for stashed in plan.entries:
        for form in stashed.forms:
            if form.kind == "codec" and form.codec is not None:
                total += c.codec_s(codec_label(form.codec), stashed.type.numel(batch))
                total += 2 * c.statement_s
    return total
