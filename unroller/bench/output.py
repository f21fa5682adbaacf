"""What the harness writes: JSON lines, CSV, Markdown; the progress bar and the summary.

``PREFIX.jsonl``: one ``{"type": "meta"}`` line (machine, command, methods), one
``{"type": "run"}`` line per benchmark and method, one ``{"type": "goal"}`` line per goal.
``PREFIX.csv``: one row per run (``CSV_FIELDS``). ``PREFIX.md``: the table, the max batch
table (samples/s there, the predicted peak and floor against the measured peak), the goals,
the methods. The summary on screen: one row per method, one column per benchmark.
Every table that shows a max batch shows the bytes per sample beside it (the slope of the
measured step peak, ``unroller.bench.per_sample``), with the two batches it is measured
between in the header line, since a slope means nothing without its range.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from unroller.bench.per_sample import batches_label
from unroller.bench.targets import verdict

MIB = 1024.0 * 1024.0

CSV_FIELDS = (
    "benchmark",
    "method",
    "kind",
    "scheme",
    "precision",
    "platform",
    "device",
    "emulated",
    "batch",
    "resolution",
    "time_median_ms",
    "time_p10_ms",
    "time_p90_ms",
    "time_ratio_vs_autograd",
    "samples_per_s",
    "stash_raw_bytes",
    "stash_stored_bytes",
    "step_peak_bytes",
    "total_peak_bytes",
    "live_at_backward_bytes",
    "peak_ratio_vs_autograd",
    "memory_how",
    "loss",
    "budget_bytes",
    "max_batch",
    "max_batch_confirmed",
    "max_batch_ratio_vs_autograd",
    "compiled",
    "reserved_bytes",
    "max_batch_basis",
    "max_batch_measured",
    "ideal_max_batch",
    "max_batch_timed_batch",
    "samples_per_s_at_max_batch",
    "samples_per_s_ratio_at_max_batch",
    "predicted_peak_bytes",
    "floor_bytes",
    "measured_over_floor",
    "measured_over_predicted",
    "per_sample_batch_a",
    "per_sample_batch_b",
    "per_sample_bytes",
    "per_sample_ratio_vs_autograd",
    "per_sample_problem",
)


def _get(record: Any, *path: str | int) -> Any:
    """``record[path[0]][path[1]]...``: keys of dicts, indices of lists; None where a step
    is missing."""
    for key in path:
        if isinstance(record, dict):
            record = record.get(key)
        elif isinstance(record, list) and isinstance(key, int) and 0 <= key < len(record):
            record = record[key]
        else:
            return None
        if record is None:
            return None
    return record


def csv_row(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": rec["benchmark"],
        "method": rec["method"],
        "kind": rec["kind"],
        "scheme": rec["scheme"],
        "precision": rec.get("precision", "fp32"),
        "platform": rec["platform"],
        "device": rec["device"],
        "emulated": rec["emulated"],
        "batch": rec["batch"],
        "resolution": rec["resolution"],
        "time_median_ms": _get(rec, "time_ms", "median"),
        "time_p10_ms": _get(rec, "time_ms", "p10"),
        "time_p90_ms": _get(rec, "time_ms", "p90"),
        "time_ratio_vs_autograd": _get(rec, "time_ratio", "median"),
        "samples_per_s": rec["samples_per_s"],
        "stash_raw_bytes": _get(rec, "stash", "raw_bytes"),
        "stash_stored_bytes": _get(rec, "stash", "stored_bytes"),
        "step_peak_bytes": _get(rec, "memory", "step_peak_bytes"),
        "total_peak_bytes": _get(rec, "memory", "total_peak_bytes"),
        "live_at_backward_bytes": _get(rec, "memory", "live_at_backward_bytes"),
        "peak_ratio_vs_autograd": rec.get("peak_ratio_vs_autograd"),
        "memory_how": _get(rec, "memory", "how"),
        "loss": rec["loss"],
        "budget_bytes": _get(rec, "max_batch", "budget_bytes"),
        "max_batch": _get(rec, "max_batch", "max_batch"),
        "max_batch_confirmed": _get(rec, "max_batch", "confirmed"),
        "max_batch_ratio_vs_autograd": rec.get("max_batch_ratio_vs_autograd"),
        "compiled": rec.get("compiled"),
        "reserved_bytes": _get(rec, "max_batch", "reserved_bytes"),
        "max_batch_basis": _get(rec, "max_batch", "basis"),
        "max_batch_measured": _get(rec, "max_batch", "measured_max_batch"),
        "ideal_max_batch": _get(rec, "predicted", "ideal_max_batch"),
        "max_batch_timed_batch": _get(rec, "max_batch_speed", "batch"),
        "samples_per_s_at_max_batch": _get(rec, "max_batch_speed", "samples_per_s"),
        "samples_per_s_ratio_at_max_batch": _get(
            rec, "max_batch_speed", "ratio_vs_autograd", "median"
        ),
        "predicted_peak_bytes": _get(rec, "predicted", "peak_bytes"),
        "floor_bytes": _get(rec, "predicted", "floor_bytes"),
        "measured_over_floor": _get(rec, "predicted", "measured_over_floor"),
        "measured_over_predicted": _get(rec, "predicted", "measured_over_predicted"),
        "per_sample_batch_a": _get(rec, "per_sample", "batches", 0),
        "per_sample_batch_b": _get(rec, "per_sample", "batches", 1),
        "per_sample_bytes": _get(rec, "per_sample", "bytes_per_sample"),
        "per_sample_ratio_vs_autograd": rec.get("per_sample_ratio_vs_autograd"),
        "per_sample_problem": _get(rec, "per_sample", "problem"),
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_jsonl(path: Path, meta: dict, records: list[dict], goals: list[dict]) -> None:
    lines = [{"type": "meta", **meta}]
    lines += [{"type": "run", **rec} for rec in records]
    lines += [{"type": "goal", **g} for g in goals]
    text = "".join(json.dumps(line, default=_json_default) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")


def write_csv(path: Path, records: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for rec in records:
            writer.writerow(csv_row(rec))


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.2f}"


def _x(r: float | None, digits: int = 2) -> str:
    return "n/a" if r is None else f"{r:.{digits}f}x"


def _mark(mb: dict[str, Any]) -> str:
    """How sure a max batch is: confirmed (no mark), predicted only, or unconfirmed."""
    if mb["confirmed"]:
        return ""
    return " (predicted)" if mb.get("basis") == "predicted" else " (unconfirmed)"


def _max_batch(rec: dict[str, Any]) -> str:
    mb = rec.get("max_batch")
    if not mb:
        return "n/a"
    mark = _mark(mb)
    ratio = rec.get("max_batch_ratio_vs_autograd")
    return f"{mb['max_batch']}{mark}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def _basis(mb: dict[str, Any]) -> str:
    if mb["confirmed"]:
        return "confirmed"
    if mb.get("basis") == "predicted":
        return f"predicted by the line, not measured; largest measured to fit {mb['measured_max_batch']}"
    return "not confirmed"


def _speed_cells(rec: dict[str, Any]) -> str:
    """Timed batch, samples/s and its ratio to autograd's, at the max batch."""
    sp = rec.get("max_batch_speed")
    if not sp:
        return "n/a | n/a | n/a"
    batch = f"{sp['batch']}" + ("" if sp["at_max_batch"] else " (not the max)")
    return (
        f"{batch} | {sp['samples_per_s']:.1f} " f"| {_x(_get(sp, 'ratio_vs_autograd', 'median'))}"
    )


