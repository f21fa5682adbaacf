"""unroll accuracy: shared initial weights, the table, the plots, reuse of finished runs."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.train_models import CLASSIFIER, DENOISER
from unroller.cli import app
from unroller.training.accuracy import ALL, parse_schemes, run_accuracy, scheme_options, summarise
from unroller.training.loop import TrainConfig, TrainError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def quiet(_line: str) -> None:
    pass


def base_config(tmp_path: Path, text: str = CLASSIFIER, **extra) -> TrainConfig:
    model = tmp_path / "model.txt"
    model.write_text(text, encoding="utf-8")
    values = dict(
        model=str(model),
        dataset="digits",
        epochs=2,
        batch_size=32,
        lr=0.1,
        train_size=128,
        test_size=64,
    )
    values.update(extra)
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("accuracy")
    out = tmp_path / "out"
    logs: list[str] = []
    rows = run_accuracy(
        base_config(tmp_path),
        ["nocompress", "quant-2bit"],
        [0, 1],
        out,
        command="unroll accuracy model.txt --schemes nocompress,quant-2bit --seeds 2",
        progress=False,
        log=logs.append,
    )
    return out, rows, logs


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_scheme_starts_from_the_seeds_initial_weights(experiment):
    out, _, _ = experiment
    for seed in (0, 1):
        init = torch.load(out / "init" / f"seed{seed}.pt", weights_only=True)
        for scheme in ("nocompress", "quant-2bit"):
            info = json.loads((out / "runs" / scheme / f"seed{seed}" / "run.json").read_text())
            assert Path(info["config"]["init"]) == (out / "init" / f"seed{seed}.pt").resolve()
            assert info["config"]["seed"] == seed
    a = torch.load(out / "init" / "seed0.pt", weights_only=True)
    b = torch.load(out / "init" / "seed1.pt", weights_only=True)
    assert not torch.equal(a["conv1.weight"], b["conv1.weight"])
    assert init.keys() == a.keys()


def test_table_numbers_come_from_the_runs(experiment):
    out, rows, _ = experiment
    by_scheme = {row.scheme: row for row in rows}
    assert list(by_scheme) == ["nocompress", "quant-2bit"]
    for scheme, row in by_scheme.items():
        finals = [
            metrics_of(out / "runs" / scheme / f"seed{s}")[-1]["test"]["accuracy"] for s in (0, 1)
        ]
        assert row.finals == finals
        assert row.mean == pytest.approx(statistics.fmean(finals))
        assert row.std == pytest.approx(statistics.stdev(finals))
        assert (row.low, row.high) == (min(finals), max(finals))
    base, quant = by_scheme["nocompress"], by_scheme["quant-2bit"]
    assert base.delta == 0.0 and quant.delta == pytest.approx(quant.mean - base.mean)
    assert base.stored_vs_baseline == 1.0
    assert quant.stored_vs_baseline > 2.0  # 2-bit codes instead of 32-bit floats
    first = metrics_of(out / "runs" / "quant-2bit" / "seed0")[0]
    assert quant.stored_bytes == first["stash_stored_bytes"]


def test_markdown_csv_json_and_plots_are_written(experiment):
    out, rows, _ = experiment
    text = (out / "accuracy.md").read_text()
    assert "unroll accuracy model.txt --schemes nocompress,quant-2bit --seeds 2" in text
    assert "| quant-2bit |" in text and "mean ± std (2 seeds)" in text
    assert f"{rows[1].mean:.2f} ± {rows[1].std:.2f}" in text
    with open(out / "accuracy.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["scheme"] for r in table] == ["nocompress", "quant-2bit"]
    assert float(table[1]["seed1"]) == rows[1].finals[1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "classification" and len(summary["rows"]) == 2
    for name in ("accuracy.png", "train_loss.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_quant_bits_variants_are_written_as_configs(experiment):
    out, _, _ = experiment
    config = (out / "configs" / "quant-2bit.toml").read_text()
    assert 'compressor = "quant"' in config and "bits = 2" in config
    generated = (out / "runs" / "quant-2bit" / "seed0" / "model.py").read_text()
    assert "bits=2" in generated


def test_a_second_call_reuses_finished_runs(experiment, tmp_path):
    out, rows, _ = experiment
    logs: list[str] = []
    config = TrainConfig.from_dict(
        json.loads((out / "runs" / "nocompress" / "seed0" / "run.json").read_text())["config"]
    )
    base = TrainConfig(**{**config.to_dict(), "scheme": "nocompress", "seed": 0, "init": None})
    again = run_accuracy(
        base, ["nocompress", "quant-2bit"], [0, 1], out, progress=False, log=logs.append
    )
    assert sum("reused" in line for line in logs) == 4
    assert [r.finals for r in again] == [r.finals for r in rows]


def test_parse_schemes():
    assert parse_schemes("all") == list(ALL)
    assert parse_schemes("quant, dct-dense,quant") == ["quant-8bit", "dct-dense"]
    with pytest.raises(TrainError, match="unknown scheme 'zip'"):
        parse_schemes("nocompress,zip")
    with pytest.raises(TrainError, match="no such compression config"):
        parse_schemes("missing.toml")


def test_scheme_options(tmp_path):
    assert scheme_options("dct-dense", tmp_path) == ("dct-dense", None)
    assert scheme_options("quant-8bit", tmp_path) == ("quant", None)
    scheme, path = scheme_options("quant-4bit", tmp_path)
    assert scheme == "quant" and "bits = 4" in Path(path).read_text()


def test_summary_marks_diverged_runs():
    ok = [
        {
            "epoch": 1,
            "train_loss": 1.0,
            "train_time_s": 1.0,
            "stash_stored_bytes": 100,
            "test": {"psnr": 20.0, "mse": 0.01},
        }
    ]
    bad = [{"epoch": 1, "diverged": True, "train_loss": None, "test": None}]
    rows = summarise({"nocompress": {0: ok, 1: ok}, "quant-2bit": {0: ok, 1: bad}}, "denoising")
    assert rows[1].diverged == 1 and rows[1].finals == [20.0, None]
    assert rows[1].mean == 20.0 and rows[0].delta == 0.0


def test_cli_accuracy_runs_and_prints_the_table(tmp_path):
    model = tmp_path / "model.txt"
    model.write_text(DENOISER, encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "accuracy",
            str(model),
            "--dataset",
            "denoise",
            "--schemes",
            "nocompress,dct-dense",
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--train-size",
            "32",
            "--test-size",
            "16",
            "--lr",
            "0.01",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "| dct-dense |" in result.output and "denoise (synthetic)" in result.output
    assert (out / "psnr.png").is_file()


def test_cli_accuracy_rejects_unknown_schemes(tmp_path):
    model = tmp_path / "model.txt"
    model.write_text(DENOISER, encoding="utf-8")
    result = CliRunner().invoke(app, ["accuracy", str(model), "--schemes", "gzip"])
    assert result.exit_code == 2 and "unknown scheme 'gzip'" in result.output


def test_gradient_error_is_zero_for_nocompress_and_measured_for_lossy(experiment):
    out, rows, _ = experiment
    by_scheme = {row.scheme: row for row in rows}
    assert by_scheme["nocompress"].grad_error == 0.0
    lossy = by_scheme["quant-2bit"].grad_error
    assert 1e-4 < lossy < 2.0
    probes = [
        json.loads((out / "runs" / "quant-2bit" / f"seed{s}" / "gradient_probe.json").read_text())
        for s in (0, 1)
    ]
    assert lossy == pytest.approx(statistics.fmean(p["relative_l2"] for p in probes))
    assert all(p["epoch"] == 2 and p["batch"] == 32 for p in probes)
    assert "| 0 (exact) |" in (out / "accuracy.md").read_text()


def test_gradient_error_matches_an_independent_computation(experiment):
    """Recompute the probe of one run with the reference recipe: same weights, same RNG."""
    from unroller.api import import_generated, load_graph
    from unroller.data import load, signature

    out, _, _ = experiment
    run_dir = out / "runs" / "quant-2bit" / "seed1"
    config = json.loads((run_dir / "run.json").read_text())["config"]
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    data = load("digits", signature(load_graph(config["model"])), 0, 128, 64)
    x, y = data.train.inputs[:32], data.train.targets[:32]
    grads = []
    for i, path in enumerate((out / "init" / "model.py", run_dir / "model.py")):
        model = import_generated(path, f"probe_check_{i}").Model()
        model.load_state_dict(state)
        torch.manual_seed(0)
        model(x, y)
        grads.append(torch.cat([p.grad.flatten().double() for p in model.parameters()]))
    expected = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    probe = json.loads((run_dir / "gradient_probe.json").read_text())
    assert probe["relative_l2"] == pytest.approx(expected, rel=1e-12)


def test_activation_error_script_reports_every_saved_activation(tmp_path, capsys):
    from benchmarks.activation_error import main

    model = tmp_path / "model.txt"
    model.write_text(CLASSIFIER, encoding="utf-8")
    main([str(model), "--dataset", "digits", "--batch-size", "16"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| conv1 |")]
    assert len(rows) == 1
    errors = [float(cell) for cell in rows[0].strip("|").split("|")[2:]]
    assert len(errors) == 4
    dct, q8, q4, q2 = errors
    assert 0 < q8 < q4 < q2 < 1.0 and 0 < dct < 1.0  # fewer bits, larger error
    assert "| x |" not in out  # model inputs are never compressed
    assert "| 8 | " in out  # the per-size summary


def makefile_accuracy_commands() -> list[list[str]]:
    """The `make accuracy` recipe's commands, as argument lists after `unroll`."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    common = shlex.split(text.split("ACCURACY := $(UNROLL)", 1)[1].splitlines()[0])
    recipe = text.split("\naccuracy: $(STAMP)\n", 1)[1].split("\n\n", 1)[0]
    commands = recipe.replace("\\\n", " ").splitlines()
    return [common + shlex.split(line.replace("$(ACCURACY)", "")) for line in commands]


