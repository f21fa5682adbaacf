"""Few-bit backward for smooth activations (Novikov et al., "Few-bit backward: quantized
gradients of activation functions for memory footprint reduction", ICML 2023).

An elementwise activation y = f(x) has the backward dL/dx = g * f'(x), so its backward needs
of x only f'(x). Instead of x, this codec keeps a ``bits``-bit code per element: the index
of the interval of x it falls in, for intervals chosen so that replacing f'(x) by one
constant per interval (the interval's *level*) is the best such approximation in mean
square over x ~ N(0, 1). That is the piecewise-constant quantisation of the derivative with
optimal levels for that function; 3 bits instead of 32 per element.

Decompression returns, per code, a *representative* input x_k inside its interval with
f'(x_k) = level_k exactly (it exists: a level is a weighted mean of the continuous f' over
its interval). The op's own backward kernel, unchanged, then computes g * f'(x_k) =
g * level_k, on either platform: no second backward kernel, and the registry field that
opts an op in (``derivative.x = { function = "gelu", bits = 3 }``) is all an activation
needs, with a ``NAME_derivative_levels`` function below and its name in ``DERIVATIVES``.

GELU's levels also serve ``approximate="tanh"``: its backward evaluates the tanh form's
derivative at x_k, which differs from the exact one by at most 9e-4, far below the
quantisation error (about 0.065 relative at 3 bits).

The levels are computed once per (function, bits) on the host, in float64, by exact dynamic
programming over a grid of x in [-6, 6] (step 0.01): the optimal partition into 2**bits
intervals with edges on the grid. Non-finite inputs: +inf falls in the last interval and
-inf in the first (f' there is the function's limit: exact in the limit); NaN gets the
code ``torch.bucketize`` gives it (the last interval). The forward output was NaN there
already, so the loss is NaN either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from .base import (
    Compressor,
    ParamSpec,
    cached_constant,
    float_constant_compiled,
    host_checks,
    host_constant,
    is_compiling,
    is_low_precision,
    native_path,
    native_threads,
    pack_codes,
    pack_codes_compiled,
    pack_codes_fast,
    packed_code_bytes,
    prod,
    remember_plan,
    unpack_codes,
    unpack_codes_compiled,
    unpack_codes_fast,
    use_compiled_path,
    use_fast_path,
    widen_elements,
    widen_spans,
    work_dtype,
)

__all__ = [
    "DERIVATIVES",
    "FewBit",
    "derivative_levels",
    "gelu_derivative",
    "gelu_derivative_levels",
    "levels_of",
    "silu_derivative",
    "silu_derivative_levels",
]

GRID_LIMIT = 6.0
"""The levels are fitted on x in [-GRID_LIMIT, GRID_LIMIT] (the normal weight beyond is 2e-9)."""
GRID_CELLS = 1200
"""Grid cells over [-GRID_LIMIT, GRID_LIMIT]: interval edges are multiples of 0.01."""

Levels = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
"""(edges, levels, representatives): 2**bits - 1 increasing interval edges, then per
interval its level (the constant standing for f') and an x in it with f'(x) = level."""


def gelu_derivative(x: float) -> float:  # unroller-lint: host-only (constants)
    """d/dx of x * Phi(x): Phi(x) + x * phi(x) (exact GELU, approximate="none")."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) + x * math.exp(-0.5 * x * x) / math.sqrt(
        2.0 * math.pi
    )


def silu_derivative(x: float) -> float:  # unroller-lint: host-only (constants)
    """d/dx of x * sigmoid(x): s * (1 + x * (1 - s)) with s = sigmoid(x)."""
    s = 0.5 * (1.0 + math.tanh(0.5 * x))  # sigmoid without overflow for large |x|
    return s * (1.0 + x * (1.0 - s))


