"""The benchmark suite's budget figures: the quarter budget, samples/s at the max batch,
the predicted floor, the goals, and the optional pieces (compiled peers, Model(compile=True),
the memory model, the timeline plot) wired in behind flags.

Fast: flags and presets, the budget arithmetic, the search with reserved bytes and a
step-time limit on a known peak curve (a stand-in for the memory measure), the speed phase
on tiny linear models, the goals and the Markdown / CSV on hand-made records, and the
guards that keep the suite running where an optional piece is missing. Slow (SLOW=1): one
tiny run of the suite end to end. Nothing here asserts speed or memory targets.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import pytest
import torch

from unroller.bench import budget, config, main, models, output, peers, suite, targets
from unroller.bench.reference import BENCHMARKS
from unroller.bench.stats import summary

CPU = torch.device("cpu")
TINY = ["--benchmark", "quick", "--resolution", "16", "--batch-size", "2"]
TINY += ["--iterations", "1", "--warmup", "0", "--no-progress"]


# --------------------------------------------------------------------------- flags


def test_quarter_is_the_default_budget_of_both_presets():
    for argv in ([], ["--full"]):
        args = config.parse_args(argv)
        assert args.memory_budget == config.QUARTER
    assert config.parse_args(["--memory-budget", "none"]).memory_budget is None
    assert config.parse_args(["--memory-budget", "auto"]).memory_budget == config.AUTO
    assert config.parse_args(["--memory-budget", "2MiB"]).memory_budget == 2 * 1024**2


def test_presets_choose_peers_rounds_and_the_step_limit():
    quick, full = config.parse_args([]), config.parse_args(["--full"])
    assert quick.peers == ["checkpoint", "hooks"]
    assert full.peers == list(config.PEERS)
    assert quick.max_batch_rounds == 2 and full.max_batch_rounds == 3
    assert quick.max_step_seconds == 3.0 and full.max_step_seconds is None
    args = config.parse_args(["--peers", "compiled,hooks", "--max-step-seconds", "0"])
    assert args.peers == ["compiled", "hooks"] and args.max_step_seconds is None
    assert config.parse_args(["--peers", "none"]).peers == []
    assert config.parse_args(["--peers", "all"]).peers == list(config.PEERS)


@pytest.mark.parametrize(
    "argv",
    [
        ["--peers", "nobody"],
        ["--max-step-seconds", "-1"],
        ["--platform", "ipu", "--emulate", "--compile"],
    ],
)
def test_bad_new_flags_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        config.parse_args(argv)
    assert exc.value.code == 2


# --------------------------------------------------------------------------- budget


def test_quarter_budget_is_four_times_weights_gradients_and_momentum():
    layer = torch.nn.Linear(10, 5)  # 55 float32 parameters
    assert budget.parameter_bytes(layer) == 220
    assert budget.quarter_budget(layer) == 4 * 3 * 220
    assert budget.optimizer_state_bytes(layer) == 220


def test_own_total_leaves_out_other_modules_on_cuda():
    layer = torch.nn.Linear(10, 5)
    batch = [torch.zeros(4, 10)]
    cpu = {"how": "cpu-profiler", "step_peak_bytes": 100, "total_peak_bytes": 480}
    assert budget.own_total(cpu, layer, batch) == 480
    cuda = {"how": "cuda", "step_peak_bytes": 100, "total_peak_bytes": 10**9}
    assert budget.own_total(cuda, layer, batch) == 100 + 220 + 160


def test_largest_batch_under_a_step_time_limit():
    assert budget.largest_batch(10.0, 3.0) == 300
    assert budget.largest_batch(10.0, 3.0, granularity=8) == 296
    assert budget.largest_batch(10_000.0, 3.0) == 1  # at least one step
    assert budget.largest_batch(10.0, None) is None
    assert budget.largest_batch(None, 3.0) is None


def _fake_peaks(monkeypatch, curve):
    calls = []

    def fake(method, batch, device):
        n = batch[0].shape[0]
        calls.append(n)
        return {"total_peak_bytes": curve(n)}

    monkeypatch.setattr(budget, "peak_step", fake)
    return calls


def _method():
    return peers.Method("m", "ours", None, torch.nn.Linear(1, 1), None, None)


def _search(curve, limit, **kw):
    method, make = _method(), (lambda n: [torch.zeros(n)])
    fit = budget.probe_fit(method, make, (2, 4), CPU)
    return budget.search(method, make, limit, fit, CPU, **kw)


def test_search_counts_the_reserved_bytes(monkeypatch):
    curve = lambda n: 1000 + 100 * n  # noqa: E731
    _fake_peaks(monkeypatch, curve)
    found = _search(curve, 5050, reserved=500)
    assert found["max_batch"] == 35 and found["confirmed"]  # 1000 + 3500 + 500 <= 5050
    assert found["reserved_bytes"] == 500 and found["basis"] == "measured"
    assert found["budget_bytes"] == 5050


def test_search_beyond_the_step_limit_predicts_and_says_so(monkeypatch):
    curve = lambda n: 1000 + 100 * n + (n % 3) * 7  # noqa: E731
    calls = _fake_peaks(monkeypatch, curve)
    found = _search(curve, 50_000, largest=10)
    assert max(calls) == 10  # measured up to the limit, never beyond
    assert not found["confirmed"] and found["basis"] == "predicted"
    assert found["measured_max_batch"] == 10 and found["largest_measurable"] == 10
    a, b = budget.fit_line([(4, curve(4)), (10, curve(10))])
    assert found["max_batch"] == budget.predict_max(a, b, 50_000)
    assert any("time limit" in n for n in found["notes"])


def test_search_within_the_step_limit_confirms(monkeypatch):
    curve = lambda n: 1000 + 100 * n  # noqa: E731
    _fake_peaks(monkeypatch, curve)
    found = _search(curve, 5050, largest=100)
    assert found["max_batch"] == 40 and found["confirmed"] and found["basis"] == "measured"


# --------------------------------------------------------------------------- floor


def test_ideal_max_batch_is_what_fits_at_the_floor():
    predicted = {"floor_fixed_bytes": 1000.0, "floor_per_sample_bytes": 90.0}
    # 10_000 - 2000 fixed - 1000 = 7000 over (90 + 10) per sample
    assert models.ideal_max_batch(predicted, 10_000, 2000, 10.0) == 70
    assert models.ideal_max_batch(predicted, 10_000, 2000, 10.0, granularity=8) == 64
    assert models.ideal_max_batch(predicted, 2_000, 2000, 10.0) == 0
    flat = {"floor_fixed_bytes": 1000.0, "floor_per_sample_bytes": 0.0}
    assert models.ideal_max_batch(flat, 10_000, 0, 0.0) is None


def test_measured_figures_set_against_the_predicted():
    predicted = {
        "batch": 4,
        "peak_bytes": 1000,
        "floor_bytes": 800,
        "stash_bytes": 100,
        "floor_fixed_bytes": 400.0,
        "floor_per_sample_bytes": 100.0,
    }
    mb = {"budget_bytes": 10_000, "reserved_bytes": 1000, "max_batch": 50}
    out = suite._with_measured(predicted, {"step_peak_bytes": 1200}, mb, 600, 20.0, 1)
    assert out["measured_over_floor"] == pytest.approx(1.5)
    assert out["measured_over_predicted"] == pytest.approx(1.2)
    assert out["ideal_max_batch"] == 66  # (10_000 - 1600 - 400) / 120
    assert out["ideal_over_max_batch"] == pytest.approx(66 / 50)
    assert suite._with_measured(None, None, None, 0, 0.0, 1) is None
    bare = suite._with_measured(predicted, None, None, 600, 20.0, 1)
    assert bare["measured_over_floor"] is None and bare["ideal_max_batch"] is None


def test_predict_memory_gives_the_floor_line(monkeypatch):
    sims = {4: (900, 700, 50), 8: (1700, 1300, 90)}

    def fake(text, options, n):
        peak, floor, stash = sims[n]
        return types.SimpleNamespace(peak_bytes=peak, floor_bytes=floor, stash_bytes=stash)

    monkeypatch.setattr(models, "memory_model", lambda: fake)
    bench = types.SimpleNamespace(model_text=lambda resolution: "text")
    got = models.predict_memory(bench, types.SimpleNamespace(resolution=16), 4)
    assert got["floor_per_sample_bytes"] == 150 and got["floor_fixed_bytes"] == 100
    assert got["peak_bytes"] == 900 and got["floor_bytes"] == 700
    monkeypatch.setattr(models, "memory_model", lambda: None)
    assert models.predict_memory(bench, types.SimpleNamespace(resolution=16), 4) is None


# --------------------------------------------------------------------------- speed


def _linear_method(name: str, kind: str) -> peers.Method:
    layer = torch.nn.Linear(8, 1)

    def run(batch, mark):
        layer.zero_grad(set_to_none=True)
        loss = layer(batch[0]).square().mean()
        loss.backward()
        return loss

    return peers.Method(name, kind, None, layer, run, lambda b: {})


def test_samples_per_second_at_each_methods_max_batch():
    methods = [_linear_method("ours:x", "ours"), _linear_method("autograd", "autograd")]
    methods.append(_linear_method("checkpoint", "checkpoint"))
    args = argparse.Namespace(max_step_seconds=None, max_batch_rounds=3)
    run = types.SimpleNamespace(
        args=args, granularity=1, device=CPU, make_batch=lambda n: [torch.randn(n, 8)]
    )
    searched = {
        "ours:x": {"max_batch": 24, "basis": "measured", "measured_max_batch": 24},
        "autograd": {"max_batch": 8, "basis": "measured", "measured_max_batch": 8},
        "checkpoint": {"max_batch": 0, "basis": "measured", "measured_max_batch": 0},
    }
    rounds = []
    found = suite._speed_at_max_batch(run, methods, searched, {}, rounds.append)
    assert set(found) == {"ours:x", "autograd"}  # no batch fits: not timed
    assert rounds == [1, 2, 3, 4]  # one warm-up round, then three
    ours, ag = found["ours:x"], found["autograd"]
    assert ours["batch"] == 24 and ours["at_max_batch"] and ours["rounds"] == 3
    assert len(ours["time_ms"]["samples"]) == 3
    assert ours["samples_per_s"] == pytest.approx(24 / (ours["time_ms"]["median"] / 1e3))
    assert ag["ratio_vs_autograd"]["median"] == 1.0
    per_round = [
        (24 / a) / (8 / b) for a, b in zip(ours["time_ms"]["samples"], ag["time_ms"]["samples"])
    ]
    assert ours["ratio_vs_autograd"]["median"] == pytest.approx(summary(per_round)["median"])


def test_the_timed_batch_respects_the_limits():
    run = types.SimpleNamespace(args=argparse.Namespace(max_step_seconds=1.0), granularity=1)
    measured = {"max_batch": 300, "basis": "measured", "measured_max_batch": 300}
    predicted = {"max_batch": 300, "basis": "predicted", "measured_max_batch": 40}
    assert suite._timed_batch(run, measured, 10.0) == 100  # 1 s at 10 ms a sample
    assert suite._timed_batch(run, predicted, 1.0) == 40  # only what was measured to fit
    assert suite._timed_batch(run, None, 1.0) == 0


# --------------------------------------------------------------------------- goals


def _rec(method, kind="ours", scheme=None, batch=None, **extra):
    rec = {
        "benchmark": extra.pop("benchmark", "resnet34"),
        "method": method,
        "kind": kind,
        "scheme": scheme,
        "batch": 4,
        "time_ratio": {"median": extra.pop("time_ratio", 1.0)},
        "max_batch": None if batch is None else {"max_batch": batch, "bytes_per_sample": 1.0},
        "predicted": extra.pop("predicted", None),
        "max_batch_speed": extra.pop("speed", None),
    }
    rec.update(extra)
    return rec


def _by_goal(found):
    return {g["goal"]: g for g in found}


def test_budget_goals_per_scheme():
    speed = {"batch": 60, "ratio_vs_autograd": {"median": 0.9}}
    pred = {
        "ideal_max_batch": 70,
        "floor_fixed_bytes": 0.0,
        "floor_per_sample_bytes": 2**20,
        "measured_over_floor": 1.1,
    }
    records = [
        _rec("ours:dct-dense", scheme="dct-dense", batch=60, predicted=pred, speed=speed),
        _rec("autograd", "autograd", batch=10, speed={"batch": 10, "ratio_vs_autograd": None}),
        _rec("checkpoint", "checkpoint", batch=20),
        _rec("hooks:dct-dense", "hooks", "dct-dense", batch=59),
    ]
    found = _by_goal(targets.evaluate(records, device="cpu"))
    assert found["dense_max_batch"]["met"] is True  # 6.0x on ResNet-34
    assert found["ideal_batch:dct-dense"]["met"] is None  # stated for the U-Nets
    assert found["ahead_of_peers:dct-dense"]["met"] is True
    assert found["speed_at_max_batch"]["met"] is True
    assert found["floor"]["met"] is True
    assert found["cpu_time"]["met"] is True
    assert "auto" not in " ".join(found)  # auto not run: no auto entries
    records[0]["max_batch"]["max_batch"] = 59  # level with the hook peer: not ahead
    records[0]["predicted"]["measured_over_floor"] = 1.3
    records[0]["time_ratio"]["median"] = 1.2
    found = _by_goal(targets.evaluate(records, device="cpu"))
    assert found["ahead_of_peers:dct-dense"]["met"] is False
    assert found["dense_max_batch"]["met"] is False
    assert found["floor"]["met"] is False
    assert found["cpu_time"]["met"] is False
    assert _by_goal(targets.evaluate(records, device="cuda"))["cpu_time"]["met"] is None


def test_ideal_goal_on_the_unets_and_auto_entries():
    pred = {"ideal_max_batch": 30, "floor_fixed_bytes": 0.0, "floor_per_sample_bytes": 1.0}
    records = [
        _rec("ours:auto", scheme="auto", batch=20, predicted=pred, benchmark="emdenoise"),
        _rec("ours:dct-dense", scheme="dct-dense", batch=26, predicted=pred, benchmark="emdenoise"),
        _rec("autograd", "autograd", batch=5, benchmark="emdenoise"),
    ]
    found = _by_goal(targets.evaluate(records))
    assert found["ideal_batch:auto"]["met"] is False  # 30 / 20 = 1.5x
    assert found["ideal_batch:dct-dense"]["met"] is True  # 30 / 26 < 1.25x
    assert found["max_batch:auto"]["met"] is None  # the 6x goal is ResNet-34's
    assert "cpu_time" not in found


# --------------------------------------------------------------------------- output


def test_markdown_and_csv_carry_the_new_figures():
    full = {
        "benchmark": "quick",
        "method": "ours:dct-dense",
        "kind": "ours",
        "scheme": "dct-dense",
        "compiled": False,
        "platform": "gpu",
        "device": "cpu",
        "emulated": False,
        "batch": 2,
        "resolution": 16,
        "time_ms": summary([1.0, 2.0]),
        "time_ratio": summary([1.0, 1.0]),
        "samples_per_s": 1000.0,
        "loss": 1.0,
        "stash": {"raw_bytes": 10, "stored_bytes": 5},
        "memory": {"step_peak_bytes": 2**20, "total_peak_bytes": 2**21, "how": "cpu-profiler"},
        "peak_ratio_vs_autograd": 1.0,
        "predicted": {
            "peak_bytes": 2**20,
            "floor_bytes": 2**19,
            "measured_over_floor": 2.0,
            "measured_over_predicted": 1.0,
            "ideal_max_batch": 77,
        },
        "max_batch": {
            "budget_bytes": 2**24,
            "reserved_bytes": 2**20,
            "intercept_bytes": 0.0,
            "bytes_per_sample": 1.0,
            "predicted_max_batch": 90,
            "max_batch": 90,
            "measured_max_batch": 12,
            "confirmed": False,
            "basis": "predicted",
            "measured": [{"batch": 12, "total_peak_bytes": 100}],
            "notes": [],
        },
        "max_batch_ratio_vs_autograd": 2.0,
        "max_batch_speed": {
            "batch": 12,
            "at_max_batch": False,
            "samples_per_s": 321.0,
            "ratio_vs_autograd": summary([0.9]),
        },
    }
    bare = dict(full, method="autograd", kind="autograd", predicted=None, max_batch_speed=None)
    meta = {"title": "t", "about": [], "methods": {}, "command": "c", "wall_s": 1.0}
    meta.update(dict.fromkeys(["date", "processor", "machine", "platform", "cpu_count"], "x"))
    meta.update(torch="x", num_threads=1)
    md = output.markdown(meta, [full, bare], [])
    assert "### Max batch, samples/s there, predicted peak and floor" in md
    row = next(line for line in md.splitlines() if line.startswith("| quick | ours:dct-dense | 16"))
    assert "90 (predicted) (2.00x)" in row and "12 (not the max)" in row and "321.0" in row
    assert "0.90x" in row and "| 77 |" in row and "2.00x" in row
    assert "1.00 MiB of it optimizer state" in md and "largest measured to fit 12" in md
    csv = output.csv_row(full)
    assert set(output.CSV_FIELDS) == set(csv)
    assert csv["samples_per_s_ratio_at_max_batch"] == 0.9 and csv["ideal_max_batch"] == 77
    assert output.csv_row(bare)["floor_bytes"] is None
    table = output.summary_table(meta, [full, bare])
    assert table.row_count == 2


# --------------------------------------------------------------------------- guards


def test_compiled_peers_missing_or_present(monkeypatch):
    ref, notes = torch.nn.Linear(2, 1), []
    monkeypatch.delattr(peers, "compiled_peers", raising=False)
    assert suite._compiled_peers(ref, ["compiled"], notes) == [] and "missing" in notes[0]
    asked = []

    def fake(ref, budgets):
        asked.append(budgets)
        names = ["compiled", *(f"compiled-budget-{b:g}" for b in budgets)]
        return [peers.Method(n, "compiled", None, ref, None, None) for n in names]

    monkeypatch.setattr(peers, "compiled_peers", fake, raising=False)
    got = suite._compiled_peers(ref, ["compiled-budget-0.1"], [])
    assert [m.name for m in got] == ["compiled-budget-0.1"] and asked == [(0.1,)]


def test_compile_needs_a_model_that_takes_it(tmp_path: Path):
    class Plain(torch.nn.Module):
        pass

    class Compiling(torch.nn.Module):
        def __init__(self, compile: bool = False):
            super().__init__()
            self.compiled = compile

    ref = torch.nn.Module()
    for cls, ok in ((Plain, False), (Compiling, True)):
        bench = types.SimpleNamespace(model_class=lambda options, directory, c=cls: c)
        if ok:
            model = models.build_ours(bench, None, ref, CPU, tmp_path, compile=True)
            assert model.compiled
        else:
            with pytest.raises(models.CompileUnsupported):
                models.build_ours(bench, None, ref, CPU, tmp_path, compile=True)


def test_timeline_plots_guarded(monkeypatch, tmp_path: Path):
    ran = [{"benchmark": "quick", "batch": 2, "resolution": 16, "timeline": {"autograd": {}}}]
    drawn, notes = [], []
    monkeypatch.delattr(suite.plots, "timeline", raising=False)
    assert suite._write_timelines(ran, tmp_path, "bench", "t", notes) == [] and notes
    monkeypatch.setattr(
        suite.plots,
        "timeline",
        lambda recs, path, title: drawn.append((path, title)),
        raising=False,
    )
    files = suite._write_timelines(ran, tmp_path, "bench", "t", [])
    assert files == [tmp_path / "bench_timeline_quick.png"] and "quick b2@16" in drawn[0][1]


def test_suite_methods_follow_the_peers_flag(tmp_path: Path):
    argv = [*TINY, "--scheme", "nocompress", "--peers", "none"]
    bench = BENCHMARKS["quick"]
    ref = models.build_reference(bench, 16, 0, CPU)
    notes: list[str] = []
    args = config.parse_args([*argv, "--no-recompute", "--no-segments"])
    found = suite._methods(bench, args, 16, ref, CPU, tmp_path, notes)
    assert [m.name for m in found] == ["ours:nocompress", "autograd"] and not notes
    found = suite._methods(bench, config.parse_args(argv), 16, ref, CPU, tmp_path, notes)
    names = [
        "ours:nocompress",
        "ours:nocompress+recompute",
        "ours:nocompress+blocks+pieces",
        "autograd",
    ]
    assert [m.name for m in found] == names and found[1].recompute and not notes
    assert found[2].variant == {"recompute_segments": ("blocks",), "segment_piece_size": 4}
    assert found[1].variant == {"recompute": True}


def test_segment_rows_only_for_models_with_blocks(tmp_path: Path):
    """A model without block instances gets no +blocks+pieces row: it would repeat ours."""
    text = (Path(__file__).parents[1] / "models" / "autoencoder.txt").read_text()
    bench = types.SimpleNamespace(model_text=lambda resolution: text)
    args = config.parse_args([*TINY, "--scheme", "nocompress", "--peers", "none"])
    names = [b.name for b in suite.ours_builds(bench, args, 16)]
    assert names == ["ours:nocompress", "ours:nocompress+recompute"]


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_tiny_run_has_the_budget_figures(tmp_path: Path):
    argv = [*TINY, "--scheme", "dct-dense", "--out-dir", str(tmp_path), "--no-plots"]
    assert main(argv) == 0
    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    runs = {r["method"]: r for r in lines if r["type"] == "run"}
    for rec in runs.values():
        mb = rec["max_batch"]
        assert mb["reserved_bytes"] > 0 and mb["budget_bytes"] == 12 * mb["reserved_bytes"]
        assert mb["max_batch"] > 0 and rec["max_batch_speed"]["samples_per_s"] > 0
    if models.memory_model() is not None:
        pred = runs["ours:dct-dense"]["predicted"]
        assert pred["floor_bytes"] > 0 and pred["measured_over_floor"] > 0
        assert pred["ideal_max_batch"] is not None
    keys = {g["goal"] for g in lines if g["type"] == "goal"}
    assert {"dense_max_batch", "ideal_batch:dct-dense", "speed_at_max_batch", "floor"} <= keys
