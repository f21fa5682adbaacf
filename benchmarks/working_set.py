"""How far can any plan go? The least working set per sample over every plan the generator
can make, against autograd's measured bytes per sample.

Per benchmark of one or more ``benchmarks.run`` results: autograd's measured bytes per
sample (the slope of its step peak between the run's two batches, at the run's resolution),
and, from the memory model, each fixed plan's working set per sample with its stash counted
as free (``unroller.analysis.working_set``: no choice of forms for that structure keeps
less), over every structure the ``auto`` search has (``search.fixed_plans``: --recompute,
segments of every kind, pieces, selective keeps) with no time limit. The least of these,
divided into autograd's bytes per sample, is the most "times less than autograd" any plan
of these moves can reach on that model at those batches, whatever its time or error.

    python -m benchmarks.working_set benchmarks/results/auto_search_cnn \\
        --out benchmarks/results/working_set.md
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.auto_goal import _per_sample, _rows


def bounds(name: str, resolution: int, batches: tuple[int, int]) -> list[tuple[str, object]]:
    """Every fixed plan's working-set bound for benchmark ``name``, least first."""
    from unroller.analysis.search import fixed_plans
    from unroller.analysis.working_set import working_set_bound
    from unroller.bench.reference import BENCHMARKS
    from unroller.load import graph_from_text

    bench = BENCHMARKS[name]
    graph = graph_from_text(bench.model_text(resolution), str(bench.path), resolution, "fp32")
    found = [
        (label, working_set_bound(graph, config, batches))
        for label, config in fixed_plans(graph, batches[1])
    ]
    return sorted(found, key=lambda item: item[1].per_sample)


def table(runs: list[Path], goals: dict[str, float]) -> list[str]:
    lines = [
        "| benchmark | resolution, batches | autograd bytes/sample (measured) | least working set "
        "per sample (plan; statement) | at most less than autograd | that plan's predicted "
        "bytes/sample | goal | reachable |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for run in runs:
        _, rows = _rows(run)
        for name, methods in rows.items():
            autograd = methods.get("autograd")
            per_sample = _per_sample(autograd) if autograd else None
            if per_sample is None:
                continue
            batches = tuple(autograd["per_sample"]["batches"])
            resolution = autograd["resolution"]
            label, bound = bounds(name, resolution, batches)[0]
            most = per_sample / bound.per_sample
            goal = goals.get(name)
            verdict = "-" if goal is None else ("yes" if most >= goal else "no")
            lines.append(
                f"| {name} | {resolution}, {batches[0]} -> {batches[1]} | {per_sample:,.0f} | "
                f"{bound.per_sample:,.0f} ({label}; {bound.section} of `{_short(bound.at)}`) | "
                f"{most:.1f}x | {bound.plan_per_sample:,.0f} | "
                f"{'-' if goal is None else f'{goal:g}x'} | {verdict} |"
            )
    return lines


def _short(statement: str) -> str:
    return statement.split(" = ")[0].replace("|", "/")


GOALS = {"resnet34": 12.0, "mobilenet_v2": 8.0, "emdenoise": 8.0, "slstrcloud": 8.0}
GOALS["opticaldamage"] = 8.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.working_set")
    parser.add_argument("runs", nargs="+", type=Path, help="benchmarks.run result folders")
    parser.add_argument("--out", type=Path, default=None, help="write the table here")
    args = parser.parse_args(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    runs = " ".join(str(r) for r in args.runs)
    out = f" --out {args.out}" if args.out else ""
    lines = [
        "# The least working set per sample any plan can reach",
        "",
        f"Command: `python -m benchmarks.working_set {runs}{out}` "
        f"({datetime.now(timezone.utc).isoformat(timespec='seconds')}). Autograd's bytes per "
        "sample are measured (the runs' per-sample slopes); the working sets are the memory "
        "model's, per plan with its stash counted as free, over every structure the `auto` "
        "search has and the forms none, quant and dct-dense, without a time limit: the "
        "least of them bounds what any plan of these moves keeps per sample. Goals: the "
        "project's CNN goals (12x less than autograd for ResNet-34, 8x for mobilenet_v2 "
        "and the U-Nets).",
        "",
        *table(list(args.runs), GOALS),
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
