"""The ``aten`` operator on the ipu platform: refused at generate time.

PopTorch runs only the operations it supports, traced into its own graph; an opaque ATen
call's backward runs ``torch.autograd.grad`` inside the step, which PopTorch cannot trace,
so every ``aten`` statement is refused with its op named (the kernels below are never
reached: ``unsupported`` stops generation first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unroller.runtime.opaque import aten, aten_backward  # noqa: F401 (the registry's kernels)


def unsupported(op_name: str, args: Mapping[str, Any]) -> str | None:
    """Why an ``aten`` statement cannot run on the IPU: always (see the module's docstring)."""
    if op_name != "aten":
        return None
    return (
        f"the opaque ATen call {args.get('op')!r} is not supported on the ipu platform: "
        "PopTorch runs only its own operations, and this call's backward needs "
        "torch.autograd (import with a registry operator for it, or use --platform gpu)"
    )
