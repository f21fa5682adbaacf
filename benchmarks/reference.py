"""Plain ``torch.nn`` equivalents of the benchmark model files, and synthetic batches.

``REFERENCES[stem]()`` builds the module for ``benchmarks/models/STEM.txt``. Its
attribute tree mirrors the value names of the model file, so its ``state_dict()`` keys
are exactly those of the generated module and ``load_state_dict(strict=True)`` works
both ways. ``ref(*inputs_and_targets)`` returns ``(loss, *preds)`` as the file's
``return`` line does; autograd does the backward pass.

``make_batch(stem, batch)`` gives deterministic inputs and targets of the declared
shapes, in declaration order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODELS_DIR = Path(__file__).resolve().parent / "models"


def model_path(stem: str) -> Path:
    """The model file of a benchmark: ``benchmarks/models/STEM.txt``."""
    return MODELS_DIR / f"{stem}.txt"


# --------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """Blocks ``basic`` (identity shortcut) and ``basic_down`` (``shortcut.0``: conv 1x1
    with the block's stride, no bias; ``shortcut.1``: batch norm)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.has_shortcut = stride != 1 or in_planes != planes
        if self.has_shortcut:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = self.shortcut(x) if self.has_shortcut else x
        return F.relu(out + skip)


class ResNetLike(nn.Module):
    """benchmarks/models/resnet_like.txt: CIFAR ResNet, stages of 2 blocks, 16/32/64 planes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, stride=2), BasicBlock(32, 32))
        self.layer3 = nn.Sequential(BasicBlock(32, 64, stride=2), BasicBlock(64, 64))
        self.linear = nn.Linear(64, num_classes)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.layer3(self.layer2(self.layer1(h)))
        logits = self.linear(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
        return F.cross_entropy(logits, y), logits


# --------------------------------------------------------------------------- U-Net


class ConvBR(nn.Module):
    """Block ``cbr``: conv 3x3 (padding 1, with bias), ReLU, then BatchNorm2d."""

    def __init__(self, cin: int, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(F.relu(self.conv(x)))


class DoubleBR(nn.Module):
    """Block ``double``: ``c1`` then ``c2``, both ``cbr``."""

    def __init__(self, cin: int, ch: int):
        super().__init__()
        self.c1 = ConvBR(cin, ch)
        self.c2 = ConvBR(ch, ch)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(self.c1(x))


def _up2(x: Tensor) -> Tensor:
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class UNetLike(nn.Module):
    """benchmarks/models/unet_like.txt: the EMDenoise U-Net (8/16/32/64 channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = DoubleBR(1, 8)
        self.enc2 = DoubleBR(8, 16)
        self.enc3 = DoubleBR(16, 32)
        self.mid = DoubleBR(32, 64)
        self.dec5 = DoubleBR(64 + 32, 32)
        self.dec6 = DoubleBR(32 + 16, 16)
        self.dec7 = DoubleBR(16 + 8, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        s1 = self.enc1(x)
        s2 = self.enc2(F.max_pool2d(s1, 2))
        s3 = self.enc3(F.max_pool2d(s2, 2))
        h = self.mid(F.max_pool2d(s3, 2))
        h = self.dec5(torch.cat([_up2(h), s3], dim=1))
        h = self.dec6(torch.cat([_up2(h), s2], dim=1))
        h = self.dec7(torch.cat([_up2(h), s1], dim=1))
        pred = F.relu(self.out(h))
        return F.mse_loss(pred, y), pred


REFERENCES: dict[str, Callable[[], nn.Module]] = {
    "resnet_like": ResNetLike,
    "unet_like": UNetLike,
}


# --------------------------------------------------------------------------- batches


def make_batch(stem: str, batch: int, seed: int = 0) -> list[Tensor]:
    """Deterministic float32 inputs (and int64 class targets) for model ``stem``.

    resnet_like: x ~ N(0, 1) of [N, 3, 32, 32], y uniform class indices in [0, 10).
    unet_like: a clean image y uniform in [0, 1) of [N, 1, 64, 64] and the noisy input
    x = y + 0.1 * N(0, 1).
    """
    gen = torch.Generator().manual_seed(seed)
    if stem == "resnet_like":
        x = torch.randn(batch, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        return [x, y]
    if stem == "unet_like":
        clean = torch.rand(batch, 1, 64, 64, generator=gen)
        noisy = clean + 0.1 * torch.randn(batch, 1, 64, 64, generator=gen)
        return [noisy, clean]
    raise KeyError(f"no synthetic batch for model {stem!r}")
