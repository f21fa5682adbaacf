"""Plain ``torch.nn`` references for the model files in ``tests/models/``.

For every model file ``tests/models/STEM.txt`` there is an equivalent ``torch.nn.Module``
here, built from ``torch.nn`` layers (so PyTorch's default initialisation applies) and
``torch.nn.functional`` for the parameter-free ops. Its attribute tree mirrors the value
names of the model file, so its ``state_dict()`` keys are exactly those of the generated
module (``layer2.0.shortcut.0.weight``, ``enc1.c1.bn.running_mean``, ...) and
``load_state_dict`` works both ways.

- ``REFERENCES[stem]()`` builds the reference. ``ref(*inputs_and_targets)`` takes the
  model's inputs and targets in declaration order and returns ``(loss, *preds)`` exactly
  as the model's ``return`` line; ``ref.predict(*inputs)`` returns the tuple of
  predictions in evaluation mode without gradients (like the generated ``predict``).
- ``make_inputs(stem, batch)`` gives deterministic inputs and targets of the declared
  shapes (float ones in ``dtype``, class indices as int64).
- ``DECLS[stem]`` lists the declarations (``Decl``) of each model file.

Run ``python tests/reference_models.py`` to print, for every reference, its state-dict
keys and the loss of a float64 training step at batch 2.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODELS_DIR = Path(__file__).resolve().parent / "models"


def model_path(stem: str) -> Path:
    """The model file of a reference: ``tests/models/STEM.txt``."""
    return MODELS_DIR / f"{stem}.txt"


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
}

_INT_DTYPES = {"i64": torch.int64, "i32": torch.int32}


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
            out.append(t.to(_INT_DTYPES.get(decl.dtype, torch.int64)))
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


# --------------------------------------------------------------------------- base class


class Reference(nn.Module):
    """``forward(*inputs, *targets) -> (loss, *preds)``; subclasses define ``preds`` and
    ``criterion``."""

    n_inputs: int = 1

    def preds(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def criterion(
        self, preds: tuple[Tensor, ...], inputs: Sequence[Tensor], targets: Sequence[Tensor]
    ) -> Tensor:
        raise NotImplementedError

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        inputs, targets = args[: self.n_inputs], args[self.n_inputs :]
        preds = self.preds(*inputs)
        return (self.criterion(preds, inputs, targets), *preds)

    @torch.no_grad()
    def predict(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The predictions in evaluation mode (running statistics, no dropout)."""
        was_training = self.training
        self.eval()
        try:
            return self.preds(*inputs)
        finally:
            self.train(was_training)


# --------------------------------------------------------------------------- ResNets


class BasicBlock(nn.Module):
    """``basic`` (identity shortcut) or ``basic_down`` (``shortcut.0`` conv 1x1 stride s,
    no bias; ``shortcut.1`` batch norm)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1, downsample: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        if downsample:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        r1 = F.relu(self.bn1(self.conv1(x)))
        bn2 = self.bn2(self.conv2(r1))
        sc = self.shortcut(x) if self.downsample else x
        return F.relu(bn2 + sc)


class ResNetLike(Reference):
    """tests/models/resnet_like.txt"""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(
            BasicBlock(8, 16, stride=2, downsample=True), BasicBlock(16, 16)
        )
        self.linear = nn.Linear(16, 10)

    def preds(self, x: Tensor) -> tuple[Tensor, ...]:
        r = F.relu(self.bn1(self.conv1(x)))
        h = self.layer2(self.layer1(r))
        pool = F.adaptive_avg_pool2d(h, 1)
        return (self.linear(torch.flatten(pool, 1)),)

    def criterion(self, preds, inputs, targets):
        return F.cross_entropy(preds[0], targets[0])


class TinyResNet(Reference):
    """tests/models/tiny_resnet.txt (the example of the spec)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16))
        self.fc = nn.Linear(16, 10)

    def preds(self, x: Tensor) -> tuple[Tensor, ...]:
        r = F.relu(self.bn1(self.conv1(x)))
        pool = F.adaptive_avg_pool2d(self.layer1(r), 1)
        return (self.fc(torch.flatten(pool, 1)),)

    def criterion(self, preds, inputs, targets):
        return F.cross_entropy(preds[0], targets[0])


