"""The mixed-precision goals, per network and run, from the runs' own goal lines.

Reads the ``goal`` lines the harness wrote (``unroller.bench.targets``) into each run's
``bench.jsonl`` (the suite in ``--precision bf16-mixed``) or ``lora.jsonl`` (the
lora_llama preset) and writes one table of the bytes-per-sample and max-batch goals with
their verdicts and figures, then each run's command and machine, to
``benchmarks/results/precision/goals.md``, which docs/benchmarks.md includes. Nothing is
judged here: the verdicts are the harness's.

    python -m benchmarks.precision_goals benchmarks/results/precision/bf16_mixed \\
        benchmarks/results/precision/lora_llama_512 benchmarks/results/precision/lora_llama_2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.headline import results_file

OUT = Path(__file__).resolve().parent / "results" / "precision" / "goals.md"
#: the goals this table shows, in this order (``unroller.bench.targets`` keys)
GOALS = (
    "per_sample_nocompress",
    "per_sample_best_mixed",
    "per_sample_best_imported",
    "max_batch_imported",
)
VERDICT = {True: "met", False: "NOT met", None: "n/a"}
#: each goal in a few words (the harness's own text: targets.TEXTS, in bench.md / lora.md)
SHORT = {
    "per_sample_nocompress": "ours:nocompress keeps no more per sample than autograd",
    "per_sample_best_mixed": "the best ours:* at <= 1.3x autograd's time keeps >= 16x less "
    "per sample than autograd under autocast, and less than every checkpointing peer",
    "per_sample_best_imported": "the best ours:* at <= 1.3x autograd's time keeps >= 8x less "
    "per sample than autograd, and less than every checkpointing peer",
    "max_batch_imported": "max batch under the budget: the best ours:* at <= 1.3x autograd's "
    "time ahead of autograd and every checkpointing peer",
}


def _lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line]


def _span(runs: list[dict], bench: str) -> str:
    found = next((r["per_sample"]["batches"] for r in runs if r["benchmark"] == bench), None)
    return "" if not found else f" (b{found[0]}->b{found[1]})"


def goals_table(folders: list[Path]) -> str:
    rows = [
        "| network | goal | verdict | figure |",
        "|---|---|---|---|",
    ]
    footers = []
    for folder in folders:
        lines = _lines(results_file(folder))
        meta = next(x for x in lines if x.get("type") == "meta")
        runs = [x for x in lines if x.get("type") == "run" and x.get("per_sample")]
        goals = [x for x in lines if x.get("type") == "goal" and x["goal"] in GOALS]
        goals.sort(key=lambda g: GOALS.index(g["goal"]))
        for g in goals:
            where = g["benchmark"] + _span(runs, g["benchmark"])
            value = g["value"] if g["value"] is not None else g["figures"]
            if g["goal"].startswith("per_sample_best"):
                rivals = [
                    part
                    for part in g["figures"].split("; ")
                    if part.split(" ")[0] in ("checkpoint", "hf-checkpoint")
                ]
                value = "; ".join([value, *rivals])
            if g["goal"] == "max_batch_imported":
                value += f"; {g['figures']}"
            label = SHORT[g["goal"]]
            rows.append(f"| {where} | {label} | **{VERDICT[g['met']]}** | {value} |")
        footers += [
            "",
            f"({meta.get('cpu_model') or meta.get('machine')}, {meta.get('cpu_count')} CPUs, "
            f"torch {meta.get('torch')}, {meta.get('num_threads')} thread(s), precision "
            f"{meta.get('precision', 'fp32')}, {meta.get('date', '')[:10]}.) Measured by:",
            "",
            f"    {meta['command']}",
        ]
    note = [
        "",
        "Step times in these runs are CPU times (autocast on a CPU without native bf16 "
        "arithmetic), not GPU times; the bytes are what the steps allocate.",
    ]
    return "\n".join(rows + note + footers) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="the runs' --out-dir")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    table = goals_table(args.run_dirs)
    args.out.write_text(table, encoding="utf-8")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