def derivative_levels(  # unroller-lint: host-only (constants)
    derivative: Callable[[float], float], bits: int
) -> Levels:
    """The optimal piecewise-constant approximation of ``derivative`` with 2**bits pieces,
    in mean square under the standard normal weight: exact dynamic programming over the grid
    (cost of a run of cells = weighted sum of squares around its weighted mean)."""
    pieces = 1 << bits
    h = 2.0 * GRID_LIMIT / GRID_CELLS
    x = -GRID_LIMIT + (np.arange(GRID_CELLS) + 0.5) * h
    d = np.array([derivative(float(v)) for v in x])
    w = np.exp(-0.5 * x * x)
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cs = np.concatenate([[0.0], np.cumsum(w * d)])
    cq = np.concatenate([[0.0], np.cumsum(w * d * d)])
    # cost[i, j]: cells i..j-1 as one piece (inf unless i < j)
    sw = cw[None, :] - cw[:, None]
    ss = cs[None, :] - cs[:, None]
    sq = cq[None, :] - cq[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.where(sw > 0, sq - ss * ss / np.where(sw > 0, sw, 1.0), np.inf)
    cost = np.where(np.triu(np.ones_like(cost, dtype=bool), 1), np.maximum(cost, 0.0), np.inf)
    best = cost[0].copy()  # best[j]: cells 0..j-1 in one piece
    choices = []
    for _ in range(pieces - 1):
        total = best[:, None] + cost
        arg = np.argmin(total, axis=0)
        choices.append(arg)
        best = total[arg, np.arange(GRID_CELLS + 1)]
    cuts = [GRID_CELLS]
    for arg in reversed(choices):
        cuts.append(int(arg[cuts[-1]]))
    cuts = cuts[::-1]  # cell indices where pieces start, after the first (which starts at 0)
    starts = [0, *cuts[:-1]]
    edges = tuple(-GRID_LIMIT + c * h for c in starts[1:])
    levels = tuple(float((cs[e] - cs[s]) / (cw[e] - cw[s])) for s, e in zip(starts, cuts))
    bounds = [-GRID_LIMIT, *edges, GRID_LIMIT]
    reps = tuple(
        _solve(derivative, level, bounds[k], bounds[k + 1]) for k, level in enumerate(levels)
    )
    return edges, levels, reps


def _solve(  # unroller-lint: host-only (constants)
    derivative: Callable[[float], float], level: float, lo: float, hi: float
) -> float:
    """An x in [lo, hi] with derivative(x) = level (to float64 precision): the first sign
    change of derivative - level on a fine scan, then bisection; the closest scanned point
    if the level is only touched (a constant piece)."""
    xs = np.linspace(lo, hi, 4001)
    r = np.array([derivative(float(v)) - level for v in xs])
    change = np.nonzero(np.signbit(r[:-1]) != np.signbit(r[1:]))[0]
    if len(change) == 0:
        return float(xs[int(np.argmin(np.abs(r)))])
    a, b = float(xs[change[0]]), float(xs[change[0] + 1])
    fa = derivative(a) - level
    for _ in range(100):
        mid = 0.5 * (a + b)
        fm = derivative(mid) - level
        if fm == 0.0 or mid in (a, b):
            return mid
        if (fm < 0) == (fa < 0):
            a, fa = mid, fm
        else:
            b = mid
    return 0.5 * (a + b)


@cache
def gelu_derivative_levels(bits: int) -> Levels:  # unroller-lint: host-only (constants)
    """Optimal intervals, levels and representatives of GELU's derivative (cached)."""
    return derivative_levels(gelu_derivative, bits)


@cache
def silu_derivative_levels(bits: int) -> Levels:  # unroller-lint: host-only (constants)
    """Optimal intervals, levels and representatives of SiLU's derivative (cached)."""
    return derivative_levels(silu_derivative, bits)


DERIVATIVES: dict[str, Callable[[int], Levels]] = {
    "gelu": gelu_derivative_levels,
    "silu": silu_derivative_levels,
}
"""The functions a registry ``derivative`` entry may name, with their levels."""

_PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,)}
"""Bit planes a code is stored in: 3-bit codes as a 2-bit plane (the low bits) and a 1-bit
plane (the high bit), so they take 3 bits per element, not 4."""


@host_constant
def levels_of(function: str, bits: int) -> Levels:  # unroller-lint: host-only (constants)
    """``DERIVATIVES[function](bits)``; a constant to torch.compile, which would otherwise
    trace the solver."""
    return DERIVATIVES[function](bits)


