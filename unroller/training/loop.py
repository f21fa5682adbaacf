"""``unroll train``: train a generated gpu-platform model on a dataset, resumably.

The model file is generated for the gpu platform with the chosen scheme and imported;
each step is ``loss = model(x, y)`` (the unrolled backward pass fills ``.grad``) and a
torch optimizer. After every epoch the test split is scored through ``predict()``, one
JSON line of metrics is appended to ``metrics.jsonl``, and ``checkpoint.pt`` (weights,
optimizer, epoch, RNG states, metrics so far, config) is replaced atomically.

The checkpoint file. ``checkpoint.pt`` is what ``torch.save`` writes (a zip archive,
still readable with ``torch.load(..., weights_only=True)``) with one addition: the
archive's comment, the last bytes of the file, is ``unroller-checkpoint sha256:`` and
the SHA-256 (hex) of every byte before it. ``load_checkpoint`` checks that digest
before anything is deserialised, so a flipped byte anywhere in the file (tensor data,
zip headers, the digest itself) is refused instead of resumed from; it then loads with
``weights_only=True`` (a checkpoint is user-supplied input: no pickled code runs) and
checks the structure (keys, types, the config's fields, the history). ``train`` checks
the weights and the optimizer state against the model being resumed (names, shapes,
dtypes) and the RNG states before it writes anything. Checkpoints of format 1 (before
the digest) are refused: their contents cannot be verified.

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

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import random
import stat
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from unroller import data as datasets
from unroller.api import (
    PathError,
    file_kind,
    generate_source,
    load_graph,
    read_bounded,
    write_atomic,
)
from unroller.compiler.options import Options, check_field
from unroller.materialize import load_file
from unroller.parallel.checkpoint import load_sharded, plain_optimizer_state, plain_state
from unroller.parallel.shard import sharder_of
from unroller.runtime.in_backward import attach, updater_of
from unroller.training.metrics import PRIMARY, MetricSet
from unroller.training.run_folder import (
    CHECKPOINT,
    GENERATED,
    METRICS,
    RUN_INFO,
    TrainError,
    check_run_folder,
    claim_run_folder,
    read_run_file,
    write_run_file,
)

FORMAT = 2  # 2: the payload's SHA-256 in the zip comment (see the module docstring)
# The zip comment torch.save leaves empty: this prefix, then 64 hex digits.
DIGEST_PREFIX = b"unroller-checkpoint sha256:"
DIGEST_SIZE = len(DIGEST_PREFIX) + 64
ZIP_START = b"PK\x03\x04"
ZIP_END = b"PK\x05\x06"  # the end-of-central-directory record: 22 bytes + the comment
ZIP_END_SIZE = 22
OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("cosine", "constant")
# Fields that may differ between a checkpoint and the run resuming from it.
RESUMABLE_CHANGES = ("epochs", "schedule_epochs")
LATER_FIELDS = ("nproc_per_node", "sync_bn")
"""TrainConfig fields newer than format 2 checkpoints: missing means the default."""
PATH_FIELDS = ("model", "compress_config", "init")
# Bounds on a run's settings, from the command line or from a checkpoint: far past any real
# run, and small enough that nothing derived from them (the history, the sample order, a
# synthetic dataset, the processes launched) can exhaust memory or overflow a seed.
MAX_EPOCHS = 1_000_000
MAX_SEED = 2**40 - 1  # epoch_order seeds with seed * 1_000_003 + epoch: within int64
MAX_SAMPLES = 10_000_000  # --train-size, --test-size, --batch-size
MAX_RESOLUTION = 16_384
MAX_PROCESSES = 1024
MAX_TEXT = 4096  # a string setting (a path, a dataset, a device)
MAX_CHECKPOINT_BYTES = 16 * 2**30  # the most read of a checkpoint: never a whole device


class CheckpointError(TrainError):
    """A checkpoint that is missing, damaged, or not one this version can resume from."""


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
    nproc_per_node: int = 1  # data parallel: processes, each on its share of every batch
    sync_bn: bool = False  # data parallel: batch norm over the whole distributed batch
    precision: str = "fp32"  # --precision of the generated step (fp16-mixed: a GradScaler)
    #: the optimizer stepped inside the backward (unroller.runtime.in_backward)
    update_in_backward: bool = False
    #: data parallel sharded on FSDP2 (unroller.parallel.shard) instead of replicated
    shard: bool = False

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(
                f"unknown optimizer '{self.optimizer}' (known: {', '.join(OPTIMIZERS)})"
            )
        if self.schedule not in SCHEDULES:
            raise TrainError(f"unknown schedule '{self.schedule}' (known: {', '.join(SCHEDULES)})")
        for name in ("epochs", "batch_size", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.lr > 0:
            raise TrainError(f"--lr must be positive, got {self.lr}")
        if not math.isfinite(self.lr):
            raise TrainError(f"--lr must be finite, got {self.lr}")
        for name in ("momentum", "weight_decay"):
            if not 0 <= getattr(self, name) < math.inf:
                flag = name.replace("_", "-")
                raise TrainError(
                    f"--{flag} must be at least 0 and finite, got {getattr(self, name)}"
                )
        self._validate_ranges()
        problem = check_field("precision", self.precision)
        if problem is not None:
            raise TrainError(problem.render("cli"))
        replicated = self.nproc_per_node > 1 and not self.shard
        if self.update_in_backward and (replicated or self.precision == "fp16-mixed"):
            other = "--nproc-per-node" if replicated else "--precision fp16-mixed"
            raise TrainError(
                f"--update-in-backward and {other} do not combine: "
                + (
                    "the gradients are all-reduced after the backward (with --shard they "
                    "are reduce-scattered in it)"
                    if replicated
                    else "a GradScaler's step checks every gradient before any update"
                )
            )
        if self.shard and (self.nproc_per_node < 2 or self.sync_bn):
            raise TrainError(
                "--shard shards over processes: give --nproc-per-node 2 or more"
                if self.nproc_per_node < 2
                else "--shard and --sync-bn do not combine yet"
            )

    def _validate_ranges(self) -> None:
        """Integers and texts within the bounds above (a checkpoint's config too)."""
        bounds = {
            "epochs": (1, MAX_EPOCHS),
            "schedule_epochs": (1, MAX_EPOCHS),
            "batch_size": (1, MAX_SAMPLES),
            "train_size": (1, MAX_SAMPLES),
            "test_size": (1, MAX_SAMPLES),
            "resolution": (1, MAX_RESOLUTION),
            "seed": (0, MAX_SEED),
            "data_seed": (0, MAX_SEED),
            "nproc_per_node": (1, MAX_PROCESSES),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                flag = name.replace("_", "-")
                raise TrainError(f"--{flag} must be between {low} and {high}, got {value}")
        for name in (
            "model",
            "dataset",
            "scheme",
            "compress_config",
            "device",
            "init",
            "precision",
        ):
            value = getattr(self, name)
            if value is not None and (len(value) > MAX_TEXT or not value.isprintable()):
                raise TrainError(
                    f"--{name.replace('_', '-')} must be printable text of at most "
                    f"{MAX_TEXT} characters"
                )

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


def save_atomic(path: Path, payload: dict[str, Any], *, follow_links: bool = True) -> None:
    """torch.save through a temporary file and a rename: a crash never leaves half a file.
    ``follow_links=False`` inside folders unroller owns: a planted link is refused."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_atomic(path, buffer.getvalue(), follow_links=follow_links)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states a step draws from: torch's CPU generator, Python's, and the CUDA
    generator of the training device (only that one: other GPUs are left alone)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _world() -> tuple[int, int]:
    """(rank, processes) of the torch.distributed group the run is in; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """torch.save, with the SHA-256 of the bytes in the zip comment, written atomically."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    end = data[-ZIP_END_SIZE:]
    if not (end.startswith(ZIP_END) and end.endswith(b"\0\0")):  # torch writes no comment
        raise RuntimeError("torch.save wrote an archive without the expected end record")
    body = data[:-2] + DIGEST_SIZE.to_bytes(2, "little")  # the comment's length, then it
    digest = hashlib.sha256(body).hexdigest().encode("ascii")
    write_run_file(path, body + DIGEST_PREFIX + digest)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0].strip() if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _verified_bytes(path: Path) -> bytes:
    """The file's bytes, once its digest matches them: a regular file (a FIFO never
    blocks, a device is never read) of at most ``MAX_CHECKPOINT_BYTES``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({_one_line(exc)})") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: is {file_kind(mode)}, not a checkpoint file")
    try:
        data = read_bounded(path, MAX_CHECKPOINT_BYTES)
    except PathError as exc:
        raise CheckpointError(f"{exc}: not a checkpoint this version reads") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({_one_line(exc)})") from None
    check_digest(path, data)
    return data


