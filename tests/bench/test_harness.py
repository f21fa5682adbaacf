"""Smoke tests of the benchmark harness (unroller.bench: the suite and the command line).

Marked slow (they run the suite end to end): tiny sizes (the quick ResNet-8 at 16 x 16,
batch 2, one timed round), every peer, one scheme; the memory-budget search on a tiny
budget; the output files parse; the IPU path under the CPU emulation. Fast: the search
on a known peak curve (a stand-in for the memory measure), sizes, the hook peer, bad
arguments, the presets' dispatch, the model files outside a checkout, that the package
never imports the checkout's ``benchmarks``, `unroll bench --help`. Nothing here
asserts speed or memory targets.
"""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import unroller
from unroller.bench import budget, cli, config, main, paths, peers
from unroller.bench.reference import BENCHMARKS
from unroller.cli import app
from unroller.compiler.schemes import builtin

# Runs the benchmark script end to end: `make test-slow` (SLOW=1), not `make test`.
slow = pytest.mark.slow

TINY = ["--benchmark", "quick", "--resolution", "16", "--batch-size", "2"]
TINY += ["--iterations", "1", "--warmup", "0", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [*TINY, "--scheme", "dct-dense", "--memory-budget", "1KiB", "--out-dir", str(out)]
    assert main(argv) == 0
    return out


@slow
def test_outputs_exist_and_parse(gpu_run: Path):
    lines = _lines(gpu_run / "bench.jsonl")
    assert lines[0]["type"] == "meta"
    assert lines[0]["args"]["benchmarks"] == ["quick"]
    runs = [line for line in lines if line["type"] == "run"]
    methods = [r["method"] for r in runs]
    assert methods == ["ours:dct-dense", "autograd", "checkpoint", "hooks:dct-dense"]
    goals = [line for line in lines if line["type"] == "goal"]
    assert {g["goal"] for g in goals} >= {"nocompress_time", "dense_bytes", "dense_max_batch"}
    with (gpu_run / "bench.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["method"] for r in rows] == methods
    assert all(float(r["time_median_ms"]) > 0 and float(r["step_peak_bytes"]) > 0 for r in rows)
    md = (gpu_run / "bench.md").read_text(encoding="utf-8")
    assert "| benchmark | batch @ res | method |" in md and "### Goals" in md
    for name in ("memory", "time_ratio", "layers", "max_batch"):
        assert (gpu_run / f"bench_{name}.png").read_bytes()[:8] == PNG_MAGIC


@slow
def test_every_run_has_the_measures(gpu_run: Path):
    runs = [line for line in _lines(gpu_run / "bench.jsonl") if line["type"] == "run"]
    by = {r["method"]: r for r in runs}
    for r in runs:
        assert r["batch"] == 2 and r["resolution"] == 16
        t = r["time_ms"]
        assert t["p10"] <= t["median"] <= t["p90"]
        assert r["samples_per_s"] > 0 and r["loss"] > 0
        assert r["memory"]["how"] == "cpu-profiler"
        assert r["memory"]["total_peak_bytes"] > r["memory"]["step_peak_bytes"] > 0
        assert r["memory"]["live_at_backward_bytes"] > 0
        assert 0 < r["stash"]["stored_bytes"] <= r["stash"]["raw_bytes"]
    # same weights and batch: the same forward pass, so the same loss
    assert by["autograd"]["loss"] == pytest.approx(by["checkpoint"]["loss"], rel=1e-6)
    assert by["autograd"]["loss"] == pytest.approx(by["ours:dct-dense"]["loss"], rel=1e-5)
    assert by["autograd"]["time_ratio"]["median"] == 1.0
    assert by["ours:dct-dense"]["stash"]["rows"]
    assert by["hooks:dct-dense"]["stash"]["compressed_calls"] > 0


@slow
def test_tiny_budget_fits_no_batch_and_says_so(gpu_run: Path):
    runs = [line for line in _lines(gpu_run / "bench.jsonl") if line["type"] == "run"]
    for r in runs:
        mb = r["max_batch"]
        assert mb["budget_bytes"] == 1024
        assert mb["max_batch"] == 0 and mb["confirmed"]
        assert [m["batch"] for m in mb["measured"]][:1] == [1]  # the confirmation


def _fake_peaks(monkeypatch, curve):
    calls = []

    def fake(method, batch, device):
        n = batch[0].shape[0]
        calls.append(n)
        return {"total_peak_bytes": curve(n)}

    monkeypatch.setattr(budget, "peak_step", fake)
    return calls


@pytest.mark.parametrize(
    "curve, limit",
    [
        (lambda n: 1000 + 100 * n, 5050),  # linear: the first prediction holds
        (lambda n: 1000 + 100 * n + n * n, 6000),  # convex: corrected by the secant
        (lambda n: 1000 + 99 * n + (n % 3) * 40, 4000),  # not smooth
    ],
)
def test_search_finds_and_confirms_the_largest_batch(monkeypatch, curve, limit):
    calls = _fake_peaks(monkeypatch, curve)
    method = peers.Method("m", "ours", None, torch.nn.Linear(1, 1), None, None)
    fit = budget.probe_fit(method, lambda n: [torch.zeros(n)], (2, 4), torch.device("cpu"))
    found = budget.search(method, lambda n: [torch.zeros(n)], limit, fit, torch.device("cpu"))
    best = max(n for n in range(1, 200) if curve(n) <= limit)
    assert found["max_batch"] == best and found["confirmed"]
    assert found["predicted_max_batch"] == budget.predict_max(
        fit["intercept_bytes"], fit["bytes_per_sample"], limit
    )
    assert len(calls) <= 2 + budget.MAX_STEPS


def test_fit_and_sizes():
    assert budget.fit_line([(2, 1200), (4, 1400)]) == pytest.approx((1000.0, 100.0))
    assert budget.predict_max(1000, 100, 1550) == 5
    assert budget.predict_max(1000, 100, 1550, granularity=2) == 4
    assert budget.predict_max(1000, 0, 1550) is None
    assert config.parse_bytes("2GiB") == 2 * 1024**3
    assert config.parse_bytes("512MiB") == 512 * 1024**2
    assert config.parse_bytes("1.5GB") == 1_500_000_000
    assert config.parse_bytes("4096") == 4096
    for bad in ("2 parsecs", "", "-1GiB", "0"):
        with pytest.raises(ValueError):
            config.parse_bytes(bad)


def test_hook_peer_compresses_only_eligible_tensors():
    hooks = peers.CompressingHooks(
        builtin("dct-dense").default.instance(), torch.nn.Conv2d(3, 4, 3)
    )
    assert hooks.eligible(torch.randn(2, 3, 8, 8))
    assert not hooks.eligible(torch.randn(2, 3, 4, 8))  # H < 8
    assert not hooks.eligible(torch.randn(2, 3, 8))  # 3 dims
    assert not hooks.eligible(torch.randn(2, 3, 8, 8).to(torch.int64))
    assert not hooks.eligible(torch.nn.Parameter(torch.randn(2, 3, 8, 8)))
    x = torch.randn(2, 3, 16, 16)
    packed = hooks.pack(x)
    assert not isinstance(packed, torch.Tensor)
    assert hooks.unpack(packed).shape == x.shape
    assert hooks.packed_bytes < x.numel() * 4


@slow
def test_ipu_emulation_runs_and_says_so(tmp_path: Path, capsys):
    argv = [*TINY, "--platform", "ipu", "--emulate", "--scheme", "nocompress"]
    argv += ["--memory-budget", "none", "--no-plots", "--no-get-memory", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    screen = " ".join(capsys.readouterr().out.split())
    assert "CPU EMULATION" in screen and "not IPU timings" in screen
    lines = _lines(tmp_path / "bench_ipu.jsonl")
    assert any("CPU EMULATION" in line for line in lines[0]["about"])
    runs = [line for line in lines if line["type"] == "run"]
    ours = next(r for r in runs if r["method"] == "ours:nocompress")
    assert ours["emulated"] and ours["platform"] == "ipu" and ours["time_ms"]["median"] > 0


def test_ipu_without_poptorch_or_emulate_exits_2(tmp_path: Path, capsys):
    try:
        import poptorch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("PopTorch is installed here")
    assert main([*TINY, "--platform", "ipu", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PopTorch" in err[0] and "--emulate" in err[0]
    assert not list(tmp_path.iterdir())


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["--benchmark", "no-such-model"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--emulate"])  # an IPU flag without --platform ipu
    assert exc.value.code == 2


def test_a_resolution_the_model_cannot_take_exits_2(tmp_path: Path, capsys):
    argv = ["--benchmark", "emdenoise", "--resolution", "60", "--out-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "multiple of 8" in err and len(err.strip().splitlines()) == 1


def test_unroll_bench_help():
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--benchmark", "--scheme", "--memory-budget", "--emulate", "--full"):
        assert flag in result.output
    assert "Example: unroll bench" in " ".join(result.output.split())


def test_presets_share_one_command_line(capsys):
    """`unroll bench core|compress ...` reach their presets, under the caller's name."""
    for preset in ("core", "compress"):
        with pytest.raises(SystemExit) as exc:
            cli.run([preset, "--help"], prog="python -m benchmarks.run")
        assert exc.value.code == 0
        usage = " ".join(capsys.readouterr().out.split())
        assert f"usage: python -m benchmarks.run {preset}" in usage
        assert "--models-dir" in usage and "--threads" in usage
    with pytest.raises(SystemExit) as exc:
        main(["core", "--models", "no-such-model"])
    assert exc.value.code == 2
    assert "unknown models" in capsys.readouterr().err


def test_model_files_outside_a_checkout(monkeypatch, tmp_path: Path, capsys):
    """Installed without a checkout: one clear line and exit 2, unless --models-dir."""
    quick = BENCHMARKS["quick"].path.read_text(encoding="utf-8")
    monkeypatch.setattr(paths, "checkout_root", lambda: None)
    for argv in (["--benchmark", "quick"], ["core"], ["compress"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--models-dir" in err[0] and "checkout" in err[0], err
    assert paths.default_results_dir() == paths.OUTSIDE_RESULTS
    assert main(["--benchmark", "quick", "--models-dir", str(tmp_path)]) == 2
    assert "quick.txt: no such model file" in capsys.readouterr().err
    copy = tmp_path / "quick.txt"
    copy.write_text(quick, encoding="utf-8")
    assert BENCHMARKS["quick"].with_models_dir(tmp_path).path == copy
    assert BENCHMARKS["quick"].with_models_dir(tmp_path).label == "benchmarks/models/quick.txt"


def test_the_package_never_imports_the_checkouts_benchmarks():
    """``benchmarks`` is not in the wheel: nothing under unroller/ may import it."""
    package = Path(unroller.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "benchmarks" for n in names), path


def test_a_failing_benchmark_costs_only_itself(tmp_path, monkeypatch, capsys):
    """A benchmark that raises (a bug) is one line naming it and a log file with the
    traceback, at once; the other benchmarks are still measured and the results files
    written, saying which benchmark was not measured; the exit status is the internal
    error's. With UNROLL_DEBUG=1 the exception goes through."""
    from unroller import crash
    from unroller.bench import suite

    real = suite.bench_one

    def flaky(bench, *args, **kwargs):
        if bench.name == "resnet_like":
            raise KeyError(1234)
        return real(bench, *args, **kwargs)

    monkeypatch.setattr(suite, "bench_one", flaky)
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(logs))
    monkeypatch.delenv(crash.DEBUG_ENV, raising=False)
    out = tmp_path / "out"
    argv = [*TINY, "--benchmark", "resnet_like,quick", "--scheme", "nocompress"]
    argv += ["--peers", "none", "--no-recompute", "--no-segments", "--memory-budget", "none"]
    argv += ["--no-plots", "--no-get-memory", "--out-dir", str(out)]
    assert main(argv) == crash.INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "resnet_like: " in err and "internal error: KeyError: 1234" in err
    (log,) = logs.glob("unroller-*-crash-*.log")
    assert "KeyError: 1234" in log.read_text() and str(log) in err
    meta, *records = _lines(out / "bench.jsonl")
    assert {r["benchmark"] for r in records if "method" in r} == {"quick"}
    assert any(a.startswith("resnet_like: not measured: ") for a in meta["about"])
    assert meta["args"]["out_dir"] == "out"  # no absolute path of this machine
    assert "resnet_like: not measured" in (out / "bench.md").read_text()
    monkeypatch.setenv(crash.DEBUG_ENV, "1")
    with pytest.raises(KeyError):
        main(argv)
