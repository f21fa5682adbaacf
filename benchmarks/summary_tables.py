"""Summary tables of a benchmark run, written beside it for the documentation to include.

Read from a run's ``bench.jsonl`` (``python -m benchmarks.run ... --out-dir DIR``):

* ``DIR/per_sample_matrix.md``: per method (rows) and network (columns), how many times
  less than autograd each extra sample costs (the step peak's slope between the run's two
  batches) and the step time against autograd's; autograd's own slope in MiB first;
* with ``--core FILE``, the core preset's JSON as a table beside it (``FILE.md``);
* ``DIR/max_batch.md`` (runs with a memory budget): per network, each method's max batch
  under the budget against autograd's ("p": predicted by the measured line, beyond the
  step-time limit; "u": the search stopped before confirming it), the floor-limited ideal,
  samples/s there and the step time against autograd's, and the measured peak over the
  memory model's floor; before them, one matrix of the max-batch ratios of every network.

Each file ends with the command that measured the run, so the docs quote them through
``benchmarks.doc_tables`` and never by hand.

    python -m benchmarks.summary_tables benchmarks/results/per_sample
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MIB = 2**20


def _runs(path: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    meta = dict(next((r for r in rows if r.get("type") == "meta"), {}))
    where = path.parent.resolve()
    root = Path(__file__).resolve().parent.parent
    inside = root in where.parents
    meta["out_dir"] = where.relative_to(root).as_posix() if inside else where.as_posix()
    return meta, [r for r in rows if r.get("type") == "run"]


def _footer(meta: dict) -> list[str]:
    # a run written elsewhere and moved here: name where it lies now, not a machine's path
    command = re.sub(
        r"--out-dir /\S+", f"--out-dir {meta.get('out_dir', 'DIR')}", meta.get("command", "")
    )
    return [
        "",
        f"({meta.get('cpu_model') or meta.get('machine')}, {meta.get('cpu_count')} CPUs, "
        f"torch {meta.get('torch')}, {meta.get('num_threads')} thread(s), "
        f"{meta.get('date', '')[:10]}.) Measured by:",
        "",
        f"    {command}",
    ]


def _slope(run: dict) -> float | None:
    found = (run.get("per_sample") or {}).get("bytes_per_sample")
    return float(found) if found else None


def _times(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def _time(run: dict) -> str:
    return f"{float(run['time_ratio']['median']):.2f}x"


def per_sample_matrix(path: Path) -> str:
    """Bytes per sample as "x less than autograd / step time vs autograd's", per method."""
    meta, runs = _runs(path)
    names = list(dict.fromkeys(r["benchmark"] for r in runs))
    methods = list(dict.fromkeys(r["method"] for r in runs if r["kind"] != "autograd"))
    by = {(r["benchmark"], r["method"]): r for r in runs}
    base = {n: _slope(by[(n, "autograd")]) if (n, "autograd") in by else None for n in names}
    lines = [
        "| method | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        f"| {_baseline(meta)}, MiB per sample | "
        + " | ".join(f"{base[n] / MIB:.3g}" if base[n] else "n/a" for n in names)
        + " |",
    ]
    for method in methods:
        cells = []
        for name in names:
            run = by.get((name, method))
            slope = _slope(run) if run else None
            if run is None or not slope or not base[name]:
                cells.append("n/a")
            else:
                cells.append(f"{_times(base[name] / slope)} / {_time(run)}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    batches = next((r["per_sample"]["batches"] for r in runs if r.get("per_sample")), [])
    between = f"batch {batches[0]} and {batches[-1]}" if len(batches) > 1 else "two batches"
    lines += [
        "",
        f"Per cell: bytes per extra sample (the step peak's slope between {between}) as how",
        f"many times less than {_baseline(meta)}'s, and the median step time against "
        f"{_baseline(meta)}'s.",
        *_precision_note(meta),
        *_footer(meta),
    ]
    return "\n".join(lines) + "\n"


def _precision(meta: dict) -> str:
    return meta.get("precision") or "fp32"


def _baseline(meta: dict) -> str:
    """What the run's autograd row ran: plain, or under torch.autocast."""
    precision = _precision(meta)
    if precision.endswith("-mixed"):
        dtype = "bfloat16" if precision.startswith("bf16") else "float16"
        return f"autograd under torch.autocast({dtype})"
    return "autograd" if precision == "fp32" else f"autograd in {precision}"


def _precision_note(meta: dict) -> list[str]:
    """For a run in another precision than fp32: what ran, and where."""
    precision = _precision(meta)
    if precision == "fp32":
        return []
    return [
        "",
        f"Precision {precision}: ours generated with --precision {precision}, every peer "
        + (
            "with its forward under torch.autocast"
            if precision.endswith("-mixed")
            else f"cast to {precision}"
        )
        + ". Measured on a CPU: the step times are CPU times, not GPU times.",
    ]