def check_digest(path: Path, data: bytes) -> None:
    """Refuse ``data`` (the bytes of the checkpoint ``path``) unless it ends in the
    SHA-256 of the bytes before it; says what it is otherwise."""
    if not data:
        raise CheckpointError(f"{path}: the checkpoint is empty (0 bytes)")
    trailer = data[-DIGEST_SIZE:]
    if len(data) > DIGEST_SIZE + ZIP_END_SIZE and trailer.startswith(DIGEST_PREFIX):
        body = data[:-DIGEST_SIZE]
        if hashlib.sha256(body).hexdigest().encode("ascii") != trailer[len(DIGEST_PREFIX) :]:
            raise CheckpointError(
                f"{path}: the checkpoint is corrupted: its SHA-256 does not match the one "
                "recorded in it (the file was damaged or changed after it was written)"
            )
        return
    if not data.startswith(ZIP_START):
        raise CheckpointError(
            f"{path}: not an unroller training checkpoint (not a PyTorch archive)"
        )
    end = data[-ZIP_END_SIZE:]
    if end.startswith(ZIP_END) and end.endswith(b"\0\0"):
        raise CheckpointError(
            f"{path}: the checkpoint has no SHA-256 (format 1, written before checkpoints "
            "carried one, or by torch.save directly), so its contents cannot be verified; "
            "it is not resumed from: start the run again"
        )
    raise CheckpointError(
        f"{path}: the checkpoint is truncated or damaged (the SHA-256 recorded at its end "
        "is missing)"
    )


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_config(values: dict[str, Any]) -> str | None:
    """What is wrong with a recorded config (None: nothing)."""
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        if field.name not in values and field.name in LATER_FIELDS:
            continue  # a checkpoint from before the field: its default
        if field.name not in values:
            return f"its config has no '{field.name}'"
        value = values[field.name]
        allowed = typing.get_args(hints[field.name]) or (hints[field.name],)
        fits = any(
            (kind is type(None) and value is None)
            or (kind is str and isinstance(value, str))
            or (kind is int and isinstance(value, int) and not isinstance(value, bool))
            or (kind is float and _is_number(value))
            or (kind is bool and isinstance(value, bool))
            for kind in allowed
        )
        if not fits:
            return f"its config's '{field.name}' is {_kind(value)}"
    return None


