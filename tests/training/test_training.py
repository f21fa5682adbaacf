"""unroll train: a tiny run per dataset, exact resumption, atomic checkpoints, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.train_models import AUTOENCODER, CLASSIFIER, DENOISER, SEGMENTER
from unroller.cli import app
from unroller.training import loop as training
from unroller.training.loop import TrainConfig, TrainError, load_checkpoint, train

TIMES = ("train_time_s", "eval_time_s")


def write_model(tmp_path: Path, text: str, name: str = "model.txt") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMES} for r in records]


def quiet(_line: str) -> None:
    pass


CASES = {
    "digits": (CLASSIFIER, "accuracy", {"lr": 0.1}),
    "denoise": (DENOISER, "psnr", {"lr": 0.01}),
    "clouds": (SEGMENTER, "iou", {"lr": 0.05}),
    "optics": (AUTOENCODER, "psnr", {"lr": 0.01}),
}


@pytest.mark.parametrize("dataset", sorted(CASES))
def test_tiny_run_per_dataset(tmp_path, dataset):
    text, metric, extra = CASES[dataset]
    config = TrainConfig(
        model=write_model(tmp_path, text),
        dataset=dataset,
        epochs=3,
        batch_size=16,
        train_size=128,
        test_size=48,
        **extra,
    )
    out = tmp_path / "run"
    run = train(config, out, progress=False, log=quiet)
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert records == run.history
    assert run.primary == metric and run.finished
    for record in records:
        assert metric in record["test"]
        assert record["train_loss"] > 0 and record["stash_stored_bytes"] > 0
    assert records[-1]["train_loss"] < records[0]["train_loss"]  # it learns
    checkpoint = load_checkpoint(out / "checkpoint.pt")
    assert checkpoint["epoch"] == 3 and checkpoint["history"] == records
    info = json.loads((out / "run.json").read_text())
    assert info["synthetic"] == (dataset != "digits")
    assert info["primary_metric"] == metric
    assert (out / "model.py").read_text().startswith("# unroller: ")


def test_digits_run_learns_to_classify(tmp_path):
    config = TrainConfig(
        model=write_model(tmp_path, CLASSIFIER), dataset="digits", epochs=4, lr=0.1, batch_size=32
    )
    run = train(config, tmp_path / "run", progress=False, log=quiet)
    assert run.history[-1]["test"]["accuracy"] > 80.0  # chance is 10 %


def make_em_directory(root: Path, count: int = 12) -> Path:
    rng = np.random.default_rng(0)
    clean = rng.uniform(10.0, 50.0, size=(count, 16, 16, 1)).astype(np.float32)
    noisy = clean + rng.normal(0.0, 5.0, size=clean.shape).astype(np.float32)
    (root / "train").mkdir(parents=True)
    with h5py.File(root / "train" / "graphene_img_noise.h5", "w") as handle:
        handle["images"] = noisy
    with h5py.File(root / "train" / "graphene_img_clean.h5", "w") as handle:
        handle["images"] = clean
    return root


def test_tiny_run_on_sciml_hdf5_files(tmp_path):
    data_dir = make_em_directory(tmp_path / "em_graphene_sim")
    config = TrainConfig(
        model=write_model(tmp_path, DENOISER),
        dataset=f"sciml:{data_dir}",
        epochs=2,
        batch_size=4,
        lr=0.01,
    )
    run = train(config, tmp_path / "run", progress=False, log=quiet)
    assert not run.synthetic and "EMDenoise" in run.dataset
    assert len(run.history) == 2 and run.history[-1]["test"]["mse"] > 0


def stochastic_config(tmp_path: Path, epochs: int) -> TrainConfig:
    """Dropout and stochastic rounding both draw from the global RNG: a resume that did
    not restore it would diverge from the uninterrupted run."""
    compress = tmp_path / "stochastic.toml"
    compress.write_text('[default]\ncompressor = "quant"\nbits = 4\nstochastic = true\n')
    return TrainConfig(
        model=write_model(tmp_path, CLASSIFIER),
        dataset="digits",
        compress_config=str(compress),
        epochs=epochs,
        batch_size=32,
        lr=0.1,
        train_size=256,
        test_size=64,
        seed=3,
    )


class Interrupt(Exception):
    pass


def stop_after_first_epoch(line: str) -> None:
    """A log callback that interrupts a run right after epoch 1's checkpoint is saved."""
    if line.startswith("epoch 1/"):
        raise Interrupt


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    config = stochastic_config(tmp_path, epochs=3)
    full = train(config, tmp_path / "full", progress=False, log=quiet)

    with pytest.raises(Interrupt):
        train(config, tmp_path / "cut", progress=False, log=stop_after_first_epoch)
    assert [r["epoch"] for r in read_metrics(tmp_path / "cut")] == [1]
    resumed = train(
        config,
        tmp_path / "cut",
        resume=tmp_path / "cut" / "checkpoint.pt",
        progress=False,
        log=quiet,
    )
    assert without_times(resumed.history) == without_times(full.history)
    assert without_times(read_metrics(tmp_path / "cut")) == without_times(
        read_metrics(tmp_path / "full")
    )
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_restoring_rng_differs(tmp_path, monkeypatch):
    """The resume test above can fail: skipping the RNG restore changes the numbers."""
    config = stochastic_config(tmp_path, epochs=2)
    full = train(config, tmp_path / "full", progress=False, log=quiet)
    train(
        TrainConfig(**{**config.to_dict(), "epochs": 1}),
        tmp_path / "cut",
        progress=False,
        log=quiet,
    )
    monkeypatch.setattr(training, "set_rng_state", lambda state, device: torch.manual_seed(12345))
    resumed = train(
        config,
        tmp_path / "cut",
        resume=tmp_path / "cut" / "checkpoint.pt",
        progress=False,
        log=quiet,
    )
    assert without_times(resumed.history)[0] == without_times(full.history)[0]
    assert without_times(resumed.history)[1] != without_times(full.history)[1]


