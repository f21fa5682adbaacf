"""The core benchmark: the generated unrolled training step against torch.autograd.

    python -m benchmarks.core_bench [--models resnet_like,unet_like] [--batch-size 32]
        [--repeats 15] [--warmup 3] [--threads N] [--seed 0]
        [--out benchmarks/results/core_bench.json]

For each model file ``benchmarks/models/STEM.txt`` the generated ``Model`` (through
``unroller.api.load_model_class``) and the ``torch.nn`` module of
``benchmarks/reference.py`` get the same weights (``load_state_dict``, strict, both
ways) and the same float32 batch. One train step is, for ours,
``model.zero_grad(set_to_none=True); loss = model(*batch)``; for autograd,
``ref.zero_grad(set_to_none=True); loss = ref(*batch)[0]; loss.backward()``.

Measured per model (see ``METHODS`` for the exact procedures, also written to the JSON):

* time: ``--warmup`` rounds, then ``--repeats`` rounds of one step each side, the side
  that goes first alternating by round, each step timed with ``time.perf_counter``;
  median, p10, p90 per side and the median of the per-round ratios ours / autograd;
* peak step memory of each side, from the PyTorch profiler's CPU allocation events;
* saved-for-backward bytes: autograd's counted with ``saved_tensors_hooks``, ours
  predicted by ``unroller.report.graph_report``, plus the bytes each side holds live
  when its backward pass begins (from the same allocation trace).

The goals (time ratio <= 1.05, saved bytes and peak memory no larger than autograd's)
are printed as met / not met; nothing here asserts them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.reference import REFERENCES, make_batch, model_path
from unroller.api import load_graph, load_model_class
from unroller.report import graph_report

DEFAULT_MODELS = ("resnet_like", "unet_like")
DEFAULT_OUT = Path("benchmarks/results/core_bench.json")
MIB = 1024.0 * 1024.0
TIME_RATIO_GOAL = 1.05
BACKWARD_MARK = "core_bench::autograd_backward"
SEED_OP = "aten::ones_like"  # the generated step's seed gradient: torch.ones_like(loss)

METHODS = {
    "time": (
        "time.perf_counter around one whole train step (zero_grad + forward + backward; "
        "for autograd also loss.backward()); warm-up rounds first; then in each timed round "
        "one step per side, the first side alternating by round (even rounds: ours first); "
        "Python's garbage collector is disabled while timing; p10/p90 by linear "
        "interpolation between order statistics; ratio = median over rounds of "
        "ours/autograd within the round"
    ),
    "peak_memory": (
        "one extra step per side after timing, run under torch.profiler.profile(activities="
        "[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) with the "
        "gradients already None and no earlier step's tensors alive; every CPU "
        "allocation/free event of the trace (prof.profiler.kineto_results."
        "experimental_event_tree(), allocation events including those inside aten ops, "
        "e.g. mkldnn scratch buffers) is accumulated in time order; peak = the largest "
        "running total of bytes allocated since the step began (only the step's own "
        "allocations: parameters, buffers and the batch made before are not counted); "
        "retained = the running total at the end (the new .grad tensors and the loss)"
    ),
    "live_at_backward": (
        "the running total of the same allocation trace at the moment the backward pass "
        "begins: for autograd, the start of a record_function marker wrapping "
        "loss.backward(); for ours, the first aten::ones_like call (the generated step's "
        "seed gradient, torch.ones_like(loss)); null if that call is not found. It counts "
        "every tensor the step allocated that is alive then: saved tensors, outputs, "
        "the loss, not the parameters or the batch"
    ),
    "autograd_saved": (
        "torch.autograd.graph.saved_tensors_hooks active during the reference's forward; "
        "the pack hook records each saved tensor's untyped storage, each storage counted "
        "once (deduplicated by untyped_storage().data_ptr()) with its full nbytes; "
        "'with_params' counts everything, 'without_params' drops tensors that are "
        "nn.Parameters or share storage with one, 'without_params_and_buffers' also "
        "drops buffers (batch-norm running statistics, which native_batch_norm saves)"
    ),
    "ours_saved": (
        "predicted, not measured: unroller.report.graph_report(unroller.api.load_graph("
        "path), batch)['total_saved_bytes'] (activations the generated backward reads, "
        "each value once, parameters excluded)"
    ),
}


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core_bench",
        description="Time and memory of the generated unrolled step against torch.autograd.",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma-separated model stems of benchmarks/models/ (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per model")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per model")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and batch seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in REFERENCES]
    if unknown or not args.models:
        parser.error(f"unknown models {unknown}; known: {', '.join(sorted(REFERENCES))}")
    if args.batch_size < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch-size and --repeats must be >= 1, --warmup >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


# --------------------------------------------------------------------------- steps


def step_ours(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    model.zero_grad(set_to_none=True)
    return model(*batch)


def step_autograd(ref: nn.Module, batch: Sequence[Tensor], mark: bool = False) -> Tensor:
    ref.zero_grad(set_to_none=True)
    loss = ref(*batch)[0]
    if mark:
        with record_function(BACKWARD_MARK):
            loss.backward()
    else:
        loss.backward()
    return loss


def build_pair(stem: str, seed: int) -> tuple[nn.Module, nn.Module]:
    """The generated model and the reference, with the reference's default-initialised
    weights loaded into the generated one (strict, and checked back the other way)."""
    torch.manual_seed(seed)
    ref = REFERENCES[stem]()
    ours = load_model_class(model_path(stem))()
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.train()
    ref.train()
    return ours, ref


def rel_diff(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def check_agreement(ours: nn.Module, ref: nn.Module, batch: Sequence[Tensor]) -> dict[str, Any]:
    """One step each from the same state: the losses and the largest gradient difference."""
    loss_ours = step_ours(ours, batch)
    loss_ref = step_autograd(ref, batch)
    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, None
    for name, param in ours.named_parameters():
        want = ref_params[name].grad
        if param.grad is None or want is None:
            if (param.grad is None) != (want is None):
                worst, worst_name = float("inf"), name
            continue
        d = rel_diff(param.grad, want)
        if d > worst:
            worst, worst_name = d, name
    return {
        "loss_ours": float(loss_ours),
        "loss_autograd": float(loss_ref.detach()),
        "loss_rel_diff": rel_diff(loss_ours, loss_ref),
        "max_grad_rel_diff": worst,
        "max_grad_rel_diff_param": worst_name,
    }


# --------------------------------------------------------------------------- time


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1), linear interpolation between order statistics."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no samples")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(samples: Sequence[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "p10": percentile(samples, 0.1),
        "p90": percentile(samples, 0.9),
        "min": min(samples),
        "max": max(samples),
        "samples": list(samples),
    }


def time_steps(
    run_ours: Callable[[], Any], run_ref: Callable[[], Any], warmup: int, repeats: int
) -> dict[str, Any]:
    for _ in range(warmup):
        run_ours()
        run_ref()
    ours_ms: list[float] = []
    ref_ms: list[float] = []
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            order = ((run_ours, ours_ms), (run_ref, ref_ms))
            if r % 2:
                order = order[::-1]
            for fn, sink in order:
                t0 = time.perf_counter()
                fn()
                sink.append((time.perf_counter() - t0) * 1e3)
    finally:
        if was_enabled:
            gc.enable()
    ratios = [a / b for a, b in zip(ours_ms, ref_ms)]
    return {
        "unit": "ms",
        "ours": summary(ours_ms),
        "autograd": summary(ref_ms),
        "ratio": summary(ratios),
    }


# --------------------------------------------------------------------------- memory


def _allocation_trace(prof: profile) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """(time_ns, signed bytes) of every CPU allocation event in time order, and the first
    start time of each op name."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int]] = []
    first_start: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocs.append((event.start_time_ns, int(fields.alloc_size)))
        else:
            name = event.name
            t = event.start_time_ns
            if name not in first_start or t < first_start[name]:
                first_start[name] = t
        stack.extend(event.children)
    allocs.sort(key=lambda a: a[0])
    return allocs, first_start


