"""Mixed precision at run time: the ``cast`` kernels.

A mixed-precision step (``--precision bf16-mixed``, ``fp16-mixed``) has every cast written
out: ``cast`` statements for activations (the graph builder puts one before each op that
runs in another dtype than its input, ``unroller.compiler.precision``), and for the
parameters of an op that runs in the low dtype, ``L.cast(name, dtype)``: a view of the layer
whose float parameters are that dtype, made once per step and per layer
(``unroller.runtime.cast_cache``). Its gradient comes back in the low dtype
and ``accumulate`` adds it to the float32 ``.grad`` as autograd does (the cast's backward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from unroller.runtime.common import Grads, Needs, _exports, _need

#: The model language's float dtype names (``cast(x, dtype="bf16")``) as torch dtypes.
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}


def cast(x: Tensor, *, dtype: str) -> Tensor:
    """x in ``dtype`` (round to nearest even, as ``Tensor.to`` and torch.autocast round)."""
    return x.to(DTYPES[dtype])


def cast_backward(g: Tensor, *, source: str, needs: Needs | None = None) -> Grads:
    """The gradient in the input's dtype (``_to_copy``'s backward: another rounding)."""
    return (g.to(DTYPES[source]) if _need(needs, 0) else None,)


__all__ = _exports(globals())
