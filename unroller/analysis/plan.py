"""The compression planner: per saved tensor, the form that fits a memory budget with the
least predicted gradient error (``unroll plan``, and the ``auto`` scheme).

Candidates per tensor the backward reads as an activation: raw, quant at 8, 4 or 2 bits,
and for image maps [N, C, H, W] with H, W >= 8 DCT+Chop (keep 6 or 4 of 8, int8; keep 4
folded; keep 4 in bf16). Masks stay on (lossless) whatever the plan says.

- **Memory** is predicted by ``unroller.analysis.memory`` (the step program the generator emits,
  read statement by statement): only tensors still held at the predicted peak can lower
  it, so a tensor that is never held at the peak stays raw and costs no error.
- **Error** is calibrated by one probe step of the uncompressed generated module on a
  real (or seeded synthetic) batch: per tensor and candidate, the relative L2 error of one
  compress/decompress round trip of that very tensor, ``e``, times a sensitivity ``s``,
  the norm of the parameter gradients its error reaches (its readers' parameters, and
  every parameter upstream of a reader whose input gradient depends on the tensor: a
  batch norm's input, not a convolution's). The predicted relative gradient error is
  ``sqrt(sum (e * s)^2) / |all parameter gradients|``: GACT's adaptive allocation in
  spirit (spend bits where the gradient is sensitive), with a cheaper sensitivity.
- **Search**: start with everything raw; while the predicted peak is over the budget, move
  the tensors held at the peak to smaller forms, cheapest added error per byte saved
  first, until the bytes saved cover the excess; simulate again. ``max_error`` rules out
  candidates whose round-trip error on the probe is above it.
- **Segment recompute** (``segments=("auto",)``): the top-level block instances that can
  be recomputed (``unroller.compiler.stash.segment_problem``) are moves too. A move recomputes one
  segment: the bytes it saves are its own stash (what only its recompute would make) held
  at the peak, its cost the FLOPs of its forward statements (``flops.forward_flops``),
  and the moves are taken most bytes saved per recompute FLOP first. Moves come in three
  tiers, each used up before the next: light compression (forms whose round-trip error on
  the probe is at most ``LIGHT_ERROR``, 8-bit quant in practice: almost no error, little
  time), then segment recompute (no error of its own under exact forms; about one more
  forward of the segment), then harder compression. A fixed set of segments (``blocks``
  or names) is planned with, not chosen.

The result is an ordinary compression config (``[[rule]] tensor = ...``): readable,
editable, diffable, and ``unroll generate --compress-config`` takes it as it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unroller.analysis.flops import forward_flops
from unroller.analysis.memory import Simulation, packed_bytes, simulate_graph
from unroller.analysis.probe import (
    AUTO_PARAM_ERROR,
    Probe,
    config_parameter_errors,
    parameters_over,
    planned_step,
    run_probe,
)
from unroller.compiler.graph import Graph, Node
from unroller.compiler.schemes import Codec, CompressionConfig, Rule, make_codec
from unroller.compiler.stash import (
    SEGMENT_AUTO,
    SEGMENT_BLOCKS,
    Form,
    Segment,
    Stashed,
    chosen_instances,
    plan_stash,
)
from unroller.materialize import ModelBuilder
from unroller.materialize import model_class as materialized_class

__all__ = [
    "AUTO_BATCH",
    "AUTO_MAX_ERROR",
    "AUTO_PARAM_ERROR",
    "Choice",
    "MemoryPlan",
    "Probe",
    "blame",
    "candidates",
    "CheckedScheme",
    "checked_plan",
    "checked_scheme",
    "config_parameter_errors",
    "config_toml",
    "make_plan",
    "parameter_errors",
    "parameters_over",
    "run_probe",
    "segment_pool",
    "to_toml",
]

AUTO_BATCH = 256  # the batch the auto scheme plans for: activations, not weights, dominate
AUTO_MAX_ERROR = 0.2  # auto: no candidate whose round trip is worse than this on the probe
AUTO_ROUNDS = 8  # auto: at most this many plans, each giving up one tensor's codec
AUTO_SLACK = 1.10  # auto's budget: the least peak reachable under its candidates, + 10%
LIGHT_ERROR = 0.02  # segment planning: forms this accurate on the probe are tried first
ERROR_SAMPLES = 2  # round-trip errors are measured on the probe's first samples


@dataclass(frozen=True)
class Choice:
    """One candidate form of a saved tensor."""

    label: str  # "raw", "quant-8", "dct-k4", ...
    codec: Codec | None  # None: raw


RAW = Choice("raw", None)


def _choices() -> tuple[list[Choice], list[Choice]]:
    quant = [Choice(f"quant-{b}", make_codec("quant", {"bits": b})) for b in (8, 4, 2)]
    dct = [
        Choice("dct-k6", make_codec("dct", {"keep": 6}, min_size=8)),
        Choice("dct-k4", make_codec("dct", {}, min_size=8)),
        Choice("dct-k4-bf16", make_codec("dct", {"storage": "bf16"}, min_size=8)),
        Choice("dct-k4-fold", make_codec("dct", {"fold": True}, min_size=8)),
    ]
    return quant, dct


def candidates(stashed: Stashed) -> list[Choice]:
    """raw, then every codec that fits the tensor (``Codec.fit``)."""
    quant, dct = _choices()
    found = [RAW]
    for choice in quant + dct:
        codec, _ = choice.codec.fit(tuple(stashed.type.shape), stashed.layout)
        if codec is not None:
            found.append(Choice(choice.label, codec))
    return found


def plannable(graph: Graph) -> list[Stashed]:
    """Saved tensors some backward step reads as a compressible activation (those a
    compress-everything config would compress), in the order the forward makes them."""
    probe = CompressionConfig(default=make_codec("quant", {"bits": 8}))
    return [s for s in plan_stash(graph, probe).entries if any(f.kind == "codec" for f in s.forms)]


def config_of(
    assign: dict[str, Choice],
    recompute: bool = False,
    segments: tuple[str, ...] = (),
    piece_size: int = 0,
    keep: tuple[str, ...] = (),
) -> CompressionConfig:
    """The compression config of an assignment: one ``tensor`` rule per compressed tensor
    (``recompute``: cheap ops' outputs remade in the backward, too; ``segments``: the block
    instances recomputed in the backward; ``piece_size``: in pieces of at most that many
    samples; ``keep``: their statements not run again, ``segment_keep``)."""
    rules = [
        Rule(choice.codec, tensor=key) for key, choice in assign.items() if choice.codec is not None
    ]
    return CompressionConfig(
        default=None,
        rules=rules,
        source="<plan>",
        recompute=recompute,
        segments=segments,
        segment_piece_size=piece_size if segments else 0,
        segment_keep=keep if segments else (),
    )


def _bytes(stashed: Stashed, choice: Choice, batch: int) -> int:
    if choice.codec is None:
        return stashed.raw_bytes(batch)
    return packed_bytes(stashed, Form("codec", choice.codec), batch)


# -- the probe step ----------------------------------------------------------------------


def round_trip_error(codec: Codec, x: torch.Tensor) -> float:
    """Relative L2 error of one compress/decompress of ``x`` (0 for an all-zero tensor)."""
    instance = codec.instance()
    y = instance.decompress(instance.compress(x), tuple(x.shape[1:]), x.dtype)
    norm = float(torch.linalg.vector_norm(x.double()))
    if norm == 0.0:
        return 0.0
    diff = float(torch.linalg.vector_norm(y.double() - x.double()))
    return diff / norm if math.isfinite(diff) else math.inf


def _sensitivity(
    graph: Graph, stashed: Stashed, norms: dict[str, float], upstream: dict[str, float]
) -> float:
    """Norm of the parameter gradients an error in ``stashed`` reaches: each reader's own,
    and, unless the reader's input gradient ignores it (a registry ``weighted`` layer's saved
    input ``x``: grad_x = g @ W, or its convolution analogue), every parameter gradient
    upstream of the reader, through that input gradient."""
    total = 0.0
    for reader, saved, form in stashed.readers:
        if form.kind == "mask":  # lossless: a compressed form never reaches this reader
            continue
        total += _node_norm2(reader, norms)
        if not (reader.op.weighted is not None and saved.entry == "x"):
            total += upstream.get(reader.name, 0.0)
    return math.sqrt(total)


def _upstream_keys(graph: Graph) -> dict[str, frozenset[str]]:
    """Per node: the parameters upstream of its inputs."""
    producers = {n.output.name: n for n in graph.nodes}
    keys: dict[str, frozenset[str]] = {}
    for node in graph.nodes:  # topological order: inputs first
        found: set[str] = set()
        for value in node.inputs:
            parent = producers.get(value.name)
            if parent is not None:
                found |= keys[parent.name] | {p.key for p in parent.params if p.present}
        keys[node.name] = frozenset(found)
    return keys


def _upstream_norms(graph: Graph, norms: dict[str, float]) -> dict[str, float]:
    """Per node: the squared norm of every parameter gradient upstream of its inputs."""
    keys = _upstream_keys(graph)
    return {name: sum(norms.get(k, 0.0) for k in found) for name, found in keys.items()}


def _reach(stashed: Stashed, upstream: dict[str, frozenset[str]]) -> set[str]:
    """The parameters whose gradients an error in ``stashed`` reaches (``_sensitivity``'s
    set: its readers' own, and those upstream of a reader whose input gradient reads it)."""
    found: set[str] = set()
    for reader, saved, form in stashed.readers:
        if form.kind == "mask":
            continue
        found |= _own(reader)
        if not (reader.op.weighted is not None and saved.entry == "x"):
            found |= upstream.get(reader.name, frozenset())
    return found


def _own(node: Node) -> set[str]:
    """The keys of ``node``'s own parameters."""
    return {p.key for p in node.params if p.present}


def _node_norm2(node: Node, norms: dict[str, float]) -> float:
    return sum(norms.get(p.key, 0.0) for p in node.params if p.present)


# -- the plan ----------------------------------------------------------------------------


@dataclass
class Row:
    """One planned tensor: its form, bytes and predicted error."""

    tensor: str
    shape: tuple
    choice: Choice
    raw_bytes: int
    stored_bytes: int
    round_trip_error: float  # measured on the probe tensor
    sensitivity: float
    held_at_peak: bool

    @property
    def predicted(self) -> float:
        return self.round_trip_error * self.sensitivity


@dataclass
class MemoryPlan:
    """The planner's answer and how it was reached."""

    batch_size: int
    budget: int | None
    config: CompressionConfig
    rows: list[Row]
    simulation: Simulation
    nocompress: Simulation
    grad_norm: float  # |all parameter gradients| of the probe step
    probe_source: str
    max_error: float | None
    fits: bool
    notes: list[str] = field(default_factory=list)
    #: segment recompute: the block instances recomputed (planned or given), in graph order
    segments: list[str] = field(default_factory=list)

    @property
    def predicted_error(self) -> float:
        """Predicted relative error of all parameter gradients together."""
        total = math.sqrt(sum(r.predicted**2 for r in self.rows))
        return total / self.grad_norm if self.grad_norm > 0 else 0.0

    def assignment(self) -> dict[str, str]:
        return {r.tensor: r.choice.label for r in self.rows}


def make_plan(
    graph: Graph,
    batch_size: int,
    budget: int | None,
    probe: Probe,
    max_error: float | None = None,
    platform: str = "gpu",
    recompute: bool = False,
    segments: tuple[str, ...] = (),
    segment_piece_size: int = 0,
    ceilings: dict[str, float] | None = None,
    segment_keep: tuple[str, ...] = (),
    update_in_backward: bool = False,
) -> MemoryPlan:
    """The least-error assignment whose predicted peak fits ``budget`` (None: the least
    peak reachable, then the least error at that peak + ``AUTO_SLACK``); ``recompute``: the
    step remakes cheap ops' outputs in the backward (``--recompute``), planned with it;
    ``segments``: block instances recomputed in the backward (``("auto",)``: the search
    chooses them, see the module's docstring); ``segment_piece_size``: those segments run in
    pieces of at most that many samples (``--segment-piece-size``), planned so, and
    ``segment_keep`` their statements not run again; ``ceilings``: per tensor, candidates
    whose round trip is at or above this are ruled out (what ``checked_plan`` sets for a
    tensor that gave a parameter too large an error); ``update_in_backward``: the peaks
    are those of the step that updates each parameter in its backward and frees its
    gradient (``--update-in-backward``, an optimizer attached)."""
    ceilings = ceilings or {}
    choosing = SEGMENT_AUTO in segments
    pool = segment_pool(graph, batch_size) if choosing else []
    chosen: list[str] = []  # of the pool, recomputed so far
    fixed = () if choosing else tuple(segments)

    def simulate(config: CompressionConfig):
        return simulate_graph(
            graph, config, batch_size, platform, update_in_backward=update_in_backward
        )

    def config_now(assign_now: dict[str, Choice]) -> CompressionConfig:
        picked = tuple(name for name, _, _ in pool if name in chosen) if choosing else fixed
        return config_of(assign_now, recompute, picked, segment_piece_size, segment_keep)

    units = plannable(graph)
    norms = {k: float(torch.linalg.vector_norm(g.double())) ** 2 for k, g in probe.grads.items()}
    grad_norm = math.sqrt(sum(norms.values()))
    upstream = _upstream_norms(graph, norms)
    options: dict[str, list[tuple[Choice, int, float]]] = {}
    sens: dict[str, float] = {}
    for s in units:
        x = probe.tensors.get(s.key)
        x = x[:ERROR_SAMPLES] if x is not None else None
        found = []
        for choice in candidates(s):
            err = 0.0 if choice.codec is None or x is None else round_trip_error(choice.codec, x)
            if choice.codec is not None and max_error is not None and err > max_error:
                continue
            if choice.codec is not None and err >= ceilings.get(s.key, math.inf):
                continue
            found.append((choice, _bytes(s, choice, batch_size), err))
        options[s.key] = sorted(found, key=lambda o: -o[1])  # largest (raw) first
        sens[s.key] = _sensitivity(graph, s, norms, upstream)
    by_key = {s.key: s for s in units}
    nocompress = simulate(CompressionConfig())
    notes = []
    if budget is None:
        smallest = {k: min(o, key=lambda c: c[1])[0] for k, o in options.items()}
        every = tuple(name for name, _, _ in pool) if choosing else fixed
        least_config = config_of(smallest, recompute, every, segment_piece_size, segment_keep)
        least = simulate(least_config)
        budget_used = int(least.peak_bytes * AUTO_SLACK)
        notes.append(
            f"budget: the least peak any plan reaches ({least.peak_bytes} bytes) " f"x {AUTO_SLACK}"
        )
    else:
        budget_used = budget
    assign = {k: options[k][0] for k in options}  # raw
    sim = nocompress
    if recompute or fixed:
        sim = simulate(config_now({}))
    while sim.peak_bytes > budget_used:
        excess = sim.peak_bytes - budget_used
        moves = []  # (tier, cost, key or segment, new form or None, bytes saved)
        for key in sim.peak_stash:
            if key not in assign:
                continue
            choice, nbytes, err = assign[key]
            for c2, b2, e2 in options[key]:
                if b2 < nbytes:
                    cost = max((e2**2 - err**2) * sens[key] ** 2, 0.0) / (nbytes - b2)
                    tier = 0 if not choosing or e2 <= LIGHT_ERROR else 2
                    moves.append((tier, cost, key, (c2, b2, e2), nbytes - b2))
        if choosing:
            moves += _segment_moves(graph, pool, chosen, config_now(_labels(assign)), sim)
        if not moves:
            break
        moves.sort(key=lambda m: (m[0], m[1], -m[4]))
        saved, moved = 0, set()
        for _, _, key, new, gain in moves:
            if key in moved:
                continue
            if new is None:
                chosen.append(key)
            else:
                assign[key] = new
            moved.add(key)
            saved += gain
            if saved >= excess:
                break
        sim = simulate(config_now(_labels(assign)))
    fits = sim.peak_bytes <= budget_used
    if not fits:
        notes.append(
            f"the budget cannot be met: the predicted peak stays at {sim.peak_bytes} bytes "
            f"with every tensor held at the peak in its smallest form (floor "
            f"{sim.floor_bytes} bytes; the rest is working memory and parameter gradients)"
        )
    held = set(sim.peak_stash)
    rows = [
        Row(
            tensor=key,
            shape=tuple(by_key[key].type.shape),
            choice=choice,
            raw_bytes=by_key[key].raw_bytes(batch_size),
            stored_bytes=nbytes,
            round_trip_error=err,
            sensitivity=sens[key],
            held_at_peak=key in held,
        )
        for key, (choice, nbytes, err) in assign.items()
    ]
    config = config_now(_labels(assign))
    if choosing:
        notes.append(
            f"segments recomputed: {len(config.segments)} of {len(pool)} "
            "(most bytes saved per recompute FLOP first, after 8-bit-accurate forms)"
        )
    return MemoryPlan(
        batch_size=batch_size,
        budget=budget_used,
        config=config,
        rows=rows,
        simulation=sim,
        nocompress=nocompress,
        grad_norm=grad_norm,
        probe_source=probe.source,
        max_error=max_error,
        fits=fits,
        notes=notes,
        segments=[s.name for s in plan_stash(graph, config).segments] if config.segments else [],
    )


def _labels(assign: dict[str, tuple[Choice, int, float]]) -> dict[str, Choice]:
    return {k: v[0] for k, v in assign.items()}


def segment_pool(graph: Graph, batch: int) -> list[tuple[str, float, list[str]]]:
    """The block instances the planner may recompute: (name, FLOPs of its forward at
    ``batch``, the saved tensors only its recompute would make), in graph order."""
    picked, _ = chosen_instances(graph, (SEGMENT_BLOCKS,))
    every = plan_stash(graph, CompressionConfig(segments=(SEGMENT_BLOCKS,)))
    own: dict[str, Segment] = {s.name: s for s in every.segments}
    return [
        (
            call.name,
            max(1.0, sum(forward_flops(n, batch) for n in nodes)),
            list(own[call.name].internal) if call.name in own else [],
        )
        for call, nodes in picked
    ]


def _segment_moves(
    graph: Graph,
    pool: list[tuple[str, float, list[str]]],
    chosen: list[str],
    config: CompressionConfig,
    sim: Simulation,
) -> list[tuple[int, float, str, None, int]]:
    """Tier-1 moves: recompute a segment not chosen yet, whose own stash is held at the
    peak; saves those bytes (in their current forms), costs its forward's FLOPs."""
    held = set(sim.peak_stash)
    batch = sim.batch_size
    # under a lossy config the forward keeps a segment's 1-bit masks anyway: not saved
    stored = {
        s.key: sum(
            packed_bytes(s, f, batch)
            for f in s.forms
            if f.kind != "recompute" and not (config.lossy and f.kind == "mask")
        )
        for s in plan_stash(graph, config).entries
    }
    moves = []
    for name, flops, keys in pool:
        if name in chosen:
            continue
        gain = sum(stored.get(k, 0) for k in keys if k in held)
        if gain > 0:
            moves.append((1, -gain / flops, name, None, gain))
    return moves


def measured_error(
    graph: Graph,
    plan: MemoryPlan,
    probe: Probe,
    label: str = "<model>",
    model_class: type | None = None,
    build: ModelBuilder = materialized_class,
) -> float:
    """Relative error of all parameter gradients of one step under the plan, against the
    probe's uncompressed step (same weights, same batch); ``model_class``: the planned
    module's class, when the caller has generated it already (else ``build`` makes it)."""
    num = den = 0.0
    for _, got, ref in planned_step(graph, plan.config, probe, label, model_class, build):
        num += float(torch.linalg.vector_norm((got - ref).double())) ** 2
        den += float(torch.linalg.vector_norm(ref.double())) ** 2
    return math.sqrt(num / den) if den > 0 else 0.0


def checked_plan(
    graph: Graph,
    probe: Probe,
    max_error: float | None,
    segments: tuple[str, ...] = (),
    label: str = "<model>",
    limit: float = AUTO_PARAM_ERROR,
    budget: int | None = None,
    build: ModelBuilder = materialized_class,
    recompute: bool = False,
    segment_piece_size: int = 0,
    segment_keep: tuple[str, ...] = (),
) -> MemoryPlan:
    """``make_plan`` at ``AUTO_BATCH`` (``budget``; None: least peak + slack; ``recompute``,
    ``segments``, ``segment_piece_size`` and ``segment_keep`` as there), then checked per parameter: one
    step of the planned module on the probe's batch and weights; while some parameter fails
    (``probe.parameters_over``: its gradient error at or above ``limit`` and over its
    sampling noise), the lossy tensors ``blame`` names (those its node reads, else every
    one that reaches it) give up their form and every form at least as lossy
    (``ceilings``), and the search runs again (``AUTO_ROUNDS`` at most; then every tensor
    that reaches one stays raw). The planner's error model scales each round
    trip by the norm of the gradients it reaches, which misses a parameter whose exact
    gradient nearly cancels (a batch norm's input gradient is the output gradient less its
    mean and its projection on the normalised input: an error in the saved input survives
    the projection, the exact part does not), where a 0.87 round trip was measured to give
    a 9.5 relative error; the check measures what the model does instead."""
    ceilings: dict[str, float] = {}
    upstream = _upstream_keys(graph)
    units = {s.key: s for s in plannable(graph)}

    def plan() -> MemoryPlan:
        return make_plan(
            graph,
            AUTO_BATCH,
            budget,
            probe,
            max_error,
            recompute=recompute,
            segments=segments,
            segment_piece_size=segment_piece_size,
            ceilings=ceilings,
            segment_keep=segment_keep,
        )

    def blamed(found: MemoryPlan, last: bool) -> list[Row]:
        """The lossy rows to step down (``blame``); none when no parameter fails."""
        lossy = [r for r in found.rows if r.choice.codec is not None]
        if not lossy:
            return []
        over = set(parameters_over(graph, found.config, probe, limit, label, build))
        if not over:
            return []
        keys = blame([units[r.tensor] for r in lossy], over, upstream, direct=not last)
        return [r for r in lossy if r.tensor in keys]

    for attempt in range(AUTO_ROUNDS + 1):
        found = plan()
        culprits = blamed(found, attempt == AUTO_ROUNDS)
        if not culprits:
            return found
        for row in culprits:  # the last round: every tensor that reaches them stays raw
            ceiling = 0.0 if attempt == AUTO_ROUNDS else row.round_trip_error
            ceilings[row.tensor] = min(ceiling, ceilings.get(row.tensor, math.inf))
    return plan()


@dataclass
class CheckedScheme:
    """A built-in scheme's config after the per-parameter check (``checked_scheme``)."""

    config: CompressionConfig | None  # None: ruled out
    stepped: tuple[str, ...]  # the saved tensors stepped down (8-bit quant, else raw)
    why: str  # ruled out: the parameter still failing, and why


def checked_scheme(
    graph: Graph,
    config: CompressionConfig,
    probe: Probe,
    label: str = "<model>",
    build: ModelBuilder = materialized_class,
    finish: Callable[[CompressionConfig], CompressionConfig] = lambda c: c,
) -> CheckedScheme:
    """A built-in scheme's ``config`` checked per parameter like ``checked_plan``'s plans:
    while some parameter fails (``parameters_over``), the tensors ``blame`` names are
    stepped down, first to 8-bit quant (a 0.01 round trip) and then to raw, by one
    ``tensor`` rule each after the scheme's own (``finish`` redoes what the caller derives
    from the rules: the ``--recompute`` guard). Ruled out when a parameter still fails after
    ``AUTO_ROUNDS``."""
    upstream = _upstream_keys(graph)
    quant8 = make_codec("quant", {"bits": 8})
    stepped: dict[str, Codec | None] = {}
    found = config
    for attempt in range(AUTO_ROUNDS + 1):
        over = parameters_over(graph, found, probe, AUTO_PARAM_ERROR, label, build)
        if not over:
            return CheckedScheme(found, tuple(stepped), "")
        if attempt == AUTO_ROUNDS:
            break
        lossy = [s for s in plan_stash(graph, found).entries if _codec_of(s) is not None]
        keys = blame(lossy, set(over), upstream, direct=attempt < AUTO_ROUNDS - 1)
        for s in lossy:
            if s.key in keys:
                codec = _codec_of(s)
                mild = codec.name == "quant" and codec.kwargs.get("bits", 8) >= 8
                stepped[s.key] = None if s.key in stepped or mild else quant8
        rules = [Rule(codec, tensor=key) for key, codec in stepped.items()]
        found = finish(dataclasses.replace(config, rules=[*config.rules, *rules]))
    name, why = next(iter(over.items()))
    return CheckedScheme(None, tuple(stepped), f"{name}'s {why} on the probe")


def _codec_of(stashed: Stashed) -> Codec | None:
    return next((f.codec for f in stashed.forms if f.kind == "codec"), None)


def blame(
    lossy: list[Stashed],
    over: set[str],
    upstream: dict[str, frozenset[str]],
    direct: bool = True,
) -> set[str]:
    """The keys of the ``lossy`` tensors to step down for the failing parameters ``over``:
    with ``direct``, those read by a node that owns one of them (a batch norm's saved input
    for its weight), when there are any; else every one whose error reaches one of them
    (``_reach``: through input gradients, too); else all of them."""
    if direct:
        owned = {
            s.key
            for s in lossy
            if any(form.kind != "mask" and _own(reader) & over for reader, _, form in s.readers)
        }
        if owned:
            return owned
    return {s.key for s in lossy if _reach(s, upstream) & over} or {s.key for s in lossy}


def parameter_errors(
    graph: Graph,
    plan: MemoryPlan,
    probe: Probe,
    label: str = "<model>",
    build: ModelBuilder = materialized_class,
) -> dict[str, float]:
    """Per parameter, the relative error of its gradient in one step under the plan against
    the probe's uncompressed step (same weights, same batch). A parameter whose exact
    gradient is at most ``NEGLIGIBLE`` of all gradients together is left out: at float32
    rounding (a convolution's bias right before a batch norm, exactly 0 in exact
    arithmetic), any change is a large relative error and means nothing."""
    return config_parameter_errors(graph, plan.config, probe, label, build)


# -- output ------------------------------------------------------------------------------


def _comment(text: str) -> str:
    """``text`` safe inside one TOML comment line: control characters (line breaks
    included) written as escapes, so nothing after them can become a key."""
    return "".join(c if c == "\t" or (" " <= c and c != "\x7f") else ascii(c)[1:-1] for c in text)


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return _toml_string(str(value))


def to_toml(plan: MemoryPlan, header: list[str]) -> str:
    """The plan as a compression config file, with ``header`` lines as comments."""
    lines = _structure_lines(plan.config, header)
    for row in plan.rows:
        if row.choice.codec is None:
            continue
        lines += ["", "[[rule]]", f"tensor = {_toml_string(row.tensor)}"]
        lines.append(f"compressor = {_toml_string(row.choice.codec.name)}")
        base = dict(_base_params(row.choice))
        for key, value in base.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        if row.choice.codec.min_size:
            lines.append(f"min_size = {row.choice.codec.min_size}")
    return "\n".join(lines) + "\n"


def _structure_lines(config: CompressionConfig, header: list[str]) -> list[str]:
    """The header comments, the top-level keys (masks, derivative codes, recompute and
    segments) and the default: the config's own codec (a built-in scheme's the search
    chose), else none."""
    lines = [f"# {_comment(line)}" if line else "#" for line in header]
    if not config.masks:
        lines += ["", "masks = false"]
    if config.derivatives:
        lines += ["", "derivatives = true"]
    if config.recompute:
        lines += ["", "recompute = true"]
        if config.recompute_keep:
            kept = ", ".join(_toml_string(glob) for glob in config.recompute_keep)
            lines.append(f"recompute_keep = [{kept}]")
    if config.segments:
        names = ", ".join(_toml_string(name) for name in config.segments)
        lines += ["", f"recompute_segments = [{names}]"]
        if config.segment_piece_size:
            lines.append(f"segment_piece_size = {int(config.segment_piece_size)}")
        if config.segment_keep:
            kept = ", ".join(_toml_string(glob) for glob in config.segment_keep)
            lines.append(f"segment_keep = [{kept}]")
    if config.default is None:
        return lines + ["", "[default]", 'compressor = "none"']
    return lines + ["", "[default]", *_codec_lines(config.default, config.default.params)]


def _codec_lines(codec: Codec, params: tuple[tuple[str, Any], ...]) -> list[str]:
    """A codec's keys in a ``[default]`` or ``[[rule]]`` table."""
    lines = [f"compressor = {_toml_string(codec.name)}"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in params if value is not None]
    if codec.min_size:
        lines.append(f"min_size = {codec.min_size}")
    return lines


def config_toml(config: CompressionConfig, header: list[str]) -> str:
    """A searched config as a compression config file, with ``header`` lines as comments:
    what ``unroll plan --max-time-ratio`` writes. Every key the config sets is written
    (a planned config: one ``tensor`` rule per compressed tensor; a built-in scheme's: its
    default codec and derivative codes), so loading the file gives the same config."""
    lines = _structure_lines(config, header)
    for rule in config.rules:
        if rule.tensor is None or rule.op is not None or rule.name is not None:
            raise ValueError(f"cannot write rule {rule!r}: only tensor rules are planned")
        lines += ["", "[[rule]]", f"tensor = {_toml_string(rule.tensor)}"]
        lines += (
            _codec_lines(rule.codec, rule.codec.params) if rule.codec else ['compressor = "none"']
        )
    return "\n".join(lines) + "\n"


def _base_params(choice: Choice) -> tuple[tuple[str, Any], ...]:
    """The codec's parameters as the candidate set them (not the per-tensor group size
    ``Codec.fit`` adds for attention rows: the loader adds it again)."""
    quant, dct = _choices()
    for base in quant + dct:
        if base.label == choice.label:
            return base.codec.params
    return choice.codec.params if choice.codec else ()
