"""``unroll accuracy``: what each compression scheme costs in accuracy, over seeds.

For every seed one initial state dict is made (``torch.manual_seed(seed); Model()``)
and every scheme trains from it, with the same data order, so the only difference
between two runs of a seed is what the scheme does to the saved activations. Each run
is an ordinary ``unroll train`` run in ``OUT/runs/SCHEME/seedS`` (metrics, checkpoint):
an interrupted experiment continues where it stopped when started again with the same
arguments, and finished runs are reused.

The table (``accuracy.md``, ``accuracy.csv``, ``summary.json``) gives per scheme the
final-epoch test metric's mean, sample standard deviation and range over seeds, the
difference of the mean from ``nocompress``, the bytes kept for backward in one step
relative to ``nocompress`` (measured by ``stash_report()`` on the first step), and the
median training time per epoch. ``METRIC.png`` and ``train_loss.png`` plot the mean
over seeds per epoch (band: min to max).

Schemes: the built-in ones, ``quant-8bit`` (= ``quant``), ``quant-4bit`` and
``quant-2bit`` (quant with 4 or 2 bits, written as config files in ``OUT/configs``), or
the path of a ``--compress-config`` TOML file. ``all`` is the first six.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from unroller.api import write_atomic
from unroller.compiler.schemes import SCHEMES
from unroller.materialize import load_file, load_source
from unroller.training.loop import (
    CHECKPOINT,
    GENERATED,
    TrainConfig,
    TrainError,
    check_model_state,
    generate,
    load_checkpoint,
    prepare,
    resolve_device,
    save_atomic,
    train,
)
from unroller.training.metrics import LABELS, REPORTED

ALL = ("nocompress", "dct-first", "dct-dense", "quant-8bit", "quant-4bit", "quant-2bit")
QUANT_BITS = {"quant-8bit": 8, "quant-4bit": 4, "quant-2bit": 2}
BASELINE = "nocompress"
DIGITS = {"iou": 4, "bpc": 3}  # decimals shown per metric (default 2)


def parse_schemes(text: str) -> list[str]:
    """``all`` or a comma-separated list of scheme labels or config-file paths."""
    labels: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        names = list(ALL) if item == "all" else ["quant-8bit" if item == "quant" else item]
        for name in names:
            if name not in SCHEMES and name not in QUANT_BITS and not name.endswith(".toml"):
                raise TrainError(
                    f"unknown scheme '{name}' (known: all, {', '.join(ALL)}, or a .toml config)"
                )
            if name.endswith(".toml") and not Path(name).is_file():
                raise TrainError(f"no such compression config: {name}")
            if name not in labels:
                labels.append(name)
    if not labels:
        raise TrainError("--schemes names no scheme")
    return labels


def label_of(scheme: str) -> str:
    return Path(scheme).stem if scheme.endswith(".toml") else scheme


def scheme_options(scheme: str, out: Path) -> tuple[str, str | None]:
    """(scheme, compress_config) for ``train``; quant-4bit/2bit get a config file."""
    if scheme.endswith(".toml"):
        return "nocompress", str(Path(scheme).resolve())
    if scheme == "quant-8bit":
        return "quant", None  # the built-in quant scheme is 8 bits
    if scheme in QUANT_BITS:
        path = out / "configs" / f"{scheme}.toml"
        text = (
            f"# {scheme}: the quant scheme at {QUANT_BITS[scheme]} bits (written by unroll accuracy)\n"
            # derivatives: as the built-in quant scheme, GELU/SiLU inputs as few-bit codes
            "derivatives = true\n"
            f'[default]\ncompressor = "quant"\nbits = {QUANT_BITS[scheme]}\n'
        )
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            write_atomic(path, text, follow_links=False)
        return "quant", str(path.resolve())
    return scheme, None


@dataclass
class Row:
    """One scheme's line of the table."""

    scheme: str
    metric: str
    seeds: list[int]
    finals: list[float | None]  # per seed; None if the run diverged
    mean: float | None
    std: float | None
    low: float | None
    high: float | None
    delta: float | None  # mean minus the baseline's mean
    stored_bytes: int | None
    stored_vs_baseline: float | None  # baseline bytes / these bytes
    epoch_time_s: float | None
    time_vs_baseline: float | None
    secondary: dict[str, float]
    diverged: int
    grad_error: float | None = None  # mean over seeds, see gradient_error()