def _check_history(history: Any, epoch: int) -> str | None:
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        return f"its 'history' is {_kind(history)}, not a list of epoch records"
    # the length first: ``epoch`` is bounded, but no list of its size is built before
    if len(history) != epoch or [r.get("epoch") for r in history] != list(range(1, epoch + 1)):
        return f"its 'history' does not hold one record for each of epochs 1 to {epoch}"
    for record in history:
        if record.get("diverged"):
            continue
        test = record.get("test")
        if not (
            _is_number(record.get("train_loss"))
            and isinstance(test, dict)
            and all(isinstance(k, str) and _is_number(v) for k, v in test.items())
        ):
            return (
                f"its 'history' record of epoch {record['epoch']} has no numeric losses and metrics"
            )
    try:
        json.dumps(history)
    except (TypeError, ValueError) as exc:
        return f"its 'history' is not JSON data ({_one_line(exc)})"
    return None


def _check_rng(state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"its 'rng' is {_kind(state)}, not a dict"
    for key in ("torch", "python"):
        if key not in state:
            return f"its 'rng' has no '{key}' state"
    for key in ("torch", "cuda"):
        value = state.get(key)
        if key in state and not (
            isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
        ):
            return f"its '{key}' RNG state is {_kind(value)}, not a uint8 vector"
    try:
        torch.Generator().set_state(state["torch"])
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"its 'torch' RNG state is not one ({_one_line(exc)})"
    try:
        random.Random().setstate(state["python"])
    except (TypeError, ValueError, OverflowError) as exc:
        return f"its 'python' RNG state is not one ({_one_line(exc)})"
    return None


def _check_settings(values: dict[str, Any], epoch: int) -> str | None:
    """What is wrong with the values of a recorded config whose types are right."""
    config = TrainConfig.from_dict(values)
    try:
        config.validate()
    except TrainError as exc:
        return f"its config is not one a run can have ({_one_line(exc)})"
    if epoch > config.epochs:
        return f"its 'epoch' {epoch} is past its config's {config.epochs} epochs"
    return None


def _check_rng_ranks(payload: dict[str, Any]) -> str | None:
    """A data-parallel checkpoint's per-process RNG states: one valid state per process."""
    if "rng_ranks" not in payload:
        return None
    ranks = payload["rng_ranks"]
    processes = payload["config"].get("nproc_per_node", 1)
    if not isinstance(ranks, list) or len(ranks) != processes:
        return f"its 'rng_ranks' is {_kind(ranks)}, not one RNG state per process ({processes})"
    for rank, state in enumerate(ranks):
        problem = _check_rng(state)
        if problem:
            return f"rank {rank}: {problem}"
    return None


def _check_optimizer_shape(state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"its 'optimizer' is {_kind(state)}, not a state dict"
    groups, per_param = state.get("param_groups"), state.get("state")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict)
        and isinstance(g.get("params"), list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in g["params"])
        for g in groups
    ):
        return "its optimizer state has no list of parameter groups"
    if not isinstance(per_param, dict) or not all(
        isinstance(v, dict) and all(isinstance(k, str) for k in v) for v in per_param.values()
    ):
        return "its optimizer state has no per-parameter state dict"
    return None


