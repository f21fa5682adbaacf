"""Does ``auto`` find the best plan? Its measured bytes per sample against the best fixed
option's that meets the same time limit, from one ``benchmarks.run`` result.

Per benchmark of the run: every ``ours:`` row's bytes per sample (the slope of the measured
step peak between the run's two batches) and its time against ``ours:nocompress`` (the
median over rounds of the per-round ratio: the rows took turns in each round). The fixed
options are every ``ours:`` row that is not an ``auto`` row; the best is the one with the
least bytes per sample whose measured time is within ``--limit`` (auto's default, 1.2).
The goal: ``ours:auto`` within the limit, keeping at most ``--slack`` (1.10) times the
best fixed option's bytes per sample. With ``--least X``, also the absolute goal: some
``ours:`` row (auto included) keeps at least X times less per sample than autograd within
``--limit`` times autograd's step time.

    python -m benchmarks.run --benchmark gpt_tiny,vit_tiny,resnet34 \\
        --scheme nocompress,dct-dense,quant,auto --peers none --memory-budget none \\
        --threads 1 --per-sample-batches 4,8 --out-dir benchmarks/results/auto_search
    python -m benchmarks.auto_goal benchmarks/results/auto_search
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

BASE = "ours:nocompress"
AUTO = "ours:auto"


def _rows(run: Path) -> tuple[dict[str, Any], dict[str, dict[str, dict[str, Any]]]]:
    meta: dict[str, Any] = {}
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for line in (run / "bench.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "meta":
            meta = record
        elif record.get("type") == "run":
            found.setdefault(record["benchmark"], {})[record["method"]] = record
    return meta, found


def time_vs(row: dict[str, Any], base: dict[str, Any]) -> float | None:
    """The median over rounds of ``row``'s step time over ``base``'s in the same round."""
    mine, theirs = row["time_ms"].get("samples"), base["time_ms"].get("samples")
    if not mine or not theirs or len(mine) != len(theirs):
        return None
    return statistics.median(a / b for a, b in zip(mine, theirs))


def _per_sample(row: dict[str, Any]) -> float | None:
    found = row.get("per_sample") or {}
    return found.get("bytes_per_sample")


def judge(rows: dict[str, dict[str, Any]], limit: float, slack: float) -> dict[str, Any] | None:
    """One benchmark's verdict, or None without a nocompress and an auto row."""
    if BASE not in rows or AUTO not in rows:
        return None
    base = rows[BASE]
    scored = {}
    for method, row in rows.items():
        ratio, per_sample = time_vs(row, base), _per_sample(row)
        if method.startswith("ours:") and ratio is not None and per_sample is not None:
            scored[method] = (per_sample, ratio)
    fixed = {m: s for m, s in scored.items() if not m.startswith(AUTO) and s[1] <= limit}
    best = min(fixed, key=lambda m: fixed[m][0]) if fixed else None
    auto = scored.get(AUTO)
    autograd = _per_sample(rows["autograd"]) if "autograd" in rows else None
    verdict = None
    if auto is not None and best is not None:
        verdict = auto[1] <= limit and auto[0] <= slack * fixed[best][0]
    return {
        "auto": auto,
        "best": best,
        "best_scores": fixed.get(best) if best else None,
        "autograd": autograd,
        "met": verdict,
        "scored": scored,
    }


def absolute(rows: dict[str, dict[str, Any]], limit: float) -> tuple[str, float, float] | None:
    """The ``ours:`` row (auto included) keeping the least per sample among those within
    ``limit`` times autograd's step time: (method, times less than autograd, time ratio);
    None without an autograd row or any row within."""
    if "autograd" not in rows or not _per_sample(rows["autograd"]):
        return None
    base, ag = rows["autograd"], _per_sample(rows["autograd"])
    within = []
    for method, row in rows.items():
        ratio, per_sample = time_vs(row, base), _per_sample(row)
        if method.startswith("ours:") and ratio is not None and per_sample and ratio <= limit:
            within.append((method, ag / per_sample, ratio))
    return max(within, key=lambda w: w[1]) if within else None


