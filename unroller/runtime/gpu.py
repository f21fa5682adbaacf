"""Forward and backward kernels of the ``gpu`` platform: plain PyTorch, on CPU or CUDA.

Generated code calls ``K.<op>(...)`` and ``K.<op>_backward(...)`` inside ``torch.no_grad()``.

* forward: ``op(*inputs, *params, *buffers, **kernel_args)`` returns the output, or
  ``(output, *extras)`` for ops that keep extras for backward (batchnorm2d, maxpool2d,
  dropout, cross_entropy).
* backward: ``op_backward(grad_out, *saved, **kernel_args, needs)`` returns one gradient per
  input then one per trainable param, ``None`` where ``needs`` is False. Nothing that is not
  needed is computed: aten backward kernels get an ``output_mask`` built from ``needs``.

Both kernels of an op take the same kernel_args (ops.toml lists them once), so a forward also
accepts, and ignores, the shape facts only its backward uses (``input_hw``, ``sizes``,
``input_shape``), and flatten/reshape backwards accept their forward's ``start_dim``/``shape``.

Every backward calls the aten kernel that autograd's derivative formula calls, with the
tensors autograd would have saved, so in float64 gradients equal ``torch.autograd``'s
(bit for bit for almost every op). Each op's forward and backward sit side by side.
"""

from __future__ import annotations

import torch
from torch import Tensor

# fmt: off
__all__ = [
    "conv2d", "conv2d_backward",
    "conv_transpose2d", "conv_transpose2d_backward",
    "linear", "linear_backward",
    "batchnorm2d", "batchnorm2d_backward", "batchnorm2d_eval",
    "relu", "relu_backward",
    "sigmoid", "sigmoid_backward",
    "tanh", "tanh_backward",
    "gelu", "gelu_backward",
    "leaky_relu", "leaky_relu_backward",
    "maxpool2d", "maxpool2d_backward",
    "avgpool2d", "avgpool2d_backward",
    "adaptive_avgpool2d", "adaptive_avgpool2d_backward",
    "upsample", "upsample_backward",
    "add", "add_backward",
    "mul", "mul_backward",
    "concat", "concat_backward",
    "flatten", "flatten_backward",
    "reshape", "reshape_backward",
    "dropout", "dropout_backward", "dropout_eval",
    "cross_entropy", "cross_entropy_backward",
    "mse_loss", "mse_loss_backward",
    "l1_loss", "l1_loss_backward",
    "bce_loss", "bce_loss_backward",
    "bce_with_logits", "bce_with_logits_backward",
    "accumulate", "add_layer", "tensors", "check_inputs",
]
# fmt: on

_aten = torch.ops.aten
_MEAN = 1  # at::Reduction::Mean
_IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
_NO_OUTPUT_PADDING = (0, 0)
_NO_DILATION = (1, 1)
# Devices on which F.dropout uses the fused aten::native_dropout (ATen's is_fused_kernel_acceptable).
_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")

_Pair = tuple[int, int]
_Needs = tuple[bool, ...]
_Grads = tuple[Tensor | None, ...]


def _need(needs: _Needs, i: int) -> bool:
    return i < len(needs) and bool(needs[i])


def _mask(needs: _Needs, n: int = 3) -> list[bool]:
    return [_need(needs, i) for i in range(n)]


def _pad(grads: tuple[Tensor | None, ...] | list[Tensor | None], needs: _Needs) -> _Grads:
    """Fit the gradients to len(needs), dropping any that were not asked for."""
    out = list(grads)[: len(needs)] + [None] * (len(needs) - len(grads))
    return tuple(t if _need(needs, i) else None for i, t in enumerate(out))


def _shape_only(g: Tensor, shape: tuple[int, ...] | list[int]) -> Tensor:
    """A tensor of `shape` that costs no memory (0-stride scalar), for aten ops that read only
    the input's sizes and options."""
    return g.new_zeros(()).expand(*shape)


# ---------------------------------------------------------------- convolutions


def conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    stride: _Pair,
    padding: _Pair,
    dilation: _Pair,
    groups: int,
) -> Tensor:
    """aten::convolution, as F.conv2d; autograd saves x and weight."""
    return _aten.convolution(
        x, weight, bias, stride, padding, dilation, False, _NO_OUTPUT_PADDING, groups
    )