def _check_structure(payload: dict[str, Any]) -> str | None:
    """What is wrong with a loaded checkpoint's structure (None: nothing)."""
    kinds = {
        "epoch": int,
        "config": dict,
        "generated_sha256": str,
        "model": dict,
        "optimizer": dict,
        "rng": dict,
        "history": list,
    }
    for key, kind in kinds.items():
        if key not in payload:
            return f"it has no '{key}'"
        value = payload[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            return (
                f"its '{key}' is {_kind(value)}, not {'an' if kind is int else 'a'} {kind.__name__}"
            )
    epoch = payload["epoch"]
    if not 1 <= epoch <= MAX_EPOCHS:
        return f"its 'epoch' is {epoch}, not between 1 and {MAX_EPOCHS}"
    bad = [
        str(k)
        for k, v in payload["model"].items()
        if not isinstance(k, str) or not isinstance(v, torch.Tensor)
    ]
    if bad:
        return f"its 'model' weights hold entries that are not named tensors ({', '.join(bad[:3])})"
    for check in (
        lambda: _check_config(payload["config"]),
        lambda: _check_settings(payload["config"], epoch),
        lambda: _check_history(payload["history"], epoch),
        lambda: _check_rng(payload["rng"]),
        lambda: _check_rng_ranks(payload),
        lambda: _check_optimizer_shape(payload["optimizer"]),
    ):
        problem = check()
        if problem:
            return problem
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's payload: its digest verified before it is deserialised (tensors and
    plain data only), its structure checked; ``CheckpointError`` (one line) otherwise."""
    path = Path(path)
    data = _verified_bytes(path)
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise CheckpointError(f"{path}: not a readable checkpoint ({_one_line(exc)})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else None
        detail = f" (format {found!r}, this version reads {FORMAT})" if found is not None else ""
        raise CheckpointError(f"{path}: not an unroller training checkpoint{detail}")
    problem = _check_structure(payload)
    if problem:
        raise CheckpointError(f"{path}: not a usable checkpoint: {problem}")
    return payload


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:4])
    return shown + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def check_model_state(path: Path, state: dict[str, Tensor], model: torch.nn.Module) -> None:
    """Refuse weights that do not fit ``model``: names, shapes and dtypes must match."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    for name, want in expected.items():
        got = state.get(name)
        if got is None or (got.shape == want.shape and got.dtype == want.dtype):
            continue
        problems.append(f"{name} is {_kind(got)}, the model's is {_kind(want)}")
    if problems:
        raise CheckpointError(
            f"{path}: the checkpoint's weights do not fit the model: {'; '.join(problems[:3])}"
        )


