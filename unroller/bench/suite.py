"""The benchmark suite, the default preset of ``unroll bench`` (what ``make bench`` runs).

For each benchmark (``--benchmark``, default the four published and four spec-v2 models) and each scheme
(``--scheme``): the generated unrolled step and its peers (plain autograd,
torch.utils.checkpoint at stage boundaries, autograd with the same compressor in
saved_tensors_hooks), all on the same weights and the same synthetic batch, timed in
interleaved rounds; stashed bytes, peak step memory, final loss; and with
``--memory-budget`` the largest batch per method under the budget. Writes
``bench.{jsonl,csv,md}`` and PNG plots (``bench_ipu*`` for ``--platform ipu``) to
``--out-dir`` and prints a summary.

    unroll bench                                   # quick preset (make bench)
    unroll bench --full                            # published sizes (make bench FULL=1)
    unroll bench --benchmark resnet34 --scheme dct-dense --memory-budget 2GiB
    unroll bench --platform ipu --emulate --benchmark quick --num-ipus 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

# Before torch loads: the profiler (peak memory) would print two "USDT: ... profiler_start
# / profiler_stop" lines per measured step on stderr.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from unroller import crash  # noqa: E402
from unroller.bench import (  # noqa: E402
    budget,
    config,
    machine,
    measure,
    models,
    options,
    output,
    peers,
    per_sample,
    plots,
    targets,
)
from unroller.bench import precision as bench_precision  # noqa: E402
from unroller.bench.paths import ModelsNotFound  # noqa: E402
from unroller.bench.peers import STASH_METHODS, Method  # noqa: E402
from unroller.bench.stats import summary  # noqa: E402
from unroller.bench.timing import time_interleaved  # noqa: E402
from unroller.compiler.options import DEFAULT_TIME_RATIO, Options  # noqa: E402
from unroller.compiler.platforms import platform as get_platform  # noqa: E402
from unroller.compiler.schemes import AUTO  # noqa: E402
from unroller.runtime import ipu_device  # noqa: E402

EMULATION_NOTE = (
    "IPU platform under the CPU EMULATION of PopTorch: 'ours' times are CPU-emulation "
    "timings of the poptorch.trainingModel call, not IPU timings; the peers run on the "
    "host CPU"
)


def _options(args: argparse.Namespace, scheme: str, resolution: int) -> Options:
    limit = getattr(args, "max_time_ratio", DEFAULT_TIME_RATIO) if scheme == AUTO else None
    return Options(
        platform=args.platform,
        scheme=scheme,
        num_ipus=args.num_ipus,
        resolution=resolution,
        precision=_precision_name(args),
        max_time_ratio=limit or DEFAULT_TIME_RATIO,
    )


def _precision_name(args: argparse.Namespace) -> str:
    """--precision (namespaces made before the flag existed: the default)."""
    return getattr(args, "precision", bench_precision.DEFAULT)


@dataclasses.dataclass(frozen=True)
class OursBuild:
    """One generated module the suite builds and measures for a benchmark: the row's
    method name, the Options it is generated with, and how it is built. ``ours_builds``
    is the one list of them, so what the harness runs and what the tests generate cannot
    drift apart."""

    name: str  # ours:SCHEME, ours:SCHEME+compile, ours:SCHEME+recompute, ...
    scheme: str
    options: Options
    variant: dict[str, Any] = dataclasses.field(default_factory=dict)  # fields on the scheme's
    note: str = ""  # what the row runs, beyond the scheme
    compile: bool = False  # Model(compile=True): torch.compile of the step
    folder: str = ""  # where under the run's temporary folder it is written


RECOMPUTE_VARIANT = (
    config.RECOMPUTE_SCHEMES,
    "recompute",
    {"recompute": True},
    "--recompute: cheap ops remade in the backward",
)
"""ours:SCHEME+recompute (``--recompute``): cheap ops' outputs remade in the backward."""
SEGMENT_VARIANT = (
    config.SEGMENT_SCHEMES,
    "blocks+pieces",
    {"recompute_segments": ("blocks",), "segment_piece_size": config.SEGMENT_PIECE_SIZE},
    f"--recompute-segments blocks --segment-piece-size {config.SEGMENT_PIECE_SIZE}: every "
    "block instance recomputed in the backward, in pieces of the batch",
)
"""ours:SCHEME+blocks+pieces (``--segments``): every top-level block instance keeps only its
inputs from the forward and runs its forward again when its backward begins, in pieces of
at most ``config.SEGMENT_PIECE_SIZE`` samples where no op couples the samples."""


SELECTIVE_VARIANT = (
    config.SELECTIVE_SCHEMES,
    "blocks+keep",
    {**SEGMENT_VARIANT[2], "segment_keep": ("matmuls",)},
    f"--recompute-segments blocks --segment-piece-size {config.SEGMENT_PIECE_SIZE} "
    "--segment-keep matmuls: every block instance recomputed in pieces of the batch, its "
    "matrix products kept by the forward and not run again",
)
"""ours:SCHEME+blocks+keep: selective segment recompute, what the segments' recompute costs
when only the cheap statements between the kept matrix products run again."""