def conv2d_backward(
    g: Tensor,
    x: Tensor,
    weight: Tensor,
    *,
    stride: _Pair,
    padding: _Pair,
    dilation: _Pair,
    groups: int,
    needs: _Needs,
) -> _Grads:
    """aten::convolution_backward (transposed=False)."""
    mask = _mask(needs)
    if not any(mask):
        return _pad((), needs)
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
    return _pad(grads, needs)


def conv_transpose2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    stride: _Pair,
    padding: _Pair,
    output_padding: _Pair,
    dilation: _Pair,
    groups: int,
) -> Tensor:
    """aten::convolution(transposed=True), as F.conv_transpose2d; autograd saves x and weight."""
    return _aten.convolution(
        x, weight, bias, stride, padding, dilation, True, output_padding, groups
    )


def conv_transpose2d_backward(
    g: Tensor,
    x: Tensor,
    weight: Tensor,
    *,
    stride: _Pair,
    padding: _Pair,
    output_padding: _Pair,
    dilation: _Pair,
    groups: int,
    needs: _Needs,
) -> _Grads:
    """aten::convolution_backward (transposed=True); weight is [in, out/groups, kh, kw]."""
    mask = _mask(needs)
    if not any(mask):
        return _pad((), needs)
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
    return _pad(grads, needs)


