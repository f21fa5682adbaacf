"""Lossless 1-bit packing of boolean masks (e.g. ReLU or max-pool masks saved for backward)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import (
    Compressor,
    ParamSpec,
    pack_codes,
    pack_codes_compiled,
    pack_codes_fast,
    packed_code_bytes,
    prod,
    unpack_codes,
    unpack_codes_compiled,
    unpack_codes_fast,
    use_compiled_path,
    use_fast_path,
)

__all__ = ["Bits"]


class Bits(Compressor):
    """Packs a bool tensor [N, ...] into uint8 [N, ceil(M / 8)] (M = elements per sample),
    8 values per byte, element i of a byte in bit i; each sample is zero-padded to a multiple
    of 8. Lossless. Only bool input is accepted (ValueError otherwise): a mask is expected,
    and silently treating nonzero floats as True would hide a wiring mistake. Zero-size
    inputs (N = 0 or an empty sample) round-trip on both paths.
    """

    name: ClassVar[str] = "bits"
    flops: ClassVar[float] = 2.0  # a bit per element each way: a compare, a shift
    lossless: ClassVar[bool] = True
    PARAMS: ClassVar[dict[str, ParamSpec]] = {}

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if dtype != torch.bool:
            raise ValueError(f"{self!r}: expects a torch.bool mask, got dtype {dtype}")

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.bool) -> int:
        self._check_dtype(dtype)
        if len(shape) < 1:
            raise ValueError(f"{self!r}: expected a batch dimension, got shape {tuple(shape)}")
        return shape[0] * packed_code_bytes(prod(tuple(shape[1:])), 1)

    def compress(self, t: Tensor) -> tuple[Tensor, ...]:
        if not isinstance(t, Tensor):
            raise ValueError(f"{self!r}: expected a torch.Tensor, got {type(t).__name__}")
        self._check_dtype(t.dtype)
        if t.dim() < 1:
            raise ValueError(f"{self!r}: expected a batch dimension, got a 0-d tensor")
        n = t.shape[0]
        flat = t.reshape(n, prod(tuple(t.shape[1:])))
        if use_compiled_path(t):
            return (pack_codes_compiled(flat, 1),)
        if use_fast_path(t):
            return (pack_codes_fast(flat, 1),)
        return (pack_codes(flat, 1),)

    def decompress(
        self, packed: tuple[Tensor, ...], shape: tuple[int, ...], dtype: torch.dtype = torch.bool
    ) -> Tensor:
        if len(packed) != 1:
            raise ValueError(f"{self!r}: expected packed (bits,), got {len(packed)} tensors")
        (p,) = packed
        n = p.shape[0]
        if use_compiled_path(p):  # != 0 rather than a view as bool: that one fuses
            mask = unpack_codes_compiled(p, 1, prod(tuple(shape))).reshape(n, *shape) != 0
            return mask if dtype == torch.bool else mask.to(dtype)
        if use_fast_path(p):
            mask = unpack_codes_fast(p, 1, prod(tuple(shape))).view(torch.bool)
            mask = mask.reshape(n, *shape).contiguous()
            return mask if dtype == torch.bool else mask.to(dtype)
        codes = unpack_codes(p, 1, prod(tuple(shape)))
        mask = codes.reshape(n, *shape) != 0
        return mask if dtype == torch.bool else mask.to(dtype)
