"""``verify`` under a low precision checks the accuracy contract: per tensor, the generated
step's error against the float64 original at most 2 x that of torch's own step in the
precision (torch.autocast, or the module moved to the low dtype) + a floor
(unroller.analysis.verify_precision)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import unroller.runtime.gpu as K
from unroller.analysis.verify import VerifyError, verify_module
from unroller.analysis.verify_precision import FLOORS, ContractReport
from unroller.cli import app
from unroller.runtime.precision import DTYPES

NET = '''
import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):
    """A pre-norm transformer block in miniature, with a classifier per position."""

    def __init__(self, d=16, heads=2, classes=5):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.fc2(self.drop(F.gelu(self.fc1(self.ln2(h)))))
        return self.head(h)
'''

TEXT = """
model tiny {
    input x: f32[N, 8, 16]
    target y: i64[N, 8]
    inp = linear(x, out_features=16)
    ln1 = layernorm(inp, normalized_shape=16)
    attn = multihead_attention(ln1, num_heads=2)
    add = add(inp, attn)
    ln2 = layernorm(add, normalized_shape=16)
    fc1 = linear(ln2, out_features=64)
    gelu = gelu(fc1)
    drop = dropout(gelu, p=0.1)
    fc2 = linear(drop, out_features=16)
    add_1 = add(add, fc2)
    head = linear(add_1, out_features=5)
    head_classes_first = permute(head, dims=(0, 2, 1))
    loss = cross_entropy(head_classes_first, y)
    return loss, head
}
"""

MIXED = ["bf16-mixed", "fp16-mixed"]


def _tiny() -> nn.Module:
    namespace: dict = {}
    exec(compile(NET, "tiny_net", "exec"), namespace)
    torch.manual_seed(0)
    return namespace["Tiny"]()


def _verify(precision: str, **kwargs) -> ContractReport:
    report = verify_module(_tiny(), (torch.randn(4, 8, 16),), precision=precision, **kwargs)
    assert isinstance(report, ContractReport)
    return report


@pytest.mark.parametrize("precision", MIXED)
def test_a_mixed_step_meets_the_contract_on_every_tensor(precision):
    report = _verify(precision)
    assert report.ok, report.problems or report.render()
    names = [row.name for row in report.rows]
    params = [f"grad {k}" for k, _ in _tiny().named_parameters()]
    assert names[0] == "loss" and set(params) <= set(names)
    floor = FLOORS[precision.split("-")[0].replace("fp", "f")]
    for row in report.rows:
        assert row.bound == pytest.approx(2 * row.peer + floor)
        assert 0 <= row.ours <= row.bound
    grads = [row for row in report.rows if row.name.startswith("grad ")]
    # a low precision, not float64: every gradient is off, by about the low dtype's rounding
    assert all(row.ours > 1e-5 for row in grads)
    assert "ours <= 2 x peer + " in report.summary() and report.summary().startswith("ok")
    assert report.notes[0].startswith(f"accuracy contract for --precision {precision}")
    assert "torch.autocast('cpu'" in report.notes[0]
    assert any(note.startswith("dropout off") for note in report.notes)  # drop, p=0.1


def test_a_plain_low_precision_is_judged_against_the_module_moved_to_it():
    report = _verify("bf16")
    assert report.ok, report.render()
    assert "the original moved to torch.bfloat16" in report.notes[0]


def _e4m3_cast(x, *, dtype):
    """A broken cast kernel: through float8 (3 mantissa bits) on its way to ``dtype``."""
    return x.to(torch.float8_e4m3fn).to(DTYPES[dtype])


def _scaled_cast_backward(g, *, source, needs=None):
    """A broken cast backward: the gradient 3% too large."""
    return (g.to(DTYPES[source]) * 1.03,)


@pytest.mark.parametrize(
    "precision, kernel, broken",
    [
        ("bf16-mixed", "cast", _e4m3_cast),
        ("fp16-mixed", "cast_backward", _scaled_cast_backward),
    ],
)
def test_a_broken_cast_kernel_fails_the_contract(monkeypatch, precision, kernel, broken):
    monkeypatch.setattr(K, kernel, broken)
    report = _verify(precision)
    assert not report.ok and not report.problems
    failed = {row.name for row in report.failed}
    assert "grad inp.weight" in failed and "FAIL:" in report.summary()
    assert all(row.ours > row.bound for row in report.failed)


def test_a_zero_gradient_is_measured_against_the_largest_one():
    """A bias before batch norm has gradient 0 in exact arithmetic: its float64 reference is
    rounding noise, so its error is taken against the step's largest gradient norm."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    report = verify_module(net, (torch.randn(4, 8),), precision="bf16-mixed", batch_size=4)
    assert report.ok, report.render()
    (bias,) = [row for row in report.rows if row.name == "grad 0.bias"]
    assert "zero in exact arithmetic" in bias.note and bias.ours < 1e-3
    assert all("zero in exact" not in row.note for row in report.rows if row is not bias)
    assert any(row.name == "buffer 1.running_var" for row in report.rows)


