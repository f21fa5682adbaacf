"""Kernels of the shape and tensor ops of spec v2 that are the same on both platforms.

expand, transpose, permute, select, slice, matmul, the softmax forwards, mean, sum and pad
need no platform-specific code: their gradients are views, copies, sums or products, which
PopTorch runs (views and constant-bound slices are resolved before the IPU). Both
``unroller.runtime.gpu`` and ``unroller.runtime.ipu`` import them from here; the backwards
of softmax and log_softmax differ (gpu calls aten's, ipu writes the formula) and live there.

They sit in a module of their own because two kernels are named like Python builtins
(``sum``, ``slice``): defined in ``common``, they would shadow the builtins that its stash
accounting calls. In gpu.py and ipu.py they shadow them too, so neither calls a bare
``sum(...)`` or ``slice(...)`` (tests/operators/test_shapeops.py checks this).

The batch dim is dim 0 of every batched tensor and the shape rules hand these kernels
normalised dims (never 0 of a batched tensor). An input without the batch dim (a free parameter) reaches only
expand and matmul, whose backwards sum the gradient down to that input's own shape, as
autograd's ``sum_to`` does; and select (``gammas[i]``), whose backward tells the two
apart by rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from unroller.runtime.common import _STEP, Grads, Needs, _exports, _need

BATCH = "N"  # shapes.BATCH: the batch symbol in expand's size and input_shape


def _sum_to(g: Tensor, shape: tuple[int, ...]) -> Tensor:
    """g summed down to ``shape`` (leading dims dropped, broadcast dims of size 1 kept), as
    at::sum_to, which autograd uses for every broadcast: the same sums in the same order."""
    lead = g.dim() - len(shape)
    dims = list(range(lead)) + [
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1
    ]
    if dims:  # sum over no dims would be a sum over all
        g = g.sum(dims, keepdim=True)
    return g.reshape(shape) if lead else g


def _resolve(shape: tuple, batch: int) -> tuple[int, ...]:
    return tuple(batch if d == BATCH else d for d in shape)


# ---------------------------------------------------------------- expand


def expand(x: Tensor, *, size: tuple) -> Tensor:
    """Tensor.expand. An N in size (only first, and only for an input without the batch
    dim: a batched input gets -1 there) is the batch size of the step's inputs, which
    ``check_inputs`` records at the entry of every step and prediction."""
    if size[0] == BATCH:
        batch = getattr(_STEP, "batch", None)
        if batch is None:
            raise RuntimeError("expand(size=(N, ...)): no batch size recorded (check_inputs)")
        size = (batch, *size[1:])
    return x.expand(*size)


def expand_backward(g: Tensor, *, input_shape: tuple, needs: Needs | None = None) -> Grads:
    """g summed to the input's shape (N in it is g's batch size); g itself when nothing
    was broadcast."""
    if not _need(needs, 0):
        return (None,)
    return (_sum_to(g, _resolve(input_shape, g.shape[0])),)


# ---------------------------------------------------------------- transpose and permute


def transpose(x: Tensor, *, dim0: int, dim1: int) -> Tensor:
    """torch.transpose (a view); saves nothing."""
    return x.transpose(dim0, dim1)


def transpose_backward(g: Tensor, *, dim0: int, dim1: int, needs: Needs | None = None) -> Grads:
    """The same swap of g (autograd's transpose backward)."""
    return (g.transpose(dim0, dim1) if _need(needs, 0) else None,)


def permute(x: Tensor, *, dims: tuple[int, ...]) -> Tensor:
    """Tensor.permute (a view); saves nothing."""
    return x.permute(*dims)


def permute_backward(g: Tensor, *, inverse: tuple[int, ...], needs: Needs | None = None) -> Grads:
    """g permuted back by the inverse permutation (autograd's permute_backwards)."""
    return (g.permute(*inverse) if _need(needs, 0) else None,)


# ---------------------------------------------------------------- select and slice


def select(x: Tensor, *, dim: int, index: int) -> Tensor:
    """x.narrow(dim, index, 1) without that dim (views: Tensor.select is not on PopTorch's
    list); saves nothing."""
    return x.narrow(dim, index, 1).squeeze(dim)


def select_backward(
    g: Tensor,
    *,
    dim: int,
    index: int,
    input_shape: tuple[int, ...],
    needs: Needs | None = None,
) -> Grads:
    """g put back at ``index`` between zeros (torch.cat: no index_put on the IPU); the
    values of aten's select_backward (a copy into zeros) bit for bit."""
    if not _need(needs, 0):
        return (None,)
    # input_shape leaves N out of a batched input (g has its rank), not a free parameter's
    size = input_shape[dim - 1] if g.dim() == len(input_shape) else input_shape[dim]
    parts = [g.unsqueeze(dim)]
    if index:
        parts.insert(0, _zeros_like_along(g, dim, index))
    if size - index - 1:
        parts.append(_zeros_like_along(g, dim, size - index - 1))
    return (torch.cat(parts, dim) if len(parts) > 1 else parts[0],)


def _zeros_like_along(g: Tensor, dim: int, n: int) -> Tensor:
    """Zeros shaped like g with n at ``dim`` inserted (g lacks that dim: select's gradient)."""
    shape = list(g.shape)
    shape.insert(dim, n)
    return g.new_zeros(shape)


def slice(x: Tensor, *, dim: int, start: int = 0, end: int | None = None, step: int = 1) -> Tensor:
    """x[..., start:end:step] along dim, a view with constant bounds (moving dim last with a
    transpose view so that the slice is written as syntax); saves nothing."""
    last = x.transpose(dim, -1)
    return last[..., start:end:step].transpose(dim, -1)


def slice_backward(
    g: Tensor,
    *,
    dim: int,
    start: int = 0,
    end: int | None = None,
    step: int = 1,
    input_shape: tuple[int, ...],
    needs: Needs | None = None,
) -> Grads:
    """g spread back into zeros of the input's shape (aten's slice_backward's values): with
    step > 1 each element of g gets step - 1 zeros after it (a cat and a reshape), then zeros
    before start and after the last element taken (cats), all constant sizes."""
    if not _need(needs, 0):
        return (None,)
    size = input_shape[dim - 1]
    end = size if end is None else end
    count = g.shape[dim]
    spread = g
    if step > 1:
        gap = list(g.shape)
        gap.insert(dim + 1, step - 1)
        parts = [g.unsqueeze(dim + 1), g.new_zeros(gap)]
        wide = list(g.shape)
        wide[dim] = count * step
        spread = torch.cat(parts, dim + 1).reshape(wide).narrow(dim, 0, (count - 1) * step + 1)
    parts = [spread]
    before, after = start, size - start - spread.shape[dim]
    if before:
        parts.insert(0, _zeros_at(g, dim, before))
    if after:
        parts.append(_zeros_at(g, dim, after))
    return (torch.cat(parts, dim) if len(parts) > 1 else spread,)


def _zeros_at(g: Tensor, dim: int, n: int) -> Tensor:
    """Zeros shaped like g with size n at ``dim``."""
    shape = list(g.shape)
    shape[dim] = n
    return g.new_zeros(shape)


# ---------------------------------------------------------------- matmul


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul; the backward reads both factors."""
    return torch.matmul(a, b)


def matmul_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: Needs | None = None) -> Grads:
    """ga = g @ b^T and gb = a^T @ g, each summed down to its factor's shape (a factor
    without the batch dim, or broadcast, gets the sum over what it was broadcast to).
    Where torch.matmul folds the batch into matrix rows (x @ W with a 2-D W, or one with
    batch dims all 1; W @ x with a 2-D W, through transposes), the gradient of the
    unbatched factor is the same folded product, so the sums run in autograd's order."""
    ga = gb = None
    if a.dim() == 2 and b.dim() > 2:  # W @ x: matmul computes (x^T @ W^T)^T, folded
        if _need(needs, 0):
            bt, gt = b.transpose(-1, -2), g.transpose(-1, -2)
            # W^T is column-major, so mm's backward takes this product's order for it
            ga = gt.reshape(-1, gt.shape[-1]).t().matmul(bt.reshape(-1, bt.shape[-1]))
        if _need(needs, 1):
            gb = g.transpose(-1, -2).matmul(a).transpose(-1, -2)
        return (ga, gb)
    if _need(needs, 0):
        ga = _sum_to(g.matmul(b.transpose(-1, -2)), tuple(a.shape))
    if _need(needs, 1):
        if a.dim() >= b.dim() and math.prod(b.shape[:-2]) == 1:  # x @ W: folded rows
            gb = a.reshape(-1, a.shape[-1]).t().matmul(g.reshape(-1, g.shape[-1]))
            gb = gb.reshape(b.shape)
        else:
            gb = _sum_to(a.transpose(-1, -2).matmul(g), tuple(b.shape))
    return (ga, gb)