# --------------------------------------------------------------------------- U-Net


class CBR(nn.Module):
    """Block ``cbr``: conv 3x3 (padding 1, bias), ReLU, BatchNorm2d."""

    def __init__(self, cin: int, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(F.relu(self.conv(x)))


class Double(nn.Module):
    """Block ``double``: two ``cbr`` calls named ``c1`` and ``c2``."""

    def __init__(self, cin: int, ch: int):
        super().__init__()
        self.c1 = CBR(cin, ch)
        self.c2 = CBR(ch, ch)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(self.c1(x))


class UNetLike(Reference):
    """tests/models/unet_like.txt"""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = Double(1, 4)
        self.enc2 = Double(4, 8)
        self.mid = Double(8, 16)
        self.dec2 = Double(24, 8)
        self.dec1 = Double(12, 4)
        self.out = nn.Conv2d(4, 1, 1)

    def preds(self, x: Tensor) -> tuple[Tensor, ...]:
        enc1 = self.enc1(x)
        enc2 = self.enc2(F.max_pool2d(enc1, 2))
        mid = self.mid(F.max_pool2d(enc2, 2))
        up2 = F.interpolate(mid, scale_factor=2, mode="bilinear", align_corners=False)
        dec2 = self.dec2(torch.cat([up2, enc2], dim=1))
        up1 = F.interpolate(dec2, scale_factor=2, mode="bilinear", align_corners=False)
        dec1 = self.dec1(torch.cat([up1, enc1], dim=1))
        return (self.out(dec1),)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], targets[0])


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

    def preds(self, x: Tensor) -> tuple[Tensor, ...]:
        h = F.max_pool2d(self.ebn1(F.relu(self.e1(x))), 2)
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

    def preds(self, x: Tensor) -> tuple[Tensor, ...]:
        a1 = F.leaky_relu(self.c1(x), negative_slope=0.2)
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

    def preds(self, x: Tensor) -> tuple[Tensor, ...]:
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

    def preds(self, x: Tensor, v: Tensor) -> tuple[Tensor, ...]:
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


# --------------------------------------------------------------------------- registry

REFERENCES: dict[str, Callable[[], nn.Module]] = {
    "resnet_like": ResNetLike,
    "unet_like": UNetLike,
    "autoencoder": Autoencoder,
    "nonsquare": NonSquare,
    "fanout": FanOut,
    "all_ops": AllOps,
    "tiny_resnet": TinyResNet,
}

_DECL_RE = re.compile(
    r"^\s*(input|target)\s+([A-Za-z_]\w*)\s*:\s*(\w+)\s*\[\s*N\s*((?:,\s*\d+\s*)*)\]", re.M
)


def declared_in_file(stem: str) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """The (kind, name, dtype, dims) declarations read from the model file itself."""
    text = model_path(stem).read_text()
    return [
        (m[1], m[2], m[3], tuple(int(d) for d in m[4].replace(",", " ").split()))
        for m in _DECL_RE.finditer(text)
    ]


def _self_check() -> None:
    import time

    for stem, factory in REFERENCES.items():
        expected = [(d.kind, d.name, d.dtype, d.dims) for d in DECLS[stem]]
        assert declared_in_file(stem) == expected, (stem, declared_in_file(stem))
        torch.manual_seed(0)
        ref = factory().double()
        args = make_inputs(stem, 2)
        t0 = time.perf_counter()
        loss, *preds = ref(*args)
        loss.backward()
        dt = time.perf_counter() - t0
        assert loss.dim() == 0 and torch.isfinite(loss)
        missing = [n for n, p in ref.named_parameters() if p.grad is None]
        assert not missing, (stem, missing)
        eval_preds = ref.predict(*args[: num_inputs(stem)])
        assert [p.shape for p in eval_preds] == [p.shape for p in preds]
        keys = list(ref.state_dict())
        print(
            f"== {stem}: {len(keys)} state-dict keys, loss {loss.item():.6f}, "
            f"preds {[tuple(p.shape) for p in preds]}, step {dt * 1e3:.1f} ms"
        )
        for k in keys:
            print(f"   {k}")


if __name__ == "__main__":
    _self_check()
