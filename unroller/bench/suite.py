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

from unroller.bench import (  # noqa: E402
    budget,
    config,
    goals,
    machine,
    measure,
    models,
    options,
    output,
    peers,
    plots,
)
from unroller.bench.paths import ModelsNotFound  # noqa: E402
from unroller.bench.peers import STASH_METHODS, Method  # noqa: E402
from unroller.bench.timing import time_interleaved  # noqa: E402
from unroller.codegen import Options  # noqa: E402
from unroller.runtime import ipu_device  # noqa: E402

EMULATION_NOTE = (
    "IPU platform under the CPU EMULATION of PopTorch: 'ours' times are CPU-emulation "
    "timings of the poptorch.trainingModel call, not IPU timings; the peers run on the "
    "host CPU"
)


def _methods(
    bench: Any,
    args: argparse.Namespace,
    resolution: int,
    ref: torch.nn.Module,
    device: torch.device,
    directory: Path,
) -> list[Method]:
    found = []
    for scheme in args.schemes:
        options = Options(
            platform=args.platform, scheme=scheme, num_ipus=args.num_ipus, resolution=resolution
        )
        model = models.build_ours(bench, options, ref, device, directory)
        if args.platform == "ipu":
            found.append(peers.ours_ipu(scheme, model, ipu_device.poptorch, args))
        else:
            found.append(peers.ours_gpu(scheme, model))
    found.append(peers.autograd(ref))
    if hasattr(ref, "forward_checkpointed"):
        found.append(peers.checkpointed(ref))
    found += [peers.hooks(s, ref) for s in args.schemes if s in config.HOOK_SCHEMES]
    return found


class _Phases:
    """Wall seconds per phase of one benchmark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 2)
        self._last = now


def _max_batches(
    methods: list[Method],
    args: argparse.Namespace,
    make_batch: Callable[[int], list[torch.Tensor]],
    device: torch.device,
    batch_size: int,
    granularity: int,
    memory: dict[str, dict | None],
    note: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """budget.search per method under the run's budget ('auto': from autograd's line).
    The probes default to the run's batch (whose peak the memory phase measured) and
    twice it."""
    probes = args.probe_batches or (batch_size, 2 * batch_size)
    probes = tuple(-(-n // granularity) * granularity for n in probes)
    fits = {}
    for m in sorted(methods, key=lambda m: m.name != "autograd"):
        known = {batch_size: memory[m.name]["total_peak_bytes"]} if memory[m.name] else None
        note(f"max batch, {m.name}: probes {probes[0]}, {probes[1]}")
        fits[m.name] = budget.probe_fit(m, make_batch, probes, device, known)
    limit = args.memory_budget
    if limit == config.AUTO:
        limit = budget.auto_budget(fits["autograd"], batch_size, args.preset.budget_factor)
    return {
        m.name: budget.search(
            m,
            make_batch,
            limit,
            fits[m.name],
            device,
            granularity,
            progress=lambda what: note(f"max batch, {what}"),
        )
        for m in methods
    }


def bench_one(
    bench: Any, args: argparse.Namespace, device: torch.device, bar: output.Bar
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records of every method on one benchmark, and what was run (sizes, seconds)."""
    phases = _Phases()
    resolution = models.resolution_of(bench, args)
    batch_size = models.batch_of(bench, args)
    granularity, device_batch = 1, None
    if args.platform == "ipu":
        device_batch, batch_size = config.ipu_batch(args, batch_size)
        granularity = args.replication_factor * config.ipu_accumulation(args.num_ipus)
    label = f"{bench.name} b{batch_size}@{resolution}"
    bar.note(f"{label}: generating")
    ref = models.build_reference(bench, resolution, args.seed, device)

    def make_batch(n: int) -> list[torch.Tensor]:
        return models.batch_on(bench, n, resolution, args.seed, device)

    with tempfile.TemporaryDirectory(prefix="unroller-bench-") as tmp:
        methods = _methods(bench, args, resolution, ref, device, Path(tmp))
    names = [m.name for m in methods]
    searching = args.memory_budget is not None
    bar.add(args.warmup + args.iterations + len(methods) * (1 + args.get_memory + searching))
    batch = make_batch(batch_size)
    phases.done("generate")

    timing = time_interleaved(
        {m.name: partial(m.step, batch) for m in methods},
        args.warmup,
        args.iterations,
        "autograd",
        device,
        on_round=lambda r: bar.advance(f"{label}: timing round {r}"),
    )
    phases.done("time")
    stash = {}
    for m in methods:  # before the memory phase: ours' first stash finds its backward mark
        stash[m.name] = m.stash(batch)
        bar.advance(f"{label}: stash {m.name}")
    phases.done("stash")
    memory: dict[str, dict | None] = dict.fromkeys(names)
    if args.get_memory:
        for m in methods:
            memory[m.name] = measure.peak_step(m, batch, device)
            bar.advance(f"{label}: peak memory {m.name}")
        phases.done("memory")
    del batch

    searched: dict[str, dict | None] = dict.fromkeys(names)
    if searching:
        searched.update(
            _max_batches(
                methods,
                args,
                make_batch,
                device,
                batch_size,
                granularity,
                memory,
                lambda what: bar.note(f"{label}: {what}"),
            )
        )
        bar.advance(f"{label}: max batch", len(methods))
        phases.done("max_batch")

    base_peak = (memory["autograd"] or {}).get("step_peak_bytes")
    base_batch = (searched["autograd"] or {}).get("max_batch")
    records = []
    for m in methods:
        t, mem, mb = timing[m.name], memory[m.name], searched[m.name]
        records.append(
            {
                "benchmark": bench.name,
                "method": m.name,
                "kind": m.kind,
                "scheme": m.scheme,
                "platform": args.platform,
                "device": (
                    "ipu"
                    if m.kind == "ours" and args.platform == "ipu" and not args.emulate
                    else device.type
                ),
                "emulated": bool(args.platform == "ipu" and args.emulate),
                "batch": batch_size,
                "resolution": resolution,
                "time_ms": t["time_ms"],
                "time_ratio": t["ratio"],
                "samples_per_s": batch_size / (t["time_ms"]["median"] / 1e3),
                "loss": t["loss"],
                "stash": stash[m.name],
                "memory": mem,
                "peak_ratio_vs_autograd": (
                    mem["step_peak_bytes"] / base_peak if mem and base_peak else None
                ),
                "max_batch": mb,
                "max_batch_ratio_vs_autograd": (
                    mb["max_batch"] / base_batch if mb and base_batch else None
                ),
                "notes": m.notes,
            }
        )
    info = {
        "benchmark": bench.name,
        "batch": batch_size,
        "resolution": resolution,
        "ipu_device_batch": device_batch,
        "methods": names,
        "phase_seconds": phases.seconds,
    }
    return records, info


