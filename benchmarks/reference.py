"""Plain ``torch.nn`` equivalents of the benchmark model files, synthetic batches, and the
benchmark registry.

``BENCHMARKS[name]`` (a ``Benchmark``) describes ``benchmarks/models/NAME.txt``:

- ``build(resolution)`` builds the reference module at that input size (``None``: the
  size the model file declares). Its attribute tree mirrors the value names of the model
  file, so its ``state_dict()`` keys are exactly those of the generated module, in the
  same order, and ``load_state_dict(strict=True)`` works both ways.
  ``ref(*inputs_and_targets)`` returns ``(loss, *preds)`` as the file's ``return`` line
  does (autograd does the backward pass); ``ref.forward_checkpointed(*batch)`` returns
  the same with ``torch.utils.checkpoint`` around every stage; ``ref.predict(*inputs)``
  gives the predictions in evaluation mode.
- ``make_batch(batch, resolution, seed)``: deterministic float32 inputs and targets of
  the declared shapes and plausible value ranges, in declaration order.
- ``model_text(resolution)``, ``generate(options)``, ``model_class(options)``: the model
  text at a resolution and the generated module from it (see "Resolutions").
- ``native_resolution``, ``paper_batch``, ``quick_resolution``: the declared input size,
  the batch the authors of the published benchmarks used, and the reduced size
  ``make bench``'s quick run uses on a 2-core CPU.

Resolutions. ``unroller.codegen.Options(resolution=R)`` makes the generator rewrite every
``[N, C, H, W]`` input and target to ``H = R`` (``unroller.api.at_resolution``). The
ResNets (adaptive pooling) and the U-Nets (fully convolutional; R a multiple of 8 so that
the three 2x2 poolings and x2 upsamplings meet the skips) need nothing more. The
OpticalDamage autoencoder's linear layers and reshape depend on the size: with S = R / 4
the decoder's ``linear`` has ``16 * S * S`` outputs and the reshape is ``(16, S, S)``, and
the decoder gives back 4 S rows, so R must be a multiple of 4 (native 200: S = 50).
For it, ``model_text(R)`` rewrites those two numbers (and the input declaration) in the
model file's text; ``generate`` and ``model_class`` generate from that text (through
``unroller.api.generate_from_text``, labelled with the model file's path; the lines keep
their numbers, so error positions still point into the file). The header of such a
generated file records the sha256 of the rewritten text, so ``unroll check`` cannot
regenerate it from the file: write these to temporary directories, not ``generated/``.

Older interface, kept for ``benchmarks/core_bench.py`` and ``benchmarks/compress_bench.py``:
``REFERENCES[stem]()`` builds the reference of the two original benchmark models
(``resnet_like``, ``unet_like``) at their native size; ``make_batch(stem, batch, seed)``
gives their batch (and delegates to ``BENCHMARKS`` for the others); ``model_path(stem)``.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from unroller.api import generate_from_text, import_generated, write_atomic
from unroller.codegen import Options

MODELS_DIR = Path(__file__).resolve().parent / "models"

# A stage runner: ``run(fn, *tensors)`` calls ``fn(*tensors)``, plainly or checkpointed.
StageRunner = Callable[..., Tensor]


def model_path(stem: str) -> Path:
    """The model file of a benchmark: ``benchmarks/models/STEM.txt``."""
    return MODELS_DIR / f"{stem}.txt"


# --------------------------------------------------------------------------- base class


def _run_plain(fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
    return fn(*args)


class BenchReference(nn.Module):
    """``forward(*inputs, *targets) -> (loss, *preds)``.

    Subclasses define ``preds(inputs, run)``, calling every stage as ``run(fn, *tensors)``,
    ``criterion(preds, inputs, targets)``, and ``segments()``.
    """

    n_inputs: int = 1

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def criterion(
        self, preds: tuple[Tensor, ...], inputs: Sequence[Tensor], targets: Sequence[Tensor]
    ) -> Tensor:
        raise NotImplementedError

    def segments(self) -> dict[str, list[nn.Module]]:
        """The checkpointed stages in order: name -> the modules holding its parameters.

        Parameters outside every stage (the head of a ResNet or U-Net) run plainly.
        """
        raise NotImplementedError

    def _compute(self, args: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        inputs, targets = args[: self.n_inputs], args[self.n_inputs :]
        preds = self.preds(inputs, run)
        return (self.criterion(preds, inputs, targets), *preds)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return self._compute(args, _run_plain)

    def forward_checkpointed(self, *args: Tensor) -> tuple[Tensor, ...]:
        """``forward`` with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
        around every stage of ``segments()``: each stage keeps only its inputs, and its
        forward runs again during backward. Same loss, predictions and gradients.

        The recomputation would update the batch-norm running statistics a second time;
        it restores every buffer afterwards, so they too end as after ``forward``.
        """
        return self._compute(args, self._run_checkpointed)

    def _run_checkpointed(self, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        calls = 0

        def stage(*tensors: Tensor) -> Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward pass
                return fn(*tensors)
            saved = [b.clone() for b in self.buffers()]
            try:  # the recomputation in backward (it may stop early by raising)
                return fn(*tensors)
            finally:
                with torch.no_grad():
                    for buf, old in zip(self.buffers(), saved):
                        buf.copy_(old)

        return checkpoint(stage, *args, use_reentrant=False)

    @torch.no_grad()
    def predict(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The predictions in evaluation mode (running statistics), no gradients."""
        was_training = self.training
        self.eval()
        try:
            return self.preds(inputs, _run_plain)
        finally:
            self.train(was_training)