# ---------------------------------------------------------------- linear


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear (addmm on the flattened leading dims); autograd saves x and weight."""
    return torch.nn.functional.linear(x, weight, bias)


def linear_backward(g: Tensor, x: Tensor, weight: Tensor, *, needs: _Needs) -> _Grads:
    """addmm/mm backward: gx = g @ W, gW = g^T @ x (mm_mat2_backward's order), gb = sum of g."""
    gx = g.matmul(weight) if _need(needs, 0) else None
    g2 = g.reshape(-1, g.shape[-1])
    gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if _need(needs, 1) else None
    gb = g2.sum(0) if _need(needs, 2) else None
    return _pad((gx, gw, gb), needs)


# ---------------------------------------------------------------- batch norm


def batchnorm2d(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    *,
    eps: float,
    momentum: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """aten::native_batch_norm(training=True), as nn.BatchNorm2d.train(): updates the running
    stats (unbiased var) and num_batches_tracked in place; autograd saves x, weight,
    save_mean, save_invstd."""
    factor = 0.0 if momentum is None else momentum
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if momentum is None:  # cumulative moving average
            factor = 1.0 / float(num_batches_tracked)
    return _aten.native_batch_norm(x, weight, bias, running_mean, running_var, True, factor, eps)


def batchnorm2d_backward(
    g: Tensor,
    x: Tensor,
    weight: Tensor | None,
    save_mean: Tensor,
    save_invstd: Tensor,
    *,
    eps: float,
    momentum: float | None,
    needs: _Needs,
) -> _Grads:
    """aten::native_batch_norm_backward(train=True); running stats are not read in training."""
    mask = _mask(needs)
    if not any(mask):
        return _pad((), needs)
    grads = _aten.native_batch_norm_backward(
        g, x, weight, None, None, save_mean, save_invstd, True, eps, mask
    )
    return _pad(grads, needs)


def batchnorm2d_eval(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    *,
    eps: float,
    momentum: float | None,
) -> Tensor:
    """aten::native_batch_norm(training=False): normalizes with the running stats, changes
    nothing."""
    factor = 0.0 if momentum is None else momentum
    return _aten.native_batch_norm(x, weight, bias, running_mean, running_var, False, factor, eps)[
        0
    ]


# ---------------------------------------------------------------- activations


def relu(x: Tensor) -> Tensor:
    """torch.relu; autograd saves the output."""
    return torch.relu(x)


def relu_backward(g: Tensor, y: Tensor, *, needs: _Needs) -> _Grads:
    """aten::threshold_backward(g, y, 0); y may be the bool mask y > 0 (same result)."""
    if not _need(needs, 0):
        return (None,)
    if y.dtype == torch.bool:
        return (torch.where(y, g, g.new_zeros(())),)
    return (_aten.threshold_backward(g, y, 0),)


def relu_mask(y: Tensor) -> Tensor:
    """What relu's backward needs of its output: y > 0, one bit per element when packed."""
    return y > 0


def sigmoid(x: Tensor) -> Tensor:
    """torch.sigmoid; autograd saves the output."""
    return torch.sigmoid(x)


def sigmoid_backward(g: Tensor, y: Tensor, *, needs: _Needs) -> _Grads:
    """aten::sigmoid_backward(g, y)."""
    return (_aten.sigmoid_backward(g, y) if _need(needs, 0) else None,)


def tanh(x: Tensor) -> Tensor:
    """torch.tanh; autograd saves the output."""
    return torch.tanh(x)


def tanh_backward(g: Tensor, y: Tensor, *, needs: _Needs) -> _Grads:
    """aten::tanh_backward(g, y)."""
    return (_aten.tanh_backward(g, y) if _need(needs, 0) else None,)


def gelu(x: Tensor, *, approximate: str) -> Tensor:
    """aten::gelu; autograd saves the input."""
    return _aten.gelu(x, approximate=approximate)


def gelu_backward(g: Tensor, x: Tensor, *, approximate: str, needs: _Needs) -> _Grads:
    """aten::gelu_backward(g, x, approximate)."""
    return (_aten.gelu_backward(g, x, approximate=approximate) if _need(needs, 0) else None,)


def leaky_relu(x: Tensor, *, negative_slope: float) -> Tensor:
    """aten::leaky_relu; autograd saves the input."""
    return _aten.leaky_relu(x, negative_slope)


def leaky_relu_backward(g: Tensor, x: Tensor, *, negative_slope: float, needs: _Needs) -> _Grads:
    """aten::leaky_relu_backward(g, x, negative_slope, self_is_result=False); x may be the
    bool mask x > 0."""
    if not _need(needs, 0):
        return (None,)
    if x.dtype == torch.bool:
        return (torch.where(x, g, g * negative_slope),)
    return (_aten.leaky_relu_backward(g, x, negative_slope, False),)


def leaky_relu_mask(x: Tensor, *, negative_slope: float) -> Tensor:
    """What leaky_relu's backward needs of its input: x > 0."""
    return x > 0


# ---------------------------------------------------------------- pooling


def maxpool2d(
    x: Tensor, *, kernel_size: _Pair, stride: _Pair, padding: _Pair
) -> tuple[Tensor, Tensor]:
    """aten::max_pool2d_with_indices (dilation 1, floor mode); autograd saves x and indices."""
    return _aten.max_pool2d_with_indices(x, kernel_size, stride, padding, _NO_DILATION, False)


def maxpool2d_backward(
    g: Tensor,
    indices: Tensor,
    *,
    kernel_size: _Pair,
    stride: _Pair,
    padding: _Pair,
    input_hw: _Pair,
    needs: _Needs,
) -> _Grads:
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
    return (
        _aten.max_pool2d_with_indices_backward(
            g, x, kernel_size, stride, padding, _NO_DILATION, False, indices
        ).contiguous(),
    )


def _window_of(size: int, stride: int, padding: int, out: int, device: torch.device) -> Tensor:
    """For each input position, the (non-overlapping) pooling window that covers it."""
    return ((torch.arange(size, device=device) + padding) // stride).clamp_(max=out - 1)


def maxpool2d_mask(
    indices: Tensor, *, kernel_size: _Pair, stride: _Pair, padding: _Pair, input_hw: _Pair
) -> Tensor:
    """The argmax positions as a bool mask of the input's shape (one per window; ties
    resolved as PyTorch resolved them). Exact only for non-overlapping windows."""
    n, c = indices.shape[:2]
    mask = torch.zeros(n, c, input_hw[0] * input_hw[1], dtype=torch.bool, device=indices.device)
    mask.scatter_(2, indices.reshape(n, c, -1), True)
    return mask.reshape(n, c, *input_hw)


def avgpool2d(x: Tensor, *, kernel_size: _Pair, stride: _Pair, padding: _Pair) -> Tensor:
    """aten::avg_pool2d (count_include_pad, floor mode); the backward needs no activation."""
    return _aten.avg_pool2d(x, kernel_size, stride, padding, False, True, None)


def avgpool2d_backward(
    g: Tensor,
    *,
    kernel_size: _Pair,
    stride: _Pair,
    padding: _Pair,
    input_hw: _Pair,
    needs: _Needs,
) -> _Grads:
    """aten::avg_pool2d_backward; it reads only the input's shape, given as a 0-stride tensor."""
    if not _need(needs, 0):
        return (None,)
    shape = _shape_only(g, (*g.shape[:-2], *input_hw))
    return (_aten.avg_pool2d_backward(g, shape, kernel_size, stride, padding, False, True, None),)


def adaptive_avgpool2d(x: Tensor, *, output_size: _Pair) -> Tensor:
    """As F.adaptive_avg_pool2d: a mean over H, W for 1x1, else aten::_adaptive_avg_pool2d."""
    if tuple(output_size) == (1, 1):
        return x.mean((-1, -2), keepdim=True)
    return _aten._adaptive_avg_pool2d(x, output_size)


def adaptive_avgpool2d_backward(
    g: Tensor, *, output_size: _Pair, input_hw: _Pair, needs: _Needs
) -> _Grads:
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
    mode: str,
    align_corners: bool | None,
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
    mode: str,
    align_corners: bool | None,
    input_hw: _Pair,
    needs: _Needs,
) -> _Grads:
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


# ---------------------------------------------------------------- arithmetic and shapes


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b; saves nothing."""
    return a + b


def add_backward(g: Tensor, *, needs: _Needs) -> _Grads:
    """Both gradients are g itself (shared: accumulate() copies before any in-place add)."""
    return (g if _need(needs, 0) else None, g if _need(needs, 1) else None)


def mul(a: Tensor, b: Tensor) -> Tensor:
    """a * b; autograd saves both factors."""
    return a * b


def mul_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: _Needs) -> _Grads:
    """(g * b, g * a), out of place, so a and b may be the same tensor."""
    return (g * b if _need(needs, 0) else None, g * a if _need(needs, 1) else None)


def concat(*xs: Tensor, dim: int) -> Tensor:
    """torch.cat; saves nothing."""
    return torch.cat(xs, dim)


def concat_backward(g: Tensor, *, dim: int, sizes: tuple[int, ...], needs: _Needs) -> _Grads:
    """Views of g along dim, as cat's backward (narrow)."""
    parts = g.split(list(sizes), dim)
    return tuple(p if _need(needs, i) else None for i, p in enumerate(parts))


def flatten(x: Tensor, *, start_dim: int) -> Tensor:
    """torch.flatten; saves nothing."""
    return torch.flatten(x, start_dim)


def flatten_backward(g: Tensor, *, input_shape: tuple[int, ...], needs: _Needs) -> _Grads:
    """g reshaped to (N, *input_shape)."""
    return (g.reshape(g.shape[0], *input_shape) if _need(needs, 0) else None,)


def reshape(x: Tensor, *, shape: tuple[int, ...]) -> Tensor:
    """x.reshape(N, *shape), keeping the batch dim; saves nothing."""
    return x.reshape(x.shape[0], *shape)


def reshape_backward(g: Tensor, *, input_shape: tuple[int, ...], needs: _Needs) -> _Grads:
    """g reshaped to (N, *input_shape)."""
    return (g.reshape(g.shape[0], *input_shape) if _need(needs, 0) else None,)


# ---------------------------------------------------------------- dropout


def dropout(x: Tensor, *, p: float) -> tuple[Tensor, Tensor | None]:
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


def dropout_backward(g: Tensor, mask: Tensor | None, *, p: float, needs: _Needs) -> _Grads:
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


def dropout_eval(x: Tensor, *, p: float) -> Tensor:
    """Identity, as nn.Dropout.eval()."""
    return x


# ---------------------------------------------------------------- losses (mean reduction)


def cross_entropy(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """As F.cross_entropy: aten::_log_softmax then aten::nll_loss_forward; autograd saves the
    log-probabilities (and target, total weight)."""
    log_probs = _aten._log_softmax(logits, 1, False)
    loss, _ = _aten.nll_loss_forward(log_probs, target, None, _MEAN, _IGNORE_INDEX)
    return loss, log_probs


def cross_entropy_backward(
    g: Tensor, log_probs: Tensor, target: Tensor, *, needs: _Needs
) -> _Grads:
    """aten::nll_loss_backward then aten::_log_softmax_backward_data; the total weight is the
    count of non-ignored targets, as nll_loss_forward computes it."""
    if not _need(needs, 0):
        return _pad((), needs)
    total = target.ne(_IGNORE_INDEX).sum().to(log_probs.dtype)
    glp = _aten.nll_loss_backward(g, log_probs, target, None, _MEAN, _IGNORE_INDEX, total)
    return _pad((_aten._log_softmax_backward_data(glp, log_probs, 1, log_probs.dtype),), needs)


def mse_loss(a: Tensor, b: Tensor) -> Tensor:
    """aten::mse_loss(mean); autograd saves both arguments."""
    return _aten.mse_loss(a, b, _MEAN)


def mse_loss_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: _Needs) -> _Grads:
    """aten::mse_loss_backward for a, and with the arguments swapped for b (derivatives.yaml)."""
    ga = _aten.mse_loss_backward(g, a, b, _MEAN) if _need(needs, 0) else None
    gb = _aten.mse_loss_backward(g, b, a, _MEAN) if _need(needs, 1) else None
    return (ga, gb)


def l1_loss(a: Tensor, b: Tensor) -> Tensor:
    """As F.l1_loss: (a - b).abs().mean() (l1_loss is a composite op)."""
    return (a - b).abs().mean()


def l1_loss_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: _Needs) -> _Grads:
    """mean -> abs -> sub backward: sgn(a - b) * g / numel for a, its negation for b."""
    if not (_need(needs, 0) or _need(needs, 1)):
        return (None, None)
    diff = a - b
    ga = g.expand(diff.shape).div(diff.numel()) * diff.sgn()
    return (ga if _need(needs, 0) else None, ga.neg() if _need(needs, 1) else None)


def bce_loss(p: Tensor, t: Tensor) -> Tensor:
    """aten::binary_cross_entropy(mean); autograd saves both arguments."""
    return _aten.binary_cross_entropy(p, t, None, _MEAN)


def bce_loss_backward(g: Tensor, p: Tensor, t: Tensor, *, needs: _Needs) -> _Grads:
    """aten::binary_cross_entropy_backward for p; for t, -logit(p) * g / numel (autograd's
    binary_cross_entropy_target_backward)."""
    gp = _aten.binary_cross_entropy_backward(g, p, t, None, _MEAN) if _need(needs, 0) else None
    gt = torch.logit(p).neg_().mul_(g).div_(t.numel()) if _need(needs, 1) else None
    return (gp, gt)


def bce_with_logits(x: Tensor, t: Tensor) -> Tensor:
    """aten::binary_cross_entropy_with_logits(mean); autograd saves both arguments."""
    return _aten.binary_cross_entropy_with_logits(x, t, None, None, _MEAN)


def bce_with_logits_backward(g: Tensor, x: Tensor, t: Tensor, *, needs: _Needs) -> _Grads:
    """(sigmoid(x) - t) * g / numel for x and -x * g / numel for t, as autograd's
    binary_cross_entropy_with_logits_{,target_}backward."""
    gx = (x.sigmoid() - t).mul_(g).div_(x.numel()) if _need(needs, 0) else None
    gt = x.neg().mul_(g).div_(t.numel()) if _need(needs, 1) else None
    return (gx, gt)


# ---------------------------------------------------------------- helpers for generated code


def accumulate(param: torch.nn.Parameter, grad: Tensor | None) -> None:
    """As autograd's AccumulateGrad: the first gradient is stored, later ones added in place.

    The first one is always copied, into a tensor with the param's layout (as autograd's
    clone_obey_contract), because a kernel's gradient may be shared (add_backward returns g
    for both inputs) or a view (concat_backward): a later in-place add must not write into it.
    """
    if grad is None:
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)
        else:
            param.grad += grad


