"""``--precision`` on the command line: generate, diff (precision against precision, and
against the checked-in bf16-mixed module), graph, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unroller.cli import app

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "benchmarks" / "models" / "gpt_tiny.txt")
runner = CliRunner()


def test_generate_records_the_precision_in_the_header(tmp_path):
    out = tmp_path / "m.py"
    result = runner.invoke(app, ["generate", GPT, "--precision", "fp16-mixed", "-o", str(out)])
    assert result.exit_code == 0, result.output
    header = json.loads(out.read_text().splitlines()[0].removeprefix("# unroller: "))
    assert header["precision"] == "fp16-mixed"
    assert 'K.cast(norm1, dtype="f16")' in out.read_text()


@pytest.mark.parametrize(
    "args",
    [
        ["generate", GPT, "--precision", "bf17"],
        ["generate", GPT, "--precision", "bf16-mixed", "--platform", "ipu"],
        ["diff", GPT, "--precision", "fp32", "--precision", "bf16", "--precision", "fp16"],
        ["graph", GPT, "--precision", "half"],
    ],
)
def test_a_bad_precision_is_one_line_and_status_2(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "precision" in result.output


def test_diff_shows_the_casts_one_precision_makes(monkeypatch):
    monkeypatch.chdir(ROOT)
    result = runner.invoke(app, ["diff", GPT, "--precision", "fp32", "--precision", "bf16-mixed"])
    assert result.exit_code == 1
    assert '+    norm1_bf16 = K.cast(norm1, dtype="bf16")' in result.output
    assert '+        norm1_bf16, L.cast("self_attn", torch.bfloat16)' in result.output
    checked_in = runner.invoke(app, ["diff", GPT, "--precision", "bf16-mixed"])
    assert checked_in.exit_code == 0, checked_in.output  # generated/.../nocompress-bf16-mixed.py


def test_graph_shows_the_cast_statements_and_their_dtypes():
    result = runner.invoke(app, ["graph", GPT, "--precision", "bf16-mixed", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("layers.0.norm1.bf16"))
    assert "cast" in line and "bf16[N, 64, 64]" in line