def _floor_cells(rec: dict[str, Any]) -> str:
    """Ideal max batch, predicted peak, floor, measured over floor and over predicted."""
    pred = rec.get("predicted")
    if not pred:
        return "n/a | n/a | n/a | n/a | n/a"
    ideal = pred.get("ideal_max_batch")
    return (
        f"{'n/a' if ideal is None else ideal} | {_mib(pred['peak_bytes'])} "
        f"| {_mib(pred['floor_bytes'])} | {_x(pred['measured_over_floor'])} "
        f"| {_x(pred['measured_over_predicted'])}"
    )


def per_sample_range(records: list[dict]) -> str:
    """The batches the bytes per sample of ``records`` are measured between, for a header
    line: ``b4->b8`` when every record shares them, else each benchmark's."""
    ranges = {r["benchmark"]: batches_label(r.get("per_sample")) for r in records}
    ranges = {k: v for k, v in ranges.items() if v != "n/a"}
    if not ranges:
        return "not measured"
    if len(set(ranges.values())) == 1:
        return next(iter(ranges.values()))
    return ", ".join(f"{k} {v}" for k, v in ranges.items())


def _per_sample_cells(rec: dict[str, Any]) -> str:
    """Bytes per sample in MiB (or why there is none) and the ratio to autograd's."""
    found = rec.get("per_sample")
    if not found:
        return "n/a | n/a"
    value = found["bytes_per_sample"]
    cell = f"{value / MIB:.3f}" if value is not None else "none"
    return f"{cell} | {_x(rec.get('per_sample_ratio_vs_autograd'), 3)}"


