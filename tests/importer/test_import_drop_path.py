"""Stochastic depth imports as the registry's ``drop_path``, exact against the original.

The three ways libraries write it (Hugging Face's ``keep + rand`` floored times ``x / keep``,
timm's ``bernoulli_(keep)`` divided by keep or not, torchvision's ``StochasticDepth`` per
row) in a module named as one; verify makes the original's module draw its mask as the
kernel does (``verify.stochastic_depth_as_generated``). Batch 16 at p = 0.5: some samples
are dropped and some kept, so the masks matter (the last test shows verify fails without
the shared draw).
"""

from __future__ import annotations

import contextlib
import re

import import_zoo
import pytest
import torch
from torch import nn

from unroller.analysis import verify as verify_module_
from unroller.analysis.verify import verify_module
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

SPEC = "x: f32[N, 8]"
BATCH = 16


class TimmDropPath(nn.Module):
    """timm's DropPath: one Bernoulli draw per sample, scaled by 1/keep when asked."""

    def __init__(self, drop_prob: float, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        if keep > 0.0 and self.scale_by_keep:
            mask.div_(keep)
        return x * mask


class HfDropPath(nn.Module):
    """Hugging Face's drop_path: ``keep + rand`` floored, times ``x / keep``."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype)
        mask.floor_()
        return x.div(keep) * mask


class Residual(nn.Module):
    """Two residual blocks, each branch through its own stochastic depth module."""

    def __init__(self, make) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.drop1 = make()
        self.fc2 = nn.Linear(8, 8)
        self.drop2 = make()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(torch.tanh(self.fc1(x)))
        x = x + self.drop2(torch.tanh(self.fc2(x)))
        return self.head(x)


IDIOMS = {
    "timm": (lambda: TimmDropPath(0.5), "p=0.5"),
    "timm-unscaled": (lambda: TimmDropPath(0.5, scale_by_keep=False), "p=0.5, scale=false"),
    "hf": (lambda: HfDropPath(0.5), "p=0.5"),
    "torchvision": (lambda: import_zoo.StochasticDepth(0.5, "row"), "p=0.5"),
}


def _imported(name: str) -> tuple[nn.Module, str]:
    make, _ = IDIOMS[name]
    torch.manual_seed(0)
    net = Residual(make)
    return net, import_network("net", [SPEC], built=net, fallback=False).text


@pytest.mark.parametrize("name", sorted(IDIOMS))
def test_each_idiom_is_one_drop_path_statement(name):
    _, text = _imported(name)
    args = IDIOMS[name][1]
    for block, branch in (("drop1", "tanh"), ("drop2", "tanh_1")):
        assert re.search(rf"{block} = drop_path\(\S*{branch}, {re.escape(args)}\)", text), text
    for word in ("rand", "bernoulli", "floor", "aten("):
        assert word not in text, word
    assert "div" not in text  # Hugging Face's x / keep is drop_path's own scaling


@pytest.mark.parametrize("name", sorted(IDIOMS))
def test_each_idiom_verifies_exactly(name):
    net, _ = _imported(name)
    report = verify_module(net, (torch.randn(BATCH, 8),), batch_size=BATCH)
    assert report.ok, report.problems or report.table()
    assert any("drop1" in note and "p=0.5" in note for note in report.notes), report.notes


def test_verify_fails_when_the_original_draws_its_own_masks(monkeypatch):
    """Without the shared draw the original's masks are its own: the comparison fails,
    so the passing tests above compare dropped samples, not an identity."""
    net, _ = _imported("timm")
    monkeypatch.setattr(
        verify_module_, "stochastic_depth_as_generated", lambda module: contextlib.nullcontext()
    )
    report = verify_module(net, (torch.randn(BATCH, 8),), batch_size=BATCH)
    assert not report.ok


def test_dropout_off_switches_stochastic_depth_off_on_both_sides():
    net, _ = _imported("hf")
    report = verify_module(net, (torch.randn(BATCH, 8),), batch_size=BATCH, dropout="off")
    assert report.ok, report.problems or report.table()
    assert net.drop1.drop_prob == 0.5  # the caller's module is left as it was


def test_eval_predictions_are_the_identity_not_the_scaling():
    """Hugging Face's ``x / keep`` belongs to drop_path: at inference the branch is x itself
    (a division left as its own statement would scale eval predictions by 1/keep)."""
    net, text = _imported("hf")
    net.eval()
    report = verify_module(net, (torch.randn(BATCH, 8),), batch_size=BATCH)
    assert report.ok, report.problems or report.table()


class BatchDraw(nn.Module):
    """One draw for the whole batch inside a module named as stochastic depth."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.drop_path = import_zoo.StochasticDepth(0.2, "batch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.drop_path(x))


def test_batch_mode_and_unnamed_draws_stay_refused():
    with pytest.raises(ImportFailure) as info:
        import_network("net", [SPEC], built=BatchDraw(), fallback=False)
    (item,) = info.value.unmapped
    assert item.op == "stochastic depth" and item.module_path == "drop_path"
    assert "drop_path_rate=0.0" in item.reason and "StochasticDepth" in item.reason


def test_a_probability_of_one_is_refused_as_such():
    torch.manual_seed(0)
    net = Residual(lambda: TimmDropPath(1.0))
    with pytest.raises(ImportFailure) as info:
        import_network("net", [SPEC], built=net, fallback=False)
    assert "every sample dropped" in str(info.value)