def initial_state(config: TrainConfig, seed: int, out: Path) -> Path:
    """The shared initial weights of a seed, made once from the nocompress module (which
    is also the exact reference of the gradient probe). A folder whose nocompress module
    differs from what the model file generates now is refused: its runs are stale."""
    path = out / "init" / f"seed{seed}.pt"
    module_path = out / "init" / GENERATED
    source = generate(replace(config, scheme=BASELINE, compress_config=None))
    if module_path.is_file() and module_path.read_text(encoding="utf-8") != source:
        raise TrainError(
            f"{out} holds runs of another version of the model (or of the generator); "
            "use another --out or remove it"
        )
    if path.is_file():
        return path
    name = f"unroller_init_{abs(hash(str(out.resolve())))}"
    Model = load_source(source, module_path.parent, GENERATED, name, follow_links=False).Model
    torch.manual_seed(seed)
    save_atomic(path, Model().state_dict(), follow_links=False)
    return path


def run_one(config: TrainConfig, run_dir: Path, progress: bool, log) -> list[dict[str, Any]]:
    """Train (or reuse, or continue) one scheme x seed run; its metric history."""
    checkpoint_path = run_dir / CHECKPOINT
    resume = None
    if checkpoint_path.is_file():
        checkpoint = load_checkpoint(checkpoint_path)
        recorded = TrainConfig.from_dict(checkpoint["config"])
        # the same settings, epochs included (a longer cosine schedule is another run)
        if replace(recorded, schedule_epochs=None) != config:
            raise TrainError(
                f"{run_dir} holds a run with other settings; use another --out or remove it"
            )
        source = generate(config)
        if checkpoint["generated_sha256"] != hashlib.sha256(source.encode("utf-8")).hexdigest():
            raise TrainError(
                f"{run_dir} holds a run of another version of the model, its compression "
                "config or the generator; use another --out or remove it"
            )
        history = checkpoint["history"]
        if checkpoint["epoch"] >= config.epochs or (history and history[-1].get("diverged")):
            log(f"{run_dir}: finished earlier, reused")
            return history
        resume = checkpoint_path
    return train(config, run_dir, resume=resume, progress=progress, log=log).history


PROBE = "gradient_probe.json"


def gradient_error(config: TrainConfig, run_dir: Path, baseline: Path, data) -> float | None:
    """How far the scheme's gradients are from exact ones at the run's final weights:
    ``||g_scheme - g_nocompress|| / ||g_nocompress||`` over all parameters, for one
    training step on the first batch of the training split, both modules starting from
    the same weights, buffers and global RNG state at the start of the step (the same
    draws for dropout unless a stochastic compressor consumes some first). Cached in the run folder as ``gradient_probe.json``.
    """
    probe = run_dir / PROBE
    checkpoint = load_checkpoint(run_dir / CHECKPOINT)
    if probe.is_file():
        cached = json.loads(probe.read_text(encoding="utf-8"))
        if cached.get("epoch") == checkpoint["epoch"]:
            return cached["relative_l2"]
    if checkpoint["history"][-1].get("diverged"):
        return None
    device = resolve_device(config.device)
    count = min(config.batch_size, len(data.train))
    args = [data.train.inputs[:count].to(device)]
    if data.train.targets is not None:
        args.append(data.train.targets[:count].to(device))
    grads = []
    for index, module in enumerate((baseline, run_dir / GENERATED)):
        name = f"unroller_probe_{index}_{abs(hash(str(module.resolve())))}"
        model = load_file(module, name).Model()
        check_model_state(run_dir / CHECKPOINT, checkpoint["model"], model)
        model.load_state_dict(checkpoint["model"])
        model.to(device)
        torch.manual_seed(0)
        model(*args)
        grads.append(torch.cat([p.grad.flatten().double() for p in model.parameters()]))
    exact, approx = grads
    error = ((approx - exact).norm() / exact.norm().clamp_min(1e-300)).item()
    record = {"epoch": checkpoint["epoch"], "batch": count, "relative_l2": error}
    write_atomic(probe, json.dumps(record) + "\n", follow_links=False)
    return error


def _final(history: list[dict[str, Any]], metric: str) -> float | None:
    last = history[-1]
    return None if last.get("diverged") else last["test"][metric]


