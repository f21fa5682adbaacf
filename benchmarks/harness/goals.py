"""The issue's goals, evaluated on the run's records and reported met / not met.

Nothing here asserts: each goal gives its figures, whether it was met, or why it could
not be evaluated (a scheme or peer not run, memory not measured).
"""

from __future__ import annotations

from typing import Any

from benchmarks.compress_bench import same_activations

NOCOMPRESS_TIME = 1.05  # ours:nocompress / autograd, step time
DENSE_BYTES = 1.0 / 12.0  # ours:dct-dense stored / nocompress stored, same activations
DENSE_TIME = 1.3  # ours:dct-dense / autograd, step time
DENSE_BATCH = 6.0  # max batch under the budget, ours:dct-dense / autograd
BATCH_GOAL_MODELS = ("resnet34", "emdenoise", "slstrcloud", "resnet_like", "unet_like")


def _goal(bench: str, key: str, text: str, met: bool | None, figures: str) -> dict[str, Any]:
    return {"benchmark": bench, "goal": key, "text": text, "met": met, "figures": figures}


def _peak(record: dict[str, Any] | None) -> int | None:
    mem = (record or {}).get("memory")
    return mem["step_peak_bytes"] if mem else None


def _ratio(record: dict[str, Any] | None) -> float | None:
    found = (record or {}).get("time_ratio")
    return found["median"] if found else None


def evaluate_benchmark(bench: str, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``runs``: the records of one benchmark by method name."""
    noc, dense, ag = runs.get("ours:nocompress"), runs.get("ours:dct-dense"), runs.get("autograd")
    goals = []

    text = f"ours:nocompress step time <= {NOCOMPRESS_TIME}x autograd (median of round ratios)"
    r = _ratio(noc)
    goals.append(
        _goal(
            bench,
            "nocompress_time",
            text,
            None if r is None else r <= NOCOMPRESS_TIME,
            "n/a" if r is None else f"{r:.3f}x",
        )
    )

    text = "ours:nocompress step peak memory <= autograd's"
    a, b = _peak(noc), _peak(ag)
    goals.append(
        _goal(
            bench,
            "nocompress_peak",
            text,
            None if a is None or b is None else a <= b,
            "n/a" if a is None or b is None else f"{a / b:.3f}x ({a} vs {b} bytes)",
        )
    )

    text = "ours:dct-dense stored bytes <= 1/12 of nocompress's for the same activations"
    if noc and dense:
        same = same_activations(
            dense["stash"]["rows"], {row["tensor"]: row for row in noc["stash"]["rows"]}
        )
        total = dense["stash"]["stored_bytes"] / noc["stash"]["stored_bytes"]
        ratio = same["ratio"]
        goals.append(
            _goal(
                bench,
                "dense_bytes",
                text,
                None if ratio is None else ratio <= DENSE_BYTES,
                f"{ratio:.4f} (1/{1 / ratio:.1f}) over {same['count']} compressed tensors; "
                f"all stored bytes {total:.4f} (1/{1 / total:.1f})",
            )
        )
    else:
        goals.append(_goal(bench, "dense_bytes", text, None, "needs nocompress and dct-dense"))

    text = "ours:dct-dense step peak memory below every peer's at the same batch"
    peers = {k: v for k, v in runs.items() if v["kind"] != "ours"}
    d = _peak(dense)
    peer_peaks = {k: _peak(v) for k, v in peers.items()}
    if d is None or not peers or None in peer_peaks.values():
        goals.append(_goal(bench, "dense_peak", text, None, "needs dct-dense, peers and memory"))
    else:
        figures = ", ".join(f"{d / p:.2f}x {k}" for k, p in peer_peaks.items())
        met = all(d < p for p in peer_peaks.values())
        goals.append(_goal(bench, "dense_peak", text, met, figures))

    text = f"ours:dct-dense step time <= {DENSE_TIME}x autograd"
    r = _ratio(dense)
    goals.append(
        _goal(
            bench,
            "dense_time",
            text,
            None if r is None else r <= DENSE_TIME,
            "n/a" if r is None else f"{r:.3f}x",
        )
    )

    text = f"max batch under the budget: ours:dct-dense >= {DENSE_BATCH:g}x autograd's"
    if bench not in BATCH_GOAL_MODELS:
        text += " (goal stated for ResNet-34 and the U-Nets; reported only)"
    mb_d = (dense or {}).get("max_batch")
    mb_a = (ag or {}).get("max_batch")
    if mb_d and mb_a and mb_a["max_batch"]:
        ratio = mb_d["max_batch"] / mb_a["max_batch"]
        met = ratio >= DENSE_BATCH if bench in BATCH_GOAL_MODELS else None
        slope = mb_a["bytes_per_sample"] / mb_d["bytes_per_sample"]
        goals.append(
            _goal(
                bench,
                "dense_max_batch",
                text,
                met,
                f"{ratio:.2f}x ({mb_d['max_batch']} vs {mb_a['max_batch']}); per-sample "
                f"bytes ratio (the limit for a large budget) {slope:.2f}x",
            )
        )
    else:
        goals.append(_goal(bench, "dense_max_batch", text, None, "needs the budget search"))
    return goals


def evaluate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_bench: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        by_bench.setdefault(rec["benchmark"], {})[rec["method"]] = rec
    return [g for bench, runs in by_bench.items() for g in evaluate_benchmark(bench, runs)]


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")
