"""What ``unroll import`` says when it refuses, and the learned scalars it imports.

A refusal names the module feature at fault (stochastic depth, attention dropout) with its
module path and the fix, once: nodes that only read a failed value are not listed again.
Shapes in messages show the batch dim as ``N``, never the example batch of the capture.
Learned scalars (a 0-d ``nn.Parameter``, an element of a parameter vector) import and
verify exactly in float64.
"""

from __future__ import annotations

import re
from pathlib import Path

import import_zoo  # tests/ is on sys.path (conftest.py)
import pytest
import torch
from torch import nn

from unroller.analysis.verify import verify_text
from unroller.api import graph_from_text, load_model_class
from unroller.errors import ModelError
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")


def _fail(module: nn.Module, spec: str = "x: f32[N, 8]") -> ImportFailure:
    with pytest.raises(ImportFailure) as info:
        import_network("net", [spec], built=module, fallback=False)
    return info.value


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


def test_torchvision_stochastic_depth_is_drop_path_at_its_modules():
    """EfficientNet's StochasticDepth (per row, 0.2 scaled by depth): one ``drop_path`` per
    module, no bernoulli or division left (tests/importer/test_import_drop_path.py verifies
    the idioms)."""
    net = import_zoo.efficientnet_b0(width_mult=0.1, depth_mult=0.5, stochastic_depth_prob=0.2)
    text = import_network("net", ["x: f32[N, 3, 32, 32]"], built=net, fallback=False).text
    assert "        stochastic_depth = drop_path(block.3.1, p=p)  # StochasticDepth\n" in text
    probs = re.findall(r"features\.\d\.1 = mb_conv_2\(.*, p=([0-9.]+)\)", text)
    assert [round(float(p), 12) for p in probs] == [0.08, 0.12, 0.16], text
    for word in ("bernoulli", "rand", "div"):
        assert word not in text, word


class _Noise(nn.Module):
    """One random draw for the whole batch, in no stochastic depth module: not named so."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.rand((1, 1), dtype=x.dtype)


@pytest.mark.parametrize(
    "module, path",
    [
        (_Residual(import_zoo.StochasticDepth(0.2, "batch")), "drop_path"),
        (_RandFloor(), ""),
    ],
)
def test_draws_drop_path_does_not_take_are_named_stochastic_depth_once(module, path):
    """One draw for the whole batch, or a draw outside a stochastic depth module (verify
    could not make it draw as the kernel does): refused once, by name, with the fix."""
    failure = _fail(module)
    assert len(failure.unmapped) == 1, failure
    (item,) = failure.unmapped
    assert item.op == "stochastic depth" and item.module_path == path
    assert "drop_path_rate=0.0" in item.reason


def test_other_random_draws_are_not_called_stochastic_depth():
    failure = _fail(_Noise())
    assert [u.op for u in failure.unmapped] == ["aten.rand.default"], failure


def test_stochastic_depth_at_zero_imports():
    """At drop probability 0 the same residual blocks import (no failure): the drop path is
    the identity, so each block's output is the plain residual add, with no random draw
    left in the text, and every tensor of the original is the imported model's."""
    net = import_zoo.efficientnet_b0(width_mult=0.1, depth_mult=0.5, stochastic_depth_prob=0.0)
    imported = import_network("net", ["x: f32[N, 3, 32, 32]"], built=net)
    text = imported.text
    assert "3 instances (features.4.1, features.5.1, features.6.1)" in text
    assert "        add = add(block.3.1, x)\n        return add\n" in text
    for word in ("stochastic", "bernoulli", "rand", "drop_path"):
        assert word not in text, word
    assert set(imported.state) == set(net.state_dict())
    graph = graph_from_text(text, "net.txt")
    for stage in (4, 5, 6):  # the block's last batch norm plus the block's input
        add = graph.node(f"features.{stage}.1.add")
        assert [v.name for v in add.inputs] == [
            f"features.{stage}.1.block.3.1",
            f"features.{stage}.0.block.3.1",
        ]


