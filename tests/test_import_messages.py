"""What ``unroll import`` says when it refuses, and the learned scalars it imports.

A refusal names the module feature at fault (stochastic depth, attention dropout) with its
module path and the fix, once: nodes that only read a failed value are not listed again.
Shapes in messages show the batch dim as ``N``, never the example batch of the capture.
Learned scalars (a 0-d ``nn.Parameter``, an element of a parameter vector) import and
verify exactly in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

import import_zoo  # noqa: E402  (tests/ is on sys.path under pytest)


def _fail(module: nn.Module, spec: str = "x: f32[N, 8]") -> ImportFailure:
    with pytest.raises(ImportFailure) as info:
        import_network("net", [spec], built=module)
    return info.value


class _DropPath(nn.Module):
    """timm's drop path: one Bernoulli draw per sample, survivors scaled by 1/keep."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = x.new_empty(shape).bernoulli_(keep)
        mask.div_(keep)
        return x * mask


class _Residual(nn.Module):
    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop_path = drop
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.drop_path(self.fc(x)))


class _RandFloor(nn.Module):
    """The other drop path idiom: ``floor(keep + rand)`` per sample, inline in a block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 0.75
        mask = keep + torch.rand((x.shape[0], 1), dtype=x.dtype, device=x.device)
        mask.floor_()
        return x + self.fc(x).div(keep) * mask


def test_stochastic_depth_is_one_line_per_module_naming_it_and_the_fix():
    net = import_zoo.efficientnet_b0(width_mult=0.1, depth_mult=0.5, stochastic_depth_prob=0.2)
    failure = _fail(net, "x: f32[N, 3, 32, 32]")
    paths = [u.module_path for u in failure.unmapped]
    assert paths == [
        "features.4.1.stochastic_depth",
        "features.5.1.stochastic_depth",
        "features.6.1.stochastic_depth",
    ], failure
    for item in failure.unmapped:
        assert item.op == "stochastic depth"
        assert "probability 0" in item.reason and "StochasticDepth(p=0.0)" in item.reason
        assert "bernoulli" not in item.line() and "div" not in item.line()
    assert "drop probability 0.08" in failure.unmapped[0].reason


@pytest.mark.parametrize(
    "module, path", [(_Residual(_DropPath(0.1)), "drop_path"), (_RandFloor(), "")]
)
def test_drop_path_idioms_are_named_stochastic_depth_once(module, path):
    failure = _fail(module)
    assert len(failure.unmapped) == 1, failure
    (item,) = failure.unmapped
    assert item.op == "stochastic depth" and item.module_path == path
    assert "drop_path_rate=0.0" in item.reason


def test_stochastic_depth_at_zero_imports():
    net = import_zoo.efficientnet_b0(width_mult=0.1, depth_mult=0.5, stochastic_depth_prob=0.0)
    import_network("net", ["x: f32[N, 3, 32, 32]"], built=net)


class _Unmapped(nn.Module):
    """An op with no registry operator feeding another, then a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.special.erfcx(self.fc(x))
        y = torch.special.i0(y)
        return self.head(x + y)


def test_consequences_of_a_failure_are_not_listed():
    failure = _fail(_Unmapped())
    assert [u.op for u in failure.unmapped] == ["aten.special_erfcx.default"], failure


def test_attention_dropout_names_the_fix():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    failure = _fail(Attn(), "x: f32[N, 5, 8]")
    assert len(failure.unmapped) == 1, failure
    assert "attention dropout 0.1" in failure.unmapped[0].reason
    assert "dropout=0.0" in failure.unmapped[0].reason
