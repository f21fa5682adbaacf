"""The scaling preset: one process against a K-stage pipeline and K data-parallel processes.

    unroll bench --pipeline 2 [--data-parallel 2] [--benchmark resnet34]
        [--scheme nocompress,quant,dct-dense] [--micro-batches 4] [--schedule 1f1b|gpipe]
        [--batch-size 32] [--resolution R] [--steps 3] [--warmup 1] [--threads 1]
        [--error-batch N] [--seed 0] [--out-dir benchmarks/results/]

(also ``unroll bench scaling ...``; any command line of the harness with ``--pipeline`` or
``--data-parallel`` comes here.) For each scheme, on the same weights and float32 batch:

- ``ours:SCHEME``: the ordinary generated module, one process, the whole batch;
- ``pipelineK:SCHEME``: the module generated with ``Options(pipeline=K)``, one process
  per stage (``unroller.parallel.pipeline.PipelineStage``), boundaries over gloo in the
  scheme's codec; bytes on the wire against raw tensors, and the gradient error the
  scheme gives with the wire against the exact (nocompress) pipeline;
- ``dpK:SCHEME`` (``--data-parallel K``): the module generated with
  ``Options(data_parallel=True)``, K processes on batch/K each, gradients averaged by
  ``unroller.parallel.data``; the all-reduce time alone, how much of it the backward hides,
  and the bytes all-reduced.

The parent times the one-process rows and measures the gradient errors (float64,
``run_local``: every stage in this process with the wire's codec round trips), then
starts one group of processes (torch.multiprocessing, gloo, a ``file://`` store in a
temporary folder) that runs the pipeline and data-parallel phases of every scheme in
turn. Writes ``scaling.jsonl`` and ``scaling.md`` to ``--out-dir`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from unroller.api import generate_from_text, graph_from_text
from unroller.bench import machine, options, output
from unroller.bench.paths import ModelsNotFound, default_results_dir
from unroller.bench.reference import BENCHMARKS
from unroller.bench.stats import summary
from unroller.compiler.codegen import PROCESS_STAGES, value_range
from unroller.compiler.options import Options
from unroller.compiler.pipeline import split
from unroller.compiler.schemes import SCHEMES, builtin
from unroller.compiler.stash import plan_stash
from unroller.materialize import load_file, write_source
from unroller.parallel import data as distributed
from unroller.parallel.pipeline import PipelineStage, boundaries_of, run_local
from unroller.runtime.ipu_device import synthetic_batch

DEFAULT_SCHEMES = ("nocompress", "quant", "dct-dense")
EXACT = "nocompress"  # the scheme every gradient error is measured against
FILES = ("scaling.jsonl", "scaling.md")
#: how long a process waits for another (gloo) before the run fails instead of hanging
PROCESS_TIMEOUT = datetime.timedelta(minutes=30)
MIB = 1024.0 * 1024.0

METHODS = {
    "step": (
        "one step = gradients reset to None (untimed), then the generated step (forward and "
        "unrolled backward, no optimizer update), float32; --warmup untimed steps, then "
        "--steps timed ones with time.perf_counter; the table gives the median (p10/p90)"
    ),
    "processes": (
        "pipeline and data-parallel rows: one process per stage or shard, started with "
        "torch.multiprocessing (spawn) on one gloo group, each with --threads threads; a "
        "barrier of the row's processes before every step, the step timed on each rank, "
        "the slowest rank's time taken per step, then the median over steps"
    ),
    "samples_per_s": "the whole batch / the median step time",
    "speedup": (
        "the one-process row's median step time / this row's (same scheme, same batch, "
        "each process with --threads threads: K processes use K times the threads)"
    ),
    "pipeline": (
        "every process gets the whole batch, cut into --micro-batches micro-batches run in "
        "the --schedule order; each process builds the whole model, its stage's parameters "
        "get gradients; every scheme is cut where nocompress's memory (parameters + "
        "stash) is balanced (not the compute), so the same values cross for every scheme"
    ),
    "wire": (
        "bytes the pipeline's processes send per step (PipelineStage.log.totals of the "
        "last timed step, summed over ranks): forward = boundary activations, backward = "
        "their gradients; vs raw = those bytes / what the same tensors take uncompressed"
    ),
    "grad_error": (
        "relative L2 error ||g - g_exact|| / ||g_exact|| over every parameter gradient "
        "concatenated, float64, in the parent on the first --error-batch samples of the "
        "batch. ours rows: the one-process SCHEME step against the one-process nocompress "
        "step; pipeline rows: the SCHEME pipeline (unroller.parallel.pipeline.run_local, the "
        "same micro-batches, the wire's codec round trips) against the nocompress pipeline. "
        "Set side by side they show what the wire adds (the pipeline's figure also holds "
        "the scheme's own stash error on micro-batches)"
    ),
    "allreduce": (
        "data-parallel rows: alone = the median time of the step's bucket all-reduces run "
        "one after another with nothing else to do (unroller.parallel.data.overlap, after "
        "the last step); blocked = the median over timed steps of the time reduce_wait "
        "waited; hidden = 1 - blocked / alone; rank 0's figures (every rank's are in the "
        "JSON lines)"
    ),
    "allreduced_bytes": (
        "data-parallel rows: bytes of the parameter gradients each process all-reduces per "
        "step (the sum over the reducer's buckets)"
    ),
}


# -- the model a run scales ------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A model text at a resolution, and how to make its batches: a registry benchmark
    (its own synthetic data) or a model file (normal inputs, class-index targets)."""

    name: str
    label: str
    text: str
    resolution: int | None  # None: the size the model file declares
    make_batch: Callable[[int, int], list[Tensor]]  # (samples, seed) -> inputs and targets

    def source(self, scheme: str, **extra: Any) -> str:
        """The generated module of ``scheme`` at the workload's resolution."""
        opts = Options(scheme=scheme, resolution=self.resolution, **extra)
        return generate_from_text(self.text, opts, label=self.label)

    def cut(self, stages: int) -> tuple[str, ...]:
        """The first node of each stage after the first in nocompress's balanced split:
        every scheme's pipeline is cut there, so their wire bytes compare."""
        graph = graph_from_text(self.text, self.label, self.resolution)
        plan = plan_stash(graph, builtin(EXACT))
        cut = split(graph, plan, stages, None, PROCESS_STAGES, "--pipeline", loss_last=True)
        return tuple(cut.starts)


