"""References of the test suite's model files (``tests/models/*.txt``) and their inputs.

Small networks that cover the model language (every operator, non-square shapes,
fan-out, two inputs, no target, division by tensors that have gradients), checked
against the generated modules to 1e-10 in float64. They share the ResNet and U-Net definitions with the benchmark networks; the
rest are one class each. The names ``resnet_like`` and ``unet_like`` exist in both
folders with different sizes, so this registry is ``SUITE_REFERENCES`` next to the
benchmarks' ``BENCHMARKS``.

- ``SUITE_REFERENCES[stem]()`` builds the reference; ``ref(*inputs_and_targets)``
  returns ``(loss, *preds)`` exactly as the model's ``return`` line, ``ref.predict``
  the predictions in evaluation mode.
- ``make_inputs(stem, batch)``: deterministic inputs and targets of the declared shapes
  (float ones in ``dtype``, class indices as int64); ``DECLS[stem]`` the declarations.

``python -m unroller.bench.reference`` prints, for every reference, its state-dict keys
and the loss of a float64 training step at batch 2.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroller.bench.paths import suite_models_dir
from unroller.bench.reference.base import Reference, StageRunner
from unroller.bench.reference.blocks import CifarResNet, UNet
from unroller.compiler.dtypes import torch_dtype


def suite_model_path(stem: str) -> Path:
    """The model file of a reference: ``tests/models/STEM.txt``."""
    return suite_models_dir() / f"{stem}.txt"


# --------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Decl:
    """One ``input``/``target`` line of a model file.

    ``fill`` says how ``make_inputs`` fills it: ``"normal"`` (standard normal),
    ``"unit"`` (uniform in [0, 1)), ``"open_unit"`` (uniform in (0, 1), bounded away from
    0 and 1), or ``"classes:K"`` (int64 class indices in [0, K)).
    """

    kind: str  # "input" or "target"
    name: str
    dtype: str  # as written in the file: f32, i64, ...
    dims: tuple[int, ...]  # the dims after N
    fill: str = "normal"


DECLS: dict[str, list[Decl]] = {
    "resnet_like": [
        Decl("input", "x", "f32", (3, 16, 16)),
        Decl("target", "y", "i64", (), "classes:10"),
    ],
    "unet_like": [
        Decl("input", "x", "f32", (1, 16, 16)),
        Decl("target", "y", "f32", (1, 16, 16)),
    ],
    "autoencoder": [
        Decl("input", "x", "f32", (1, 16, 16), "unit"),
    ],
    "nonsquare": [
        Decl("input", "x", "f32", (2, 13, 11)),
        Decl("target", "y", "f32", (5,), "open_unit"),
    ],
    "fanout": [
        Decl("input", "x", "f32", (3, 8, 8)),
        Decl("target", "y", "f32", (2, 8, 8)),
    ],
    "all_ops": [
        Decl("input", "x", "f32", (3, 10, 10)),
        Decl("input", "v", "f32", (6,)),
        Decl("target", "y", "f32", (1,), "unit"),
    ],
    "tiny_resnet": [
        Decl("input", "x", "f32", (3, 32, 32)),
        Decl("target", "y", "i64", (), "classes:10"),
    ],
    "divide": [
        Decl("input", "x", "f32", (3, 8, 8)),
        Decl("target", "y", "f32", (5,)),
    ],
}


def make_inputs(
    stem: str, batch: int, dtype: torch.dtype = torch.float64, seed: int = 0
) -> list[Tensor]:
    """Deterministic inputs and targets of model ``stem``, in declaration order.

    Float values are drawn in float64 and then cast to ``dtype``, so the same seed gives
    the same values (up to rounding) in every float dtype. Integer targets keep their
    declared integer dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    out: list[Tensor] = []
    for decl in DECLS[stem]:
        shape = (batch, *decl.dims)
        if decl.fill.startswith("classes:"):
            k = int(decl.fill.split(":", 1)[1])
            t = torch.randint(0, k, shape, generator=gen, dtype=torch.int64)
            out.append(t.to(torch_dtype(decl.dtype)))
            continue
        if decl.fill == "normal":
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
        elif decl.fill == "unit":
            t = torch.rand(shape, generator=gen, dtype=torch.float64)
        elif decl.fill == "open_unit":
            t = 0.02 + 0.96 * torch.rand(shape, generator=gen, dtype=torch.float64)
        else:
            raise ValueError(f"unknown fill {decl.fill!r}")
        out.append(t.to(dtype))
    return out


