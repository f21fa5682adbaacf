"""The suite's targets: thresholds a run's records are checked against, each reported
met / not met / n/a in bench.md and as the ``goal`` lines of bench.jsonl.

Nothing here asserts: each target gives its headline figure (``value``), the details
(``figures``), and whether the run met it (``met``; None where it cannot be evaluated: a
scheme or peer not run, memory not measured, or a target stated for other models).
"Well below" every peer's peak is taken as at most ``DENSE_PEAK`` times it.

Under the memory budget (the "quarter" budget by default) the targets are checked for
``auto`` and dct-dense (``BUDGET_SCHEMES``), one entry per scheme run: max batch >= 6x
autograd's on ResNet-34, within 1.25x of the floor-limited ideal on the U-Nets and
OpticalDamage, ahead of every hook-based peer and of checkpointing; for every ours:*
method: samples/s at its max batch >= 0.85x autograd's at autograd's max batch, and the
measured step peak <= 1.25x the predicted floor; on the CPU, ResNet-34 step times against
autograd (``CPU_TIME``, the +compile rows included).

Bytes per sample (the slope of the measured step peak between two batches,
``unroller.bench.per_sample``: the large-budget limit of the max-batch ratio, which no
choice of budget moves): on the transformers (``TRANSFORMERS``) ours:nocompress keeps no
more per sample than autograd, and the best ours:* whose step time is within
``PER_SAMPLE_TIME`` of autograd's keeps ``PER_SAMPLE_LESS`` times less per sample than
autograd and less than checkpointing; on ResNet-34 the same best keeps
``PER_SAMPLE_LESS`` times less. "Best" is picked among the rows that meet the time bound,
so a scheme that saves memory only by being slow cannot meet it. These entries carry the
command that measured them (``command``).
"""

from __future__ import annotations

import math
from typing import Any

from unroller.bench.stashed import same_activations

NOCOMPRESS_TIME = 1.05  # ours:nocompress / autograd, step time
DENSE_BYTES = 1.0 / 12.0  # ours:dct-dense stored / nocompress stored, same activations
DENSE_PEAK = 0.9  # "well below": ours:dct-dense step peak / each peer's
DENSE_TIME = 1.3  # ours:dct-dense / autograd, step time
DENSE_BATCH = 6.0  # max batch under the budget, ours:auto or ours:dct-dense / autograd
BATCH_GOAL_MODELS = ("resnet34", "resnet_like")
IDEAL_BATCH = 1.25  # floor-limited ideal max batch / max batch
IDEAL_GOAL_MODELS = ("emdenoise", "slstrcloud", "opticaldamage", "unet_like")
BUDGET_SCHEMES = ("auto", "dct-dense")
SPEED_AT_MAX = 0.85  # samples/s at the max batch, ours / autograd at its own max batch
FLOOR = 1.25  # measured step peak / predicted floor
CPU_TIME = {"nocompress": 1.00, "quant": 1.15, "dct-dense": 1.15}  # ResNet-34, CPU
CPU_TIME_MODELS = ("resnet34",)
TRANSFORMERS = ("vit_tiny", "gpt_tiny", "gpt_small", "bert_encoder")
PER_SAMPLE_LESS = 8.0  # autograd's bytes per sample / the best ours:*'s
PER_SAMPLE_TIME = 1.3  # the best is picked among ours:* at most this step time vs autograd
PER_SAMPLE_CNN = ("resnet34",)
#: under a mixed precision (every peer under torch.autocast): the best ours:* at
#: PER_SAMPLE_TIME keeps PER_SAMPLE_LESS_MIXED times less per sample than autograd under
#: autocast on these models (the imported LoRA Llama of the lora_llama preset included),
#: and less than every checkpointing peer under autocast
PER_SAMPLE_LESS_MIXED = 16.0
MIXED_GOAL_MODELS = ("vit_tiny", "gpt_small", "bert_encoder", "lora_llama")
MIB = 2**20