def workload(name: str, resolution: int | None, models_dir: Path | None) -> Workload:
    """The registry benchmark ``name`` (default resolution: its quick one), or the model file
    at path ``name`` (default: its declared size). ValueError or ModelsNotFound say why not."""
    if name in BENCHMARKS:
        bench = options.benchmarks([name], models_dir)[name]
        size = bench.check_resolution(bench.quick_resolution if resolution is None else resolution)
        text = bench.model_text(size)
        return Workload(name, bench.label, text, size, lambda n, s: bench.make_batch(n, size, s))
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"--benchmark {name!r}: neither a benchmark ({', '.join(BENCHMARKS)}) nor a model file"
        )
    text = path.read_text(encoding="utf-8")
    graph = graph_from_text(text, str(path), resolution)
    specs = [
        (v.name, v.kind, v.type.dtype, list(v.type.shape[1:]), value_range(v)) for v in graph.inputs
    ]
    return Workload(path.stem, str(path), text, resolution, _file_batches(specs))


def _file_batches(specs: list) -> Callable[[int, int], list[Tensor]]:
    """A model file's batch maker: synthetic inputs of its declared shapes."""
    return lambda n, seed: synthetic_batch(specs, n, seed)


# -- the command line ------------------------------------------------------------------------


def _stages(text: str) -> int:
    value = options.positive(text)
    if value not in PROCESS_STAGES:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(map(str, PROCESS_STAGES))}, got {value}"
        )
    return value


