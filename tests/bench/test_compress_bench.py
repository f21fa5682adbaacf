"""Smoke test of the compress preset (unroller.bench.compress, `python -m
benchmarks.compress_bench`): it runs in-process at a tiny size and writes sane numbers
(slow). No speed or memory target is asserted here."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unroller.bench import compress, stashed
from unroller.bench.codec_bench import CODEC_CONFIGS
from unroller.bench.scheme_bench import BASELINE
from unroller.compiler.schemes import SCHEMES

# Runs the benchmark script end to end: `make test-slow` (SLOW=1), not `make test`.
slow = pytest.mark.slow

MODELS = list(compress.DEFAULT_MODELS)
COMPRESSING = [s for s in SCHEMES if s != BASELINE]
PROG = "python -m benchmarks.compress_bench"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compress_bench") / "compress_bench.json"
    argv = ["--models", ",".join(MODELS), "--batch-size", "2", "--repeats", "2"]
    argv += ["--warmup", "1", "--shape", "2,8,16,16", "--out", str(out)]
    argv += ["--threads", str(torch.get_num_threads())]
    assert compress.main(argv, prog=PROG) == 0
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _summary_ok(s: dict, n: int) -> None:
    assert all(_positive(s[k]) for k in ("median", "p10", "p90", "min", "max"))
    assert s["p10"] <= s["median"] <= s["p90"]
    assert len(s["samples"]) == n


@slow
def test_meta_and_markdown(run):
    results, md = run
    meta = results["meta"]
    for key in ("date", "processor", "machine", "platform", "cpu_count", "torch", "num_threads"):
        assert key in meta
    assert meta["torch"] == torch.__version__
    assert meta["command"].startswith("python -m benchmarks.compress_bench ")
    assert "--batch-size 2" in meta["command"] and "--shape 2,8,16,16" in meta["command"]
    assert meta["args"]["shape"] == [2, 8, 16, 16]
    assert {"codec_time", "stored_bytes", "same_activations", "step_time"} <= set(
        results["methods"]
    )
    for text in (meta["command"], meta["torch"], "| configuration |", "| model | scheme |"):
        assert text in md
    assert "What limits the figures" in md and results["limits"] in md
    assert md.count(" met") + md.count("NOT met") >= 2


@slow
def test_codec_numbers(run):
    results, _ = run
    codecs = results["codecs"]
    assert codecs["activation"]["shape"] == [2, 8, 16, 16]
    assert _positive(codecs["clone_pooled"]["median_gbps"])
    labels = [c["label"] for c in codecs["configs"]]
    assert labels == [label for label, *_ in CODEC_CONFIGS]
    for c in codecs["configs"]:
        assert _positive(c["raw_bytes"]) and _positive(c["stored_bytes"])
        assert c["stored_bytes"] == c["stored_bytes_predicted"]
        assert 0 < c["stored_over_raw"] < 1
        for part in ("compress", "decompress", "round_trip", "clone"):
            _summary_ok(c["time_ms"][part], 2)
        assert all(_positive(v) for v in c["gbps"].values())
        assert _positive(c["ratio_to_clone"]["median"]) and _positive(c["ratio_to_pooled_clone"])
        assert math.isfinite(c["rel_l2_error"]) and c["rel_l2_error"] >= 0
        if c["input"] == "mask":
            assert c["exact"] and c["rel_l2_error"] == 0 and c["dtype"] == "bool"
        else:
            assert 0 < c["rel_l2_error"] < 1.5 and c["dtype"] == "float32"


@slow
@pytest.mark.parametrize("index", range(len(MODELS)))
def test_scheme_numbers(run, index):
    results, _ = run
    m = results["models"][index]
    assert m["model"] == MODELS[index] and m["batch_size"] == 2
    by = {s["scheme"]: s for s in m["schemes"]}
    assert list(by) == list(SCHEMES)
    base = by[BASELINE]
    assert base["ratio_all"] == 1.0 and base["same_activations"]["count"] == 0
    for s in m["schemes"]:
        assert _positive(s["total_stored_bytes"]) and _positive(s["total_raw_bytes"])
        assert s["total_stored_bytes"] <= s["total_raw_bytes"]
        assert s["total_raw_bytes"] == base["total_raw_bytes"]
        assert s["stash"]["rows"] and all("tensor" in r for r in s["stash"]["rows"])
        assert s["plan"]["matches_measured"]
        for side in ("scheme", "nocompress", "ratio"):
            _summary_ok(s["time"][side], 2)
        mem = s["memory"]
        assert _positive(mem["peak_bytes"]) and _positive(mem["live_at_backward_bytes"])
        assert mem["backward_marker"] and "backward" in mem["backward_marker"]
        assert s["check"]["loss_equal_to_nocompress"]
        assert s["codec_cost"]["total_ms"] >= 0
    for scheme in COMPRESSING:
        s = by[scheme]
        same = s["same_activations"]
        assert same["count"] >= 1 and 0 < same["ratio"] < 1
        assert 0 < same["ratio_without_masks"] <= same["ratio"]
        assert 0 < s["ratio_all"] < 1
        assert _positive(s["codec_cost"]["total_ms"])
        assert _positive(s["check"]["grad_rel_diff_vs_nocompress"])
    assert set(m["goals"]) == {"dense_bytes", "dense_time"}
    assert all(isinstance(g["met"], bool) for g in m["goals"].values())
    assert all(_positive(g["value"]) for g in m["goals"].values())


def test_lossy_labels_and_shape_argument():
    assert stashed.lossy("Bits() + Dct(block=8, keep=4, storage='int8', fold=False)")
    assert stashed.lossy("Quant(bits=8, group_size=None, stochastic=False)")
    assert not stashed.lossy("raw")
    assert not stashed.lossy("Bits()")
    assert compress.parse_args(["--shape", "1,2,8,8"]).shape == (1, 2, 8, 8)
    with pytest.raises(SystemExit):
        compress.parse_args(["--shape", "1,2,8"])


def test_device_argument():
    """``--device`` takes cpu and the CUDA devices this machine has; anything else is a
    usage error that names what was expected."""
    assert compress.parse_args([]).device == torch.device("cpu")
    assert compress.parse_args(["--device", "cpu"]).device == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "meta"):
        with pytest.raises(SystemExit):
            compress.parse_args(["--device", bad])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            compress.parse_args(["--device", "cuda"])
    else:
        assert compress.parse_args(["--device", "cuda"]).device.type == "cuda"
