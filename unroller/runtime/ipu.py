"""Forward and backward kernels of the ``ipu`` platform (PopTorch, Graphcore's PyTorch).

Same calling convention as ``unroller.runtime.gpu`` (described in ``unroller.runtime.common``:
layer handles in place of parameter tensors, registry defaults as keyword defaults, one
gradient per input then per parameter, ``None`` where ``needs`` is False, nothing unneeded
computed). The kernels whose code is the same on both platforms (linear, relu, sigmoid, tanh,
add, mul, concat, flatten, reshape, l1_loss's forward, the mask kernels of relu and
leaky_relu, dropout_eval, the shape ops, rmsnorm, rotary, lstm, gru) and the helpers
generated code calls come from ``unroller.runtime.shared``, in one star import; this module
defines only what PopTorch needs done differently (each under ``@conventions.implements``:
its parameters and defaults are ``unroller.runtime.conventions``' stub, written once for
both platforms; the kernels made from these, the 1-D pools and more, come from
``unroller.runtime.derived``), and ``collect`` (not ``accumulate``) hands parameter
gradients to PopTorch. Under ``--precision fp16-mixed`` / ``fp16`` the backward starts from
``loss_seed`` (PopTorch's loss scaling) and a half model's inputs go through ``floats_in``;
the casts are the shared ``cast`` kernels and the cast cache (``L.cast``).

Every kernel uses only operations PopTorch runs on the IPU (see PopTorch's list of supported
operations): no aten backward kernels, no autograd, no max-pool indices, no bilinear
upsampling op, no dilated transposed convolution, no erf, no data-dependent shapes. Every
gradient is written out:

* conv2d: input gradient = conv_transpose2d of g with the same weight and the output_padding
  that restores the input size; weight gradient = a grouped conv2d of the input (batch and
  channels swapped) with g as the kernel, stride and dilation swapped, cropped to the kernel.
  With dilation > 1 (PopTorch's ConvTranspose has none) the input gradient is a plain dilated
  conv2d instead: g with stride - 1 zeros inserted between its elements (stacked with zeros
  and reshaped), its edges padded by (k - 1) * dilation - padding (cropped where negative)
  and fitted to the input size (zeros for rows the forward never read), against the kernel
  flipped (index_select) with its in / out channels swapped per group.
* conv_transpose2d: forward conv_transpose2d, or with dilation > 1 the same plain conv2d as
  conv2d's dilated input gradient (plus the bias); input gradient = conv2d of g;
  weight gradient by the same convolution as conv2d's, with g and x in swapped roles.
* batchnorm2d: written out (mean, biased var, rsqrt; running stats updated in place with the
  unbiased var, as nn.BatchNorm2d.train()); backward by the closed-form batch-norm gradient.
* maxpool2d: no indices. The "indices" extra is a bool selection tensor
  ``sel[N, C, kh*kw, Ho, Wo]``: offset q = (i, j) of a window is selected when its value equals
  the window's maximum and no earlier offset (row-major) of that window does, which is PyTorch's
  tie rule (the first maximum wins). The gradient is conv_transpose2d of the stacked
  ``where(sel, g, 0)`` with a one-hot kernel bank (groups = C, stride s, padding p): exactly
  PyTorch's, ties and overlapping windows included.
* avgpool2d: conv_transpose2d of g / (kh*kw) with an all-ones kernel per channel.
* adaptive_avgpool2d and upsample: matmuls with averaging / interpolation matrices built from
  the static sizes with PyTorch's index rules (float32 source index for nearest, PyTorch's
  source-index and lambda rule for bilinear); backward with the transposed matrices.
* gelu(approximate="none"): forward F.gelu; backward Phi(x) + x * phi(x), with
  phi = exp(-x^2/2)/sqrt(2 pi) and Phi(x) = gelu(x)/x for |x| >= 0.1 and its Taylor series
  (to x^11, truncation < 1e-19) below. Accuracy in float64, against torch.autograd over
  [-40, 40] (0, +-1e-300 and both sides of the switch included): norm-relative error ~6e-17
  (tested <= 1e-14); per element |error| ~5e-16 * |g| * (|Phi(x)| + |x phi(x)|) (tested
  <= 4e-15); the series branch is within 2.3e-16 relative of the exact Phi (tested <= 1e-15).
  (For x < -3, gelu(x)/x inherits the cancellation in 1 + erf(x/sqrt 2) that PyTorch's own
  forward and backward share, so it matches PyTorch, not the exact Phi, there.)
* maxpool2d NaN: a window whose maximum is NaN selects nothing (gradient 0 there), where
  PyTorch routes the gradient to the window's last NaN. All finite / infinite inputs match.
* dropout draws from torch.rand, a different stream from the gpu kernel's.
* v2: relu6 / hardtanh / hardsigmoid / hardswish / silu / mish / elu / softplus gradients are
  aten's formulas written out; cross_entropy and nll_loss take [N, C, d1, ...] with targets
  [N, d1, ...] (one-hot by comparison with arange(C), label smoothing in closed form:
  (softmax - (1 - ls) one_hot - ls / C) * g / count); embedding's weight gradient is a
  scatter_add of g's rows into a zero table (PopTorch has no embedding backward to call).
* layernorm, groupnorm: written out (biased var, rsqrt), backward by the closed form
  rstd * (gy - mean(gy) - xhat * mean(gy * xhat)); conv1d, batchnorm1d and the 1-D pools are
  the 2-D kernels on [N, C, 1, L] views. Ceil-mode pools pad the overhanging last window with
  NaN (max) and crop what the transposed convolution puts past the input's end.

The interpolation / averaging matrices and kernel banks depend only on static sizes; on CPU
and CUDA they are cached, on other devices (the IPU's traced graph) rebuilt per call, so no
tensor of one traced graph is reused in another.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from unroller.runtime import conventions, derived
from unroller.runtime.attention import scaled_dot_product_attention as _sdpa_blocks
from unroller.runtime.attention import (
    scaled_dot_product_attention_backward as _sdpa_blocks_backward,
)

# What this module's own code uses of the shared modules.
from unroller.runtime.common import (
    _ONE_SIXTH_F32,
    Grads,
    Needs,
    Pair,
    _ceil_mode_of,
    _exports,
    _fit,
    _need,
    _norm_tensors,
    _running_stats_used,
    _weight_bias,
    _widened,
    hardsigmoid_mask,
    hardtanh_mask,
    linear,
    linear_backward,
)
from unroller.runtime.moe import moe_layer  # noqa: F401 (builds the layer; moe is refused)

# Every kernel and helper the two platforms share (see shared's doc), exported from here as
# ipu kernels (see __all__ at the end); the definitions below replace shared ones of the same
# name (``unsupported``). shapeops' sum and slice shadow the builtins here, so this module
# calls neither bare.
from unroller.runtime.shared import *  # noqa: F403

# the clamp of (1 - p) * p in binary_cross_entropy's gradient: PyTorch's EPSILON, 1e-12 as a float32
_BCE_EPS = struct.unpack("f", struct.pack("f", 1e-12))[0]
_BCE_LOG_MIN = -100.0  # binary_cross_entropy clamps its logs at -100
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_KAPPA = 0.044715
_PHI_SERIES_BELOW = 0.1  # |x| below this: Phi(x) from its Taylor series, else gelu(x) / x
# Phi(x) = 1/2 + x/sqrt(2 pi) * sum_n (-1)^n x^(2n) / (2^n n! (2n+1)), n = 0..5
_PHI_SERIES = tuple((-1) ** n / (2**n * math.factorial(n) * (2 * n + 1)) for n in range(6))


# ---------------------------------------------------------------- small helpers


def _pair(v: Any) -> tuple:
    if isinstance(v, (tuple, list)):
        return (v[0], v[1]) if len(v) == 2 else (v[0], v[0])
    return (v, v)


def _zero(t: Tensor) -> Tensor:
    return t.new_zeros(())


# Constant tensors that depend only on static sizes: cached where tensors are eager ones.
_CACHE: dict[tuple, Tensor] = {}
_CACHE_LIMIT = 512
_CACHED_DEVICES = ("cpu", "cuda")


def _constant(key: tuple, device: torch.device, build: Callable[[], Tensor]) -> Tensor:
    if device.type not in _CACHED_DEVICES:
        return build()
    full = (*key, str(device))
    t = _CACHE.get(full)
    if t is None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        t = _CACHE[full] = build()
    return t


def unsupported(op_name: str, args: Mapping[str, Any]) -> str | None:
    """Why a node with these args cannot run on the IPU platform, or None when it can."""
    if op_name == "aten":  # the importer's opaque ATen call (unroller.runtime.opaque)
        return _opaque_refusal(args)
    if op_name == "scaled_dot_product_attention" and float(args.get("dropout", 0.0)) > 0:
        return (
            "attention dropout is not supported on the ipu platform: its mask is drawn from "
            "a seeded generator, which PopTorch's random ops do not take (use dropout=0.0)"
        )
    if op_name == "moe":
        return (
            "a mixture of experts (moe) is not supported on the ipu platform: its experts "
            "gather and scatter the rows routed to them, tensors of data-dependent sizes, "
            "which PopTorch does not run"
        )
    if op_name == "drop_path" and float(args.get("p", 0.0)) > 0:
        return (
            "stochastic depth (drop_path with p > 0) is not supported on the ipu platform: "
            "its per-sample mask is drawn from a seeded generator, which PopTorch's random "
            "ops do not take (use p=0.0)"
        )
    return None


Maybe = Tensor | None


def aten(
    t0: Maybe, t1: Maybe = None, t2: Maybe = None, t3: Maybe = None, t4: Maybe = None,
    t5: Maybe = None, t6: Maybe = None, t7: Maybe = None, *, op: str, call: str,
    output: int | None = None,
) -> tuple[Tensor, Maybe]:  # fmt: skip
    """The importer's opaque ATen call has no ipu formulation: ``unsupported`` refuses the
    statement when the module is generated, so this only says so if called by hand."""
    raise NotImplementedError(_opaque_refusal({"op": op}))


def aten_backward(
    g: Tensor, t0: Maybe, t1: Maybe = None, t2: Maybe = None, t3: Maybe = None,
    t4: Maybe = None, t5: Maybe = None, t6: Maybe = None, t7: Maybe = None,
    seed: Maybe = None, *, op: str, call: str, output: int | None = None,
    needs: Sequence[bool] | None = None,
) -> tuple[Maybe, ...]:  # fmt: skip
    """See ``aten``: refused at generate time."""
    raise NotImplementedError(_opaque_refusal({"op": op}))


def _opaque_refusal(args: Mapping[str, Any]) -> str:
    """Why an ``aten`` statement cannot run here: PopTorch runs only its own operations,
    traced into its graph, and the call's backward needs torch.autograd."""
    return (
        f"the opaque ATen call {str(args.get('op'))!r} is not supported on the ipu platform: "
        "PopTorch runs only its own operations, and this call's backward needs "
        "torch.autograd (map the op to a registry operator, or use --platform gpu)"
    )


