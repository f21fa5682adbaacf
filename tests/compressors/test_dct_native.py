"""The native DCT kernel (``unroller/compress/native/dct_kernels.cpp``).

It runs by default for int8 storage and float32 work on the CPU, and it is not bit-identical
to the PyTorch formulations (its products are not BLAS's). What it must do instead:
- agree with the PyTorch formulation within the contract of ``tests/codec_agreement``, over
  block sizes, keeps, fold, odd plane sizes and value ranges (derandomised cases);
- meet the same error bound against the exact chop (compared with the PyTorch path's error);
- propagate non-finite values and keep all-zero and constant planes as the PyTorch path does;
- give the same bits whatever the thread count;
- fall back to the PyTorch formulation when the kernel cannot run.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from tests.codec_agreement import assert_dct_close, same_bits
from tests.native_variants import variants, x86_only
from unroller.compress import Dct, base
from unroller.compress import native as native_module
from unroller.compress.dct import prescale_exponent

pytestmark = pytest.mark.skipif(
    native_module.library() is None, reason="no native kernels (no C++ compiler?)"
)

CASES = [
    ((4, 64, 32, 32), {}),
    ((4, 512, 4, 4), {}),
    ((2, 3, 13, 7), {}),
    ((1, 1, 1, 1), {}),
    ((2, 1, 1, 13), {}),
    ((2, 5, 33, 33), {"keep": 8}),
    ((3, 4, 20, 20), {"fold": True}),
    ((2, 2, 8, 8), {"fold": True}),
    ((2, 3, 17, 9), {"block": 16, "keep": 5}),
    ((2, 2, 8, 8), {"keep": 8}),
    ((1, 2, 70, 65), {"block": 64, "keep": 3, "fold": True}),
    ((2, 3, 9, 10), {"block": 1, "keep": 1}),
    ((2, 3, 11, 6), {"block": 5, "keep": 2}),
    ((2, 2, 12, 12), {"block": 4, "keep": 2}),
    ((2, 2, 16, 24), {"block": 8, "keep": 2}),
]


def field(shape, seed: int, smooth: bool = True) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if smooth and shape[-1] >= 5 and shape[-2] >= 5:
        x = torch.nn.functional.avg_pool2d(x, 5, 1, 2)
    return x


def round_trip(c: Dct, x: torch.Tensor, native: bool):
    saved = base.NATIVE
    base.NATIVE = native
    try:
        packed = c.compress(x)
        return packed, c.decompress(packed, tuple(x.shape[1:]), x.dtype)
    finally:
        base.NATIVE = saved


@pytest.mark.parametrize("shape, params", CASES, ids=lambda v: str(v))
def test_native_agrees_with_pytorch(shape, params):
    c = Dct(**params)
    for seed, scale in enumerate((1.0, 1e-30, 1e30, 3.0)):
        x = field(shape, seed, smooth=seed % 2 == 0) * scale
        got, want = round_trip(c, x, True), round_trip(c, x, False)
        assert_dct_close(c, *got, *want, what=(shape, params, seed))
        # each path decompresses the other's codes to within float rounding
        for packed in (got[0], want[0]):
            a = round_trip_decompress(c, packed, x, True)
            b = round_trip_decompress(c, packed, x, False)
            assert_dct_close(c, packed, a, packed, b)


def round_trip_decompress(c: Dct, packed, x: torch.Tensor, native: bool) -> torch.Tensor:
    saved = base.NATIVE
    base.NATIVE = native
    try:
        return c.decompress(packed, tuple(x.shape[1:]), x.dtype)
    finally:
        base.NATIVE = saved


def test_native_runs_by_default(monkeypatch):
    """int8 / float32 on the CPU takes the kernel; other forms the PyTorch formulation."""

    calls = []
    real_c, real_d = Dct._compress_native, Dct._decompress_native
    monkeypatch.setattr(Dct, "_compress_native", lambda *a: calls.append("c") or real_c(*a))
    monkeypatch.setattr(Dct, "_decompress_native", lambda *a: calls.append("d") or real_d(*a))
    x = field((2, 3, 8, 8), 0)
    c = Dct()
    c.decompress(c.compress(x), (3, 8, 8), torch.float32)
    assert calls == ["c", "d"]
    calls.clear()
    # float64 work, other storage, float16 output: the PyTorch formulation
    c.compress(x.double())
    Dct(storage="bf16").compress(x)
    c.decompress(c.compress(x), (3, 8, 8), torch.float16)
    assert calls == ["c"]  # the float32 compression only


def test_native_error_bound_matches_pytorch():
    """Against the exact chop (float64), the native round trip errs as the PyTorch one does."""
    for shape, params in CASES[:10]:
        c = Dct(**params)
        x = field(shape, 7)
        exact = Dct(**{**params, "storage": "f32"})
        base.NATIVE = False
        try:
            chop = exact.decompress(exact.compress(x.double()), tuple(shape[1:]), torch.float64)
        finally:
            base.NATIVE = True
        (_, y_n), (_, y_t) = round_trip(c, x, True), round_trip(c, x, False)
        err_n = (y_n.double() - chop).norm() / chop.norm().clamp_min(1e-300)
        err_t = (y_t.double() - chop).norm() / chop.norm().clamp_min(1e-300)
        assert err_n <= err_t * 1.01 + 1e-6, (shape, params, float(err_n), float(err_t))


def test_native_special_values():
    x = field((3, 4, 9, 10), 1)
    x[0, 0, 1, 2], x[0, 1, 3, 3], x[0, 2, 0, 0] = math.nan, math.inf, -math.inf
    x[1, 0] = 3.0e38
    x[1, 1] = 1e-40  # subnormal constant plane
    x[1, 2] = -0.0
    x[1, 3] = 0.0
    x[2, 0] = 7.25
    c = Dct()
    (q, scale), y = round_trip(c, x, True)
    want, y_want = round_trip(c, x, False)
    assert_dct_close(c, (q, scale), y, want, y_want)
    assert torch.isnan(y[0, :3]).all() and torch.isfinite(y[0, 3]).all()  # whole channel
    assert torch.equal(q[0, :3], torch.zeros_like(q[0, :3]))  # NaN -> code 0
    assert scale[1, 2] == 1 and scale[1, 3] == 1 and not y[1, 2:].any()  # all-zero planes
    assert torch.allclose(y[2, 0], torch.full_like(y[2, 0], 7.25), rtol=1e-6, atol=0)
    assert torch.isfinite(y[1, 0]).all()  # huge finite values never overflow


def test_native_same_bits_for_any_thread_count(monkeypatch):
    x = field((4, 16, 24, 24), 3)
    c = Dct(fold=True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            monkeypatch.setattr(base, "THREAD_ELEMENTS", 64)  # a thread per few planes
            results.append(round_trip(c, x, True))
    finally:
        torch.set_num_threads(threads)
    (packed0, y0), *rest = results
    for packed, y in rest:
        assert all(same_bits(a, b) for a, b in zip(packed, packed0)) and same_bits(y, y0)


def test_native_failure_falls_back(monkeypatch):
    """A kernel that reports failure (no scratch memory) leaves the PyTorch formulation to
    run, with its exact bits."""

    class Failing:
        def ud_compress_f32(self, *args):
            return 1

        def ud_decompress_f32(self, *args):
            return 1

    x = field((2, 3, 16, 16), 4)
    c = Dct()
    want_packed, want_y = round_trip(c, x, False)
    monkeypatch.setattr("unroller.compress.dct_host.native_library", lambda *t: Failing())
    packed = c.compress(x)
    assert all(same_bits(a, b) for a, b in zip(packed, want_packed))
    assert same_bits(c.decompress(packed, (3, 16, 16), torch.float32), want_y)


def test_native_reads_only_its_own_layout(monkeypatch):
    """Packed tensors of another dtype or shape never reach the kernel (which would read them
    as int8 codes of this layout): the PyTorch formulation takes them, with its own bits."""
    c = Dct()
    x = field((2, 3, 16, 16), 5)
    q, scale = c.compress(x)
    odd = [(q.reshape(2, 3, -1), scale), (q, scale.double()), (q.short(), scale)]
    want = [round_trip_decompress(c, p, x, False) for p in odd]

    def boom(*args):
        raise AssertionError("kernel used")

    monkeypatch.setattr(Dct, "_decompress_native", boom)
    for p, y in zip(odd, want):
        assert same_bits(c.decompress(p, (3, 16, 16), torch.float32), y)


def test_scale_headroom_documented():
    """The stored coefficients are divided by 2**e (e = ceil(log2(block))), in the kernel as
    in the PyTorch path: the codes of a plane of constant v are DC = v * block / 2**e."""
    c = Dct()
    x = torch.full((1, 1, 8, 8), 2.0)
    (q, scale), _ = round_trip(c, x, True)
    dc = float(q[0, 0, 0, 0, 0, 0]) * float(scale[0, 0])
    assert dc == pytest.approx(2.0 * 8 / 2 ** prescale_exponent(8), rel=1e-6)


@x86_only
def test_native_dct_same_bits_on_every_instruction_set_and_without_shuffles(tmp_path):
    """The clone a CPU picks (baseline SSE2, AVX2, AVX-512) and a compiler without vector
    shuffles give the library's bits: every lane of the vector steps is the scalar loops'
    sequence of operations."""
    lib = native_module.library()
    built = variants(tmp_path, "dct_kernels.cpp", "UD_SHUFFLE")
    for variant in built:
        variant.ud_compress_f32.restype = variant.ud_decompress_f32.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fold in (False, True):
        c = Dct(fold=fold)
        for shape in ((3, 5, 37, 29), (2, 3, 16, 8), (1, 2, 8, 40), (2, 4, 64, 64)):
            x = field(shape, 11) * 3
            n, ch, h, w = shape
            tk, down, up = (m.contiguous() for m in c._matrices(torch.float32, x.device))
            hb, wb = -(-h // 8), -(-w // 8)
            kept = 10 if fold else 16
            results = []
            for variant in [lib, *built]:
                q = torch.zeros(n * ch * hb * wb * kept, dtype=torch.int8)
                scale = torch.zeros(n * ch)
                out = torch.empty_like(x)
                args = (n * ch, h, w, 8, 4, int(fold))
                fn = variant.ud_compress_f32
                fn.argtypes = [p, i64, i64, i64, i64, i64, ctypes.c_int, p, p, p, p, ctypes.c_int]
                fn(
                    x.data_ptr(),
                    *args,
                    down.data_ptr(),
                    tk.data_ptr(),
                    q.data_ptr(),
                    scale.data_ptr(),
                    1,
                )
                fn = variant.ud_decompress_f32
                fn.argtypes = [p, p, i64, i64, i64, i64, i64, ctypes.c_int, p, p, p, ctypes.c_int]
                fn(
                    q.data_ptr(),
                    scale.data_ptr(),
                    *args,
                    tk.data_ptr(),
                    up.data_ptr(),
                    out.data_ptr(),
                    1,
                )
                results.append((q, scale, out))
            for got in results[1:]:
                assert all(same_bits(a, b) for a, b in zip(results[0], got)), (fold, shape)
