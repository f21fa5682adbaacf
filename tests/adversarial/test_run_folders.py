"""Hostile run folders, checkpoints and launches for ``unroll train``.

Each case must end in one ``unroll: error: ...`` line, exit status 2, no traceback, with
nothing written or replaced, bounded memory and time, and no code from the working
directory run:

- the data-parallel launcher (torchrun and every process it starts) never puts the working
  directory on sys.path, so a planted ``./typer.py`` or ``./numpy.py`` never runs;
- ``-o DIR`` writes only into a new, empty or marked (``.unroller-run``) run folder unless
  ``--force``; it never follows a symbolic link inside one; ``-o`` naming a regular file,
  a FIFO or a dangling link is refused without blocking;
- a full disk is one line, and ``metrics.jsonl`` never names an epoch whose checkpoint is
  missing (the checkpoint is written first);
- ``--resume`` reads a regular file only, bounded (a FIFO never blocks, /dev/zero and a
  huge sparse file are never read), and every setting of a loaded checkpoint is
  range-checked (an epoch of 1e18 once raised MemoryError).

One tiny run (the classifier of ``tests/train_models.py``, 32 digits, one epoch) makes the
run folder and checkpoint most cases start from; the launcher cases run real processes
(the working directory's place on sys.path is what they test), the full two-process
training only with SLOW=1.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, time_limit
from typer.testing import CliRunner

from tests.adversarial.cli_cases import invoke, refused
from tests.train_models import CLASSIFIER
from unroller.cli import app
from unroller.cli.train import launch_command
from unroller.parallel.data import BOOT, python_module_command, torchrun_command
from unroller.training import run_folder
from unroller.training.loop import (
    MAX_CHECKPOINT_BYTES,
    CheckpointError,
    TrainConfig,
    load_checkpoint,
    save_checkpoint,
    train,
)
from unroller.training.run_folder import MARKER, RunFolderError, write_run_file

runner = CliRunner()
TINY = ["--epochs", "1", "--train-size", "32", "--test-size", "16", "--batch-size", "16"]


def quiet(_line: str) -> None:
    pass


@pytest.fixture(autouse=True)
def alarm():
    """No case may block (a FIFO) or run away (a huge read)."""
    with time_limit(60, TimeoutError("blocked for 60 s")):
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[TrainConfig, Path]:
    """(config, run folder) of a finished one-epoch run."""
    root = tmp_path_factory.mktemp("base")
    model = root / "model.txt"
    model.write_text(CLASSIFIER, encoding="utf-8")
    config = TrainConfig(
        model=str(model), epochs=1, batch_size=16, train_size=32, test_size=16, lr=0.1
    )
    train(config, root / "run", progress=False, log=quiet)
    return config, root / "run"


def snapshot(folder: Path) -> dict[str, Any]:
    """Every entry's kind and bytes (links by target), to show nothing changed."""
    found: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.is_symlink():
            found[path.name] = ("link", os.readlink(path))
        elif path.is_file():
            found[path.name] = path.read_bytes()
        else:
            found[path.name] = "other"
    return found


def train_args(config: TrainConfig, *extra: str) -> list[str]:
    return ["train", config.model, *TINY, "--quiet", *extra]


def copy_run(run: Path, target: Path) -> Path:
    shutil.copytree(run, target, symlinks=True)
    return target


# -- 1. the launcher: nothing from the working directory runs --------------------------

PLANTED = ("typer", "numpy", "torch", "unroller")


def plant(folder: Path) -> Path:
    """Modules in ``folder`` that leave a marker file when imported."""
    for name in PLANTED:
        (folder / f"{name}.py").write_text(
            "from pathlib import Path\n"
            f"Path({str(folder)!r}, 'RAN-{name}').write_text('planted code ran')\n"
            f"raise ImportError('planted {name}')\n",
            encoding="utf-8",
        )
    return folder


def markers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("RAN-"))