@conventions.implements
def scaled_dot_product_attention(q, k, v, bias, *, is_causal, scale, enable_gqa, dropout):
    """unroller.runtime.attention's, block by block (the seed extra is None: no dropout)."""
    if dropout:
        raise NotImplementedError(unsupported("scaled_dot_product_attention", {"dropout": dropout}))
    out, lse = _sdpa_blocks(q, k, v, bias, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out, lse, None


@conventions.implements
def scaled_dot_product_attention_backward(
    g, q, k, v, output, lse, seed, bias, *, is_causal, scale, enable_gqa, dropout, needs
):
    """unroller.runtime.attention's backward (no dropout on this platform)."""
    if dropout:
        raise NotImplementedError(unsupported("scaled_dot_product_attention", {"dropout": dropout}))
    return _sdpa_blocks_backward(
        g,
        q,
        k,
        v,
        output,
        lse,
        bias,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        needs=needs,
    )


# ---------------------------------------------------------------- half precision


def loss_seed(loss: Tensor, scale: float = 1.0) -> Tensor:
    """d loss / d loss times PopTorch's loss scaling ``scale`` (``--precision fp16-mixed``,
    ``fp16``: the module's ``loss_scaling``, the value its optimizer is built with), what
    PopTorch seeds its own backward with, so that float16 gradients in the explicit backward
    do not underflow. ``ipu_device.surrogate`` hands the scaled gradients on divided by the
    same factor, which PopTorch's scaling multiplies back and its optimizer divides out.
    In the loss's dtype: a half model's seed above 65504 is already an overflow."""
    return torch.ones_like(loss) * scale


def floats_in(dtype: torch.dtype, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The inputs with the floating-point ones in ``dtype`` (a half model, ``--precision
    fp16``, takes float32 batches too), the others as they are."""
    return tuple(t.to(dtype) if t.dtype.is_floating_point else t for t in inputs)


# ---------------------------------------------------------------- convolutions


def _restore_padding(in_size: int, out_size: int, k_extent: int, s: int, p: int) -> int:
    """output_padding of the conv_transpose2d that maps a conv output back to ``in_size``."""
    return in_size + 2 * p - ((out_size - 1) * s + k_extent)


def _weight_grad(
    data: Tensor,
    filt: Tensor,
    kernel_hw: tuple[int, int],
    stride: Pair,
    dilation: Pair,
    padding: Pair,
    groups: int,
) -> Tensor:
    """sum over n, i, j of data_pad[n, g*Dc + d, a*stride + i*dilation, ...] * filt[n, g*Fc + f,
    i, j] as a weight [G*Fc, Dc, kh, kw]: a grouped conv2d with the batch as channels."""
    n, dch, dh, dw = data.shape
    fch, fh, fw = filt.shape[1:]
    dcg = dch // groups
    d = data.reshape(n, groups, dcg, dh, dw).permute(2, 1, 0, 3, 4).reshape(dcg, groups * n, dh, dw)
    f = filt.reshape(n, groups, fch // groups, fh, fw).permute(1, 2, 0, 3, 4)
    f = f.reshape(fch, n, fh, fw)
    out = F.conv2d(d, f, None, stride, padding, dilation, groups)
    return out.transpose(0, 1)[:, :, : kernel_hw[0], : kernel_hw[1]]


def _insert_zeros(t: Tensor, dim: int, s: int) -> Tensor:
    """t with s - 1 zeros after each element along ``dim`` (2 or 3): stacked with zeros and
    reshaped, as PopTorch has no strided write or dilated transposed convolution."""
    if s == 1:
        return t
    shape = list(t.shape)
    zeros_shape = shape[: dim + 1] + [s - 1] + shape[dim + 1 :]
    stacked = torch.cat([t.unsqueeze(dim + 1), t.new_zeros(zeros_shape)], dim + 1)
    return stacked.reshape(*shape[:dim], shape[dim] * s, *shape[dim + 1 :])


def _fit_edges(t: Tensor, dim: int, before: int, after: int) -> Tensor:
    """t padded with zeros (a positive amount) or cropped (a negative one) at both ends."""
    if before < 0:
        t = t.narrow(dim, -before, t.shape[dim] + before)
    if after < 0:
        t = t.narrow(dim, 0, t.shape[dim] + after)
    pads = [0, 0, 0, 0]
    pads[2 * (3 - dim)] = max(before, 0)
    pads[2 * (3 - dim) + 1] = max(after, 0)
    return F.pad(t, pads) if any(pads) else t


def _transposed_conv(
    g: Tensor, weight: Tensor, out_hw: tuple[int, int], s: Pair, p: Pair, d: Pair, groups: int
) -> Tensor:
    """The transpose of conv2d(., weight, stride s, padding p, dilation d, groups) applied to
    g, of spatial size ``out_hw``, from a plain conv2d (PopTorch's ConvTranspose has no
    dilation): g with s - 1 zeros between its elements, its edges padded by (k - 1) * d - p
    (cropped where negative) and fitted to out + (k - 1) * d, convolved (dilation d) with the
    kernel flipped and its in / out channels swapped per group."""
    k = weight.shape[2:]
    fill = [(k[i] - 1) * d[i] for i in (0, 1)]
    z = _insert_zeros(_insert_zeros(g, 2, s[0]), 3, s[1])
    before = [fill[i] - p[i] for i in (0, 1)]
    after = [out_hw[i] + fill[i] - before[i] - z.shape[2 + i] for i in (0, 1)]
    both = [max(0, min(before[i], after[i])) for i in (0, 1)]  # conv2d's own padding
    for i in (0, 1):
        z = _fit_edges(z, 2 + i, before[i] - both[i], after[i] - both[i])
    cout, cin_g = weight.shape[:2]
    w = weight.reshape(groups, cout // groups, cin_g, *k).transpose(1, 2)
    w = w.reshape(groups * cin_g, cout // groups, *k)
    for i in (0, 1):
        if k[i] > 1:
            rev = torch.arange(k[i] - 1, -1, -1, device=w.device)
            w = w.index_select(2 + i, rev)
    return F.conv2d(z, w, None, 1, tuple(both), d, groups)


@conventions.implements
def conv2d(x, layer, *, stride, padding, dilation, groups):
    """F.conv2d with the layer's weight and bias."""
    weight, bias = _weight_bias(layer)
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


@conventions.implements
def conv2d_backward(g, x, layer, *, stride, padding, dilation, groups, needs):
    """gx = conv_transpose2d(g, weight) (dilated: _transposed_conv), gW = conv of x with g,
    gb = sum."""
    weight = layer.weight
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    kh, kw = weight.shape[2:]
    gx = gw = gb = None
    if _need(needs, 0):
        if d == (1, 1):
            op = tuple(
                _restore_padding(x.shape[2 + i], g.shape[2 + i], weight.shape[2 + i], s[i], p[i])
                for i in (0, 1)
            )
            gx = F.conv_transpose2d(g, weight, None, s, p, op, groups)
        else:
            gx = _transposed_conv(g, weight, tuple(x.shape[2:]), s, p, d, groups)
    if _need(needs, 1):
        gw = _weight_grad(x, g, (kh, kw), d, s, p, groups)
    if _need(needs, 2):
        gb = g.sum((0, 2, 3))
    return _fit((gx, gw, gb), needs)


@conventions.implements
def conv_transpose2d(x, layer, *, stride, padding, output_padding, dilation, groups):
    """F.conv_transpose2d; with dilation > 1, which PopTorch's ConvTranspose lacks,
    _transposed_conv plus the bias."""
    weight, bias = _weight_bias(layer)
    d = _pair(dilation)
    if d == (1, 1):
        return F.conv_transpose2d(x, weight, bias, stride, padding, output_padding, groups)
    s, p, op = _pair(stride), _pair(padding), _pair(output_padding)
    k = weight.shape[2:]
    out_hw = tuple(
        (x.shape[2 + i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1 for i in (0, 1)
    )
    y = _transposed_conv(x, weight, out_hw, s, p, d, groups)
    return y if bias is None else y + bias.reshape(1, -1, 1, 1)


@conventions.implements
def conv_transpose2d_backward(
    g, x, layer, *, stride, padding, output_padding, dilation, groups, needs
):
    """gx = conv2d(g, weight), gW = conv of g with x (weight is [in, out/groups, kh, kw]),
    gb = sum. Uses only conv2d, so any dilation works here."""
    weight = layer.weight
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    gx = gw = gb = None
    if _need(needs, 0):
        gx = F.conv2d(g, weight, None, s, p, d, groups)[:, :, : x.shape[2], : x.shape[3]]
    if _need(needs, 1):
        gw = _weight_grad(g, x, tuple(weight.shape[2:]), d, s, p, groups)
    if _need(needs, 2):
        gb = g.sum((0, 2, 3))
    return _fit((gx, gw, gb), needs)


# ---------------------------------------------------------------- batch norm


def _per_channel(t: Tensor) -> Tensor:
    return t.reshape(1, -1, 1, 1)


def _bn_dtypes(x: Tensor, weight: Tensor | None, running_mean: Tensor | None):
    """(compute, held): batch norm computes in float32 when x is a 16-bit float, in x's
    dtype otherwise, as torch's kernels accumulate; its statistics and parameter gradients
    are in the dtype of the layer's tensors (its weights', else its running statistics',
    else x's): float32 under a mixed precision, where a float16 input meets float32 weights,
    float16 in a half model. Output and input gradient stay in x's dtype. Under fp32 (and
    float64) all three are x's dtype, and nothing is cast."""
    held = weight if weight is not None else running_mean
    compute = torch.float32 if x.dtype.itemsize < 4 else x.dtype
    return compute, (held.dtype if held is not None else x.dtype)


def _normalised(
    centered: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
) -> Tensor:
    """centered * invstd * weight + bias, per channel (weight, bias: None when not affine)."""
    scale = invstd if weight is None else invstd * weight
    y = centered * _per_channel(scale)
    return y if bias is None else y + _per_channel(bias)


@conventions.implements
def batchnorm2d(x, layer, *, eps, momentum):
    """As nn.BatchNorm2d.train(): normalizes with the batch statistics (biased var), updates
    the layer's running_mean / running_var (unbiased var) with the momentum in place and adds
    1 to its num_batches_tracked; momentum None: cumulative average. Returns (y, mean, invstd).
    The layer in eval mode (with running stats), as nn.BatchNorm2d.eval(): the running
    mean and rsqrt(running_var + eps) in their place, nothing updated. Dtypes: ``_bn_dtypes``."""
    weight, bias, running_mean, running_var, num_batches_tracked = _norm_tensors(layer)
    compute, held = _bn_dtypes(x, weight, running_mean)
    out, x = x.dtype, x.to(compute)
    if _running_stats_used(layer, running_mean, running_var):
        invstd = torch.rsqrt(running_var.to(compute) + eps)
        y = _normalised(x - _per_channel(running_mean.to(compute)), invstd, weight, bias)
        return y.to(out), running_mean, invstd.to(held)
    dims = (0, 2, 3)
    mean = x.mean(dims)
    centered = x - _per_channel(mean)
    sq = centered.square()
    invstd = torch.rsqrt(sq.mean(dims) + eps)
    y = _normalised(centered, invstd, weight, bias)
    factor = _momentum_factor(num_batches_tracked, momentum, compute)
    if running_mean is not None:
        running_mean.mul_(1 - factor).add_(mean * factor)
    if running_var is not None:
        unbiased = sq.sum(dims) / (x.numel() // x.shape[1] - 1)  # inf / nan for one value
        running_var.mul_(1 - factor).add_(unbiased * factor)
    return y.to(out), mean.to(held), invstd.to(held)


@conventions.implements
def batchnorm2d_recompute(x, layer, *, eps, momentum):
    """The training forward's output again (``--recompute``), from the batch statistics of x;
    the running statistics are left alone. The layer in eval mode: the eval forward's."""
    weight, bias, running_mean, running_var, _ = _norm_tensors(layer)
    if _running_stats_used(layer, running_mean, running_var):
        return batchnorm2d_eval(x, layer, eps=eps, momentum=momentum)
    compute, _ = _bn_dtypes(x, weight, running_mean)
    out, x = x.dtype, x.to(compute)
    dims = (0, 2, 3)
    mean = x.mean(dims)
    centered = x - _per_channel(mean)
    invstd = torch.rsqrt(centered.square().mean(dims) + eps)
    return _normalised(centered, invstd, weight, bias).to(out)


def _momentum_factor(
    num_batches_tracked: Tensor | None, momentum: float | None, dtype: torch.dtype
) -> float | Tensor:
    """Counts the batch and gives the running-stat update factor, as nn.BatchNorm2d: the
    momentum, or 1 / num_batches_tracked (cumulative average) for momentum None."""
    factor: float | Tensor = 0.0 if momentum is None else momentum
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if momentum is None:
            factor = num_batches_tracked.to(dtype).reciprocal()
    return factor


@conventions.implements
def batchnorm2d_backward(g, x, layer, save_mean, save_invstd, *, eps, momentum, needs):
    """Closed form: with xhat = (x - mean) * invstd, gb = sum(g), gW = sum(g * xhat),
    gx = (g - gb/M - xhat * gW/M) * invstd * W (sums over N, H, W; M their count). The
    layer in eval mode (with running stats; mean and invstd the forward's from them): the
    statistics are constants, so gx = g * invstd * W. Dtypes: ``_bn_dtypes``."""
    if not any(_need(needs, i) for i in range(3)):
        return _fit((), needs)
    weight, _, running_mean, running_var, _ = _norm_tensors(layer)
    frozen = _running_stats_used(layer, running_mean, running_var)
    compute, held = _bn_dtypes(x, weight, running_mean)
    out, g, x = x.dtype, g.to(compute), x.to(compute)
    save_mean, save_invstd = save_mean.to(compute), save_invstd.to(compute)
    dims = (0, 2, 3)
    count = x.numel() // x.shape[1]
    gb = g.sum(dims)
    gw = xhat = None
    if _need(needs, 1) or (_need(needs, 0) and not frozen):
        xhat = (x - _per_channel(save_mean)) * _per_channel(save_invstd)
        gw = (g * xhat).sum(dims)
    gx = None
    if _need(needs, 0):
        scale = _per_channel(save_invstd if weight is None else save_invstd * weight)
        if frozen:
            gx = g * scale
        else:
            gx = (g - _per_channel(gb / count) - xhat * _per_channel(gw / count)) * scale
        gx = gx.to(out)
    gw = gw.to(held) if gw is not None else None
    return _fit((gx, gw, gb.to(held)), needs)


@conventions.implements
def batchnorm2d_eval(x, layer, *, eps, momentum):
    """As nn.BatchNorm2d.eval(): normalizes with the running statistics, changes nothing."""
    weight, bias, running_mean, running_var, _ = _norm_tensors(layer)
    compute, _ = _bn_dtypes(x, weight, running_mean)
    out, x = x.dtype, x.to(compute)
    if running_mean is None or running_var is None:  # no running stats: batch statistics
        mean = x.mean((0, 2, 3))
        var = (x - _per_channel(mean)).square().mean((0, 2, 3))
    else:
        mean, var = running_mean.to(compute), running_var.to(compute)
    return _normalised(x - _per_channel(mean), torch.rsqrt(var + eps), weight, bias).to(out)


# ---------------------------------------------------------------- activations


@conventions.implements
def relu_backward(g, y, *, needs):
    """where(y > 0, g, 0); y may be the bool mask y > 0 (same result, bit for bit)."""
    if not _need(needs, 0):
        return (None,)
    keep = y if y.dtype == torch.bool else y > 0
    return (torch.where(keep, g, _zero(g)),)


@conventions.implements
def sigmoid_backward(g, y, *, needs):
    """g * (1 - y) * y."""
    return (g * (1 - y) * y if _need(needs, 0) else None,)


@conventions.implements
def tanh_backward(g, y, *, needs):
    """g * (1 - y^2)."""
    return (g * (1 - y * y) if _need(needs, 0) else None,)


def _gelu_tanh_parts(x: Tensor) -> tuple[Tensor, Tensor]:
    x_sq = x * x
    inner = _SQRT_2_OVER_PI * (x + _GELU_TANH_KAPPA * x_sq * x)
    return x_sq, torch.tanh(inner)


def _std_normal_cdf(x: Tensor) -> Tensor:
    """Phi(x) without erf: gelu(x) / x for |x| >= 0.1, else the Taylor series of Phi at 0
    (terms to x^11; truncation below 1e-19 there)."""
    small = x.abs() < _PHI_SERIES_BELOW
    safe = torch.where(small, torch.ones_like(x), x)
    from_gelu = F.gelu(safe) / safe
    x_sq = x * x
    poly = x_sq * _PHI_SERIES[-1]  # Horner: c0 + x^2 (c1 + x^2 (... + x^2 c5))
    for c in reversed(_PHI_SERIES[1:-1]):
        poly = (poly + c) * x_sq
    series = 0.5 + x * _INV_SQRT_2PI * (poly + _PHI_SERIES[0])
    return torch.where(small, series, from_gelu)


@conventions.implements
def gelu(x, *, approximate):
    """F.gelu for "none" (GELU runs on the IPU); the tanh form written out."""
    if approximate == "tanh":
        _, t = _gelu_tanh_parts(x)
        return 0.5 * x * (1 + t)
    if approximate == "none":
        return F.gelu(x)
    raise ValueError(f"gelu: unknown approximate={approximate!r}")


@conventions.implements
def gelu_backward(g, x, *, approximate, needs):
    """none: g * (Phi(x) + x * phi(x)), Phi without erf (see _std_normal_cdf); tanh: the
    derivative of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if not _need(needs, 0):
        return (None,)
    if approximate == "tanh":
        x_sq, t = _gelu_tanh_parts(x)
        left = 0.5 * x
        right = 1 + t
        d_inner = _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_KAPPA * x_sq)
        return (g * (0.5 * right + left * (1 - t * t) * d_inner),)
    if approximate == "none":
        pdf = torch.exp(x * x * -0.5) * _INV_SQRT_2PI
        return (g * (_std_normal_cdf(x) + x * pdf),)
    raise ValueError(f"gelu: unknown approximate={approximate!r}")


@conventions.implements
def leaky_relu(x, *, negative_slope):
    """F.leaky_relu; the backward reads the input (or its mask x > 0)."""
    return F.leaky_relu(x, negative_slope)


@conventions.implements
def leaky_relu_backward(g, x, *, negative_slope, needs):
    """where(x > 0, g, g * negative_slope); x may be the bool mask x > 0."""
    if not _need(needs, 0):
        return (None,)
    keep = x if x.dtype == torch.bool else x > 0
    return (torch.where(keep, g, g * negative_slope),)


# ---------------------------------------------------------------- v2 activations
# relu6, hardtanh, silu, elu and softplus forwards are shared (common.py: one F call each,
# all on PopTorch's list); hardsigmoid, hardswish and mish are not on it and are written
# out with aten's own formulas: hardsigmoid and hardswish match torch bit for bit on the CPU
# (forward and gradient), mish to rounding (aten's vectorised exp / tanh differ in the last bit).


@conventions.implements
def hardtanh_backward(g, x, *, min_val, max_val, needs):
    """where(min_val < x < max_val, g, 0), the inside test written as hardtanh_mask's; x
    may be that bool mask."""
    if not _need(needs, 0):
        return (None,)
    inside = x if x.dtype == torch.bool else hardtanh_mask(x, min_val=min_val, max_val=max_val)
    return (torch.where(inside, g, _zero(g)),)


@conventions.implements
def hardsigmoid(x):
    """min(max(x + 3, 0), 6) / 6, aten's formula."""
    return torch.clamp(x + 3.0, 0.0, 6.0) / 6.0


@conventions.implements
def hardsigmoid_backward(g, x, *, needs):
    """g * 1/6 (float32's 1/6, as aten) where -3 < x < 3, else 0; x may be that bool mask."""
    if not _need(needs, 0):
        return (None,)
    inside = x if x.dtype == torch.bool else hardsigmoid_mask(x)
    return (torch.where(inside, g * _ONE_SIXTH_F32, _zero(g)),)


@conventions.implements
def hardswish(x):
    """x * min(max(x + 3, 0), 6) / 6, aten's formula."""
    return x * torch.clamp(x + 3.0, 0.0, 6.0) / 6.0


@conventions.implements
def hardswish_backward(g, x, *, needs):
    """0 for x <= -3, g for x >= 3, g * (x / 3 + 0.5) between (aten's hardswish_backward,
    ends included as PyTorch 2.x decides them)."""
    if not _need(needs, 0):
        return (None,)
    upper = torch.where(x >= 3.0, g, g * (x / 3.0 + 0.5))
    return (torch.where(x <= -3.0, _zero(g), upper),)


def _sigmoid_of(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)), as aten's silu and mish kernels compute it."""
    return torch.reciprocal(torch.exp(x.neg()) + 1.0)


@conventions.implements
def silu_backward(g, x, *, needs):
    """g * s * (1 + x * (1 - s)), s = sigmoid(x) (aten's silu_backward)."""
    if not _need(needs, 0):
        return (None,)
    s = _sigmoid_of(x)
    return (g * s * (1.0 + x * (1.0 - s)),)


def _tanh_softplus(x: Tensor) -> Tensor:
    return torch.tanh(torch.log1p(torch.exp(x)))


@conventions.implements
def mish(x):
    """x * tanh(log1p(exp(x))), aten's formula (Mish is not on PopTorch's list)."""
    return x * _tanh_softplus(x)


@conventions.implements
def mish_backward(g, x, *, needs):
    """g * (t + x * s * (1 - t^2)), t = tanh(softplus(x)), s = sigmoid(x) (aten's)."""
    if not _need(needs, 0):
        return (None,)
    t, s = _tanh_softplus(x), _sigmoid_of(x)
    return (g * (t + x * s * (1.0 - t * t)),)


@conventions.implements
def elu_backward(g, x, *, alpha, needs):
    """g * alpha * exp(x) where x <= 0, else g (elu_backward with is_result=False)."""
    if not _need(needs, 0):
        return (None,)
    return (torch.where(x <= 0.0, g * alpha * torch.exp(x), g),)


@conventions.implements
def softplus_backward(g, x, *, beta, threshold, needs):
    """g where beta * x > threshold (softplus is x there), else g * z / (z + 1) with
    z = exp(beta * x) (aten's softplus_backward)."""
    if not _need(needs, 0):
        return (None,)
    bx = x * beta
    z = torch.exp(bx)
    return (torch.where(bx > threshold, g, g * z / (z + 1.0)),)


# ---------------------------------------------------------------- v2 nll_loss and embedding


def _class_one_hot(target: Tensor, classes: int, dtype: torch.dtype) -> Tensor:
    """[N, C, d1, ...]: 1 where C's index equals the target (an ignored one matches none
    unless ignore_index is a class; callers zero ignored elements)."""
    shape = (1, classes) + (1,) * (target.dim() - 1)
    index = torch.arange(classes, device=target.device).reshape(shape)
    return (index == target.unsqueeze(1)).to(dtype)


def _nll_mean(log_probs: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(-mean of log_probs at the targets over the kept elements, the kept mask)."""
    kept = target != ignore_index
    safe = torch.where(kept, target, _zero(target))
    picked = torch.gather(log_probs, 1, safe.unsqueeze(1)).squeeze(1)
    total = kept.sum().to(log_probs.dtype)
    return torch.where(kept, picked, _zero(picked)).sum().neg() / total, kept


@conventions.implements
def nll_loss(log_probs, target, *, ignore_index):
    """Gather of the targets' log-probabilities, sum over the kept elements / their count
    (all ignored: 0 / 0 = nan, as torch)."""
    return _nll_mean(log_probs, target, ignore_index)[0]


@conventions.implements
def nll_loss_backward(g, target, *, ignore_index, num_classes, needs):
    """-one_hot(target) * g / count on kept elements, 0 on ignored ones."""
    if not _need(needs, 0):
        return _fit((), needs)
    kept = target != ignore_index
    total = kept.sum().to(g.dtype)
    scale = torch.where(kept, (g / total).neg(), _zero(g)).unsqueeze(1)
    return _fit((_class_one_hot(target, num_classes, g.dtype) * scale,), needs)


@conventions.implements
def embedding(ids, layer, *, padding_idx):
    """F.embedding (Embedding runs on the IPU; padding_idx changes only the gradient)."""
    return F.embedding(ids, layer.weight)


@conventions.implements
def embedding_backward(g, ids, layer, *, padding_idx, needs):
    """(None for the ids, the weight's dense gradient): scatter_add of g's rows into a zero
    table at the ids; the padding_idx row (negative: from the end) stays zero."""
    if not _need(needs, 1):
        return _fit((None, None), needs)
    num_embeddings = layer.weight.shape[0]
    dim = g.shape[-1]
    rows = g.reshape(-1, dim)
    index = ids.reshape(-1, 1).expand(rows.shape)
    table = torch.zeros(num_embeddings, dim, dtype=g.dtype, device=g.device)
    gw = torch.scatter_add(table, 0, index, rows)
    if padding_idx is not None:
        pad = padding_idx + num_embeddings if padding_idx < 0 else padding_idx
        row = torch.arange(num_embeddings, device=g.device).unsqueeze(1)
        gw = torch.where(row == pad, _zero(gw), gw)
    return _fit((None, gw), needs)


# ---------------------------------------------------------------- pooling


def _pool_output_padding(input_hw: Pair, out_hw: Any, k: tuple, s: tuple, p: tuple) -> Pair:
    return tuple(_restore_padding(input_hw[i], out_hw[i], k[i], s[i], p[i]) for i in (0, 1))


def _pool_overhang(input_hw: Any, out_hw: Any, k: tuple, s: tuple, p: tuple) -> Pair:
    """How far the last window reaches past the right / bottom padding (ceil mode), per dim."""
    return tuple(max(0, (out_hw[i] - 1) * s[i] + k[i] - input_hw[i] - 2 * p[i]) for i in (0, 1))


def _unpool(t: Tensor, bank: Tensor, s: tuple, p: tuple, input_hw: Any, groups: int) -> Tensor:
    """conv_transpose2d of per-window values back onto the input grid (groups, stride s,
    padding p); output_padding restores the input size, and what a ceil-mode window adds
    past the input's end is cropped."""
    k = tuple(bank.shape[-2:])
    op = _pool_output_padding(input_hw, t.shape[-2:], k, s, p)
    out = F.conv_transpose2d(t, bank, None, s, p, tuple(max(0, o) for o in op), groups)
    if min(op) < 0:
        out = out[:, :, : input_hw[0], : input_hw[1]].contiguous()
    return out


def _avg_divisor(
    input_hw: Any, out_hw: Any, k: tuple, s: tuple, p: tuple, dtype: torch.dtype, dev: torch.device
) -> Tensor:
    """[Ho, Wo]: each window's size clipped to input plus padding (avg_pool2d's ceil mode)."""

    def build() -> Tensor:
        sizes = []
        for i in (0, 1):
            start = torch.arange(out_hw[i], device=dev) * s[i] - p[i]
            end = torch.clamp(start + k[i], max=input_hw[i] + p[i])
            sizes.append((end - start).to(dtype))
        return sizes[0].unsqueeze(1) * sizes[1].unsqueeze(0)

    key = ("avgdiv", *input_hw, *out_hw, *k, *s, *p, dtype)
    return _constant(key, dev, build)


def _one_hot_bank(channels: int, kh: int, kw: int, dtype: torch.dtype, dev: torch.device) -> Tensor:
    """[C * kh*kw, 1, kh, kw]: per channel, filter q is one at kernel offset q (row-major)."""

    def build() -> Tensor:
        q = torch.arange(kh * kw, device=dev)
        eye = (q.unsqueeze(1) == q.unsqueeze(0)).to(dtype).reshape(1, kh * kw, 1, kh, kw)
        return eye.expand(channels, kh * kw, 1, kh, kw).reshape(channels * kh * kw, 1, kh, kw)

    return _constant(("onehot", channels, kh, kw, dtype), dev, build)


def _ones_bank(channels: int, kh: int, kw: int, dtype: torch.dtype, dev: torch.device) -> Tensor:
    """[C, 1, kh, kw] of ones."""
    return _constant(
        ("ones", channels, kh, kw, dtype),
        dev,
        lambda: torch.ones(channels, 1, kh, kw, dtype=dtype, device=dev),
    )


@conventions.implements
def maxpool2d(x, *, kernel_size, stride, padding, ceil_mode):
    """F.max_pool2d (dilation 1) and, in place of indices, the bool selection
    ``sel[N, C, kh*kw, Ho, Wo]``: offset q = (i, j) (row-major) of each window is selected when
    it holds the window's maximum and no earlier offset does: PyTorch's rule, first maximum
    wins. Padding is NaN, which equals nothing, so padded positions are never selected.
    A window whose maximum is NaN selects nothing (PyTorch picks its last NaN). In ceil mode
    the last window may overhang the input: the overhang is NaN padding too."""
    k, s, p = _pair(kernel_size), _pair(stride), _pair(padding)
    y = F.max_pool2d(x, k, s, p, ceil_mode=ceil_mode)
    ho, wo = y.shape[-2:]
    over = _pool_overhang(x.shape[-2:], (ho, wo), k, s, p)
    pads = (p[1], p[1] + over[1], p[0], p[0] + over[0])
    xp = x if not any(pads) else F.pad(x, pads, value=math.nan)
    rows, cols = s[0] * (ho - 1) + 1, s[1] * (wo - 1) + 1
    sels: list[Tensor] = []
    claimed: Tensor | None = None
    for i in range(k[0]):
        for j in range(k[1]):
            hit = xp[:, :, i : i + rows : s[0], j : j + cols : s[1]] == y
            if claimed is None:
                sels.append(hit)
                claimed = hit
            else:
                sels.append(hit & ~claimed)
                claimed = claimed | hit
    return y, torch.stack(sels, 2)


@conventions.implements
def maxpool2d_backward(g, indices, *, kernel_size, stride, padding, input_hw, needs):
    """conv_transpose2d of where(sel, g, 0) (C * kh*kw channels) with the one-hot kernel bank
    (groups C, stride s, padding p): each input element gets the sum of g over the windows that
    selected it, as PyTorch's gradient. ``indices`` may instead be the input-shaped bool mask
    of ``maxpool2d_mask`` (non-overlapping windows only): then g is spread over each window
    (ones kernel) and kept where the mask is set; the same result, bit for bit."""
    if not _need(needs, 0):
        return (None,)
    k, s, p = _pair(kernel_size), _pair(stride), _pair(padding)
    n, c, ho, wo = g.shape
    if indices.dtype != torch.bool:
        raise TypeError(f"maxpool2d_backward: expected the bool selection, got {indices.dtype}")
    if indices.dim() == 4:  # the input-shaped 1-bit mask
        spread = _unpool(g, _ones_bank(c, *k, g.dtype, g.device), s, p, input_hw, c)
        return (torch.where(indices, spread, _zero(g)),)
    picked = torch.where(indices, g.unsqueeze(2), _zero(g)).reshape(n, c * k[0] * k[1], ho, wo)
    bank = _one_hot_bank(c, *k, g.dtype, g.device)
    return (_unpool(picked, bank, s, p, input_hw, c),)


@conventions.implements
def maxpool2d_mask(indices, *, kernel_size, stride, padding, input_hw):
    """The selected positions as a bool mask of the input's shape (one per window, ties
    resolved as PyTorch does). Enough for the backward only for non-overlapping windows."""
    k, s, p = _pair(kernel_size), _pair(stride), _pair(padding)
    n, c, kk, ho, wo = indices.shape
    sel = indices.reshape(n, c * kk, ho, wo).to(torch.float32)
    bank = _one_hot_bank(c, *k, torch.float32, indices.device)
    return _unpool(sel, bank, s, p, input_hw, c) > 0.5


@conventions.implements
def avgpool2d(x, *, kernel_size, stride, padding, ceil_mode):
    """F.avg_pool2d (count_include_pad); the backward needs no activation."""
    k, s, p = _pair(kernel_size), _pair(stride), _pair(padding)
    return F.avg_pool2d(x, k, s, p, ceil_mode=ceil_mode, count_include_pad=True)


@conventions.implements
def avgpool2d_backward(g, *, kernel_size, stride, padding, input_hw, needs):
    """conv_transpose2d of g / (kh*kw) with a ones kernel per channel (groups C, stride s,
    padding p, output_padding up to input_hw). In ceil mode a window overhanging the input
    divides by the part of it inside input and padding (PyTorch's divisor)."""
    if not _need(needs, 0):
        return (None,)
    k, s, p = _pair(kernel_size), _pair(stride), _pair(padding)
    c = g.shape[1]
    bank = _ones_bank(c, *k, g.dtype, g.device)
    if _ceil_mode_of(input_hw, g.shape[-2:], k, s, p):
        scaled = g / _avg_divisor(input_hw, tuple(g.shape[-2:]), k, s, p, g.dtype, g.device)
    else:
        scaled = g / (k[0] * k[1])
    return (_unpool(scaled, bank, s, p, input_hw, c),)


def _adaptive_matrix(out: int, size: int, dtype: torch.dtype, dev: torch.device) -> Tensor:
    """[out, size]: row i averages PyTorch's adaptive window floor(i*size/out) ..
    ceil((i+1)*size/out)."""

    def build() -> Tensor:
        i = torch.arange(out, device=dev).unsqueeze(1)
        h = torch.arange(size, device=dev).unsqueeze(0)
        start = torch.floor_divide(i * size, out)
        end = torch.floor_divide((i + 1) * size + out - 1, out)
        inside = torch.logical_and(h >= start, h < end)
        return inside.to(dtype) / (end - start).to(dtype)

    return _constant(("adaptive", out, size, dtype), dev, build)


@conventions.implements
def adaptive_avgpool2d(x, *, output_size):
    """A_h @ x @ A_w^T with the averaging matrices (a mean over H, W for 1x1)."""
    ho, wo = _pair(output_size)
    if (ho, wo) == (1, 1):
        return x.mean((-1, -2), keepdim=True)
    h, w = x.shape[-2:]
    a_h = _adaptive_matrix(ho, h, x.dtype, x.device)
    a_w = _adaptive_matrix(wo, w, x.dtype, x.device)
    return torch.matmul(a_h, torch.matmul(x, a_w.t()))


@conventions.implements
def adaptive_avgpool2d_backward(g, *, output_size, input_hw, needs):
    """A_h^T @ g @ A_w (g / (H*W) expanded for 1x1)."""
    if not _need(needs, 0):
        return (None,)
    ho, wo = _pair(output_size)
    h, w = input_hw
    if (ho, wo) == (1, 1):
        return (g.expand(*g.shape[:-2], h, w) / (h * w),)
    a_h = _adaptive_matrix(ho, h, g.dtype, g.device)
    a_w = _adaptive_matrix(wo, w, g.dtype, g.device)
    return (torch.matmul(a_h.t(), torch.matmul(g, a_w)),)


# ---------------------------------------------------------------- upsampling


def _upsample_size(hw: Any, scale: tuple[float, float]) -> Pair:
    # as torch.nn.functional.interpolate: floor(in * scale)
    return int(math.floor(hw[0] * scale[0])), int(math.floor(hw[1] * scale[1]))


def _interp_matrix(
    out: int,
    size: int,
    scale: float,
    mode: str,
    align_corners: bool,
    dtype: torch.dtype,
    dev: torch.device,
) -> Tensor:
    """[out, size]: output row o = sum_i M[o, i] * input row i, by ATen's index rules."""

    def build() -> Tensor:
        cols = torch.arange(size, device=dev).unsqueeze(0)
        if out == size:  # ATen copies (both modes)
            rows = torch.arange(out, device=dev).unsqueeze(1)
            return (rows == cols).to(dtype)
        if mode == "nearest":
            if out == 2 * size:
                src = torch.floor_divide(torch.arange(out, device=dev), 2)
            else:  # float32: floorf(o * float(1 / scale)), as ATen's nearest_idx
                ratio = 1.0 / scale if scale > 0 else size / out
                r32 = torch.full((), ratio, dtype=torch.float32, device=dev)
                o32 = torch.arange(out, dtype=torch.float32, device=dev)
                src = torch.clamp(torch.floor(o32 * r32).to(torch.int64), max=size - 1)
            return (cols == src.unsqueeze(1)).to(dtype)
        # bilinear: ATen's compute_source_index_and_lambda, in its opmath type
        opmath = torch.float64 if dtype == torch.float64 else torch.float32
        o = torch.arange(out, dtype=opmath, device=dev)
        if align_corners:
            num = torch.full((), size - 1, dtype=opmath, device=dev)
            ratio = num / (out - 1) if out > 1 else torch.zeros((), dtype=opmath, device=dev)
            src = ratio * o
        else:
            value = 1.0 / scale if scale > 0 else size / out
            ratio = torch.full((), value, dtype=opmath, device=dev)
            src = torch.clamp(ratio * (o + 0.5) - 0.5, min=0.0)
        # floorf(src): the source index is rounded to float32 before the floor, as in ATen
        i0 = torch.clamp(torch.floor(src.to(torch.float32)).to(torch.int64), max=size - 1)
        lam1 = torch.clamp(src - i0.to(opmath), min=0.0, max=1.0)
        i1 = i0 + (i0 < size - 1).to(torch.int64)
        w0 = (cols == i0.unsqueeze(1)).to(opmath) * (1 - lam1).unsqueeze(1)
        w1 = (cols == i1.unsqueeze(1)).to(opmath) * lam1.unsqueeze(1)
        return (w0 + w1).to(dtype)

    key = ("interp", out, size, float(scale), mode, bool(align_corners), dtype)
    return _constant(key, dev, build)


def _upsample_matrices(
    in_hw: Any, out_hw: Any, scale: tuple, mode: str, align: bool, t: Tensor
) -> tuple[Tensor, Tensor]:
    if mode not in ("nearest", "bilinear"):
        raise ValueError(f"upsample: unsupported mode {mode!r}")
    m_h = _interp_matrix(out_hw[0], in_hw[0], scale[0], mode, align, t.dtype, t.device)
    m_w = _interp_matrix(out_hw[1], in_hw[1], scale[1], mode, align, t.dtype, t.device)
    return m_h, m_w


@conventions.implements
def upsample(x, *, scale_factor, mode, align_corners):
    """As nn.Upsample(scale_factor=...): M_h @ x @ M_w^T with interpolation matrices."""
    scale = tuple(float(v) for v in _pair(scale_factor))
    out_hw = _upsample_size(x.shape[-2:], scale)
    m_h, m_w = _upsample_matrices(x.shape[-2:], out_hw, scale, mode, bool(align_corners), x)
    return torch.matmul(m_h, torch.matmul(x, m_w.t()))


@conventions.implements
def upsample_backward(g, *, scale_factor, mode, align_corners, input_hw, needs):
    """M_h^T @ g @ M_w."""
    if not _need(needs, 0):
        return (None,)
    scale = tuple(float(v) for v in _pair(scale_factor))
    m_h, m_w = _upsample_matrices(input_hw, g.shape[-2:], scale, mode, bool(align_corners), g)
    return (torch.matmul(m_h.t(), torch.matmul(g, m_w)),)


# ---------------------------------------------------------------- dropout


@conventions.implements
def dropout(x, *, p):
    """Training dropout: keep = rand >= p (probability 1 - p), y = x * keep / (1 - p).
    Returns (y, keep); keep is None for p == 0 (identity) and p == 1 (all dropped). Draws
    come from torch.rand (on the IPU seeded by poptorch.Options().randomSeed), not the gpu
    kernel's stream."""
    if p == 0 or x.numel() == 0:
        return x, None
    if p == 1:
        return x * _zero(x), None
    keep = torch.rand(x.shape, dtype=x.dtype, device=x.device) >= p
    return x * (keep.to(x.dtype) / (1 - p)), keep


@conventions.implements
def dropout_backward(g, mask, *, p, needs):
    """g * keep / (1 - p)."""
    if not _need(needs, 0):
        return (None,)
    if p == 1:
        return (g * _zero(g),)
    if mask is None:
        return (g,)
    return (g * (mask.to(g.dtype) / (1 - p)),)


@conventions.implements
def drop_path(x, *, p, scale):
    """The identity at p == 0; p > 0 is refused (``unsupported``) when the module is made."""
    if p:
        raise NotImplementedError(unsupported("drop_path", {"p": p}))
    return x, None


@conventions.implements
def drop_path_backward(g, seed, *, p, scale, needs):
    """The identity's backward (p == 0 only, see drop_path)."""
    if p:
        raise NotImplementedError(unsupported("drop_path", {"p": p}))
    return (g if _need(needs, 0) else None,)


@conventions.implements
def moe(x, layer, *, top_k, norm_topk, router_float32):
    """Refused when the module is made (``unsupported``); this only says so if called."""
    raise NotImplementedError(unsupported("moe", {}))


@conventions.implements
def moe_backward(g, x, layer, index, *, top_k, norm_topk, router_float32, needs):
    """Refused when the module is made (``unsupported``)."""
    raise NotImplementedError(unsupported("moe", {}))


# ---------------------------------------------------------------- losses (mean reduction)


@conventions.implements
def cross_entropy(logits, target, *, label_smoothing, ignore_index):
    """As F.cross_entropy (mean over the non-ignored elements; classes on dim 1, any further
    dims per pixel / token): log_softmax, gather of the targets' log-probabilities, sum over
    the kept elements / their count; with label smoothing, (1 - ls) times that plus ls / C
    times the kept elements' mean of -sum_c log_probs, as torch. Returns (loss, log_probs)."""
    log_probs = F.log_softmax(logits, 1)
    loss, kept = _nll_mean(log_probs, target, ignore_index)
    if label_smoothing == 0.0:
        return loss, log_probs
    total = kept.sum().to(log_probs.dtype)
    smooth = torch.where(kept, log_probs.sum(1), _zero(log_probs)).sum().neg() / total
    classes = logits.shape[1]
    return (1 - label_smoothing) * loss + smooth * (label_smoothing / classes), log_probs


@conventions.implements
def cross_entropy_backward(g, log_probs, target, *, label_smoothing, ignore_index, needs):
    """(softmax - (1 - ls) one_hot(target) - ls / C) * g / count on the kept elements, zero
    on ignored ones; the softmax is exp(log_probs), the one-hot a comparison with arange(C)."""
    if not _need(needs, 0):
        return _fit((), needs)
    kept = target != ignore_index
    total = kept.sum().to(log_probs.dtype)
    classes = log_probs.shape[1]
    one_hot = _class_one_hot(target, classes, log_probs.dtype)
    row = torch.where(kept, g / total, _zero(log_probs)).unsqueeze(1)
    if label_smoothing == 0.0:
        return _fit(((torch.exp(log_probs) - one_hot) * row,), needs)
    smoothed = one_hot * (1 - label_smoothing) + label_smoothing / classes
    return _fit(((torch.exp(log_probs) - smoothed) * row,), needs)


@conventions.implements
def cross_entropy_low(logits, target, *, label_smoothing, ignore_index):
    """cross_entropy of the low-precision logits cast to float32 whole: the IPU's graph
    compiler plans the step's memory itself, so no chunks."""
    loss, _ = cross_entropy(
        _widened(logits), target, label_smoothing=label_smoothing, ignore_index=ignore_index
    )
    return loss


@conventions.implements
def cross_entropy_low_backward(g, logits, target, *, label_smoothing, ignore_index, needs):
    """cross_entropy's gradient from the log-probabilities made again, in the logits' dtype."""
    if not _need(needs, 0):
        return _fit((), needs)
    log_probs = F.log_softmax(_widened(logits), 1)
    (found,) = cross_entropy_backward(
        g, log_probs, target, label_smoothing=label_smoothing, ignore_index=ignore_index, needs=None
    )
    return _fit((found.to(logits.dtype),), needs)


@conventions.implements
def mse_loss(a, b):
    """mean((a - b)^2)."""
    return (a - b).square().mean()


@conventions.implements
def mse_loss_backward(g, a, b, *, needs):
    """2 (a - b) g / numel for a, its negation for b."""
    if not (_need(needs, 0) or _need(needs, 1)):
        return (None, None)
    ga = (a - b) * (g * (2.0 / a.numel()))
    return (ga if _need(needs, 0) else None, ga.neg() if _need(needs, 1) else None)


@conventions.implements
def l1_loss_backward(g, a, b, *, needs):
    """sign(a - b) g / numel for a, its negation for b."""
    if not (_need(needs, 0) or _need(needs, 1)):
        return (None, None)
    ga = torch.sign(a - b) * (g / a.numel())
    return (ga if _need(needs, 0) else None, ga.neg() if _need(needs, 1) else None)


@conventions.implements
def bce_loss(p, t):
    """mean(-(t log p + (1 - t) log(1 - p))), each log clamped at -100 as in PyTorch."""
    log_p = torch.clamp(torch.log(p), min=_BCE_LOG_MIN)
    log_q = torch.clamp(torch.log1p(-p), min=_BCE_LOG_MIN)
    return ((t - 1) * log_q - t * log_p).mean()


@conventions.implements
def bce_loss_backward(g, p, t, *, needs):
    """g (p - t) / max((1 - p) p, eps) / numel for p (PyTorch's formula, eps = float32(1e-12)); for t,
    -log(p / (1 - p)) g / numel."""
    gp = gt = None
    if _need(needs, 0):
        gp = g * (p - t) / torch.clamp((1 - p) * p, min=_BCE_EPS) / p.numel()
    if _need(needs, 1):
        gt = torch.log(p / (1 - p)).neg() * (g / t.numel())
    return (gp, gt)


@conventions.implements
def bce_with_logits(x, t):
    """mean((1 - t) x + softplus(-x)), softplus(-x) = max(-x, 0) + log1p(exp(-|x|))."""
    softplus_neg = torch.clamp(x.neg(), min=0.0) + torch.log1p(torch.exp(x.abs().neg()))
    return ((1 - t) * x + softplus_neg).mean()


@conventions.implements
def bce_with_logits_backward(g, x, t, *, needs):
    """(sigmoid(x) - t) g / numel for x, -x g / numel for t."""
    gx = (torch.sigmoid(x) - t) * (g / x.numel()) if _need(needs, 0) else None
    gt = x.neg() * (g / t.numel()) if _need(needs, 1) else None
    return (gx, gt)


# ---------------------------------------------------------------- softmax, log_softmax (v2)


@conventions.implements
def softmax_backward(g, y, *, dim, needs):
    """y * (g - sum(g * y)) along dim: the formula aten's softmax backward computes."""
    if not _need(needs, 0):
        return (None,)
    return (y * (g - (g * y).sum(dim, keepdim=True)),)


@conventions.implements
def log_softmax_backward(g, y, *, dim, needs):
    """g - exp(y) * sum(g) along dim: the formula aten's log_softmax backward computes."""
    if not _need(needs, 0):
        return (None,)
    return (g - torch.exp(y) * g.sum(dim, keepdim=True),)


# ---------------------------------------------------------------- attention
#
# scaled_dot_product_attention and its backward are unroller.runtime.attention's (imported
# above, shared with gpu): block by block from matmul, exp, log, amax and sums, never the
# [N, H, L, S] probabilities.


@conventions.implements
def multihead_attention(x, bias, layer, *, num_heads, is_causal):
    """nn.MultiheadAttention(batch_first=True)(x, x, x, need_weights=False): one packed
    projection [N, L, 3E] split into q, k, v [N, H, L, E/H], the attention (block by block:
    ``attention``), the heads joined into the context [N, L, E], the out-projection.
    ``bias``: [N or 1, H or 1, L, L] added to the scores; a call without it is (x, layer),
    as generated code makes it. Returns (y, q, k, v, lse, context): lse [N, H, L] the row
    logsumexp the attention backward reads beside q, k, v and the context (its output)."""
    if layer is None:  # (x, layer): the optional bias left out
        bias, layer = None, bias
    n, length, embed = x.shape
    out_layer = layer.out_proj
    proj = F.linear(x, layer.in_proj_weight, getattr(layer, "in_proj_bias", None))
    heads = proj.reshape(n, length, 3, num_heads, embed // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = heads[0], heads[1], heads[2]
    y, lse = _sdpa_blocks(q, k, v, bias, is_causal=is_causal)
    context = y.transpose(1, 2).reshape(n, length, embed)
    return linear(context, out_layer), q, k, v, lse, context


@conventions.implements
def multihead_attention_backward(g, x, layer, q, k, v, lse, context, bias, *, is_causal, needs):
    """The out-projection's linear backward, the attention's (from q, k, v, lse and the
    context as its output), the heads' gradients joined
    into [N, L, 3E] (q, k, v blocks), the in-projection's linear backward. Gradients: x,
    the bias (where given; summed over the dims it broadcasts), in_proj_weight,
    in_proj_bias, out_proj.weight, out_proj.bias."""
    args = (g, x, layer, q, k, v, lse, context)
    if bias is None:
        return _mha_backward(*args, None, False, is_causal, needs)[0]
    rest = None if needs is None else (*needs[:1], *needs[2:])  # without the bias's slot
    grads, g_bias = _mha_backward(*args, bias, _need(needs, 1), is_causal, rest)
    return _fit((grads[0] if grads else None, g_bias, *grads[1:]), needs)


def _mha_backward(g, x, layer, q, k, v, lse, context, bias, need_bias, is_causal, needs):
    """multihead_attention_backward's gradients of x and the four parameters, and the
    bias's (None unless ``need_bias``)."""
    if not (need_bias or any(_need(needs, i) for i in range(5))):
        return _fit((), needs), None
    n, length, embed = x.shape
    into = need_bias or any(_need(needs, i) for i in range(3))  # before the attention
    g_context, g_w_out, g_b_out = linear_backward(
        g, context, layer.out_proj, needs=(into, _need(needs, 3), _need(needs, 4))
    )
    gx = g_w_in = g_b_in = g_bias = None
    if g_context is not None:
        heads, head_dim = q.shape[1], q.shape[3]
        g_y = g_context.reshape(n, length, heads, head_dim).transpose(1, 2)
        y = context.reshape(n, length, heads, head_dim).transpose(1, 2)
        grads = _sdpa_blocks_backward(
            g_y, q, k, v, y, lse, bias, is_causal=is_causal, needs=(True, True, True, need_bias)
        )
        g_bias = grads[3] if need_bias else None
        g_proj = torch.cat([t.transpose(1, 2).reshape(n, length, embed) for t in grads[:3]], -1)
        g_proj2 = g_proj.reshape(n * length, 3 * embed)
        if _need(needs, 0):
            gx = g_proj.matmul(layer.in_proj_weight)
        if _need(needs, 1):
            g_w_in = g_proj2.t().matmul(x.reshape(n * length, embed))
        if _need(needs, 2):
            g_b_in = g_proj2.sum(0)
    return _fit((gx, g_w_in, g_b_in, g_w_out, g_b_out), needs), g_bias


# ---------------------------------------------------------------- normalisation and 1-D ops (v2)


def _trailing(x: Tensor, count: int) -> tuple[int, ...]:
    return tuple(range(x.dim() - count, x.dim()))


@conventions.implements
def layernorm(x, layer, *, normalized_shape, eps):
    """As F.layer_norm over the trailing dims (biased var); returns (y, mean, rstd) with
    mean, rstd keeping those dims as 1s, as aten::native_layer_norm."""
    weight, bias = _weight_bias(layer)
    dims = _trailing(x, len(normalized_shape))
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    rstd = torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean, rstd


def _norm_input_grad(gy: Tensor, xhat: Tensor, rstd: Tensor, dims: Any) -> Tensor:
    """The normalisation's input gradient given gy = g * weight: rstd * (gy - mean(gy) -
    xhat * mean(gy * xhat)), means over the normalised dims."""
    mean_gy = gy.mean(dims, keepdim=True)
    return (gy - mean_gy - xhat * (gy * xhat).mean(dims, keepdim=True)) * rstd


@conventions.implements
def layernorm_backward(g, x, layer, mean, rstd, *, normalized_shape, needs):
    """Closed form with xhat = (x - mean) * rstd: gx as _norm_input_grad, gW = sum of g * xhat
    and gb = sum of g over the leading dims."""
    weight, bias = _weight_bias(layer)
    dims = _trailing(x, len(normalized_shape))
    lead = tuple(range(x.dim() - len(normalized_shape)))
    xhat = (x - mean) * rstd
    gx = gw = gb = None
    if _need(needs, 0):
        gx = _norm_input_grad(g if weight is None else g * weight, xhat, rstd, dims)
    if _need(needs, 1) and weight is not None:
        gw = (g * xhat).sum(lead)
    if _need(needs, 2) and bias is not None:
        gb = g.sum(lead)
    return _fit((gx, gw, gb), needs)


def _channel_shape(x: Tensor) -> tuple[int, ...]:
    return (1, -1, *([1] * (x.dim() - 2)))


@conventions.implements
def groupnorm(x, layer, *, num_groups, eps):
    """As F.group_norm: statistics over each group of channels with the spatial dims (biased
    var); returns (y, mean, rstd), mean and rstd [N, num_groups] as aten::native_group_norm."""
    weight, bias = _weight_bias(layer)
    xg = x.reshape(x.shape[0], num_groups, -1)
    mean = xg.mean(2)
    centered = xg - mean.unsqueeze(2)
    rstd = torch.rsqrt(centered.square().mean(2) + eps)
    y = (centered * rstd.unsqueeze(2)).reshape(x.shape)
    if weight is not None:
        y = y * weight.reshape(_channel_shape(x))
    if bias is not None:
        y = y + bias.reshape(_channel_shape(x))
    return y, mean, rstd


@conventions.implements
def groupnorm_backward(g, x, layer, mean, rstd, *, num_groups, needs):
    """Closed form per group (as layernorm's, on [N, G, C/G * spatial]); gW, gb summed over
    N and the spatial dims."""
    weight, bias = _weight_bias(layer)
    n = x.shape[0]
    xhat = (x.reshape(n, num_groups, -1) - mean.unsqueeze(2)) * rstd.unsqueeze(2)
    dims = (0, *range(2, x.dim()))
    gx = gw = gb = None
    if _need(needs, 0):
        gy = g if weight is None else g * weight.reshape(_channel_shape(x))
        gyg = gy.reshape(n, num_groups, -1)
        gx = _norm_input_grad(gyg, xhat, rstd.unsqueeze(2), 2).reshape(x.shape)
    if _need(needs, 1) and weight is not None:
        gw = (g * xhat.reshape(x.shape)).sum(dims)
    if _need(needs, 2) and bias is not None:
        gb = g.sum(dims)
    return _fit((gx, gw, gb), needs)


# BatchNorm1d on [N, C] or [N, C, L] is BatchNorm2d's computation on [N, C, 1, L]: the 2-D
# kernels run on that view and their results are viewed back.


def _as_image(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], t.shape[1], 1, -1)


def batchnorm1d(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """batchnorm2d on x viewed as [N, C, 1, L] (L = 1 for [N, C])."""
    y, mean, invstd = batchnorm2d(_as_image(x), layer, eps=eps, momentum=momentum)
    return y.reshape(x.shape), mean, invstd


def batchnorm1d_recompute(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> Tensor:
    """batchnorm2d_recompute on x viewed as [N, C, 1, L]."""
    return batchnorm2d_recompute(_as_image(x), layer, eps=eps, momentum=momentum).reshape(x.shape)


def batchnorm1d_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    save_mean: Tensor,
    save_invstd: Tensor,
    *,
    eps: float = 1e-05,
    momentum: float | None = 0.1,
    needs: Needs | None = None,
) -> Grads:
    """batchnorm2d_backward on the [N, C, 1, L] views; the input gradient viewed back."""
    grads = batchnorm2d_backward(
        _as_image(g), _as_image(x), layer, save_mean, save_invstd, eps=eps, needs=needs
    )
    if not grads or grads[0] is None:
        return grads
    return (grads[0].reshape(x.shape), *grads[1:])


def batchnorm1d_eval(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> Tensor:
    """batchnorm2d_eval on the [N, C, 1, L] view."""
    return batchnorm2d_eval(_as_image(x), layer, eps=eps, momentum=momentum).reshape(x.shape)


@conventions.implements
def conv1d(x, layer, *, stride, padding, dilation, groups):
    """F.conv2d on the [N, C, 1, L] views (as ATen runs a 1-D convolution)."""
    weight, bias = _weight_bias(layer)
    y = F.conv2d(
        x.unsqueeze(2), weight.unsqueeze(2), bias, (1, stride), (0, padding), (1, dilation), groups
    )
    return y.squeeze(2)


@conventions.implements
def conv1d_backward(g, x, layer, *, stride, padding, dilation, groups, needs):
    """conv2d's gradients on the [N, C, 1, L] views: gx = conv_transpose2d(g, weight)
    (dilated: _transposed_conv), gW = the convolution of x with g, gb = sum."""
    weight = layer.weight
    k = weight.shape[2]
    gx = gw = gb = None
    if _need(needs, 0):
        if dilation == 1:
            op = _restore_padding(x.shape[2], g.shape[2], k, stride, padding)
            gx = F.conv_transpose2d(
                g.unsqueeze(2),
                weight.unsqueeze(2),
                None,
                (1, stride),
                (0, padding),
                (0, op),
                groups,
            )
        else:
            gx = _transposed_conv(
                g.unsqueeze(2),
                weight.unsqueeze(2),
                (1, x.shape[2]),
                (1, stride),
                (0, padding),
                (1, dilation),
                groups,
            )
        gx = gx.squeeze(2)
    if _need(needs, 1):
        gw = _weight_grad(
            x.unsqueeze(2), g.unsqueeze(2), (1, k), (1, dilation), (1, stride), (0, padding), groups
        ).squeeze(2)
    if _need(needs, 2):
        gb = g.sum((0, 2))
    return _fit((gx, gw, gb), needs)


@conventions.implements
def maxpool1d_mask(indices, *, kernel_size, stride, padding, input_length):
    """maxpool2d_mask of the unsqueezed selection, as [N, C, L]."""
    mask = maxpool2d_mask(
        indices.unsqueeze(3),
        kernel_size=(1, kernel_size),
        stride=(1, stride),
        padding=(0, padding),
        input_hw=(1, input_length),
    )
    return mask.squeeze(2)


# The kernels made from this platform's own (see derived's doc).
derived.install(globals())

__all__ = _exports(globals())
