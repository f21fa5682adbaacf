"""The issue's goals, evaluated on the run's records and reported met / not met.

Nothing here asserts: each goal gives its headline figure (``value``), the details
(``figures``), whether it was met (``met``; None where it cannot be evaluated: a scheme or
peer not run, memory not measured, or a goal stated for other models). "Well below"
every peer's peak is taken as at most ``DENSE_PEAK`` times it.
"""

from __future__ import annotations

from typing import Any

from unroller.bench.stashed import same_activations

NOCOMPRESS_TIME = 1.05  # ours:nocompress / autograd, step time
DENSE_BYTES = 1.0 / 12.0  # ours:dct-dense stored / nocompress stored, same activations
DENSE_PEAK = 0.9  # "well below": ours:dct-dense step peak / each peer's
DENSE_TIME = 1.3  # ours:dct-dense / autograd, step time
DENSE_BATCH = 6.0  # max batch under the budget, ours:dct-dense / autograd
BATCH_GOAL_MODELS = ("resnet34", "emdenoise", "slstrcloud", "resnet_like", "unet_like")

TEXTS = {
    "nocompress_time": f"ours:nocompress step time <= {NOCOMPRESS_TIME}x autograd",
    "nocompress_peak": "ours:nocompress step peak <= autograd's",
    "dense_bytes": "ours:dct-dense stored bytes <= 1/12 of nocompress's (same activations)",
    "dense_peak": f"ours:dct-dense step peak <= {DENSE_PEAK}x every peer's (same batch)",
    "dense_time": f"ours:dct-dense step time <= {DENSE_TIME}x autograd",
    "dense_max_batch": f"max batch under the budget: ours:dct-dense >= {DENSE_BATCH:g}x autograd's "
    "(ResNet-34 and the U-Nets)",
}


def _peak(record: dict[str, Any] | None) -> int | None:
    mem = (record or {}).get("memory")
    return mem["step_peak_bytes"] if mem else None


def _time_ratio(record: dict[str, Any] | None) -> float | None:
    found = (record or {}).get("time_ratio")
    return found["median"] if found else None


def _time_goal(record: dict[str, Any] | None, limit: float) -> tuple:
    r = _time_ratio(record)
    if r is None:
        return None, None, "not run"
    return r <= limit, f"{r:.3f}x", "median over rounds of the per-round time ratio"


def _nocompress_peak(noc: dict | None, ag: dict | None) -> tuple:
    a, b = _peak(noc), _peak(ag)
    if a is None or b is None:
        return None, None, "needs nocompress, autograd and --get-memory"
    return a <= b, f"{a / b:.3f}x", f"{a} vs {b} bytes"


def _dense_bytes(noc: dict | None, dense: dict | None) -> tuple:
    if not (noc and dense):
        return None, None, "needs nocompress and dct-dense"
    base = {row["tensor"]: row for row in noc["stash"]["rows"]}
    same = same_activations(dense["stash"]["rows"], base)
    ratio = same["ratio"]
    if ratio is None:
        return None, None, "dct-dense compressed nothing"
    total = dense["stash"]["stored_bytes"] / noc["stash"]["stored_bytes"]
    figures = (
        f"{same['count']} compressed tensors (masks kept with them included); all stored "
        f"bytes {total:.4f} (1/{1 / total:.1f})"
    )
    return ratio <= DENSE_BYTES, f"{ratio:.4f} (1/{1 / ratio:.1f})", figures


def _dense_peak(dense: dict | None, runs: dict[str, dict]) -> tuple:
    d = _peak(dense)
    peers = {k: _peak(v) for k, v in runs.items() if v["kind"] != "ours"}
    if d is None or not peers or None in peers.values():
        return None, None, "needs dct-dense, the peers and --get-memory"
    ratios = {k: d / p for k, p in peers.items()}
    worst = max(ratios, key=ratios.get)
    figures = ", ".join(f"{r:.2f}x {k}" for k, r in ratios.items())
    met = all(r <= DENSE_PEAK for r in ratios.values())
    return met, f"{ratios[worst]:.2f}x {worst}", figures


def _dense_batch(bench: str, dense: dict | None, ag: dict | None) -> tuple:
    mb_d, mb_a = (dense or {}).get("max_batch"), (ag or {}).get("max_batch")
    if not (mb_d and mb_a and mb_a["max_batch"]):
        return None, None, "needs dct-dense, autograd and --memory-budget"
    ratio = mb_d["max_batch"] / mb_a["max_batch"]
    slope = mb_a["bytes_per_sample"] / mb_d["bytes_per_sample"]
    figures = (
        f"{mb_d['max_batch']} vs {mb_a['max_batch']}; per-sample peak bytes ratio (the limit "
        f"for a large budget) {slope:.2f}x"
    )
    if bench not in BATCH_GOAL_MODELS:
        figures += "; goal stated for other models: reported only"
        return None, f"{ratio:.2f}x", figures
    return ratio >= DENSE_BATCH, f"{ratio:.2f}x", figures


def evaluate_benchmark(bench: str, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``runs``: the records of one benchmark by method name."""
    noc, dense, ag = runs.get("ours:nocompress"), runs.get("ours:dct-dense"), runs.get("autograd")
    found = {
        "nocompress_time": _time_goal(noc, NOCOMPRESS_TIME),
        "nocompress_peak": _nocompress_peak(noc, ag),
        "dense_bytes": _dense_bytes(noc, dense),
        "dense_peak": _dense_peak(dense, runs),
        "dense_time": _time_goal(dense, DENSE_TIME),
        "dense_max_batch": _dense_batch(bench, dense, ag),
    }
    return [
        {
            "benchmark": bench,
            "goal": key,
            "text": TEXTS[key],
            "met": met,
            "value": value,
            "figures": figures,
        }
        for key, (met, value, figures) in found.items()
    ]


def evaluate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_bench: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        by_bench.setdefault(rec["benchmark"], {})[rec["method"]] = rec
    return [g for bench, runs in by_bench.items() for g in evaluate_benchmark(bench, runs)]


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")
