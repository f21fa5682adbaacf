"""The scaling preset (unroller.bench.scaling): `unroll bench --pipeline 2 --data-parallel 2`.

- Fast: a test model file at a tiny size, 2 stages (2 processes over gloo), nocompress,
  one timed step: the rows, the files, bytes on the wire equal to raw bytes, no gradient
  error; the routing from the harness command line; bad arguments exit 2.
- Slow (SLOW=1): pipeline and data parallel together, a compressing scheme beside
  nocompress: fewer bytes on the wire than raw, a gradient error above zero, the
  all-reduce figures in range.
No speed is asserted: these are measurements, not goals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TESTS

from unroller.bench import cli, scaling

MODEL = str(TESTS / "models" / "tiny_resnet.txt")
TINY = ["--benchmark", MODEL, "--resolution", "8", "--batch-size", "4", "--micro-batches", "2"]
TINY += ["--steps", "1", "--warmup", "0"]
PROG = "python -m benchmarks.run"


def _run(tmp_path: Path, argv: list[str]) -> tuple[dict, list[dict], str]:
    """Run the harness on ``argv`` into ``tmp_path``: (meta, records, markdown)."""
    assert cli.run([*argv, "--out-dir", str(tmp_path)], PROG) == 0
    lines = [json.loads(x) for x in (tmp_path / "scaling.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "meta" and all(x["type"] == "run" for x in lines[1:])
    return lines[0], lines[1:], (tmp_path / "scaling.md").read_text()


def _timed(rec: dict, steps: int) -> None:
    t = rec["time_ms"]
    assert len(t["samples"]) == steps and t["median"] > 0
    assert rec["samples_per_s"] > 0 and rec["speedup_vs_one_process"] > 0


@pytest.mark.slow  # the scaling preset end to end (test_pipeline_parallel covers the stages)
def test_two_stage_pipeline_nocompress(tmp_path):
    meta, records, md = _run(tmp_path, ["--pipeline", "2", "--scheme", "nocompress", *TINY])
    assert [r["method"] for r in records] == ["ours:nocompress", "pipeline2:nocompress"]
    one, piped = records
    for rec in records:
        _timed(rec, 1)
        assert rec["benchmark"] == "tiny_resnet" and rec["batch"] == 4 and rec["resolution"] == 8
    assert one["processes"] == 1 and one["speedup_vs_one_process"] == 1.0
    assert piped["processes"] == 2 and len(piped["per_rank"]) == 2
    # nocompress: every boundary raw on the wire, and no gradient error either way
    wire = piped["wire"]
    assert wire["forward_bytes"] == wire["raw_forward_bytes"] > 0
    assert wire["backward_bytes"] == wire["raw_backward_bytes"] > 0
    assert piped["wire_vs_raw_forward"] == piped["wire_vs_raw_backward"] == 1.0
    assert piped["grad_error"] < 1e-12 and one["grad_error"] < 1e-12
    assert piped["boundaries"] and all(b["codec"] is None for b in piped["boundaries"])
    # the command, the machine and the table
    assert meta["command"].startswith(f"{PROG} --pipeline 2 ")
    for text in (meta["command"], "| pipeline2:nocompress | 2 |", "### Machine", meta["torch"]):
        assert text in md


def test_routing_and_bad_arguments(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path)]
    # `unroll bench --pipeline`/`--data-parallel` and `unroll bench scaling` reach this
    # preset's parser (the suite's would answer "unrecognized arguments")
    routed = [
        (["--pipeline", "9"], "argument --pipeline: expected one of 2, 3"),
        (["--data-parallel=1"], "argument --data-parallel: expected at least 2 processes"),
        (["scaling", "--pipeline", "1"], f"{PROG} scaling: error: argument --pipeline"),
    ]
    for argv, said in routed:
        with pytest.raises(SystemExit) as exc:
            cli.run([*argv, *out], PROG)
        assert exc.value.code == 2
        assert said in capsys.readouterr().err
    bad = [
        ["--data-parallel", "2", "--batch-size", "5"],
        ["--pipeline", "--batch-size", "2", "--micro-batches", "4"],
        ["--pipeline", "--batch-size", "8", "--error-batch", "16"],
        ["--pipeline", "--scheme", "zip"],
        ["--pipeline", "--schedule", "zigzag"],
    ]
    for argv in bad:
        with pytest.raises(SystemExit) as exc:
            scaling.main([*argv, *out], "unroll bench scaling")
        assert exc.value.code == 2
    assert "unroll bench scaling: error:" in capsys.readouterr().err
    assert scaling.main(["--benchmark", "no_such_model", *out]) == 2
    assert "neither a benchmark" in capsys.readouterr().err
    assert scaling.main(["--benchmark", "emdenoise", "--resolution", "12", *out]) == 2
    assert "multiple of 8" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_pipeline_and_data_parallel_with_a_compressing_scheme(tmp_path):
    argv = ["--pipeline", "--data-parallel", "--scheme", "nocompress,quant", *TINY]
    argv[argv.index("--steps") + 1] = "2"
    _, records, md = _run(tmp_path, argv)
    methods = [r["method"] for r in records]
    assert methods == [
        f"{m}:{s}" for s in ("nocompress", "quant") for m in ("ours", "pipeline2", "dp2")
    ]
    by = {r["method"]: r for r in records}
    for rec in records:
        _timed(rec, 2)
    quant = by["pipeline2:quant"]
    assert quant["wire"]["forward_bytes"] < quant["wire"]["raw_forward_bytes"]
    assert quant["wire"]["backward_bytes"] < quant["wire"]["raw_backward_bytes"]
    assert 0 < quant["grad_error"] < 1 and 0 < by["ours:quant"]["grad_error"] < 1
    assert quant["grad_error_one_process"] == by["ours:quant"]["grad_error"]
    for scheme in ("nocompress", "quant"):
        dp = by[f"dp2:{scheme}"]
        assert dp["processes"] == 2 and dp["buckets"] >= 1
        assert dp["allreduce_s"] > 0 and 0 <= dp["hidden_fraction"] <= 1
        assert dp["allreduced_bytes"] > 0 and len(dp["per_rank"]) == 2
    assert "| dp2:quant | 2 |" in md