def ours_builds(bench: Any, args: argparse.Namespace, resolution: int) -> list[OursBuild]:
    """Every generated module the suite runs on ``bench`` at ``resolution`` under the parsed
    flags ``args``, in the order of its rows: ours per scheme, +compile per scheme
    (``--compile``), +recompute (``--recompute``, RECOMPUTE_SCHEMES) and +blocks+pieces
    (``--segments``, SEGMENT_SCHEMES, on models with block instances, where they would
    otherwise repeat ours:SCHEME). The host-side variants are not built for a platform
    that hands the step to a graph compiler."""
    found = [OursBuild(f"ours:{s}", s, _options(args, s, resolution)) for s in args.schemes]
    if args.compile:
        note = "Model(compile=True): torch.compile of the step"
        found += [
            OursBuild(f"ours:{b.scheme}+compile", b.scheme, b.options, {}, note, True, "compile")
            for b in found
        ]
    variants = []
    if getattr(args, "recompute", False) and not _compiled(args):
        variants.append(RECOMPUTE_VARIANT)
    if getattr(args, "segments", False) and not _compiled(args) and _has_blocks(bench, resolution):
        variants += [SEGMENT_VARIANT, SELECTIVE_VARIANT]
    for schemes, suffix, fields, note in variants:
        for scheme in [s for s in args.schemes if s in schemes]:
            options = dataclasses.replace(_options(args, scheme, resolution), **fields)
            name = f"ours:{scheme}+{suffix}"
            found.append(OursBuild(name, scheme, options, fields, note, folder=suffix))
    return found


def _has_blocks(bench: Any, resolution: int) -> bool:
    """Does the model have top-level block instances (segments to recompute)?"""
    from unroller.api import graph_from_text
    from unroller.compiler.stash import block_instances

    return bool(block_instances(graph_from_text(bench.model_text(resolution))))


def _ours_methods(
    bench: Any,
    args: argparse.Namespace,
    resolution: int,
    ref: torch.nn.Module,
    device: torch.device,
    directory: Path,
    notes: list[str],
) -> list[Method]:
    """The ours rows of ``ours_builds``, each generated, given the reference's weights and
    wrapped for timing; no +compile rows, with a note, where the generated Model cannot
    compile."""
    found = []
    for build in ours_builds(bench, args, resolution):
        try:
            model = models.build_ours(
                bench, build.options, ref, device, directory / build.folder, build.compile
            )
        except models.CompileUnsupported as exc:
            notes.append(f"--compile: no ours:SCHEME+compile rows: {exc} in this tree")
            continue
        if _compiled(args):
            method = peers.ours_ipu(build.scheme, model, ipu_device.poptorch, args)
        else:
            method = peers.ours_gpu(build.scheme, model)
        method.name = build.name
        method.recompute = build.options.recompute
        method.variant = dict(build.variant)
        method.compiles = build.compile  # peers.Method: its first step compiles
        if build.note:
            method.notes.append(build.note)
        found.append(method)
    return found


def _compiled_peers(
    ref: torch.nn.Module,
    wanted: list[str],
    notes: list[str],
    context: peers.Context = peers.plain,
) -> list[Method]:
    """The torch.compile'd autograd peers of ``wanted`` (peers.compiled_peers), or none
    with a note where this tree has no such peers."""
    make = getattr(peers, "compiled_peers", None)
    if make is None:
        notes.append(
            f"peers {', '.join(wanted)}: unroller.bench.peers.compiled_peers is "
            "missing in this tree: not run"
        )
        return []
    prefix = "compiled-budget-"
    budgets = tuple(float(p[len(prefix) :]) for p in wanted if p.startswith(prefix))
    extra = {} if context is peers.plain else {"context": context}  # an older tree: plain
    return [m for m in make(ref, budgets=budgets, **extra) if m.name in wanted]


def _methods(
    bench: Any,
    args: argparse.Namespace,
    resolution: int,
    ref: torch.nn.Module,
    device: torch.device,
    directory: Path,
    notes: list[str],
) -> list[Method]:
    """Ours (``ours_builds``), autograd, and the peers of --peers, each peer's forward in
    the context --precision gives it (``torch.autocast`` for a mixed one); what could not
    be built goes into ``notes``."""
    found = _ours_methods(bench, args, resolution, ref, device, directory, notes)
    context = bench_precision.of(_precision_name(args)).contexts(device)
    found.append(peers.autograd(ref, context))
    if "checkpoint" in args.peers and hasattr(ref, "forward_checkpointed"):
        found.append(peers.checkpointed(ref, context))
    if "hooks" in args.peers:
        found += [peers.hooks(s, ref, context) for s in args.schemes if s in config.HOOK_SCHEMES]
    compiled = [p for p in args.peers if p in config.COMPILED_PEERS]
    if compiled:
        found += _compiled_peers(ref, compiled, notes, context)
    return found