def test_tolerance_is_the_float64_checks_and_refused_with_a_precision():
    with pytest.raises(VerifyError, match="tolerance=0.001 is the float64 check's bound"):
        _verify("bf16-mixed", tolerance=1e-3)


def test_fp32_stays_the_float64_check():
    report = verify_module(_tiny(), (torch.randn(4, 8, 16),), precision="fp32", dropout="off")
    assert not isinstance(report, ContractReport) and report.tolerance == 1e-10
    assert report.ok, report.render()
    assert max(row.rel for row in report.rows) < 1e-12


# ---------------------------------------------------------------------------- the CLI


def _files(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "tiny.txt").write_text(TEXT)
    (tmp_path / "tiny_net.py").write_text(NET)
    return str(tmp_path / "tiny.txt"), f"{tmp_path / 'tiny_net.py'}:Tiny"


def _cli(*args: str):
    return CliRunner().invoke(app, ["verify", *args])


def test_cli_verify_checks_the_contract_and_prints_it(tmp_path):
    model, against = _files(tmp_path)
    result = _cli(model, "--against", against, "--precision", "bf16-mixed")
    assert result.exit_code == 0, result.output
    assert "accuracy contract for --precision bf16-mixed" in result.output
    assert "ours <= 2 x peer + 0.001" in result.output
    assert "ok: 18 values within the bf16-mixed accuracy contract" in result.output


def test_cli_verify_exits_1_when_the_contract_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(K, "cast", _e4m3_cast)
    model, against = _files(tmp_path)
    result = _cli(model, "--against", against, "--precision", "bf16-mixed")
    assert result.exit_code == 1, result.output
    assert "values outside the bf16-mixed accuracy contract" in result.output.splitlines()[-1]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--precision", "nonsense"], "unknown precision 'nonsense'"),
        (["--precision", "fp16-mixed", "--tolerance", "1e-3"], "--tolerance is the float64"),
    ],
)
def test_cli_verify_refuses_in_one_line(tmp_path, args, says):
    model, against = _files(tmp_path)
    result = _cli(model, "--against", against, *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.output


def test_the_contracts_errors_are_float64_norms():
    """The error of a side is ||x - ref|| / ||ref|| over the whole tensor."""
    from unroller.analysis.verify_precision import contract_row
    from unroller.compiler.precision import get

    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    row = contract_row("t", ref + torch.tensor([0.0, 0.05]), ref * 1.01, ref, get("bf16-mixed"))
    assert row.ref_norm == 5.0 and row.ours == pytest.approx(0.01)
    assert row.peer == pytest.approx(0.01) and row.bound == pytest.approx(0.021) and row.ok
    zero = torch.zeros(2, dtype=torch.float64)
    row = contract_row("z", zero + 3e-4, zero, zero, get("bf16"))
    assert row.ours == pytest.approx(math.sqrt(2) * 3e-4) and row.ok  # absolute norms
    assert "reference 0" in row.note
    inf = torch.full((2,), math.inf)
    assert contract_row("o", ref, inf, ref, get("fp16")).bound == math.inf


def test_overflow_counts_against_ours_only_where_float16_could_hold_the_reference():
    """The peer overflowing does not excuse ours overflowing, unless the reference itself
    is beyond float16's range (a gradient of 1e7 without a GradScaler: mobilenet_v2 at batch
    2), where no step computing in float16 can hold it."""
    from unroller.analysis.verify_precision import contract_row
    from unroller.compiler.precision import get as get_precision

    fp16 = get_precision("fp16-mixed")
    inf = torch.full((3,), math.inf)
    big = torch.tensor([1.0e7, 2.0, 3.0], dtype=torch.float64)
    small = torch.tensor([1.0e3, 2.0, 3.0], dtype=torch.float64)
    assert contract_row("w", inf, inf, big, fp16).ok
    assert not contract_row("w", inf, inf, small, fp16).ok
    assert contract_row("w", small.float(), inf, small, fp16).ok
    assert not contract_row("w", inf, big.float(), big, fp16).ok  # the peer held it: ours must
    assert not contract_row("w", inf, inf, big, get_precision("bf16-mixed")).ok  # bf16 holds 1e7
