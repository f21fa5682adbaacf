"""The ``auto`` scheme as a search: the plan with the least bytes per sample within a time limit.

Every move the generator has changes both memory and time: compressed forms (codec time),
``--recompute`` (cheap ops again), segment recompute (a block's forward again) and pieces
(a statement's overhead per extra piece). The search builds the plans these moves make
together and keeps the one predicted to keep the least per added sample while its step
takes at most ``max_time_ratio`` times the uncompressed step's (``AUTO_TIME_RATIO`` by
default):

- **structures**: ``--recompute`` off and on; segments none, every block instance that can
  be recomputed, and the blocks that fit the time limit (most bytes of own stash per
  recompute FLOP first, ``plan.segment_pool``); with segments, whole or in pieces of
  ``PIECE_SIZES`` samples; and selective: the segments' matrix products of one op (their
  attention, say), or all of them, kept by the forward and not run again
  (``segment_keep``), so that the recompute remakes only the cheap statements between
  them. A structure whose step is over the limit with no codec at all
  is dropped before any forms are planned (codecs only add time).
- **forms** per structure: none (exact), the planner's (``plan.AUTO_MAX_ERROR``) at the
  least peak reachable + 10% (``plan.make_plan``), and the built-in schemes ``quant`` and
  ``dct-dense`` as they are (the planner aims at the least peak at a large batch, where a
  scheme that compresses everything can keep less per sample at a small one);
  ``--recompute`` plans go through ``recompute_guard``.
- **scores**: bytes per sample, the slope of the predicted peak (``memory.simulate_graph``)
  between the batches of each pair of ``batches``, the largest (``SEARCH_BATCHES``: 4 -> 8
  and 16 -> 32); time, the predicted ratio (``step_time.predict_time``) at the first
  pair's larger batch. Among the plans within the limit, the least bytes per sample wins; plans
  within ``TIE`` of it count as equal, and then the least lossy forms, then the fastest.
  "Within the limit" keeps the time model's margin (``StepCosts.margin``, its median
  under-prediction on measured steps) under it: the plan that wins is the one nearest the
  limit among hundreds, so an error of a few hundredths decides whether it measures over.
- **checked**: the winner's lossy forms are checked per parameter on the probe step
  (``probe.parameters_over``: a gradient error of ``AUTO_PARAM_ERROR`` or more that is
  also over the gradient's sampling noise at the probe's batch). The planner's forms that
  fail give way (``plan.checked_plan``); a built-in scheme's tensors that fail are stepped
  down to 8-bit quant, then raw (``plan.checked_scheme``), and the scheme is ruled out
  when that does not do. Scores are then taken again, and the search settles on the best
  of what is left.

A prediction of time is checked against a measured step by ``unroll plan --measure``
(``measure`` here): while the measured ratio is over the limit, the next plan is tried.
The result keeps every plan considered, so ``unroll plan`` can say what was chosen and why.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from unroller.analysis.memory import simulate_graph
from unroller.analysis.plan import (
    AUTO_BATCH,
    AUTO_MAX_ERROR,
    Probe,
    checked_plan,
    checked_scheme,
    config_of,
    make_plan,
    run_probe,
    segment_pool,
)
from unroller.analysis.recompute_guard import guard_recompute
from unroller.analysis.step_time import StepTime, costs, predict_time
from unroller.compiler.graph import Graph
from unroller.compiler.options import DEFAULT_TIME_RATIO
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.schemes import CompressionConfig, resolve
from unroller.compiler.stash import (
    SEGMENT_AUTO,
    SEGMENT_BLOCKS,
    SEGMENT_KEEP_MATMULS,
    block_instances,
    chosen_instances,
    kept_statement,
    plan_stash,
)
from unroller.errors import ModelError
from unroller.materialize import ModelBuilder
from unroller.materialize import model_class as materialized_class

__all__ = [
    "AUTO_TIME_RATIO",
    "auto_config",
    "Candidate",
    "fixed_plans",
    "PIECE_SIZES",
    "SEARCH_BATCHES",
    "Search",
    "search",
]

AUTO_TIME_RATIO = DEFAULT_TIME_RATIO
"""``auto``'s default limit: a step at most 1.2 times the uncompressed step's time."""
SEARCH_BATCHES = (4, 8, 16, 32)
"""The pairs of batches whose predicted peaks give the bytes per sample a plan is scored by,
the larger of the two slopes: small batches, where fine-tuning at long context sits and
pieces of a few samples already pay, and larger ones, where what the step holds for the
whole batch outside the pieces (a selective segment's forward, say) shows; the time ratio
is predicted at the first pair's larger batch (and ``LARGE_BATCH``). ``unroll plan
--batch-size B`` scores at B/2 and B alone."""
PIECE_SIZES = (1, 2, 4)
LARGE_BATCH = 64
"""The time ratio a plan is held to is the larger of the two predicted at the search's
larger batch and at this one: pieces of a fixed size cost more per sample as the batch
grows (more pieces), towards a bound a batch of 64 nearly reaches."""
TIE = 0.01  # bytes per sample within 1% of the least count as the least
#: the forms a structure is tried with, least lossy first: none, the planner's, and the
#: built-in schemes' (what a user picking a scheme by hand gets)
FORMS = ("none", "planned", "quant", "dct-dense")
SCHEME_FORMS = ("quant", "dct-dense")
MEASURED_TRIES = 4  # unroll plan --measure: at most this many plans timed


@dataclass
class Candidate:
    """One plan the search considered, with its scores."""

    forms: str  # one of FORMS
    recompute: bool
    segments: tuple[str, ...]  # block instances recomputed, in graph order
    segments_label: str  # "none", "every block (4)", "3 of 4 blocks"
    piece_size: int  # 0: segments whole
    config: CompressionConfig
    bytes_per_sample: float
    time: StepTime  # at the search's larger batch
    ratio: float  # the time ratio held to the limit: the larger at that batch and LARGE_BATCH
    checked: bool = False  # its forms passed the per-parameter check
    rejected: bool = False  # its forms failed it (a built-in scheme's)
    measured_ratio: float | None = None  # unroll plan --measure
    note: str = ""  # why it was not chosen, when that is not its scores
    keep: tuple[str, ...] = ()  # the segments' statements kept (``segment_keep``) ...
    keep_label: str = ""  # ... in words
    stepped: int = 0  # a built-in scheme's tensors the check stepped down

    @property
    def label(self) -> str:
        found = _label(
            self.forms, self.recompute, self.segments_label, self.piece_size, self.keep_label
        )
        if self.stepped:
            found += f", {self.stepped} tensors stepped down by the check"
        return found


@dataclass
class Search:
    """What the search considered and chose."""

    max_time_ratio: float
    batches: tuple[int, ...]  # pairs: bytes per sample is the largest slope between them
    candidates: list[Candidate]  # every plan scored, best first
    chosen: Candidate
    dropped: list[str] = field(default_factory=list)  # structures over the limit unplanned
    notes: list[str] = field(default_factory=list)
    held: float | None = None  # the predicted ratio plans are held to (the limit less margin)

    def why(self) -> str:
        """One sentence: why the chosen plan won."""
        c = self.chosen
        held = self.max_time_ratio if self.held is None else self.held
        within = [x for x in self.candidates if x.ratio <= held and not x.rejected]
        margin = ""
        if held < self.max_time_ratio:
            margin = f" (predicted at most {held:.2f}x: the time model's margin kept)"
        return (
            f"least predicted bytes per sample ({c.bytes_per_sample:,.0f}) of the "
            f"{len(within)} plans predicted within {self.max_time_ratio}x the uncompressed "
            f"step's time{margin} (this one {c.ratio:.2f}x), of {len(self.candidates)} scored"
        )


def _label(
    forms: str, recompute: bool, segments: str, piece_size: int, keep_label: str = ""
) -> str:
    parts = [f"forms {forms}"]
    if recompute:
        parts.append("--recompute")
    if segments != "none":
        pieces = f" in pieces of {piece_size}" if piece_size else ""
        parts.append(f"segments {segments}{pieces}")
    if keep_label:
        parts.append(keep_label)
    return ", ".join(parts)


@dataclass(frozen=True)
class _Structure:
    recompute: bool
    segments: tuple[str, ...]
    segments_label: str
    piece_size: int
    keep: tuple[str, ...] = ()  # segment_keep
    keep_label: str = ""


def search(
    graph: Graph,
    probe: Probe,
    max_time_ratio: float = AUTO_TIME_RATIO,
    batches: Sequence[int] = SEARCH_BATCHES,
    platform: str = "gpu",
    recompute: bool | None = None,
    segments: tuple[str, ...] | None = None,
    pieces: bool = True,
    label: str = "<model>",
    build: ModelBuilder = materialized_class,
    measure: Callable[[CompressionConfig], float] | None = None,
) -> Search:
    """The plan with the least predicted bytes per sample whose predicted step time is at
    most ``max_time_ratio`` times the uncompressed step's (see the module's docstring).

    ``recompute``: None tries both, else fixed; ``segments``: None chooses, else these
    block instance patterns are fixed (``()``: none); ``pieces``: segments may run in
    pieces (not on platforms that collect gradients); ``measure``: the measured time ratio
    of a config's step, tried on the best plans in turn until one is within the limit."""
    batches = tuple(batches)
    b2 = batches[1]
    held = held_ratio(max_time_ratio)
    structures, dropped = _structures(graph, held, b2, recompute, segments, pieces)
    scored: list[Candidate] = []
    seen: set[str] = set()
    for s in structures:
        for forms in FORMS:
            config = _config(graph, probe, s, forms, platform)
            if repr(config) in seen:
                continue
            seen.add(repr(config))
            found = _score(graph, config, s, forms, batches, platform)
            if not any(_same(found, c) for c in scored):  # forms that came out exact
                scored.append(found)
    if not scored:  # nothing within the limit, even exact: the uncompressed step
        s = _Structure(False, (), "none", 0)
        scored.append(_score(graph, config_of({}), s, "none", batches, platform))
    check = _Check(graph, probe, batches, platform, label, build)
    chosen, notes = _choose(check, scored, held, max_time_ratio, measure)
    _rank(scored, held)
    return Search(max_time_ratio, batches, scored, chosen, dropped, notes, held)