def num_inputs(stem: str) -> int:
    """How many of the declarations are inputs (the arguments ``predict`` takes)."""
    return sum(d.kind == "input" for d in DECLS[stem])


# --------------------------------------------------------------------------- ResNets, U-Net


class SuiteResNetLike(CifarResNet):
    """tests/models/resnet_like.txt: two stages (8, 16 planes) of two BasicBlocks."""

    def __init__(self) -> None:
        super().__init__([2, 2], [8, 16])


class TinyResNet(CifarResNet):
    """tests/models/tiny_resnet.txt (the example of the spec): one stage of two blocks,
    16 planes, the linear layer named ``fc``."""

    def __init__(self) -> None:
        super().__init__([2], [16], head="fc")


class SuiteUNetLike(UNet):
    """tests/models/unet_like.txt: two encoder levels (4, 8) and mid (16), "BR" blocks,
    1x1 output conv, no activation, MSE against the target."""

    def __init__(self) -> None:
        super().__init__(1, (4, 8, 16), True, 1, ("enc1", "enc2"), ("dec2", "dec1"))


# --------------------------------------------------------------------------- autoencoder


class Autoencoder(Reference):
    """tests/models/autoencoder.txt (no target: the loss compares the output with x)."""

    def __init__(self) -> None:
        super().__init__()
        self.e1 = nn.Conv2d(1, 4, 3, padding=1)
        self.ebn1 = nn.BatchNorm2d(4)
        self.e2 = nn.Conv2d(4, 4, 3, padding=1)
        self.ebn2 = nn.BatchNorm2d(4)
        self.latent = nn.Linear(64, 8)
        self.dec = nn.Linear(8, 64)
        self.dbn0 = nn.BatchNorm2d(4)
        self.d0 = nn.Conv2d(4, 4, 3, padding=1)
        self.t1 = nn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1)
        self.dbn1 = nn.BatchNorm2d(6)
        self.d1 = nn.Conv2d(6, 6, 3)
        self.t2 = nn.ConvTranspose2d(6, 4, 3, stride=2, output_padding=1)
        self.dbn2 = nn.BatchNorm2d(4)
        self.d2 = nn.Conv2d(4, 4, 3)
        self.out = nn.Conv2d(4, 1, 1)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        h = F.max_pool2d(self.ebn1(F.relu(self.e1(inputs[0]))), 2)
        h = F.max_pool2d(self.ebn2(F.relu(self.e2(h))), 2)
        latent = self.latent(torch.flatten(h, 1))
        dec = self.dec(latent)
        h = dec.reshape(dec.shape[0], 4, 4, -1)
        h = F.relu(self.d0(self.dbn0(h)))
        h = self.dbn1(F.relu(self.t1(h)))
        h = F.relu(self.d1(h))
        h = self.dbn2(F.relu(self.t2(h)))
        h = F.relu(self.d2(h))
        return (torch.sigmoid(self.out(h)),)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], inputs[0])


# --------------------------------------------------------------------------- non-square


class Tall(nn.Module):
    """Block ``tall``: conv with kernel (kh, 1), padding (ph, 0), no bias; tanh."""

    def __init__(self, cin: int, ch: int, kh: int = 3, ph: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, ch, (kh, 1), padding=(ph, 0), bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.conv(x))


class NonSquare(Reference):
    """tests/models/nonsquare.txt"""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=2)
        self.t1 = nn.ConvTranspose2d(
            4, 3, (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2)
        )
        self.bn = nn.BatchNorm2d(3)
        self.tb = Tall(3, 4, kh=5, ph=2)
        self.c2 = nn.Conv2d(4, 4, (1, 3), stride=(1, 2), padding=(0, 1), groups=4)
        self.fc = nn.Linear(80, 5)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        a1 = F.leaky_relu(self.c1(inputs[0]), negative_slope=0.2)
        p1 = F.max_pool2d(a1, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0))
        g = F.gelu(self.bn(self.t1(p1)), approximate="tanh")
        ap = F.avg_pool2d(g, kernel_size=(2, 3), stride=(2, 2), padding=(1, 1))
        up = F.interpolate(ap, scale_factor=1.5, mode="nearest")
        c2 = self.c2(self.tb(up))
        aap = F.adaptive_avg_pool2d(c2, (4, 5))
        return (self.fc(torch.flatten(aap, 1)),)

    def criterion(self, preds, inputs, targets):
        return F.binary_cross_entropy_with_logits(preds[0], targets[0])