def _meta(args: argparse.Namespace, argv: Sequence[str], prog: str) -> dict[str, Any]:
    meta = machine.describe(prog, argv)
    meta["args"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "preset"
    }
    meta["args"]["preset"] = "full" if args.full else "quick"
    how = "cuda" if args.device == "cuda" else "cpu"
    if args.platform == "ipu":
        where = "CPU EMULATION of PopTorch" if args.emulate else "PopTorch"
        where += f", {args.num_ipus} IPU(s) x {args.replication_factor} replica(s)"
    else:
        where = f"device {args.device}"
    meta["title"] = f"platform {args.platform} ({where}), {meta['args']['preset']} preset"
    meta["about"] = [
        f"peak memory: {measure.MEMORY_SHORT[how]}; time: {args.iterations} rounds after "
        f"{args.warmup} warm-up, methods interleaved, same weights and batch"
    ]
    if args.platform == "ipu" and args.emulate:
        meta["about"].insert(0, EMULATION_NOTE)
        if args.profile:
            meta["about"].append("--profile: the emulation writes no PopVision report")
    parts = args.replication_factor * config.ipu_accumulation(args.num_ipus)
    if args.platform == "ipu" and parts > 1:
        meta["about"].append(
            f"ours splits each batch into {parts} micro-batches (replicas x gradient "
            "accumulation) run one after another, so its peak follows the micro-batch; the "
            "peers take the whole batch at once"
        )
    elif args.platform == "ipu":
        meta["about"].append(
            "on the IPU the host measures no device memory: no peak or max batch here; "
            "--profile DIR writes PopVision's memory report"
        )
    meta["methods"] = {
        "time": measure.TIME_METHOD,
        "peak_memory": measure.MEMORY_METHODS[how],
        **{f"stash_{k}": v for k, v in STASH_METHODS.items()},
        "max_batch": budget.METHOD,
        "auto_budget": (
            "autograd's predicted total peak at "
            f"{args.preset.budget_factor:g} x the run's batch, rounded up to a MiB"
        ),
        **{f"method_{k}": v for k, v in peers.METHODS.items()},
    }
    return meta


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
    if args.platform != "ipu":
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
    try:
        with output.progress_bar(console, args.progress) as bar:
            for name in args.benchmarks:
                found, info = bench_one(registry[name], args, device, bar)
                records += found
                ran.append(info)
    finally:
        if args.platform == "ipu" and args.emulate:
            ipu_device.use_emulation(False)
    found = goals.evaluate(records)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    prefix = "bench" if args.platform == "gpu" else "bench_ipu"
    files = [out / f"{prefix}.jsonl", out / f"{prefix}.csv", out / f"{prefix}.md"]
    if args.plots:
        files += plots.write_all(records, out, prefix)
    meta = _meta(args, argv, prog)
    meta["wall_s"] = time.perf_counter() - started
    meta["benchmarks"] = ran
    output.write_jsonl(files[0], meta, records, found)
    output.write_csv(files[1], records)
    files[2].write_text(output.markdown(meta, records, found), encoding="utf-8")
    output.print_summary(console, meta, records, found, files)
    return 0