TEXTS = {
    "nocompress_time": f"ours:nocompress step time <= {NOCOMPRESS_TIME}x autograd",
    "nocompress_peak": "ours:nocompress step peak <= autograd's",
    "dense_bytes": "ours:dct-dense stored bytes <= 1/12 of nocompress's (same activations)",
    "dense_peak": f"ours:dct-dense step peak <= {DENSE_PEAK}x every peer's (same batch)",
    "dense_time": f"ours:dct-dense step time <= {DENSE_TIME}x autograd",
    "max_batch": "max batch under the budget: ours:{scheme} >= " + f"{DENSE_BATCH:g}x autograd's "
    "(ResNet-34)",
    "ideal_batch": "max batch under the budget: ours:{scheme} within "
    + f"{IDEAL_BATCH:g}x of the floor-limited ideal (the U-Nets and OpticalDamage)",
    "ahead_of_peers": "max batch under the budget: ours:{scheme} ahead of every hook-based "
    "peer and of checkpointing",
    "speed_at_max_batch": f"samples/s at the max batch: every ours:* >= {SPEED_AT_MAX:g}x "
    "autograd's at its own max batch",
    "floor": f"measured step peak <= {FLOOR:g}x the predicted floor, every ours:*",
    "cpu_time": "CPU ResNet-34 step time vs autograd: "
    + ", ".join(f"{s} <= {v:.2f}x" for s, v in CPU_TIME.items())
    + " (and their +compile rows)",
    "per_sample_nocompress": "bytes per sample (slope of the measured step peak): "
    "ours:nocompress <= autograd's (transformers)",
    "per_sample_best": f"bytes per sample: the best ours:* at step time <= {PER_SAMPLE_TIME:g}x "
    f"autograd's keeps >= {PER_SAMPLE_LESS:g}x less than autograd, and less than "
    "checkpointing (transformers)",
    "per_sample_best_mixed": "bytes per sample, {precision}: the best ours:* at step time <= "
    f"{PER_SAMPLE_TIME:g}x autograd's under torch.autocast keeps >= {PER_SAMPLE_LESS_MIXED:g}x "
    "less than autograd under torch.autocast, and less than every checkpointing peer under "
    "torch.autocast",
    "per_sample_best_imported": "bytes per sample: the best ours:* at step time <= "
    f"{PER_SAMPLE_TIME:g}x autograd's keeps >= {PER_SAMPLE_LESS:g}x less than autograd, and "
    "less than every checkpointing peer (Hugging Face gradient checkpointing included)",
    "max_batch_imported": "max batch under the budget: the largest of ours:* at step time <= "
    f"{PER_SAMPLE_TIME:g}x autograd's ahead of autograd's and of every checkpointing peer's",
    "per_sample_best_cnn": "bytes per sample: the best ours:* at step time <= "
    f"{PER_SAMPLE_TIME:g}x autograd's keeps >= {PER_SAMPLE_LESS:g}x less than autograd "
    "(ResNet-34)",
}
# the key dct-dense's max-batch target is recorded under (older runs' bench.jsonl use it too)
GOAL_KEYS = {("max_batch", "dct-dense"): "dense_max_batch"}


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


def _batch_of(record: dict[str, Any] | None) -> int | None:
    mb = (record or {}).get("max_batch")
    return None if not mb else mb["max_batch"]


def _max_batch(bench: str, ours: dict | None, ag: dict | None) -> tuple:
    mb_d, mb_a = (ours or {}).get("max_batch"), (ag or {}).get("max_batch")
    if not (mb_d and mb_a and mb_a["max_batch"]):
        return None, None, "needs the scheme, autograd (fitting a batch) and --memory-budget"
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


