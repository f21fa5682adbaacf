"""Affine per-group integer quantisation to 8, 4 or 2 bits, codes packed into bytes."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import (
    Compressor,
    ParamSpec,
    pack_codes,
    packed_code_bytes,
    prod,
    unpack_codes,
    work_dtype,
)

__all__ = ["Quant"]


class Quant(Compressor):
    """Affine quantisation with one (min, scale) pair per group.

    Groups: ``group_size=None`` makes one group per channel of each sample for inputs of rank
    >= 3 ([N, C, ...]) and one group per sample for rank 1-2 inputs; an int makes groups of that
    many consecutive elements of each flattened sample (the last group padded by repeating the
    sample's last element, which changes no min/max). Per group: mn = amin, mx = amax,
    scale = (mx - mn) / (2**bits - 1), code = round((x - mn) / scale) in [0, 2**bits - 1]
    (``stochastic``: floor(v + U[0, 1)), unbiased, using torch's global RNG);
    x_hat = mn + code * scale. Error per element: <= scale / 2 (nearest), < scale (stochastic).

    Packed form: (codes uint8 [N, ceil(M * bits / 8)], mn [N, G], scale [N, G]) where M is the
    per-sample element count and G the groups per sample; mn and scale are float32 (float64 for
    float64 inputs). Work is done in float32 (float64 for float64 inputs).

    Constant groups (mx == mn, all-zero tensors included) decompress exactly. Huge finite
    values (up to the dtype's max) never overflow: when mx - mn could exceed the dtype's range,
    the group is computed on halved values.

    Non-finite input: a NaN, +inf or -inf anywhere in a group makes the group's scale NaN or
    inf, and then EVERY element of that group decompresses to NaN; no group with a non-finite
    input ever decompresses to finite values. Other groups are unaffected.
    """

    name: ClassVar[str] = "quant"
    lossless: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, ParamSpec]] = {
        "bits": ParamSpec(int, 8, "bits per code", choices=(8, 4, 2)),
        "group_size": ParamSpec(
            int,
            None,
            "elements per (min, scale) group; None = one channel of one sample (rank >= 3) "
            "or one sample (rank <= 2)",
            min=1,
            optional=True,
        ),
        "stochastic": ParamSpec(
            bool, False, "unbiased stochastic rounding instead of round-to-nearest"
        ),
    }

    # layout ------------------------------------------------------------------------------

    def layout(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """(N, M, group, groups) for a full shape: M elements per sample, ``groups`` groups of
        ``group`` elements each per sample (groups * group >= M)."""
        if len(shape) < 1:
            raise ValueError(f"{self!r}: expected a batch dimension, got shape {tuple(shape)}")
        n = shape[0]
        m = prod(tuple(shape[1:]))
        if m == 0:
            raise ValueError(f"{self!r}: empty samples (shape {tuple(shape)}) are not supported")
        gs = self.params["group_size"]
        if gs is None:
            g = prod(tuple(shape[2:])) if len(shape) >= 3 else m
        else:
            g = min(gs, m)
        return n, m, g, -(-m // g)

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        self._float_dtype(dtype)
        n, m, _, groups = self.layout(tuple(shape))
        side = torch.empty((), dtype=work_dtype(dtype)).element_size()
        return n * (packed_code_bytes(m, self.params["bits"]) + 2 * groups * side)

    # compress ----------------------------------------------------------------------------

    def compress(self, t: Tensor) -> tuple[Tensor, ...]:
        self._float_input(t)
        n, m, g, groups = self.layout(tuple(t.shape))
        bits = self.params["bits"]
        levels = float((1 << bits) - 1)
        wd = work_dtype(t.dtype)
        big_range = torch.finfo(wd).max * 0.25
        x = t.reshape(n, m).to(wd)
        if groups * g != m:  # pad the last group with copies of the last element
            x = torch.cat([x, x[:, m - 1 : m].expand(n, groups * g - m)], dim=1)
        x = x.reshape(n, groups, g)
        mn = torch.amin(x, dim=-1, keepdim=True)  # NaN propagates
        mx = torch.amax(x, dim=-1, keepdim=True)
        # s = 1/2 for groups whose range mx - mn might not fit the dtype, else 1 (exact).
        half = torch.full_like(mn, 0.5)
        s = torch.where(mx * 0.5 - mn * 0.5 > big_range, half, torch.ones_like(mn))
        scale = (mx * s - mn * s) / levels / s
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: v = 0
        v = (x * s - mn * s) / (safe * s)
        if self.params["stochastic"]:
            v = torch.floor(v + torch.rand_like(v))
        else:
            v = torch.round(v)
        v = torch.clamp(v, 0.0, levels)
        v = torch.where(torch.isnan(v), torch.zeros_like(v), v)  # defined cast; scale is NaN
        codes = v.to(torch.int32).reshape(n, groups * g)[:, :m]
        return (
            pack_codes(codes, bits),
            mn.reshape(n, groups),
            scale.reshape(n, groups),
        )

    # decompress --------------------------------------------------------------------------

    def decompress(
        self, packed: tuple[Tensor, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        self._float_dtype(dtype)
        if len(packed) != 3:
            raise ValueError(f"{self!r}: expected packed (codes, mn, scale), got {len(packed)}")
        codes, mn, scale = packed
        n = codes.shape[0]
        full = (n, *shape)
        _, m, g, groups = self.layout(full)
        bits = self.params["bits"]
        levels = float((1 << bits) - 1)
        wd = work_dtype(dtype)
        fmax = torch.finfo(wd).max
        q = unpack_codes(codes, bits, m).to(wd)
        if groups * g != m:
            q = torch.nn.functional.pad(q, (0, groups * g - m))
        q = q.reshape(n, groups, g)
        mn = mn.to(wd).reshape(n, groups, 1)
        scale = scale.to(wd).reshape(n, groups, 1)
        # Halve the terms where mn + q * scale might overflow on the way (inexact only for
        # values that are huge anyway); clamp catches a last rounding step past the max.
        half = torch.full_like(scale, 0.5)
        s = torch.where(scale > fmax / (2.0 * levels), half, torch.ones_like(scale))
        x = torch.clamp((mn * s + q * (scale * s)) / s, -fmax, fmax)
        # scale - scale is 0 for finite groups and NaN where the group held NaN or +-inf.
        x = x + (scale - scale)
        x = x.reshape(n, groups * g)[:, :m].reshape(full)
        return x.to(dtype).contiguous()
