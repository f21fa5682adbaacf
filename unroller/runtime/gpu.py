"""Forward and backward kernels of the ``gpu`` platform: plain PyTorch, on CPU or CUDA.

Generated code calls ``K.<op>(...)`` and ``K.<op>_backward(...)`` inside ``torch.no_grad()``;
the calling convention, the layer handles and the helpers are described in
``unroller.runtime.common``, which holds everything this module shares with ``ipu``. Here
are only the kernels whose gpu code differs.

Every backward calls the aten kernel that autograd's derivative formula calls, with the
tensors autograd would have saved, so in float64 gradients equal ``torch.autograd``'s
(bit for bit for almost every op), and nothing that is not needed is computed: aten backward
kernels get an ``output_mask`` built from ``needs``. Each op's forward and backward sit side
by side.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Shared kernels and helpers, exported from here as gpu kernels (see __all__ at the end).
from unroller.runtime.common import (  # noqa: F401
    IGNORE_INDEX,
    Grads,
    Needs,
    Pair,
    _ceil_mode_of,
    _exports,
    _fit,
    _need,
    _need_mask,
    _norm_tensors,
    _weight_bias,
    accumulate,
    add,
    add_backward,
    add_layer,
    check_inputs,
    collect,
    concat,
    concat_backward,
    dropout_eval,
    flatten,
    flatten_backward,
    l1_loss,
    layers,
    leaky_relu_mask,
    linear,
    linear_backward,
    mul,
    mul_backward,
    relu,
    relu_mask,
    reshape,
    reshape_backward,
    sigmoid,
    stash,
    stash_log,
    stash_raw,
    stash_report,
    tanh,
    tensors,
    unsupported,
)

_aten = torch.ops.aten
_MEAN = 1  # at::Reduction::Mean
_NO_OUTPUT_PADDING = (0, 0)
_NO_DILATION = (1, 1)
# Devices on which F.dropout uses the fused aten::native_dropout (ATen's is_fused_kernel_acceptable).
_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def _shape_only(g: Tensor, shape: tuple[int, ...] | list[int]) -> Tensor:
    """A tensor of `shape` that costs no memory (0-stride scalar), for aten ops that read only
    the input's sizes and options."""
    return g.new_zeros(()).expand(*shape)


# ---------------------------------------------------------------- convolutions


def conv2d(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: Pair = (1, 1),
    padding: Pair = (0, 0),
    dilation: Pair = (1, 1),
    groups: int = 1,
) -> Tensor:
    """aten::convolution, as F.conv2d; autograd saves x and weight."""
    weight, bias = _weight_bias(layer)
    return _aten.convolution(
        x, weight, bias, stride, padding, dilation, False, _NO_OUTPUT_PADDING, groups
    )


def conv2d_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: Pair = (1, 1),
    padding: Pair = (0, 0),
    dilation: Pair = (1, 1),
    groups: int = 1,
    needs: Needs | None = None,
) -> Grads:
    """aten::convolution_backward (transposed=False)."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = layer.weight
    grads = _aten.convolution_backward(
        g,
        x,
        weight,
        [weight.shape[0]],
        stride,
        padding,
        dilation,
        False,
        _NO_OUTPUT_PADDING,
        groups,
        mask,
    )
    return _fit(grads, needs)


def conv_transpose2d(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: Pair = (1, 1),
    padding: Pair = (0, 0),
    output_padding: Pair = (0, 0),
    dilation: Pair = (1, 1),
    groups: int = 1,
) -> Tensor:
    """aten::convolution(transposed=True), as F.conv_transpose2d; autograd saves x and weight."""
    weight, bias = _weight_bias(layer)
    return _aten.convolution(
        x, weight, bias, stride, padding, dilation, True, output_padding, groups
    )


def conv_transpose2d_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: Pair = (1, 1),
    padding: Pair = (0, 0),
    output_padding: Pair = (0, 0),
    dilation: Pair = (1, 1),
    groups: int = 1,
    needs: Needs | None = None,
) -> Grads:
    """aten::convolution_backward (transposed=True); weight is [in, out/groups, kh, kw]."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = layer.weight
    grads = _aten.convolution_backward(
        g,
        x,
        weight,
        [weight.shape[1] * groups],
        stride,
        padding,
        dilation,
        True,
        output_padding,
        groups,
        mask,
    )
    return _fit(grads, needs)


# ---------------------------------------------------------------- batch norm