# --------------------------------------------------------------------------- fan-out


class Unit(nn.Module):
    """Block ``unit``: conv 3x3 (padding 1), ReLU."""

    def __init__(self, cin: int, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, ch, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.conv(x))


class FanOut(Reference):
    """tests/models/fanout.txt"""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.u1 = Unit(4, 4)
        self.u2 = Unit(4, 4)
        self.g = nn.Conv2d(19, 2, 1)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        x = inputs[0]
        a = self.a(x)
        b = self.b(a)
        c = a + b
        d = a * c
        e = a * a
        f = self.u1(a) + self.u2(a)
        cat = torch.cat([c, d, e], dim=1)
        cat2 = torch.cat([cat, f, x], dim=1)
        dr = F.dropout(cat2, p=0.0, training=self.training)
        g = self.g(dr)
        return (g + g, c)

    def criterion(self, preds, inputs, targets):
        return F.l1_loss(preds[0], targets[0])


# --------------------------------------------------------------------------- all ops


class AllOps(Reference):
    """tests/models/all_ops.txt (two inputs)."""

    n_inputs = 2

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6, eps=0.001, momentum=0.3)
        self.ct = nn.ConvTranspose2d(6, 4, 3, padding=1, bias=False)
        self.lv = nn.Linear(6, 144)
        self.c2 = nn.Conv2d(10, 2, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(10, 2, 1)
        self.l1 = nn.Linear(16, 3)
        self.l2 = nn.Linear(6, 1, bias=False)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        x, v = inputs
        g = F.gelu(self.bn(self.c1(x)))
        lr = F.leaky_relu(F.max_pool2d(g, 2))
        ap = F.avg_pool2d(lr, 2, padding=1)
        up = F.interpolate(ap, scale_factor=2, mode="bilinear", align_corners=True)
        th = torch.tanh(self.ct(up))
        lv = self.lv(v)
        sv = torch.sigmoid(lv.reshape(lv.shape[0], 4, -1, 6))
        cat = torch.cat([th * sv, up], dim=1)
        dr = F.dropout(F.relu(cat), p=0.0, training=self.training)
        un = F.interpolate(dr, scale_factor=2, mode="nearest")
        s = self.c2(un) + self.c3(dr)
        aap = F.adaptive_avg_pool2d(s, 4)
        l1 = self.l1(torch.flatten(aap, 2))
        l2 = self.l2(torch.flatten(l1, 1))
        return (torch.sigmoid(l2),)

    def criterion(self, preds, inputs, targets):
        return F.binary_cross_entropy(preds[0], targets[0])


# --------------------------------------------------------------------------- division


class Divide(Reference):
    """tests/models/divide.txt: divisions by tensors that have gradients (a positive
    softplus plus a learned offset; a broadcast mean square plus a learned scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(3, 1, 1))
        self.q = nn.Parameter(torch.ones(1))
        self.a = nn.Conv2d(3, 3, 3, padding=1)
        self.h = nn.Conv2d(3, 4, 3, padding=1)
        self.logits = nn.Linear(256, 5)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        x = inputs[0]
        xs = x / (F.softplus(self.a(x)) + self.p)
        h = self.h(xs)
        n = h / ((h * h).mean(dim=(2, 3), keepdim=True) + self.q)
        return (self.logits(torch.flatten(n, 1)),)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], targets[0])


# --------------------------------------------------------------------------- registry

SUITE_REFERENCES: dict[str, Callable[[], nn.Module]] = {
    "resnet_like": SuiteResNetLike,
    "unet_like": SuiteUNetLike,
    "autoencoder": Autoencoder,
    "nonsquare": NonSquare,
    "fanout": FanOut,
    "all_ops": AllOps,
    "tiny_resnet": TinyResNet,
    "divide": Divide,
}

_DECL_RE = re.compile(
    r"^\s*(input|target)\s+([A-Za-z_]\w*)\s*:\s*(\w+)\s*\[\s*N\s*((?:,\s*\d+\s*)*)\]", re.M
)


def declared_in_file(stem: str) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """The (kind, name, dtype, dims) declarations read from the model file itself."""
    text = suite_model_path(stem).read_text()
    return [
        (m[1], m[2], m[3], tuple(int(d) for d in m[4].replace(",", " ").split()))
        for m in _DECL_RE.finditer(text)
    ]