def _processes(text: str) -> int:
    value = options.positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 processes, got {value}")
    return value


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Step time, samples/s and speed-up of a K-stage pipeline and of K data-parallel "
            "processes (CPU, gloo) against one process, per compression scheme; bytes on "
            "the pipeline's wire, the gradient error it adds, and the all-reduce overlap. "
            "Writes scaling.jsonl and scaling.md to --out-dir."
        ),
        epilog="Without --pipeline or --data-parallel: --pipeline 2.",
    )
    add = parser.add_argument
    add("--benchmark", default="resnet34", help="a registry model, or a model file's path")
    add("--scheme", default=",".join(DEFAULT_SCHEMES), help=f"a comma list of {', '.join(SCHEMES)}")
    add("--pipeline", type=_stages, nargs="?", const=2, metavar="K", help="stages (default 2)")
    add("--data-parallel", type=_processes, nargs="?", const=2, metavar="K", help="processes")
    add("--micro-batches", type=options.positive, default=4, help="pipeline micro-batches")
    add("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    add("--batch-size", type=options.positive, default=32, help="samples per step, all processes")
    add(
        "--resolution",
        type=options.positive,
        help="rows of image inputs (default: a benchmark's quick size, a file's declared one)",
    )
    add("--steps", type=options.positive, default=3, help="timed steps")
    add("--warmup", type=options.non_negative, default=1, help="untimed steps first")
    add("--threads", type=options.positive, default=1, help="torch threads per process")
    add(
        "--error-batch",
        type=options.positive,
        help="samples of the float64 gradient-error steps, the first of the batch (default: "
        "2 x --micro-batches, at most the batch)",
    )
    add("--seed", type=int, default=0, help="weights and batch seed")
    add("--models-dir", type=Path, help="the benchmark model files (default: the checkout's)")
    add("--out-dir", type=Path, help="results folder (default: benchmarks/results/)")
    return parser


def parse_args(argv: Sequence[str], prog: str) -> argparse.Namespace:
    """Parsed and checked flags (argparse exits 2 with one line on a bad one)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.pipeline is None and args.data_parallel is None:
        args.pipeline = 2
    args.schemes = options.choose(args.scheme, SCHEMES, SCHEMES, "scheme", parser)
    args.error_batch = args.error_batch or min(2 * args.micro_batches, args.batch_size)
    if args.error_batch > args.batch_size:
        parser.error(f"--error-batch {args.error_batch} > --batch-size {args.batch_size}")
    if args.pipeline and args.batch_size < args.micro_batches:
        parser.error(f"--batch-size {args.batch_size} < --micro-batches {args.micro_batches}")
    if args.pipeline and args.error_batch < args.micro_batches:
        parser.error(f"--error-batch {args.error_batch} < --micro-batches {args.micro_batches}")
    if args.data_parallel and args.batch_size % args.data_parallel:
        parser.error(
            f"--batch-size {args.batch_size} does not split into --data-parallel "
            f"{args.data_parallel} equal shards"
        )
    args.out_dir = args.out_dir or default_results_dir()
    return args


# -- what the processes run ------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every spawned process needs (picklable)."""

    folder: str
    schemes: tuple[str, ...]
    pipeline: int  # 0: no pipeline phase
    data_parallel: int  # 0: no data-parallel phase
    micro_batches: int
    schedule: str
    steps: int
    warmup: int
    threads: int

    @property
    def world(self) -> int:
        return max(self.pipeline, self.data_parallel)


def _module_path(folder: str | Path, scheme: str, variant: str) -> Path:
    return Path(folder) / f"{variant}_{scheme.replace('-', '_')}.py"


def load_model(folder: str | Path, scheme: str, variant: str, tag: str) -> torch.nn.Module:
    """The generated Model of ``variant`` (one, pipeline, dp) with the run's initial weights."""
    path = _module_path(folder, scheme, variant)
    module = load_file(path, f"scaling_{path.stem}_{tag}")
    model = module.Model()
    model.load_state_dict(torch.load(Path(folder) / "initial.pt"))
    model.train()
    return model


def timed_steps(
    warmup: int, steps: int, step: Callable[[], Any], before: Callable[[], None]
) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones; ``before`` runs
    untimed ahead of every step (resetting gradients, waiting for the other processes)."""
    seconds = []
    for i in range(warmup + steps):
        before()
        began = time.perf_counter()
        step()
        if i >= warmup:
            seconds.append(time.perf_counter() - began)
    return seconds


def _pipeline_phase(plan: Plan, scheme: str, rank: int, group: Any, batch: list) -> dict:
    """Stage ``rank`` of the scheme's pipeline: step seconds and the bytes it sent."""
    model = load_model(plan.folder, scheme, "pipeline", f"r{rank}")
    stage = PipelineStage(
        model,
        rank,
        micro_batches=plan.micro_batches,
        schedule_kind=plan.schedule,
        group=group,
        ranks=list(range(plan.pipeline)),
    )
    losses: list[float] = []

    def step() -> None:
        loss = stage.step(*batch)
        if loss is not None:
            losses.append(float(loss))

    def before() -> None:
        model.zero_grad(set_to_none=True)
        dist.barrier(group=group)

    seconds = timed_steps(plan.warmup, plan.steps, step, before)
    return {"seconds": seconds, "wire": stage.log.totals(), "loss": losses[-1] if losses else None}


def _allreduced_bytes(reducer: Any) -> int:
    """Bytes of the gradients the reducer's buckets held in the last step."""
    total = 0
    for names in reducer.buckets.values():
        for name in names:
            grad = reducer.params[name].grad
            total += 0 if grad is None else grad.numel() * grad.element_size()
    return total


def _data_parallel_phase(plan: Plan, scheme: str, rank: int, group: Any, batch: list) -> dict:
    """Shard ``rank`` of the scheme's data-parallel run: step and all-reduce seconds."""
    model = load_model(plan.folder, scheme, "dp", f"r{rank}")
    reducer = distributed.attach(model, group=group)
    n = batch[0].shape[0] // plan.data_parallel
    shard = [t[rank * n : (rank + 1) * n] for t in batch]
    blocked: list[float] = []

    def step() -> None:
        model(*shard)
        blocked.append(reducer.blocked_seconds)

    def before() -> None:
        model.zero_grad(set_to_none=True)
        dist.barrier(group=group)

    seconds = timed_steps(plan.warmup, plan.steps, step, before)
    found = distributed.overlap(reducer)
    blocked_s = statistics.median(blocked[plan.warmup :])
    alone = found["allreduce_seconds"]
    return {
        "seconds": seconds,
        "allreduce_s": alone,
        "blocked_s": blocked_s,
        "hidden_fraction": max(0.0, min(1.0, 1 - blocked_s / alone)) if alone > 0 else 0.0,
        "buckets": int(found["buckets"]),
        "allreduced_bytes": _allreduced_bytes(reducer),
    }


def _group(members: int, world: int) -> Any:
    """The process group of ranks 0..members-1 (every rank must call this, in order)."""
    return None if members == world else dist.new_group(list(range(members)))


def worker(rank: int, plan: Plan) -> None:
    """One spawned process: every scheme's pipeline phase, then its data-parallel phase, on
    the ranks each uses (the others wait at a barrier); results to ``rank{R}.json``."""
    folder = Path(plan.folder)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder / 'store'}",
        rank=rank,
        world_size=plan.world,
        timeout=PROCESS_TIMEOUT,
    )
    torch.set_num_threads(plan.threads)
    batch = torch.load(folder / "batch.pt")
    phases = [
        ("pipeline", plan.pipeline, _pipeline_phase),
        ("dp", plan.data_parallel, _data_parallel_phase),
    ]
    groups = {kind: _group(k, plan.world) for kind, k, _ in phases if k}
    found: dict[str, dict] = {}
    for scheme in plan.schemes:
        for kind, members, run in phases:
            if members and rank < members:
                found[f"{kind}:{scheme}"] = run(plan, scheme, rank, groups[kind], batch)
            if members:
                dist.barrier()
    (folder / f"rank{rank}.json").write_text(json.dumps(found), encoding="utf-8")
    dist.destroy_process_group()