def batchnorm2d(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """aten::native_batch_norm(training=True), as nn.BatchNorm2d.train(): updates the layer's
    running stats (unbiased var) and num_batches_tracked in place; autograd saves x, weight,
    save_mean, save_invstd."""
    weight, bias, running_mean, running_var, num_batches_tracked = _norm_tensors(layer)
    factor = 0.0 if momentum is None else momentum
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if momentum is None:  # cumulative moving average
            factor = 1.0 / float(num_batches_tracked)
    return _aten.native_batch_norm(x, weight, bias, running_mean, running_var, True, factor, eps)


def batchnorm2d_backward(
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
    """aten::native_batch_norm_backward(train=True); running stats are not read in training."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = getattr(layer, "weight", None)
    grads = _aten.native_batch_norm_backward(
        g, x, weight, None, None, save_mean, save_invstd, True, eps, mask
    )
    return _fit(grads, needs)


def batchnorm2d_eval(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> Tensor:
    """aten::native_batch_norm(training=False): normalizes with the running stats, changes
    nothing."""
    weight, bias, running_mean, running_var, _ = _norm_tensors(layer)
    factor = 0.0 if momentum is None else momentum
    batch_stats = running_mean is None  # track_running_stats=False: torch uses batch stats
    out = _aten.native_batch_norm(
        x, weight, bias, running_mean, running_var, batch_stats, factor, eps
    )
    return out[0]


# ---------------------------------------------------------------- activations


def relu_backward(g: Tensor, y: Tensor, *, needs: Needs | None = None) -> Grads:
    """aten::threshold_backward(g, y, 0); y may be the bool mask y > 0 (same result)."""
    if not _need(needs, 0):
        return (None,)
    if y.dtype == torch.bool:
        return (torch.where(y, g, g.new_zeros(())),)
    return (_aten.threshold_backward(g, y, 0),)


def sigmoid_backward(g: Tensor, y: Tensor, *, needs: Needs | None = None) -> Grads:
    """aten::sigmoid_backward(g, y)."""
    return (_aten.sigmoid_backward(g, y) if _need(needs, 0) else None,)


def tanh_backward(g: Tensor, y: Tensor, *, needs: Needs | None = None) -> Grads:
    """aten::tanh_backward(g, y)."""
    return (_aten.tanh_backward(g, y) if _need(needs, 0) else None,)


def gelu(x: Tensor, *, approximate: str = "none") -> Tensor:
    """aten::gelu; autograd saves the input."""
    return _aten.gelu(x, approximate=approximate)


def gelu_backward(
    g: Tensor, x: Tensor, *, approximate: str = "none", needs: Needs | None = None
) -> Grads:
    """aten::gelu_backward(g, x, approximate)."""
    return (_aten.gelu_backward(g, x, approximate=approximate) if _need(needs, 0) else None,)


def leaky_relu(x: Tensor, *, negative_slope: float = 0.01) -> Tensor:
    """aten::leaky_relu; autograd saves the input."""
    return _aten.leaky_relu(x, negative_slope)


def leaky_relu_backward(
    g: Tensor, x: Tensor, *, negative_slope: float = 0.01, needs: Needs | None = None
) -> Grads:
    """aten::leaky_relu_backward(g, x, negative_slope, self_is_result=False); x may be the
    bool mask x > 0."""
    if not _need(needs, 0):
        return (None,)
    if x.dtype == torch.bool:
        return (torch.where(x, g, g * negative_slope),)
    return (_aten.leaky_relu_backward(g, x, negative_slope, False),)


# ---------------------------------------------------------------- pooling


def maxpool2d(
    x: Tensor, *, kernel_size: Pair, stride: Pair, padding: Pair = (0, 0), ceil_mode: bool = False
) -> tuple[Tensor, Tensor]:
    """aten::max_pool2d_with_indices (dilation 1); autograd saves x and indices."""
    return _aten.max_pool2d_with_indices(x, kernel_size, stride, padding, _NO_DILATION, ceil_mode)


def maxpool2d_backward(
    g: Tensor,
    indices: Tensor,
    *,
    kernel_size: Pair,
    stride: Pair,
    padding: Pair = (0, 0),
    input_hw: Pair,
    needs: Needs | None = None,
) -> Grads:
    """aten::max_pool2d_with_indices_backward, which reads only the input's sizes, so no
    activation is kept: just the indices, or (non-overlapping windows) a bool mask of the
    argmax positions from ``maxpool2d_mask``, whose gradient is the same, bit for bit."""
    if not _need(needs, 0):
        return (None,)
    n, c = g.shape[:2]
    if indices.dtype == torch.bool:
        rows = _window_of(input_hw[0], stride[0], padding[0], g.shape[2], g.device)
        cols = _window_of(input_hw[1], stride[1], padding[1], g.shape[3], g.device)
        spread = g.index_select(2, rows).index_select(3, cols)
        return (torch.where(indices, spread, spread.new_zeros(())),)
    x = _shape_only(g, (n, c, *input_hw))
    ceil_mode = _ceil_mode_of(input_hw, g.shape[2:], kernel_size, stride, padding)
    return (
        _aten.max_pool2d_with_indices_backward(
            g, x, kernel_size, stride, padding, _NO_DILATION, ceil_mode, indices
        ).contiguous(),
    )


def _window_of(size: int, stride: int, padding: int, out: int, device: torch.device) -> Tensor:
    """For each input position, the (non-overlapping) pooling window that covers it."""
    return ((torch.arange(size, device=device) + padding) // stride).clamp_(max=out - 1)


def maxpool2d_mask(
    indices: Tensor,
    *,
    kernel_size: Pair,
    stride: Pair,
    padding: Pair = (0, 0),
    input_hw: Pair,
) -> Tensor:
    """The argmax positions as a bool mask of the input's shape (one per window; ties
    resolved as PyTorch resolved them). Exact only for non-overlapping windows."""
    n, c = indices.shape[:2]
    mask = torch.zeros(n, c, input_hw[0] * input_hw[1], dtype=torch.bool, device=indices.device)
    mask.scatter_(2, indices.reshape(n, c, -1), True)
    return mask.reshape(n, c, *input_hw)


def avgpool2d(
    x: Tensor, *, kernel_size: Pair, stride: Pair, padding: Pair = (0, 0), ceil_mode: bool = False
) -> Tensor:
    """aten::avg_pool2d (count_include_pad); the backward needs no activation."""
    return _aten.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, True, None)


def avgpool2d_backward(
    g: Tensor,
    *,
    kernel_size: Pair,
    stride: Pair,
    padding: Pair = (0, 0),
    input_hw: Pair,
    needs: Needs | None = None,
) -> Grads:
    """aten::avg_pool2d_backward; it reads only the input's shape, given as a 0-stride tensor."""
    if not _need(needs, 0):
        return (None,)
    shape = _shape_only(g, (*g.shape[:-2], *input_hw))
    ceil_mode = _ceil_mode_of(input_hw, g.shape[-2:], kernel_size, stride, padding)
    return (
        _aten.avg_pool2d_backward(g, shape, kernel_size, stride, padding, ceil_mode, True, None),
    )


def adaptive_avgpool2d(x: Tensor, *, output_size: Pair) -> Tensor:
    """As F.adaptive_avg_pool2d: a mean over H, W for 1x1, else aten::_adaptive_avg_pool2d."""
    if tuple(output_size) == (1, 1):
        return x.mean((-1, -2), keepdim=True)
    return _aten._adaptive_avg_pool2d(x, output_size)


def adaptive_avgpool2d_backward(
    g: Tensor, *, output_size: Pair, input_hw: Pair, needs: Needs | None = None
) -> Grads:
    """mean's backward (expand / numel) for 1x1, else aten::_adaptive_avg_pool2d_backward
    given a 0-stride tensor of the input's shape."""
    if not _need(needs, 0):
        return (None,)
    shape = (*g.shape[:-2], *input_hw)
    if tuple(output_size) == (1, 1):
        return (g.expand(shape).div(input_hw[0] * input_hw[1]),)
    return (_aten._adaptive_avg_pool2d_backward(g, _shape_only(g, shape)),)


# ---------------------------------------------------------------- upsampling


def _upsample_size(
    hw: tuple[int, int] | torch.Size, scale_factor: tuple[float, float]
) -> list[int]:
    # as ATen's compute_output_size for scale factors: int64(in * scale), i.e. floor
    return [int(hw[0] * scale_factor[0]), int(hw[1] * scale_factor[1])]


def upsample(
    x: Tensor,
    *,
    scale_factor: tuple[float, float],
    mode: str = "nearest",
    align_corners: bool | None = False,
) -> Tensor:
    """As nn.Upsample(scale_factor=...): aten::upsample_{nearest,bilinear}2d with the scales
    passed through, as F.interpolate with recompute_scale_factor=None; saves nothing."""
    size = _upsample_size(x.shape[-2:], scale_factor)
    sh, sw = float(scale_factor[0]), float(scale_factor[1])
    if mode == "nearest":
        return _aten.upsample_nearest2d(x, size, sh, sw)
    if mode == "bilinear":
        return _aten.upsample_bilinear2d(x, size, bool(align_corners), sh, sw)
    raise ValueError(f"upsample: unsupported mode {mode!r}")


def upsample_backward(
    g: Tensor,
    *,
    scale_factor: tuple[float, float],
    mode: str = "nearest",
    align_corners: bool | None = False,
    input_hw: Pair,
    needs: Needs | None = None,
) -> Grads:
    """aten::upsample_{nearest,bilinear}2d_backward; sizes come from g and input_hw."""
    if not _need(needs, 0):
        return (None,)
    out_hw = list(g.shape[-2:])
    in_size = [*g.shape[:-2], *input_hw]
    sh, sw = float(scale_factor[0]), float(scale_factor[1])
    if mode == "nearest":
        return (_aten.upsample_nearest2d_backward(g, out_hw, in_size, sh, sw),)
    if mode == "bilinear":
        return (
            _aten.upsample_bilinear2d_backward(g, out_hw, in_size, bool(align_corners), sh, sw),
        )
    raise ValueError(f"upsample: unsupported mode {mode!r}")


# ---------------------------------------------------------------- dropout


def dropout(x: Tensor, *, p: float = 0.5) -> tuple[Tensor, Tensor | None]:
    """As F.dropout(train=True), same random draws. Saves a bool keep-mask (autograd saves float
    noise on CPU, the same bool mask from aten::native_dropout on CUDA). The mask is None for
    p == 0 (identity) and p == 1 (all dropped)."""
    if p == 0 or x.numel() == 0:
        return x, None
    if p == 1:
        return x * x.new_zeros(()), None
    if x.device.type in _FUSED_DROPOUT_DEVICES:
        return _aten.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    mask = noise.bool()
    return x * noise.div_(1 - p), mask


def dropout_backward(
    g: Tensor, mask: Tensor | None, *, p: float = 0.5, needs: Needs | None = None
) -> Grads:
    """g * noise with noise rebuilt from the mask exactly as forward made it (CPU), or
    aten::native_dropout_backward (fused devices)."""
    if not _need(needs, 0):
        return (None,)
    if p == 1:
        return (g * g.new_zeros(()),)
    if mask is None:
        return (g,)
    if g.device.type in _FUSED_DROPOUT_DEVICES:
        return (_aten.native_dropout_backward(g, mask, 1.0 / (1.0 - p)),)
    return (g * mask.to(g.dtype).div_(1 - p),)


# ---------------------------------------------------------------- losses (mean reduction)


def cross_entropy(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """As F.cross_entropy: aten::_log_softmax then aten::nll_loss_forward; autograd saves the
    log-probabilities (and target, total weight)."""
    log_probs = _aten._log_softmax(logits, 1, False)
    loss, _ = _aten.nll_loss_forward(log_probs, target, None, _MEAN, IGNORE_INDEX)
    return loss, log_probs


def cross_entropy_backward(
    g: Tensor, log_probs: Tensor, target: Tensor, *, needs: Needs | None = None
) -> Grads:
    """aten::nll_loss_backward then aten::_log_softmax_backward_data; the total weight is the
    count of non-ignored targets, as nll_loss_forward computes it."""
    if not _need(needs, 0):
        return _fit((), needs)
    total = target.ne(IGNORE_INDEX).sum().to(log_probs.dtype)
    glp = _aten.nll_loss_backward(g, log_probs, target, None, _MEAN, IGNORE_INDEX, total)
    return _fit((_aten._log_softmax_backward_data(glp, log_probs, 1, log_probs.dtype),), needs)


def mse_loss(a: Tensor, b: Tensor) -> Tensor:
    """aten::mse_loss(mean); autograd saves both arguments."""
    return _aten.mse_loss(a, b, _MEAN)


def mse_loss_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: Needs | None = None) -> Grads:
    """aten::mse_loss_backward for a, and with the arguments swapped for b (derivatives.yaml)."""
    ga = _aten.mse_loss_backward(g, a, b, _MEAN) if _need(needs, 0) else None
    gb = _aten.mse_loss_backward(g, b, a, _MEAN) if _need(needs, 1) else None
    return (ga, gb)


def l1_loss_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: Needs | None = None) -> Grads:
    """mean -> abs -> sub backward: sgn(a - b) * g / numel for a, its negation for b."""
    if not (_need(needs, 0) or _need(needs, 1)):
        return (None, None)
    diff = a - b
    ga = g.expand(diff.shape).div(diff.numel()) * diff.sgn()
    return (ga if _need(needs, 0) else None, ga.neg() if _need(needs, 1) else None)


