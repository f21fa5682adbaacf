"""DCT+Chop: blockwise 2-D DCT-II, keep the low-frequency corner, store it at low precision."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import (
    Compressor,
    ParamError,
    ParamSpec,
    is_low_precision,
    itemsize,
    saturate,
    use_compiled_path,
    use_fast_path,
    widen_elements,
    work_dtype,
    zero_nan_compiled,
)
from .dct_host import DctHostPaths
from .dct_tables import (
    _STORAGE_DTYPES,
    MAX_BLOCK,
    ONE_TILE_MAX_BLOCK,
    dct_matrix,
    fold_index,
    prescale_exponent,
    tile_matrix,
)

__all__ = ["MAX_BLOCK", "Dct", "dct_matrix", "fold_index", "prescale_exponent"]


class Dct(DctHostPaths, Compressor):
    """DCT+Chop for 4-D activations [N, C, H, W].

    Each H x W plane is padded to multiples of ``block`` by replicating its last row and last
    column (edge replication: a constant plane stays constant, so its tiles' DC coefficients
    carry it exactly) and cut into block x block tiles; each tile B gets the orthonormal 2-D
    DCT-II and only the top-left ``keep`` x ``keep`` coefficients ``Tk @ B @ Tk^T`` are kept
    (with ``fold``, only those with i + j < keep). The kept coefficients are stored divided by
    2**e, e = ceil(log2(block)) (a power of two: exact), so that no stored coefficient exceeds
    the largest |value| of its tile. Decompression zero-fills the rest, applies
    ``Tk^T @ C @ Tk`` times 2**e and crops the padding.

    Packed form: ``storage='int8'``: (q int8, scale [N, C]) with a symmetric per
    (sample, channel) scale amax|stored coeffs| / 127 (float32, or float64 for float64
    inputs; 1 for an all-zero channel); otherwise (coeffs,) in bf16 / f16 / f32. Coefficient
    tensors are [N, C, Hb, keep, Wb, keep], or [N, C, Hb, Wb, keep*(keep+1)/2] with ``fold``.

    float16 / bfloat16 inputs and outputs: the transforms run in float32 (in bfloat16 each
    partial product would be rounded to 8 bits), on spans of planes of at most
    ``base.WIDEN_ELEMENTS`` elements (``_plane_spans``; the native kernel widens its own
    spans), so no float32 copy of a whole large tensor is made, and the output is written
    in its dtype span by span. The packed form is the one the float32 input with the same
    values gives (and the same bytes on every formulation, which share the spans), and the
    output is the float32 decompression rounded to the dtype: the round trip errs by at
    most the float32 codec's error plus the dtype's rounding of the result.

    Zero-size inputs (N, C, H or W of 0) round-trip: the packed tensors have the same shapes as
    for any other input (zero-size coefficient tensors; with int8 a scale [N, C] of ones) and
    decompress to an empty tensor of the right shape and dtype.

    Error (float32 work; float64 inputs: the same with 2**-53 for float rounding):

    - the difference from the exact chop (of the replicated-padded planes, saturated to the
      output dtype's range) is the storage rounding only: per (sample, channel) in L2 at most
      sqrt(kept coefficients) * 2**e * scale / 2 for int8 (the inverse transform is an
      isometry), 2**-8 / 2**-11 / 2**-24 (the unit roundoff) of the padded plane's norm for
      bf16 / f16 / f32 storage (edge replication makes that norm at most ``block`` times the
      input's; f16 storage rounds no finer than its subnormal step 2**-24 * 2**e, reached
      for values below about 6e-5), plus float rounding (~1e-6 relative, and the output
      dtype's rounding for float16 / bfloat16);
    - ``keep == block`` with f32 storage is lossless up to float rounding (~1e-6 relative);
    - a constant plane, of any H and W (1 x 1 and 7 x 13 included), comes back to float
      rounding (~1e-6 relative) with int8 and f32 storage, and to the storage precision
      (2**-8 bf16, 2**-11 f16 relative: their unit roundoff) otherwise; an all-zero channel
      comes back as zeros.
    - padding trade-off: edge replication gives edge tiles interior-sized coefficients (a
      corner tile holding one pixel becomes that pixel's constant, DC = block * value), so
      on white-noise-like planes whose H or W is not a multiple of ``block`` the int8 scale
      is coarser than with zero padding: keep 8, int8, N(0, 1) 33 x 33 planes: 0.019
      relative error (zero padding: 0.008). With keep 4, and on smooth data at any keep, it
      is as good or better (7 x 13 smooth planes, keep 4: 0.19 against 0.30).

    Non-finite input (propagated, never turned into finite values): a NaN or inf makes its
    tile's coefficients non-finite, so with float storage that tile decompresses to NaN/inf
    (padding copies an edge value only into the edge tile that already holds it); with int8
    storage the (sample, channel) scale becomes NaN or inf and the whole channel of that
    sample decompresses to NaN/inf.

    Extreme finite values: the forward transform never overflows, and no stored coefficient
    exceeds the largest |value| of its tile. So int8 storage holds any finite input, f16
    storage any float16 input and bf16 storage any input up to bfloat16's max (about
    3.39e38; f32 storage: float32's max); a coefficient beyond the storage format's range
    (possible only for inputs beyond it, e.g. float32 values above 65504 with f16) is
    stored as inf, and its tile decompresses to NaN/inf. The decompressed values are
    saturated to the output dtype's finite range (``base.saturate``), so a float16 input of
    65504 never comes back as inf, whatever the storage. The inverse transform cannot
    overflow the work dtype for inputs up to its largest value / (1.3 * block) (about 3e37
    for float32 work and block 8); above, a reconstruction can overflow to inf, never to a
    finite wrong value.
    """

    name: ClassVar[str] = "dct"
    flops: ClassVar[float] = 64.0  # two 8x8 matrix products per block each way: 4 x 2 x 8
    lossless: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, ParamSpec]] = {
        "block": ParamSpec(int, 8, "side of the square DCT tiles", min=1, max=MAX_BLOCK),
        "keep": ParamSpec(
            int, 4, "side of the kept low-frequency corner (<= block)", min=1, max=MAX_BLOCK
        ),
        "storage": ParamSpec(
            str, "int8", "precision of the kept coefficients", choices=tuple(_STORAGE_DTYPES)
        ),
        "fold": ParamSpec(bool, False, "keep only coefficients with i + j < keep (gather)"),
    }

    @classmethod
    def check_params(cls, params: dict) -> None:
        if params["keep"] > params["block"]:
            raise ParamError(
                f"Dct: bad value {params['keep']!r} for parameter 'keep': expected an int "
                f"<= block ({params['block']})",
                "keep",
            )

    # layout ------------------------------------------------------------------------------

    def _geometry(self, c: int, h: int, w: int) -> tuple[int, int]:
        b = self.params["block"]
        return -(-h // b), -(-w // b)

    def _coeffs_per_tile(self) -> int:
        k = self.params["keep"]
        return k * (k + 1) // 2 if self.params["fold"] else k * k

    def _coeff_shape(self, n: int, c: int, hb: int, wb: int) -> tuple[int, ...]:
        k = self.params["keep"]
        if self.params["fold"]:
            return (n, c, hb, wb, self._coeffs_per_tile())
        return (n, c, hb, k, wb, k)

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        self._float_dtype(dtype)
        if len(shape) != 4:
            raise ValueError(f"{self!r}: expected a 4-D shape [N, C, H, W], got {tuple(shape)}")
        n, c, h, w = shape
        hb, wb = self._geometry(c, h, w)
        storage = _STORAGE_DTYPES[self.params["storage"]]
        elem = itemsize(storage)
        total = n * c * hb * wb * self._coeffs_per_tile() * elem
        if self.params["storage"] == "int8":
            total += n * c * itemsize(work_dtype(dtype))
        return total

    def _matrices(self, wd: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(Tk, Tk / 2**e, Tk * 2**e): the DCT rows, and the ones that divide the coefficients
        by 2**e in the first forward product and multiply them back in the last inverse one."""
        b, k = self.params["block"], self.params["keep"]
        e = prescale_exponent(b)
        return (
            dct_matrix(b, k, wd, device),
            dct_matrix(b, k, wd, device, -e),
            dct_matrix(b, k, wd, device, e),
        )

    def _one_tile(self, hb: int, wb: int) -> bool:
        """Is every plane a single tile of a small block? Then the 2-D transform is one matrix
        product (``tile_matrix``) on both paths (a shape-only branch, so they stay
        bit-identical). Only up to ``ONE_TILE_MAX_BLOCK``: the table has block**2 * kept
        entries, built one scalar at a time (block 64 would be 16.7 million)."""
        return hb == 1 and wb == 1 and self.params["block"] <= ONE_TILE_MAX_BLOCK

    def _tile_product(self, rows: Tensor, wd: torch.dtype, inverse: bool) -> Tensor:
        b, k = self.params["block"], self.params["keep"]
        table = tile_matrix(b, k, self.params["fold"], wd, rows.device, inverse)
        return torch.matmul(rows, table)

    def _pad(self, x: Tensor, hb: int, wb: int) -> Tensor:
        """``x`` [N, C, H, W] (H, W >= 1) padded to [N, C, Hb*b, Wb*b] by edge replication."""
        b = self.params["block"]
        h, w = x.shape[-2:]
        if hb * b == h and wb * b == w:
            return x
        return F.pad(x, (0, wb * b - w, 0, hb * b - h), mode="replicate")

    def _empty_packed(
        self, n: int, c: int, hb: int, wb: int, wd: torch.dtype, device: torch.device
    ) -> tuple[Tensor, ...]:
        """The packed form of a zero-size input (shapes only: nothing to transform)."""
        storage = _STORAGE_DTYPES[self.params["storage"]]
        coeffs = torch.zeros(self._coeff_shape(n, c, hb, wb), dtype=storage, device=device)
        if self.params["storage"] != "int8":
            return (coeffs,)
        return coeffs, torch.ones((n, c), dtype=wd, device=device)

    # compress ----------------------------------------------------------------------------

    def compress(self, t: Tensor) -> tuple[Tensor, ...]:
        self._float_input(t)
        if t.dim() != 4:
            raise ValueError(
                f"{self!r}: expected a 4-D tensor [N, C, H, W], got shape {tuple(t.shape)}"
            )
        b = self.params["block"]
        n, c, h, w = t.shape
        hb, wb = self._geometry(c, h, w)
        wd = work_dtype(t.dtype)
        if n * c * h * w == 0:  # same on both paths: a shape-only branch
            return self._empty_packed(n, c, hb, wb, wd, t.device)
        compiled = use_compiled_path(t)
        fast = not compiled and use_fast_path(t)
        spans = self._plane_spans(n * c, hb * wb * b * b, t.dtype)
        if len(spans) > 1 and not (fast and self._native_compresses(t, wd)):
            return self._compress_spans(t, spans, hb, wb, wd, compiled, fast)
        if fast:
            return self._compress_fast(t, hb, wb, wd)
        return self._compress_safe(t, hb, wb, wd, compiled)

    def _plane_spans(self, planes: int, plane: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        """(p0, p1): the planes a formulation transforms together, ``plane`` elements each
        once padded. All of them for float32 / float64 data; for float16 / bfloat16 data,
        whose float32 work would otherwise be a float32 copy of the whole tensor (and its
        transforms), spans of at most ``base.WIDEN_ELEMENTS`` elements (one plane at least).
        A shape-only choice shared by every formulation, so their matrix products have the
        same shapes (BLAS results can depend on them) and they stay bit-identical."""
        if not is_low_precision(dtype):
            return [(0, planes)]
        per = max(1, widen_elements() // plane)
        return [(p, min(planes, p + per)) for p in range(0, planes, per)]

    def _compress_spans(
        self,
        t: Tensor,
        spans: list[tuple[int, int]],
        hb: int,
        wb: int,
        wd: torch.dtype,
        compiled: bool,
        fast: bool,
    ) -> tuple[Tensor, ...]:
        """``compress`` of a float16 / bfloat16 tensor a span of planes at a time (each plane
        is transformed, chopped and scaled on its own): at most a span is widened to float32
        at once, and the packed pieces (a fraction of the input's size) are joined."""
        n, c, h, w = t.shape
        planes = t.reshape(n * c, 1, h, w)
        parts = []
        for p0, p1 in spans:
            piece = planes[p0:p1]
            if fast:
                parts.append(self._compress_fast(piece, hb, wb, wd))
            else:
                parts.append(self._compress_safe(piece, hb, wb, wd, compiled))
        return tuple(
            torch.cat([part[i] for part in parts]).reshape(n, c, *parts[0][i].shape[2:])
            for i in range(len(parts[0]))
        )

    def _compress_safe(
        self, t: Tensor, hb: int, wb: int, wd: torch.dtype, compiled: bool
    ) -> tuple[Tensor, ...]:
        """``compress``'s IPU-safe formulation (and, while torch.compile traces, the compiled
        one) of a non-empty [N, C, H, W] tensor."""
        b, k = self.params["block"], self.params["keep"]
        n, c, h, w = t.shape
        x = self._pad(t.to(wd), hb, wb)
        if self._one_tile(hb, wb):  # [N*C, b*b] @ [b*b, kept]: the kept coefficients / 2**e
            y = self._tile_product(x.reshape(n * c, b * b), wd, inverse=False)
            y = y.reshape(self._coeff_shape(n, c, hb, wb))
        else:
            tk, tk_down, _ = self._matrices(wd, x.device)
            # rows of each tile: [k, b] @ [N, C, Hb, b, Wp] -> [N, C, Hb, k, Wp], / 2**e
            y = torch.matmul(tk_down, x.reshape(n, c, hb, b, wb * b))
            # columns: [N, C, Hb, k, Wb, b] @ [b, k] -> [N, C, Hb, k, Wb, k]
            y = torch.matmul(y.reshape(n, c, hb, k, wb, b), tk.t())
            if self.params["fold"]:
                y = y.permute(0, 1, 2, 4, 3, 5).reshape(n, c, hb, wb, k * k)
                y = torch.index_select(y, -1, fold_index(k, y.device))
        storage = self.params["storage"]
        if storage != "int8":
            return (y.to(_STORAGE_DTYPES[storage]),)
        amax = torch.amax(torch.abs(y), dim=tuple(range(2, y.dim())))  # [N, C]
        # all-zero channel: scale 1 (codes are 0). NaN/inf stay in the scale (amax == 0 is
        # False for NaN), so a non-finite channel decompresses to non-finite values.
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 127.0)
        q = torch.round(y / scale.reshape(n, c, *([1] * (y.dim() - 2))))
        q = torch.clamp(q, -127.0, 127.0)
        # defined cast where the scale is NaN
        q = (
            zero_nan_compiled(q)
            if compiled
            else torch.where(torch.isnan(q), torch.zeros_like(q), q)
        )
        return q.to(torch.int8), scale

    # decompress --------------------------------------------------------------------------

    def _check_packed(self, packed: tuple[Tensor, ...], shape: tuple[int, ...]) -> int:
        """N, after checking the number of packed tensors and the per-sample shape."""
        if len(shape) != 3:
            raise ValueError(f"{self!r}: expected a per-sample shape (C, H, W), got {shape}")
        if self.params["storage"] == "int8":
            if len(packed) != 2:
                raise ValueError(f"{self!r}: expected packed (q, scale), got {len(packed)} tensors")
        elif len(packed) != 1:
            raise ValueError(f"{self!r}: expected packed (coeffs,), got {len(packed)} tensors")
        return packed[0].shape[0]

    def decompress(
        self, packed: tuple[Tensor, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        self._float_dtype(dtype)
        n = self._check_packed(packed, tuple(shape))
        b = self.params["block"]
        c, h, w = shape
        hb, wb = self._geometry(c, h, w)
        wd = work_dtype(dtype)
        if n * c * h * w == 0:  # same on both paths: a shape-only branch
            return torch.zeros((n, c, h, w), dtype=dtype, device=packed[0].device)
        fast = use_fast_path(*packed)
        spans = self._plane_spans(n * c, hb * wb * b * b, dtype)
        if len(spans) > 1:  # a float16 / bfloat16 output: a span of planes at a time
            if fast:
                return self._decompress_spans_fast(packed, (c, h, w), hb, wb, wd, dtype, spans)
            views = tuple(p.reshape(n * c, 1, *p.shape[2:]) for p in packed)
            parts = [
                self._decompress_safe(tuple(v[p0:p1] for v in views), (1, h, w), hb, wb, wd, dtype)
                for p0, p1 in spans
            ]
            return torch.cat(parts).reshape(n, c, h, w)
        if fast:
            return self._decompress_fast(packed, (c, h, w), hb, wb, wd, dtype)
        return self._decompress_safe(packed, (c, h, w), hb, wb, wd, dtype)

    def _decompress_safe(
        self,
        packed: tuple[Tensor, ...],
        shape: tuple[int, int, int],
        hb: int,
        wb: int,
        wd: torch.dtype,
        dtype: torch.dtype,
    ) -> Tensor:
        """``decompress``'s IPU-safe formulation, for a non-empty shape."""
        b, k = self.params["block"], self.params["keep"]
        c, h, w = shape
        n = packed[0].shape[0]
        if self.params["storage"] == "int8":
            q, scale = packed
            y = q.to(wd) * scale.to(wd).reshape(n, c, *([1] * (q.dim() - 2)))
        else:
            y = packed[0].to(wd)
        if self._one_tile(hb, wb):  # [N*C, kept] @ [kept, b*b]: the tiles, times 2**e
            x = self._tile_product(y.reshape(n * c, -1), wd, inverse=True)
            x = x.reshape(n, c, b, b)[:, :, :h, :w]
            return saturate(x, dtype).to(dtype).contiguous()
        if self.params["fold"]:
            idx = fold_index(k, y.device).expand(y.shape)
            full = torch.zeros((n, c, hb, wb, k * k), dtype=wd, device=y.device)
            y = torch.scatter(full, -1, idx, y).reshape(n, c, hb, wb, k, k)
            y = y.permute(0, 1, 2, 4, 3, 5)
        tk, _, tk_up = self._matrices(wd, y.device)
        # rows: [b, k] @ [N, C, Hb, k, Wb*k] -> [N, C, Hb, b, Wb*k]
        x = torch.matmul(tk.t(), y.reshape(n, c, hb, k, wb * k))
        # columns, times 2**e: [N, C, Hb, b, Wb, k] @ [k, b] -> [N, C, Hb, b, Wb, b]
        x = torch.matmul(x.reshape(n, c, hb, b, wb, k), tk_up)
        x = x.reshape(n, c, hb * b, wb * b)[:, :, :h, :w]
        return saturate(x, dtype).to(dtype).contiguous()