def _ideal_batch(bench: str, ours: dict | None) -> tuple:
    pred = (ours or {}).get("predicted") or {}
    ideal, n = pred.get("ideal_max_batch"), _batch_of(ours)
    if ideal is None or n is None:
        return None, None, "needs the scheme, --memory-budget and the memory model"
    per = pred["floor_per_sample_bytes"] / 2**20
    figures = (
        f"max batch {n}, ideal {ideal} (floor {pred['floor_fixed_bytes'] / 2**20:.2f} MiB + "
        f"{per:.3f} MiB x batch)"
    )
    if not n:
        met = None if not ideal else False
        return (met if bench in IDEAL_GOAL_MODELS else None), "no batch fits", figures
    ratio = ideal / n
    if bench not in IDEAL_GOAL_MODELS:
        return None, f"{ratio:.2f}x", figures + "; goal stated for other models: reported only"
    return ratio <= IDEAL_BATCH, f"{ratio:.2f}x", figures


def _ahead_of_peers(ours: dict | None, runs: dict[str, dict]) -> tuple:
    n = _batch_of(ours)
    rivals = {k: _batch_of(v) for k, v in runs.items() if v["kind"] in ("hooks", "checkpoint")}
    if n is None or not rivals or None in rivals.values():
        return None, None, "needs the scheme, a hook-based peer or checkpointing, --memory-budget"
    best = max(rivals, key=rivals.get)
    figures = f"{n} vs " + ", ".join(f"{k} {v}" for k, v in rivals.items())
    return n > rivals[best], f"{n} vs {rivals[best]} ({best})", figures + " (ahead: strictly more)"


def _worst(ratios: dict[str, float], limit: float, larger_is_better: bool) -> tuple:
    """Met when every ratio is on the right side of ``limit``; the value names the worst."""
    pick = min if larger_is_better else max
    worst = pick(ratios, key=ratios.get)
    ok = [(r >= limit) if larger_is_better else (r <= limit) for r in ratios.values()]
    figures = ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items())
    return all(ok), f"{ratios[worst]:.2f}x {worst}", figures


def _speed_at_max_batch(runs: dict[str, dict]) -> tuple:
    ratios = {}
    for name, rec in runs.items():
        sp = rec.get("max_batch_speed") or {}
        if rec["kind"] == "ours" and sp.get("ratio_vs_autograd"):
            ratios[name] = sp["ratio_vs_autograd"]["median"]
    if not ratios:
        return None, None, "needs ours, autograd and --memory-budget"
    met, value, figures = _worst(ratios, SPEED_AT_MAX, True)
    timed = {k: runs[k]["max_batch_speed"]["batch"] for k in [*ratios, "autograd"] if k in runs}
    return (
        met,
        value,
        figures + "; timed at batch " + ", ".join(f"{k} {n}" for k, n in timed.items()),
    )


def _floor(runs: dict[str, dict]) -> tuple:
    ratios = {
        name: rec["predicted"]["measured_over_floor"]
        for name, rec in runs.items()
        if rec["kind"] == "ours" and (rec.get("predicted") or {}).get("measured_over_floor")
    }
    if not ratios:
        return None, None, "needs ours, --get-memory and the memory model"
    return _worst(ratios, FLOOR, False)


def _cpu_time(bench: str, runs: dict[str, dict], device: str | None) -> tuple:
    if device != "cpu" or bench not in CPU_TIME_MODELS:
        return None, None, f"stated for ResNet-34 on the CPU; ran on {device}"
    limits = {}
    for name, rec in runs.items():
        plain = name in (f"ours:{rec['scheme']}", f"ours:{rec['scheme']}+compile")
        if plain and rec["scheme"] in CPU_TIME and _time_ratio(rec) is not None:
            limits[name] = CPU_TIME[rec["scheme"]]
    if not limits:
        return None, None, "needs ours:nocompress, quant or dct-dense"
    ratios = {k: _time_ratio(runs[k]) for k in limits}
    met = all(ratios[k] <= limits[k] for k in limits)
    worst = max(limits, key=lambda k: ratios[k] / limits[k])
    figures = ", ".join(f"{k} {ratios[k]:.3f}x (<= {limits[k]:.2f}x)" for k in limits)
    batch = next(iter(runs.values()))["batch"]
    return (
        met,
        f"{ratios[worst]:.3f}x {worst}",
        f"{figures}; batch {batch} (the goal is stated at 32)",
    )


