"""The two families that both zoos use, parametrised: CIFAR-style ResNets and U-Nets.

The benchmark files and the test suite's files hold ResNets and U-Nets of different
depths and widths; one definition of each, with the depth, widths and names as
arguments, keeps their maths in one place. Attribute names follow the model files'
value names, so state-dict keys match the generated modules'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroller.bench.reference.base import Reference, StageRunner

# --------------------------------------------------------------------------- ResNets


class BasicBlock(nn.Module):
    """Blocks ``basic`` (identity shortcut) and ``basic_down`` (``shortcut.0``: conv 1x1
    with the block's stride, no bias; ``shortcut.1``: batch norm), the latter whenever
    the stride or the width changes."""

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


class CifarResNet(Reference):
    """A CIFAR-style ResNet of BasicBlocks: stem conv 3x3 (no bias), BN, ReLU, no max
    pool; stages ``layer1``... of ``blocks[i]`` blocks with ``planes[i]`` planes, the
    first block of every stage after the first with stride 2; adaptive average pool,
    flatten, a linear layer named ``head``, cross-entropy. Stages for checkpointing: the
    stem, each layer."""

    def __init__(
        self,
        blocks: Sequence[int],
        planes: Sequence[int],
        num_classes: int = 10,
        in_channels: int = 3,
        head: str = "linear",
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes[0])
        self.num_stages = len(blocks)
        cin = planes[0]
        for i, (count, width) in enumerate(zip(blocks, planes)):
            stride = 1 if i == 0 else 2
            layer = [BasicBlock(cin, width, stride)]
            layer += [BasicBlock(width, width) for _ in range(count - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*layer))
            cin = width
        self.head_name = head
        self.add_module(head, nn.Linear(cin, num_classes))

    def layers(self) -> list[nn.Module]:
        return [getattr(self, f"layer{i + 1}") for i in range(self.num_stages)]

    def stem(self, x: Tensor) -> Tensor:
        return F.relu(self.bn1(self.conv1(x)))

    def segments(self) -> dict[str, list[nn.Module]]:
        found: dict[str, list[nn.Module]] = {"stem": [self.conv1, self.bn1]}
        for i, layer in enumerate(self.layers()):
            found[f"layer{i + 1}"] = [layer]
        return found

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        h = run(self.stem, inputs[0])
        for layer in self.layers():
            h = run(layer, h)
        head = getattr(self, self.head_name)
        return (head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)),)

    def criterion(self, preds, inputs, targets):
        return F.cross_entropy(preds[0], targets[0])


# --------------------------------------------------------------------------- U-Nets


class ConvAct(nn.Module):
    """Block ``cbr`` (``bn=True``: conv 3x3 with bias, ReLU, then BatchNorm2d: "BR") or
    ``cr`` (``bn=False``: conv 3x3, ReLU)."""

    def __init__(self, cin: int, ch: int, bn: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(cin, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch) if bn else None

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.conv(x))
        return self.bn(h) if self.bn is not None else h


class Double(nn.Module):
    """Block ``double``: one U-Net level, ``c1`` then ``c2``."""

    def __init__(self, cin: int, ch: int, bn: bool = True):
        super().__init__()
        self.c1 = ConvAct(cin, ch, bn)
        self.c2 = ConvAct(ch, ch, bn)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(self.c1(x))


UNET_RULE = "three 2x2 max pools and three x2 upsamplings must give back the skips' sizes"


def up2(x: Tensor) -> Tensor:
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class UNet(Reference):
    """The SciML-Bench U-Net shape at any depth: encoder levels (each after the first
    behind a 2x2 max pool; their outputs are the skips), ``mid`` (behind a max pool),
    decoder levels (bilinear x2 upsampling, concat with the matching skip, a level), the
    1-channel conv ``out`` and ``head``. ``widths``: one per encoder level, then mid's.
    Stages for checkpointing: every level (a pool or an upsampling and concat runs inside
    the level that follows it)."""

    def __init__(
        self,
        in_channels: int,
        widths: Sequence[int],
        bn: bool,
        out_kernel: int,
        encoders: Sequence[str] = ("enc1", "enc2", "enc3"),
        decoders: Sequence[str] = ("dec5", "dec6", "dec7"),
    ) -> None:
        super().__init__()
        if len(widths) != len(encoders) + 1 or len(decoders) != len(encoders):
            raise ValueError("a U-Net needs one width per encoder level plus mid's")
        self.encoders, self.decoders = tuple(encoders), tuple(decoders)
        cin = in_channels
        for name, width in zip(encoders, widths):
            self.add_module(name, Double(cin, width, bn))
            cin = width
        self.mid = Double(cin, widths[-1], bn)
        cin = widths[-1]
        for name, skip in zip(decoders, reversed(widths[:-1])):
            self.add_module(name, Double(cin + skip, skip, bn))
            cin = skip
        self.out = nn.Conv2d(cin, 1, out_kernel, padding=out_kernel // 2)

    @property
    def levels(self) -> tuple[str, ...]:
        return (*self.encoders, "mid", *self.decoders)

    def segments(self) -> dict[str, list[nn.Module]]:
        return {name: [getattr(self, name)] for name in self.levels}

    def head(self, out: Tensor) -> Tensor:
        return out

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        def down(level: nn.Module) -> Callable[[Tensor], Tensor]:
            return lambda h: level(F.max_pool2d(h, 2))

        def up(level: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
            return lambda h, skip: level(torch.cat([up2(h), skip], dim=1))

        skips = []
        h = inputs[0]
        for i, name in enumerate(self.encoders):
            level = getattr(self, name)
            h = run(level, h) if i == 0 else run(down(level), h)
            skips.append(h)
        h = run(down(self.mid), h)
        for name, skip in zip(self.decoders, reversed(skips)):
            h = run(up(getattr(self, name)), h, skip)
        return (self.head(self.out(h)),)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], targets[0])
