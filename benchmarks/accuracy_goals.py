"""Each scheme's difference from ``nocompress`` and the accuracy goals, from the results.

Reads the ``summary.json`` that ``unroll accuracy`` wrote in every folder of
``benchmarks/results/accuracy`` (nothing is trained or measured here) and writes
``benchmarks/results/accuracy/goals.md``: per experiment the mean final test metric of
``nocompress``, every other scheme's difference from it, the largest spread over seeds
and, for classification, what one test image is worth; then each goal with its verdict.

    python -m benchmarks.accuracy_goals            # rewrite goals.md
    python -m benchmarks.accuracy_goals --check    # exit 1 if goals.md is not what it writes

The goals are limits stated before the runs (``GOALS``): a scheme meets one when the
absolute difference of its mean from ``nocompress``'s mean, same seeds, is at most the
limit and no seed diverged.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks.results_file import write_or_check
from unroller.training.accuracy import BASELINE, DIGITS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "accuracy"
OUT = RESULTS / "goals.md"
COMMAND = "python -m benchmarks.accuracy_goals"

#: The unit a difference of each metric is given in.
UNITS = {"accuracy": "pp", "psnr": "dB", "iou": "IoU", "bpc": "bits/char"}
#: Schemes with a column of their own, in this order; any other goes to "other schemes".
COLUMNS = ("dct-first", "dct-dense", "quant-8bit", "quant-4bit", "quant-2bit")
#: Per metric: the limits on |scheme - nocompress|, each with the schemes it applies to.
GOALS = {
    "accuracy": ((1.0, ("dct-dense", "quant-8bit", "quant-blocks", "auto")),),
    "bpc": ((0.05, ("quant-8bit", "quant-blocks")), (0.02, ("auto",))),
}


#: Decimals of a difference: the tables' own, one more for bits per character.
DIFF_DIGITS = {**DIGITS, "bpc": DIGITS.get("bpc", 2) + 1}


def _signed(value: float, metric: str) -> str:
    return f"{value:+.{DIFF_DIGITS.get(metric, 2)}f}"


def _device(header: dict) -> str:
    found = re.search(r"device (\S+(?: \([^)]*\))?)", header["machine"])
    return found.group(1) if found else "?"


def _one_test_sample(header: dict, metric: str) -> str:
    found = re.search(r"(\d[\d,]*) test\b", header["dataset"])
    if metric != "accuracy" or not found:
        return "-"
    return f"{100 / int(found.group(1).replace(',', '')):.2f} pp"


def _load() -> list[tuple[str, dict]]:
    return [
        (path.parent.name, json.loads(path.read_text()))
        for path in sorted(RESULTS.glob("*/summary.json"))
    ]


def differences(summaries: list[tuple[str, dict]]) -> list[str]:
    lines = [
        "| experiment | device | seeds | metric | nocompress | "
        + " | ".join(COLUMNS)
        + " | other schemes | largest std over seeds | one test image |",
        "|---|---|---|---|---|" + "---|" * len(COLUMNS) + "---|---|---|",
    ]
    for name, summary in summaries:
        rows = {row["scheme"]: row for row in summary["rows"]}
        base = rows[BASELINE]
        metric = base["metric"]
        unit = UNITS.get(metric, metric)
        cells = [
            "-" if scheme not in rows else _signed(rows[scheme]["delta"], metric)
            for scheme in COLUMNS
        ]
        others = ", ".join(
            f"{scheme} {_signed(row['delta'], metric)}"
            for scheme, row in rows.items()
            if scheme != BASELINE and scheme not in COLUMNS
        )
        spreads = [row["std"] for row in rows.values() if row.get("std") is not None]
        spread = f"{max(spreads):.{DIGITS.get(metric, 2)}f}" if spreads else "- (one seed)"
        digits = DIGITS.get(metric, 2)
        lines.append(
            f"| {name} | {_device(summary['header'])} "
            f"| {len(base['seeds'])} | {metric} ({unit}) | {base['mean']:.{digits}f} | "
            + " | ".join(cells)
            + f" | {others or '-'} | {spread} | {_one_test_sample(summary['header'], metric)} |"
        )
    return lines


def goals(summaries: list[tuple[str, dict]]) -> list[str]:
    lines = ["| experiment | scheme | goal | difference | verdict |", "|---|---|---|---|---|"]
    for name, summary in summaries:
        rows = {row["scheme"]: row for row in summary["rows"]}
        metric = rows[BASELINE]["metric"]
        if metric not in GOALS:
            continue
        unit = UNITS[metric]
        seeds = len(rows[BASELINE]["seeds"])
        for limit, scheme in ((lim, s) for lim, schemes in GOALS[metric] for s in schemes):
            row = rows.get(scheme)
            if row is None:
                continue
            met = row["delta"] is not None and abs(row["delta"]) <= limit and not row["diverged"]
            difference = "-" if row["delta"] is None else f"{_signed(row['delta'], metric)} {unit}"
            lines.append(
                f"| {name} | {scheme} | within {limit:g} {unit} of nocompress (mean of "
                f"{seeds} seed{'s' if seeds > 1 else ''}) | {difference} "
                f"| {'met' if met else '**NOT met**'} |"
            )
    return lines


def report() -> str:
    summaries = _load()
    without = sorted(
        name for name, summary in summaries if summary["rows"][0]["metric"] not in GOALS
    )
    lines = [
        "# Accuracy against nocompress: differences and goals",
        "",
        f"Command: `{COMMAND}` (reads the `summary.json` of every folder of "
        "benchmarks/results/accuracy; each folder's `accuracy.md` has the command and "
        "machine of its runs)",
        "",
        "## Difference from nocompress",
        "",
        "Mean over seeds of the final test metric, minus nocompress's mean over the same "
        "seeds (pp: percentage points of accuracy; dB: PSNR; bits/char: lower is better, "
        "so a positive difference is a loss). Largest std: the largest sample standard "
        "deviation over seeds of any scheme in the experiment. One test image: what one "
        "test image more or less correct changes the accuracy by.",
        "",
        *differences(summaries),
        "",
        "## Goals",
        "",
        "A goal is met when |scheme - nocompress| is at most the limit and no seed "
        f"diverged. No goal is set for {', '.join(without)}: their differences are above.",
        "",
        *goals(summaries),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(__doc__.splitlines()[0], OUT, COMMAND, report, argv)


if __name__ == "__main__":
    sys.exit(main())
