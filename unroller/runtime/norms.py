"""Normalisation kernels that are the same on both platforms: ``rmsnorm``.

RMSNorm (torch.nn.RMSNorm, the Llama family's norm) is written with the ops both platforms
run (pow, mean, rsqrt, mul, sum, expand; PopTorch has all of them), so
``unroller.runtime.gpu`` and ``unroller.runtime.ipu`` import it from here. The forward is
F.rms_norm's composite (float32 / float64): rstd = rsqrt(mean(x**2) + eps), y = x * rstd *
weight. The backward replays the steps autograd takes through that composite (the two
products' gradients with their broadcast sums, rsqrt's -0.5 * g * rstd**3, mean's expand /
count, pow's g * (2 * x), the two x terms added), so on the CPU it gives autograd's bits.
It reads x, which a compressor may replace, and the saved per-row rstd, which stays exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from unroller.runtime.common import Grads, Needs, _exports, _fit, _need
from unroller.runtime.shapeops import _sum_to


def _dims(x: Tensor, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(normalised trailing dims, leading dims) of x."""
    split = x.dim() - count
    return tuple(range(split, x.dim())), tuple(range(split))


def _eps(x: Tensor, eps: float | None) -> float:
    """eps, or as torch.nn.RMSNorm leaves it (None): the dtype's machine epsilon."""
    return torch.finfo(x.dtype).eps if eps is None else eps


def rmsnorm(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    normalized_shape: tuple[int, ...],
    eps: float | None = None,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """As F.rms_norm: rstd = rsqrt(mean(x**2) + eps) over the trailing dims (kept as 1s),
    y = x * rstd (* weight); returns (y, rstd)."""
    weight = getattr(layer, "weight", None)
    dims, _ = _dims(x, len(normalized_shape))
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + _eps(x, eps))
    y = x * rstd
    if weight is not None:
        y = y * _scale(weight, weight_offset)
    return y, rstd


def _scale(weight: Tensor, offset: float) -> Tensor:
    """What the norm is multiplied by: the weight, or weight + offset (Gemma's 1 + w)."""
    return weight if not offset else offset + weight


def rmsnorm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    rstd: Tensor,
    *,
    normalized_shape: tuple[int, ...],
    weight_offset: float = 0.0,
    needs: Needs | None = None,
) -> Grads:
    """(gx, gW), autograd's steps (module doc); the offset's gradient passes straight on."""
    weight = getattr(layer, "weight", None)
    dims, _ = _dims(x, len(normalized_shape))
    gx = gw = None
    if _need(needs, 1) and weight is not None:
        gw = _sum_to(g * (x * rstd), tuple(weight.shape))  # y = (x * rstd) * weight
    if _need(needs, 0):
        gt = g if weight is None else g * _scale(weight, weight_offset)
        g_rstd = _sum_to(gt * x, tuple(rstd.shape))  # x * rstd, rstd broadcast over dims
        g_mean = (-0.5 * g_rstd) * rstd.pow(3)  # rsqrt; the + eps passes it on
        count = 1
        for d in dims:
            count *= x.shape[d]
        g_square = g_mean.expand(x.shape) / count  # mean over dims
        gx = gt * rstd + g_square * (2.0 * x)  # both uses of x: the product and pow(x, 2)
    return _fit((gx, gw), needs)


#: The kernels both platforms take from here (through ``unroller.runtime.shared``).
__all__ = _exports(globals())
