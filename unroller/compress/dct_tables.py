"""The DCT+Chop codec's tables: its storage dtypes, block limits, the DCT matrices, the
fold order of a kept corner and the one-tile transform, each built once per arguments
(``cached_constant``) and shared by every formulation of the codec (``unroller.compress.dct``
and its host paths, ``unroller.compress.dct_host``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import cached_constant, float_constant_compiled, is_compiling

_STORAGE_DTYPES = {
    "int8": torch.int8,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
}


MAX_BLOCK = 64
"""Largest ``block`` (and so ``keep``): the tiles of one plane are padded to multiples of it."""

ONE_TILE_MAX_BLOCK = 8
"""Largest ``block`` whose single-tile planes go through ``tile_matrix`` (a [64, kept] table
at most); larger blocks keep the separable form on every plane."""


def dct_matrix(
    block: int, keep: int, dtype: torch.dtype, device: torch.device | str, exponent: int = 0
) -> Tensor:
    """The first ``keep`` rows of the orthonormal DCT-II matrix of size ``block`` (keep x block),
    times ``2**exponent``.

    T[0, j] = 1/sqrt(block); T[i, j] = sqrt(2/block) cos((2j+1) i pi / (2 block)). Computed
    in float64 on the host (Python's math, so that under torch.compile, where it is a
    constant of the graph, the values are the same), then cast and moved; cached per
    (block, keep, dtype, device, exponent). Multiplying by a power of two is exact, so a product with the scaled
    matrix is the product with T scaled exactly (barring underflow to subnormals)."""
    device = torch.device(device)
    if is_compiling():  # one constant in the graph, no guard on the cache
        return float_constant_compiled(_dct_rows(block, keep, exponent), dtype, device)

    def build() -> Tensor:
        rows = _dct_rows(block, keep, exponent)
        full = [[torch.full((), v, dtype=torch.float64, device=device) for v in r] for r in rows]
        return torch.stack([torch.stack(r) for r in full]).to(dtype)

    return cached_constant(("dct", block, keep, dtype, device, exponent), build)


def _dct_rows(block: int, keep: int, exponent: int) -> list[list[float]]:
    """The first ``keep`` rows of the DCT-II matrix of size ``block`` times 2**exponent, as
    Python floats (float64), in the operation order of the former tensor build."""
    factor = 2.0**exponent
    step = math.pi / (2 * block)
    norm = math.sqrt(2.0 / block)
    rows = [[1.0 / math.sqrt(block) * factor] * block]
    for i in range(1, keep):
        rows.append([math.cos((2 * j + 1) * i * step) * norm * factor for j in range(block)])
    return rows[:keep]


def prescale_exponent(block: int) -> int:
    """e = ceil(log2(block)): coefficients are stored divided by 2**e >= block, so that none
    exceeds the largest |input| of its tile (|T B T^T|_ij <= block * max|B|)."""
    return (block - 1).bit_length()


def fold_index(keep: int, device: torch.device | str) -> Tensor:
    """int64 positions ``i * keep + j`` with ``i + j < keep`` in a flattened keep x keep corner,
    in row-major order: keep * (keep + 1) / 2 of them."""
    device = torch.device(device)

    def build() -> Tensor:
        idx = [i * keep + j for i in range(keep) for j in range(keep) if i + j < keep]
        return torch.stack([torch.full((), i, dtype=torch.int64, device=device) for i in idx])

    return cached_constant(("dct_fold", keep, device), build)


def tile_matrix(
    block: int, keep: int, fold: bool, dtype: torch.dtype, device: torch.device | str, inverse: bool
) -> Tensor:
    """The 2-D transform of a whole tile as one matrix, so that every tile of a tensor goes
    through one matrix product (a tile a row of block * block values, p * block + q).

    Forward (``inverse`` False): [block**2, kept], column (i, j) holding T[i, p] T[j, q] /
    2**e: a tile row times it gives the kept coefficients (Tk B Tk^T) / 2**e, all keep x keep
    of them in row-major order, or with ``fold`` those with i + j < keep in ``fold_index``
    order. Inverse: [kept, block**2], row (i, j) holding T[i, p] T[j, q] * 2**e: coefficient
    rows times it give the tiles Tk^T C Tk * 2**e. The products are taken in float64 on the
    host (Python floats, as ``dct_matrix``) and cast once; cached per arguments.

    Used where every plane is one tile (H, W <= block: ResNet-34's 8 x 8 maps at 32 x 32
    input), whose rows are then a view of the input: one product of [N*C, block**2] by
    [block**2, kept], where the separable form (two products with the keep x block rows)
    broadcasts a small matrix over every plane, a batched product of thousands of tiny
    matrices (3x slower at batch 32; larger maps keep the separable form, whose tiles would
    need a permuted copy)."""
    device = torch.device(device)
    e = prescale_exponent(block)
    left = _dct_rows(block, keep, e if inverse else -e)
    right = _dct_rows(block, keep, 0)
    if inverse:
        left, right = right, left  # T[i, p] * (T * 2**e)[j, q]
    pairs = [(i, j) for i in range(keep) for j in range(keep) if not fold or i + j < keep]
    rows = [
        [left[i][p] * right[j][q] for p in range(block) for q in range(block)] for i, j in pairs
    ]
    if is_compiling():
        table = float_constant_compiled(rows, dtype, device)
        return table if inverse else table.t()

    def build() -> Tensor:  # as dct_matrix builds its rows: ops PopTorch has
        full = [[torch.full((), v, dtype=torch.float64, device=device) for v in r] for r in rows]
        table = torch.stack([torch.stack(r) for r in full]).to(dtype)
        return table if inverse else table.t().contiguous()

    return cached_constant(("dct_tile", block, keep, fold, dtype, device, inverse), build)