def spawn(plan: Plan) -> list[dict]:
    """Start ``plan.world`` processes, wait for them; each one's results, by rank."""
    mp.spawn(worker, args=(plan,), nprocs=plan.world, join=True)
    folder = Path(plan.folder)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(plan.world)]


# -- what the parent measures ----------------------------------------------------------------


def prepare(args: argparse.Namespace, work: Workload, folder: Path) -> list[Tensor]:
    """Write every generated module the run needs, the initial weights (the nocompress
    module's, seeded) and the batch to ``folder``; the batch."""
    variants = {"one": {}}
    if args.pipeline:
        variants["pipeline"] = {"pipeline": args.pipeline, "stage_starts": work.cut(args.pipeline)}
    if args.data_parallel:
        variants["dp"] = {"data_parallel": True}
    for scheme in dict.fromkeys([EXACT, *args.schemes]):
        for variant, extra in variants.items():
            write_source(_module_path(folder, scheme, variant), work.source(scheme, **extra))
    torch.manual_seed(args.seed)
    module = load_file(_module_path(folder, EXACT, "one"), f"scaling_init_{folder.name}")
    torch.save(module.Model().state_dict(), folder / "initial.pt")
    batch = work.make_batch(args.batch_size, args.seed)
    torch.save(batch, folder / "batch.pt")
    return batch