def summarise(
    results: dict[str, dict[int, list[dict[str, Any]]]],
    task: str,
    probes: dict[str, dict[int, float | None]] | None = None,
) -> list[Row]:
    """The table rows from each scheme's per-seed metric histories."""
    metric, *others = REPORTED[task]
    rows: list[Row] = []
    for scheme, per_seed in results.items():
        seeds = sorted(per_seed)
        finals = [_final(per_seed[s], metric) for s in seeds]
        good = [v for v in finals if v is not None]
        first = next((r for s in seeds for r in per_seed[s] if not r.get("diverged")), None)
        times = [r["train_time_s"] for s in seeds for r in per_seed[s] if not r.get("diverged")]
        secondary = {}
        for name in others:
            values = [_final(per_seed[s], name) for s in seeds]
            values = [v for v in values if v is not None]
            if values:
                secondary[name] = statistics.fmean(values)
        rows.append(
            Row(
                scheme=label_of(scheme),
                metric=metric,
                seeds=seeds,
                finals=finals,
                mean=statistics.fmean(good) if good else None,
                std=statistics.stdev(good) if len(good) > 1 else None,
                low=min(good) if good else None,
                high=max(good) if good else None,
                delta=None,
                stored_bytes=first["stash_stored_bytes"] if first else None,
                stored_vs_baseline=None,
                epoch_time_s=statistics.median(times) if times else None,
                time_vs_baseline=None,
                secondary=secondary,
                diverged=sum(v is None for v in finals),
                grad_error=_mean_of((probes or {}).get(scheme, {}).values()),
            )
        )
    base = next((r for r in rows if r.scheme == BASELINE), None)
    if base is not None:
        for row in rows:
            if row.mean is not None and base.mean is not None:
                row.delta = row.mean - base.mean
            if row.stored_bytes and base.stored_bytes:
                row.stored_vs_baseline = base.stored_bytes / row.stored_bytes
            if row.epoch_time_s and base.epoch_time_s:
                row.time_vs_baseline = row.epoch_time_s / base.epoch_time_s
    return rows


def _mean_of(values) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.fmean(found) if found else None


