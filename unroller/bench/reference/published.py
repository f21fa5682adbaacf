"""References of the benchmark model files (``benchmarks/models/*.txt``).

The four published workloads (ResNet-34 on CIFAR-10, the EMDenoise and SLSTRCloud
U-Nets, the OpticalDamage autoencoder), ResNet-8 for quick runs, and the two networks
the first benchmarks used (``resnet_like``, ``unet_like``). OpticalDamage's linear
layers depend on the input size, so its model text is rewritten per resolution
(``rewrite_opticaldamage``); the others resize through ``Options(resolution=R)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroller.bench.reference.base import Reference, StageRunner
from unroller.bench.reference.blocks import CifarResNet, UNet

# --------------------------------------------------------------------------- ResNets


class ResNetLike(CifarResNet):
    """benchmarks/models/resnet_like.txt: CIFAR ResNet, stages of 2 blocks, 16/32/64 planes."""

    def __init__(self, num_classes: int = 10):
        super().__init__([2, 2, 2], [16, 32, 64], num_classes)


class ResNet34(CifarResNet):
    """benchmarks/models/resnet34.txt: CIFAR-10 ResNet-34, [3, 4, 6, 3] blocks with
    64/128/256/512 planes (21.3M parameters)."""

    def __init__(self, num_classes: int = 10):
        super().__init__([3, 4, 6, 3], [64, 128, 256, 512], num_classes)


class QuickResNet(CifarResNet):
    """benchmarks/models/quick.txt: ResNet-8, one block per stage, 16/32/64 planes."""

    def __init__(self, num_classes: int = 10):
        super().__init__([1, 1, 1], [16, 32, 64], num_classes)


# --------------------------------------------------------------------------- U-Nets


class UNetLike(UNet):
    """benchmarks/models/unet_like.txt: the EMDenoise U-Net (8/16/32/64 channels, "BR"),
    1x1 output conv, ReLU, MSE against the clean image; native 64 x 64."""

    def __init__(self) -> None:
        super().__init__(1, (8, 16, 32, 64), bn=True, out_kernel=1)

    def head(self, out: Tensor) -> Tensor:
        return F.relu(out)


class EMDenoise(UNet):
    """benchmarks/models/emdenoise.txt: 8/16/32/64 channels, conv + "BR" (ReLU then
    BatchNorm2d), output conv 8 -> 1 kernel 3 padding 1, ReLU, MSE against the clean
    image; native 256 x 256."""

    def __init__(self) -> None:
        super().__init__(1, (8, 16, 32, 64), bn=True, out_kernel=3)

    def head(self, out: Tensor) -> Tensor:
        return F.relu(out)


class SLSTRCloud(UNet):
    """benchmarks/models/slstrcloud.txt: 9 input channels, 32/64/128/256 channels, conv +
    ReLU (no batch norm), output conv 32 -> 1 kernel 1, sigmoid, BCE against the mask;
    native 256 x 256."""

    def __init__(self) -> None:
        super().__init__(9, (32, 64, 128, 256), bn=False, out_kernel=1)

    def head(self, out: Tensor) -> Tensor:
        return torch.sigmoid(out)

    def criterion(self, preds, inputs, targets):
        return F.binary_cross_entropy(preds[0], targets[0])


# --------------------------------------------------------------------------- OpticalDamage

OPTICAL_LATENT = 512
OPTICAL_CHANNELS = 16  # channels at the inner S x S size
OPTICAL_RULE = (
    "two 2x2 max pools take R to S = R / 4, and the decoder gives back 4 S rows "
    "(S -> 2S+2 -> 2S -> 4S+2 -> 4S)"
)


def optical_side(resolution: int) -> int:
    """The inner size S of OpticalDamage at input size R (R = 4 S; 200 -> 50)."""
    if resolution < 4 or resolution % 4:
        raise ValueError(
            f"opticaldamage needs a resolution that is a positive multiple of 4 "
            f"(4, 8, ..., native 200), got {resolution}: {OPTICAL_RULE}"
        )
    return resolution // 4


class OpticalEncoder(nn.Module):
    """Block ``encode``: conv-ReLU-BN-maxpool twice, conv-ReLU-BN, flatten, ``fc``."""

    def __init__(self, side: int, latent: int = OPTICAL_LATENT):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 64, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.conv2 = nn.Conv2d(64, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, OPTICAL_CHANNELS, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(OPTICAL_CHANNELS)
        self.fc = nn.Linear(OPTICAL_CHANNELS * side * side, latent)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(self.bn1(F.relu(self.conv1(x))), 2)
        h = F.max_pool2d(self.bn2(F.relu(self.conv2(h))), 2)
        h = self.bn3(F.relu(self.conv3(h)))
        return self.fc(torch.flatten(h, 1))


class OpticalDecoder(nn.Module):
    """Block ``decode``: ``fc`` to 16 S S, reshape, BN, conv, two (conv_transpose stride
    2, ReLU, BN, conv padding 0, ReLU), conv 1x1."""

    def __init__(self, side: int, latent: int = OPTICAL_LATENT):
        super().__init__()
        self.side = side
        self.fc = nn.Linear(latent, OPTICAL_CHANNELS * side * side)
        self.bn0 = nn.BatchNorm2d(OPTICAL_CHANNELS)
        self.conv1 = nn.Conv2d(OPTICAL_CHANNELS, 16, 3, padding=1)
        self.deconv1 = nn.ConvTranspose2d(16, 32, 3, stride=2, output_padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 32, 3)
        self.deconv2 = nn.ConvTranspose2d(32, 64, 3, stride=2, output_padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.conv3 = nn.Conv2d(64, 64, 3)
        self.out = nn.Conv2d(64, 1, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.fc(z).reshape(z.shape[0], OPTICAL_CHANNELS, self.side, self.side)
        h = F.relu(self.conv1(self.bn0(h)))
        h = self.bn1(F.relu(self.deconv1(h)))
        h = F.relu(self.conv2(h))
        h = self.bn2(F.relu(self.deconv2(h)))
        h = F.relu(self.conv3(h))
        return self.out(h)


class OpticalDamage(Reference):
    """benchmarks/models/opticaldamage.txt: the autoencoder at input size R (a multiple
    of 4; native 200), latent 512, MSE against the input. Stages for checkpointing: the
    encoder and the decoder."""

    def __init__(self, resolution: int = 200, latent: int = OPTICAL_LATENT):
        super().__init__()
        side = optical_side(resolution)
        self.encoder = OpticalEncoder(side, latent)
        self.decoder = OpticalDecoder(side, latent)

    def segments(self) -> dict[str, list[nn.Module]]:
        return {"encoder": [self.encoder], "decoder": [self.decoder]}

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        return (run(self.decoder, run(self.encoder, inputs[0])),)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], inputs[0])


def rewrite_opticaldamage(text: str, resolution: int) -> str:
    """The OpticalDamage model text at input size R: the input declaration and the
    decoder's ``units=16*S*S, side=S`` (each must occur exactly once)."""
    side = optical_side(resolution)
    declaration = r"(input\s+x\s*:\s*f32\[\s*N\s*,\s*1\s*,\s*)\d+(\s*,\s*)\d+(\s*\])"
    edits = [
        (declaration, rf"\g<1>{resolution}\g<2>{resolution}\g<3>"),
        (r"units=\d+, side=\d+", f"units={OPTICAL_CHANNELS * side * side}, side={side}"),
    ]
    for pattern, repl in edits:
        text, count = re.subn(pattern, repl, text)
        if count != 1:
            raise RuntimeError(
                f"opticaldamage.txt: expected one match of {pattern!r} to rewrite for "
                f"resolution {resolution}, found {count}"
            )
    return text