def bce_loss(p: Tensor, t: Tensor) -> Tensor:
    """aten::binary_cross_entropy(mean); autograd saves both arguments."""
    return _aten.binary_cross_entropy(p, t, None, _MEAN)


def bce_loss_backward(g: Tensor, p: Tensor, t: Tensor, *, needs: Needs | None = None) -> Grads:
    """aten::binary_cross_entropy_backward for p; for t, -logit(p) * g / numel (autograd's
    binary_cross_entropy_target_backward)."""
    gp = _aten.binary_cross_entropy_backward(g, p, t, None, _MEAN) if _need(needs, 0) else None
    gt = torch.logit(p).neg_().mul_(g).div_(t.numel()) if _need(needs, 1) else None
    return (gp, gt)


def bce_with_logits(x: Tensor, t: Tensor) -> Tensor:
    """aten::binary_cross_entropy_with_logits(mean); autograd saves both arguments."""
    return _aten.binary_cross_entropy_with_logits(x, t, None, None, _MEAN)


def bce_with_logits_backward(
    g: Tensor, x: Tensor, t: Tensor, *, needs: Needs | None = None
) -> Grads:
    """(sigmoid(x) - t) * g / numel for x and -x * g / numel for t, as autograd's
    binary_cross_entropy_with_logits_{,target_}backward."""
    gx = (x.sigmoid() - t).mul_(g).div_(x.numel()) if _need(needs, 0) else None
    gt = x.neg().mul_(g).div_(t.numel()) if _need(needs, 1) else None
    return (gx, gt)


