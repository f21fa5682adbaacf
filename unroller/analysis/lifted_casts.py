"""The original's casts of activations to float32, lifted while ``verify`` steps it.

The importer traces a network in float32, where ``x.float()`` or ``x.to(torch.float32)`` of
an activation is the identity: the trace has no node for it, and the imported text (one float
dtype) computes without it. ``verify`` judges in float64, where the same cast rounds the
activation to float32 in the original only, so ModernBERT's rotary (``q.float() * cos``) or
a norm computed on ``x.to(torch.float32)`` would differ by float32's rounding (~1e-13 to
1e-7 in the loss) with nothing wrong in either side's arithmetic. While the original steps
in float64, such a cast returns its input, as it does in the traced precision.

Only casts of tensors that need a gradient (activations and parameters: the reference runs
with autograd on, its eval forward too) are lifted. A cast of a constant (a buffer, a table
made from sizes: Llama's ``inv_freq.float()`` before its cos and sin) stays: the trace holds
those as float32 values computed the original's way, and the text keeps them. Operators that
compute in float32 by argument (``softmax(x, dtype=torch.float32)``) are not casts and stay
too: the text keeps them as such (the importer's opaque call, which rounds as they do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CASTS = (torch.Tensor.float, torch.Tensor.to, torch.Tensor.type)


def _target(func: Any, args: tuple, kwargs: dict) -> Any:
    """The dtype a cast call asks for, or None; None too when it also moves the tensor to
    another device (that part must happen: only a pure cast is lifted)."""
    if func is torch.Tensor.float:
        return torch.float32
    tensor, dtype = args[0], kwargs.get("dtype")
    devices = [kwargs["device"]] if kwargs.get("device") is not None else []
    for arg in args[1:]:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif func is torch.Tensor.to and isinstance(arg, torch.Tensor):
            dtype, devices = arg.dtype, [*devices, arg.device]
        elif isinstance(arg, (str, torch.device)):
            devices.append(arg)
    if any(torch.device(d) != tensor.device for d in devices):
        return None
    return dtype


class LiftedCasts(TorchFunctionMode):
    """Casts float64 -> float32 of tensors that need a gradient return the tensor itself
    (see the module docstring); ``lifted`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.lifted = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and args and isinstance(args[0], torch.Tensor):
            tensor = args[0]
            if (
                tensor.dtype == torch.float64
                and tensor.requires_grad
                and _target(func, args, kwargs) == torch.float32
                and not kwargs.get("copy", False)
            ):
                self.lifted += 1
                return tensor
        return func(*args, **kwargs)


def lifted_note(count: int) -> str:
    """verify's note when casts were lifted."""
    return (
        f"the original's float64 step lifted {count} cast(s) of activations to float32 (the "
        "identity in float32, the precision the import traces in, and absent from the text: "
        "unroller.analysis.lifted_casts)"
    )