def test_resume_refuses_other_settings(tmp_path):
    config = stochastic_config(tmp_path, epochs=1)
    train(config, tmp_path / "run", progress=False, log=quiet)
    other = TrainConfig(**{**config.to_dict(), "lr": 0.2, "epochs": 2})
    with pytest.raises(TrainError, match=r"lr 0\.1 -> 0\.2"):
        train(other, tmp_path / "run", resume=tmp_path / "run" / "checkpoint.pt", log=quiet)


def test_resume_refuses_a_changed_model_file(tmp_path):
    config = stochastic_config(tmp_path, epochs=1)
    train(config, tmp_path / "run", progress=False, log=quiet)
    Path(config.model).write_text(CLASSIFIER.replace("out_channels=8", "out_channels=4"))
    longer = TrainConfig(**{**config.to_dict(), "epochs": 2})
    with pytest.raises(TrainError, match="generated model differs"):
        train(longer, tmp_path / "run", resume=tmp_path / "run" / "checkpoint.pt", log=quiet)


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    config = stochastic_config(tmp_path, epochs=2)
    out = tmp_path / "run"
    train(TrainConfig(**{**config.to_dict(), "epochs": 1}), out, progress=False, log=quiet)
    before = (out / "checkpoint.pt").read_bytes()
    real_replace = os.replace

    def disk_full_for_checkpoints(src, dst):
        if str(dst).endswith("checkpoint.pt"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", disk_full_for_checkpoints)
    with pytest.raises(TrainError, match="disk full"):  # one line: cannot write ...: disk full
        train(config, out, resume=out / "checkpoint.pt", progress=False, log=quiet)
    assert (out / "checkpoint.pt").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 1


def test_divergence_is_recorded_and_stops(tmp_path):
    config = TrainConfig(
        model=write_model(tmp_path, DENOISER),
        dataset="denoise",
        epochs=5,
        lr=1e6,
        momentum=0.0,
        train_size=64,
        test_size=16,
        batch_size=16,
    )
    run = train(config, tmp_path / "run", progress=False, log=quiet)
    assert run.history[-1]["diverged"] and run.history[-1]["epoch"] < 5
    assert run.finished


def test_lr_schedules():
    config = TrainConfig(model="m.txt", lr=0.1, epochs=5)
    assert config.lr_at(1) == pytest.approx(0.1)
    assert config.lr_at(5) == pytest.approx(0.001)
    assert config.lr_at(3) == pytest.approx(0.001 + 0.5 * 0.099)
    constant = TrainConfig(model="m.txt", lr=0.1, epochs=5, schedule="constant")
    assert [constant.lr_at(e) for e in range(1, 6)] == [0.1] * 5


def test_epoch_order_depends_on_seed_and_epoch_only():
    config = TrainConfig(model="m.txt", seed=1)
    torch.manual_seed(0)
    a = training.epoch_order(config, 2, 50)
    torch.manual_seed(99)
    assert torch.equal(a, training.epoch_order(config, 2, 50))
    assert not torch.equal(a, training.epoch_order(config, 3, 50))
    assert sorted(a.tolist()) == list(range(50))


def test_batches_drop_a_last_single_sample():
    assert training.batches(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert training.batches(9, 4) == [(0, 4), (4, 8)]
    assert training.batches(1, 4) == [(0, 1)]


runner = CliRunner()


def test_cli_train_writes_a_run(tmp_path):
    model = write_model(tmp_path, CLASSIFIER)
    out = tmp_path / "run"
    args = ["train", model, "--dataset", "digits", "--epochs", "1", "--train-size", "64"]
    result = runner.invoke(app, [*args, "--test-size", "32", "--out", str(out), "--lr", "0.1"])
    assert result.exit_code == 0, result.output
    assert "epoch 1/1" in result.output and "accuracy" in result.output
    assert len(read_metrics(out)) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["--dataset", "denoise"], "dataset 'denoise' is a denoising task"),
        (["--scheme", "zip"], "unknown scheme 'zip'"),
        (["--optimizer", "lbfgs"], "unknown optimizer 'lbfgs'"),
        (
            ["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"],
            "device",
        ),
        (["--resume", "missing.pt"], "no such checkpoint"),
    ],
)
def test_cli_train_errors_are_one_line_and_exit_2(tmp_path, args, message):
    model = write_model(tmp_path, CLASSIFIER)
    result = runner.invoke(app, ["train", model, "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_cli_train_reports_model_file_errors_with_a_position(tmp_path):
    model = write_model(tmp_path, CLASSIFIER.replace("relu(bn1)", "relu(bn9)"))
    result = runner.invoke(app, ["train", model, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert f"{model}:7:15: error: undefined name" in result.output and "error:" in result.output


def test_cli_resume_takes_the_checkpoints_settings(tmp_path):
    model = write_model(tmp_path, CLASSIFIER)
    out = tmp_path / "run"
    first = [
        "train",
        model,
        "--epochs",
        "1",
        "--train-size",
        "64",
        "--test-size",
        "32",
        "--lr",
        "0.1",
        "--batch-size",
        "16",
        "--seed",
        "4",
        "--out",
        str(out),
        "--quiet",
    ]
    assert runner.invoke(app, first).exit_code == 0
    resumed = runner.invoke(
        app, ["train", model, "--resume", str(out / "checkpoint.pt"), "--epochs", "2", "--quiet"]
    )
    assert resumed.exit_code == 0, resumed.output
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2]
    info = json.loads((out / "run.json").read_text())
    assert info["config"]["seed"] == 4 and info["config"]["lr"] == 0.1
    clash = runner.invoke(
        app, ["train", model, "--resume", str(out / "checkpoint.pt"), "--lr", "0.3"]
    )
    assert clash.exit_code == 2 and "lr 0.1 -> 0.3" in clash.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_and_resume(tmp_path):
    """On CUDA: data and model move to the device, the CUDA RNG state is checkpointed, and a
    resumed run reproduces the uninterrupted one (cuDNN is put in deterministic mode)."""
    config = TrainConfig(**{**stochastic_config(tmp_path, epochs=3).to_dict(), "device": "cuda"})
    full = train(config, tmp_path / "full", progress=False, log=quiet)
    checkpoint = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert "cuda" in checkpoint["rng"]

    with pytest.raises(Interrupt):
        train(config, tmp_path / "cut", progress=False, log=stop_after_first_epoch)
    resumed = train(
        config,
        tmp_path / "cut",
        resume=tmp_path / "cut" / "checkpoint.pt",
        progress=False,
        log=quiet,
    )
    assert without_times(resumed.history) == without_times(full.history)
    assert full.history[-1]["train_loss"] < full.history[0]["train_loss"]


def test_a_new_run_refuses_a_folder_that_holds_one(tmp_path):
    config = stochastic_config(tmp_path, epochs=1)
    train(config, tmp_path / "run", progress=False, log=quiet)
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    with pytest.raises(TrainError, match="already holds a run; continue it with --resume"):
        train(config, tmp_path / "run", progress=False, log=quiet)
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before


def test_extending_a_run_keeps_its_schedule_and_continues_at_the_final_lr(tmp_path):
    config = TrainConfig(**{**stochastic_config(tmp_path, epochs=3).to_dict(), "lr": 0.1})
    train(config, tmp_path / "run", progress=False, log=quiet)
    longer = TrainConfig(**{**config.to_dict(), "epochs": 5})
    run = train(longer, tmp_path / "run", resume=tmp_path / "run" / "checkpoint.pt", log=quiet)
    lrs = [r["lr"] for r in run.history]
    assert lrs[:3] == [pytest.approx(0.1), pytest.approx(0.0505), pytest.approx(0.001)]
    assert lrs[3:] == [pytest.approx(0.001), pytest.approx(0.001)]
    assert run.config.schedule_epochs == 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("momentum", -1.0, "--momentum must be at least 0"), ("weight_decay", -0.1, "--weight-decay")],
)
def test_negative_optimizer_settings_are_refused(tmp_path, field, value, message):
    config = TrainConfig(**{**stochastic_config(tmp_path, epochs=1).to_dict(), field: value})
    with pytest.raises(TrainError, match=message):
        train(config, tmp_path / "run", progress=False, log=quiet)


def test_an_empty_test_split_is_refused(tmp_path):
    from unroller.data import DatasetError

    data_dir = tmp_path / "em"
    (data_dir / "train").mkdir(parents=True)
    images = np.random.default_rng(0).uniform(size=(1, 16, 16, 1)).astype(np.float32)
    for name in ("graphene_img_noise.h5", "graphene_img_clean.h5"):
        with h5py.File(data_dir / "train" / name, "w") as handle:
            handle["images"] = images
    config = TrainConfig(model=write_model(tmp_path, DENOISER), dataset=f"sciml:{data_dir}")
    with pytest.raises(DatasetError, match="empty test split"):
        train(config, tmp_path / "run", progress=False, log=quiet)


def test_fp16_mixed_trains_with_a_loss_scaler_and_resumes_exactly(tmp_path):
    """--precision fp16-mixed: the step takes a GradScaler, whose state (scale, growth
    tracker) the checkpoint keeps, so a resumed run is the uninterrupted one."""
    config = TrainConfig(
        model=write_model(tmp_path, CLASSIFIER),
        dataset="digits",
        epochs=2,
        batch_size=32,
        lr=0.1,
        train_size=64,
        test_size=16,
        precision="fp16-mixed",
    )
    full = train(config, tmp_path / "full", progress=False, log=quiet)
    scaler = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["scaler"]
    assert scaler["scale"] > 1 and scaler["_growth_tracker"] == 4  # 2 steps per epoch
    assert '"precision": "fp16-mixed"' in (tmp_path / "full" / "model.py").read_text()
    with pytest.raises(Interrupt):
        train(config, tmp_path / "cut", progress=False, log=stop_after_first_epoch)
    resumed = train(
        config,
        tmp_path / "cut",
        resume=tmp_path / "cut" / "checkpoint.pt",
        progress=False,
        log=quiet,
    )
    assert without_times(resumed.history) == without_times(full.history)


def test_an_unknown_precision_is_a_training_error(tmp_path):
    config = TrainConfig(model=write_model(tmp_path, CLASSIFIER), precision="fp8")
    with pytest.raises(TrainError, match="unknown precision 'fp8'"):
        config.validate()


def test_update_in_backward_trains_as_the_plain_run_and_resumes_exactly(tmp_path):
    """``--update-in-backward``: the optimizer (SGD with momentum and weight decay) steps
    inside the backward; two epochs give the plain run's metrics and weights (the same
    updates, in float32 bit for bit), the generated file says so, and a run cut after its
    first epoch resumes to the same end (the optimizer's checkpointed state is the plain
    run's)."""
    config = stochastic_config(tmp_path, epochs=2)
    plain = train(config, tmp_path / "plain", progress=False, log=quiet)
    updating = TrainConfig(**{**config.to_dict(), "update_in_backward": True})
    full = train(updating, tmp_path / "full", progress=False, log=quiet)
    assert "K.update_params" in (tmp_path / "full" / "model.py").read_text()
    assert without_times(full.history) == without_times(plain.history)
    a = load_checkpoint(tmp_path / "plain" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    with pytest.raises(Interrupt):
        train(updating, tmp_path / "cut", progress=False, log=stop_after_first_epoch)
    resumed = train(
        updating,
        tmp_path / "cut",
        resume=tmp_path / "cut" / "checkpoint.pt",
        progress=False,
        log=quiet,
    )
    assert without_times(resumed.history) == without_times(full.history)


@pytest.mark.parametrize(
    "field,value,message",
    [("nproc_per_node", 2, "--nproc-per-node"), ("precision", "fp16-mixed", "GradScaler")],
)
def test_update_in_backward_refuses_what_it_cannot_combine_with(tmp_path, field, value, message):
    config = TrainConfig(
        model=write_model(tmp_path, CLASSIFIER), update_in_backward=True, **{field: value}
    )
    with pytest.raises(TrainError, match=message):
        config.validate()
