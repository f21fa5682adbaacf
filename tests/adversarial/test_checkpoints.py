"""Damaged, foreign and malformed checkpoints given to ``unroll train --resume``.

Every case must end in one ``CheckpointError`` line naming the file (exit 2 from the
CLI, no traceback) before anything in the run folder is written. One tiny run (the
classifier of ``tests/train_models.py`` on 32 digits, one epoch) makes the checkpoint
that every case starts from.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.train_models import CLASSIFIER
from unroller.cli import app
from unroller.training.loop import (
    DIGEST_PREFIX,
    DIGEST_SIZE,
    CheckpointError,
    TrainConfig,
    check_digest,
    load_checkpoint,
    save_checkpoint,
    train,
)

runner = CliRunner()


def quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[TrainConfig, Path]:
    """(config, run folder) of a finished one-epoch run."""
    root = tmp_path_factory.mktemp("base")
    model = root / "model.txt"
    model.write_text(CLASSIFIER, encoding="utf-8")
    config = TrainConfig(
        model=str(model),
        dataset="digits",
        epochs=1,
        batch_size=16,
        train_size=32,
        test_size=16,
        lr=0.1,
    )
    train(config, root / "run", progress=False, log=quiet)
    return config, root / "run"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def payload_of(run: Path) -> dict[str, Any]:
    # the file is still a plain torch archive (the digest is its zip comment)
    return torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)


def copy_run(run: Path, target: Path) -> Path:
    shutil.copytree(run, target)
    return target / "checkpoint.pt"


def crafted(base, tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the run whose checkpoint has ``change`` applied, with a valid digest."""
    _, run = base
    path = copy_run(run, tmp_path / "crafted")
    payload = payload_of(run)
    change(payload)
    save_checkpoint(path, payload)
    return path


def data_offsets(blob: bytes) -> dict[str, tuple[int, int]]:
    """Member name -> (first byte, size) of its stored data inside the zip."""
    found = {}
    for info in zipfile.ZipFile(io.BytesIO(blob)).infolist():
        name_len, extra_len = struct.unpack(
            "<HH", blob[info.header_offset + 26 : info.header_offset + 30]
        )
        start = info.header_offset + 30 + name_len + extra_len
        found[info.filename] = (start, info.file_size)
    return found


def flipped(blob: bytes, offset: int, mask: int = 0x01) -> bytes:
    return blob[:offset] + bytes([blob[offset] ^ mask]) + blob[offset + 1 :]