# --------------------------------------------------------------------------- ResNets


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


class CifarResNet(BenchReference):
    """A CIFAR-style ResNet of BasicBlocks: stem conv 3x3 (no bias), BN, ReLU, no max
    pool; stages ``layer1``... of ``blocks[i]`` blocks with ``planes[i]`` planes, the
    first block of every stage after the first with stride 2; adaptive average pool,
    flatten, ``linear``, cross-entropy. Stages for checkpointing: the stem, each layer."""

    def __init__(
        self,
        blocks: Sequence[int],
        planes: Sequence[int],
        num_classes: int = 10,
        in_channels: int = 3,
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
        self.linear = nn.Linear(cin, num_classes)

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
        return (self.linear(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)),)

    def criterion(self, preds, inputs, targets):
        return F.cross_entropy(preds[0], targets[0])


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


# Kept under their old names for code that imported them.
ConvBR = ConvAct
DoubleBR = Double


UNET_RULE = "three 2x2 max pools and three x2 upsamplings must give back the skips' sizes"


def _up2(x: Tensor) -> Tensor:
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class UNet(BenchReference):
    """The SciML-Bench U-Net shape: levels ``enc1``-``enc3`` (each followed by a 2x2 max
    pool; their outputs are the skips), ``mid``, and ``dec5``-``dec7`` (bilinear x2
    upsampling, concat with the skip, a level); then the 1-channel conv ``out`` and the
    head. Stages for checkpointing: each of the seven levels (a pool or an upsampling and
    concat runs inside the level that follows it)."""

    LEVELS = ("enc1", "enc2", "enc3", "mid", "dec5", "dec6", "dec7")

    def __init__(self, in_channels: int, widths: Sequence[int], bn: bool, out_kernel: int) -> None:
        super().__init__()
        w1, w2, w3, w4 = widths
        self.enc1 = Double(in_channels, w1, bn)
        self.enc2 = Double(w1, w2, bn)
        self.enc3 = Double(w2, w3, bn)
        self.mid = Double(w3, w4, bn)
        self.dec5 = Double(w4 + w3, w3, bn)
        self.dec6 = Double(w3 + w2, w2, bn)
        self.dec7 = Double(w2 + w1, w1, bn)
        self.out = nn.Conv2d(w1, 1, out_kernel, padding=out_kernel // 2)

    def segments(self) -> dict[str, list[nn.Module]]:
        return {name: [getattr(self, name)] for name in self.LEVELS}

    def head(self, out: Tensor) -> Tensor:
        raise NotImplementedError

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        def down(level: nn.Module) -> Callable[[Tensor], Tensor]:
            return lambda h: level(F.max_pool2d(h, 2))

        def up(level: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
            return lambda h, skip: level(torch.cat([_up2(h), skip], dim=1))

        s1 = run(self.enc1, inputs[0])
        s2 = run(down(self.enc2), s1)
        s3 = run(down(self.enc3), s2)
        h = run(down(self.mid), s3)
        h = run(up(self.dec5), h, s3)
        h = run(up(self.dec6), h, s2)
        h = run(up(self.dec7), h, s1)
        return (self.head(self.out(h)),)


class UNetLike(UNet):
    """benchmarks/models/unet_like.txt: the EMDenoise U-Net (8/16/32/64 channels, "BR"),
    1x1 output conv, ReLU, MSE against the clean image; native 64 x 64."""

    def __init__(self) -> None:
        super().__init__(1, (8, 16, 32, 64), bn=True, out_kernel=1)

    def head(self, out: Tensor) -> Tensor:
        return F.relu(out)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], targets[0])


