"""DCT+Chop's host paths: the fast cpu/cuda formulation and the native kernels.

``Dct`` (``unroller.compress.dct``) holds the codec and its IPU-safe formulation; these
are the paths only a host runs (each marked host-only for ``unroll lint``), kept apart so
that each class has one job. They read the codec's geometry and matrices through the
methods ``Dct`` defines (``_matrices``, ``_coeff_shape``, ``_plane_spans`` ...).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import (
    cached_constant,
    native_library,
    native_threads,
    saturate_fast,
    skip_checks,
    widen_elements,
)
from .dct_tables import _STORAGE_DTYPES, fold_index


class DctHostPaths:
    """The host formulations of ``Dct``, mixed into it."""

    # fast cpu/cuda path ------------------------------------------------------------------
    # The matmuls are exactly the IPU-safe formulation's (same shapes and layouts: BLAS results
    # can depend on the matrix sizes, so they are never split otherwise than in the spans of
    # planes that every formulation shares, ``_plane_spans``); the work around them is not.

    def _fold_positions(  # unroller-lint: host-only (fast cpu/cuda path)
        self, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """(rows, cols) of the kept coefficients i + j < keep, in ``fold_index`` order."""
        k = self.params["keep"]
        return cached_constant(
            ("dct_fold_rc", k, device),
            lambda: torch.stack([fold_index(k, device) // k, fold_index(k, device) % k]),
        ).unbind(0)

    def _native_compresses(  # unroller-lint: host-only (fast cpu/cuda path)
        self, t: Tensor, wd: torch.dtype
    ) -> bool:
        """Whether ``_compress_fast`` hands ``t`` to the native kernel (int8 storage, float32
        work, the kernels at hand), which widens a float16 / bfloat16 input a span of planes
        at a time itself."""
        return (
            self.params["storage"] == "int8"
            and wd == torch.float32
            and native_library(t) is not None
        )

    def _decompress_spans_fast(  # unroller-lint: host-only (fast cpu/cuda path)
        self,
        packed: tuple[Tensor, ...],
        shape: tuple[int, int, int],
        hb: int,
        wb: int,
        wd: torch.dtype,
        dtype: torch.dtype,
        spans: list[tuple[int, int]],
    ) -> Tensor:
        """``_decompress_fast`` a span of planes at a time into one output tensor of
        ``dtype`` (float16 / bfloat16): each span's float32 work is cast into its place, so
        no float32 tensor of the whole output is made."""
        c, h, w = shape
        n = packed[0].shape[0]
        out = torch.empty((n, c, h, w), dtype=dtype, device=packed[0].device)
        flat = out.view(n * c, 1, h, w)
        views = tuple(p.reshape(n * c, 1, *p.shape[2:]) for p in packed)
        for p0, p1 in spans:
            piece = tuple(v[p0:p1] for v in views)
            flat[p0:p1].copy_(self._decompress_fast(piece, (1, h, w), hb, wb, wd, dtype))
        return out

    def _compress_fast(  # unroller-lint: host-only (fast cpu/cuda path)
        self, t: Tensor, hb: int, wb: int, wd: torch.dtype
    ) -> tuple[Tensor, ...]:
        """``compress`` with the same packed tensors: the same padding and two matmuls, the
        fold as one gather from the un-permuted coefficients, the int8 scale from amax/amin
        (no |y| temporary) and the quantisation in place."""
        b, k = self.params["block"], self.params["keep"]
        storage = self.params["storage"]
        n, c, h, w = t.shape
        if storage == "int8" and wd == torch.float32:
            lib = native_library(t)
            if lib is not None:
                packed = self._compress_native(lib, t, hb, wb)
                if packed is not None:
                    return packed
                spans = self._plane_spans(n * c, hb * wb * b * b, t.dtype)
                if len(spans) > 1:  # the kernel got no scratch memory: spans here too
                    return self._compress_spans(t, spans, hb, wb, wd, False, True)
        x = self._pad(t.to(wd), hb, wb)
        if self._one_tile(hb, wb):
            y = self._tile_product(x.reshape(n * c, b * b), wd, inverse=False)
            y = y.reshape(self._coeff_shape(n, c, hb, wb))
        else:
            tk, tk_down, _ = self._matrices(wd, x.device)
            y = torch.matmul(tk_down, x.reshape(n, c, hb, b, wb * b))
            y = torch.matmul(y.reshape(n, c, hb, k, wb, b), tk.t())
        if self.params["fold"] and not self._one_tile(hb, wb):
            rows, cols = self._fold_positions(y.device)
            y = y.permute(0, 1, 2, 4, 3, 5)[..., rows, cols]  # [N, C, Hb, Wb, kept]
        if storage != "int8":
            return (y.to(_STORAGE_DTYPES[storage]),)
        flat = y.reshape(n, c, -1)
        checks = skip_checks(y)
        if checks:  # max |y| = max(amax, -amin) without a |y| temporary; abs() gives
            # amax(|y|)'s +0.0 for all-zero channels
            amax = torch.maximum(torch.amax(flat, dim=-1), torch.amin(flat, dim=-1).neg_()).abs_()
        else:
            amax = torch.amax(torch.abs(flat), dim=-1)
        scale = torch.where(amax == 0, 1.0, amax / 127.0)
        y.div_(scale.reshape(n, c, *([1] * (y.dim() - 2)))).round_().clamp_(-127.0, 127.0)
        # y / scale is NaN only for a non-finite channel, or where amax / 127 underflowed to 0
        if not checks or not bool(((scale > 0) & torch.isfinite(scale)).all()):
            y.nan_to_num_(0.0)  # defined cast; the channel's scale is NaN, inf or 0
        return y.to(torch.int8), scale

    def _decompress_fast(  # unroller-lint: host-only (fast cpu/cuda path)
        self,
        packed: tuple[Tensor, ...],
        shape: tuple[int, int, int],
        hb: int,
        wb: int,
        wd: torch.dtype,
        dtype: torch.dtype,
    ) -> Tensor:
        """``decompress`` with bit-identical output: dequantisation in one multiply, the folded
        coefficients put straight into the layout the matmul reads, the same two matmuls,
        the second one writing into the output when nothing is cropped or cast, and the
        saturation to a narrower output dtype only when the cast made an inf (on the CPU;
        on CUDA always)."""
        b, k = self.params["block"], self.params["keep"]
        c, h, w = shape
        coeffs = packed[0]
        n = coeffs.shape[0]
        if len(packed) == 2 and wd == torch.float32 and dtype == torch.float32:
            lib = native_library(*packed)
            if lib is not None and self._native_packed_ok(packed, n, c, hb, wb):
                out = self._decompress_native(lib, packed, (n, c, h, w))
                if out is not None:
                    return out
        if len(packed) == 2:
            scale = packed[1].to(wd).reshape(n, c, *([1] * (coeffs.dim() - 2)))
            y = torch.mul(coeffs, scale)  # int8 * float: the codes are cast exactly
        else:
            y = coeffs.to(wd)
        if self._one_tile(hb, wb):
            x = self._tile_product(y.reshape(n * c, -1), wd, inverse=True).reshape(n, c, b, b)
            if b == h and b == w and dtype == wd:
                return x
            return saturate_fast(x[:, :, :h, :w], dtype)
        if self.params["fold"]:
            rows, cols = self._fold_positions(y.device)
            full = torch.zeros((n, c, hb, k, wb, k), dtype=wd, device=y.device)
            full.permute(0, 1, 2, 4, 3, 5)[..., rows, cols] = y
            y = full
        tk, _, tk_up = self._matrices(wd, y.device)
        x = torch.matmul(tk.t(), y.reshape(n, c, hb, k, wb * k))
        x = x.reshape(n, c, hb, b, wb, k)
        if hb * b == h and wb * b == w and dtype == wd:
            out = torch.empty((n, c, h, w), dtype=wd, device=y.device)
            torch.matmul(x, tk_up, out=out.view(n, c, hb, b, wb, b))
            return out
        x = torch.matmul(x, tk_up).reshape(n, c, hb * b, wb * b)[:, :, :h, :w]
        return saturate_fast(x, dtype)

    # native cpu path ---------------------------------------------------------------------
    # int8 storage, float32 work: ``native/dct_kernels.cpp`` does a plane at a time (pad,
    # transform, chop, scale, codes; and back) in one call. Its products are not BLAS's, so
    # it equals the PyTorch formulations up to float rounding, not bit for bit (coefficients
    # within a few ulps; a code may differ by one next to a half-integer).

    def _native_packed_ok(  # unroller-lint: host-only (native cpu path)
        self, packed: tuple[Tensor, ...], n: int, c: int, hb: int, wb: int
    ) -> bool:
        """Packed tensors the kernel can read as they are: int8 codes of this layout and a
        float32 scale [N, C] (anything else goes through the PyTorch formulation, which says
        what is wrong)."""
        q, scale = packed
        return (
            q.dtype == torch.int8
            and tuple(q.shape) == self._coeff_shape(n, c, hb, wb)
            and scale.dtype == torch.float32
            and tuple(scale.shape) == (n, c)
        )

    def _compress_native(  # unroller-lint: host-only (native cpu path)
        self, lib, t: Tensor, hb: int, wb: int
    ) -> tuple[Tensor, Tensor] | None:
        """``compress`` through the native kernel; None when it could not get scratch memory
        (the PyTorch formulation then runs). The kernel reads float32 planes: a float16 /
        bfloat16 input is widened a span of planes at a time (``base.WIDEN_ELEMENTS`` per
        thread) into one reused buffer, each plane being coded on its own, so the codes
        are those of one call on the whole widened tensor."""
        b, k = self.params["block"], self.params["keep"]
        n, c, h, w = t.shape
        planes = n * c
        q = torch.empty(self._coeff_shape(n, c, hb, wb), dtype=torch.int8)
        scale = torch.empty((n, c), dtype=torch.float32)
        tk, tk_down, _ = self._matrices(torch.float32, t.device)
        threads = native_threads(t.numel())
        if t.dtype == torch.float32:
            step, src, buf = planes, t.contiguous().view(planes, h, w), None
        else:
            step = max(1, widen_elements() * threads // (h * w))
            src = t.reshape(planes, h, w)
            buf = torch.empty(min(step, planes) * h * w, dtype=torch.float32)
        per_plane = q.numel() // planes  # int8 codes of one plane
        for p0 in range(0, planes, step):
            p1 = min(planes, p0 + step)
            if buf is None:
                x = src
            else:
                x = buf[: (p1 - p0) * h * w].view(p1 - p0, h, w)
                x.copy_(src[p0:p1])
            failed = lib.ud_compress_f32(
                x.data_ptr(),
                p1 - p0,
                h,
                w,
                b,
                k,
                int(self.params["fold"]),
                tk_down.contiguous().data_ptr(),
                tk.contiguous().data_ptr(),
                q.data_ptr() + p0 * per_plane,
                scale.data_ptr() + p0 * scale.element_size(),
                threads,
            )
            if failed:
                return None
        return q, scale

    def _decompress_native(  # unroller-lint: host-only (native cpu path)
        self, lib, packed: tuple[Tensor, ...], full: tuple[int, int, int, int]
    ) -> Tensor | None:
        """``decompress`` through the native kernel (float32 out); None as above."""
        b, k = self.params["block"], self.params["keep"]
        n, c, h, w = full
        q, scale = (p.contiguous() for p in packed)
        out = torch.empty(full, dtype=torch.float32)
        tk, _, tk_up = self._matrices(torch.float32, q.device)
        failed = lib.ud_decompress_f32(
            q.data_ptr(),
            scale.data_ptr(),
            n * c,
            h,
            w,
            b,
            k,
            int(self.params["fold"]),
            tk.contiguous().data_ptr(),
            tk_up.contiguous().data_ptr(),
            out.data_ptr(),
            native_threads(out.numel()),
        )
        return None if failed else out
