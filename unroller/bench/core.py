"""The core preset: the generated unrolled training step against torch.autograd.

    unroll bench core [--models resnet_like,unet_like] [--batch-size 32] [--repeats 15]
        [--warmup 3] [--threads N] [--seed 0] [--out benchmarks/results/core_bench.json]

(``python -m benchmarks.core_bench`` runs the same.) For each benchmark model the
generated ``Model`` (through ``unroller.api.load_model_class``) and its ``torch.nn``
reference get the same weights (``load_state_dict``, strict, both ways) and the same
float32 batch at the native size. One train step is, for ours,
``model.zero_grad(set_to_none=True); loss = model(*batch)``; for autograd,
``ref.zero_grad(set_to_none=True); loss = ref(*batch)[0]; loss.backward()``.

Measured per model (``METHODS`` says exactly how; it is also written to the JSON):
time (interleaved rounds, median, p10, p90 per side, the median of the per-round ratios
ours / autograd); peak step memory of each side (profiler allocation events);
saved-for-backward bytes (autograd's counted with ``saved_tensors_hooks``, ours
predicted by ``unroller.analysis.report.graph_report``) and the bytes each side holds live when
its backward pass begins. The goals (time ratio <= 1.05, saved bytes and peak memory no
larger than autograd's) are printed as met / not met; nothing here asserts them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from unroller.analysis.report import graph_report
from unroller.api import load_graph, load_model_class
from unroller.bench import machine, options
from unroller.bench.core_report import METHODS, format_markdown
from unroller.bench.paths import ModelsNotFound
from unroller.bench.profiling import BACKWARD_MARK, SEED_OP, profile_step
from unroller.bench.reference import Benchmark
from unroller.bench.saved import count_autograd_saved
from unroller.bench.steps import step_autograd, step_ours
from unroller.bench.timing import time_pair

DEFAULT_MODELS = ("resnet_like", "unet_like")
OUT_NAME = "core_bench.json"
TIME_RATIO_GOAL = 1.05


def parse_args(argv: Sequence[str] | None, prog: str = "unroll bench core") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time and memory of the generated unrolled step against torch.autograd.",
    )
    options.add_report_flags(parser, DEFAULT_MODELS, repeats=15, out_name=OUT_NAME)
    return options.finish_report_args(parser, parser.parse_args(argv), OUT_NAME)


def build_pair(bench: Benchmark, seed: int) -> tuple[nn.Module, nn.Module]:
    """The generated model and the reference at the native size, with the reference's
    default-initialised weights loaded into the generated one (strict, and checked back
    the other way)."""
    torch.manual_seed(seed)
    ref = bench.build()
    with tempfile.TemporaryDirectory(prefix="unroller-bench-") as tmp:
        ours = load_model_class(bench.path, None, Path(tmp))()
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


def bench_model(bench: Benchmark, args: argparse.Namespace) -> dict[str, Any]:
    """Time, memory, saved bytes and agreement of one model at ``--batch-size``."""
    ours, ref = build_pair(bench, args.seed)
    batch = bench.make_batch(args.batch_size, None, args.seed)
    check = check_agreement(ours, ref, batch)

    def run_ours() -> Tensor:
        return step_ours(ours, batch)

    def run_ref() -> Tensor:
        return step_autograd(ref, batch)

    pair = time_pair(run_ours, run_ref, args.warmup, args.repeats)
    timing = {"unit": "ms", "ours": pair["first"], "autograd": pair["second"]}
    timing["ratio"] = pair["ratio"]
    ours.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    mem_ours = profile_step(lambda: step_ours(ours, batch), SEED_OP)
    mem_ref = profile_step(lambda: step_autograd(ref, batch, mark=True), BACKWARD_MARK)
    saved_ref = count_autograd_saved(ref, batch)
    report = graph_report(load_graph(bench.path), args.batch_size)
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
        "model": bench.name,
        "model_file": bench.label,
        "batch_size": args.batch_size,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in ref.parameters()),
        "check": check,
        "time": timing,
        "memory": {"ours": mem_ours, "autograd": mem_ref},
        "saved": {"ours_predicted_bytes": saved_ours, "autograd_counted": saved_ref},
        "goals": goals,
    }


def main(argv: Sequence[str], prog: str = "unroll bench core") -> int:
    """Run the core preset on ``argv``; writes ``--out`` and prints the Markdown report."""
    argv = list(argv)
    args = parse_args(argv, prog)
    try:
        registry = options.benchmarks(args.models, args.models_dir)
    except ModelsNotFound as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meta = machine.describe(prog, argv)
    meta["args"] = {
        "models": args.models,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "seed": args.seed,
        "out": machine.shown_path(args.out),
    }
    results: dict[str, Any] = {"meta": meta, "methods": METHODS}
    results["models"] = [bench_model(registry[name], args) for name in args.models]
    print(format_markdown(results, TIME_RATIO_GOAL))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0