def _slope(record: dict[str, Any] | None) -> float | None:
    """A record's bytes per sample (``per_sample.slope``), None without a figure."""
    return ((record or {}).get("per_sample") or {}).get("bytes_per_sample")


def _why_no_slope(name: str, record: dict[str, Any] | None) -> str:
    """Why ``record`` has no bytes per sample: not run, memory not measured, or the
    slope's own problem (equal peaks, a falling peak)."""
    if record is None:
        return f"{name} not run"
    found = record.get("per_sample")
    if not found:
        return f"{name}: no bytes per sample (needs --get-memory)"
    return f"{name}: {found['problem']}"


def _per_sample_nocompress(noc: dict | None, ag: dict | None) -> tuple:
    """ours:nocompress's bytes per sample against autograd's (same two batches)."""
    a, b = _slope(noc), _slope(ag)
    if a is None or b is None:
        why = [_why_no_slope(n, r) for n, r in (("ours:nocompress", noc), ("autograd", ag))]
        return None, None, "; ".join(w for w, v in zip(why, (a, b)) if v is None)
    if noc["per_sample"]["batches"] != ag["per_sample"]["batches"]:
        return None, None, "measured between different batches"
    span = "->".join(f"b{n}" for n in ag["per_sample"]["batches"])
    figures = f"{a / MIB:.3f} vs {b / MIB:.3f} MiB per sample ({span})"
    return a <= b, f"{a / b:.3f}x", figures


def _per_sample_best(
    runs: dict[str, dict], against_checkpoint: bool, less: float = PER_SAMPLE_LESS
) -> tuple:
    """The ours:* row with the least bytes per sample among those whose step time is at
    most PER_SAMPLE_TIME x autograd's: >= ``less`` x less than autograd's, and
    (``against_checkpoint``) less than every checkpointing peer's (``checkpoint``, and
    the lora_llama preset's Hugging Face gradient checkpointing)."""
    goal = less
    ag = runs.get("autograd")
    base = _slope(ag)
    if base is None:
        return None, None, _why_no_slope("autograd", ag)
    span = ag["per_sample"]["batches"]
    rows = {
        name: rec
        for name, rec in runs.items()
        if rec["kind"] == "ours"
        and _slope(rec) is not None
        and rec["per_sample"]["batches"] == span
        and _time_ratio(rec) is not None
    }
    if not rows:
        return None, None, "needs ours:* rows with a bytes per sample and a step time"
    parts = [f"autograd {base / MIB:.3f} MiB per sample (b{span[0]}->b{span[1]})"]
    parts += [
        f"{name} {base / _slope(rec):.2f}x less at {_time_ratio(rec):.3f}x time"
        for name, rec in rows.items()
    ]
    within = {k: v for k, v in rows.items() if _time_ratio(v) <= PER_SAMPLE_TIME}
    if not within:
        return False, f"no ours:* within {PER_SAMPLE_TIME:g}x time", "; ".join(parts)
    best = min(within, key=lambda k: _slope(within[k]))
    less = base / _slope(within[best])
    met: bool | None = less >= goal
    value = f"{less:.2f}x less ({best}, {_time_ratio(within[best]):.3f}x time)"
    if against_checkpoint:
        rivals = {k: v for k, v in runs.items() if v["kind"] == "checkpoint"} or {
            "checkpoint": None
        }
        for name, ck in rivals.items():
            rival = _slope(ck)
            if rival is None:
                parts.append(_why_no_slope(name, ck))
                met = False if not met else None
            else:
                parts.append(f"{name} {base / rival:.2f}x less")
                met = met and _slope(within[best]) < rival
    return met, value, "; ".join(parts)