def _fmt_sig(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _fmt_error(value: float | None) -> str:
    if value is None:
        return "-"
    return "0 (exact)" if value == 0 else f"{value:.2g}"


def _fmt(value: float | None, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown(rows: list[Row], header: dict[str, Any]) -> str:
    metric = rows[0].metric
    label = LABELS[metric]
    unit = " pp" if metric.endswith("accuracy") else ""
    seeds = len(rows[0].seeds)
    lines = [
        f"# Accuracy by compression scheme: {header['model']} on {header['dataset_title']}",
        "",
        f"Command: `{header['command']}`",
        "",
        f"- Data: {header['dataset']}",
        f"- Training: {header['training']}",
        f"- Machine: {header['machine']}; table written {header['finished']}",
        "",
        f"| scheme | {label}, mean ± std ({seeds} seeds) | min - max | vs nocompress{unit} "
        "| gradient error | stored activations vs nocompress | time / epoch (s) "
        "| time vs nocompress |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        stored = "-" if row.stored_vs_baseline is None else f"1/{row.stored_vs_baseline:.1f}"
        if row.stored_vs_baseline is not None and row.stored_vs_baseline < 1.05:
            stored = f"{1 / row.stored_vs_baseline:.2f}x"
        digits = DIGITS.get(row.metric, 2)
        if row.mean is None:
            mean = "diverged"
        elif row.std is None:  # one finished seed: no spread to show
            mean = _fmt(row.mean, digits)
        else:
            mean = f"{_fmt(row.mean, digits)} ± {_fmt(row.std, digits)}"
        if row.diverged and row.mean is not None:
            mean += f" ({row.diverged} diverged)"
        lines.append(
            f"| {row.scheme} | {mean} | {_fmt(row.low, digits)} - {_fmt(row.high, digits)} "
            f"| {_fmt(row.delta, digits, signed=True)} | {_fmt_error(row.grad_error)} | {stored} "
            f"| {_fmt(row.epoch_time_s)} "
            f"| {_fmt(row.time_vs_baseline)}x |"
        )
    lines += [
        "",
        "Gradient error: relative L2 distance of all parameter gradients from the exact "
        "(nocompress) ones, one step on the first training batch at the run's final "
        "weights, mean over seeds. "
        "Stored activations: bytes kept for the backward pass in one training step (first "
        "step, same batch), measured by `stash_report()`; 1/k means k times fewer than "
        "nocompress. Time: median seconds of training per epoch (evaluation excluded).",
    ]
    others = [k for k in rows[0].secondary]
    if others:
        lines += ["", "| scheme | " + " | ".join(LABELS[k] + " (mean)" for k in others) + " |"]
        lines.append("|---|" + "---|" * len(others))
        for row in rows:
            cells = " | ".join(_fmt_sig(row.secondary.get(k)) for k in others)
            lines.append(f"| {row.scheme} | {cells} |")
    return "\n".join(lines) + "\n"


def csv_text(rows: list[Row]) -> str:
    buffer = io.StringIO()
    seeds = rows[0].seeds
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(
        ["scheme", "metric", "mean", "std", "min", "max", "delta_vs_nocompress"]
        + [f"seed{s}" for s in seeds]
        + ["gradient_error", "stored_bytes", "stored_vs_nocompress", "epoch_time_s"]
        + ["time_vs_nocompress", "diverged"]
    )
    for row in rows:
        writer.writerow(
            [row.scheme, row.metric, row.mean, row.std, row.low, row.high, row.delta]
            + row.finals
            + [
                row.grad_error,
                row.stored_bytes,
                row.stored_vs_baseline,
                row.epoch_time_s,
                row.time_vs_baseline,
                row.diverged,
            ]
        )
    return buffer.getvalue()


def _curves(per_seed: dict[int, list[dict[str, Any]]], key: str):
    """Per epoch: the epochs, and the mean, min and max over seeds of ``key``."""
    xs, means, lows, highs = [], [], [], []
    for epoch in sorted({r["epoch"] for h in per_seed.values() for r in h}):
        values = [
            r["train_loss"] if key == "train_loss" else r["test"][key]
            for history in per_seed.values()
            for r in history
            if r["epoch"] == epoch and not r.get("diverged")
        ]
        if values:
            xs.append(epoch)
            means.append(statistics.fmean(values))
            lows.append(min(values))
            highs.append(max(values))
    return xs, means, lows, highs


def plot(
    results: dict[str, dict[int, list[dict[str, Any]]]], metric: str, title: str, out: Path
) -> list[Path]:
    """``METRIC.png`` (all epochs, and the second half zoomed in, where the schemes'
    differences show) and ``train_loss.png`` (log scale): per epoch, the mean over seeds
    with a band from the minimum to the maximum."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise TrainError("the plots need matplotlib: pip install matplotlib") from None
    written = []
    for key, name, ylabel in (
        (metric, f"{metric}.png", LABELS[metric]),
        ("train_loss", "train_loss.png", "training loss"),
    ):
        zoom = key != "train_loss"
        fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(12 if zoom else 7, 4.5))
        axes = list(axes) if zoom else [axes]
        for scheme, per_seed in results.items():
            xs, means, lows, highs = _curves(per_seed, key)
            if not xs:
                continue
            for index, ax in enumerate(axes):
                first = 0 if index == 0 else len(xs) // 2
                (line,) = ax.plot(
                    xs[first:], means[first:], marker="o", markersize=3, label=label_of(scheme)
                )
                ax.fill_between(
                    xs[first:], lows[first:], highs[first:], color=line.get_color(), alpha=0.15
                )
        for index, ax in enumerate(axes):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.set_title(title if index == 0 else "second half of training", fontsize=10)
        if key == "train_loss":
            axes[0].set_yscale("log")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = out / name
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=110)
        plt.close(fig)
        write_atomic(path, image.getvalue(), follow_links=False)
        written.append(path)
    return written


def run_accuracy(
    base: TrainConfig,
    schemes: list[str],
    seeds: list[int],
    out: str | Path,
    command: str = "",
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Train every scheme for every seed from shared initial weights; write the table."""
    out = Path(out)
    device = resolve_device(base.device)
    out.mkdir(parents=True, exist_ok=True)
    _, sig, data = prepare(base)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    probes: dict[str, dict[int, float | None]] = {}
    for seed in seeds:
        init = initial_state(replace(base, seed=seed), seed, out)
        for scheme in schemes:
            name, config_path = scheme_options(scheme, out)
            config = replace(
                base, scheme=name, compress_config=config_path, seed=seed, init=str(init.resolve())
            )
            log(f"== {label_of(scheme)}, seed {seed}")
            run_dir = out / "runs" / label_of(scheme) / f"seed{seed}"
            results.setdefault(scheme, {})[seed] = run_one(config, run_dir, progress, log)
            probes.setdefault(scheme, {})[seed] = gradient_error(
                config, run_dir, out / "init" / GENERATED, data
            )
    rows = summarise(results, data.task, probes)
    header = {
        "model": sig.model,
        "dataset_title": data.title,
        "dataset": data.description,
        "command": command or "(library call)",
        "training": (
            f"{base.epochs} epochs, batch {base.batch_size}, {base.optimizer} lr {base.lr} "
            f"({base.schedule}), momentum {base.momentum}, weight decay {base.weight_decay}, "
            f"seeds {', '.join(map(str, seeds))}, same initial weights for every scheme"
        ),
        "machine": (
            f"{platform.machine()} {platform.system()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, device {device}"
            + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        ),
        "finished": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    write_atomic(out / "accuracy.md", markdown(rows, header), follow_links=False)
    write_atomic(out / "accuracy.csv", csv_text(rows), follow_links=False)
    summary = {"header": header, "task": data.task, "rows": [asdict(r) for r in rows]}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n", follow_links=False)
    plot(results, rows[0].metric, f"{sig.model} on {data.title}", out)
    return rows