@pytest.mark.slow  # trains every scheme of the three experiments: make test-slow
def test_make_accuracy_commands_run(tmp_path):
    """Each `make accuracy` command, cut to one tiny epoch, runs and writes its table
    (so the README's commands stay valid)."""
    commands = makefile_accuracy_commands()
    assert [c[c.index("--dataset") + 1] for c in commands] == ["digits", "denoise", "clouds"]
    for index, args in enumerate(commands):
        out = tmp_path / f"out{index}"
        tiny = ["--schemes", "nocompress,dct-dense", "--seeds", "1", "--epochs", "1"]
        tiny += ["--train-size", "16", "--test-size", "8", "--out", str(out)]
        result = CliRunner().invoke(app, args + tiny)
        assert result.exit_code == 0, result.output
        assert "| dct-dense |" in (out / "accuracy.md").read_text()


def test_one_seed_shows_no_spread():
    ok = [
        {
            "epoch": 1,
            "train_loss": 1.0,
            "train_time_s": 1.0,
            "stash_stored_bytes": 100,
            "test": {"accuracy": 90.0, "loss": 0.3},
        }
    ]
    rows = summarise({"nocompress": {0: ok}}, "classification")
    assert rows[0].std is None and rows[0].mean == 90.0
    from unroller.training.accuracy import markdown

    header = {
        k: "x"
        for k in ("model", "dataset_title", "dataset", "command", "training", "machine", "finished")
    }
    assert "| nocompress | 90.00 | 90.00 - 90.00 |" in markdown(rows, header)


def test_a_results_folder_of_another_model_version_is_refused(tmp_path):
    config = base_config(tmp_path, epochs=1, train_size=32, test_size=16)
    run_accuracy(config, ["nocompress"], [0], tmp_path / "out", progress=False, log=quiet)
    Path(config.model).write_text(CLASSIFIER.replace("out_channels=8", "out_channels=6"))
    with pytest.raises(TrainError, match="another version of the model"):
        run_accuracy(config, ["nocompress"], [0], tmp_path / "out", progress=False, log=quiet)