class _Unmapped(nn.Module):
    """An op with no registry operator feeding a residual add and a linear, which read a
    failed value (consequences); and an unmapped op of its own (a second cause)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.side = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + torch.special.erfcx(self.fc(x))
        return self.head(y) + torch.special.i0(self.side(x))


def test_consequences_of_a_failure_are_not_listed_but_other_causes_are():
    failure = _fail(_Unmapped())
    ops = [u.op for u in failure.unmapped]
    assert ops == ["aten.special_erfcx.default", "aten.special_i0.default"], failure


def test_attention_dropout_with_a_mask_names_the_fix():
    """Attention dropout imports as statements (sdpa with its dropout); with a causal mask
    too it is refused, naming the dropout and the fix."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]

    failure = _fail(Attn(), "x: f32[N, 5, 8]")
    assert len(failure.unmapped) == 1, failure
    assert "attention dropout 0.1" in failure.unmapped[0].reason
    assert "dropout=0.0" in failure.unmapped[0].reason


# ---------------------------------------------------------------- learned scalars


@pytest.mark.parametrize("name", ["ScaledHead", "GatedMix"])
def test_learned_scalars_import_and_verify_exactly(name):
    spec = f"{ZOO}:{name}"
    imported = import_network(spec, ["x: f32[N, 8]"])
    if name == "ScaledHead":
        assert "scale = parameter(shape=())" in imported.text, imported.text
    else:
        assert "gammas = parameter(shape=(3,))" in imported.text
        assert "select(gammas, dim=0, index=2)" in imported.text, imported.text
    report = verify_text(imported.text, spec, None)
    assert report.ok, report.problems or report.table()
    grads = {row.name: row for row in report.rows}
    held = "grad scale" if name == "ScaledHead" else "grad gammas"
    assert held in grads and grads[held].ref_max > 0, report.table()


def test_a_zero_d_parameter_is_a_statement_of_the_language(tmp_path):
    text = """model s {
    input x: f32[N, 4]
    target y: i64[N]
    fc = linear(x, out_features=3)
    t = parameter(shape=(), init="ones")
    out = mul(fc, t)
    loss = cross_entropy(out, y)
    return loss, out
}
"""
    assert graph_from_text(text).node("t").output.type.shape == ()
    path = tmp_path / "s.model"
    path.write_text(text)
    module = load_model_class(path)()
    assert module.state_dict()["t"].shape == torch.Size([])
    with pytest.raises(ModelError, match="dims"):
        graph_from_text(text.replace("mul(fc, t)", "permute(fc, dims=())"))


def test_select_of_the_batch_dim_is_still_refused():
    class Rows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[0] + x

    failure = _fail(Rows())
    assert "batch dim" in failure.unmapped[0].reason


# ---------------------------------------------------------------- shapes say N


class _MergesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(-1, 4)


class _WrongWidth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(1)


def test_a_refused_reshape_shows_the_batch_as_n():
    failure = _fail(_MergesBatch())
    (item,) = failure.unmapped
    assert "reshaping [N, 8] to [2*N, 4]" in item.reason, failure
    assert "'N'" not in str(failure) and "6" not in item.reason


@pytest.mark.parametrize(
    "module, spec, shown",
    [
        (lambda: nn.Sequential(nn.Linear(8, 8)), "x: f32[N, 5]", "(Nx5 and 8x8)"),
        (_WrongWidth, "x: f32[N, 3, 16, 16]", "input[N, 3, 16, 16]"),
    ],
)
def test_a_network_failing_eagerly_shows_the_batch_as_n(module, spec, shown):
    text = str(_fail(module(), spec))
    assert "the network fails on inputs of the declared shapes" in text, text
    assert shown in text, text


@pytest.mark.parametrize("eps, bound", [(-1.0, ">= 0.0"), (2.0, "<= 1.0")])
def test_an_attribute_outside_the_languages_range_is_the_networks_error(eps, bound):
    """A LayerNorm eps the language's layernorm does not take is reported as the network's
    setting, at its module, not as an internal error of the importer."""
    net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=eps), nn.Linear(8, 3))
    with pytest.raises(ImportFailure) as info:
        import_network("net", ["x: f32[N, 8]"], built=net)
    message = str(info.value)
    assert "internal error" not in message
    assert "the network's 1 (LayerNorm)" in message and f"'eps' must be a number {bound}" in message
