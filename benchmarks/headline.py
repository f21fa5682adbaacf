"""The headline table: bytes each extra sample costs, ours against what users pick instead.

Read from benchmark runs' ``bench.jsonl`` (``python -m benchmarks.run ... --out-dir DIR``;
a lora_llama run's ``lora.jsonl``): per network and precision, autograd's step-peak slope
between two batch sizes (MiB per sample), and how many times less the best of ours keeps
at a step time within ``--time-limit`` of autograd's, against activation checkpointing
(``torch.utils.checkpoint`` per block, or Hugging Face's gradient checkpointing) and the
best hook-based compressor (``saved_tensors_hooks``) at any time. In a run of a mixed
``--precision`` every peer ran under ``torch.autocast``: its rows say so, and where it ran
on a CPU, that its times are not GPU times. Written to ``headline.md`` of the first folder
with each run's command, so README quotes it through ``benchmarks.doc_tables`` and never
by hand.

    python -m benchmarks.headline benchmarks/results/per_sample
    python -m benchmarks.headline benchmarks/results/per_sample \
        benchmarks/results/precision/bf16_mixed benchmarks/results/precision/lora_llama
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


def results_file(folder: Path) -> Path:
    """A run folder's records: the suite's ``bench.jsonl`` or the lora_llama preset's."""
    for name in ("bench.jsonl", "lora.jsonl"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder}: no bench.jsonl or lora.jsonl")


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


HEADER = (
    "| network | precision | autograd, MiB per sample | ours, best at <= {limit:g}x autograd's "
    "time | activation checkpointing | best hook compressor |"
)


def _precision_cell(meta: dict, runs: list[dict]) -> str:
    precision = meta.get("precision") or "fp32"
    if precision != "fp32" and any(r.get("device") == "cpu" for r in runs):
        return f"{precision} (CPU)"
    return precision


def _rows(meta: dict, runs: list[dict], limit: float) -> list[str]:
    lines = []
    precision = _precision_cell(meta, runs)
    for name in dict.fromkeys(r["benchmark"] for r in runs):
        mine = [r for r in runs if r["benchmark"] == name]
        autograd = next((r for r in mine if r["kind"] == "autograd"), None)
        if autograd is None or not _slope(autograd):
            continue
        base = _slope(autograd)
        ours = _best([r for r in mine if r["kind"] == "ours"], limit)
        checkpoint = _best([r for r in mine if r["kind"] == "checkpoint"], None)
        hooks = _best([r for r in mine if r["kind"] == "hooks"], None)
        cells = (name, precision, f"{base / MIB:.3f}")
        cells += tuple(_cell(r, base) for r in (ours, checkpoint, hooks))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _footer(meta: dict, runs: list[dict], label: str = "Bytes per sample") -> list[str]:
    batches = next((r["per_sample"]["batches"] for r in runs if r.get("per_sample")), [])
    return [
        "",
        (
            f"{label}: the step peak's slope between batch {batches[0]} and {batches[-1]}"
            if len(batches) > 1
            else f"{label}: the step peak's slope between two batches"
        ),
        f"({meta.get('cpu_model') or meta.get('machine')}, {meta.get('cpu_count')} CPUs, "
        f"torch {meta.get('torch')}, {meta.get('date', '')[:10]}). Measured by:",
        "",
        f"    {meta['command']}",
    ]


def _label(meta: dict, runs: list[dict]) -> str:
    """A run's rows, as a footer names them: its precision and networks."""
    names = ", ".join(dict.fromkeys(r["benchmark"] for r in runs))
    return f"{meta.get('precision') or 'fp32'} rows ({names})"


def _mixed_note(found: list[tuple[dict, list[dict]]]) -> list[str]:
    """What the mixed-precision rows ran, and where: said once, after the footers."""
    mixed = sorted({m["precision"] for m, _ in found if str(m.get("precision")).endswith("-mixed")})
    if not mixed:
        return []
    on_cpu = any(
        r.get("device") == "cpu" for m, runs in found for r in runs if m.get("precision") in mixed
    )
    note = (
        f"{' and '.join(mixed)} rows: ours generated with that --precision; autograd and "
        "checkpointing (torch.utils.checkpoint per block or decoder layer, or Hugging Face's "
        "gradient checkpointing) with their forward under torch.autocast"
    )
    if on_cpu:
        note += (
            "; measured on a CPU, whose low-precision kernels are not a GPU's: the step times "
            "are CPU times, not GPU times"
        )
    return ["", note + "."]


def headline(path: Path, limit: float = 1.3) -> str:
    """The table for the run in ``path`` (a bench.jsonl), with its command."""
    meta, runs = _runs(path)
    lines = [HEADER.format(limit=limit), "|---|---|---:|---|---|---|", *_rows(meta, runs, limit)]
    return "\n".join(lines + _footer(meta, runs) + _mixed_note([(meta, runs)])) + "\n"


def headline_of(folders: list[Path], limit: float = 1.3) -> str:
    """One table of the runs in ``folders`` (their rows in order), each run's footer after."""
    found = [_runs(results_file(folder)) for folder in folders]
    lines = [HEADER.format(limit=limit), "|---|---|---:|---|---|---|"]
    for meta, runs in found:
        lines += _rows(meta, runs, limit)
    for meta, runs in found:
        lines += _footer(meta, runs, _label(meta, runs) if len(found) > 1 else "Bytes per sample")
    return "\n".join(lines + _mixed_note(found)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dirs", type=Path, nargs="+", help="benchmark runs' --out-dir (rows in this order)"
    )
    parser.add_argument("--time-limit", type=float, default=1.3)
    args = parser.parse_args(argv)
    table = headline_of(args.run_dirs, args.time_limit)
    (args.run_dirs[0] / "headline.md").write_text(table, encoding="utf-8")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