def _mark(run: dict) -> str:
    found = run.get("max_batch") or {}
    if found.get("confirmed"):
        return ""
    return " p" if found.get("basis") == "predicted" else " u"


def _max_batch(run: dict) -> str:
    found = run.get("max_batch") or {}
    if found.get("max_batch") is None:
        return "n/a"
    ratio = run.get("max_batch_ratio_vs_autograd")
    tail = f" ({ratio:.2f}x)" if ratio is not None else ""
    return f"{found['max_batch']}{_mark(run)}{tail}"


def max_batch_tables(path: Path) -> str:
    """The max batch under the run's budget, per network and method."""
    meta, runs = _runs(path)
    runs = [r for r in runs if (r.get("max_batch") or {}).get("max_batch") is not None]
    names = list(dict.fromkeys(r["benchmark"] for r in runs))
    methods = list(dict.fromkeys(r["method"] for r in runs if r["kind"] != "autograd"))
    by = {(r["benchmark"], r["method"]): r for r in runs}
    lines = [
        "### Max batch against autograd's, per network",
        "",
        "| network (budget) | autograd | " + " | ".join(methods) + " |",
        "|---|---:|" + "---:|" * len(methods),
    ]
    for name in names:
        auto = by.get((name, "autograd"))
        budget = (auto or next(r for r in runs if r["benchmark"] == name))["max_batch"]
        cells = [f"{name} ({budget['budget_bytes'] / MIB:,.0f} MiB)"]
        cells.append(f"{auto['max_batch']['max_batch']}{_mark(auto)}" if auto else "n/a")
        for method in methods:
            run = by.get((name, method))
            ratio = run and run.get("max_batch_ratio_vs_autograd")
            cells.append(f"{ratio:.2f}x{_mark(run)}" if ratio is not None and run else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    for name in names:
        mine = [r for r in runs if r["benchmark"] == name]
        batch = mine[0].get("batch")
        lines += [
            "",
            f"### {name}",
            "",
            "| method | max batch (vs autograd) | ideal (floor-limited) | samples/s there vs "
            f"autograd's | step time at b{batch} vs autograd | measured peak / floor |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for run in mine:
            predicted = run.get("predicted") or {}
            speed = ((run.get("max_batch_speed") or {}).get("ratio_vs_autograd") or {}).get(
                "median"
            )
            over = predicted.get("measured_over_floor")
            cells = [
                run["method"],
                _max_batch(run),
                str(predicted.get("ideal_max_batch") or "-"),
                f"{speed:.2f}x" if speed is not None else "-",
                f"{float(run['time_ratio']['median']):.3f}x",
                f"{over:.2f}x" if over is not None else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        'Marks: "p", beyond the step-time limit, predicted by the line through the measured',
        'peaks, not confirmed; "u", the search stopped at the step-time limit before confirming.',
        *_footer(meta),
    ]
    return "\n".join(lines) + "\n"


def core_table(path: Path) -> str:
    """The core preset's JSON (``python -m benchmarks.core_bench``) as a table."""
    data = json.loads(path.read_text(encoding="utf-8"))
    lines = [
        "| model | ours ms (median) | autograd ms (median) | median ratio | peak MiB ours / "
        "autograd | saved for backward MiB ours / autograd |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model in data["models"]:
        time, memory, saved = model["time"], model["memory"], model["saved"]
        cells = [
            f"{model['model']} ({model['parameters'] / 1000:.0f}k params)",
            f"{time['ours']['median']:.1f}",
            f"{time['autograd']['median']:.1f}",
            f"{time['ratio']['median']:.3f}",
            f"{memory['ours']['peak_bytes'] / MIB:.2f} / "
            f"{memory['autograd']['peak_bytes'] / MIB:.2f}",
            f"{saved['ours_predicted_bytes'] / MIB:.2f} / "
            f"{saved['autograd_counted']['without_params_bytes'] / MIB:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _footer(data["meta"])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="*", help="benchmark runs' --out-dir")
    parser.add_argument("--core", type=Path, help="a core_bench JSON: writes it as .md beside")
    args = parser.parse_args(argv)
    if args.core:
        args.core.with_suffix(".md").write_text(core_table(args.core), "utf-8")
    for run_dir in args.run_dirs:
        path = run_dir / "bench.jsonl"
        if not path.is_file() and (run_dir / "lora.jsonl").is_file():
            path = run_dir / "lora.jsonl"  # the lora_llama preset's run
        _, runs = _runs(path)
        if any(_slope(r) for r in runs):
            (run_dir / "per_sample_matrix.md").write_text(per_sample_matrix(path), "utf-8")
        if any((r.get("max_batch") or {}).get("max_batch") is not None for r in runs):
            (run_dir / "max_batch.md").write_text(max_batch_tables(path), "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
