"""``Quant``'s native CPU path: the kernels of ``native/quant_kernels.cpp`` called with
the same bytes as the PyTorch formulations, and the per-shape plans that let a repeated
call skip the general dispatch. Host-side code, apart from the traced PyTorch path."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import native_threads, packed_code_bytes


class _NativeQuant:
    """The native compress and decompress of ``Quant`` (whose ``_encode_plans`` and
    ``_decode_plans`` caches these read and fill)."""

    def _compress_native(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        t: Tensor,
        n: int,
        m: int,
        g: int,
        groups: int,
        wd: torch.dtype,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, ...]:
        """``compress`` through the native kernel (``native/quant_kernels.cpp``): per group,
        min/max, the group's constants and the packed codes in one pass over the input, with
        the bytes the PyTorch formulations give. float16 / bfloat16 inputs are widened to
        float32 first (exact; the PyTorch path computes on them in float32 too). The noise of
        stochastic rounding is the same single ``torch.rand`` draw as in the other paths."""
        x = t.reshape(n, m)
        if x.dtype != wd:
            x = x.to(wd)
        x = x.contiguous()
        noise = None
        if self.params["stochastic"]:
            noise = torch.rand((n * groups, g), dtype=wd, device=t.device, generator=generator)
        return self._encode(lib, x, noise, n, m, g, groups)

    def _encode(  # unroller-lint: host-only (native cpu path)
        self, lib: Any, x: Tensor, noise: Tensor | None, n: int, m: int, g: int, groups: int
    ) -> tuple[Tensor, ...]:
        """The kernel's call on a contiguous input of the work dtype, into new tensors."""
        bits = self.params["bits"]
        out = x.new_empty((n, packed_code_bytes(m, bits)), dtype=torch.uint8)
        mn = x.new_empty((n, groups))
        scale = x.new_empty((n, groups))
        encode = lib.uq_encode_f64 if x.dtype is torch.float64 else lib.uq_encode_f32
        encode(
            x.data_ptr(),
            None if noise is None else noise.data_ptr(),
            n,
            m,
            g,
            bits,
            out.data_ptr(),
            mn.data_ptr(),
            scale.data_ptr(),
            native_threads(n * m),
        )
        return out, mn, scale

    def _encode_planned(  # unroller-lint: host-only (native cpu path)
        self, lib: Any, t: Tensor, plan: tuple
    ) -> tuple[Tensor, ...]:
        """``_compress_native`` for a (shape, dtype) seen before: a float32 / float64 input,
        nearest rounding (the plan is only made for those); same bytes."""
        n, m, g, groups, _ = plan
        if not t.is_contiguous():  # per-head views of the packed in-projection
            t = t.contiguous()
        return self._encode(lib, t, None, n, m, g, groups)

    def _planned_ok(self, packed: tuple[Tensor, ...], plan: tuple) -> bool:
        """Whether a packed form fits a decode plan exactly: the codes' shape is in the key,
        the rest (dtypes, sizes, contiguity) is checked here, as ``_native_packed_ok`` does."""
        codes, mn, scale = packed
        count = plan[1] * plan[4]
        wd = plan[5]
        return (
            codes.dtype is torch.uint8
            and mn.dtype is wd
            and scale.dtype is wd
            and mn.numel() == count
            and scale.numel() == count
            and codes.is_contiguous()
            and mn.is_contiguous()
            and scale.is_contiguous()
        )

    def _decode_planned(  # unroller-lint: host-only (native cpu path)
        self, lib: Any, packed: tuple[Tensor, ...], plan: tuple
    ) -> Tensor:
        """``_decompress_native`` for a (codes shape, shape, dtype) seen before, into a new
        tensor of the work dtype (the plan is only made where it is the output's)."""
        codes, mn, scale = packed
        full, n, m, g, _, _ = plan
        return self._decode(lib, codes, mn, scale, mn.new_empty(full), n, m, g)

    def _decode(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        codes: Tensor,
        mn: Tensor,
        scale: Tensor,
        out: Tensor,
        n: int,
        m: int,
        g: int,
    ) -> Tensor:
        """The kernel's call on contiguous packed tensors (mn, scale of ``out``'s dtype)."""
        decode = lib.uq_decode_f64 if out.dtype is torch.float64 else lib.uq_decode_f32
        decode(
            codes.data_ptr(),
            mn.data_ptr(),
            scale.data_ptr(),
            n,
            m,
            g,
            self.params["bits"],
            out.data_ptr(),
            native_threads(n * m),
        )
        return out

    def _native_packed_ok(  # unroller-lint: host-only (native cpu path)
        self, codes: Tensor, mn: Tensor, scale: Tensor, n: int, m: int, groups: int
    ) -> bool:
        """Whether a packed form has exactly the dtypes and sizes the native kernel reads (it
        trusts them: a short tensor would be read past its end). Anything else goes to the
        PyTorch path, which raises the usual errors for malformed input."""
        return (
            codes.dtype == torch.uint8
            and tuple(codes.shape) == (n, packed_code_bytes(m, self.params["bits"]))
            and mn.is_floating_point()
            and scale.is_floating_point()
            and mn.numel() == n * groups
            and scale.numel() == n * groups
        )

    def _decompress_native(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        codes: Tensor,
        mn: Tensor,
        scale: Tensor,
        full: tuple[int, ...],
        m: int,
        g: int,
        groups: int,
        wd: torch.dtype,
        dtype: torch.dtype,
    ) -> Tensor:
        """``decompress`` through the native kernel, bit-identical to the other paths: per group
        the kernel computes the terms of the general formula x = clamp((q * (scale * s) +
        mn * s) / s) + (scale - scale) as the fast path does (s is 1, or 1/2 where scale >
        max / (2 * levels); dividing by it is multiplying by 1 or 2, exactly) and applies
        them per element in one pass, writing the output. float16 / bfloat16 outputs are
        computed in float32 and cast, as the fast path does."""
        n = codes.shape[0]
        mn = (mn if mn.dtype == wd else mn.to(wd)).contiguous()
        scale = (scale if scale.dtype == wd else scale.to(wd)).contiguous()
        out = torch.empty((n, m), dtype=wd, device=codes.device)
        out = self._decode(lib, codes.contiguous(), mn, scale, out, n, m, g)
        out = out.view(full)
        return out if dtype == wd else out.to(dtype)