# ---------------------------------------------------------------- softmax forwards


def softmax(x: Tensor, *, dim: int = -1) -> Tensor:
    """torch.softmax; the backward reads the output (an activation)."""
    return torch.nn.functional.softmax(x, dim)


def log_softmax(x: Tensor, *, dim: int = -1) -> Tensor:
    """torch.log_softmax; the backward reads the output (an activation)."""
    return torch.nn.functional.log_softmax(x, dim)


# ---------------------------------------------------------------- reductions


def sum(x: Tensor, *, dim: tuple[int, ...], keepdim: bool = False) -> Tensor:  # noqa: A001
    """torch.sum over dims (never N's); saves nothing."""
    return x.sum(dim, keepdim=keepdim)


def _spread(g: Tensor, dim: tuple[int, ...], keepdim: bool, input_shape: tuple) -> Tensor:
    """g broadcast back over the reduced dims (autograd's sum_backward: unsqueeze the
    dims in increasing order, expand)."""
    if not keepdim:
        for d in sorted(dim):
            g = g.unsqueeze(d)
    return g.expand(g.shape[0], *input_shape)


def sum_backward(
    g: Tensor,
    *,
    dim: tuple[int, ...],
    keepdim: bool = False,
    input_shape: tuple[int, ...],
    needs: Needs | None = None,
) -> Grads:
    """g expanded over the summed dims (a view of g, as autograd's)."""
    return (_spread(g, dim, keepdim, input_shape) if _need(needs, 0) else None,)