def _absolute_lines(found: dict[str, dict[str, dict[str, Any]]], limit: float, least: float):
    lines = [
        "",
        f"Absolute goal: some ours:* row (auto included) keeps at least {least:g}x less per "
        f"sample than autograd at most {limit}x autograd's step time (the median of per-round "
        "ratios):",
        "",
        "| benchmark | best ours within the limit | less than autograd | time vs autograd | goal |",
        "|---|---|---:|---:|---|",
    ]
    for name, rows in found.items():
        got = absolute(rows, limit)
        if got is None:
            lines.append(f"| {name} | - | - | - | not met |")
            continue
        method, less, ratio = got
        met = "met" if less >= least else "not met"
        lines.append(f"| {name} | {method} | {less:.1f}x | {ratio:.2f}x | {met} |")
    return lines


def _flags(limit: float, slack: float, least: float | None) -> str:
    """The judge's flags that differ from their defaults, as typed."""
    flags = f" --limit {limit:g}" if limit != 1.2 else ""
    flags += f" --slack {slack:g}" if slack != 1.10 else ""
    return flags + (f" --least {least:g}" if least is not None else "")


def _x(autograd: float | None, per_sample: float) -> str:
    return f"{autograd / per_sample:.1f}x" if autograd and per_sample else "-"


def report(run: Path, limit: float, slack: float, least: float | None = None) -> str:
    meta, found = _rows(run)
    lines = [
        f"# `auto` against the best fixed option within {limit}x time",
        "",
        f"From `{meta.get('command', '?')}` ({meta.get('date', '?')}, {meta.get('cpu_model', '?')},"
        f" {meta.get('num_threads', '?')} thread(s), load {meta.get('loadavg_start', '?')}),"
        f" judged by `python -m benchmarks.auto_goal {run}{_flags(limit, slack, least)}`."
        " Bytes per sample: the slope "
        "of the measured step peak; less than autograd: autograd's bytes per sample over "
        "the row's; time: against ours:nocompress, the median of per-round ratios.",
        "",
        "| benchmark | auto: bytes/sample (less than autograd), time | best fixed within the "
        "limit | its bytes/sample (less than autograd), time | auto / best | goal |",
        "|---|---|---|---|---:|---|",
    ]
    verdicts = {
        name: v for name, rows in found.items() if (v := judge(rows, limit, slack)) is not None
    }
    for name, v in verdicts.items():
        auto, best, scores, ag = v["auto"], v["best"], v["best_scores"], v["autograd"]
        a = f"{auto[0]:,.0f} ({_x(ag, auto[0])}), {auto[1]:.2f}x" if auto else "-"
        b = f"{scores[0]:,.0f} ({_x(ag, scores[0])}), {scores[1]:.2f}x" if scores else "-"
        rel = f"{auto[0] / scores[0]:.2f}" if auto and scores and scores[0] else "-"
        met = {True: "met", False: "not met", None: "-"}[v["met"]]
        lines.append(f"| {name} | {a} | {best or '-'} | {b} | {rel} | {met} |")
    lines += [
        "",
        f"Goal: auto's time within {limit}x and its bytes per sample at most {slack}x the best "
        "fixed option's. Every row scored, per benchmark (bytes per sample, time):",
        "",
    ]
    for name, v in verdicts.items():
        cells = ", ".join(
            f"{m.split(':', 1)[1]} {s[0]:,.0f} at {s[1]:.2f}x" for m, s in v["scored"].items()
        )
        lines.append(f"- {name}: {cells}")
    if least is not None:
        lines += _absolute_lines(found, limit, least)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a benchmarks.run --out-dir")
    parser.add_argument("--limit", type=float, default=1.2)
    parser.add_argument("--slack", type=float, default=1.10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--least",
        type=float,
        default=None,
        help="also judge the absolute goal: some ours row keeps at least this many times "
        "less per sample than autograd within --limit of autograd's time",
    )
    args = parser.parse_args(argv)
    text = report(args.run, args.limit, args.slack, args.least)
    print(text)
    (args.out or args.run / "auto_goal.md").write_text(text)


if __name__ == "__main__":
    main()