def profile_step(run: Callable[[], Any], backward_mark: str) -> dict[str, Any]:
    """Peak, retained and live-at-backward bytes of one step, from the allocation trace."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as p:
        result = run()
    del result
    allocs, first_start = _allocation_trace(p)
    mark = first_start.get(backward_mark)
    running = peak = 0
    at_backward = None
    for t, size in allocs:
        if mark is not None and at_backward is None and t >= mark:
            at_backward = running
        running += size
        peak = max(peak, running)
    if mark is not None and at_backward is None:
        at_backward = running
    return {
        "peak_bytes": peak,
        "retained_bytes": running,
        "live_at_backward_bytes": at_backward,
        "allocation_events": len(allocs),
    }


def count_autograd_saved(ref: nn.Module, batch: Sequence[Tensor]) -> dict[str, Any]:
    """Bytes autograd saves for backward during one forward of ``ref``."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in ref.parameters()}
    buffer_ptrs = {b.untyped_storage().data_ptr() for b in ref.buffers()}
    input_ptrs = {t.untyped_storage().data_ptr() for t in batch}
    storages: dict[int, tuple[int, str]] = {}
    n_saved = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal n_saved
        n_saved += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if isinstance(t, nn.Parameter) or ptr in param_ptrs:
            kind = "param"
        elif ptr in buffer_ptrs:
            kind = "buffer"
        elif ptr in input_ptrs:
            kind = "batch"
        else:
            kind = "activation"
        if storage.nbytes() and ptr not in storages:
            storages[ptr] = (storage.nbytes(), kind)
        return t

    ref.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ref(*batch)[0]
    loss.backward()
    by_kind: dict[str, int] = {"param": 0, "buffer": 0, "batch": 0, "activation": 0}
    for nbytes, kind in storages.values():
        by_kind[kind] += nbytes
    total = sum(by_kind.values())
    return {
        "with_params_bytes": total,
        "without_params_bytes": total - by_kind["param"],
        "without_params_and_buffers_bytes": total - by_kind["param"] - by_kind["buffer"],
        "by_kind_bytes": by_kind,
        "saved_tensor_count": n_saved,
        "distinct_storages": len(storages),
    }