def mean(x: Tensor, *, dim: tuple[int, ...], keepdim: bool = False) -> Tensor:
    """torch.mean over dims (never N's); saves nothing."""
    return x.mean(dim, keepdim=keepdim)


def mean_backward(
    g: Tensor,
    *,
    dim: tuple[int, ...],
    keepdim: bool = False,
    input_shape: tuple[int, ...],
    needs: Needs | None = None,
) -> Grads:
    """sum's gradient divided by the count averaged over (autograd's mean_backward)."""
    if not _need(needs, 0):
        return (None,)
    count = math.prod(input_shape[d - 1] for d in dim)
    return (_spread(g, dim, keepdim, input_shape) / count,)


# ---------------------------------------------------------------- pad


def pad(x: Tensor, *, pad: tuple[int, ...], mode: str = "constant", value: float = 0.0) -> Tensor:
    """F.pad with a constant (widths >= 0, the last dims only); saves nothing."""
    return torch.nn.functional.pad(x, pad, mode, value)


def pad_backward(g: Tensor, *, pad: tuple[int, ...], needs: Needs | None = None) -> Grads:
    """The padded border cut off g (constant-bound narrow views): constant_pad_nd's
    gradient, whose values are g's inside the border."""
    if not _need(needs, 0):
        return (None,)
    for i in range(len(pad) // 2):
        dim = g.dim() - 1 - i
        left, right = pad[2 * i], pad[2 * i + 1]
        g = g.narrow(dim, left, g.shape[dim] - left - right)
    return (g,)


#: The kernels both platforms take from here (through ``unroller.runtime.shared``).
__all__ = _exports(globals())
