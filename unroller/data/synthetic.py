"""Task-like synthetic datasets, generated deterministically from a seed.

They stand in for the SciML-Bench data (tens of GB, not downloadable here) with the
same input and target shapes and the same kind of task, so a scheme's effect on
training can be measured on this machine. They are *synthetic*: every table, plot and
description that uses one says so. The same seed gives bit-identical tensors (a
private ``torch.Generator``; the global RNG is untouched).

- ``denoise`` (the EMDenoise task): smooth random fields in (0, 1) as clean images;
  the input is the clean image under Poisson shot noise at a low dose (mean 12
  counts at full intensity), scaled back to intensity (a C-channel model gets C
  independent exposures). Target: the one-channel clean image.
- ``clouds`` (the SLSTRCloud task): C-channel images (9 for SLSTR: 6 "reflectances",
  3 "brightness temperatures") made of one smooth hidden cloud field mixed into every
  channel with seed-drawn weights, plus each channel's own smooth field and pixel
  noise. Target: the mask where a hidden linear threshold rule on the noise-free
  channels holds (positive reflectance weights, negative temperature weights).
- ``optics`` (the OpticalDamage autoencoder): a smooth beam profile with low-contrast
  texture, plus 0-6 small bright Gaussian defects of radius 0.7-2 pixels. The
  autoencoder's target is its input.

Smooth fields are white noise low-passed with a Gaussian filter in Fourier space
(periodic, unit variance per image), with a correlation length proportional to the
image size, so the sets look alike at any resolution.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from unroller.data.core import Signature, Split, TaskData, check

DEFAULT_SIZES = {"denoise": (512, 128), "clouds": (256, 64), "optics": (256, 64)}
TASKS = {"denoise": "denoising", "clouds": "segmentation", "optics": "autoencoding"}
PHOTONS = 12.0  # expected counts at intensity 1 in `denoise`


def smooth_fields(count: int, channels: int, height: int, width: int, sigma: float, gen) -> Tensor:
    """[count, channels, H, W] float64 Gaussian random fields, zero mean, unit std each."""
    noise = torch.randn(count, channels, height, width, generator=gen, dtype=torch.float64)
    fy = torch.fft.fftfreq(height, dtype=torch.float64)[:, None]
    fx = torch.fft.rfftfreq(width, dtype=torch.float64)[None, :]
    gain = torch.exp(-2.0 * math.pi**2 * sigma**2 * (fy**2 + fx**2))
    field = torch.fft.irfft2(torch.fft.rfft2(noise) * gain, s=(height, width))
    field = field - field.mean(dim=(-2, -1), keepdim=True)
    return field / field.std(dim=(-2, -1), keepdim=True).clamp_min(1e-12)


def denoise(count: int, shape: tuple[int, int, int], gen, task_gen) -> Split:
    channels, height, width = shape
    clean = torch.sigmoid(1.5 * smooth_fields(count, 1, height, width, height / 16, gen))
    # one clean image; each input channel is an independent noisy exposure of it
    exposures = clean.expand(-1, channels, -1, -1)
    noisy = torch.poisson(exposures * PHOTONS, generator=gen) / PHOTONS
    return Split(noisy.float(), clean.float())


def clouds(count: int, shape: tuple[int, int, int], gen, task_gen) -> Split:
    channels, height, width = shape
    warm = max(1, channels // 3)  # the last third are "brightness temperatures"
    signs = torch.ones(channels, dtype=torch.float64)
    signs[channels - warm :] = -1.0
    mixing = signs * (0.5 + torch.rand(channels, generator=task_gen, dtype=torch.float64))
    rule = signs * (0.5 + torch.rand(channels, generator=task_gen, dtype=torch.float64))
    hidden = smooth_fields(count, 1, height, width, height / 12, gen)
    own = smooth_fields(count, channels, height, width, height / 24, gen)
    clean = mixing[None, :, None, None] * hidden + 0.7 * own
    score = (rule[None, :, None, None] * clean).sum(dim=1, keepdim=True)
    mask = (score > 0.0).to(torch.float64)
    noisy = clean + 0.3 * torch.randn(clean.shape, generator=gen, dtype=torch.float64)
    return Split(noisy.float(), mask.float())


def optics(count: int, shape: tuple[int, int, int], gen, task_gen) -> Split:
    channels, height, width = shape
    ys = torch.linspace(-1.0, 1.0, height, dtype=torch.float64)[:, None]
    xs = torch.linspace(-1.0, 1.0, width, dtype=torch.float64)[None, :]
    centre = 0.2 * (torch.rand(count, 2, generator=gen, dtype=torch.float64) - 0.5)
    dy = ys[None] - centre[:, 0, None, None]
    dx = xs[None] - centre[:, 1, None, None]
    beam = 0.15 + 0.45 * torch.exp(-(dy**2 + dx**2) / 0.5)  # [count, H, W]
    texture = 0.05 * smooth_fields(count, channels, height, width, height / 20, gen)
    images = beam[:, None] + texture
    pixel_y = torch.arange(height, dtype=torch.float64)[:, None]
    pixel_x = torch.arange(width, dtype=torch.float64)[None, :]
    defects = torch.randint(0, 7, (count,), generator=gen)
    for i in range(count):
        for _ in range(int(defects[i])):
            cy = torch.rand((), generator=gen, dtype=torch.float64) * (height - 1)
            cx = torch.rand((), generator=gen, dtype=torch.float64) * (width - 1)
            radius = 0.7 + 1.3 * torch.rand((), generator=gen, dtype=torch.float64)
            peak = 0.4 + 0.4 * torch.rand((), generator=gen, dtype=torch.float64)
            spot = peak * torch.exp(-((pixel_y - cy) ** 2 + (pixel_x - cx) ** 2) / (2 * radius**2))
            images[i] += spot
    return Split(images.clamp(0.0, 1.0).float(), None)


GENERATORS = {"denoise": denoise, "clouds": clouds, "optics": optics}
DESCRIPTIONS = {
    "denoise": "smooth random fields under Poisson shot noise (the EMDenoise task)",
    "clouds": "smooth multi-channel fields, mask from a hidden threshold rule (the SLSTRCloud task)",
    "optics": "beam-profile images with small bright defects (the OpticalDamage task)",
}


def build(
    sig: Signature,
    name: str,
    seed: int = 0,
    train_size: int | None = None,
    test_size: int | None = None,
) -> TaskData:
    """The synthetic set ``name`` at the model's image shape. The task's hidden rule,
    the train split and the test split come from three generators seeded from ``seed``,
    so changing one split's size never changes the other split or the rule."""
    task = TASKS[name]
    check(sig, name, task)
    default_train, default_test = DEFAULT_SIZES[name]
    make = GENERATORS[name]

    def generator(stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(3 * seed + stream)

    train = make(train_size or default_train, sig.input_shape, generator(1), generator(0))
    test = make(test_size or default_test, sig.input_shape, generator(2), generator(0))
    channels, height, width = sig.input_shape
    return TaskData(
        name=name,
        task=task,
        synthetic=True,
        description=(
            f"synthetic '{name}' (seed {seed}): {DESCRIPTIONS[name]}, {channels}x{height}x{width}, "
            f"{len(train)} train / {len(test)} test"
        ),
        train=train,
        test=test,
    )