def refused(path: Path, fragment: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and fragment in message, message
    assert "\n" not in message
    return message


# -- integrity: one flipped byte -------------------------------------------------------


def named_offsets(blob: bytes) -> dict[str, int]:
    members = data_offsets(blob)
    weight, size = members["archive/data/0"]  # conv1.weight
    rng, rng_size = members["archive/data/13"]  # the torch RNG state (the last tensor)
    pickle_start, pickle_size = members["archive/data.pkl"]
    end = len(blob) - DIGEST_SIZE - 22
    return {
        "first byte (zip magic)": 0,
        "local header CRC field": 14,
        "pickle": pickle_start + pickle_size // 2,
        "tensor data first byte": weight,
        "tensor data middle": weight + size // 2,
        "tensor data last byte": weight + size - 1,
        "rng state tensor": rng + rng_size // 3,
        "central directory": end - 40,
        "end record": end + 10,
        "comment length": end + 20,
        "digest prefix": len(blob) - DIGEST_SIZE + 3,
        "digest hex": len(blob) - 5,
        "last byte": len(blob) - 1,
    }


def test_a_flipped_byte_in_tensor_data_would_load_silently_without_the_digest(base):
    """The reproducer of the issue: torch.load alone takes the damaged weights."""
    _, run = base
    blob = (run / "checkpoint.pt").read_bytes()
    start, _ = data_offsets(blob)["archive/data/0"]
    damaged = torch.load(io.BytesIO(flipped(blob, start + 3, 0x40)), weights_only=True)
    assert not torch.equal(
        damaged["model"]["conv1.weight"], payload_of(run)["model"]["conv1.weight"]
    )


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_a_flipped_byte_is_detected_wherever_it_is(base, tmp_path, mask):
    _, run = base
    blob = (run / "checkpoint.pt").read_bytes()
    path = tmp_path / "checkpoint.pt"
    for where, offset in named_offsets(blob).items():
        path.write_bytes(flipped(blob, offset, mask))
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        assert str(path) in str(info.value), where


def test_every_single_bit_flip_is_detected(base):
    """All offsets, in memory (the digest check load_checkpoint runs on the file's bytes)."""
    _, run = base
    path = run / "checkpoint.pt"
    blob = path.read_bytes()
    check_digest(path, blob)  # the intact file passes
    missed = []
    for offset in range(len(blob)):
        try:
            check_digest(path, flipped(blob, offset, 1 << (offset % 8)))
        except CheckpointError:
            continue
        missed.append(offset)
    assert not missed


def test_damaged_tensor_data_names_the_cause(base, tmp_path):
    _, run = base
    blob = (run / "checkpoint.pt").read_bytes()
    start, _ = data_offsets(blob)["archive/data/0"]
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(flipped(blob, start + 7))
    refused(path, "corrupted: its SHA-256 does not match")


def test_the_checkpoint_format(base):
    """A torch archive whose zip comment is the SHA-256 of all bytes before it."""
    import hashlib

    _, run = base
    blob = (run / "checkpoint.pt").read_bytes()
    comment = zipfile.ZipFile(io.BytesIO(blob)).comment
    assert comment.startswith(DIGEST_PREFIX) and len(comment) == DIGEST_SIZE
    body = blob[:-DIGEST_SIZE]
    assert comment[len(DIGEST_PREFIX) :].decode() == hashlib.sha256(body).hexdigest()
    assert load_checkpoint(run / "checkpoint.pt")["format"] == 2


# -- not a checkpoint at all -----------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00"


@pytest.mark.parametrize(
    ("name", "make", "fragment"),
    [
        ("empty", lambda p, blob: p.write_bytes(b""), "is empty"),
        ("png", lambda p, blob: p.write_bytes(PNG), "not an unroller training checkpoint"),
        (
            "text",
            lambda p, blob: p.write_text("epoch = 3\n"),
            "not an unroller training checkpoint",
        ),
        ("half", lambda p, blob: p.write_bytes(blob[: len(blob) // 2]), "truncated or damaged"),
        ("no trailer", lambda p, blob: p.write_bytes(blob[:-DIGEST_SIZE]), "truncated or damaged"),
        ("one byte short", lambda p, blob: p.write_bytes(blob[:-1]), "truncated or damaged"),
        ("zip head only", lambda p, blob: p.write_bytes(blob[:4]), "truncated or damaged"),
        ("directory", lambda p, blob: p.mkdir(), "is a directory"),
        ("missing", lambda p, blob: None, "no such checkpoint"),
    ],
)
def test_files_that_are_no_checkpoint(base, tmp_path, name, make, fragment):
    _, run = base
    path = tmp_path / "checkpoint.pt"
    make(path, (run / "checkpoint.pt").read_bytes())
    refused(path, fragment)


def test_a_checkpoint_without_a_digest_is_refused(base, tmp_path):
    """Format 1 (plain torch.save) cannot be verified: refused, with the reason."""
    _, run = base
    payload = payload_of(run)
    payload["format"] = 1
    path = tmp_path / "checkpoint.pt"
    torch.save(payload, path)
    message = refused(path, "has no SHA-256")
    assert "format 1" in message and "start the run again" in message


def test_a_foreign_archive_with_a_valid_digest(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"weights": torch.zeros(3)})
    refused(path, "not an unroller training checkpoint")
    save_checkpoint(path, {"format": 7, "weights": torch.zeros(3)})
    refused(path, "format 7, this version reads 2")
    save_checkpoint(path, [1, 2, 3])  # type: ignore[arg-type]
    refused(path, "not an unroller training checkpoint")


RAN: list[str] = []


def _record(text: str) -> str:
    RAN.append(text)
    return text


class Trap:
    """Unpickling this would call ``_record``: a stand-in for arbitrary code."""

    def __reduce__(self):
        return (_record, ("unpickled code ran",))


def test_pickled_code_is_never_run(base, tmp_path):
    """The digest is no signature; the payload is loaded with weights_only=True."""
    path = crafted(base, tmp_path, lambda p: p.update(extra=Trap()))
    refused(path, "not a readable checkpoint")
    assert RAN == []


# -- structurally wrong checkpoints (valid digest) --------------------------------------


def _set(path: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(payload: dict[str, Any]) -> None:
        target = payload
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _drop(path: list[str]) -> Callable[[dict[str, Any]], None]:
    def change(payload: dict[str, Any]) -> None:
        target = payload
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return change


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (_drop(["config"]), "no 'config'"),
        (_drop(["optimizer"]), "no 'optimizer'"),
        (_drop(["rng"]), "no 'rng'"),
        (_drop(["model"]), "no 'model'"),
        (_drop(["history"]), "no 'history'"),
        (_drop(["epoch"]), "no 'epoch'"),
        (_drop(["rng", "torch"]), "no 'torch' state"),
        (_drop(["rng", "python"]), "no 'python' state"),
        (_drop(["config", "lr"]), "config has no 'lr'"),
        (_set(["epoch"], "1"), "'epoch' is a str"),
        (_set(["epoch"], True), "'epoch' is a bool"),
        (_set(["epoch"], 0), "'epoch' is 0"),
        (_set(["config"], [1, 2]), "'config' is a list"),
        (_set(["config", "epochs"], "3"), "config's 'epochs' is a str"),
        (_set(["config", "lr"], None), "config's 'lr' is a NoneType"),
        (_set(["generated_sha256"], 5), "'generated_sha256' is a int"),
        (_set(["model"], torch.zeros(3)), "'model' is a float32 tensor"),
        (_set(["model", "fc.weight"], [0.0] * 40), "not named tensors (fc.weight)"),
        (_set(["optimizer"], "sgd"), "'optimizer' is a str"),
        (_set(["optimizer", "param_groups"], {}), "no list of parameter groups"),
        (_set(["optimizer", "state"], []), "no per-parameter state dict"),
        (_set(["rng", "torch"], torch.zeros(5056)), "'torch' RNG state is a float32 tensor"),
        (_set(["rng", "torch"], torch.zeros(3, dtype=torch.uint8)), "'torch' RNG state is not one"),
        (_set(["rng", "python"], (3, (1, 2), None)), "'python' RNG state is not one"),
        (_set(["rng", "python"], "seed"), "'python' RNG state is not one"),
        (_set(["rng", "cuda"], [1, 2]), "'cuda' RNG state is a list"),
        (_set(["history"], {"1": {}}), "'history' is a dict"),
        (_set(["history"], []), "one record for each of epochs 1 to 1"),
        (_set(["history", 0, "test"], None), "epoch 1 has no numeric losses"),
    ],
)
def test_structurally_wrong_checkpoints(base, tmp_path, change, fragment):
    path = crafted(base, tmp_path, change)
    assert "not a usable checkpoint: " in refused(path, fragment)


# -- checkpoints that do not fit the model being resumed --------------------------------


def _resize(name: str, shape: tuple[int, ...]) -> Callable[[dict[str, Any]], None]:
    def change(payload: dict[str, Any]) -> None:
        payload["model"][name] = torch.zeros(shape)

    return change


def _momentum(shape: tuple[int, ...], dtype=torch.float32) -> Callable[[dict[str, Any]], None]:
    def change(payload: dict[str, Any]) -> None:
        payload["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(shape, dtype=dtype)

    return change


def _other_model(payload: dict[str, Any]) -> None:
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Linear(4, 10))
    payload["model"] = other.state_dict()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            _resize("conv1.weight", (4, 1, 3, 3)),
            "conv1.weight is a float32 tensor of shape [4, 1, 3, 3]",
        ),
        (_drop(["model", "fc.bias"]), "missing fc.bias"),
        (_set(["model", "extra.weight"], torch.zeros(2)), "unexpected extra.weight"),
        (
            _set(["model", "bn1.num_batches_tracked"], torch.tensor(1.0)),
            "num_batches_tracked is a float32",
        ),
        (_other_model, "missing conv1.weight"),
        (
            _momentum((10, 32)),
            "'momentum_buffer' of parameter 0 is a float32 tensor of shape [10, 32]",
        ),
        (_momentum((8, 1, 3, 3), torch.int64), "'momentum_buffer' of parameter 0 is a int64"),
        (
            _set(["optimizer", "state", 99], {"momentum_buffer": torch.zeros(1)}),
            "state for parameter 99",
        ),
        (_set(["optimizer", "param_groups", 0, "params"], [0, 1]), "parameter groups differ"),
        (
            _set(["optimizer", "param_groups", 0, "momentum"], "0.9"),
            "group 0's 'momentum' is a str",
        ),
        (_drop(["optimizer", "param_groups", 0, "momentum"]), "group 0's 'momentum' is a NoneType"),
        (_set(["history", 0, "test"], {"loss": 1.0}), "epoch 1 has no accuracy"),
    ],
)
def test_checkpoints_that_do_not_fit_the_model(base, tmp_path, change, fragment):
    config, _ = base
    path = crafted(base, tmp_path, change)
    before = snapshot(path.parent)
    longer = TrainConfig(**{**config.to_dict(), "epochs": 2})
    with pytest.raises(CheckpointError) as info:
        train(longer, path.parent, resume=path, progress=False, log=quiet)
    message = str(info.value)
    assert str(path) in message and fragment in message, message
    assert snapshot(path.parent) == before  # nothing written