def check_optimizer_state(path: Path, state: dict[str, Any], optimizer) -> None:
    """Refuse an optimizer state that does not fit ``optimizer``'s parameters."""
    fresh = optimizer.state_dict()["param_groups"]
    groups = state["param_groups"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    prefix = f"{path}: the checkpoint's optimizer state does not fit the model"
    if len(groups) != len(fresh) or any(
        g["params"] != f["params"] for g, f in zip(groups, fresh, strict=False)
    ):
        raise CheckpointError(f"{prefix}: its parameter groups differ")
    for index, (group, want) in enumerate(zip(groups, fresh, strict=True)):
        for key, value in want.items():
            got = group.get(key)
            if _is_number(value) and not _is_number(got):
                raise CheckpointError(f"{prefix}: group {index}'s '{key}' is {_kind(got)}")
            if isinstance(value, tuple) and not (
                isinstance(got, tuple | list)
                and len(got) == len(value)
                and all(_is_number(v) for v in got)
            ):
                raise CheckpointError(f"{prefix}: group {index}'s '{key}' is {_kind(got)}")
    for index, entries in state["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise CheckpointError(f"{prefix}: it has state for parameter {index!r}")
        shape = params[index].shape
        for key, value in entries.items():
            if value is None or _is_number(value):
                continue
            ok = isinstance(value, torch.Tensor) and (
                (value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool)
                or (value.shape == shape and value.is_floating_point())
            )
            if not ok:
                raise CheckpointError(
                    f"{prefix}: '{key}' of parameter {index} is {_kind(value)}, the "
                    f"parameter is {list(shape)}"
                )


def resumes_in_place(resume: str | Path | None, out: str | Path) -> bool:
    """Whether the run resumes from the checkpoint inside ``out`` (loaded and verified by
    then): the folder is a run's even if made before run folders were marked."""
    if resume is None:
        return False
    try:
        return os.path.samefile(resume, Path(out) / CHECKPOINT)
    except OSError:
        return False


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
    model,
    split: datasets.Split,
    task: str,
    logits: bool,
    batch_size: int,
    device,
    class_dim: int = 1,
) -> dict:
    """The test metrics of ``predict()`` over ``split``; ``class_dim``: where a language
    model's predictions hold the scores (see ``Signature.pred_class_dim``)."""
    scores = MetricSet(task, logits=logits, class_dim=class_dim)
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
    reducer: Any = None,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """One pass over the training split; the epoch's metrics record (without ``test``).
    Stops at the first loss that is not finite and marks the record ``diverged``.

    Data parallel (``reducer``, unroller.parallel.data): each process takes its contiguous
    share of every batch, and its gradients are weighted by its share before the average,
    so the step is the one-process step on the whole batch; the loss reported is the whole
    batch's."""
    lr = config.lr_at(epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    order = epoch_order(config, epoch, len(split))
    loss_sum, seen, stash = 0.0, 0, None
    rank, world = _world()
    began = time.perf_counter()
    for first, last in bounds:
        index = order[first:last]
        whole = len(index)
        if reducer is not None:
            index = torch.tensor_split(index, world)[rank]
            reducer.weight = world * len(index) / whole
        args = [split.inputs[index].to(device)]
        if split.targets is not None:
            args.append(split.targets[index].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss = (model(*args) if scaler is None else model(*args, scaler=scaler)).item()
        if reducer is not None:
            loss = _whole_batch_loss(loss * len(index), whole)
        if not math.isfinite(loss):
            return {"epoch": epoch, "lr": lr, "diverged": True, "train_loss": None, "test": None}
        if updater_of(model) is not None:
            pass  # stepped inside the backward, each parameter as its gradient was final
        elif scaler is None:
            optimizer.step()
        else:  # unscales, skips a step whose gradients overflowed, adapts the scale
            scaler.step(optimizer)
            scaler.update()
        if stash is None:  # what the first step kept for backward
            stash = model.stash_report()
        loss_sum += loss * whole
        seen += whole
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


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _gathered(value: Any, world: int) -> list[Any]:
    import torch.distributed as dist

    found: list[Any] = [None] * world
    dist.all_gather_object(found, value)
    return found


def _share_buffers(model: torch.nn.Module) -> None:
    import torch.distributed as dist

    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)


def _whole_batch_loss(local_sum: float, whole: int) -> float:
    import torch.distributed as dist

    total = torch.tensor([local_sum], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / whole


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
    """The text of the gpu-platform module the run trains (data parallel: with its
    gradient all-reduces)."""
    options = Options(
        platform="gpu",
        scheme=config.scheme,
        compress_config=config.compress_config,
        resolution=config.resolution,
        data_parallel=config.nproc_per_node > 1 and not config.shard,
        shard=config.shard,
        precision=config.precision,
        update_in_backward=config.update_in_backward,
    )
    return generate_source(config.model, options)


def make_scaler(config: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16-mixed trains with loss scaling (float16's range would underflow small
    gradients): a ``torch.amp.GradScaler`` the step seeds its backward with, which skips
    an update whose gradients overflowed and adapts its scale, as under autograd."""
    if config.precision != "fp16-mixed":
        return None
    return torch.amp.GradScaler(device.type)


def prepare(config: TrainConfig):
    """Generate the model, read its signature, build the dataset."""
    config.validate()
    source = generate(config)
    graph = load_graph(config.model, config.resolution)
    sig = datasets.signature(graph)
    data = datasets.load(config.dataset, sig, config.data_seed, config.train_size, config.test_size)
    return source, sig, data


def _resumable(resume: Path, config: TrainConfig) -> tuple[dict[str, Any], TrainConfig]:
    """The checkpoint at ``resume`` and the config the run continues with (its lr schedule
    keeps the length it was made with); TrainError if ``config`` differs from its config
    in anything but ``epochs`` or ends before it."""
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
            f"--resume: {resume}: the checkpoint was made with other settings ({details}); "
            "only --epochs may change"
        )
    if checkpoint["epoch"] > config.epochs:
        raise TrainError(
            f"--resume: {resume}: the checkpoint is at epoch {checkpoint['epoch']}, "
            f"past --epochs {config.epochs}"
        )
    # extra epochs run at the schedule's end
    schedule = recorded.schedule_epochs or recorded.epochs
    return checkpoint, dataclasses.replace(config, schedule_epochs=schedule)


def train(
    config: TrainConfig,
    out: str | Path,
    resume: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
    force: bool = False,
) -> Run:
    """Train as ``config`` says, writing into ``out``; continue from ``resume`` if given
    (the checkpoint's config is used, except ``epochs``, which may grow).

    ``out`` must be new, empty or a run folder unroller made (``unroller.training.run_folder``);
    ``force`` writes into any other folder. After each epoch the checkpoint is written
    before the metrics line, so ``metrics.jsonl`` never names an epoch whose checkpoint
    is missing."""
    checkpoint = None
    if resume is not None:
        resume = Path(resume)
        checkpoint, config = _resumable(resume, config)
    rank, world = _world()
    out = Path(out)
    _check_out_folder(config, out, resume, rank, world, force)
    if rank != 0:  # one process writes and reports
        progress, log = False, lambda line: None
    device = resolve_device(config.device)
    if device.type == "cuda":
        # exact resumption needs run-to-run identical kernels: no autotuning, and the
        # deterministic cuDNN algorithms
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    source, sig, data = prepare(config)
    source_sha = hashlib.sha256(source.encode("utf-8")).hexdigest()
    if checkpoint is not None:
        _check_checkpoint_fits(checkpoint, resume, source_sha, data.task)
    model, reducer = _start_model(config, out, source, rank, world, device, checkpoint is None)
    optimizer = make_optimizer(config, model.parameters())
    if config.update_in_backward:
        attach(model, optimizer)
    scaler = make_scaler(config, device)
    history: list[dict[str, Any]] = []
    start = 1
    if checkpoint is not None:
        history, start = _restore(checkpoint, resume, model, optimizer, device, rank)
        if scaler is not None and isinstance(checkpoint.get("scaler"), dict):
            scaler.load_state_dict(checkpoint["scaler"])
    run = Run(config, out, data.task, data.description, data.synthetic, history)
    if rank == 0:
        info = _run_info(config, data, run, source_sha)
        write_run_file(out / RUN_INFO, json.dumps(info, indent=2) + "\n")
        write_run_file(out / METRICS, "".join(json.dumps(r) + "\n" for r in history))
    if history and history[-1].get("diverged"):
        return run
    bounds = _epoch_batches(len(data.train), config.batch_size, world)
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
                reducer,
                scaler,
            )
            if reducer is not None and not config.sync_bn:
                _share_buffers(model)  # rank 0's running statistics, as DDP broadcasts them
            if not record.get("diverged"):
                record["test"] = _timed_evaluation(model, data, sig, config, device, record)
            history.append(record)
            _save_epoch(config, out, epoch, source_sha, (model, optimizer, scaler), device, history)
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


def _epoch_batches(samples: int, batch_size: int, world: int) -> list[tuple[int, int]]:
    """An epoch's batch bounds, refused when one is too small to give every process a
    sample."""
    bounds = batches(samples, batch_size)
    if world > 1 and min(b - a for a, b in bounds) < world:
        raise TrainError(
            f"a batch of {min(b - a for a, b in bounds)} sample(s) cannot be shared by {world} "
            "processes: choose --batch-size and --train-size so that every batch has at "
            "least one sample per process"
        )
    return bounds


def _check_out_folder(
    config: TrainConfig, out: Path, resume: Path | None, rank: int, world: int, force: bool
) -> None:
    """Refuse a folder that is not ours to write (unless ``force``), a run started again
    over its own checkpoint, and a process count other than the config's."""
    if rank == 0:
        check_run_folder(out, force=force, ours=resumes_in_place(resume, out))
    if resume is None and (out / CHECKPOINT).exists():
        raise TrainError(
            f"{out} already holds a run; continue it with --resume {out / CHECKPOINT} "
            "or choose another --out"
        )
    if world != config.nproc_per_node:
        raise TrainError(
            f"--nproc-per-node {config.nproc_per_node}, but {world} process(es) run: "
            "start data-parallel runs with unroll train --nproc-per-node (it launches torchrun)"
        )


def _check_checkpoint_fits(
    checkpoint: dict[str, Any], resume: Path, source_sha: str, task: str
) -> None:
    """Refuse to resume a checkpoint made from other generated code, or whose history
    lacks the task's primary metric for an epoch that did not diverge."""
    if checkpoint["generated_sha256"] != source_sha:
        raise TrainError(
            f"--resume: {resume}: the generated model differs from the checkpoint's (the "
            "model file, the scheme's config or the generator changed)"
        )
    for record in checkpoint["history"]:
        if not record.get("diverged") and PRIMARY[task] not in record["test"]:
            raise CheckpointError(
                f"{resume}: not a usable checkpoint: its 'history' record of epoch "
                f"{record['epoch']} has no {PRIMARY[task]}"
            )


def _start_model(
    config: TrainConfig,
    out: Path,
    source: str,
    rank: int,
    world: int,
    device: torch.device,
    fresh: bool,
) -> tuple[Any, Any]:
    """The generated model, written into the run folder and imported from there, seeded,
    on ``device``, from ``config.init``'s weights on a ``fresh`` run; with more than one
    process, its gradient reducer too (else None). Rank 0 writes the file as every run
    file is written (``run_folder.write_run_file``: never through a link), unless it holds
    the text already; every rank imports it (``materialize.load_file``) after the barrier."""
    if rank == 0:
        claim_run_folder(out)
        if read_run_file(out / GENERATED) != source.encode("utf-8"):
            write_run_file(out / GENERATED, source)
    _barrier(world)
    module_name = f"unroller_train_{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}"
    Model = load_file(out / GENERATED, module_name).Model

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model = Model()
    if config.init is not None and fresh:  # a resumed run has its weights
        try:
            model.load_state_dict(torch.load(config.init, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, ValueError, TypeError, pickle.UnpicklingError) as exc:
            raise TrainError(f"cannot start from {config.init}: {_one_line(exc)}") from None
    model.to(device)
    reducer = None
    if world > 1 and config.shard:
        from unroller.parallel import shard

        reducer = shard.attach(model)
    elif world > 1:
        from unroller.parallel import data as distributed

        reducer = distributed.attach(model, sync_bn=config.sync_bn)
        torch.manual_seed(config.seed + 1_000_003 * rank)  # each its own dropout masks
        random.seed(config.seed + 1_000_003 * rank)
    return model, reducer


def _restore(
    checkpoint: dict[str, Any],
    resume: Path,
    model: Any,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    rank: int,
) -> tuple[list[dict[str, Any]], int]:
    """Load the checkpoint's weights, optimizer state and random generators, everything
    checked before anything is loaded; returns its history and the epoch to start at."""
    check_model_state(resume, checkpoint["model"], model)
    check_optimizer_state(resume, checkpoint["optimizer"], optimizer)
    cuda_state = checkpoint["rng"].get("cuda")
    if device.type == "cuda" and cuda_state is not None:
        size = torch.cuda.get_rng_state(device).numel()
        if cuda_state.numel() != size:
            raise CheckpointError(
                f"{resume}: not a usable checkpoint: its CUDA RNG state has "
                f"{cuda_state.numel()} bytes, this device's has {size}"
            )
    try:
        if sharder_of(model) is not None:
            load_sharded(model, optimizer, checkpoint["model"], checkpoint["optimizer"])
        else:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{resume}: the checkpoint does not fit the model ({_one_line(exc)})"
        ) from None
    ranks = checkpoint.get("rng_ranks")
    set_rng_state(ranks[rank] if isinstance(ranks, list) else checkpoint["rng"], device)
    return list(checkpoint["history"]), checkpoint["epoch"] + 1


def _run_info(config: TrainConfig, data: Any, run: Run, source_sha: str) -> dict[str, Any]:
    """What ``run.json`` records: the config, the task and data, the code and torch."""
    return {
        "config": config.to_dict(),
        "task": data.task,
        "primary_metric": run.primary,
        "dataset": data.description,
        "synthetic": data.synthetic,
        "generated_sha256": source_sha,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _timed_evaluation(
    model: Any,
    data: Any,
    sig: Any,
    config: TrainConfig,
    device: torch.device,
    record: dict[str, Any],
) -> dict[str, float]:
    """The test metrics after an epoch; the time they took goes into ``record``. A
    sharded model is gathered whole for it (``predict`` reads every parameter)."""
    began = time.perf_counter()
    sharder = sharder_of(model)
    with sharder.everything() if sharder is not None else contextlib.nullcontext():
        metrics = evaluate(
            model,
            data.test,
            data.task,
            sig.logits,
            config.batch_size,
            device,
            sig.pred_class_dim or 1,
        )
    record["eval_time_s"] = time.perf_counter() - began
    return metrics


def _save_epoch(
    config: TrainConfig,
    out: Path,
    epoch: int,
    source_sha: str,
    state: tuple[Any, torch.optim.Optimizer, torch.amp.GradScaler | None],
    device: torch.device,
    history: list[dict[str, Any]],
) -> None:
    """Write the epoch's checkpoint, then its metrics line (rank 0), every process's
    random generators included so that a resume draws what it would have; ``state``: the
    model, the optimizer and the loss scaler (fp16-mixed) whose states it holds."""
    model, optimizer, scaler = state
    rank, world = _world()
    payload = {
        "format": FORMAT,
        "epoch": epoch,
        "config": config.to_dict(),
        "generated_sha256": source_sha,
        "model": plain_state(model.state_dict()),
        "optimizer": plain_optimizer_state(optimizer.state_dict()),
        "rng": rng_state(device),
        "history": history,
    }
    if scaler is not None:
        payload["scaler"] = scaler.state_dict()
    if world > 1:  # every process's generators, so a resume draws what it would have
        payload["rng_ranks"] = _gathered(rng_state(device), world)
    if rank == 0:  # the checkpoint first: no metrics line without its checkpoint
        save_checkpoint(out / CHECKPOINT, payload)
        write_run_file(out / METRICS, "".join(json.dumps(r) + "\n" for r in history))
    _barrier(world)