def held_ratio(limit: float, margin: float | None = None) -> float:
    """The predicted time ratio plans are held to under ``limit``: the limit less the time
    model's margin (``step_time.costs().margin``), but never below 1 where the limit is
    not (the uncompressed step's structures stay within)."""
    margin = costs().margin if margin is None else margin
    return max(min(limit, 1.0), limit - margin)


def _structures(
    graph: Graph,
    limit: float,
    batch: int,
    recompute: bool | None,
    segments: tuple[str, ...] | None,
    pieces: bool,
) -> tuple[list[_Structure], list[str]]:
    """The structures to plan forms for, and those dropped as over ``limit`` already."""
    options = [False, True] if recompute is None else [recompute]
    segment_sets = _segment_sets(graph, limit, batch, segments)
    found, dropped = [], []
    for r in options:
        for names, what in segment_sets:
            sizes = [0, *PIECE_SIZES] if names and pieces else [0]
            for size, (keep, kept) in itertools.product(sizes, _keep_sets(graph, names)):
                s = _Structure(r, names, what, size, keep, kept)
                config = config_of({}, r, names, size, keep)
                if size and not any(seg.in_pieces for seg in plan_stash(graph, config).segments):
                    continue  # no segment can run in pieces: the same step as whole
                ratio = time_ratio(graph, config, batch)
                if ratio > limit:
                    label = _label("none", r, what, size, kept)
                    dropped.append(f"{label}: {ratio:.2f}x with no codec")
                    continue
                found.append(s)
    return found, dropped


