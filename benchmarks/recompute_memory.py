"""What ``--recompute`` buys in memory, per benchmark model and scheme, at the published sizes.

For each model at its paper batch and native resolution (``unroller.bench.reference``), and
each scheme, the memory model (``unroller.analysis.memory``, which predicts the CPU profiler's
measured step peak to 0.98-1.05x on the CNNs, with and without recompute: see
tests/compiler/test_recompute.py and tests/analysis/test_memory_plan.py) gives the stash kept for backward,
the step's peak and its floor, without and with ``--recompute``; and the peak's bytes per
sample (the slope of the line through the peaks at the batch and 8x it), whose ratio is
what recompute multiplies the max batch by when the budget is large against the fixed part.

    python -m benchmarks.recompute_memory [--out benchmarks/results/recompute_memory.md]

Predictions, not measurements: ``make bench`` measures the same rows
(``ours:SCHEME+recompute``) at the quick sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unroller.api import simulate, write_atomic
from unroller.bench.config import PUBLISHED
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.options import Options

MIB = 2**20
SCHEMES = ("nocompress", "quant", "dct-dense")
LARGE = 8  # the peak per sample: the slope between the batch and LARGE x the batch


def rows(models: list[str]) -> list[dict]:
    found = []
    for name in models:
        bench = BENCHMARKS[name]
        batch, resolution = bench.paper_batch, bench.native_resolution
        text = bench.model_text(resolution)
        for scheme in SCHEMES:
            row = {"model": name, "batch": batch, "resolution": resolution, "scheme": scheme}
            for recompute in (False, True):
                options = Options(scheme=scheme, resolution=resolution, recompute=recompute)
                sim = simulate(text, options, batch)
                large = simulate(text, options, LARGE * batch)
                row["recompute" if recompute else "plain"] = {
                    "stash_mib": sim.stash_bytes / MIB,
                    "peak_mib": sim.peak_bytes / MIB,
                    "floor_mib": sim.floor_bytes / MIB,
                    "per_sample_mib": (large.peak_bytes - sim.peak_bytes)
                    / ((LARGE - 1) * batch)
                    / MIB,
                }
            found.append(row)
    return found


def markdown(found: list[dict], command: str) -> str:
    lines = [
        "## What --recompute buys: the memory model at the published sizes",
        "",
        f"Command: `{command}`. Predicted by the memory model (unroller.analysis.memory), not "
        "measured; peak per sample = the slope through the predicted peaks at the batch and "
        f"{LARGE}x it; its ratio is the max-batch gain of recompute under a large budget.",
        "",
        "| model (batch @ res) | scheme | stash MiB | + recompute | step peak MiB "
        "| + recompute | floor MiB | + recompute | peak MiB / sample | + recompute | gain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in found:
        a, b = r["plain"], r["recompute"]
        gain = a["per_sample_mib"] / b["per_sample_mib"] if b["per_sample_mib"] else 0.0
        lines.append(
            f"| {r['model']} ({r['batch']} @ {r['resolution']}) | {r['scheme']} "
            f"| {a['stash_mib']:.1f} | {b['stash_mib']:.1f} "
            f"| {a['peak_mib']:.1f} | {b['peak_mib']:.1f} | {a['floor_mib']:.1f} "
            f"| {b['floor_mib']:.1f} | {a['per_sample_mib']:.2f} | {b['per_sample_mib']:.2f} "
            f"| {gain:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recompute_memory")
    parser.add_argument("--benchmark", default=",".join(PUBLISHED), help="comma list")
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.recompute_memory " + " ".join(argv or sys.argv[1:])
    text = markdown(rows([m.strip() for m in args.benchmark.split(",")]), command.strip())
    print(text, end="")
    if args.out:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