def add_layer(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """Attach `module` at the dotted `path` of `root`, creating plain nn.Module containers for
    missing intermediate parts, so that root.state_dict() has keys "<path>.<name>".

    Children are written into ``_modules`` directly, not through ``add_module``/``setattr``:
    ``add_module`` refuses a name that is already an attribute of the module ("forward",
    "training", "double", a method of a subclass such as "predict"), and attribute syntax
    cannot spell a keyword or a digit ("class", "0"). state_dict, load_state_dict,
    named_parameters, named_buffers, .to() and .double() all walk ``_modules``, so they work
    with any such name; only attribute access ``root.forward`` still finds the method. One
    caveat: a child named "training" makes its parent's ``.train()``/``.eval()`` raise,
    because nn.Module.__setattr__ refuses to assign the bool flag over a child's name.
    """
    parts = path.split(".")
    if not all(parts):
        raise ValueError(f"add_layer: bad path {path!r}")
    node = root
    for part in parts[:-1]:
        child = node._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            node._modules[part] = child
        node = child
    node._modules[parts[-1]] = module


def tensors(root: torch.nn.Module) -> dict[str, Tensor]:
    """State-dict name -> live parameter or buffer (shared ones under every name), rebuilt on
    each call so it follows .to()/.double(), which replace the tensors."""
    out: dict[str, Tensor] = dict(root.named_parameters(remove_duplicate=False))
    out.update(root.named_buffers(remove_duplicate=False))
    return out


_INT_DTYPES = {"i64": torch.int64, "i32": torch.int32}


def check_inputs(*specs: tuple[str, object, str, tuple[int, ...]]) -> None:
    """Refuse, at the entry of a step, inputs that differ from the model's declarations.

    Each spec is (model name, tensor, declared dtype, declared dims after N). A wrong
    shape would otherwise fail deep inside a kernel or a codec with a message about
    something else. Float declarations accept any floating dtype, because a module moved
    with ``.double()`` or ``.half()`` computes in its parameters' dtype; integer ones
    (class indices) need exactly the declared dtype. All inputs share one batch size.
    """
    batch = None
    for name, value, dtype, dims in specs:
        if not isinstance(value, Tensor):
            raise ValueError(f"input '{name}': expected a tensor, got {type(value).__name__}")
        expected = f"{dtype}[N, {', '.join(map(str, dims))}]" if dims else f"{dtype}[N]"
        given = f"{value.dtype} of shape {list(value.shape)}"
        if tuple(value.shape[1:]) != tuple(dims) or value.dim() != len(dims) + 1:
            raise ValueError(f"input '{name}': expected shape {expected}, got {given}")
        wanted = _INT_DTYPES.get(dtype)
        if (value.dtype != wanted) if wanted is not None else not value.is_floating_point():
            kind = wanted if wanted is not None else "a floating-point dtype"
            raise ValueError(f"input '{name}': expected {expected} ({kind}), got {given}")
        if batch is None:
            batch = (name, value.shape[0])
        elif value.shape[0] != batch[1]:
            raise ValueError(
                f"input '{name}': batch size {value.shape[0]} differs from "
                f"'{batch[0]}' ({batch[1]})"
            )
    if batch is not None and batch[1] == 0:
        raise ValueError(f"input '{batch[0]}': the batch is empty")


# ---------------------------------------------------------------- stash accounting


def stash(log: list, key: str, raw: Tensor, *forms: tuple) -> None:
    """Record one tensor kept compressed: its raw bytes and the bytes of each stored form
    (``(compressor, packed tensors)`` pairs)."""
    stored = sum(t.numel() * t.element_size() for _, packed in forms for t in packed)
    label = " + ".join(repr(codec) for codec, _ in forms)
    log.append((key, label, tuple(raw.shape), raw.numel() * raw.element_size(), stored))


def stash_raw(log: list, tensors: dict[str, Tensor]) -> None:
    """Record the tensors kept as they are."""
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        log.append((key, "raw", tuple(t.shape), nbytes, nbytes))


def stash_report(log: list) -> dict:
    """The rows ``stash`` recorded, with totals (what ``model.stash_report()`` returns)."""
    rows = [
        {"tensor": k, "compressor": c, "shape": list(s), "raw_bytes": r, "stored_bytes": b}
        for k, c, s, r, b in log
    ]
    return {
        "rows": rows,
        "total_raw_bytes": sum(r["raw_bytes"] for r in rows),
        "total_stored_bytes": sum(r["stored_bytes"] for r in rows),
    }