def time_one_process(args: argparse.Namespace, folder: Path, scheme: str, batch: list) -> dict:
    """The ordinary generated module of ``scheme`` on the whole batch in this process."""
    model = load_model(folder, scheme, "one", "parent")
    losses: list[float] = []
    seconds = timed_steps(
        args.warmup,
        args.steps,
        lambda: losses.append(float(model(*batch))),
        lambda: model.zero_grad(set_to_none=True),
    )
    return {"seconds": seconds, "loss": losses[-1]}


def _flat_grads(model: torch.nn.Module) -> Tensor:
    """Every parameter's gradient (zeros where none), in one float64 vector."""
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
        for p in model.parameters()
    ]
    return torch.cat(parts)


def _gradients(folder: Path, scheme: str, variant: str, batch: list, micro: int) -> Tensor:
    """The float64 gradients of one step of ``variant`` (one: the whole batch in one call;
    pipeline: run_local over ``micro`` micro-batches) from the initial weights."""
    model = load_model(folder, scheme, variant, "error").double()
    model.zero_grad(set_to_none=True)
    if variant == "pipeline":
        run_local(model, *batch, micro_batches=micro)
    else:
        model(*batch)
    return _flat_grads(model)


def rel_l2(got: Tensor, want: Tensor) -> float:
    return float((got - want).norm() / max(float(want.norm()), 1e-300))


def boundaries(folder: Path, scheme: str) -> list[dict[str, Any]]:
    """The values the scheme's pipeline sends between stages: the generator places the
    stage cuts per scheme (by the memory each stage keeps), so the cuts, and with them
    the bytes on the wire, can differ between schemes."""
    model = load_model(folder, scheme, "pipeline", "cuts")
    return [
        {
            "name": b.name,
            "source": b.source,
            "targets": list(b.targets),
            "shape": list(b.shape),
            "codec": None if b.codec is None else repr(b.codec),
        }
        for b in boundaries_of(model)
    ]


def gradient_errors(args: argparse.Namespace, folder: Path, batch: list) -> dict[str, dict]:
    """Per scheme, the relative gradient error against nocompress of the one-process step
    and (with --pipeline) of the pipeline, float64 on the first --error-batch samples.
    Each is a fresh model from the initial weights, nocompress included (its error is a
    check that the step is deterministic, not an assumption)."""
    small = [t[: args.error_batch] for t in batch]
    small = [t.double() if t.is_floating_point() else t for t in small]
    variants = ["one"] + (["pipeline"] if args.pipeline else [])
    exact = {v: _gradients(folder, EXACT, v, small, args.micro_batches) for v in variants}
    return {
        scheme: {
            v: rel_l2(_gradients(folder, scheme, v, small, args.micro_batches), exact[v])
            for v in variants
        }
        for scheme in args.schemes
    }


# -- rows ------------------------------------------------------------------------------------


def _slowest_per_step(ranks: list[dict]) -> list[float]:
    """Per step, the slowest rank's seconds."""
    return [max(steps) for steps in zip(*(r["seconds"] for r in ranks))]


