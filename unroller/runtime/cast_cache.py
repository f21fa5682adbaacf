"""The step's cast cache: a layer seen with its float parameters in another dtype.

A mixed-precision step reads the parameters of an op that runs in the low dtype through
``L.cast(name, dtype)`` (``unroller.runtime.common.Layers``): one view per layer and dtype,
made on first use and kept by the step's layer handles until the step ends, as
torch.autocast's cast cache keeps a weight's low-precision copy for its context. A weight
read by the forward and by the backward is so cast once. This module needs nothing of the
kernels, so the layer handles and the kernels can both import it. It runs on both platforms:
on the IPU the casts are traced into PopTorch's graph (``Tensor.to``, on its list), and
``unroll lint --platform ipu`` checks them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class CastLayer:
    """A layer seen with its floating-point parameters and buffers in another dtype: what a
    kernel reads as ``layer.weight`` is the cast copy, anything else (``training``, ``eps``,
    integer buffers) is the layer's own. Submodules (an attention's ``out_proj``) are seen
    the same way, through the same cache."""

    __slots__ = ("_layer", "_dtype", "_cache", "_path", "_cast")

    def __init__(self, layer: torch.nn.Module, dtype: torch.dtype, cache: dict, path: str):
        self._layer, self._dtype, self._cache, self._path = layer, dtype, cache, path
        self._cast: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        cast = self._cast
        if name in cast:
            return cast[name]
        found = _attribute(self._layer, name)
        if name in ("_parameters", "_buffers"):  # what kernels read directly, cast alike
            found = {k: self._tensor(k, t) for k, t in found.items()}
        elif isinstance(found, Tensor):
            found = self._tensor(name, found)
        elif isinstance(found, torch.nn.Module):
            found = cast_layer(self._cache, found, self._dtype, f"{self._path}.{name}")
        else:
            return found
        cast[name] = found
        return found

    def _tensor(self, name: str, t: Tensor | None) -> Tensor | None:
        """Parameter or buffer ``name`` in the view's dtype when it is floating point, cast
        once (``layer.weight`` and ``layer._parameters["weight"]`` are the same copy)."""
        key = "tensor:" + name
        if key not in self._cast:
            floating = t is not None and t.is_floating_point() and t.dtype != self._dtype
            self._cast[key] = t.detach().to(self._dtype) if floating else t
        return self._cast[key]

    def __repr__(self) -> str:
        return f"CastLayer({self._path or '<model>'}, {self._dtype})"


def _attribute(layer: torch.nn.Module, name: str) -> Any:  # unroller-lint: host-only
    """``layer.<name>``, the attribute a kernel reads through the view (``weight``, ``eps``,
    ``training``, a submodule): a lookup by a computed name, so the linter leaves it out.
    It runs while PopTorch traces the step and makes no tensor operation: what a kernel then
    computes with the value is checked where the kernel's code says it, and the casts the
    view makes (``_tensor``) are checked with the rest of this class."""
    return getattr(layer, name)


def cast_layer(cache: dict, layer: torch.nn.Module, dtype: torch.dtype, path: str) -> CastLayer:
    """The step's one cast view of ``layer`` in ``dtype`` (made on first use)."""
    key = (path, dtype)
    found = cache.get(key)
    if found is None:
        found = cache[key] = CastLayer(layer, dtype, cache, path)
    return found