# ---------------------------------------------------------------- normalisation and 1-D ops (v2)


def layernorm(
    x: Tensor, layer: torch.nn.Module, *, normalized_shape: tuple[int, ...], eps: float = 1e-05
) -> tuple[Tensor, Tensor, Tensor]:
    """aten::native_layer_norm, as F.layer_norm; autograd saves x, mean, rstd, weight, bias."""
    weight, bias = _weight_bias(layer)
    return _aten.native_layer_norm(x, normalized_shape, weight, bias, eps)


def layernorm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    mean: Tensor,
    rstd: Tensor,
    *,
    normalized_shape: tuple[int, ...],
    needs: Needs | None = None,
) -> Grads:
    """aten::native_layer_norm_backward; bias is read only for its presence (its gradient)."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight, bias = _weight_bias(layer)
    grads = _aten.native_layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias, mask)
    return _fit(grads, needs)


def groupnorm(
    x: Tensor, layer: torch.nn.Module, *, num_groups: int, eps: float = 1e-05
) -> tuple[Tensor, Tensor, Tensor]:
    """aten::native_group_norm, as F.group_norm; autograd saves x, weight, mean, rstd."""
    weight, bias = _weight_bias(layer)
    n, c = x.shape[:2]
    return _aten.native_group_norm(x, weight, bias, n, c, x.shape[2:].numel(), num_groups, eps)


def groupnorm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    mean: Tensor,
    rstd: Tensor,
    *,
    num_groups: int,
    needs: Needs | None = None,
) -> Grads:
    """aten::native_group_norm_backward."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight, _ = _weight_bias(layer)
    n, c = x.shape[:2]
    grads = _aten.native_group_norm_backward(
        g, x, mean, rstd, weight, n, c, x.shape[2:].numel(), num_groups, mask
    )
    return _fit(grads, needs)