def _timing(seconds: list[float], batch: int, one_ms: float | None) -> dict[str, Any]:
    ms = summary([s * 1e3 for s in seconds])
    return {
        "time_ms": ms,
        "samples_per_s": batch / (ms["median"] / 1e3),
        "speedup_vs_one_process": None if one_ms is None else one_ms / ms["median"],
    }


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def rows_for_scheme(
    args: argparse.Namespace, work: Workload, scheme: str, parent: dict, ranks: list[dict]
) -> list[dict[str, Any]]:
    """The scheme's records: one process, the pipeline, data parallel (those run), from
    what the parent measured (``parent``: one, errors, boundaries) and the ranks' results."""
    one, errors = parent["one"], parent["errors"]
    common = {
        "benchmark": work.name,
        "resolution": work.resolution,
        "batch": args.batch_size,
        "scheme": scheme,
        "threads_per_process": args.threads,
    }
    first = _timing(one["seconds"], args.batch_size, None)
    one_ms = first["time_ms"]["median"]
    rows = [
        {
            **common,
            "method": f"ours:{scheme}",
            "kind": "one-process",
            "processes": 1,
            **first,
            "speedup_vs_one_process": 1.0,
            "loss": one["loss"],
            "grad_error": errors["one"],
        }
    ]
    if args.pipeline:
        found = [r[f"pipeline:{scheme}"] for r in ranks[: args.pipeline]]
        wire = {k: sum(f["wire"][k] for f in found) for k in found[0]["wire"]}
        rows.append(
            {
                **common,
                "method": f"pipeline{args.pipeline}:{scheme}",
                "kind": "pipeline",
                "processes": args.pipeline,
                "micro_batches": args.micro_batches,
                "schedule": args.schedule,
                **_timing(_slowest_per_step(found), args.batch_size, one_ms),
                "loss": next(f["loss"] for f in reversed(found) if f["loss"] is not None),
                "wire": wire,
                "wire_vs_raw_forward": _ratio(wire["forward_bytes"], wire["raw_forward_bytes"]),
                "wire_vs_raw_backward": _ratio(wire["backward_bytes"], wire["raw_backward_bytes"]),
                "grad_error": errors["pipeline"],
                "grad_error_one_process": errors["one"],
                "boundaries": parent["boundaries"],
                "per_rank": found,
            }
        )
    if args.data_parallel:
        found = [r[f"dp:{scheme}"] for r in ranks[: args.data_parallel]]
        lead = found[0]
        rows.append(
            {
                **common,
                "method": f"dp{args.data_parallel}:{scheme}",
                "kind": "data-parallel",
                "processes": args.data_parallel,
                **_timing(_slowest_per_step(found), args.batch_size, one_ms),
                **{k: lead[k] for k in ("allreduce_s", "blocked_s", "hidden_fraction")},
                "buckets": lead["buckets"],
                "allreduced_bytes": lead["allreduced_bytes"],
                "per_rank": found,
            }
        )
    return rows


# -- the report ------------------------------------------------------------------------------


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _wire_cells(rec: dict) -> str:
    wire = rec.get("wire")
    if not wire:
        return "| | "
    return (
        f"| {wire['forward_bytes'] / MIB:.2f} / {wire['backward_bytes'] / MIB:.2f} "
        f"| {_cell(rec['wire_vs_raw_forward'], '.3f')} / "
        f"{_cell(rec['wire_vs_raw_backward'], '.3f')} "
    )


def _allreduce_cells(rec: dict) -> str:
    if rec["kind"] != "data-parallel":
        return "| | | "
    return (
        f"| {rec['allreduce_s'] * 1e3:.1f} / {rec['blocked_s'] * 1e3:.1f} "
        f"| {rec['hidden_fraction']:.2f} | {rec['allreduced_bytes'] / MIB:.2f} "
    )


