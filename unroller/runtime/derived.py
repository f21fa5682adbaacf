"""Kernels built from a platform's own: written once, made for each platform from its kernels.

The 1-D pools are the 2-D ones on [N, C, 1, L] with a (1, k) window, exactly as ATen's
max_pool1d_with_indices / avg_pool1d / adaptive_avg_pool1d compute them (so autograd's
gradients are the 2-D backward kernels' too); attention in evaluation mode is the training
kernel without dropout; relu6's gradient is hardtanh's on [0, 6] (F.relu6 is hardtanh). ``kernels`` makes them from a platform's namespace, which then holds
them as its own (``derived.install(globals())``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from unroller.runtime.common import Grads, Needs, _need

Kernel = Callable[..., Any]


def install(namespace: dict[str, Any]) -> None:
    """Adds the derived kernels to a platform module's namespace (at its import, on the host)."""
    namespace.update(kernels(namespace))


def kernels(platform: Mapping[str, Any]) -> dict[str, Kernel]:
    """The derived kernels of the platform whose kernels ``platform`` holds by name."""
    return {
        **_max_pools_1d(platform["maxpool2d"], platform["maxpool2d_backward"]),
        **_avg_pools_1d(platform["avgpool2d"], platform["avgpool2d_backward"]),
        **_adaptive_pools_1d(
            platform["adaptive_avgpool2d"], platform["adaptive_avgpool2d_backward"]
        ),
        **_attention_eval(platform["scaled_dot_product_attention"]),
        **_relu6(platform["hardtanh_backward"]),
    }


def _made(*functions: Kernel) -> dict[str, Kernel]:
    """Kernels by name, reported as the runtime's (``common._exports`` lists them)."""
    return {f.__name__: f for f in functions}


def _max_pools_1d(maxpool2d: Kernel, maxpool2d_backward: Kernel) -> dict[str, Kernel]:
    def maxpool1d(
        x: Tensor, *, kernel_size: int, stride: int, padding: int = 0, ceil_mode: bool = False
    ) -> tuple[Tensor, Tensor]:
        """maxpool2d on x.unsqueeze(2): the output and the platform's indices with the unit
        height dim dropped (PyTorch's positions in L, or the ipu selection [N, C, k, Lo])."""
        y, indices = maxpool2d(
            x.unsqueeze(2),
            kernel_size=(1, kernel_size),
            stride=(1, stride),
            padding=(0, padding),
            ceil_mode=ceil_mode,
        )
        return y.squeeze(2), indices.squeeze(indices.dim() - 2)

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
        """maxpool2d_backward on the unsqueezed gradient and indices (an ipu selection
        [N, C, k, Lo] gets its unit dim back before Lo; a mask of maxpool1d_mask, [N, C, L],
        and PyTorch's indices, [N, C, Lo], before L)."""
        if not _need(needs, 0):
            return (None,)
        (gx,) = maxpool2d_backward(
            g.unsqueeze(2),
            indices.unsqueeze(3 if indices.dim() == 4 else 2),
            kernel_size=(1, kernel_size),
            stride=(1, stride),
            padding=(0, padding),
            input_hw=(1, input_length),
        )
        return (gx.squeeze(2),)

    return _made(maxpool1d, maxpool1d_backward)


def _avg_pools_1d(avgpool2d: Kernel, avgpool2d_backward: Kernel) -> dict[str, Kernel]:
    def avgpool1d(
        x: Tensor, *, kernel_size: int, stride: int, padding: int = 0, ceil_mode: bool = False
    ) -> Tensor:
        """avgpool2d on x.unsqueeze(2), as ATen's avg_pool1d (count_include_pad)."""
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

    return _made(avgpool1d, avgpool1d_backward)


def _adaptive_pools_1d(pool2d: Kernel, pool2d_backward: Kernel) -> dict[str, Kernel]:
    def adaptive_avgpool1d(x: Tensor, *, output_size: int) -> Tensor:
        """adaptive_avgpool2d on x.unsqueeze(2) with output (1, output_size)."""
        return pool2d(x.unsqueeze(2), output_size=(1, output_size)).squeeze(2)

    def adaptive_avgpool1d_backward(
        g: Tensor, *, output_size: int, input_length: int, needs: Needs | None = None
    ) -> Grads:
        """adaptive_avgpool2d_backward on the unsqueezed gradient."""
        if not _need(needs, 0):
            return (None,)
        (gx,) = pool2d_backward(
            g.unsqueeze(2), output_size=(1, output_size), input_hw=(1, input_length)
        )
        return (gx.squeeze(2),)

    return _made(adaptive_avgpool1d, adaptive_avgpool1d_backward)


def _attention_eval(attention: Kernel) -> dict[str, Kernel]:
    def scaled_dot_product_attention_eval(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None = None,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        dropout: float = 0.0,
    ) -> Tensor:
        """The attention in evaluation mode: no dropout (as torch modules pass dropout_p=0 then)."""
        return attention(q, k, v, bias, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)[0]

    return _made(scaled_dot_product_attention_eval)


def _relu6(hardtanh_backward: Kernel) -> dict[str, Kernel]:
    def relu6_backward(g: Tensor, x: Tensor, *, needs: Needs | None = None) -> Grads:
        """hardtanh_backward(g, x, 0, 6); x may be the bool mask."""
        return hardtanh_backward(g, x, min_val=0.0, max_val=6.0, needs=needs)

    return _made(relu6_backward)