# --------------------------------------------------------------------------- one model


def bench_model(stem: str, args: argparse.Namespace) -> dict[str, Any]:
    ours, ref = build_pair(stem, args.seed)
    batch = make_batch(stem, args.batch_size, seed=args.seed)
    check = check_agreement(ours, ref, batch)

    def run_ours() -> Tensor:
        return step_ours(ours, batch)

    def run_ref() -> Tensor:
        return step_autograd(ref, batch)

    timing = time_steps(run_ours, run_ref, args.warmup, args.repeats)
    ours.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    mem_ours = profile_step(lambda: step_ours(ours, batch), SEED_OP)
    mem_ref = profile_step(lambda: step_autograd(ref, batch, mark=True), BACKWARD_MARK)
    saved_ref = count_autograd_saved(ref, batch)
    report = graph_report(load_graph(model_path(stem)), args.batch_size)
    saved_ours = int(report["total_saved_bytes"])

    ratio = timing["ratio"]["median"]
    goals = {
        "time_ratio": {
            "goal": f"median ratio ours/autograd <= {TIME_RATIO_GOAL}",
            "value": ratio,
            "met": ratio <= TIME_RATIO_GOAL,
        },
        "saved_bytes": {
            "goal": "ours (predicted) <= autograd (counted, without parameters)",
            "value": [saved_ours, saved_ref["without_params_bytes"]],
            "met": saved_ours <= saved_ref["without_params_bytes"],
        },
        "peak_memory": {
            "goal": "ours peak step memory <= autograd's",
            "value": [mem_ours["peak_bytes"], mem_ref["peak_bytes"]],
            "met": mem_ours["peak_bytes"] <= mem_ref["peak_bytes"],
        },
    }
    return {
        "model": stem,
        "model_file": f"benchmarks/models/{model_path(stem).name}",
        "batch_size": args.batch_size,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in ref.parameters()),
        "check": check,
        "time": timing,
        "memory": {"ours": mem_ours, "autograd": mem_ref},
        "saved": {"ours_predicted_bytes": saved_ours, "autograd_counted": saved_ref},
        "goals": goals,
    }