def _compiled(args: argparse.Namespace) -> bool:
    """Does --platform hand the step to a graph compiler (``Platform.graph_compiled``:
    PopTorch on the IPU)? Then the batch goes in as micro-batches, the host measures no
    device memory (no memory-model prediction, no timeline, no host-side variants), and
    the compiler's backend is set up (or emulated) before the run."""
    return get_platform(args.platform).graph_compiled


class _Phases:
    """Wall seconds per phase of one benchmark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 2)
        self._last = now


class _Run:
    """What one benchmark's phases share: the benchmark, its sizes, the batch maker."""

    def __init__(self, bench: Any, args: argparse.Namespace, device: torch.device) -> None:
        self.bench, self.args, self.device = bench, args, device
        self.resolution = models.resolution_of(bench, args)
        self.batch_size = models.batch_of(bench, args)
        self.granularity, self.device_batch = 1, None
        if _compiled(args):
            self.device_batch, self.batch_size = config.ipu_batch(args, self.batch_size)
            self.granularity = args.replication_factor * config.ipu_accumulation(args.num_ipus)
        self.label = f"{bench.name} b{self.batch_size}@{self.resolution}"

    def make_batch(self, n: int) -> list[torch.Tensor]:
        """``n`` samples on the device, in --precision (a plain low one casts the floats)."""
        found = models.batch_on(self.bench, n, self.resolution, self.args.seed, self.device)
        return bench_precision.of(_precision_name(self.args)).batch(found)


def _budget(
    args: argparse.Namespace, ref: torch.nn.Module, fits: dict[str, dict], batch_size: int
) -> tuple[int, int]:
    """(budget, reserved bytes added to every measured total) of the run's budget mode."""
    if args.memory_budget == config.QUARTER:  # weights at most a quarter of it
        floor = budget.auto_budget(fits["autograd"], batch_size, args.preset.budget_factor)
        return max(budget.quarter_budget(ref), floor), budget.optimizer_state_bytes(ref)
    if args.memory_budget == config.AUTO:
        return budget.auto_budget(fits["autograd"], batch_size, args.preset.budget_factor), 0
    return int(args.memory_budget), 0