def fixed_plans(
    graph: Graph, batch: int = SEARCH_BATCHES[1], platform: str = "gpu"
) -> list[tuple[str, CompressionConfig]]:
    """Every structure the search has (no time limit) with the forms that need no probe
    (none and the built-in schemes), each with its label: what ``working_set_bound`` is
    taken over to say how little any plan of these moves can keep."""
    pieces = get_platform(platform).grads == "accumulate"  # as the api's auto moves say
    structures, _ = _structures(graph, math.inf, batch, None, None, pieces)
    found = []
    for s in structures:
        for forms in ("none", *SCHEME_FORMS):
            config = _config(graph, None, s, forms, platform)  # type: ignore[arg-type]
            found.append(
                (_label(forms, s.recompute, s.segments_label, s.piece_size, s.keep_label), config)
            )
    return found


def _keep_sets(graph: Graph, segments: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """What selective recompute may keep of ``segments``: nothing, the matrix products of
    one op (named, ``segment_keep``), and all of them when there are several ops; with
    how to say it."""
    sets: list[tuple[tuple[str, ...], str]] = [((), "")]
    if not segments:
        return sets
    by_op: dict[str, list[str]] = {}
    for call, nodes in block_instances(graph):
        if call.name in segments:
            for node in nodes:
                if kept_statement(node, (SEGMENT_KEEP_MATMULS,)):
                    by_op.setdefault(node.op.name, []).append(node.name)
    for op, names in sorted(by_op.items()):
        sets.append((tuple(names), f"keeping {op} ({len(names)})"))
    if len(by_op) > 1:
        sets.append(((SEGMENT_KEEP_MATMULS,), "keeping every matrix product"))
    return sets


def _segment_sets(
    graph: Graph, limit: float, batch: int, segments: tuple[str, ...] | None
) -> list[tuple[tuple[str, ...], str]]:
    """The segment sets to try: (instance names, how to call them)."""
    if segments is not None:
        if not segments:
            return [((), "none")]
        picked, _ = chosen_instances(graph, segments)
        names = tuple(call.name for call, _ in picked)
        return [(names, ", ".join(segments))]
    try:
        pool = segment_pool(graph, batch)
    except ModelError:  # the model has no block instance: no segments to try
        pool = []
    every = tuple(name for name, _, _ in pool)
    sets = [((), "none")]
    if every:
        sets.append((every, f"every block ({len(every)})"))
        within = _within_time(graph, pool, limit, batch)
        if within and within != every:
            sets.append((within, f"{len(within)} of {len(every)} blocks"))
    return sets


def _within_time(graph: Graph, pool, limit: float, batch: int) -> tuple[str, ...]:
    """Block instances, most own-stash bytes per recompute FLOP first, while the step with
    them recomputed (no codec) stays within ``limit``; in graph order."""
    own = plan_stash(graph, CompressionConfig(segments=(SEGMENT_BLOCKS,))).by_key()
    gain = {name: sum(own[k].raw_bytes(batch) for k in keys if k in own) for name, _, keys in pool}
    order = sorted(pool, key=lambda p: -gain[p[0]] / p[1])
    taken: list[str] = []
    for name, _, _ in order:
        trial = [n for n, _, _ in pool if n in taken or n == name]
        if time_ratio(graph, config_of({}, False, tuple(trial)), batch) <= limit:
            taken = trial
    return tuple(taken)


def _config(
    graph: Graph, probe: Probe, s: _Structure, forms: str, platform: str
) -> CompressionConfig:
    if forms == "none":
        config = config_of({}, s.recompute, s.segments, s.piece_size, s.keep)
    elif forms in SCHEME_FORMS:
        config = dataclasses.replace(
            resolve(forms),
            recompute=s.recompute,
            segments=s.segments,
            segment_piece_size=s.piece_size if s.segments else 0,
            segment_keep=s.keep if s.segments else (),
        )
    else:
        config = make_plan(
            graph,
            AUTO_BATCH,
            None,
            probe,
            AUTO_MAX_ERROR,
            platform,
            recompute=s.recompute,
            segments=s.segments,
            segment_piece_size=s.piece_size,
            segment_keep=s.keep,
        ).config
    return guard_recompute(graph, config, platform) if s.recompute else config


def _score(
    graph: Graph,
    config: CompressionConfig,
    s: _Structure,
    forms: str,
    batches: tuple[int, ...],
    platform: str,
) -> Candidate:
    """``config`` scored: the largest slope of the predicted peak over the pairs of
    ``batches`` (bytes per sample), and the time ratio at the first pair's larger batch."""
    per_sample = 0.0
    for b1, b2 in zip(batches[0::2], batches[1::2]):
        p1 = simulate_graph(graph, config, b1, platform).peak_bytes
        p2 = simulate_graph(graph, config, b2, platform).peak_bytes
        per_sample = max(per_sample, (p2 - p1) / (b2 - b1))
    time = predict_time(graph, config, batches[1])
    ratio = max(time.ratio, predict_time(graph, config, LARGE_BATCH).ratio)
    if forms == "planned" and not any(r.codec is not None for r in config.rules):
        forms = "none"  # the planner found nothing worth compressing
    return Candidate(
        forms,
        s.recompute,
        s.segments,
        s.segments_label,
        s.piece_size,
        config,
        per_sample,
        time,
        ratio,
        keep=s.keep,
        keep_label=s.keep_label,
    )


def time_ratio(graph: Graph, config: CompressionConfig, batch: int) -> float:
    """The predicted time ratio a plan is held to (``LARGE_BATCH``)."""
    return max(predict_time(graph, config, b).ratio for b in (batch, LARGE_BATCH))


def _same(a: Candidate, b: Candidate) -> bool:
    """Two plans that emit the same step: the planner's forms that came out exact and no
    forms at all, say (their configs differ only in where they came from)."""
    return (
        a.label == b.label
        and repr(a.config.rules) == repr(b.config.rules)
        and (a.config.recompute_keep == b.config.recompute_keep)
    )


def _rank(scored: list[Candidate], limit: float) -> None:
    """Best first: not ruled out, then within the limit before over it; within it, the
    least bytes per sample (within ``TIE`` counts as equal), the least lossy forms, the
    fastest; over it, the fastest."""
    within = [c for c in scored if c.ratio <= limit and not c.rejected]
    least = min((c.bytes_per_sample for c in within), default=math.inf)

    def key(c: Candidate) -> tuple:
        if c.ratio > limit:
            return (c.rejected, True, c.ratio)
        tied = c.bytes_per_sample <= least * (1 + TIE) + 1
        return (
            c.rejected,
            False,
            (not tied, c.bytes_per_sample if not tied else 0.0, FORMS.index(c.forms), c.ratio),
        )

    scored.sort(key=key)


@dataclass
class _Check:
    """The per-parameter check of a plan's lossy forms on the probe step."""

    graph: Graph
    probe: Probe
    batches: tuple[int, ...]
    platform: str
    label: str
    build: ModelBuilder

    def __call__(self, c: Candidate) -> Candidate:
        """``c`` checked: itself (``rejected`` where a built-in scheme gives a parameter
        too large an error), or the plan rescored with the forms ``checked_plan`` left."""
        c.checked = True
        if c.forms == "none":
            return c
        if c.forms in SCHEME_FORMS:
            return self._scheme(c)
        found = checked_plan(
            self.graph,
            self.probe,
            AUTO_MAX_ERROR,
            c.segments,
            self.label,
            build=self.build,
            recompute=c.recompute,
            segment_piece_size=c.piece_size,
            segment_keep=c.keep,
        ).config
        return self._rescored(c, self._guard(c.recompute)(found))

    def _scheme(self, c: Candidate) -> Candidate:
        """A built-in scheme's candidate checked (``plan.checked_scheme``): itself, rescored
        with the tensors the check stepped down, or ``rejected``."""
        checked = checked_scheme(
            self.graph, c.config, self.probe, self.label, self.build, self._guard(c.recompute)
        )
        if checked.config is None:
            c.rejected = True
            c.note = f"ruled out: {checked.why}"
            return c
        if not checked.stepped:
            return c
        return self._rescored(c, checked.config, len(checked.stepped))

    def _rescored(self, c: Candidate, config: CompressionConfig, stepped: int = 0) -> Candidate:
        """``c``'s structure and forms with the checked ``config``, scored again."""
        s = _Structure(
            c.recompute, c.segments, c.segments_label, c.piece_size, c.keep, c.keep_label
        )
        redone = _score(self.graph, config, s, c.forms, self.batches, self.platform)
        redone.checked = True
        redone.stepped = stepped
        return redone

    def _guard(self, recompute: bool) -> Callable[[CompressionConfig], CompressionConfig]:
        if not recompute:
            return lambda config: config
        return lambda config: guard_recompute(self.graph, config, self.platform)


def _choose(
    check: _Check,
    scored: list[Candidate],
    held: float,
    limit: float,
    measure: Callable[[CompressionConfig], float] | None,
) -> tuple[Candidate, list[str]]:
    """The best plan (predicted within ``held``) whose lossy forms pass the check and, with
    ``measure``, whose measured time is within ``limit`` (at most ``MEASURED_TRIES``
    timed; none within: the fastest timed), with notes on what gave way."""
    notes: list[str] = []
    timed: list[Candidate] = []
    for _ in range(3 * len(scored) + MEASURED_TRIES):
        _rank(scored, held)
        left = [c for c in scored if not c.rejected and c.measured_ratio is None]
        if not left:
            break
        top = left[0]
        if not top.checked:
            scored[scored.index(top)] = check(top)
            continue
        if measure is None or top.ratio > held or len(timed) >= MEASURED_TRIES:
            break
        top.measured_ratio = measure(top.config)
        timed.append(top)
        if top.measured_ratio <= limit:
            if len(timed) > 1:
                notes.append(
                    f"the predicted best ({timed[0].label}) measured "
                    f"{timed[0].measured_ratio:.2f}x, over the limit: took {top.label}"
                )
            return top, notes
        top.note = f"measured {top.measured_ratio:.2f}x, over the limit"
    if timed:
        notes.append(f"no plan timed was measured within {limit}x: chose the fastest timed")
        return min(timed, key=lambda c: c.measured_ratio), notes
    left = [c for c in scored if not c.rejected]
    return (left or scored)[0], notes


def auto_config(
    graph: Graph,
    label: str = "<model>",
    segments: tuple[str, ...] | None = (),
    build: ModelBuilder = materialized_class,
    platform: str = "gpu",
    recompute: bool | None = None,
    max_time_ratio: float = AUTO_TIME_RATIO,
    pieces: bool = True,
) -> CompressionConfig:
    """The ``auto`` scheme: the chosen plan of ``search`` on a probe step with a seeded
    synthetic batch and seeded initial weights (so the same model text always gives the
    same file). ``segments``: ``()`` or ``("auto",)`` lets the search choose, names fix
    them, ``None`` rules segments out (pipelined steps); ``recompute``: None lets it
    choose; ``pieces``: segments may run in pieces; ``build``: what makes the probe's
    modules (``materialize.model_class``)."""
    fixed: tuple[str, ...] | None
    if segments is None:
        fixed = ()  # ruled out
    elif not segments or SEGMENT_AUTO in segments:
        fixed = None  # the search chooses
    else:
        fixed = tuple(segments)
    types = tuple(str(v.type) for v in graph.inputs)
    key = (graph.source, graph.float_dtype, graph.precision, types, fixed, platform)
    key += (recompute, max_time_ratio, pieces)
    if key not in _AUTO_PLANS:
        probe = run_probe(graph, label=label, build=build)
        found = search(
            graph,
            probe,
            max_time_ratio,
            platform=platform,
            recompute=recompute,
            segments=fixed,
            pieces=pieces,
            label=label,
            build=build,
        )
        while len(_AUTO_PLANS) >= AUTO_PLANS_KEPT:
            del _AUTO_PLANS[next(iter(_AUTO_PLANS))]
        _AUTO_PLANS[key] = found.chosen.config
    return copy.deepcopy(_AUTO_PLANS[key])


AUTO_PLANS_KEPT = 32
"""How many ``auto`` plans one process remembers. A plan is a function of the model text,
its input shapes and the moves allowed alone (seeded probe batch and weights), and one
process often plans the same model again: ``auto`` and ``auto --recompute`` and the ipu
module share a probe, the benchmark harness generates and then predicts memory at two
batches, a test suite builds a model more than once. Each plan costs a probe step, the
search (a few seconds to tens of seconds of the memory model) and a checked step."""
_AUTO_PLANS: dict[tuple[Any, ...], CompressionConfig] = {}
