"""verify lifts the original's float64 -> float32 casts of activations (identities in the
float32 trace the text comes from), and only those (unroller.analysis.lifted_casts)."""

from __future__ import annotations

import torch
from torch import nn

from unroller.analysis import lifted_casts
from unroller.analysis.lifted_casts import LiftedCasts
from unroller.analysis.verify import verify_module


class CastsInside(nn.Module):
    """ModernBERT's rotary in miniature: an activation cast to float32 and multiplied by a
    float64 factor (the product promotes back), a constant's cast to float32 kept as a
    table, and a softmax in float32 by argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        table = torch.cos(self.freq.float() * 3.0).to(h.dtype)  # a constant: kept
        h = (h.float() * table).to(x.dtype)
        return self.head(h)


def test_activation_casts_are_lifted_and_constant_casts_kept():
    model = CastsInside().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with LiftedCasts() as lift:
        h = torch.tanh(model.fc(x))
        assert h.float() is h and h.to(torch.float32) is h and h.to(dtype=torch.float32) is h
        assert model.freq.float().dtype == torch.float32  # no gradient: a constant
        assert h.to(torch.float32, copy=True).dtype == torch.float32  # a copy asked for
        probs = torch.softmax(h, dim=-1, dtype=torch.float32)  # not a cast
        assert probs.dtype == torch.float32
    assert lift.lifted == 3


def test_verify_passes_with_the_casts_lifted_and_says_so():
    torch.manual_seed(0)
    report = verify_module(CastsInside(), (torch.randn(4, 8),))
    assert report.ok, report.problems or report.table()
    assert any("lifted 1 cast(s) of activations to float32" in n for n in report.notes)


def test_without_the_lift_the_float32_rounding_fails_verify(monkeypatch):
    """The casts matter: kept, the original rounds its activations to float32 in float64
    and the comparison fails at float32's rounding."""

    class Kept(LiftedCasts):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(lifted_casts, "LiftedCasts", Kept)
    torch.manual_seed(0)
    report = verify_module(CastsInside(), (torch.randn(4, 8),))
    assert not report.ok
    assert not any("lifted" in n for n in report.notes)


def test_no_note_when_nothing_is_lifted():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    report = verify_module(net, (torch.randn(4, 8),))
    assert report.ok and not any("lifted" in n for n in report.notes)


def test_a_cast_that_also_moves_the_tensor_is_not_lifted():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True) * 2
    with LiftedCasts() as lift:
        moved = x.to("meta", torch.float32)
        same_place = x.to("cpu", torch.float32)
    assert moved.device.type == "meta" and moved.dtype == torch.float32
    assert same_place is x and lift.lifted == 1