class EMDenoise(UNet):
    """benchmarks/models/emdenoise.txt: 8/16/32/64 channels, conv + "BR" (ReLU then
    BatchNorm2d), output conv 8 -> 1 kernel 3 padding 1, ReLU, MSE against the clean
    image; native 256 x 256."""

    def __init__(self) -> None:
        super().__init__(1, (8, 16, 32, 64), bn=True, out_kernel=3)

    def head(self, out: Tensor) -> Tensor:
        return F.relu(out)

    def criterion(self, preds, inputs, targets):
        return F.mse_loss(preds[0], targets[0])


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


class OpticalDamage(BenchReference):
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


def _rewrite_opticaldamage(text: str, resolution: int) -> str:
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


# --------------------------------------------------------------------------- batches

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def smooth_field(gen: torch.Generator, shape: Sequence[int], cells: int = 8) -> Tensor:
    """Smooth random images in [0, 1], float64, of shape [N, C, H, W]: Gaussian noise on
    a coarse ``cells``-per-side grid and on a grid 4x finer (a quarter of the weight),
    bilinearly upsampled, then scaled per image and channel to span [0, 1]."""
    n, c, h, w = shape
    field = torch.zeros(n, c, h, w, dtype=torch.float64)
    for k, weight in ((cells, 1.0), (4 * cells, 0.25)):
        kh, kw = min(k, h), min(k, w)
        coarse = torch.randn(n, c, kh, kw, generator=gen, dtype=torch.float64)
        field += weight * F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    lo = field.amin(dim=(2, 3), keepdim=True)
    hi = field.amax(dim=(2, 3), keepdim=True)
    return (field - lo) / (hi - lo).clamp_min(1e-12)


