"""The calling convention of every kernel whose formulation differs between the platforms.

Generated code calls ``K.<op>(...)`` the same way whichever platform ``K`` is, leaving out
the keyword arguments equal to their registry default, so the parameters, their order and
their defaults are one thing both platforms share. They are written here once, as stubs;
each platform writes only its formulation, under ``@conventions.implements``, which gives
the function this stub's defaults and annotations and checks at import that its parameters
are the stub's (a platform may add keyword-only parameters of its own, with their defaults,
after them: the gpu convolutions' ``piece_bytes``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from unroller.runtime.common import IGNORE_INDEX, Grads, Needs, Pair

Kernel = TypeVar("Kernel", bound=Callable)


def implements(impl: Kernel) -> Kernel:  # unroller-lint: host-only (runs at import)
    """``impl`` with the defaults and annotations of the stub of the same name below."""
    spec = globals()[impl.__name__]
    want = list(inspect.signature(spec).parameters.values())
    have = list(inspect.signature(impl).parameters.values())
    if [(p.name, p.kind) for p in have[: len(want)]] != [(p.name, p.kind) for p in want] or any(
        p.kind is not p.KEYWORD_ONLY or p.default is p.empty for p in have[len(want) :]
    ):
        raise TypeError(f"{impl.__module__}.{impl.__name__}: parameters differ from the convention")
    impl.__defaults__ = spec.__defaults__
    impl.__kwdefaults__ = {**(spec.__kwdefaults__ or {}), **(impl.__kwdefaults__ or {})} or None
    impl.__annotations__ = {**spec.__annotations__, **impl.__annotations__}
    return impl


# ---------------------------------------------------------------- the stubs


def conv2d(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: Pair = (1, 1),
    padding: Pair = (0, 0),
    dilation: Pair = (1, 1),
    groups: int = 1,
) -> Tensor: ...


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
) -> Grads: ...


def conv_transpose2d(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: Pair = (1, 1),
    padding: Pair = (0, 0),
    output_padding: Pair = (0, 0),
    dilation: Pair = (1, 1),
    groups: int = 1,
) -> Tensor: ...


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
) -> Grads: ...


def batchnorm2d(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> tuple[Tensor, Tensor, Tensor]: ...


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
) -> Grads: ...


def batchnorm2d_recompute(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> Tensor: ...


def batchnorm2d_eval(
    x: Tensor, layer: torch.nn.Module, *, eps: float = 1e-05, momentum: float | None = 0.1
) -> Tensor: ...


def relu_backward(g: Tensor, y: Tensor, *, needs: Needs | None = None) -> Grads: ...


def sigmoid_backward(g: Tensor, y: Tensor, *, needs: Needs | None = None) -> Grads: ...


def tanh_backward(g: Tensor, y: Tensor, *, needs: Needs | None = None) -> Grads: ...


def gelu(x: Tensor, *, approximate: str = "none") -> Tensor: ...


def gelu_backward(
    g: Tensor, x: Tensor, *, approximate: str = "none", needs: Needs | None = None
) -> Grads: ...


def leaky_relu(x: Tensor, *, negative_slope: float = 0.01) -> Tensor: ...


def leaky_relu_backward(
    g: Tensor, x: Tensor, *, negative_slope: float = 0.01, needs: Needs | None = None
) -> Grads: ...


def hardtanh_backward(
    g: Tensor, x: Tensor, *, min_val: float = -1.0, max_val: float = 1.0, needs: Needs | None = None
) -> Grads: ...


def hardsigmoid(x: Tensor) -> Tensor: ...


def hardsigmoid_backward(g: Tensor, x: Tensor, *, needs: Needs | None = None) -> Grads: ...


def hardswish(x: Tensor) -> Tensor: ...


def hardswish_backward(g: Tensor, x: Tensor, *, needs: Needs | None = None) -> Grads: ...


def silu_backward(g: Tensor, x: Tensor, *, needs: Needs | None = None) -> Grads: ...


def mish(x: Tensor) -> Tensor: ...


def mish_backward(g: Tensor, x: Tensor, *, needs: Needs | None = None) -> Grads: ...


def elu_backward(
    g: Tensor, x: Tensor, *, alpha: float = 1.0, needs: Needs | None = None
) -> Grads: ...


def softplus_backward(
    g: Tensor, x: Tensor, *, beta: float = 1.0, threshold: float = 20.0, needs: Needs | None = None
) -> Grads: ...


def nll_loss(log_probs: Tensor, target: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor: ...


def nll_loss_backward(
    g: Tensor,
    target: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_classes: int,
    needs: Needs | None = None,
) -> Grads: ...


def embedding(ids: Tensor, layer: torch.nn.Module, *, padding_idx: int | None = None) -> Tensor: ...


def embedding_backward(
    g: Tensor,
    ids: Tensor,
    layer: torch.nn.Module,
    *,
    padding_idx: int | None = None,
    needs: Needs | None = None,
) -> Grads: ...


def maxpool2d(
    x: Tensor, *, kernel_size: Pair, stride: Pair, padding: Pair = (0, 0), ceil_mode: bool = False
) -> tuple[Tensor, Tensor]: ...


def maxpool2d_backward(
    g: Tensor,
    indices: Tensor,
    *,
    kernel_size: Pair,
    stride: Pair,
    padding: Pair = (0, 0),
    input_hw: Pair,
    needs: Needs | None = None,
) -> Grads: ...


def maxpool2d_mask(
    indices: Tensor, *, kernel_size: Pair, stride: Pair, padding: Pair = (0, 0), input_hw: Pair
) -> Tensor: ...


def avgpool2d(
    x: Tensor, *, kernel_size: Pair, stride: Pair, padding: Pair = (0, 0), ceil_mode: bool = False
) -> Tensor: ...


def avgpool2d_backward(
    g: Tensor,
    *,
    kernel_size: Pair,
    stride: Pair,
    padding: Pair = (0, 0),
    input_hw: Pair,
    needs: Needs | None = None,
) -> Grads: ...


def adaptive_avgpool2d(x: Tensor, *, output_size: Pair) -> Tensor: ...


def adaptive_avgpool2d_backward(
    g: Tensor, *, output_size: Pair, input_hw: Pair, needs: Needs | None = None
) -> Grads: ...


def upsample(
    x: Tensor,
    *,
    scale_factor: tuple[float, float],
    mode: str = "nearest",
    align_corners: bool | None = False,
) -> Tensor: ...


def upsample_backward(
    g: Tensor,
    *,
    scale_factor: tuple[float, float],
    mode: str = "nearest",
    align_corners: bool | None = False,
    input_hw: Pair,
    needs: Needs | None = None,
) -> Grads: ...


def dropout(x: Tensor, *, p: float = 0.5) -> tuple[Tensor, Tensor | None]: ...


def dropout_backward(
    g: Tensor, mask: Tensor | None, *, p: float = 0.5, needs: Needs | None = None
) -> Grads: ...


def drop_path(x: Tensor, *, p: float = 0.0, scale: bool = True) -> tuple[Tensor, Tensor | None]: ...


def drop_path_backward(
    g: Tensor,
    seed: Tensor | None,
    *,
    p: float = 0.0,
    scale: bool = True,
    needs: Needs | None = None,
) -> Grads: ...


def moe(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    top_k: int,
    norm_topk: bool = True,
    router_float32: bool = False,
) -> tuple[Tensor, Tensor]: ...


def moe_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    index: Tensor,
    *,
    top_k: int,
    norm_topk: bool = True,
    router_float32: bool = False,
    needs: Needs | None = None,
) -> Grads: ...


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]: ...


def cross_entropy_backward(
    g: Tensor,
    log_probs: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    needs: Needs | None = None,
) -> Grads: ...


def cross_entropy_low(
    logits: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor: ...


def cross_entropy_low_backward(
    g: Tensor,
    logits: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    needs: Needs | None = None,
) -> Grads: ...


def mse_loss(a: Tensor, b: Tensor) -> Tensor: ...


def mse_loss_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: Needs | None = None) -> Grads: ...


def l1_loss_backward(g: Tensor, a: Tensor, b: Tensor, *, needs: Needs | None = None) -> Grads: ...


def bce_loss(p: Tensor, t: Tensor) -> Tensor: ...


def bce_loss_backward(g: Tensor, p: Tensor, t: Tensor, *, needs: Needs | None = None) -> Grads: ...


def bce_with_logits(x: Tensor, t: Tensor) -> Tensor: ...


def bce_with_logits_backward(
    g: Tensor, x: Tensor, t: Tensor, *, needs: Needs | None = None
) -> Grads: ...


def softmax_backward(
    g: Tensor, y: Tensor, *, dim: int = -1, needs: Needs | None = None
) -> Grads: ...


def log_softmax_backward(
    g: Tensor, y: Tensor, *, dim: int = -1, needs: Needs | None = None
) -> Grads: ...


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor | None]: ...


def scaled_dot_product_attention_backward(
    g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    output: Tensor,
    lse: Tensor,
    seed: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout: float = 0.0,
    needs: Needs | None = None,
) -> Grads: ...


def multihead_attention(
    x: Tensor,
    bias: Tensor | torch.nn.Module | None,
    layer: torch.nn.Module | None = None,
    *,
    num_heads: int,
    is_causal: bool = False,
) -> tuple[Tensor, ...]: ...


def multihead_attention_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    context: Tensor,
    bias: Tensor | None = None,
    *,
    is_causal: bool = False,
    needs: Needs | None = None,
) -> Grads: ...


def layernorm(
    x: Tensor, layer: torch.nn.Module, *, normalized_shape: tuple[int, ...], eps: float = 1e-05
) -> tuple[Tensor, Tensor, Tensor]: ...


def layernorm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    mean: Tensor,
    rstd: Tensor,
    *,
    normalized_shape: tuple[int, ...],
    needs: Needs | None = None,
) -> Grads: ...


def groupnorm(
    x: Tensor, layer: torch.nn.Module, *, num_groups: int, eps: float = 1e-05
) -> tuple[Tensor, Tensor, Tensor]: ...


def groupnorm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    mean: Tensor,
    rstd: Tensor,
    *,
    num_groups: int,
    needs: Needs | None = None,
) -> Grads: ...


def conv1d(
    x: Tensor,
    layer: torch.nn.Module,
    *,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
) -> Tensor: ...


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
) -> Grads: ...


def maxpool1d_mask(
    indices: Tensor, *, kernel_size: int, stride: int, padding: int = 0, input_length: int
) -> Tensor: ...
