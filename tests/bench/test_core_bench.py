"""Smoke test of the core preset (unroller.bench.core, `python -m benchmarks.core_bench`):
it runs, in-process, at a tiny size, and writes sane numbers. No speed or memory target
is asserted here."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unroller.api import load_model_class
from unroller.bench import core
from unroller.bench.reference import BENCHMARKS
from unroller.bench.stats import percentile, summary
from unroller.bench.timing import time_pair

# Runs the benchmark script end to end: `make test-slow` (SLOW=1), not `make test`.
slow = pytest.mark.slow

STEMS = sorted(core.DEFAULT_MODELS)
PROG = "python -m benchmarks.core_bench"
LOSS_TOL = 1e-5  # relative, float32


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("core_bench") / "core_bench.json"
    argv = ["--models", ",".join(STEMS), "--batch-size", "2", "--repeats", "2"]
    argv += ["--warmup", "1", "--threads", str(torch.get_num_threads()), "--out", str(out)]
    assert core.main(argv, prog=PROG) == 0
    return json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@slow
def test_meta_fields(results):
    meta = results["meta"]
    for key in ("date", "processor", "torch", "num_threads", "command", "args"):
        assert key in meta
    assert meta["torch"] == torch.__version__
    assert meta["command"].startswith("python -m benchmarks.core_bench ")
    assert "--batch-size 2" in meta["command"]
    assert set(results["methods"]) >= {"time", "peak_memory", "autograd_saved", "ours_saved"}
    assert [r["model"] for r in results["models"]] == STEMS


@slow
@pytest.mark.parametrize("index", range(len(STEMS)))
def test_model_numbers_are_sane(results, index):
    r = results["models"][index]
    assert r["batch_size"] == 2
    t = r["time"]
    for side in ("ours", "autograd", "ratio"):
        s = t[side]
        assert all(_positive(s[k]) for k in ("median", "p10", "p90", "min", "max"))
        assert s["p10"] <= s["median"] <= s["p90"]
        assert len(s["samples"]) == 2
    for side in ("ours", "autograd"):
        m = r["memory"][side]
        assert _positive(m["peak_bytes"]) and m["peak_bytes"] >= m["retained_bytes"] > 0
    assert _positive(r["saved"]["ours_predicted_bytes"])
    a = r["saved"]["autograd_counted"]
    assert a["with_params_bytes"] > a["without_params_bytes"] > 0
    assert a["without_params_bytes"] >= a["without_params_and_buffers_bytes"] > 0
    assert set(r["goals"]) == {"time_ratio", "saved_bytes", "peak_memory"}
    assert all(isinstance(g["met"], bool) for g in r["goals"].values())
    c = r["check"]
    assert abs(c["loss_ours"] - c["loss_autograd"]) <= LOSS_TOL * abs(c["loss_autograd"])


@slow
@pytest.mark.parametrize("stem", STEMS)
def test_same_loss_on_same_weights(stem):
    """Independent of the benchmark: both directions of load_state_dict are strict, and one
    float32 step gives the same loss."""
    torch.manual_seed(1)
    ref = BENCHMARKS[stem].build()
    ours = load_model_class(BENCHMARKS[stem].path)()
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    batch = BENCHMARKS[stem].make_batch(2, None, seed=3)
    assert all(t.dtype in (torch.float32, torch.int64) for t in batch)
    loss = ours(*batch)
    want = ref(*batch)[0].detach()
    assert loss.dim() == 0
    assert abs(float(loss) - float(want)) <= LOSS_TOL * abs(float(want))


def test_two_sides_alternate_and_summaries_interpolate():
    """The pair timing behind both report presets: the first side leads on even rounds."""
    order: list[str] = []
    found = time_pair(lambda: order.append("a"), lambda: order.append("b"), 1, 4)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(found["first"]["samples"]) == len(found["ratio"]["samples"]) == 4
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.1) == pytest.approx(1.4)
    s = summary([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["samples"]) == (2.0, 1.0, 3.0, [3.0, 1.0, 2.0])