def run_in(folder: Path, command: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTHONSAFEPATH", None)  # the plain interpreter's behaviour, as a user has it
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_launch_command_never_runs_python_dash_m(base, tmp_path):
    """torchrun and its processes start as ``python [-P] -c BOOT MODULE``: ``-m`` would put
    the working directory first on sys.path, in the launcher and in every process."""
    config, _ = base
    two = TrainConfig(**{**config.to_dict(), "nproc_per_node": 2})
    command = launch_command(two, tmp_path / "run", None, quiet=True)
    assert "-m" not in command
    assert command.count(BOOT) == 2 and command.count(sys.executable) == 2
    launcher = command.index(BOOT)
    assert command[launcher - 1] == "-c" and command[launcher + 1] == "torch.distributed.run"
    worker = command.index(BOOT, launcher + 1)
    assert command[worker + 1 : worker + 3] == ["unroller.cli", "train"]
    assert command[command.index("--no-python") + 1] == sys.executable  # run as given
    if sys.version_info >= (3, 11):
        assert command.count("-P") == 2
    assert "--force" not in command
    assert "--force" in launch_command(two, tmp_path / "run", None, quiet=True, force=True)


def test_the_planted_modules_would_run_under_python_dash_m(tmp_path):
    """The control: ``python -m unroller.cli`` in that folder runs the planted code."""
    folder = plant(tmp_path)
    run_in(folder, [sys.executable, "-m", "unroller.cli", "--help"])
    assert markers(folder)


def test_a_launched_python_runs_nothing_from_the_working_directory(tmp_path):
    folder = plant(tmp_path)
    result = run_in(folder, python_module_command("unroller.cli", ["train", "--help"]))
    assert result.returncode == 0, result.stderr
    assert "--nproc-per-node" in result.stdout
    assert markers(folder) == []


def test_a_python_without_the_safe_path_flag_drops_the_working_directory(tmp_path):
    """Python 3.10 has no -P: BOOT itself removes the working directory's entry."""
    folder = plant(tmp_path)
    command = python_module_command("unroller.cli", ["--help"])
    if "-P" in command:
        command.remove("-P")
    result = run_in(folder, command)
    assert result.returncode == 0, result.stderr
    assert markers(folder) == []


def test_torchrun_and_its_process_run_nothing_from_the_working_directory(tmp_path):
    """The launch mechanism of --nproc-per-node, with one cheap process."""
    folder = plant(tmp_path)
    command = torchrun_command(1, "unroller.cli", ["train", "--help"])
    result = run_in(folder, command)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--nproc-per-node" in result.stdout
    assert markers(folder) == []


@pytest.mark.slow  # torchrun with two training processes: make test-slow
def test_two_process_training_runs_nothing_from_the_working_directory(tmp_path):
    folder = tmp_path / "cwd"
    folder.mkdir()
    plant(folder)
    (folder / "m.txt").write_text(CLASSIFIER, encoding="utf-8")
    args = ["train", "m.txt", *TINY, "-o", "run", "--quiet", "--nproc-per-node", "2"]
    result = run_in(folder, python_module_command("unroller.cli", args), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert markers(folder) == []
    assert load_checkpoint(folder / "run" / "checkpoint.pt")["config"]["nproc_per_node"] == 2


# -- 2. run folders: never someone else's files, never through a link ------------------


def test_a_folder_with_the_users_files_is_refused(base, tmp_path):
    config, _ = base
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "model.py").write_text("my own model\n")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(folder)
    refused(
        invoke(*train_args(config, "-o", str(folder))),
        str(folder),
        "not a run folder unroller made",
        "--force",
    )
    assert snapshot(folder) == before


def test_the_working_directory_is_refused(base, tmp_path, monkeypatch):
    """``-o .`` in a project folder: its model.py is the user's."""
    config, _ = base
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text("import torch  # mine\n")
    before = snapshot(tmp_path)
    refused(invoke(*train_args(config, "-o", ".")), "--out .", "not empty")
    assert snapshot(tmp_path) == before


def test_the_library_refuses_the_same_folder(base, tmp_path):
    config, _ = base
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(RunFolderError, match="not a run folder unroller made"):
        train(config, tmp_path, progress=False, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_force_writes_into_a_foreign_folder_and_marks_it(base, tmp_path):
    config, _ = base
    (tmp_path / "notes.txt").write_text("mine\n")
    result = invoke(*train_args(config, "-o", str(tmp_path), "--force"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert (tmp_path / MARKER).is_file() and (tmp_path / "checkpoint.pt").is_file()


def test_an_empty_folder_and_a_marked_one_are_used(base, tmp_path):
    """A new run in an empty folder; then (its checkpoint removed, as after an interrupt
    in epoch 1) the same marked folder again, without --force."""
    config, _ = base
    for _ in range(2):
        result = invoke(*train_args(config, "-o", str(tmp_path)))
        assert result.exit_code == 0, result.output
        assert (tmp_path / MARKER).is_file()
        (tmp_path / "checkpoint.pt").unlink()


def test_resume_continues_a_run_folder_made_before_the_marker(base, tmp_path):
    """A verified checkpoint inside the folder says it is a run's: resumed, then marked."""
    config, run = base
    folder = copy_run(run, tmp_path / "old")
    (folder / MARKER).unlink()
    result = invoke(
        "train", config.model, "--resume", str(folder / "checkpoint.pt"), "--epochs", "2", "-q"
    )
    assert result.exit_code == 0, result.output
    assert load_checkpoint(folder / "checkpoint.pt")["epoch"] == 2
    assert (folder / MARKER).is_file()


def test_resume_into_a_foreign_folder_is_refused(base, tmp_path):
    config, run = base
    (tmp_path / "model.py").write_text("mine\n")
    before = snapshot(tmp_path)
    result = invoke(
        "train",
        config.model,
        "--resume",
        str(run / "checkpoint.pt"),
        "--epochs",
        "2",
        "-q",
        "-o",
        str(tmp_path),
    )
    refused(result, "not a run folder unroller made")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", [MARKER, "model.py", "metrics.jsonl", "run.json", "checkpoint.pt"])
@pytest.mark.parametrize("force", [False, True])
def test_a_link_inside_a_new_run_folder_is_never_followed(base, tmp_path, name, force):
    config, _ = base
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / name).symlink_to(victim)
    before = snapshot(folder)
    extra = ["--force"] if force else []
    refused(
        invoke(*train_args(config, "-o", str(folder), *extra)),
        str(folder / name),
        "symbolic link",
        "never follows links",
    )
    assert victim.read_text() == "precious\n" and snapshot(folder) == before


@pytest.mark.parametrize("name", ["model.py", "metrics.jsonl", "run.json"])
def test_a_link_inside_a_resumed_run_folder_is_never_followed(base, tmp_path, name):
    config, run = base
    folder = copy_run(run, tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (folder / name).unlink()
    (folder / name).symlink_to(victim)
    before = snapshot(folder)
    result = invoke(
        "train", config.model, "--resume", str(folder / "checkpoint.pt"), "--epochs", "2", "-q"
    )
    refused(result, str(folder / name), "symbolic link")
    assert victim.read_text() == "precious\n" and snapshot(folder) == before


def test_a_link_swapped_in_at_write_time_is_not_followed(tmp_path):
    """The write itself refuses a link (the checks above could be raced)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(RunFolderError, match="symbolic link"):
        write_run_file(tmp_path / "metrics.jsonl", "{}\n")
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "metrics.jsonl").is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_run_file_that_is_no_regular_file_is_refused(base, tmp_path, kind):
    config, _ = base
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / MARKER).write_text(run_folder.MARKER_TEXT)
    if kind == "fifo":
        os.mkfifo(folder / "model.py")
    else:
        (folder / "model.py").mkdir()
    refused(invoke(*train_args(config, "-o", str(folder))), str(folder / "model.py"))


# -- 3. -o naming something that is no folder ------------------------------------------


def _make_out(kind: str, tmp_path: Path) -> Path:
    path = tmp_path / "out"
    if kind == "regular file":
        path.write_text("mine\n")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    elif kind == "under a regular file":
        path.write_text("mine\n")
        path = path / "run"
    return path


@pytest.mark.parametrize(
    ("kind", "phrase"),
    [
        ("regular file", "is a regular file, not a folder"),
        ("fifo", "is a named pipe (FIFO), not a folder"),
        ("dangling link", "does not exist"),
        ("link to a fifo", "is a named pipe (FIFO), not a folder"),
        ("under a regular file", "is not a folder"),
    ],
)
def test_out_that_is_no_folder(base, tmp_path, kind, phrase):
    config, _ = base
    out = _make_out(kind, tmp_path)
    before = snapshot(tmp_path)
    refused(invoke(*train_args(config, "-o", str(out))), str(out), phrase)
    assert snapshot(tmp_path) == before


# -- 4. a full disk --------------------------------------------------------------------


def disk_full_on(monkeypatch, fails: Callable[[Path, int], bool]) -> None:
    """Make the run-file writes whose (path, how many writes of that name so far) match
    ``fails`` raise ENOSPC, as a full disk does."""
    real = run_folder.write_atomic
    seen: dict[str, int] = {}

    def write(path, data, **kwargs):
        path = Path(path)
        seen[path.name] = seen.get(path.name, 0) + 1
        if fails(path, seen[path.name]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data, **kwargs)

    monkeypatch.setattr(run_folder, "write_atomic", write)


def metric_epochs(folder: Path) -> list[int]:
    text = (folder / "metrics.jsonl").read_text() if (folder / "metrics.jsonl").exists() else ""
    return [json.loads(line)["epoch"] for line in text.splitlines()]


def test_a_full_disk_at_the_first_checkpoint(base, tmp_path, monkeypatch):
    config, _ = base
    disk_full_on(monkeypatch, lambda path, n: path.name == "checkpoint.pt")
    folder = tmp_path / "run"
    refused(
        invoke(*train_args(config, "-o", str(folder))),
        str(folder / "checkpoint.pt"),
        "No space left on device",
    )
    assert not (folder / "checkpoint.pt").exists()
    assert metric_epochs(folder) == []  # no line for the epoch without a checkpoint
    assert not [p for p in folder.iterdir() if ".unroller-tmp-" in p.name]


def test_a_full_disk_at_a_later_checkpoint_keeps_metrics_and_checkpoint_agreeing(
    base, tmp_path, monkeypatch
):
    config, run = base
    folder = copy_run(run, tmp_path / "run")
    disk_full_on(monkeypatch, lambda path, n: path.name == "checkpoint.pt")
    result = invoke(
        "train", config.model, "--resume", str(folder / "checkpoint.pt"), "--epochs", "3", "-q"
    )
    refused(result, "No space left on device")
    assert load_checkpoint(folder / "checkpoint.pt")["epoch"] == 1
    assert metric_epochs(folder) == [1]


def test_a_full_disk_at_the_metrics_write_leaves_them_behind_not_ahead(base, tmp_path, monkeypatch):
    config, _ = base
    folder = tmp_path / "run"
    # the first metrics write (the empty history) passes; the epoch's line fails
    disk_full_on(monkeypatch, lambda path, n: path.name == "metrics.jsonl" and n > 1)
    refused(invoke(*train_args(config, "-o", str(folder))), "No space left on device")
    assert load_checkpoint(folder / "checkpoint.pt")["epoch"] == 1
    assert metric_epochs(folder) == []


def test_a_full_disk_before_training(base, tmp_path, monkeypatch):
    config, _ = base
    disk_full_on(monkeypatch, lambda path, n: True)
    refused(invoke(*train_args(config, "-o", str(tmp_path / "run"))), "No space left")


# -- 5. --resume: bounded reads, regular files only, every setting checked --------------


@pytest.mark.parametrize(
    ("kind", "phrase"),
    [
        ("fifo", "is a named pipe (FIFO), not a checkpoint file"),
        ("link to a fifo", "is a named pipe (FIFO), not a checkpoint file"),
        ("dev zero", "is a character device, not a checkpoint file"),
        ("socket", "is a socket"),
    ],
)
def test_resume_of_something_that_is_no_regular_file(base, tmp_path, kind, phrase):
    config, _ = base
    if kind == "fifo":
        path = tmp_path / "checkpoint.pt"
        os.mkfifo(path)
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "pipe")
        path = tmp_path / "checkpoint.pt"
        path.symlink_to(tmp_path / "pipe")
    elif kind == "dev zero":
        path = Path("/dev/zero")
    else:
        import socket

        path = tmp_path / "s.pt"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    with pytest.raises(CheckpointError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(path)
    result = invoke("train", config.model, "--resume", str(path), "-q", "-o", str(tmp_path / "o"))
    refused(result, str(path), phrase)
    assert not (tmp_path / "o").exists()


def test_resume_of_a_huge_file_reads_none_of_it(tmp_path, monkeypatch):
    """A sparse file past the bound is refused by its size, before any byte is read."""
    path = tmp_path / "checkpoint.pt"
    with open(path, "wb") as handle:
        try:
            handle.truncate(MAX_CHECKPOINT_BYTES + 1)
        except OSError as exc:  # a file system without sparse files this large
            pytest.skip(f"cannot make a sparse file: {exc}")

    def never(*args, **kwargs):
        raise AssertionError("the huge file was read")

    monkeypatch.setattr("unroller.files.read_limited", never)
    with pytest.raises(CheckpointError, match="is larger than"):
        load_checkpoint(path)


def test_resume_of_a_file_past_the_bound_is_refused(tmp_path, monkeypatch):
    """The bound itself, at a small size (the real one is checked above by size only)."""
    monkeypatch.setattr("unroller.training.loop.MAX_CHECKPOINT_BYTES", 1024)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 4096)
    with pytest.raises(CheckpointError, match="is larger than"):
        load_checkpoint(path)


def crafted(base, tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the run whose checkpoint has ``change`` applied, re-signed (valid SHA-256)."""
    _, run = base
    folder = copy_run(run, tmp_path / "crafted")
    payload = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    change(payload)
    save_checkpoint(folder / "checkpoint.pt", payload)
    return folder / "checkpoint.pt"


def _set(*keys_and_value: Any) -> Callable[[dict[str, Any]], None]:
    *keys, value = keys_and_value

    def change(payload: dict[str, Any]) -> None:
        target = payload
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def _both(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(payload: dict[str, Any]) -> None:
        for one in changes:
            one(payload)

    return change


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (_set("epoch", 10**18), "'epoch' is 1000000000000000000, not between 1 and"),
        (_set("epoch", 2**70), "not between 1 and"),
        (_set("epoch", 5), "'epoch' 5 is past its config's 1 epochs"),
        (_both(_set("epoch", 10**6), _set("config", "epochs", 10**6)), "epochs 1 to 1000000"),
        (_set("config", "epochs", 10**18), "--epochs must be between 1 and"),
        (_set("config", "batch_size", 10**18), "--batch-size must be between"),
        (_set("config", "train_size", 10**12), "--train-size must be between"),
        (_set("config", "test_size", 0), "--test-size must be between"),
        (_set("config", "resolution", 10**9), "--resolution must be between"),
        (_set("config", "seed", 2**70), "--seed must be between"),
        (_set("config", "seed", -1), "--seed must be between"),
        (_set("config", "data_seed", 2**64), "--data-seed must be between"),
        (_set("config", "nproc_per_node", 10**6), "--nproc-per-node must be between"),
        (_set("config", "schedule_epochs", 0), "--schedule-epochs must be between"),
        (_set("config", "lr", float("inf")), "--lr must be finite"),
        (_set("config", "lr", float("nan")), "--lr must be positive"),
        (_set("config", "momentum", float("inf")), "--momentum must be at least 0 and finite"),
        (_set("config", "weight_decay", float("nan")), "--weight-decay must be at least 0"),
        (_set("config", "optimizer", "rmsprop"), "unknown optimizer"),
        (_set("config", "device", "cpu\nunroll: error: forged"), "--device must be printable"),
        (_set("config", "dataset", "d" * 100_000), "--dataset must be printable text"),
        (_set("config", "epochs", 0), "--epochs must be at least 1"),
        (_set("rng_ranks", [1, 2]), "'rng_ranks' is a list, not one RNG state per process"),
        (_set("rng_ranks", "x"), "'rng_ranks' is a str"),
    ],
)
def test_every_setting_of_a_resigned_checkpoint_is_checked(base, tmp_path, change, fragment):
    path = crafted(base, tmp_path, change)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and fragment in message and "\n" not in message, message


def test_rng_ranks_of_a_data_parallel_checkpoint_are_checked(base, tmp_path):
    def change(payload: dict[str, Any]) -> None:
        payload["config"]["nproc_per_node"] = 2
        payload["rng_ranks"] = [payload["rng"], {"torch": torch.zeros(3, dtype=torch.uint8)}]

    path = crafted(base, tmp_path, change)
    with pytest.raises(CheckpointError, match="rank 1: its 'rng' has no 'python' state"):
        load_checkpoint(path)


def test_cli_resume_of_an_epoch_of_1e18(base, tmp_path):
    """It once raised MemoryError (a list of 1e18 epoch numbers)."""
    config, _ = base
    path = crafted(base, tmp_path, _set("epoch", 10**18))
    before = snapshot(path.parent)
    result = invoke("train", config.model, "--resume", str(path), "--epochs", "2", "-q")
    refused(result, str(path), "not between 1 and")
    assert snapshot(path.parent) == before


def test_cli_resume_of_a_huge_process_count_launches_nothing(base, tmp_path, monkeypatch):
    config, _ = base
    path = crafted(base, tmp_path, _set("config", "nproc_per_node", 10**6))

    def no_launch(*args, **kwargs):
        raise AssertionError("a launch was attempted")

    monkeypatch.setattr(subprocess, "run", no_launch)
    result = invoke("train", config.model, "--resume", str(path), "-q")
    refused(result, "--nproc-per-node must be between")


def test_cli_out_of_range_options(base, tmp_path):
    config, _ = base
    out = str(tmp_path / "run")
    refused(invoke(*train_args(config, "-o", out, "--seed", str(2**70))), "--seed must be")
    refused(invoke(*train_args(config, "-o", out, "--lr", "inf")), "--lr must be finite")
    assert not (tmp_path / "run").exists()


# ---- unroll accuracy's output folder ----------------------------------------------------


def test_accuracy_never_follows_a_link_in_its_output_folder(tmp_path: Path):
    """``unroll accuracy --out`` writes its configs, initial weights, tables and plots with
    links refused, as the run folders inside it: a link planted at the 4-bit config's name
    is one error line, and its target is untouched."""
    model = tmp_path / "model.txt"
    model.write_text(CLASSIFIER, encoding="utf-8")
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n", encoding="utf-8")
    (tmp_path / "out" / "configs").mkdir(parents=True)
    (tmp_path / "out" / "configs" / "quant-4bit.toml").symlink_to(victim)
    args = ["accuracy", str(model), "--schemes", "quant-4bit", "--seeds", "1", *TINY]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unroll: error: "), result.stderr
    assert "link" in lines[0], lines[0]
    assert victim.read_text(encoding="utf-8") == "mine\n"