def _batch_resnet_like(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    x = torch.randn(batch, 3, resolution, resolution, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return [x, y]


def _batch_unet_like(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    clean = torch.rand(batch, 1, resolution, resolution, generator=gen)
    noisy = clean + 0.1 * torch.randn(batch, 1, resolution, resolution, generator=gen)
    return [noisy, clean]


def _batch_cifar(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """CIFAR-10-like: smooth RGB images in [0, 1] with a little pixel noise, normalised
    with the CIFAR-10 channel means and standard deviations (values about -2 to 2.2);
    class indices in [0, 10)."""
    img = smooth_field(gen, (batch, 3, resolution, resolution), cells=4)
    img = img + 0.03 * torch.randn(img.shape, generator=gen, dtype=torch.float64)
    img = img.clamp(0.0, 1.0)
    mean = torch.tensor(CIFAR_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, dtype=torch.float64).view(1, 3, 1, 1)
    x = ((img - mean) / std).float()
    y = torch.randint(0, 10, (batch,), generator=gen)
    return [x, y]


def _batch_emdenoise(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """The clean image: a smooth field in [0, 1]; the input: clean + N(0, 0.1^2) noise."""
    clean = smooth_field(gen, (batch, 1, resolution, resolution))
    noisy = clean + 0.1 * torch.randn(clean.shape, generator=gen, dtype=torch.float64)
    return [noisy.float(), clean.float()]


def _batch_slstrcloud(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """A cloud mask (a smooth field thresholded at 0.5: blobs of cloud, values exactly 0
    or 1) and 9 channels that see it: channels 0-5 reflectances in [0, 1] (surface 0.05
    to 0.35, cloud brighter, about 0.6 to 0.9), channels 6-8 brightness temperatures
    standardised as (T - 270 K) / 20 K (surface about 280-300 K, cloud about 230-250 K)."""
    shape = (batch, 1, resolution, resolution)
    mask = (smooth_field(gen, shape, cells=6) > 0.5).double()
    surface = smooth_field(gen, (batch, 6, resolution, resolution))
    noise = 0.02 * torch.randn(batch, 9, resolution, resolution, generator=gen, dtype=torch.float64)
    refl = (0.05 + 0.3 * surface) * (1 - mask) + (0.6 + 0.3 * surface) * mask + noise[:, :6]
    temp_field = smooth_field(gen, (batch, 3, resolution, resolution))
    kelvin = (280 + 20 * temp_field) * (1 - mask) + (230 + 20 * temp_field) * mask
    bt = (kelvin - 270) / 20 + noise[:, 6:]
    x = torch.cat([refl.clamp(0.0, 1.0), bt], dim=1)
    return [x.float(), mask.float()]


def _batch_opticaldamage(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """Optics images in [0, 1]: a smooth background between 0.2 and 0.6 with a few small
    bright Gaussian spots (damage sites, 1-4 per image)."""
    background = 0.2 + 0.4 * smooth_field(gen, (batch, 1, resolution, resolution), cells=4)
    coords = (torch.arange(resolution, dtype=torch.float64) + 0.5) / resolution
    yy, xx = coords.view(-1, 1), coords.view(1, -1)
    spots = torch.zeros_like(background)
    for i in range(batch):
        count = int(torch.randint(1, 5, (1,), generator=gen))
        for _ in range(count):
            cy, cx, amp = torch.rand(3, generator=gen, dtype=torch.float64).tolist()
            width = 0.01 + 0.03 * float(torch.rand(1, generator=gen, dtype=torch.float64))
            d2 = (yy - cy) ** 2 + (xx - cx) ** 2
            spots[i, 0] += (0.3 + 0.5 * amp) * torch.exp(-d2 / (2 * width**2))
    return [(background + spots).clamp(0.0, 1.0).float()]


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Benchmark:
    """One benchmark network: ``benchmarks/models/NAME.txt`` and its reference.

    ``paper_batch`` is the batch the authors of the published benchmarks used; for the
    models that are not from that work (``from_paper`` false) it is the batch this
    project's harness uses (32). Valid resolutions are the positive multiples of
    ``resolution_step`` (``resolution_rule`` says why).
    """

    name: str
    description: str
    native_resolution: int
    paper_batch: int
    quick_resolution: int
    resolution_step: int
    from_paper: bool
    reference: Callable[[int], BenchReference]  # resolution -> reference module
    batch_fn: Callable[[torch.Generator, int, int], list[Tensor]]  # (gen, batch, R)
    text_rewrite: Callable[[str, int], str] | None = None  # (file text, R) -> text at R
    resolution_rule: str = "any size works"  # why resolutions are multiples of the step

    @property
    def path(self) -> Path:
        """The model file."""
        return model_path(self.name)

    @property
    def label(self) -> str:
        """How generated code names its source: the model file, relative to the repo."""
        return f"benchmarks/models/{self.path.name}"

    def valid_resolution(self, resolution: int) -> bool:
        return resolution >= self.resolution_step and resolution % self.resolution_step == 0

    def check_resolution(self, resolution: int | None) -> int:
        """``resolution`` (``None``: the native one), or ValueError naming the valid ones."""
        if resolution is None:
            return self.native_resolution
        if not self.valid_resolution(resolution):
            step = self.resolution_step
            raise ValueError(
                f"{self.name} needs a resolution that is a positive multiple of {step} "
                f"({step}, {2 * step}, ..., native {self.native_resolution}), got "
                f"{resolution}: {self.resolution_rule}"
            )
        return resolution

    def build(self, resolution: int | None = None) -> BenchReference:
        """The reference module at input size ``resolution`` (default: native), with
        PyTorch's default initialisation."""
        return self.reference(self.check_resolution(resolution))

    def make_batch(self, batch: int, resolution: int | None = None, seed: int = 0) -> list[Tensor]:
        """Deterministic float32 inputs and targets (int64 class indices), in declaration
        order, at input size ``resolution`` (default: native)."""
        gen = torch.Generator().manual_seed(seed)
        return self.batch_fn(gen, batch, self.check_resolution(resolution))

    def segments(self, module: BenchReference) -> dict[str, list[nn.Module]]:
        """The stages ``module.forward_checkpointed`` checkpoints, in order."""
        return module.segments()

    def model_text(self, resolution: int | None = None) -> str:
        """The model file's text, rewritten for ``resolution`` where the model has
        size-dependent layers (OpticalDamage); otherwise the file's text unchanged (the
        generator resizes the inputs itself: ``Options(resolution=R)``)."""
        text = self.path.read_text(encoding="utf-8")
        resolution = self.check_resolution(resolution)
        if self.text_rewrite is None or resolution == self.native_resolution:
            return text
        return self.text_rewrite(text, resolution)

    def generate(self, options: Options | None = None) -> str:
        """The generated module's source for ``options`` (its ``resolution`` included)."""
        options = options or Options()
        text = self.model_text(options.resolution)
        return generate_from_text(text, options, label=self.label)

    def model_class(self, options: Options | None = None, directory: Path | None = None):
        """Generate, write to ``directory`` (a new temp dir by default), import; returns
        the generated ``Model`` class."""
        options = options or Options()
        source = self.generate(options)
        directory = Path(directory or tempfile.mkdtemp(prefix="unroller-bench-"))
        resolution = self.check_resolution(options.resolution)
        out = directory / f"{self.name}_{options.platform}_{options.scheme}_{resolution}.py"
        write_atomic(out, source)
        return import_generated(out).Model


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(
            name="resnet34",
            description="ResNet-34 on CIFAR-10 (3x32x32, 10 classes, cross-entropy)",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=True,
            reference=lambda r: ResNet34(),
            batch_fn=_batch_cifar,
        ),
        Benchmark(
            name="emdenoise",
            description="EMDenoise U-Net (1x256x256, MSE against the clean image)",
            native_resolution=256,
            paper_batch=32,
            quick_resolution=64,
            resolution_step=8,
            resolution_rule=UNET_RULE,
            from_paper=True,
            reference=lambda r: EMDenoise(),
            batch_fn=_batch_emdenoise,
        ),
        Benchmark(
            name="slstrcloud",
            description="SLSTRCloud U-Net (9x256x256, sigmoid + BCE against a {0,1} mask)",
            native_resolution=256,
            paper_batch=4,
            quick_resolution=64,
            resolution_step=8,
            resolution_rule=UNET_RULE,
            from_paper=True,
            reference=lambda r: SLSTRCloud(),
            batch_fn=_batch_slstrcloud,
        ),
        Benchmark(
            name="opticaldamage",
            description="OpticalDamage autoencoder (1x200x200, latent 512, MSE to the input)",
            native_resolution=200,
            paper_batch=8,
            quick_resolution=64,
            resolution_step=4,
            from_paper=True,
            reference=OpticalDamage,
            batch_fn=_batch_opticaldamage,
            text_rewrite=_rewrite_opticaldamage,
            resolution_rule=OPTICAL_RULE,
        ),
        Benchmark(
            name="quick",
            description="ResNet-8 on CIFAR-10-like 3x32x32 images, for quick runs",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=False,
            reference=lambda r: QuickResNet(),
            batch_fn=_batch_cifar,
        ),
        Benchmark(
            name="resnet_like",
            description="ResNet-14-like on 3x32x32 (white-noise images), cross-entropy",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=False,
            reference=lambda r: ResNetLike(),
            batch_fn=_batch_resnet_like,
        ),
        Benchmark(
            name="unet_like",
            description="EMDenoise-shaped U-Net on 1x64x64 (uniform noise images), MSE",
            native_resolution=64,
            paper_batch=32,
            quick_resolution=64,
            resolution_step=8,
            resolution_rule=UNET_RULE,
            from_paper=False,
            reference=lambda r: UNetLike(),
            batch_fn=_batch_unet_like,
        ),
    ]
}


# --------------------------------------------------------------------------- older interface

# The references ``core_bench`` and ``compress_bench`` run by default (native size).
REFERENCES: dict[str, Callable[[], nn.Module]] = {
    "resnet_like": ResNetLike,
    "unet_like": UNetLike,
}


def make_batch(stem: str, batch: int, seed: int = 0) -> list[Tensor]:
    """Deterministic float32 inputs (and int64 class targets) for model ``stem`` at its
    native size: ``BENCHMARKS[stem].make_batch(batch, None, seed)``.

    resnet_like: x ~ N(0, 1) of [N, 3, 32, 32], y uniform class indices in [0, 10).
    unet_like: a clean image y uniform in [0, 1) of [N, 1, 64, 64] and the noisy input
    x = y + 0.1 * N(0, 1).
    """
    if stem not in BENCHMARKS:
        raise KeyError(f"no synthetic batch for model {stem!r}")
    return BENCHMARKS[stem].make_batch(batch, None, seed)
