"""``unroll verify`` takes the generation options and checks the step they make."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from unroller.cli import app

MODEL = """
model seg {
    input x: f32[N, 8]
    target y: i64[N]
    block res(x) {
        fc = linear(x, out_features=8)
        act = tanh(fc)
        out = add(x, act)
        return out
    }
    b1 = res(x)
    b2 = res(b1)
    head = linear(b2, out_features=3)
    loss = cross_entropy(head, y)
    return loss, head
}
"""

NET = """
import torch
from torch import nn


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.head = Res(), Res(), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.b2(self.b1(x)))
"""


def _files(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "seg.txt").write_text(MODEL)
    (tmp_path / "net.py").write_text(NET)
    return str(tmp_path / "seg.txt"), f"{tmp_path / 'net.py'}:Net"


def test_verify_checks_the_step_that_segment_options_make(tmp_path):
    model, against = _files(tmp_path)
    args = ["verify", model, "--against", against, "--batch-size", "6"]
    args += ["--recompute-segments", "blocks", "--segment-pieces", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "recompute_segments=('blocks',), segment_pieces=2" in result.output
    assert "ok: 8 values match" in result.output


def test_verify_refuses_a_bad_option_value_naming_the_flag(tmp_path):
    model, against = _files(tmp_path)
    args = ["verify", model, "--against", against, "--segment-pieces", "0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--segment-pieces 0" in result.output


def test_a_lossy_scheme_fails_the_float64_check(tmp_path):
    model, against = _files(tmp_path)
    result = CliRunner().invoke(app, ["verify", model, "--against", against, "--scheme", "quant"])
    assert result.exit_code == 1, result.output