# BatchNorm1d is BatchNorm2d's computation on [N, C] or [N, C, L]: aten::native_batch_norm
# takes any rank, so the 2-D kernels serve unchanged.
batchnorm1d = batchnorm2d
batchnorm1d_backward = batchnorm2d_backward
batchnorm1d_eval = batchnorm2d_eval


def conv1d(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
) -> Tensor:
    """aten::convolution on [N, C, L], as F.conv1d; autograd saves x and weight."""
    weight, bias = _weight_bias(layer)
    return _aten.convolution(x, weight, bias, [stride], [padding], [dilation], False, [0], groups)


def conv1d_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
    needs: Needs | None = None,
) -> Grads:
    """aten::convolution_backward with one spatial dim."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = layer.weight
    grads = _aten.convolution_backward(
        g, x, weight, [weight.shape[0]], [stride], [padding], [dilation], False, [0], groups, mask
    )
    return _fit(grads, needs)


# The 1-D pools are the 2-D ones on [N, C, 1, L] with a (1, k) window, exactly as ATen's
# max_pool1d_with_indices / avg_pool1d / adaptive_avg_pool1d compute them (so autograd's
# gradients are the 2-D backward kernels' too).


def maxpool1d(
    x: Tensor, *, kernel_size: int, stride: int, padding: int = 0, ceil_mode: bool = False
) -> tuple[Tensor, Tensor]:
    """maxpool2d on x.unsqueeze(2): the output and PyTorch's indices (positions in L)."""
    y, indices = maxpool2d(
        x.unsqueeze(2),
        kernel_size=(1, kernel_size),
        stride=(1, stride),
        padding=(0, padding),
        ceil_mode=ceil_mode,
    )
    return y.squeeze(2), indices.squeeze(2)