def _max_batches(
    run: _Run,
    methods: list[Method],
    ref: torch.nn.Module,
    totals: dict[str, dict[int, int]],
    ms_per_sample: dict[str, float],
    note: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """budget.search per method under the run's budget ('auto': from autograd's line;
    'quarter': from the model's parameters, the momentum reserved). The probes default
    to the run's batch and twice it, whose total peaks the memory and per-sample phases
    measured already (``totals``: per method, batch -> bytes); no step predicted to take
    over --max-step-seconds is measured."""
    args, g, batch_size = run.args, run.granularity, run.batch_size
    probes = args.probe_batches or (batch_size, 2 * batch_size)
    probes = tuple(-(-n // g) * g for n in probes)
    fits = {}
    for m in sorted(methods, key=lambda m: m.name != "autograd"):
        known = totals.get(m.name) or None
        note(f"max batch, {m.name}: probes {probes[0]}, {probes[1]}")
        fits[m.name] = budget.probe_fit(m, run.make_batch, probes, run.device, known)
    limit, reserved = _budget(args, ref, fits, batch_size)
    return {
        m.name: budget.search(
            m,
            run.make_batch,
            limit,
            fits[m.name],
            run.device,
            g,
            progress=lambda what: note(f"max batch, {what}"),
            reserved=reserved,
            largest=budget.largest_batch(ms_per_sample.get(m.name), args.max_step_seconds, g),
        )
        for m in methods
    }


def per_sample_batches(run: _Run) -> tuple[int, int]:
    """The two batches the bytes per sample are measured between: --per-sample-batches,
    else the run's batch and twice it (so the max-batch probes reuse both), as multiples
    of the run's granularity."""
    a, b = run.args.per_sample_batches or (run.batch_size, 2 * run.batch_size)
    g = run.granularity
    a, b = (-(-n // g) * g for n in (a, b))
    return a, max(b, a + g)


def _per_sample(
    run: _Run,
    methods: list[Method],
    memory: dict[str, dict | None],
    advance: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[int, int]]]:
    """Per method the bytes per sample (per_sample.slope) between the two batches of
    ``per_sample_batches``, and the total peaks measured on the way (method -> batch ->
    bytes, the run's batch included) for the max-batch probes. The run's batch reuses the
    memory phase's measurement; any other batch is one more measured step per method."""
    pair = per_sample_batches(run)
    peaks: dict[str, dict[int, int | None]] = {m.name: {} for m in methods}
    totals: dict[str, dict[int, int]] = {m.name: {} for m in methods}
    for m in methods:
        if memory.get(m.name):
            peaks[m.name][run.batch_size] = memory[m.name]["step_peak_bytes"]
    for n in pair:
        if n == run.batch_size and all(memory.get(m.name) for m in methods):
            continue
        batch = run.make_batch(n)
        for m in methods:
            found = budget.measure_step(m, batch, run.device)
            peaks[m.name][n] = found["step_peak_bytes"]
            totals[m.name][n] = budget.own_total(found, m.module, batch)
            advance(f"bytes per sample, {m.name} at batch {n}")
        del batch
    slopes = {m.name: per_sample.slope([(n, peaks[m.name].get(n)) for n in pair]) for m in methods}
    return slopes, totals


def _timed_batch(run: _Run, found: dict[str, Any] | None, ms_per_sample: float | None) -> int:
    """The batch samples/s at the max batch is timed at: the max batch when measured to
    fit (else the largest measured to fit), at most the largest under --max-step-seconds."""
    if not found:
        return 0
    n = found["max_batch"] if found["basis"] == "measured" else found["measured_max_batch"]
    cap = budget.largest_batch(ms_per_sample, run.args.max_step_seconds, run.granularity)
    return n if cap is None else min(n, cap)


def _speed_at_max_batch(
    run: _Run,
    methods: list[Method],
    searched: dict[str, dict | None],
    ms_per_sample: dict[str, float],
    on_round: Callable[[int], None],
) -> dict[str, dict[str, Any]]:
    """Samples/s of every method at its own max batch: one warm-up round, then
    --max-batch-rounds rounds in which each method runs one step at its batch (the order
    rotating, as in the time phase); per round each method's samples/s over autograd's
    at autograd's own max batch."""
    sizes = {
        m.name: _timed_batch(run, searched[m.name], ms_per_sample.get(m.name)) for m in methods
    }
    sizes = {k: n for k, n in sizes.items() if n > 0}
    if not sizes:
        return {}
    batches = {name: run.make_batch(n) for name, n in sizes.items()}
    sides = {m.name: partial(m.step, batches[m.name]) for m in methods if m.name in sizes}
    rounds = run.args.max_batch_rounds
    timing = time_interleaved(sides, 1, rounds, None, run.device, on_round=on_round)
    rates = {k: [sizes[k] / (t / 1e3) for t in v["time_ms"]["samples"]] for k, v in timing.items()}
    base = rates.get("autograd")
    found = {}
    for name, n in sizes.items():
        mb = searched[name] or {}
        found[name] = {
            "batch": n,
            "at_max_batch": n == mb.get("max_batch"),
            "warmup": 1,
            "rounds": rounds,
            "time_ms": timing[name]["time_ms"],
            "samples_per_s": n / (timing[name]["time_ms"]["median"] / 1e3),
            "ratio_vs_autograd": (
                None if base is None else summary([a / b for a, b in zip(rates[name], base)])
            ),
        }
    return found


def _predicted(run: _Run, methods: list[Method], notes: list[str]) -> dict[str, dict | None]:
    """The memory model's figures (models.predict_memory) per ours method at the run's
    batch; none, with a note, without a memory model or where it fails."""
    found: dict[str, dict | None] = {}
    if _compiled(run.args) or models.memory_model() is None:
        if not _compiled(run.args):
            notes.append("predicted peak and floor: unroller.analysis.memory.simulate is missing")
        return found
    cache: dict[str, dict | None] = {}
    for m in methods:
        if m.kind != "ours":
            continue
        key = m.name
        if key not in cache:
            options = _options(run.args, m.scheme, run.resolution)
            options = dataclasses.replace(options, **m.variant)
            try:
                cache[key] = models.predict_memory(run.bench, options, run.batch_size)
            except Exception as exc:  # the memory model is new: a failure must not stop the run
                cache[key] = None
                notes.append(
                    f"{run.bench.name} {key}: the memory model failed: "
                    f"{type(exc).__name__}: {exc}"
                )
        found[m.name] = cache[key]
    return found


def _with_measured(
    predicted: dict[str, Any] | None,
    memory: dict[str, Any] | None,
    mb: dict[str, Any] | None,
    fixed: int,
    batch_per_sample: float,
    granularity: int,
) -> dict[str, Any] | None:
    """The predicted figures of one ours record with the measured ones set against them:
    measured step peak over the floor and over the predicted peak; under a budget the
    floor-limited ideal max batch and how far the max batch is from it."""
    if predicted is None:
        return None
    out = dict(predicted)
    step = (memory or {}).get("step_peak_bytes")
    out["measured_step_peak_bytes"] = step
    out["measured_over_floor"] = step / out["floor_bytes"] if step and out["floor_bytes"] else None
    out["measured_over_predicted"] = (
        step / out["peak_bytes"] if step and out["peak_bytes"] else None
    )
    out["ideal_max_batch"] = out["ideal_over_max_batch"] = None
    if mb:
        room = mb["budget_bytes"]
        ideal = models.ideal_max_batch(
            out, room, fixed + mb["reserved_bytes"], batch_per_sample, granularity
        )
        out["ideal_max_batch"] = ideal
        if ideal is not None and mb["max_batch"]:
            out["ideal_over_max_batch"] = ideal / mb["max_batch"]
    return out


def _timelines(
    run: _Run, methods: list[Method], batch: list[torch.Tensor], notes: list[str]
) -> dict:
    """Bytes live over one step (timeline.record), ours per scheme and autograd, for the
    timeline plot; none, with a note, where this tree has no timeline or on CUDA (the
    profiler's allocation events it reads are the CPU's)."""
    args = run.args
    if not (args.timeline and args.plots and not _compiled(args)):
        return {}
    if run.device.type != "cpu":
        notes.append("timeline plot: CPU only (profiler allocation events)")
        return {}
    try:
        from unroller.bench import timeline
    except ImportError:
        notes.append("timeline plot: unroller.bench.timeline is missing in this tree")
        return {}
    chosen = [
        m for m in methods if m.name == "autograd" or (m.kind == "ours" and "+" not in m.name)
    ]
    return {m.name: timeline.record(m, batch) for m in chosen}


def _compile(
    methods: list[Method], batch: list[torch.Tensor], note: Callable[[str], None]
) -> dict[str, float]:
    """One untimed step of every method whose first step compiles (torch.compile), so no
    compilation lands in a timed round even with --warmup 0; seconds per method."""
    seconds = {}
    for m in methods:
        if getattr(m, "compiles", False):
            note(m.name)
            t0 = time.perf_counter()
            m.step(batch)
            seconds[m.name] = round(time.perf_counter() - t0, 2)
    return seconds


def bench_one(
    bench: Any, args: argparse.Namespace, device: torch.device, bar: output.Bar
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records of every method on one benchmark, and what was run (sizes, seconds,
    notes, the timeline records)."""
    phases = _Phases()
    run = _Run(bench, args, device)
    label, batch_size = run.label, run.batch_size
    bar.note(f"{label}: generating")
    ref = models.build_reference(bench, run.resolution, args.seed, device)
    ref = bench_precision.of(_precision_name(args)).module(ref)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="unroller-bench-") as tmp:
        methods = _methods(bench, args, run.resolution, ref, device, Path(tmp), notes)
    names = [m.name for m in methods]
    searching = args.memory_budget is not None
    extra_batches = sum(n != batch_size for n in per_sample_batches(run))
    bar.add(
        args.warmup
        + args.iterations
        + len(methods) * (1 + args.get_memory * (1 + extra_batches) + searching)
        + searching * (1 + args.max_batch_rounds)
    )
    batch = run.make_batch(batch_size)
    found = _Measured(names, batch_per_sample=models.tensor_bytes(batch) / batch_size)
    phases.done("generate")
    found.compile_s = _compile(methods, batch, lambda m: bar.note(f"{label}: compiling {m}"))
    if found.compile_s:
        phases.done("compile")

    found.timing = time_interleaved(
        {m.name: partial(m.step, batch) for m in methods},
        args.warmup,
        args.iterations,
        "autograd",
        device,
        on_round=lambda r: bar.advance(f"{label}: timing round {r}"),
    )
    ms_per_sample = {k: v["time_ms"]["median"] / batch_size for k, v in found.timing.items()}
    phases.done("time")
    for m in methods:  # before the memory phase: ours' first stash finds its backward mark
        found.stash[m.name] = m.stash(batch)
        bar.advance(f"{label}: stash {m.name}")
    phases.done("stash")
    if args.get_memory:
        _measure_memory(run, methods, batch, device, found, bar, phases)
    found.predicted = _predicted(run, methods, notes)
    phases.done("predict")
    timelines = _timelines(run, methods, batch, notes) if args.get_memory else {}
    if timelines:
        phases.done("timeline")
    del batch

    if searching:
        _search_max_batches(run, methods, ref, found, ms_per_sample, bar, phases)
    fixed = models.state_bytes(ref)
    records = [_method_record(bench, args, device, run, m, found, fixed) for m in methods]
    info = {
        "benchmark": bench.name,
        "batch": batch_size,
        "resolution": run.resolution,
        "ipu_device_batch": run.device_batch,
        "methods": names,
        "phase_seconds": phases.seconds,
        "notes": notes,
        "timeline": timelines,
    }
    return records, info


@dataclasses.dataclass
class _Measured:
    """What the phases of one benchmark found, by method name (None: not measured)."""

    names: dataclasses.InitVar[list[str]]
    batch_per_sample: float
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)
    timing: dict[str, dict] = dataclasses.field(default_factory=dict)
    stash: dict[str, Any] = dataclasses.field(default_factory=dict)
    memory: dict[str, dict | None] = dataclasses.field(default_factory=dict)
    totals: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    slopes: dict[str, dict | None] = dataclasses.field(default_factory=dict)
    predicted: dict[str, Any] = dataclasses.field(default_factory=dict)
    searched: dict[str, dict | None] = dataclasses.field(default_factory=dict)
    speed: dict[str, dict] = dataclasses.field(default_factory=dict)

    def __post_init__(self, names: list[str]) -> None:
        self.memory = dict.fromkeys(names)
        self.totals = {name: {} for name in names}
        self.slopes = dict.fromkeys(names)
        self.searched = dict.fromkeys(names)


def _search_max_batches(
    run: _Run,
    methods: list[Method],
    ref: torch.nn.Module,
    found: _Measured,
    ms_per_sample: dict[str, float],
    bar: output.Bar,
    phases: _Phases,
) -> None:
    """Each method's largest batch within the memory budget (``found.searched``), and its
    samples per second there (``found.speed``)."""
    found.searched.update(
        _max_batches(
            run,
            methods,
            ref,
            found.totals,
            ms_per_sample,
            lambda what: bar.note(f"{run.label}: {what}"),
        )
    )
    bar.advance(f"{run.label}: max batch", len(methods))
    phases.done("max_batch")
    found.speed = _speed_at_max_batch(
        run,
        methods,
        found.searched,
        ms_per_sample,
        lambda r: bar.advance(f"{run.label}: samples/s at the max batch, round {r}"),
    )
    phases.done("max_batch_speed")


def _measure_memory(
    run: _Run,
    methods: list[Method],
    batch: Any,
    device: torch.device,
    found: _Measured,
    bar: output.Bar,
    phases: _Phases,
) -> None:
    """Each method's peak step memory at the run's batch, then its bytes per sample from
    steps at other batch sizes (``found.memory``, ``totals`` and ``slopes``)."""
    for m in methods:
        found.memory[m.name] = measure.peak_step(m, batch, device)
        found.totals[m.name][run.batch_size] = budget.own_total(
            found.memory[m.name], m.module, batch
        )
        bar.advance(f"{run.label}: peak memory {m.name}")
    phases.done("memory")
    found_slopes, more = _per_sample(
        run, methods, found.memory, lambda what: bar.advance(f"{run.label}: {what}")
    )
    found.slopes.update(found_slopes)
    for name, by_batch in more.items():
        found.totals[name].update(by_batch)
    phases.done("per_sample")


def _method_record(
    bench: Any,
    args: argparse.Namespace,
    device: torch.device,
    run: _Run,
    m: Method,
    found: _Measured,
    fixed: int,
) -> dict[str, Any]:
    """One method's record: its timing, memory, predictions and searches, and each
    against autograd's."""
    base_peak = (found.memory["autograd"] or {}).get("step_peak_bytes")
    base_batch = (found.searched["autograd"] or {}).get("max_batch")
    t, mem, mb = found.timing[m.name], found.memory[m.name], found.searched[m.name]
    return {
        "benchmark": bench.name,
        "method": m.name,
        "kind": m.kind,
        "scheme": m.scheme,
        "precision": _precision_name(args),
        "compiled": getattr(m, "compiles", False),
        "first_step_s": found.compile_s.get(m.name),
        "platform": args.platform,
        "device": (
            args.platform
            if m.kind == "ours" and _compiled(args) and not args.emulate
            else device.type
        ),
        "emulated": bool(_compiled(args) and args.emulate),
        "batch": run.batch_size,
        "resolution": run.resolution,
        "time_ms": t["time_ms"],
        "time_ratio": t["ratio"],
        "samples_per_s": run.batch_size / (t["time_ms"]["median"] / 1e3),
        "loss": t["loss"],
        "stash": found.stash[m.name],
        "memory": mem,
        "peak_ratio_vs_autograd": (
            mem["step_peak_bytes"] / base_peak if mem and base_peak else None
        ),
        "predicted": _with_measured(
            found.predicted.get(m.name),
            mem,
            mb,
            fixed,
            found.batch_per_sample,
            run.granularity,
        ),
        "max_batch": mb,
        "max_batch_ratio_vs_autograd": (
            mb["max_batch"] / base_batch if mb and base_batch else None
        ),
        "max_batch_speed": found.speed.get(m.name),
        "per_sample": found.slopes[m.name],
        "per_sample_ratio_vs_autograd": per_sample.ratio(
            found.slopes[m.name], found.slopes["autograd"]
        ),
        "notes": m.notes,
    }


def _meta(args: argparse.Namespace, argv: Sequence[str], prog: str) -> dict[str, Any]:
    meta = machine.describe(prog, argv)
    meta["args"] = {  # paths as machine.shown_path records them: no absolute path
        k: (machine.shown_path(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "preset"
    }
    meta["args"]["preset"] = "full" if args.full else "quick"
    how = "cuda" if args.device == "cuda" else "cpu"
    if _compiled(args):
        where = "CPU EMULATION of PopTorch" if args.emulate else "PopTorch"
        where += f", {args.num_ipus} IPU(s) x {args.replication_factor} replica(s)"
    else:
        where = f"device {args.device}"
    meta["title"] = f"platform {args.platform} ({where}), {meta['args']['preset']} preset"
    meta["about"] = [
        f"peak memory: {measure.MEMORY_SHORT[how]}; time: {args.iterations} rounds after "
        f"{args.warmup} warm-up, methods interleaved, same weights and batch"
    ]
    if args.memory_budget is not None:
        meta["about"].append(_budget_about(args))
    precision_line = bench_precision.about(_precision_name(args), args.device)
    if precision_line:
        meta["about"].insert(0, precision_line)
        meta["title"] += f", precision {_precision_name(args)}"
    meta["precision"] = _precision_name(args)
    if _compiled(args) and args.emulate:
        meta["about"].insert(0, EMULATION_NOTE)
        if args.profile:
            meta["about"].append("--profile: the emulation writes no PopVision report")
    parts = args.replication_factor * config.ipu_accumulation(args.num_ipus)
    if _compiled(args) and parts > 1:
        meta["about"].append(
            f"ours splits each batch into {parts} micro-batches (replicas x gradient "
            "accumulation) run one after another, so its peak follows the micro-batch; the "
            "peers take the whole batch at once"
        )
    elif _compiled(args):
        meta["about"].append(
            "on the IPU the host measures no device memory: no peak or max batch here; "
            "--profile DIR writes PopVision's memory report"
        )
    meta["methods"] = {
        "time": measure.TIME_METHOD,
        "peak_memory": measure.MEMORY_METHODS[how],
        **{f"stash_{k}": v for k, v in STASH_METHODS.items()},
        "max_batch": budget.METHOD,
        "per_sample": per_sample.METHOD,
        "budget": _budget_method(args),
        "max_batch_speed": MAX_BATCH_SPEED_METHOD.format(rounds=args.max_batch_rounds),
        "predicted_memory": PREDICTED_METHOD,
        "ideal_max_batch": IDEAL_METHOD,
        **{f"method_{k}": v for k, v in peers.METHODS.items()},
    }
    return meta


MAX_BATCH_SPEED_METHOD = (
    "samples/s at the max batch: every method steps at its own max batch, 1 warm-up round "
    "then {rounds} timed rounds (each method once per round, the order rotating, as the time "
    "phase); samples/s = batch / median step time; vs autograd = the median over rounds of "
    "its samples/s over autograd's in the same round, autograd at its own max batch. A max "
    "batch predicted but not measured to fit is timed at the largest batch measured to fit, "
    "and none at a batch whose step is predicted to take over --max-step-seconds: there the "
    "largest batch under that limit (the table marks a batch that is not the max batch)"
)
PREDICTED_METHOD = (
    "unroller.analysis.memory.simulate on the generated step of the scheme at the run's batch (ours "
    "only): predicted step peak (the step's own allocations, as the measured step peak "
    "counts them), floor (stored stash at its largest + the largest working set of a single "
    "step + parameter gradients); measured step peak / floor and / predicted peak. The "
    "+compile rows carry the prediction for the eager code of their scheme"
)
IDEAL_METHOD = (
    "floor-limited ideal max batch: the largest batch n with parameters + buffers + the "
    "reserved optimizer state + floor(n) + batch(n) <= budget, i.e. what fits if the step "
    "peaked at its floor; floor(n) = fixed + per-sample bytes, the line through the floors "
    "the memory model predicts at the run's batch and twice it"
)


def _budget_method(args: argparse.Namespace) -> str:
    if args.memory_budget == config.QUARTER:
        return budget.QUARTER_METHOD
    if args.memory_budget == config.AUTO:
        return (
            "'auto' budget: autograd's predicted total peak at "
            f"{args.preset.budget_factor:g} x the run's batch, rounded up to a MiB"
        )
    return f"a fixed budget of {args.memory_budget} bytes (--memory-budget)"


def _budget_about(args: argparse.Namespace) -> str:
    """One line on the max-batch phase: the budget and the step-time limit."""
    if args.memory_budget == config.QUARTER:
        what = (
            "quarter (weights + gradients + SGD momentum = 1/4 of the budget; the momentum "
            "counted on top of every measured peak)"
        )
    elif args.memory_budget == config.AUTO:
        what = f"auto (autograd's peak at {args.preset.budget_factor:g} x the batch)"
    else:
        what = f"{args.memory_budget / 2**20:.1f} MiB"
    limit = (
        "no limit on the step time"
        if args.max_step_seconds is None
        else f"no step predicted over {args.max_step_seconds:g} s measured (beyond: predicted, "
        "unconfirmed)"
    )
    return (
        f"max batch under the budget: {what}; {limit}; samples/s there: "
        f"{args.max_batch_rounds} timed rounds after 1 warm-up"
    )


def _write_timelines(
    ran: list[dict[str, Any]], out: Path, prefix: str, title: str, notes: list[str]
) -> list[Path]:
    """One timeline plot per benchmark (plots.timeline), from bench_one's records."""
    draw = getattr(plots, "timeline", None)
    found = [info for info in ran if info.get("timeline")]
    if not found:
        return []
    if draw is None:
        notes.append("timeline plot: unroller.bench.plots.timeline is missing in this tree")
        return []
    files = []
    for info in found:
        path = out / f"{prefix}_timeline_{info['benchmark']}.png"
        size = f"b{info['batch']}@{info['resolution']}"
        draw(
            info["timeline"], path, f"{info['benchmark']} {size}: bytes live over one step, {title}"
        )
        files.append(path)
    return files


def _check_sizes(args: argparse.Namespace, registry: dict[str, Any], prog: str) -> str | None:
    """The one-line reason a benchmark cannot run at the chosen resolution, or None."""
    for name in args.benchmarks:
        bench = registry[name]
        try:
            bench.check_resolution(models.resolution_of(bench, args))
        except ValueError as exc:
            return f"{prog}: error: {exc}"
    return None


def _setup_platform(args: argparse.Namespace, prog: str) -> str | None:
    """The one-line reason the run cannot start, or None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return f"{prog}: --device cuda, but torch.cuda.is_available() is False"
    if not _compiled(args):
        return None
    if args.emulate:
        ipu_device.use_emulation()
    else:
        try:
            ipu_device.backend()
        except ipu_device.PopTorchMissing as exc:
            return str(exc)
    if args.profile:
        os.environ["POPLAR_ENGINE_OPTIONS"] = json.dumps(
            {"autoReport.all": "true", "autoReport.directory": args.profile}
        )
    return None


def main(argv: Sequence[str], prog: str = "unroll bench") -> int:
    """The suite: parse ``argv``, run every benchmark, write the results; 0, or 2 (with
    one line on stderr) when the run cannot start."""
    argv = list(argv)
    args = config.parse_args(argv, prog)
    try:
        registry = options.benchmarks(args.benchmarks, args.models_dir)
    except ModelsNotFound as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    problem = _check_sizes(args, registry, prog) or _setup_platform(args, prog)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    console = Console()
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    ran: list[dict[str, Any]] = []
    failed: list[str] = []
    try:
        with output.progress_bar(console, args.progress) as bar:
            for name in args.benchmarks:
                try:
                    found, info = bench_one(registry[name], args, device, bar)
                except Exception as exc:
                    failed.append(_failed_benchmark(name, exc, prog, argv))
                    continue
                records += found
                ran.append(info)
    finally:
        if _compiled(args) and args.emulate:
            ipu_device.use_emulation(False)
    if not ran:
        print(f"{prog}: error: no benchmark could be measured", file=sys.stderr)
        return crash.INTERNAL_ERROR
    meta = _meta(args, argv, prog)
    found = targets.evaluate(records, device=device.type, command=meta["command"])
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    prefix = "bench" if not _compiled(args) else f"bench_{args.platform}"
    files = [out / f"{prefix}.jsonl", out / f"{prefix}.csv", out / f"{prefix}.md"]
    notes = list(dict.fromkeys(n for info in ran for n in info.pop("notes")))
    if args.plots:
        files += plots.write_all(records, out, prefix)
        files += _write_timelines(ran, out, prefix, meta["title"], notes)
    for info in ran:
        info.pop("timeline", None)
    meta["about"] += notes + failed
    meta["wall_s"] = time.perf_counter() - started
    meta["benchmarks"] = ran
    output.write_jsonl(files[0], meta, records, found)
    output.write_csv(files[1], records)
    files[2].write_text(output.markdown(meta, records, found), encoding="utf-8")
    output.print_summary(console, meta, records, found, files)
    for line in failed:
        print(f"{prog}: {line}", file=sys.stderr)
    return crash.INTERNAL_ERROR if failed else 0


def _failed_benchmark(name: str, exc: Exception, prog: str, argv: Sequence[str]) -> str:
    """What the results say of a benchmark that raised (an internal error: a bug): its
    name, the exception and the log file with the traceback, also printed at once, so
    that one benchmark's failure costs neither the others' measurements nor the results
    files. With ``--debug`` / ``UNROLL_DEBUG=1`` the exception goes through instead."""
    if crash.debugging():
        raise exc
    line = crash.crash_line(exc, " ".join([prog, *argv]), prog, f"{crash.DEBUG_ENV}=1")
    print(f"{name}: {line}", file=sys.stderr, flush=True)
    return f"{name}: not measured: {line.split(': ', 1)[1]}"