# -- through the CLI: exit 2, one line, no traceback, nothing written -------------------


def cli_resume(config: TrainConfig, path: Path, *extra: str):
    args = ["train", config.model, "--resume", str(path), "--epochs", "2", "--quiet", *extra]
    return runner.invoke(app, args)


def check_cli_refusal(result, path: Path, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("unroll: error: ") and str(path) in lines[0] and fragment in lines[0]


def test_cli_flipped_tensor_byte(base, tmp_path):
    config, run = base
    path = copy_run(run, tmp_path / "run")
    blob = path.read_bytes()
    start, size = data_offsets(blob)["archive/data/6"]  # fc.weight
    path.write_bytes(flipped(blob, start + size // 2))
    before = snapshot(path.parent)
    check_cli_refusal(cli_resume(config, path), path, "corrupted")
    assert snapshot(path.parent) == before


def test_cli_wrong_weight_shape(base, tmp_path):
    config, _ = base
    path = crafted(base, tmp_path, _resize("fc.weight", (10, 2)))
    before = snapshot(path.parent)
    check_cli_refusal(cli_resume(config, path), path, "weights do not fit the model")
    assert snapshot(path.parent) == before


def test_cli_missing_config(base, tmp_path):
    config, _ = base
    path = crafted(base, tmp_path, _drop(["config"]))
    check_cli_refusal(cli_resume(config, path), path, "it has no 'config'")


@pytest.mark.parametrize("kind", ["directory", "png", "empty", "old format"])
def test_cli_not_a_checkpoint(base, tmp_path, kind):
    config, run = base
    path = tmp_path / "checkpoint.pt"
    if kind == "directory":
        path.mkdir()
    elif kind == "png":
        path.write_bytes(PNG)
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        torch.save({**payload_of(run), "format": 1}, path)
    check_cli_refusal(cli_resume(config, path), path, "")


def test_cli_checkpoint_of_another_model(base, tmp_path):
    """A run's checkpoint resumed with another model file: refused by its settings."""
    _, run = base
    other = tmp_path / "other.txt"
    other.write_text(CLASSIFIER.replace("out_channels=8", "out_channels=4"), encoding="utf-8")
    path = copy_run(run, tmp_path / "run")
    before = snapshot(path.parent)
    result = runner.invoke(app, ["train", str(other), "--resume", str(path), "--quiet"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "other settings (model" in result.output
    assert snapshot(path.parent) == before


def test_an_intact_checkpoint_still_resumes(base, tmp_path):
    config, run = base
    path = copy_run(run, tmp_path / "run")
    result = cli_resume(config, path)
    assert result.exit_code == 0, result.output
    records = [
        json.loads(line) for line in (path.parent / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["epoch"] for r in records] == [1, 2]
    assert load_checkpoint(path)["epoch"] == 2
