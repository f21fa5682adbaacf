"""``unroll train``: train a generated gpu-platform model on a dataset, resumably.

The model file is generated for the gpu platform with the chosen scheme and imported;
each step is ``loss = model(x, y)`` (the unrolled backward pass fills ``.grad``) and a
torch optimizer. After every epoch the test split is scored through ``predict()``, one
JSON line of metrics is appended to ``metrics.jsonl``, and ``checkpoint.pt`` (weights,
optimizer, epoch, RNG states, metrics so far, config) is replaced atomically.

Exact resumption. The order of the training samples in epoch ``e`` comes from a private
generator seeded with ``(seed, e)``, the learning rate is a function of the epoch, and
the checkpoint restores the global torch RNG states (stochastic compressors and dropout
draw from them) and Python's ``random`` state, so a run resumed from the checkpoint of
epoch ``e`` computes exactly what the uninterrupted run computed from epoch ``e + 1``
on (bit for bit on the same machine; tested). NumPy's RNG is not used. On CUDA, cuDNN
is put in deterministic mode for this; kernels that add with atomics (some pooling and
upsampling backward passes) can still differ in the last bits from run to run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import pickle
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unroller import data as datasets
from unroller.api import generate_source, import_generated, load_graph, write_atomic
from unroller.codegen import Options
from unroller.errors import ConfigError
from unroller.metrics import PRIMARY, MetricSet

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
RUN_INFO = "run.json"
GENERATED = "model.py"
FORMAT = 1
OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("cosine", "constant")
# Fields that may differ between a checkpoint and the run resuming from it.
RESUMABLE_CHANGES = ("epochs", "schedule_epochs")
PATH_FIELDS = ("model", "compress_config", "init")


class TrainError(ConfigError):
    """A training run that cannot start or continue (printed as is, exit 2)."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run's numbers."""

    model: str
    dataset: str = "digits"
    scheme: str = "nocompress"
    compress_config: str | None = None
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    seed: int = 0
    data_seed: int = 0
    train_size: int | None = None
    test_size: int | None = None
    resolution: int | None = None
    device: str = "cpu"
    init: str | None = None  # a state dict to start from instead of Model()'s initialisation
    schedule_epochs: int | None = None  # the lr schedule's length (default: epochs)

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(
                f"unknown optimizer '{self.optimizer}' (known: {', '.join(OPTIMIZERS)})"
            )
        if self.schedule not in SCHEDULES:
            raise TrainError(f"unknown schedule '{self.schedule}' (known: {', '.join(SCHEDULES)})")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.lr > 0:
            raise TrainError(f"--lr must be positive, got {self.lr}")
        for name in ("momentum", "weight_decay"):
            if not getattr(self, name) >= 0:
                flag = name.replace("_", "-")
                raise TrainError(f"--{flag} must be at least 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def lr_at(self, epoch: int) -> float:
        """The learning rate of 1-based ``epoch``: constant, or cosine from lr to lr/100
        over the schedule's length; epochs past it (a run extended with --epochs) stay at
        the final lr/100."""
        total = self.schedule_epochs or self.epochs
        floor = self.lr / 100
        if self.schedule == "constant":
            return self.lr
        if epoch > total:
            return floor
        if total == 1:
            return self.lr
        progress = (epoch - 1) / (total - 1)
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainError(f"unknown device '{name}' (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: this torch build or machine has no CUDA device")
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise TrainError(f"--device {name}: this machine has {count} CUDA device(s)")
    return device


def save_atomic(path: Path, payload: dict[str, Any]) -> None:
    """torch.save through a temporary file and a rename: a crash never leaves half a file."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_atomic(path, buffer.getvalue())


def rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states a step draws from: torch's CPU generator, Python's, and the CUDA
    generator of the training device (only that one: other GPUs are left alone)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"--resume: no such checkpoint: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise TrainError(f"--resume: {path} is not a readable checkpoint ({exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TrainError(f"--resume: {path} is not an unroller training checkpoint")
    return payload


def _same_setting(name: str, a: Any, b: Any) -> bool:
    """Equal settings; file paths compare as the files they name (cwd may differ)."""
    if name in PATH_FIELDS and a is not None and b is not None:
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def make_optimizer(config: TrainConfig, params) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)


def epoch_order(config: TrainConfig, epoch: int, count: int) -> torch.Tensor:
    """The shuffled sample order of an epoch: a function of (seed, epoch) only."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
    return torch.randperm(count, generator=generator)


def batches(count: int, batch_size: int) -> list[tuple[int, int]]:
    """Batch bounds; a last batch of one sample is dropped (batch norm needs two)."""
    bounds = [(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds.pop()
    return bounds


def evaluate(
    model, split: datasets.Split, task: str, logits: bool, batch_size: int, device
) -> dict:
    scores = MetricSet(task, logits=logits)
    reference = split.reference()
    for start in range(0, len(split), batch_size):
        stop = min(start + batch_size, len(split))
        pred = model.predict(split.inputs[start:stop].to(device))
        scores.update(pred.cpu(), reference[start:stop])
    return scores.result()


def train_epoch(
    model,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    split: datasets.Split,
    epoch: int,
    bounds: list[tuple[int, int]],
    device: torch.device,
    advance: Callable[[float], None],
) -> dict[str, Any]:
    """One pass over the training split; the epoch's metrics record (without ``test``).
    Stops at the first loss that is not finite and marks the record ``diverged``."""
    lr = config.lr_at(epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    order = epoch_order(config, epoch, len(split))
    loss_sum, seen, stash = 0.0, 0, None
    began = time.perf_counter()
    for first, last in bounds:
        index = order[first:last]
        args = [split.inputs[index].to(device)]
        if split.targets is not None:
            args.append(split.targets[index].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss = model(*args).item()
        if not math.isfinite(loss):
            return {"epoch": epoch, "lr": lr, "diverged": True, "train_loss": None, "test": None}
        optimizer.step()
        if stash is None:  # what the first step kept for backward
            stash = model.stash_report()
        loss_sum += loss * len(index)
        seen += len(index)
        advance(loss)
    return {
        "epoch": epoch,
        "lr": lr,
        "train_loss": loss_sum / seen,
        "test": None,
        "train_time_s": time.perf_counter() - began,
        "stash_batch": bounds[0][1] - bounds[0][0],
        "stash_raw_bytes": stash["total_raw_bytes"],
        "stash_stored_bytes": stash["total_stored_bytes"],
    }


@dataclass
class Run:
    """What ``train`` leaves behind, for callers (``unroll accuracy``, tests)."""

    config: TrainConfig
    out: Path
    task: str
    dataset: str  # the dataset's one-line description
    synthetic: bool
    history: list[dict[str, Any]]

    @property
    def primary(self) -> str:
        return PRIMARY[self.task]

    @property
    def finished(self) -> bool:
        return bool(self.history) and (
            self.history[-1]["epoch"] == self.config.epochs
            or self.history[-1].get("diverged", False)
        )


class Progress:
    """A per-epoch progress bar on a terminal (rich), plain epoch lines otherwise."""

    def __init__(self, enabled: bool, log: Callable[[str], None]):
        self.log = log
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            console = Console(stderr=True)
            if console.is_terminal:
                self.bar = RichProgress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"),
                    TimeElapsedColumn(),
                    console=console,
                    transient=True,
                )

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def epoch(self, label: str, total: int):
        if self.bar is None:
            return None
        return self.bar.add_task(label, total=total, loss="-")

    def advance(self, task_id, loss: float) -> None:
        if self.bar is not None and task_id is not None:
            self.bar.update(task_id, advance=1, loss=f"{loss:.4f}")

    def done(self, task_id, line: str) -> None:
        if self.bar is not None and task_id is not None:
            self.bar.remove_task(task_id)
            # through the live display's console, so the line does not tear the bar
            self.bar.console.print(line, markup=False, highlight=False)
            return
        self.log(line)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def generate(config: TrainConfig) -> str:
    """The text of the gpu-platform module the run trains."""
    options = Options(
        platform="gpu",
        scheme=config.scheme,
        compress_config=config.compress_config,
        resolution=config.resolution,
    )
    return generate_source(config.model, options)


def prepare(config: TrainConfig):
    """Generate the model, read its signature, build the dataset."""
    config.validate()
    source = generate(config)
    graph = load_graph(config.model, config.resolution)
    sig = datasets.signature(graph)
    data = datasets.load(config.dataset, sig, config.data_seed, config.train_size, config.test_size)
    return source, sig, data


def train(
    config: TrainConfig,
    out: str | Path,
    resume: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
) -> Run:
    """Train as ``config`` says, writing into ``out``; continue from ``resume`` if given
    (the checkpoint's config is used, except ``epochs``, which may grow)."""
    checkpoint = None
    if resume is not None:
        checkpoint = load_checkpoint(resume)
        recorded = TrainConfig.from_dict(checkpoint["config"])
        changed = [
            f.name
            for f in dataclasses.fields(TrainConfig)
            if f.name not in RESUMABLE_CHANGES
            and not _same_setting(f.name, getattr(recorded, f.name), getattr(config, f.name))
        ]
        if changed:
            details = ", ".join(
                f"{n} {getattr(recorded, n)!r} -> {getattr(config, n)!r}" for n in changed
            )
            raise TrainError(
                f"--resume: the checkpoint was made with other settings ({details}); "
                "only --epochs may change"
            )
        if checkpoint["epoch"] > config.epochs:
            raise TrainError(
                f"--resume: the checkpoint is at epoch {checkpoint['epoch']}, past --epochs {config.epochs}"
            )
        # the lr schedule keeps the length it was made with; extra epochs run at its end
        config = dataclasses.replace(
            config, schedule_epochs=recorded.schedule_epochs or recorded.epochs
        )
    elif (Path(out) / CHECKPOINT).exists():
        raise TrainError(
            f"{out} already holds a run; continue it with --resume {Path(out) / CHECKPOINT} "
            "or choose another --out"
        )
    device = resolve_device(config.device)
    if device.type == "cuda":
        # exact resumption needs run-to-run identical kernels: no autotuning, and the
        # deterministic cuDNN algorithms
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    source, sig, data = prepare(config)
    source_sha = hashlib.sha256(source.encode("utf-8")).hexdigest()
    if checkpoint is not None and checkpoint["generated_sha256"] != source_sha:
        raise TrainError(
            "--resume: the generated model differs from the checkpoint's (the model file, "
            "the scheme's config or the generator changed)"
        )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / GENERATED, source)
    module_name = f"unroller_train_{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}"
    Model = import_generated(out / GENERATED, module_name).Model

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model = Model()
    if config.init is not None and checkpoint is None:  # a resumed run has its weights
        try:
            model.load_state_dict(torch.load(config.init, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, pickle.UnpicklingError) as exc:
            raise TrainError(f"cannot start from {config.init}: {exc}") from None
    model.to(device)
    optimizer = make_optimizer(config, model.parameters())
    history: list[dict[str, Any]] = []
    start = 1
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        history = list(checkpoint["history"])
        start = checkpoint["epoch"] + 1
        set_rng_state(checkpoint["rng"], device)

    run = Run(config, out, data.task, data.description, data.synthetic, history)
    info = {
        "config": config.to_dict(),
        "task": data.task,
        "primary_metric": run.primary,
        "dataset": data.description,
        "synthetic": data.synthetic,
        "generated_sha256": source_sha,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    write_atomic(out / RUN_INFO, json.dumps(info, indent=2) + "\n")
    write_atomic(out / METRICS, "".join(json.dumps(r) + "\n" for r in history))
    if history and history[-1].get("diverged"):
        return run

    bounds = batches(len(data.train), config.batch_size)
    with Progress(progress, log) as bar:
        for epoch in range(start, config.epochs + 1):
            label = f"epoch {epoch}/{config.epochs}"
            task_id = bar.epoch(label, len(bounds))
            record = train_epoch(
                model,
                optimizer,
                config,
                data.train,
                epoch,
                bounds,
                device,
                lambda loss, t=task_id: bar.advance(t, loss),
            )
            if not record.get("diverged"):
                began = time.perf_counter()
                record["test"] = evaluate(
                    model, data.test, data.task, sig.logits, config.batch_size, device
                )
                record["eval_time_s"] = time.perf_counter() - began
            history.append(record)
            write_atomic(out / METRICS, "".join(json.dumps(r) + "\n" for r in history))
            save_atomic(
                out / CHECKPOINT,
                {
                    "format": FORMAT,
                    "epoch": epoch,
                    "config": config.to_dict(),
                    "generated_sha256": source_sha,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "rng": rng_state(device),
                    "history": history,
                },
            )
            if record.get("diverged"):
                bar.done(task_id, f"{label}: loss is not finite; stopped")
                break
            shown = ", ".join(f"{k} {v:.4g}" for k, v in record["test"].items())
            bar.done(
                task_id,
                f"{label}: train loss {record['train_loss']:.4g}, test {shown} "
                f"({record['train_time_s']:.1f} s)",
            )
    return run
