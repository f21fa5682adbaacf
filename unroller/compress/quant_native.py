"""``Quant``'s native CPU path: the kernels of ``native/quant_kernels.cpp`` called with
the same bytes as the PyTorch formulations, and the per-shape plans that let a repeated
call skip the general dispatch. Host-side code, apart from the traced PyTorch path."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import native_threads, packed_code_bytes, widen_elements, widen_spans


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
        float32 (exact; the PyTorch path computes on them in float32 too) a span at a time
        (``_encode_widened``), never as a whole. The noise of stochastic rounding is the
        same single ``torch.rand`` draw as in the other paths."""
        x = t.reshape(n, m)
        if x.dtype != wd:
            packed = self._encode_widened(lib, x, n, m, g, groups, wd, generator)
            if packed is not None:
                return packed
            # a group longer than a span: the PyTorch fast path, which reads the input as it
            # is (min/max per group, then blocks of float32 work), with the same bytes
            levels = float((1 << self.params["bits"]) - 1)
            return self._compress_fast(t, n, m, g, groups, levels, wd, generator)
        x = x.contiguous()
        noise = None
        if self.params["stochastic"]:
            noise = torch.rand((n * groups, g), dtype=wd, device=t.device, generator=generator)
        return self._encode(lib, x, noise, n, m, g, groups)

    def _widen_plan(  # unroller-lint: host-only (native cpu path)
        self, n: int, m: int, g: int
    ) -> tuple[int, list[tuple[int, int, int, int]]] | None:
        """(threads, spans) for a float16 / bfloat16 tensor [n, m] whose groups go through
        the float32 kernel a span at a time (``base.WIDEN_ELEMENTS`` per thread), or None
        when one group (with the code bytes it must fill whole) is longer than a span."""
        threads = native_threads(n * m)
        budget = widen_elements() * threads
        step = math.lcm(g, 8 // self.params["bits"])  # whole groups, whole code bytes
        if step > budget:
            return None
        return threads, widen_spans(n, m, step, budget)

    def _encode_widened(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        x: Tensor,
        n: int,
        m: int,
        g: int,
        groups: int,
        wd: torch.dtype,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, ...] | None:
        """``_compress_native`` of a float16 / bfloat16 ``x`` [n, m]: each span (whole
        groups; see ``_widen_plan``) copied into one reused float32 buffer and encoded into
        its place in the packed form. The groups are coded on their own, so the bytes are
        those of one call on the whole widened tensor. Stochastic rounding draws its noise
        span by span, in order: the CPU generator's stream is consumed element by element,
        so the spans' draws are the single draw of the other paths, piece by piece (the
        tests compare them), and no full-size float32 noise is made either. None when a
        group is longer than a span."""
        plan = self._widen_plan(n, m, g)
        if plan is None:
            return None
        threads, spans = plan
        bits = self.params["bits"]
        per = 8 // bits
        nbytes = packed_code_bytes(m, bits)
        out = x.new_empty((n, nbytes), dtype=torch.uint8)
        mn = x.new_empty((n, groups), dtype=wd)
        scale = x.new_empty((n, groups), dtype=wd)
        i0, i1, j0, j1 = spans[0]  # the largest span
        buf = x.new_empty((i1 - i0) * (j1 - j0), dtype=wd)
        side = buf.element_size()
        encode = lib.uq_encode_f64 if wd is torch.float64 else lib.uq_encode_f32
        for i0, i1, j0, j1 in spans:
            rows, width = i1 - i0, j1 - j0
            xb = buf[: rows * width].view(rows, width)
            xb.copy_(x[i0:i1, j0:j1])
            first = i0 * groups + j0 // g  # the span's first group
            noise = None
            if self.params["stochastic"]:
                count = rows * -(-width // g) * g  # its groups, the last one padded
                noise = torch.rand(count, dtype=wd, device=x.device, generator=generator)
            encode(
                xb.data_ptr(),
                None if noise is None else noise.data_ptr(),
                rows,
                width,
                g,
                bits,
                out.data_ptr() + i0 * nbytes + j0 // per,
                mn.data_ptr() + first * side,
                scale.data_ptr() + first * side,
                threads,
            )
        return out, mn, scale

    def _decode_widened(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        codes: Tensor,
        mn: Tensor,
        scale: Tensor,
        full: tuple[int, ...],
        n: int,
        m: int,
        g: int,
        groups: int,
        dtype: torch.dtype,
    ) -> Tensor | None:
        """``_decompress_native`` into a float16 / bfloat16 tensor: each span decoded into one
        reused float32 buffer and cast into its place (the cast of the float32 result, value
        for value, without a float32 tensor of the whole output). ``codes``, ``mn`` and
        ``scale`` are contiguous, the last two of the work dtype. None when a group is
        longer than a span."""
        plan = self._widen_plan(n, m, g)
        if plan is None:
            return None
        threads, spans = plan
        per = 8 // self.params["bits"]
        nbytes = codes.shape[1]
        out = torch.empty((n, m), dtype=dtype, device=codes.device)
        i0, i1, j0, j1 = spans[0]
        buf = mn.new_empty((i1 - i0) * (j1 - j0))
        side = buf.element_size()
        decode = lib.uq_decode_f64 if buf.dtype is torch.float64 else lib.uq_decode_f32
        for i0, i1, j0, j1 in spans:
            rows, width = i1 - i0, j1 - j0
            ob = buf[: rows * width].view(rows, width)
            first = i0 * groups + j0 // g
            decode(
                codes.data_ptr() + i0 * nbytes + j0 // per,
                mn.data_ptr() + first * side,
                scale.data_ptr() + first * side,
                rows,
                width,
                g,
                self.params["bits"],
                ob.data_ptr(),
                threads,
            )
            out[i0:i1, j0:j1].copy_(ob)
        return out.view(full)

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
        computed in float32 and cast, as the fast path does, a span at a time
        (``_decode_widened``)."""
        n = codes.shape[0]
        mn = (mn if mn.dtype == wd else mn.to(wd)).contiguous()
        scale = (scale if scale.dtype == wd else scale.to(wd)).contiguous()
        if dtype != wd:
            codes = codes.contiguous()
            out = self._decode_widened(lib, codes, mn, scale, full, n, m, g, groups, dtype)
            if out is not None:
                return out
            levels = float((1 << self.params["bits"]) - 1)  # a group longer than a span
            return self._decompress_fast(codes, mn, scale, full, m, g, groups, levels, wd, dtype)
        out = torch.empty((n, m), dtype=wd, device=codes.device)
        out = self._decode(lib, codes.contiguous(), mn, scale, out, n, m, g)
        out = out.view(full)
        return out if dtype == wd else out.to(dtype)
