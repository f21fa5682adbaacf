"""The headline table: bytes each extra sample costs, ours against what users pick instead.

Read from a benchmark run's ``bench.jsonl`` (``python -m benchmarks.run ... --out-dir
DIR``): per network, autograd's step-peak slope between two batch sizes (MiB per sample),
and how many times less the best of ours keeps at a step time within ``--time-limit`` of
autograd's, against activation checkpointing (``torch.utils.checkpoint`` per block) and
the best hook-based compressor (``saved_tensors_hooks``) at any time. Written to
``DIR/headline.md`` with the command that measured the run, so README quotes it through
``benchmarks.doc_tables`` and never by hand.

    python -m benchmarks.headline benchmarks/results/per_sample
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIB = 2**20


def _runs(path: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    meta = next(r for r in rows if r.get("type") == "meta")
    return meta, [r for r in rows if r.get("type") == "run"]


def _slope(run: dict) -> float | None:
    found = (run.get("per_sample") or {}).get("bytes_per_sample")
    return float(found) if found else None


def _time(run: dict) -> float:
    return float(run["time_ratio"]["median"])


def _best(runs: list[dict], limit: float | None) -> dict | None:
    """The run keeping the fewest bytes per sample (within the time limit, if any)."""
    fit = [r for r in runs if _slope(r) and (limit is None or _time(r) <= limit)]
    return min(fit, key=_slope, default=None)


def _cell(run: dict | None, autograd: float) -> str:
    if run is None:
        return "n/a"
    return f"{autograd / _slope(run):.1f}x less at {_time(run):.2f}x time (`{run['method']}`)"


def headline(path: Path, limit: float = 1.3) -> str:
    """The table for the run in ``path`` (a bench.jsonl), with its command."""
    meta, runs = _runs(path)
    lines = [
        "| network | autograd, MiB per sample | ours, best at <= "
        f"{limit:g}x autograd's time | activation checkpointing | best hook compressor |",
        "|---|---:|---|---|---|",
    ]
    for name in dict.fromkeys(r["benchmark"] for r in runs):
        mine = [r for r in runs if r["benchmark"] == name]
        autograd = next((r for r in mine if r["kind"] == "autograd"), None)
        if autograd is None or not _slope(autograd):
            continue
        base = _slope(autograd)
        ours = _best([r for r in mine if r["kind"] == "ours"], limit)
        checkpoint = _best([r for r in mine if r["kind"] == "checkpoint"], None)
        hooks = _best([r for r in mine if r["kind"] == "hooks"], None)
        cells = (name, f"{base / MIB:.3f}", *(_cell(r, base) for r in (ours, checkpoint, hooks)))
        lines.append("| " + " | ".join(cells) + " |")
    batches = next((r["per_sample"]["batches"] for r in runs if r.get("per_sample")), [])
    lines += [
        "",
        (
            f"Bytes per sample: the step peak's slope between batch {batches[0]} and {batches[-1]}"
            if len(batches) > 1
            else "Bytes per sample: the step peak's slope between two batches"
        ),
        f"({meta.get('cpu_model') or meta.get('machine')}, {meta.get('cpu_count')} CPUs, "
        f"torch {meta.get('torch')}, {meta.get('date', '')[:10]}). Measured by:",
        "",
        f"    {meta['command']}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a benchmark run's --out-dir")
    parser.add_argument("--time-limit", type=float, default=1.3)
    args = parser.parse_args(argv)
    table = headline(args.run_dir / "bench.jsonl", args.time_limit)
    (args.run_dir / "headline.md").write_text(table, encoding="utf-8")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
