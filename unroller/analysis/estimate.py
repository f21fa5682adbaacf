"""``unroll estimate``: what fits on a device and how fast, without the device.

No IPU can run here, so the IPU side is a model, written so that every assumption is a
named, documented number a user can change (``IpuSpec``):

- **Memory per IPU** (a GC200: 1472 tiles x 624 KiB = 897 MiB of In-Processor-Memory,
  allocated at compile time): the stage's weights, their gradients and the optimizer
  state (PopTorch keeps them on chip), the stage's stash at the micro-batch (stored forms,
  the stash plan of the scheme), the largest working set of one of its steps (inputs,
  outputs and gradients of one forward or backward op, from the graph's shapes), and an
  allowance for code and exchange buffers. Over the chip's memory, the excess of the
  stash goes to Streaming Memory. Tile level: an op's working set is spread over all tiles
  and must fit in the share of each tile PopTorch leaves to temporaries
  (``availableMemoryProportion``, 0.6), else Poplar must split it (reported, not priced).
- **Time per step**: per op, the larger of its FLOPs over the achieved compute rate and
  its bytes over the on-chip bandwidth (a roofline), forward and backward (2x the
  forward's FLOPs for convolutions and matrix products); the codecs' work on what they
  compress; what goes to Streaming Memory written once and read once at its bandwidth; a
  pipeline's stage boundaries over the IPU-Links; with K pipelined IPUs, K - 1 fill and
  drain steps beside the micro-batches (GPipe).
- **GPU**: the largest batch per scheme whose predicted total (weights, gradients,
  optimizer state, the batch and the memory model's step peak, ``unroller.analysis.memory``) fits
  ``--device-memory``.

The IPU figures are a model, not a measurement: ``README.md`` ("Scaling out") compares
them with the published trend and says where they cannot reproduce it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from unroller.analysis.flops import forward_flops
from unroller.analysis.memory import simulate_graph
from unroller.compiler.dtypes import DTYPE_BYTES
from unroller.compiler.graph import Graph, Node
from unroller.compiler.options import Options
from unroller.compiler.pipeline import ipu_report, split
from unroller.compiler.schemes import CompressionConfig
from unroller.compiler.stash import plan_stash
from unroller.compress import get as compressor

MIB = 2**20


@dataclass(frozen=True)
class IpuSpec:
    """A Graphcore GC200 as the estimate sees it; every number can be overridden."""

    tiles: int = 1472
    tile_bytes: int = 638_976  # 624 KiB of SRAM per tile
    onchip_bandwidth: float = 47.5e12  # bytes/s, SRAM
    ipu_link_bandwidth: float = 320e9  # bytes/s, 10 IPU-Links
    pcie_bandwidth: float = 64e9  # bytes/s, host PCIe Gen4 x16 (the batch comes this way)
    #: Streaming Memory (off-chip DDR behind the host links): not published; an assumption
    #: to calibrate. 20 GB/s is a third of PCIe, for reads and writes that share it.
    streaming_bandwidth: float = 20e9
    flops: float = 62.5e12  # FP32 peak (GC200 datasheet; 250 TFLOPS is FP16)
    #: achieved / peak compute for convolutions and matrix products: an assumption
    efficiency: float = 0.25
    #: per IPU, for the compiled program and the exchange buffers: an assumption
    code_bytes: int = 150 * MIB
    available_memory_proportion: float = 0.6  # PopTorch's default for op temporaries

    @property
    def memory_bytes(self) -> int:
        return self.tiles * self.tile_bytes


@dataclass
class IpuStage:
    ipu: int
    weights_bytes: int  # parameters + buffers
    grads_bytes: int  # parameter gradients
    optimizer_bytes: int  # SGD momentum (one buffer per parameter)
    stash_bytes: int  # stored forms kept for backward at the micro-batch
    working_bytes: int  # the largest working set of one op
    code_bytes: int
    boundary_bytes: int  # sent to the next stage per micro-batch (activations + gradients)
    flops: float
    bytes_moved: float
    codec_flops: float

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.stash_bytes
            + self.working_bytes
            + self.code_bytes
        )


@dataclass
class IpuEstimate:
    scheme: str
    ipus: int
    micro_batch: int
    stages: list[IpuStage]
    memory_bytes: int  # per IPU
    streaming_bytes: int  # the most any IPU sends off chip
    tile_ok: bool  # every op's working set fits the tiles' temporary share
    step_seconds: float  # one step: its micro-batches through the pipeline, fill and drain
    micro_batches: int = 1  # per step (1 without a pipeline)
    notes: list[str] = field(default_factory=list)

    @property
    def fits_on_chip(self) -> bool:
        return self.streaming_bytes == 0

    def as_dict(self) -> dict[str, Any]:
        found = asdict(self)
        found["fits_on_chip"] = self.fits_on_chip
        for stage, row in zip(self.stages, found["stages"]):
            row["total_bytes"] = stage.total_bytes
        return found


def resolved(options: Options, graph: Graph, config: CompressionConfig | None) -> CompressionConfig:
    """``config`` when given (resolved by the caller: ``unroller.api.compression_config``,
    which plans the ``auto`` scheme), else the built-in scheme or config file of
    ``options``. The ``auto`` scheme is planned from a probe step, which the caller runs
    (or has run) once for everything it asks of the model; ``auto`` without ``config`` is
    a ConfigError naming the resolver. ``--recompute`` is guarded here as the resolver
    guards it (``recompute_guard``), so the estimate is of the step generate emits."""
    if config is not None:
        return config
    found = options.compression(graph)
    if not found.recompute:
        return found
    from unroller.analysis.recompute_guard import guard_recompute

    return guard_recompute(
        graph, found, options.platform, options.segment_pieces, options.segment_piece_size
    )


# -- per op -------------------------------------------------------------------------------


def _bytes(t: Any, batch: int) -> int:
    return t.numel(batch) * DTYPE_BYTES[t.dtype]


def op_bytes(node: Node, batch: int) -> int:
    """Bytes one forward op reads and writes (its inputs and its output)."""
    return sum(_bytes(v.type, batch) for v in node.inputs) + _bytes(node.output.type, batch)


def working_bytes(node: Node, batch: int) -> int:
    """An op's working set in its backward, the larger of its two steps: the inputs, the
    output and their gradients (the forward needs only the first two)."""
    inputs = sum(_bytes(v.type, batch) for v in node.inputs)
    out = _bytes(node.output.type, batch)
    return 2 * (inputs + out) if node.needs_backward else inputs + out


# -- IPU ----------------------------------------------------------------------------------


#: Micro-batches per step through a pipeline (gradient accumulation): PopTorch needs at
#: least one per stage; more hide the fill and drain. An assumption: --micro-batches.
MICRO_BATCHES = 8


def estimate_ipu(
    graph: Graph,
    options: Options,
    micro_batch: int,
    ipus: int,
    spec: IpuSpec | None = None,
    micro_batches: int = MICRO_BATCHES,
    config: CompressionConfig | None = None,
) -> IpuEstimate:
    """Memory per IPU and time of one step of ``micro_batch`` samples per micro-batch; with
    ``ipus`` > 1, ``micro_batches`` (at least ``ipus``) go through the pipeline per step.
    ``config``: see ``resolved``."""
    spec = spec or IpuSpec()
    config = resolved(options, graph, config)
    plan = plan_stash(graph, config)
    pipeline = split(graph, plan, ipus, list(options.stage_starts) or None)
    report = ipu_report(graph, plan, pipeline, micro_batch)
    stages = []
    tile_share = spec.tiles * spec.tile_bytes * spec.available_memory_proportion
    tile_ok = True
    for row in report["ipus"]:
        i = row["ipu"]
        nodes = [n for n in graph.nodes if pipeline.stage(n.name) == i]
        owners = [n for n in nodes if not n.shares]  # a shared layer's tensors: its owner's
        params = sum(
            p.nbytes() for n in owners for p in n.params if p.present and p.name not in n.ties
        )
        buffers = sum(p.nbytes() for n in owners for p in n.buffers if p.present)
        working = max((working_bytes(n, micro_batch) for n in nodes), default=0)
        tile_ok = tile_ok and working <= tile_share
        boundary = sum(
            b["forward_bytes"] + b["gradient_bytes"]
            for b in report["boundaries"]
            if b["between"][0] == i
        )
        codec_flops = 0.0
        for stashed in plan.entries:
            producer = graph.nodes[stashed.producer].name if stashed.producer >= 0 else None
            if (pipeline.stage(producer) if producer else 0) != i:
                continue
            for form in stashed.forms:
                if form.codec is not None:
                    t = form.type or stashed.type
                    codec_flops += compressor(form.codec.name).flops * t.numel(micro_batch)
        stages.append(
            IpuStage(
                ipu=i,
                weights_bytes=params + buffers,
                grads_bytes=params,
                optimizer_bytes=params,
                stash_bytes=row["stash_stored_bytes"],
                working_bytes=working,
                code_bytes=spec.code_bytes,
                boundary_bytes=boundary,
                flops=3.0 * sum(forward_flops(n, micro_batch) for n in nodes),
                bytes_moved=3.0 * sum(op_bytes(n, micro_batch) for n in nodes),
                codec_flops=codec_flops,
            )
        )
    streaming = [max(0, s.total_bytes - spec.memory_bytes) for s in stages]
    over = [s for s, extra in zip(stages, streaming) if extra > s.stash_bytes]
    notes = []
    if over:
        notes.append(
            f"IPU {over[0].ipu}: more than its stash would have to leave the chip "
            "(weights, optimizer state or one op's working set alone do not fit): "
            "PopTorch would not compile this; more IPUs or a smaller micro-batch"
        )
    if not tile_ok:
        notes.append(
            "an op's working set exceeds the tiles' share for temporaries "
            f"({spec.available_memory_proportion} of each tile): Poplar must split it"
        )
    times = []
    for stage, extra in zip(stages, streaming):
        compute = (stage.flops + stage.codec_flops) / (spec.flops * spec.efficiency)
        memory = stage.bytes_moved / spec.onchip_bandwidth
        offload = 2.0 * extra / spec.streaming_bandwidth
        link = stage.boundary_bytes / spec.ipu_link_bandwidth
        times.append(max(compute, memory) + offload + link)
    micro_batches = max(micro_batches, ipus) if ipus > 1 else 1
    step = (micro_batches + ipus - 1) * max(times) if ipus > 1 else times[0]
    return IpuEstimate(
        scheme=options.scheme,
        ipus=ipus,
        micro_batch=micro_batch,
        stages=stages,
        memory_bytes=spec.memory_bytes,
        streaming_bytes=max(streaming),
        tile_ok=tile_ok,
        step_seconds=step,
        micro_batches=micro_batches,
        notes=notes,
    )


def samples_per_second(est: IpuEstimate) -> float:
    return est.micro_batch * est.micro_batches / est.step_seconds


#: Where the batch searches stop. They double the batch until it no longer fits, so they
#: end near the real limit after about 2 log2(limit) estimates; this ceiling only stops a
#: model whose memory does not grow with the batch (or an absurd --device-memory). A result
#: equal to it is "at least this many" (``at_ceiling``), never reported as the maximum.
SEARCH_CEILING = 1 << 40


def at_ceiling(batch: int) -> bool:
    """Whether a largest-batch result is only a lower bound (the search stopped there)."""
    return batch >= SEARCH_CEILING


def largest_on_chip(
    graph: Graph,
    options: Options,
    ipus: int,
    spec: IpuSpec | None = None,
    limit: int | None = None,
    config: CompressionConfig | None = None,
) -> int:
    """The largest micro-batch whose every IPU fits on chip (0: not even 1); searched up
    to ``limit`` (default ``SEARCH_CEILING``: see ``at_ceiling``). ``config``: see
    ``resolved``."""
    config = resolved(options, graph, config)
    return _largest(
        lambda b: estimate_ipu(graph, options, b, ipus, spec, config=config).fits_on_chip,
        SEARCH_CEILING if limit is None else limit,
    )


def _largest(fits: Any, limit: int) -> int:
    """The largest n in [1, limit] with fits(n), fits being monotone (0: none; ``limit``:
    it fits there, and the real largest may be larger)."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# -- GPU ----------------------------------------------------------------------------------


