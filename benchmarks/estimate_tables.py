"""The estimator's tables for README "Scaling out": IPU and GPU, the four published models.

    python -m benchmarks.estimate_tables [--out benchmarks/results/estimate.md]

IPU: each model at its published batch (as the micro-batch) and native resolution, on 1
and 2 GC200s, per scheme: the most any IPU holds, what goes off chip, samples/s, and the
ratio to nocompress on one IPU, which is what the published figures compare (1.1-3.5x on
one IPU, 17-20x with two pipelined IPUs). Again at the streaming bandwidths 5 and 80 GB/s,
since that one is an assumption. GPU: the largest batch per scheme on an 80 GiB device.
Every figure is the model's (unroller/analysis/estimate.py), not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from unroller.analysis.estimate import IpuSpec, estimate_gpu, estimate_ipu, largest_on_chip
from unroller.analysis.estimate import samples_per_second as rate
from unroller.api import graph_from_text, write_atomic
from unroller.bench.config import PUBLISHED
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.graph import Graph
from unroller.compiler.options import Options

MIB = 2**20
SCHEMES = ("nocompress", "quant", "dct-dense")


def published() -> Iterator[tuple[str, int, int, Graph]]:
    """Each published model: name, paper batch, native resolution, graph there."""
    for name in PUBLISHED:
        bench = BENCHMARKS[name]
        res = bench.native_resolution
        yield name, bench.paper_batch, res, graph_from_text(bench.model_text(res), name)


def ipu_rows(spec: IpuSpec) -> list[str]:
    lines = [
        "| model (micro-batch @ res) | scheme | IPUs | most held by an IPU, MiB | off chip MiB "
        "| samples/s | vs nocompress on 1 IPU | largest on-chip micro-batch |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, batch, res, graph in published():
        base = None
        for scheme in SCHEMES:
            for ipus in (1, 2):
                options = Options(platform="ipu", scheme=scheme, num_ipus=ipus, resolution=res)
                est = estimate_ipu(graph, options, batch, ipus, spec)
                if base is None:
                    base = rate(est)
                held = max(s.total_bytes for s in est.stages) / MIB
                largest = largest_on_chip(graph, options, ipus, spec)
                lines.append(
                    f"| {name} ({batch} @ {res}) | {scheme} | {ipus} | {held:.0f} "
                    f"| {est.streaming_bytes / MIB:.0f} | {rate(est):.0f} "
                    f"| {rate(est) / base:.2f}x | {largest} |"
                )
    return lines


def sensitivity() -> list[str]:
    lines = [
        "| model | scheme, IPUs | vs nocompress on 1 IPU at 5 / 20 / 80 GB/s streaming |",
        "|---|---|---|",
    ]
    for name, batch, res, graph in published():
        for scheme, ipus in (("dct-dense", 1), ("dct-dense", 2)):
            ratios = []
            for bandwidth in (5e9, 20e9, 80e9):
                spec = IpuSpec(streaming_bandwidth=bandwidth)
                one = estimate_ipu(graph, Options(platform="ipu", resolution=res), batch, 1, spec)
                options = Options(platform="ipu", scheme=scheme, num_ipus=ipus, resolution=res)
                est = estimate_ipu(graph, options, batch, ipus, spec)
                ratios.append(f"{rate(est) / rate(one):.2f}x")
            lines.append(f"| {name} | {scheme}, {ipus} | {' / '.join(ratios)} |")
    return lines


def gpu_rows(device: int) -> list[str]:
    lines = [
        "| model (res) | scheme | max batch | vs nocompress | predicted total MiB there |",
        "|---|---|---:|---:|---:|",
    ]
    for name, _, res, graph in published():
        base = None
        for scheme in SCHEMES:
            est = estimate_gpu(graph, Options(scheme=scheme, resolution=res), device)
            base = base or est.max_batch or 1
            lines.append(
                f"| {name} ({res}) | {scheme} | {est.max_batch} | {est.max_batch / base:.2f}x "
                f"| {est.total_bytes / MIB:.0f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate_tables")
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args(argv)
    spec = IpuSpec()
    text = "\n".join(
        [
            "## unroll estimate: IPU (GC200) and GPU, the published models",
            "",
            "Command: `python -m benchmarks.estimate_tables`. Model figures, not measurements "
            f"(unroller/analysis/estimate.py): streaming {spec.streaming_bandwidth / 1e9:g} GB/s, compute "
            f"{spec.efficiency:g} x {spec.flops / 1e12:g} TFLOPS FP32, {spec.code_bytes // MIB} "
            "MiB per IPU for code and exchange, 8 micro-batches per pipelined step.",
            "",
            *ipu_rows(spec),
            "",
            "Sensitivity to the streaming bandwidth (the one figure not published):",
            "",
            *sensitivity(),
            "",
            "GPU, 80 GiB, SGD with momentum:",
            "",
            *gpu_rows(80 * 2**30),
            "",
        ]
    )
    print(text, end="")
    if args.out:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