def _per_sample_notes(records: list[dict]) -> list[str]:
    """One line per record whose slope has no figure: why ("none" in the tables)."""
    lines = [
        f"- {r['benchmark']} {r['method']}: {r['per_sample']['problem']}"
        for r in records
        if r.get("per_sample") and r["per_sample"]["problem"]
    ]
    return ["", 'Bytes per sample "none" (no figure), why:', "", *lines] if lines else []


def _budget_table(records: list[dict]) -> list[str]:
    """Per method: max batch, samples/s there, and (ours) the memory model's figures."""
    if not any(r.get("max_batch") or r.get("predicted") for r in records):
        return []
    lines = [
        "",
        "### Max batch, samples/s there, predicted peak and floor",
        "",
        "| benchmark | method | budget MiB | max batch (vs autograd) "
        f"| per sample MiB ({per_sample_range(records)}) | per sample vs autograd "
        "| timed at batch "
        "| samples/s there | vs autograd at its max | ideal max batch (floor-limited) "
        "| predicted step peak MiB | floor MiB | measured step peak / floor "
        "| measured / predicted peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        lines.append(
            f"| {rec['benchmark']} | {rec['method']} "
            f"| {_mib(_get(rec, 'max_batch', 'budget_bytes'))} | {_max_batch(rec)} "
            f"| {_per_sample_cells(rec)} "
            f"| {_speed_cells(rec)} | {_floor_cells(rec)} |"
        )
    return lines


def markdown(meta: dict, records: list[dict], goals: list[dict]) -> str:
    lines = [f"## unroller benchmark: {meta['title']}", ""]
    lines += [f"- {line}" for line in meta["about"]]
    lines += [
        "",
        "| benchmark | batch @ res | method | step ms median (p10/p90) | time vs autograd "
        "| samples/s | stashed MiB raw / stored | step peak MiB | total peak MiB "
        "| live at bwd MiB | peak vs autograd | final loss | max batch (vs autograd) "
        f"| per sample MiB ({per_sample_range(records)}) | per sample vs autograd |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        t, st, mem = rec["time_ms"], rec["stash"], rec.get("memory") or {}
        lines.append(
            f"| {rec['benchmark']} | {rec['batch']} @ {rec['resolution']} | {rec['method']} "
            f"| {t['median']:.1f} ({t['p10']:.1f}/{t['p90']:.1f}) "
            f"| {_x(_get(rec, 'time_ratio', 'median'), 3)} | {rec['samples_per_s']:.1f} "
            f"| {_mib(st['raw_bytes'])} / {_mib(st['stored_bytes'])} "
            f"| {_mib(mem.get('step_peak_bytes'))} | {_mib(mem.get('total_peak_bytes'))} "
            f"| {_mib(mem.get('live_at_backward_bytes'))} "
            f"| {_x(rec.get('peak_ratio_vs_autograd'))} | {rec['loss']:.6g} "
            f"| {_max_batch(rec)} | {_per_sample_cells(rec)} |"
        )
    lines += _per_sample_notes(records)
    lines += _budget_table(records)
    lines += ["", "### Goals (reported, never asserted)", ""]
    for g in goals:
        value = "" if g["value"] is None else f"{g['value']}; "
        command = f"; command: `{g['command']}`" if g.get("command") else ""
        lines.append(
            f"- {g['benchmark']}: {g['text']}: **{verdict(g['met'])}** ({value}{g['figures']})"
            + command
        )
    budgets = [r for r in records if r.get("max_batch")]
    if budgets:
        lines += ["", "### Max batch under the memory budget", ""]
        for rec in budgets:
            mb = rec["max_batch"]
            measured = ", ".join(
                f"{m['batch']}: {_mib(m['total_peak_bytes'])}" for m in mb["measured"]
            )
            reserved = mb.get("reserved_bytes")
            lines.append(
                f"- {rec['benchmark']} {rec['method']}: budget {_mib(mb['budget_bytes'])} MiB"
                + (f" ({_mib(reserved)} MiB of it optimizer state)" if reserved else "")
                + f", fit {_mib(mb['intercept_bytes'])} MiB + {_mib(mb['bytes_per_sample'])} MiB "
                f"x batch, predicted {mb['predicted_max_batch']}, max {mb['max_batch']} "
                f"({_basis(mb)}); measured total "
                f"peaks MiB by batch: {measured}" + "".join(f"; {n}" for n in mb["notes"])
            )
    lines += ["", "### Methods", ""]
    lines += [f"- {k}: {v}" for k, v in meta["methods"].items()]
    lines += ["", "### Machine", ""]
    for key in ("date", "processor", "machine", "platform", "cpu_count", "torch", "num_threads"):
        lines.append(f"- {key}: {meta[key]}")
    lines.append(f"- command: `{meta['command']}`")
    lines.append(f"- wall time: {meta['wall_s']:.0f} s")
    for info in meta.get("benchmarks", []):
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in info["phase_seconds"].items())
        lines.append(
            f"- {info['benchmark']} (batch {info['batch']} at {info['resolution']}): {phases}"
        )
    return "\n".join(lines) + "\n"


