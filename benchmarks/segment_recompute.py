"""What segment recompute buys, measured: bytes per sample and step time on one model.

Rows: autograd on the torch.nn reference, ``torch.utils.checkpoint`` around each of its
stages (the reference's ``forward_checkpointed``: per transformer layer, per residual
block), and the generated step under nocompress and quant, each without segment recompute,
with ``--recompute-segments blocks``, and with it in K pieces of the batch
(``--segment-pieces K``, default 8: pieces of 1 sample at batch 8, 4 at batch 32). Per row: the measured peak of one step (the CPU
profiler's allocation events: the step's own allocations, gradients set to None before,
as ``make bench`` measures) at two batch sizes, the slope between them (bytes per sample:
what one more sample costs, whose ratio is the max-batch gain under a large budget), the
memory model's slope for the generated rows, and the median step time at the larger batch
with its ratio to autograd's (``--threads`` CPU threads; the methods take turns, one step
each per round, so a load that drifts reaches all of them; on a machine shared with other
jobs, read the times to one digit).

    python -m benchmarks.segment_recompute [--model gpt_tiny] [--batches 8,32]
        [--iterations 5] [--threads 1] [--pieces 8]
        [--out benchmarks/results/segment_recompute.md]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from unroller.analysis.memory import simulate_graph
from unroller.api import compression_config, graph_from_text, write_atomic
from unroller.bench.profiling import profile_step
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.options import Options

SCHEMES = ("nocompress", "quant")


def _peak(step: Callable[[], torch.Tensor], zero: Callable[[], None]) -> int:
    step()  # warm: allocator, codec constants
    zero()
    gc.collect()
    return profile_step(step, "")["peak_bytes"]


def _time(step: Callable[[], torch.Tensor], zero: Callable[[], None]) -> float:
    zero()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(name: str, batches: tuple[int, int], iterations: int, pieces: int = 8) -> list[dict]:
    """One row per method: peaks at both batches, slope, predicted slope, median time."""
    bench = BENCHMARKS[name]
    torch.manual_seed(0)
    ref = bench.build()
    data = {b: bench.make_batch(b) for b in batches}
    methods: list[tuple[str, Callable, torch.nn.Module, Options | None]] = [
        ("autograd", lambda m, batch: _autograd(m, batch, False), ref, None),
        ("checkpoint per block", lambda m, batch: _autograd(m, batch, True), ref, None),
    ]
    folder = Path(tempfile.mkdtemp(prefix="unroller-segments-"))
    graph = graph_from_text(bench.model_text(), bench.path.name)
    for scheme in SCHEMES:
        for segments, k in (((), 1), (("blocks",), 1), (("blocks",), pieces)):
            options = Options(scheme=scheme, recompute_segments=segments, segment_pieces=k)
            model = bench.model_class(options, folder / f"{scheme}{len(segments)}_{k}")()
            model.load_state_dict(ref.state_dict())
            model.train()
            label = f"ours {scheme}" + (" + block recompute" if segments else "")
            label += f" in {k} pieces" if k > 1 else ""
            methods.append((label, lambda m, batch: m(*batch), model, options))
    rows = []
    steps = {
        label: (functools.partial(run, module), functools.partial(module.zero_grad, True))
        for label, run, module, _ in methods
    }
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(iterations):  # round robin: a load that drifts reaches every method
        for label, (step, zero) in steps.items():
            times[label].append(_time(functools.partial(step, data[batches[1]]), zero))
    for label, _, _, options in methods:
        step, zero = steps[label]
        peaks = [_peak(functools.partial(step, data[b]), zero) for b in batches]
        seconds = statistics.median(times[label])
        predicted = None
        if options is not None:
            config = compression_config(options, graph)
            sims = [
                simulate_graph(graph, config, b, segment_pieces=options.segment_pieces).peak_bytes
                for b in batches
            ]
            predicted = (sims[1] - sims[0]) / (batches[1] - batches[0])
        slope = (peaks[1] - peaks[0]) / (batches[1] - batches[0])
        rows.append(
            {"method": label, "peaks": peaks, "slope": slope, "predicted": predicted, "s": seconds}
        )
    return rows


def _autograd(ref: torch.nn.Module, batch: list[torch.Tensor], checkpointed: bool):
    loss = (ref.forward_checkpointed if checkpointed else ref)(*batch)[0]
    loss.backward()
    return loss.detach()


def table(name: str, batches: tuple[int, int], threads: int, rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        f"{name}: measured step peak at batch {batches[0]} and {batches[1]}, bytes per sample "
        f"(slope), median step time at batch {batches[1]}, {threads} CPU thread(s)",
        "",
        f"| method | peak b{batches[0]} (KiB) | peak b{batches[1]} (KiB) | bytes/sample | "
        "vs autograd | model bytes/sample | step ms | time vs autograd |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        model = f"{r['predicted']:,.0f}" if r["predicted"] is not None else "-"
        lines.append(
            f"| {r['method']} | {r['peaks'][0] / 1024:,.0f} | {r['peaks'][1] / 1024:,.0f} | "
            f"{r['slope']:,.0f} | {r['slope'] / base['slope']:.2f}x | {model} | "
            f"{r['s'] * 1000:,.1f} | {r['s'] / base['s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt_tiny", choices=sorted(BENCHMARKS))
    parser.add_argument("--batches", default="8,32", help="two batch sizes, comma-separated")
    parser.add_argument("--iterations", type=int, default=5, help="timed steps per method")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--pieces", type=int, default=8, help="the pieces rows' K")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    small, large = (int(b) for b in args.batches.split(","))
    torch.set_num_threads(args.threads)
    rows = measure(args.model, (small, large), args.iterations, args.pieces)
    text = table(args.model, (small, large), args.threads, rows)
    sys.stdout.write(text)
    if args.out is not None:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
