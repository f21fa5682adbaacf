"""PNG plots of a run (matplotlib, Agg backend): one figure per question, a panel per model.

- ``PREFIX_memory.png``: step peak and stashed (stored) bytes per method;
- ``PREFIX_time_ratio.png``: step time / autograd's per method (median, p10-p90 bars);
- ``PREFIX_layers.png``: stored bytes per block of the model (stash_report rows) per scheme;
- ``PREFIX_max_batch.png``: the largest batch under the budget per method (if searched);
- ``PREFIX_per_sample.png``: bytes per sample (the slope of the step peak) per method, the
  budget-free figure next to the max batch;
- ``timeline``: bytes live over one step per method (``unroller.bench.timeline.record``),
  the caller names the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1024.0 * 1024.0


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, records: list[dict], height: float = 3.6):
    """One panel per benchmark, two per row: [(benchmark, its records, axes)]."""
    benches = list(dict.fromkeys(r["benchmark"] for r in records))
    cols = min(2, len(benches))
    rows = -(-len(benches) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(benches) :]:
        ax.set_visible(False)
    return fig, [
        (b, [r for r in records if r["benchmark"] == b], ax) for b, ax in zip(benches, flat)
    ]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory(records: list[dict], path: Path) -> Path | None:
    if not any(r.get("memory") for r in records):
        return None
    plt = _pyplot()
    fig, groups = _panels(plt, records)
    for bench, recs, ax in groups:
        names = [r["method"] for r in recs]
        xs = range(len(recs))
        peak = [(r.get("memory") or {}).get("step_peak_bytes") or 0 for r in recs]
        stored = [r["stash"]["stored_bytes"] or 0 for r in recs]
        ax.bar([x - 0.2 for x in xs], [p / MIB for p in peak], 0.4, label="step peak")
        ax.bar([x + 0.2 for x in xs], [s / MIB for s in stored], 0.4, label="stashed (stored)")
        ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(f"{bench} (batch {recs[0]['batch']})", fontsize=9)
    groups[0][2].legend(fontsize=7)
    fig.suptitle("Peak step memory and stashed bytes per scheme and peer", fontsize=10)
    return _save(plt, fig, path)


def time_ratio(records: list[dict], path: Path) -> Path:
    plt = _pyplot()
    fig, groups = _panels(plt, records)
    for bench, recs, ax in groups:
        names = [r["method"] for r in recs]
        med = [r["time_ratio"]["median"] for r in recs]
        lo = [m - r["time_ratio"]["p10"] for m, r in zip(med, recs)]
        hi = [r["time_ratio"]["p90"] - m for m, r in zip(med, recs)]
        ax.bar(range(len(recs)), med, yerr=[lo, hi], capsize=2, color="tab:green")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(range(len(recs))), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("step time / autograd")
        ax.set_title(f"{bench} (batch {recs[0]['batch']})", fontsize=9)
    fig.suptitle("Step time relative to autograd (median, p10-p90)", fontsize=10)
    return _save(plt, fig, path)


def _block(tensor: str) -> str:
    """The top-level block a kept tensor belongs to: ``layer2.0.conv1`` -> ``layer2``."""
    return tensor.split(":")[0].split(".")[0]


def _blocks(recs: list[dict]) -> list[str]:
    """Blocks in forward order: compressing schemes log each tensor right after the op that
    made it, so their rows come first; the others add what is left."""
    order: dict[str, None] = {}
    for rec in sorted(recs, key=lambda r: r["scheme"] == "nocompress"):
        for row in rec["stash"]["rows"]:
            order.setdefault(_block(row["tensor"]))
    return list(order)


def layers(records: list[dict], path: Path) -> Path | None:
    ours = [r for r in records if r["kind"] == "ours" and r["stash"].get("rows")]
    if not ours:
        return None
    plt = _pyplot()
    fig, groups = _panels(plt, ours, height=4.0)
    for bench, recs, ax in groups:
        blocks = _blocks(recs)
        width = 0.8 / len(recs)
        for i, rec in enumerate(recs):
            stored = dict.fromkeys(blocks, 0)
            for row in rec["stash"]["rows"]:
                stored[_block(row["tensor"])] += row["stored_bytes"]
            xs = [k + (i - (len(recs) - 1) / 2) * width for k in range(len(blocks))]
            ax.bar(xs, [max(stored[b], 1) for b in blocks], width, label=rec["scheme"])
        ax.set_yscale("log")
        ax.set_xticks(list(range(len(blocks))), blocks, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("stored bytes")
        ax.set_title(f"{bench} (batch {recs[0]['batch']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Stored bytes per block of the model (stash_report rows, summed)", fontsize=10)
    return _save(plt, fig, path)


def max_batch(records: list[dict], path: Path) -> Path | None:
    found = [r for r in records if r.get("max_batch")]
    if not found:
        return None
    plt = _pyplot()
    fig, groups = _panels(plt, found)
    for bench, recs, ax in groups:
        values = [r["max_batch"]["max_batch"] for r in recs]
        bars = ax.bar(range(len(recs)), values, color="tab:purple")
        for bar, rec in zip(bars, recs):
            ratio = rec.get("max_batch_ratio_vs_autograd")
            if ratio is not None:
                ax.annotate(
                    f"{ratio:.1f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        budget = recs[0]["max_batch"]["budget_bytes"] / MIB
        ax.set_xticks(
            list(range(len(recs))), [r["method"] for r in recs], rotation=60, ha="right", fontsize=7
        )
        ax.set_ylabel("largest batch")
        ax.margins(y=0.15)
        ax.set_title(f"{bench} (budget {budget:.0f} MiB)", fontsize=9)
    fig.suptitle("Largest batch under the memory budget (x: vs autograd)", fontsize=10)
    return _save(plt, fig, path)


def per_sample(records: list[dict], path: Path) -> Path | None:
    """Bytes per sample per method (MiB), annotated with the ratio to autograd's; a method
    without a figure (a flat or falling peak) is left at 0 and marked "none"."""
    found = [r for r in records if r.get("per_sample")]
    if not found:
        return None
    plt = _pyplot()
    fig, groups = _panels(plt, found)
    for bench, recs, ax in groups:
        values = [(r["per_sample"]["bytes_per_sample"] or 0) / MIB for r in recs]
        bars = ax.bar(range(len(recs)), values, color="tab:orange")
        for bar, rec in zip(bars, recs):
            ratio = rec.get("per_sample_ratio_vs_autograd")
            text = "none" if rec["per_sample"]["bytes_per_sample"] is None else None
            if text or ratio is not None:
                ax.annotate(
                    text or f"{ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        a, b = recs[0]["per_sample"]["batches"]
        ax.set_xticks(
            list(range(len(recs))), [r["method"] for r in recs], rotation=60, ha="right", fontsize=7
        )
        ax.set_ylabel("MiB per sample")
        ax.margins(y=0.15)
        ax.set_title(f"{bench} (step peak, batch {a} to {b})", fontsize=9)
    fig.suptitle("Bytes per sample: slope of the measured step peak (x: vs autograd)", fontsize=10)
    return _save(plt, fig, path)


def timeline(records_by_method: dict[str, dict], path: Path, title: str) -> Path:
    """Bytes live (MiB) against the step's normalised time, one line per method: a dashed
    vertical line where its backward pass begins and a dot at its peak, so a reader sees
    whether the peak sits in the forward, at the turn or in the backward."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 4.4))
    for i, (name, rec) in enumerate(records_by_method.items()):
        color = f"C{i % 10}"
        peak = rec["peak_bytes"] / MIB
        label = f"{name} (peak {peak:.2f} MiB)"
        mib = [b / MIB for b in rec["bytes"]]
        ax.plot(rec["time"], mib, color=color, lw=1.0, drawstyle="steps-post", label=label)
        ax.plot([rec["peak_time"]], [peak], "o", color=color, markersize=5)
        if rec.get("backward_start") is not None:
            ax.axvline(rec["backward_start"], color=color, ls="--", lw=0.8, alpha=0.8)
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(bottom=0.0)
    ax.set_xlabel("time in the step (0: start, 1: end); dashed: backward begins")
    ax.set_ylabel("MiB live (the step's own allocations)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return _save(plt, fig, path)


def write_all(records: list[dict[str, Any]], out_dir: Path, prefix: str) -> list[Path]:
    made = [
        memory(records, out_dir / f"{prefix}_memory.png"),
        time_ratio(records, out_dir / f"{prefix}_time_ratio.png"),
        layers(records, out_dir / f"{prefix}_layers.png"),
        max_batch(records, out_dir / f"{prefix}_max_batch.png"),
        per_sample(records, out_dir / f"{prefix}_per_sample.png"),
    ]
    return [p for p in made if p is not None]