def maxpool1d_backward(
    g: Tensor,
    indices: Tensor,
    *,
    kernel_size: int,
    stride: int,
    padding: int = 0,
    input_length: int,
    needs: Needs | None = None,
) -> Grads:
    """maxpool2d_backward on the unsqueezed gradient; indices may be maxpool1d_mask's mask."""
    if not _need(needs, 0):
        return (None,)
    (gx,) = maxpool2d_backward(
        g.unsqueeze(2),
        indices.unsqueeze(2),
        kernel_size=(1, kernel_size),
        stride=(1, stride),
        padding=(0, padding),
        input_hw=(1, input_length),
    )
    return (gx.squeeze(2),)


def maxpool1d_mask(
    indices: Tensor,
    *,
    kernel_size: int,
    stride: int,
    padding: int = 0,
    input_length: int,
) -> Tensor:
    """The argmax positions as a bool mask of the input's shape (non-overlapping windows)."""
    n, c = indices.shape[:2]
    mask = torch.zeros(n, c, input_length, dtype=torch.bool, device=indices.device)
    return mask.scatter_(2, indices, True)


def avgpool1d(
    x: Tensor, *, kernel_size: int, stride: int, padding: int = 0, ceil_mode: bool = False
) -> Tensor:
    """avgpool2d on x.unsqueeze(2), as ATen's avg_pool1d."""
    y = avgpool2d(
        x.unsqueeze(2),
        kernel_size=(1, kernel_size),
        stride=(1, stride),
        padding=(0, padding),
        ceil_mode=ceil_mode,
    )
    return y.squeeze(2)


def avgpool1d_backward(
    g: Tensor,
    *,
    kernel_size: int,
    stride: int,
    padding: int = 0,
    input_length: int,
    needs: Needs | None = None,
) -> Grads:
    """avgpool2d_backward on the unsqueezed gradient."""
    if not _need(needs, 0):
        return (None,)
    (gx,) = avgpool2d_backward(
        g.unsqueeze(2),
        kernel_size=(1, kernel_size),
        stride=(1, stride),
        padding=(0, padding),
        input_hw=(1, input_length),
    )
    return (gx.squeeze(2),)


def adaptive_avgpool1d(x: Tensor, *, output_size: int) -> Tensor:
    """adaptive_avgpool2d on x.unsqueeze(2) with output (1, output_size)."""
    return adaptive_avgpool2d(x.unsqueeze(2), output_size=(1, output_size)).squeeze(2)


def adaptive_avgpool1d_backward(
    g: Tensor, *, output_size: int, input_length: int, needs: Needs | None = None
) -> Grads:
    """adaptive_avgpool2d_backward on the unsqueezed gradient."""
    if not _need(needs, 0):
        return (None,)
    (gx,) = adaptive_avgpool2d_backward(
        g.unsqueeze(2), output_size=(1, output_size), input_hw=(1, input_length)
    )
    return (gx.squeeze(2),)


__all__ = _exports(globals())