def _level_table(
    function: str, bits: int, which: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Edges (which=0) or representatives (which=2) of ``function``'s levels at ``bits``,
    as a tensor cached per (function, bits, which, dtype, device)."""
    values = levels_of(function, bits)[which]
    if is_compiling():  # one constant in the graph, no guard on the cache
        return float_constant_compiled([list(values)], dtype, device)[0]
    return cached_constant(
        ("fewbit", function, bits, which, dtype, device),
        lambda: torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values]),
    )


def _bit_plane_compiled(  # unroller-lint: host-only (compiled path)
    codes: Tensor, shift: int, bits: int
) -> Tensor:
    """Bits ``shift .. shift + bits - 1`` of the codes while torch.compile traces: a shift
    and a mask, where integer division would compile to a scalar loop."""
    return torch.bitwise_and(torch.bitwise_right_shift(codes, shift), (1 << bits) - 1)


def _bit_plane_fast(codes: Tensor, shift: int, p: int) -> Tensor:  # unroller-lint: host-only
    """The ``p`` bits of uint8 ``codes`` from bit ``shift`` on, by shift and mask (the CPU
    fast path; the same values as the floor division and remainder of the other paths)."""
    return codes.bitwise_right_shift(shift).bitwise_and_((1 << p) - 1)


def _interval_codes(x: Tensor, edges: Tensor) -> Tensor:  # unroller-lint: host-only
    """``torch.bucketize(x, edges).to(torch.uint8)``, code for code, by counting edges: the
    code of x is the number of edges below it, len(edges) minus those at or above it, and
    NaN, at or above none, gets len(edges) as bucketize gives it. With the few edges of a
    few-bit code (at most 15) this is a compare and a subtract per edge, several times
    faster on the CPU than bucketize's binary search per element."""
    codes = torch.full(x.shape, len(edges), dtype=torch.uint8, device=x.device)
    for k in range(len(edges)):
        codes.sub_(x.le(edges[k]).view(torch.uint8))
    return codes


class FewBit(Compressor):
    """Keeps x as the ``bits``-bit index of its interval of ``function``'s derivative; decodes
    to the interval's representative x_k, whose derivative is the interval's level.

    Packed form: one uint8 tensor [N, ceil(M * p / 8)] per bit plane p (3 bits: planes of 2
    and 1 bits), M = elements per sample. Lossy for x itself by design: only valid for the
    backward of the activation named by ``function`` (the stash planner uses it only there).
    Error of the gradient: |g| * |f'(x) - level(x)| per element, bounded per interval; the
    tests measure the mean-square error against the exact backward.

    float16 / bfloat16 inputs get the float32 input's codes without a float32 copy: the fast
    path compares them as they are with the edges rounded down to their dtype (``_low_edges``:
    the same outcome for every value), the native kernel is fed a span of
    ``base.WIDEN_ELEMENTS`` elements at a time; a float16 / bfloat16 output is looked up in
    the representatives of its dtype, a span at a time on the CPU.
    """

    name: ClassVar[str] = "fewbit"
    flops: ClassVar[float] = 8.0  # a bucket search and a table lookup per element
    lossless: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, ParamSpec]] = {
        "bits": ParamSpec(int, 3, "bits per element (2**bits intervals)", choices=(1, 2, 3, 4)),
        "function": ParamSpec(
            str, "gelu", "the activation whose derivative is coded", choices=tuple(DERIVATIVES)
        ),
    }

    def levels(self) -> Levels:  # unroller-lint: host-only (constants)
        """(edges, levels, representatives) of this codec's function and bits."""
        return levels_of(self.params["function"], self.params["bits"])

    def _table(self, which: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Edges (which=0) or representatives (which=2) as a cached tensor."""
        return _level_table(self.params["function"], self.params["bits"], which, dtype, device)

    def _low_edges(  # unroller-lint: host-only (fast cpu/cuda path)
        self, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """The float32 edges rounded down to ``dtype`` (float16 / bfloat16): each the largest
        ``dtype`` value at or below its float32 edge e, so that for every ``dtype`` value x
        (NaN and infinities included) x <= edge in ``dtype`` exactly when float32(x) <= e.
        The fast path then compares the low-precision input as it is, with the float32
        path's codes, and no float32 copy of it."""

        def build() -> Tensor:
            e32 = self._table(0, torch.float32, device)
            low = e32.to(dtype)
            below = torch.nextafter(low, torch.full_like(low, -math.inf))
            return torch.where(low.to(torch.float32) > e32, below, low)

        key = ("fewbit_low", self.params["function"], self.params["bits"], dtype, device)
        return cached_constant(key, build)

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        self._float_dtype(dtype)
        if len(shape) < 1:
            raise ValueError(f"{self!r}: expected a batch dimension, got shape {tuple(shape)}")
        m = prod(tuple(shape[1:]))
        return shape[0] * sum(packed_code_bytes(m, p) for p in _PLANES[self.params["bits"]])

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        # per (shape, dtype): the native call's sizes and table, so that a repeated call
        # (the same few shapes every step) checks its input and calls the kernel, as Quant's
        self._encode_plans: dict[tuple, tuple] = {}
        self._decode_plans: dict[tuple, tuple] = {}

    def compress(self, t: Tensor) -> tuple[Tensor, ...]:
        if isinstance(t, Tensor):
            plan = self._encode_plans.get((t.shape, t.dtype))
            if plan is not None:
                lib = native_path(t)
                if lib is not None:
                    return self._encode_planned(lib, t, *plan)
        self._float_input(t)
        n = t.shape[0]
        m = prod(tuple(t.shape[1:]))
        wd = work_dtype(t.dtype)
        edges = self._table(0, wd, t.device)
        lib = native_path(t)
        if lib is not None:
            if t.dtype == wd and n * m > 0:
                remember_plan(self._encode_plans, (t.shape, t.dtype), (n, m, edges.contiguous()))
            # a float16 / bfloat16 input is widened there, a span at a time
            return self._compress_native(lib, t.reshape(n, m), edges)
        compiled = use_compiled_path(t)
        fast = not compiled and use_fast_path(t)
        if fast and is_low_precision(t.dtype):  # compared as it is, with the edges rounded
            codes = _interval_codes(t.reshape(n, m), self._low_edges(t.dtype, t.device))
        elif fast:
            codes = _interval_codes(t.reshape(n, m).to(wd), edges)
        else:
            codes = torch.bucketize(t.reshape(n, m).to(wd), edges)  # edges[c-1] < x <= edges[c]
        pack = pack_codes_compiled if compiled else pack_codes_fast if fast else pack_codes
        packed = []
        shift = 0
        for p in _PLANES[self.params["bits"]]:
            if compiled:
                plane = _bit_plane_compiled(codes, shift, p)
            elif fast:
                plane = _bit_plane_fast(codes, shift, p)
            else:
                plane = torch.remainder(torch.div(codes, 1 << shift, rounding_mode="floor"), 1 << p)
            packed.append(pack(plane, p))
            shift += p
        return tuple(packed)

    def decompress(
        self, packed: tuple[Tensor, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        if packed and isinstance(packed[0], Tensor):
            plan = self._decode_plans.get((packed[0].shape, tuple(shape), dtype))
            if plan is not None and self._planned_ok(packed, plan[2]):
                lib = native_path(*packed)
                if lib is not None:
                    return self._decode_planned(lib, packed, *plan)
        self._float_dtype(dtype)
        planes = _PLANES[self.params["bits"]]
        if len(packed) != len(planes):
            raise ValueError(
                f"{self!r}: expected {len(planes)} packed bit planes, got {len(packed)}"
            )
        n = packed[0].shape[0]
        m = prod(tuple(shape))
        lib = native_path(*packed)
        if lib is not None and self._native_packed_ok(packed, n, m, dtype):
            if n * m > 0:
                reps = self._table(2, dtype, packed[0].device).contiguous()
                full = (n, *shape)
                sizes = tuple(t.shape for t in packed)
                key = (packed[0].shape, tuple(shape), dtype)
                remember_plan(self._decode_plans, key, (n, m, sizes, full, reps))
            return self._decompress_native(lib, packed, n, m, shape, dtype)
        compiled = use_compiled_path(*packed)
        fast = not compiled and use_fast_path(*packed)
        if fast and host_checks(packed[0]) and n * m > 0:
            return self._decompress_blocks(packed, n, m, shape, dtype)
        unpack = unpack_codes_compiled if compiled else unpack_codes_fast if fast else unpack_codes
        codes = None
        shift = 0
        for p, plane in zip(planes, packed):
            part = unpack(plane, p, m).to(torch.int32) * (1 << shift)
            codes = part if codes is None else codes + part
            shift += p
        reps = self._table(2, dtype, packed[0].device)
        x = torch.index_select(reps, 0, codes.reshape(-1))
        return x.reshape(n, *shape)

    def _decompress_blocks(  # unroller-lint: host-only (fast cpu path)
        self,
        packed: tuple[Tensor, ...],
        n: int,
        m: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> Tensor:
        """The fast path's ``decompress`` on the CPU, a span of ``base.WIDEN_ELEMENTS``
        elements at a time (whole bytes of every plane): the codes of a span gathered from
        its planes and looked up in the representatives of ``dtype``, written into their
        place in the output. The same values as one lookup of the whole tensor (what runs on
        CUDA), without its int32 index tensors (4 bytes an element, as large as a float32
        copy): an index is a span's."""
        planes = _PLANES[self.params["bits"]]
        for p, plane in zip(planes, packed):  # the planes' sizes, as unpacking checks them
            if plane.dim() != 2 or plane.shape != (n, packed_code_bytes(m, p)):
                raise ValueError(
                    f"{self!r}: a {p}-bit plane of {n} samples of {m} codes holds "
                    f"{packed_code_bytes(m, p)} bytes a sample, got shape {tuple(plane.shape)}"
                )
        reps = self._table(2, dtype, packed[0].device)
        out = torch.empty((n, m), dtype=dtype, device=packed[0].device)
        for i0, i1, j0, j1 in widen_spans(n, m, 8, max(8, widen_elements())):
            codes = None
            shift = 0
            for p, plane in zip(planes, packed):
                part = plane[i0:i1, j0 * p // 8 : j0 * p // 8 + packed_code_bytes(j1 - j0, p)]
                part = unpack_codes_fast(part, p, j1 - j0)
                if codes is None:
                    codes = part.to(torch.int32)
                else:
                    codes.add_(part.to(torch.int32).bitwise_left_shift_(shift))
                shift += p
            torch.index_select(reps, 0, codes.view(-1), out=out[i0:i1, j0:j1].view(-1))
        return out.view(n, *shape)

    # native cpu path ---------------------------------------------------------------------
    # ``native/fewbit_kernels.cpp``: the codes and their planes in one pass per chunk of a
    # sample, and back through the representatives' table; bit-identical (no arithmetic
    # rounds: compares, bit fields and a table lookup).

    def _compress_native(  # unroller-lint: host-only (native cpu path)
        self, lib, x: Tensor, edges: Tensor
    ) -> tuple[Tensor, ...]:
        """``compress`` of ``x`` [N, M] through the kernel: in the work dtype, or float16 /
        bfloat16, widened to float32 (exact) a span at a time, never as a whole."""
        n, m = x.shape
        if x.dtype != edges.dtype:
            return self._encode_widened(lib, x, n, m, edges.contiguous())
        return self._encode_planned(lib, x.contiguous(), n, m, edges.contiguous())

    def _encode_widened(  # unroller-lint: host-only (native cpu path)
        self, lib: Any, x: Tensor, n: int, m: int, edges: Tensor
    ) -> tuple[Tensor, ...]:
        """``_encode_planned`` of a float16 / bfloat16 ``x`` [n, m]: each span of
        ``base.WIDEN_ELEMENTS`` elements per thread (whole samples, or pieces of one whose
        lengths are multiples of 8: whole bytes of every plane) copied into one reused
        float32 buffer and coded into its place. Each element is coded on its own, so the
        bytes are those of one call on the whole widened tensor."""
        planes = _PLANES[self.params["bits"]]
        threads = native_threads(n * m)
        spans = widen_spans(n, m, 8, max(8, widen_elements() * threads))
        outs = [x.new_empty((n, packed_code_bytes(m, p)), dtype=torch.uint8) for p in planes]
        if n * m == 0:
            return tuple(outs)
        i0, i1, j0, j1 = spans[0]  # the largest span
        buf = x.new_empty((i1 - i0) * (j1 - j0), dtype=edges.dtype)
        for i0, i1, j0, j1 in spans:
            rows, width = i1 - i0, j1 - j0
            xb = buf[: rows * width].view(rows, width)
            xb.copy_(x[i0:i1, j0:j1])
            at = [o.data_ptr() + i0 * o.shape[1] + j0 * p // 8 for o, p in zip(outs, planes)]
            lib.ufb_encode_f32(
                xb.data_ptr(),
                rows,
                width,
                edges.data_ptr(),
                edges.numel(),
                planes[0],
                planes[1] if len(planes) > 1 else 0,
                at[0],
                at[1] if len(planes) > 1 else None,
                threads,
            )
        return tuple(outs)

    def _encode_planned(  # unroller-lint: host-only (native cpu path)
        self, lib: Any, t: Tensor, n: int, m: int, edges: Tensor
    ) -> tuple[Tensor, ...]:
        """``_compress_native`` for a (shape, dtype) seen before: a float32 / float64 input
        (the plan is only made for those); the same bytes."""
        if not t.is_contiguous():
            t = t.contiguous()
        planes = _PLANES[self.params["bits"]]
        outs = [t.new_empty((n, packed_code_bytes(m, p)), dtype=torch.uint8) for p in planes]
        encode = lib.ufb_encode_f64 if t.dtype is torch.float64 else lib.ufb_encode_f32
        encode(
            t.data_ptr(),
            n,
            m,
            edges.data_ptr(),
            edges.numel(),
            planes[0],
            planes[1] if len(planes) > 1 else 0,
            outs[0].data_ptr(),
            outs[1].data_ptr() if len(planes) > 1 else None,
            native_threads(n * m),
        )
        return tuple(outs)

    @staticmethod
    def _planned_ok(packed: tuple[Tensor, ...], sizes: tuple) -> bool:
        """Whether packed planes are exactly the uint8 tensors a decode plan read."""
        return len(packed) == len(sizes) and all(
            t.dtype is torch.uint8 and t.shape == size and t.is_contiguous()
            for t, size in zip(packed, sizes)
        )

    def _decode_planned(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        packed: tuple[Tensor, ...],
        n: int,
        m: int,
        sizes: tuple,
        full: tuple[int, ...],
        reps: Tensor,
    ) -> Tensor:
        """``_decompress_native`` for a (planes, shape, dtype) seen before."""
        return self._decode(lib, packed, n, m, full, reps)

    def _decode(  # unroller-lint: host-only (native cpu path)
        self,
        lib: Any,
        packed: tuple[Tensor, ...],
        n: int,
        m: int,
        full: tuple[int, ...],
        reps: Tensor,
    ) -> Tensor:
        """The kernel's call on contiguous planes, into a new tensor of ``reps``' dtype."""
        planes = _PLANES[self.params["bits"]]
        out = packed[0].new_empty(full, dtype=reps.dtype)
        decode = lib.ufb_decode_f64 if reps.dtype is torch.float64 else lib.ufb_decode_f32
        decode(
            packed[0].data_ptr(),
            packed[1].data_ptr() if len(planes) > 1 else None,
            n,
            m,
            planes[0],
            planes[1] if len(planes) > 1 else 0,
            reps.data_ptr(),
            out.data_ptr(),
            native_threads(n * m),
        )
        return out

    def _native_packed_ok(  # unroller-lint: host-only (native cpu path)
        self, packed: tuple[Tensor, ...], n: int, m: int, dtype: torch.dtype
    ) -> bool:
        """Planes of exactly the bytes the kernel reads (it trusts them), and an output dtype
        it writes (float32, float64); anything else takes the PyTorch path, which raises the
        usual errors for malformed input."""
        planes = _PLANES[self.params["bits"]]
        return dtype in (torch.float32, torch.float64) and all(
            t.dtype == torch.uint8 and tuple(t.shape) == (n, packed_code_bytes(m, p))
            for t, p in zip(packed, planes)
        )

    def _decompress_native(  # unroller-lint: host-only (native cpu path)
        self,
        lib,
        packed: tuple[Tensor, ...],
        n: int,
        m: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> Tensor:
        """``decompress`` through the kernel: each code's representative, in ``dtype``
        (``m`` elements per sample, of ``shape``)."""
        reps = self._table(2, dtype, packed[0].device).contiguous()
        ins = tuple(t.contiguous() for t in packed)
        return self._decode(lib, ins, n, m, (n, *shape), reps)
