"""Synthetic batches for the benchmark models: deterministic, of plausible value ranges.

Timings and memory do not depend on the values, but compression error and the losses
printed next to them do: white noise is the worst case for DCT+Chop, so the published
workloads get smooth images with the structure of their data (CIFAR-like pictures,
denoising pairs, cloud masks, optics images with damage spots). Each maker takes a
seeded generator, the batch size and the resolution, and returns the inputs and
targets in declaration order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

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


def batch_resnet_like(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    x = torch.randn(batch, 3, resolution, resolution, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return [x, y]


def batch_unet_like(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    clean = torch.rand(batch, 1, resolution, resolution, generator=gen)
    noisy = clean + 0.1 * torch.randn(batch, 1, resolution, resolution, generator=gen)
    return [noisy, clean]


def batch_cifar(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
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


def batch_emdenoise(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """The clean image: a smooth field in [0, 1]; the input: clean + N(0, 0.1^2) noise."""
    clean = smooth_field(gen, (batch, 1, resolution, resolution))
    noisy = clean + 0.1 * torch.randn(clean.shape, generator=gen, dtype=torch.float64)
    return [noisy.float(), clean.float()]


def batch_slstrcloud(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
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


def batch_opticaldamage(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
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


def batch_timeseries(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """tcn_small: 4-channel signals of ``resolution`` steps, each a class-dependent
    frequency (5 classes) with random phase per channel plus noise; class indices."""
    y = torch.randint(0, 5, (batch,), generator=gen)
    t = torch.arange(resolution, dtype=torch.float64) / resolution
    phase = 2 * torch.pi * torch.rand(batch, 4, 1, generator=gen, dtype=torch.float64)
    freq = (2.0 + 3.0 * y.to(torch.float64)).view(batch, 1, 1)
    x = torch.sin(2 * torch.pi * freq * t + phase)
    x = x + 0.3 * torch.randn(batch, 4, resolution, generator=gen, dtype=torch.float64)
    return [x.float(), y]


def batch_text(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """gpt_tiny: ``resolution`` character codes in [32, 127) per sample (printable ASCII,
    uniformly random) and the next code after each as the target."""
    ids = torch.randint(32, 127, (batch, resolution + 1), generator=gen)
    return [ids[:, :-1].contiguous(), ids[:, 1:].contiguous()]


MASK_ID = 0  # bert_encoder's mask token (no printable character)
MASK_SHARE = 0.15  # BERT's share of masked positions


def batch_masked_text(gen: torch.Generator, batch: int, resolution: int) -> list[Tensor]:
    """bert_encoder: ``resolution`` printable character codes per sample of which about
    15% (at least one per sample, so the loss is never an empty mean) are replaced by the
    mask token 0; the target holds the original code there and -100 (ignored) elsewhere."""
    ids = torch.randint(32, 127, (batch, resolution), generator=gen)
    masked = torch.rand(batch, resolution, generator=gen) < MASK_SHARE
    masked[torch.arange(batch), torch.randint(0, resolution, (batch,), generator=gen)] = True
    inputs = ids.masked_fill(masked, MASK_ID)
    targets = ids.masked_fill(~masked, -100)
    return [inputs, targets]