def table(records: list[dict]) -> list[str]:
    """The Markdown table, one line per record."""
    lines = [
        "| method | processes | step ms median (p10/p90) | samples/s | speed-up vs 1 process "
        "| wire MiB/step fwd / bwd | wire vs raw fwd / bwd | grad rel. error vs nocompress "
        "| all-reduce ms alone / blocked | hidden | all-reduced MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        t = rec["time_ms"]
        error = rec.get("grad_error")
        lines.append(
            f"| {rec['method']} | {rec['processes']} "
            f"| {t['median']:.1f} ({t['p10']:.1f}/{t['p90']:.1f}) "
            f"| {rec['samples_per_s']:.2f} | {rec['speedup_vs_one_process']:.2f} "
            f"{_wire_cells(rec)}| {'' if error is None else f'{error:.2e}'} "
            f"{_allreduce_cells(rec)}|"
        )
    return lines


def _about(args: argparse.Namespace, meta: dict) -> list[str]:
    """The lines above the table: what ran where, and how loaded the machine was."""
    load, cores = meta.get("loadavg_start"), meta.get("cpu_count")
    most = max(args.pipeline or 0, args.data_parallel or 0) * args.threads
    lines = [
        f"{most} threads at most at once ({args.threads} per process) on {cores} logical CPUs; "
        f"load average (1/5/15 min) at the start {load}, at the end {meta.get('loadavg_end')}"
    ]
    if load and cores and load[0] >= 0.5 * cores:
        lines.append(
            "the machine was busy with other jobs during the run: the timings and speed-ups "
            "are those of a loaded machine, not of idle cores"
        )
    if args.pipeline:
        lines.append(
            f"pipeline: {args.pipeline} stages, {args.micro_batches} micro-batches, "
            f"{args.schedule} schedule; gradient errors in float64 on {args.error_batch} samples"
        )
    return lines


def _cuts(records: list[dict]) -> list[str]:
    """Per pipeline row, the values that cross its stage cuts (name, shape, codec)."""
    lines = []
    for rec in records:
        if rec.get("boundaries") is None:
            continue
        crossing = "; ".join(
            f"`{b['name']}` {'x'.join(map(str, b['shape']))} stage {b['source']} -> "
            f"{','.join(map(str, b['targets']))}, {b['codec'] or 'raw'}"
            for b in rec["boundaries"]
        )
        lines.append(f"- {rec['method']} sends per sample: {crossing}")
    if not lines:
        return []
    return [
        "",
        "Values crossing the stage cuts (every scheme is cut where nocompress is):",
        "",
        *lines,
    ]


def markdown(meta: dict, records: list[dict], args: argparse.Namespace) -> str:
    """scaling.md: title, context, the table, what each column measures, the machine."""
    first = records[0]
    title = f"{first['benchmark']} batch {first['batch']} at {first['resolution']}"
    lines = [f"## unroller scaling benchmark: {title}, CPU, gloo", ""]
    lines += [f"- {line}" for line in _about(args, meta)]
    lines += ["", *table(records), *_cuts(records), "", "### What each column measures", ""]
    lines += [f"- {k}: {v}" for k, v in METHODS.items()]
    lines += ["", "### Machine", ""]
    for key in ("date", "cpu_model", "machine", "platform", "cpu_count", "python", "torch"):
        lines.append(f"- {key}: {meta[key]}")
    lines.append(f"- command: `{meta['command']}`")
    lines.append(f"- wall time: {meta['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


# -- the preset ------------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Workload) -> list[dict[str, Any]]:
    """Every measurement of the run, as records (one-process rows first per scheme)."""
    with tempfile.TemporaryDirectory(prefix="unroller-scaling-") as tmp:
        folder = Path(tmp)
        batch = prepare(args, work, folder)
        errors = gradient_errors(args, folder, batch)
        parent = {
            s: {
                "one": time_one_process(args, folder, s, batch),
                "errors": errors[s],
                "boundaries": boundaries(folder, s) if args.pipeline else None,
            }
            for s in args.schemes
        }
        plan = Plan(
            str(folder),
            tuple(args.schemes),
            args.pipeline or 0,
            args.data_parallel or 0,
            args.micro_batches,
            args.schedule,
            args.steps,
            args.warmup,
            args.threads,
        )
        ranks = spawn(plan)
    records = []
    for scheme in args.schemes:
        records += rows_for_scheme(args, work, scheme, parent[scheme], ranks)
    return records


def main(argv: Sequence[str], prog: str = "unroll bench scaling") -> int:
    """Run the scaling preset on ``argv``; 0, or 2 (one line on stderr) when it cannot start."""
    argv = list(argv)
    args = parse_args(argv, prog)
    try:
        work = workload(args.benchmark, args.resolution, args.models_dir)
    except (ValueError, ModelsNotFound) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    meta = machine.describe(prog, argv)
    try:
        records = run(args, work)
    finally:
        torch.set_num_threads(threads)
    meta["args"] = {
        k: machine.shown_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()
    }
    meta["methods"] = METHODS
    meta["wall_s"] = time.perf_counter() - started
    meta["loadavg_end"] = machine.loadavg()
    text = markdown(meta, records, args)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jsonl, md = (args.out_dir / name for name in FILES)
    output.write_jsonl(jsonl, meta, records, [])
    md.write_text(text, encoding="utf-8")
    print(f"wrote {jsonl} and {md} ({meta['wall_s']:.0f} s)")
    return 0
