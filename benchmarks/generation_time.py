"""How generation time grows with the model: parse, graph, emit and black, per size.

    python -m benchmarks.generation_time [--sizes 250,1000,4000] [--scheme dct-dense]
        [--out benchmarks/results/generation_time.json]

The model is a synthetic chain of N statements cycling conv2d / batchnorm2d / relu on a
[N, 4, 8, 8] input (the statement kinds that make the most code), then pooling, a
linear layer and a cross-entropy loss. Each size is generated once in a fresh process
state (same process, sizes in increasing order); the phases are timed with
``time.perf_counter``: front end (parse + graph), emitter (step program, template), and
black. Per-statement times that stay flat as N grows mean generation is linear.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import black

from unroller.api import graph_from_text, render_graph
from unroller.compiler import codegen
from unroller.compiler.options import Options

OPS = (
    "relu({prev})",
    "batchnorm2d({prev})",
    "conv2d({prev}, out_channels=4, kernel_size=3, padding=1)",
)


def chain_model(statements: int) -> str:
    lines = [
        "model chain {",
        "    input x: f32[N, 4, 8, 8]",
        "    target y: i64[N]",
        "    a0 = conv2d(x, out_channels=4, kernel_size=3, padding=1)",
    ]
    for i in range(1, statements):
        lines.append(f"    a{i} = " + OPS[i % 3].format(prev=f"a{i - 1}"))
    lines += [
        f"    p = adaptive_avgpool2d(a{statements - 1}, output_size=1)",
        "    f = flatten(p)",
        "    fc = linear(f, out_features=3)",
        "    loss = cross_entropy(fc, y)",
        "    return loss, fc",
        "}",
    ]
    return "\n".join(lines) + "\n"


def measure(statements: int, scheme: str) -> dict:
    text = chain_model(statements)
    spent = {"black": 0.0}
    original = black.format_str

    def timed_black(source: str, *, mode: black.Mode) -> str:
        start = time.perf_counter()
        try:
            return original(source, mode=mode)
        finally:
            spent["black"] += time.perf_counter() - start

    codegen.black.format_str = timed_black
    try:
        start = time.perf_counter()
        graph = graph_from_text(text, "chain.txt")
        front = time.perf_counter() - start
        start = time.perf_counter()
        source = render_graph(graph, "chain.txt", Options(scheme=scheme))
        emit_total = time.perf_counter() - start
    finally:
        codegen.black.format_str = original
    total = front + emit_total
    return {
        "statements": statements,
        "lines": source.count("\n"),
        "front_end_s": round(front, 3),
        "emitter_s": round(emit_total - spent["black"], 3),
        "black_s": round(spent["black"], 3),
        "total_s": round(total, 3),
        "ms_per_statement": round(1000 * total / statements, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="250,1000,4000")
    parser.add_argument("--scheme", default="dct-dense")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [measure(int(n), args.scheme) for n in args.sizes.split(",")]
    header = "| statements | lines | front end s | emitter s | black s | total s | ms/statement |"
    print(header)
    print("|" + "---|" * 7)
    for r in rows:
        print(
            f"| {r['statements']} | {r['lines']} | {r['front_end_s']} | {r['emitter_s']} | "
            f"{r['black_s']} | {r['total_s']} | {r['ms_per_statement']} |"
        )
    if args.out:
        command = (
            f"python -m benchmarks.generation_time --sizes {args.sizes} --scheme {args.scheme}"
        )
        args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