@dataclass
class GpuEstimate:
    scheme: str
    device_bytes: int
    state_bytes: int  # weights + buffers + optimizer state, held across steps
    max_batch: int
    total_bytes: int  # predicted at max_batch: state + batch + the step's own peak
    step_peak_bytes: int
    #: the search stopped at its ceiling with the batch still fitting: max_batch is a
    #: lower bound, not the maximum
    max_batch_at_least: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_total(
    graph: Graph, config: Any, batch: int, state: int, update_in_backward: bool = False
) -> tuple[int, int]:
    sim = simulate_graph(graph, config, batch, "gpu", update_in_backward=update_in_backward)
    inputs = sum(_bytes(v.type, batch) for v in graph.inputs)
    return state + inputs + sim.peak_bytes, sim.peak_bytes


def estimate_gpu(
    graph: Graph,
    options: Options,
    device_bytes: int,
    optimizer_states: int = 1,
    limit: int | None = None,
    config: CompressionConfig | None = None,
) -> GpuEstimate:
    """The largest batch whose predicted total fits ``device_bytes``: the weights and
    buffers, ``optimizer_states`` buffers per parameter (SGD momentum 1, Adam 2), the batch,
    and the memory model's step peak (activations, stash, gradients, ``.grad``; with
    ``options.update_in_backward`` each ``.grad`` freed at its update). Searched
    up to ``limit`` (default ``SEARCH_CEILING``); reaching it sets ``max_batch_at_least``.
    ``config``: see ``resolved``."""
    limit = SEARCH_CEILING if limit is None else limit
    config = resolved(options, graph, config)
    # a tied parameter is one tensor (counted once), a shared layer's counted where it is
    # made; a frozen one has no optimizer state
    owners = [n for n in graph.nodes if not n.shares]
    params = sum(p.nbytes() for n in owners for p in n.params if p.present and p.name not in n.ties)
    trained = sum(
        p.nbytes()
        for n in owners
        for p in n.params
        if p.present and p.trainable and p.name not in n.ties
    )
    buffers = sum(p.nbytes() for n in owners for p in n.buffers if p.present)
    state = params + buffers + optimizer_states * trained
    updates = options.update_in_backward
    lo = _largest(lambda b: _gpu_total(graph, config, b, state, updates)[0] <= device_bytes, limit)
    total, peak = _gpu_total(graph, config, lo, state, updates) if lo else (state, 0)
    return GpuEstimate(options.scheme, device_bytes, state, lo, total, peak, lo >= limit)