def _entry(
    bench: str,
    key: str,
    found: tuple,
    scheme: str | None = None,
    command: str | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    met, value, figures = found
    entry = {
        "benchmark": bench,
        "goal": GOAL_KEYS.get((key, scheme), key if scheme is None else f"{key}:{scheme}"),
        "text": TEXTS[key].format(scheme=scheme, precision=precision),
        "met": met,
        "value": value,
        "figures": figures,
    }
    if command is not None:
        entry["command"] = command
    return entry


def _budget_goals(bench: str, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scheme of ``BUDGET_SCHEMES`` run, and its +recompute rows (``--recompute``);
    dct-dense's entries even when not run."""
    variants = [v for s in BUDGET_SCHEMES for v in (s, f"{s}+recompute")]
    schemes = [s for s in variants if f"ours:{s}" in runs] or ["dct-dense"]
    ag = runs.get("autograd")
    found = []
    for scheme in schemes:
        ours = runs.get(f"ours:{scheme}")
        found.append(_entry(bench, "max_batch", _max_batch(bench, ours, ag), scheme))
        found.append(_entry(bench, "ideal_batch", _ideal_batch(bench, ours), scheme))
        found.append(_entry(bench, "ahead_of_peers", _ahead_of_peers(ours, runs), scheme))
    return found


def _precision(runs: dict[str, dict[str, Any]]) -> str:
    """The --precision the records were measured in (records before the flag: fp32)."""
    return next((r.get("precision") or "fp32" for r in runs.values()), "fp32")


def _per_sample_goals(
    bench: str, runs: dict[str, dict[str, Any]], command: str | None
) -> list[dict[str, Any]]:
    """The bytes-per-sample targets of ``bench``: the transformers' two, ResNet-34's one;
    under a mixed precision on ``MIXED_GOAL_MODELS``, nocompress's and the mixed one."""
    precision = _precision(runs)
    if precision.endswith("-mixed") and bench in MIXED_GOAL_MODELS:
        noc = _per_sample_nocompress(runs.get("ours:nocompress"), runs.get("autograd"))
        best = _per_sample_best(runs, True, PER_SAMPLE_LESS_MIXED)
        return [
            _entry(bench, "per_sample_nocompress", noc, command=command),
            _entry(bench, "per_sample_best_mixed", best, command=command, precision=precision),
        ]
    if bench in TRANSFORMERS:
        noc = _per_sample_nocompress(runs.get("ours:nocompress"), runs.get("autograd"))
        return [
            _entry(bench, "per_sample_nocompress", noc, command=command),
            _entry(bench, "per_sample_best", _per_sample_best(runs, True), command=command),
        ]
    if bench in PER_SAMPLE_CNN:
        best = _per_sample_best(runs, False)
        return [_entry(bench, "per_sample_best_cnn", best, command=command)]
    return []


def evaluate_benchmark(
    bench: str,
    runs: dict[str, dict[str, Any]],
    device: str | None = None,
    command: str | None = None,
) -> list[dict[str, Any]]:
    """``runs``: the records of one benchmark by method name; ``device``: where the steps
    ran (the CPU time target needs "cpu"); ``command``: the command line that measured
    them, carried by the bytes-per-sample entries. One entry per target checked."""
    noc, dense, ag = runs.get("ours:nocompress"), runs.get("ours:dct-dense"), runs.get("autograd")
    found = {
        "nocompress_time": _time_goal(noc, NOCOMPRESS_TIME),
        "nocompress_peak": _nocompress_peak(noc, ag),
        "dense_bytes": _dense_bytes(noc, dense),
        "dense_peak": _dense_peak(dense, runs),
        "dense_time": _time_goal(dense, DENSE_TIME),
    }
    entries = [_entry(bench, key, value) for key, value in found.items()]
    entries += _budget_goals(bench, runs)
    entries.append(_entry(bench, "speed_at_max_batch", _speed_at_max_batch(runs)))
    entries.append(_entry(bench, "floor", _floor(runs)))
    if bench in CPU_TIME_MODELS:
        entries.append(_entry(bench, "cpu_time", _cpu_time(bench, runs, device)))
    entries += _per_sample_goals(bench, runs, command)
    return entries


def _max_batch_imported(runs: dict[str, dict[str, Any]]) -> tuple:
    """The largest max batch of the ours:* rows within PER_SAMPLE_TIME of autograd's time
    against autograd's and every checkpointing peer's (ahead: strictly more)."""
    searched = {k: v for k, v in runs.items() if v["kind"] == "ours" and _batch_of(v) is not None}
    ours = {k: v for k, v in searched.items() if (_time_ratio(v) or math.inf) <= PER_SAMPLE_TIME}
    rivals = {k: _batch_of(v) for k, v in runs.items() if v["kind"] in ("autograd", "checkpoint")}
    if not searched or "autograd" not in rivals or None in rivals.values():
        return None, None, "needs ours:*, autograd and --memory-budget"
    if not ours:
        return False, f"no ours:* within {PER_SAMPLE_TIME:g}x time", ""
    best = max(ours, key=lambda k: _batch_of(ours[k]))
    n = _batch_of(ours[best])
    marks = {
        k: "" if (v.get("max_batch") or {}).get("confirmed") else " (predicted)"
        for k, v in runs.items()
        if v.get("max_batch")
    }
    figures = ", ".join(f"{k} {_batch_of(v)}{marks.get(k, '')}" for k, v in runs.items())
    base = rivals["autograd"]
    value = f"{n}{marks.get(best, '')} ({best})" + (f", {n / base:.2f}x autograd's" if base else "")
    return all(n > r for r in rivals.values()), value, figures


def evaluate_imported(
    bench: str, runs: dict[str, dict[str, Any]], command: str | None = None
) -> list[dict[str, Any]]:
    """The targets of an imported network (the lora_llama preset, ``NAME@SEQUENCE``):
    nocompress's bytes per sample, the best ours:* against autograd and every
    checkpointing peer (the mixed-precision goal too under a mixed precision), and the
    max batch under the budget where it was searched."""
    precision = _precision(runs)
    noc = _per_sample_nocompress(runs.get("ours:nocompress"), runs.get("autograd"))
    found = [
        _entry(bench, "per_sample_nocompress", noc, command=command),
        _entry(bench, "per_sample_best_imported", _per_sample_best(runs, True), command=command),
    ]
    if precision.endswith("-mixed") and bench.split("@")[0] in MIXED_GOAL_MODELS:
        best = _per_sample_best(runs, True, PER_SAMPLE_LESS_MIXED)
        found.append(
            _entry(bench, "per_sample_best_mixed", best, command=command, precision=precision)
        )
    if any(r.get("max_batch") for r in runs.values()):
        found.append(
            _entry(bench, "max_batch_imported", _max_batch_imported(runs), command=command)
        )
    return found


def evaluate(
    records: list[dict[str, Any]], device: str | None = None, command: str | None = None
) -> list[dict[str, Any]]:
    """Every target checked on a run's records (grouped by benchmark, then method); an
    imported network's records (``NAME@SEQUENCE``) get ``evaluate_imported``'s."""
    by_bench: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        by_bench.setdefault(rec["benchmark"], {})[rec["method"]] = rec
    return [
        g
        for bench, runs in by_bench.items()
        for g in (
            evaluate_imported(bench, runs, command)
            if "@" in bench
            else evaluate_benchmark(bench, runs, device, command)
        )
    ]


def verdict(met: bool | None) -> str:
    """How an entry's ``met`` is printed: met, NOT met, or n/a (not evaluated)."""
    return "n/a" if met is None else ("met" if met else "NOT met")