# --------------------------------------------------------------------------- output


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.2f}"


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def format_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "## core_bench: generated unrolled step vs torch.autograd (float32, CPU)",
        "",
        f"- date: {meta['date']}",
        f"- machine: processor {meta['processor']!r}, {meta['machine']}, "
        f"{meta['cpu_count']} CPUs, {meta['platform']}",
        f"- torch {meta['torch']}, torch.get_num_threads() = {meta['num_threads']}, "
        f"python {meta['python']}",
        f"- command: `{meta['command']}`",
        f"- warm-up rounds {meta['args']['warmup']}, timed rounds {meta['args']['repeats']}",
        "",
        "| model | batch | ours ms median | ours p10/p90 | autograd ms median "
        "| autograd p10/p90 | ratio median (p10/p90) | peak MiB ours / autograd "
        "| live at bwd MiB ours / autograd | saved MiB ours (pred.) / autograd (counted) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["models"]:
        t, m, s = r["time"], r["memory"], r["saved"]
        lines.append(
            f"| {r['model']} | {r['batch_size']} "
            f"| {t['ours']['median']:.1f} | {t['ours']['p10']:.1f}/{t['ours']['p90']:.1f} "
            f"| {t['autograd']['median']:.1f} "
            f"| {t['autograd']['p10']:.1f}/{t['autograd']['p90']:.1f} "
            f"| {t['ratio']['median']:.3f} ({t['ratio']['p10']:.3f}/{t['ratio']['p90']:.3f}) "
            f"| {_mib(m['ours']['peak_bytes'])} / {_mib(m['autograd']['peak_bytes'])} "
            f"| {_mib(m['ours']['live_at_backward_bytes'])} / "
            f"{_mib(m['autograd']['live_at_backward_bytes'])} "
            f"| {_mib(s['ours_predicted_bytes'])} / "
            f"{_mib(s['autograd_counted']['without_params_bytes'])} |"
        )
    lines += ["", "Goals (reported, never asserted):", ""]
    for r in results["models"]:
        g = r["goals"]
        lines.append(
            f"- {r['model']}: time ratio <= {TIME_RATIO_GOAL}: {_met(g['time_ratio']['met'])} "
            f"({g['time_ratio']['value']:.3f}); saved bytes ours <= autograd: "
            f"{_met(g['saved_bytes']['met'])}; peak memory ours <= autograd: "
            f"{_met(g['peak_memory']['met'])}"
        )
    lines += ["", "Checks and extra figures:", ""]
    for r in results["models"]:
        c, a = r["check"], r["saved"]["autograd_counted"]
        lines.append(
            f"- {r['model']}: loss ours {c['loss_ours']:.6g} / autograd {c['loss_autograd']:.6g} "
            f"(rel. diff {c['loss_rel_diff']:.2e}, max grad rel. diff "
            f"{c['max_grad_rel_diff']:.2e}); autograd saved MiB with params "
            f"{_mib(a['with_params_bytes'])}, without params and buffers "
            f"{_mib(a['without_params_and_buffers_bytes'])}; retained after the step MiB "
            f"ours {_mib(r['memory']['ours']['retained_bytes'])} / autograd "
            f"{_mib(r['memory']['autograd']['retained_bytes'])}; fastest step ms ours "
            f"{r['time']['ours']['min']:.1f} / autograd {r['time']['autograd']['min']:.1f}"
        )
    lines += ["", "Methods:", ""]
    lines += [f"- {k}: {v}" for k, v in METHODS.items()]
    return "\n".join(lines)


def machine_info(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "processor": platform.processor(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "command": shlex.join(["python", "-m", "benchmarks.core_bench", *argv]),
        "executable": sys.executable,
        "args": {
            "models": args.models,
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": args.threads,
            "seed": args.seed,
            "out": str(args.out),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"meta": machine_info(args, argv), "methods": METHODS}
    results["models"] = [bench_model(stem, args) for stem in args.models]
    print(format_markdown(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