def summary_table(meta: dict, records: list[dict]) -> Table:
    """Rows: methods; columns: benchmarks. Autograd's cell holds its own figures (step ms,
    step peak MiB, max batch, samples/s there, MiB per sample); every other cell its
    ratios to autograd's (time, step peak, max batch, samples/s, bytes per sample)."""
    benches = list(dict.fromkeys(r["benchmark"] for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    cells = {(r["benchmark"], r["method"]): r for r in records}
    table = Table(
        title=meta["title"],
        caption="cells: step time, step peak, max batch under the budget, samples/s at the "
        f"max batch, bytes per sample ({per_sample_range(records)}), as ratios to "
        "autograd's; autograd's row: ms, MiB, batch, samples/s, MiB per sample",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("method", no_wrap=True)
    for bench in benches:
        first = next(r for r in records if r["benchmark"] == bench)
        table.add_column(
            f"{bench}\nb{first['batch']}@{first['resolution']}", justify="right", no_wrap=True
        )
    for method in methods:
        row = [method]
        for bench in benches:
            rec = cells.get((bench, method))
            if rec is None:
                row.append("")
                continue
            mb = rec.get("max_batch") or {}
            rate = _get(rec, "max_batch_speed", "samples_per_s")
            slope = _get(rec, "per_sample", "bytes_per_sample")
            if method == "autograd":
                peak = (rec.get("memory") or {}).get("step_peak_bytes")
                row.append(
                    f"{rec['time_ms']['median']:.0f} "
                    f"{'n/a' if peak is None else f'{peak / MIB:.0f}'} {mb.get('max_batch', 'n/a')}"
                    f" {'n/a' if rate is None else f'{rate:.0f}'}"
                    f" {'n/a' if slope is None else f'{slope / MIB:.2f}'}"
                )
                continue
            figures = (
                _get(rec, "time_ratio", "median"),
                rec.get("peak_ratio_vs_autograd"),
                rec.get("max_batch_ratio_vs_autograd"),
                _get(rec, "max_batch_speed", "ratio_vs_autograd", "median"),
            )
            row.append(" ".join("n/a" if f is None else f"{f:.2f}" for f in figures[:2]))
            row[-1] += " n/a" if figures[2] is None else f" {figures[2]:.1f}"
            row[-1] += " n/a" if figures[3] is None else f" {figures[3]:.2f}"
            ratio = rec.get("per_sample_ratio_vs_autograd")
            row[-1] += " n/a" if ratio is None else f" {ratio:.2f}"
        table.add_row(*row)
    return table


def print_summary(
    console: Console, meta: dict, records: list[dict], goals: list[dict], files: list[Path]
) -> None:
    """The table, what the figures are, one line per goal, where the files went."""
    console.print(summary_table(meta, records))
    for line in meta["about"]:
        console.print(f"* {line}", markup=False, highlight=False)
    console.print("Goals (reported, not asserted; details in the .md):", markup=False)
    by_goal: dict[str, list[dict]] = {}
    for g in goals:
        by_goal.setdefault(g["text"], []).append(g)
    for text, items in by_goal.items():
        found = ", ".join(
            f"{g['benchmark']} {verdict(g['met'])}"
            + ("" if g["value"] is None else f" {g['value']}")
            for g in items
        )
        commands = list(dict.fromkeys(g["command"] for g in items if g.get("command")))
        found += "".join(f" (command: {c})" for c in commands)
        console.print(f"- {text}: {found}", markup=False, highlight=False)
    where = files[0].parent if files else "."
    names = ", ".join(f.name for f in files)
    console.print(f"wrote {where}/: {names} in {meta['wall_s']:.0f} s", markup=False)


class Bar:
    """A rich progress bar over the run's units of work, or nothing."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.task = progress.add_task("starting", total=None) if progress else None

    def add(self, units: int) -> None:
        if self.progress is not None:
            total = self.progress.tasks[0].total or 0
            self.progress.update(self.task, total=total + units)

    def advance(self, what: str, units: int = 1) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=units, description=what)

    def note(self, what: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=what)


@contextmanager
def progress_bar(console: Console, enabled: bool) -> Iterator[Bar]:
    if not enabled:
        yield Bar(None)
        return
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        yield Bar(progress)
