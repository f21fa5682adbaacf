"""The native few-bit kernels (``unroller/compress/native/fewbit_kernels.cpp``): bit-identical
to the PyTorch formulations (packed planes and decoded tensors) at every bit width, both
functions, the float dtypes, lengths around the kernel's 2048-code chunks and its 8- and
32-code steps, NaN and +-inf, on 1 and 2 threads, through its AVX2 chunks (where the CPU has
them) and its portable ones; malformed packed forms never reach the kernel."""

from __future__ import annotations

import math

import pytest
import torch

from tests.codec_agreement import same_bits
from unroller.compress import FewBit, base
from unroller.compress import native as native_module

pytestmark = pytest.mark.skipif(
    native_module.library() is None, reason="no native kernels (no C++ compiler?)"
)

SHAPES = [
    (3, 5),
    (2, 7, 13),
    (4, 64, 64),
    (2, 31),
    (2, 33),
    (1, 65),
    (2, 2047),
    (2, 2048),
    (1, 4099),
    (0, 5),
    (3, 0),
]


@pytest.fixture(params=["fastest", "portable"])
def chunks(request):
    """Which chunks the kernel runs: its fastest for this CPU, or the portable ones only."""
    lib = native_module.library()
    lib.ufb_set_generic(1 if request.param == "portable" else 0)
    yield request.param
    lib.ufb_set_generic(0)


def both(c: FewBit, x: torch.Tensor, dtype: torch.dtype):
    out = {}
    for native in (False, True):
        saved = base.NATIVE
        base.NATIVE = native
        try:
            packed = c.compress(x)
            out[native] = (packed, c.decompress(packed, tuple(x.shape[1:]), dtype))
        finally:
            base.NATIVE = saved
    return out[False], out[True]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("function", ["gelu", "silu"])
def test_native_fewbit_bit_identical(bits, function, chunks):
    c = FewBit(bits=bits, function=function)
    g = torch.Generator().manual_seed(bits)
    for shape in SHAPES:
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            x = (torch.randn(shape, generator=g) * 3).to(dtype)
            if x.numel() > 4:
                flat = x.view(-1)
                flat[0], flat[1], flat[2] = math.nan, math.inf, -math.inf
                flat[3] = float(c.levels()[0][0])  # exactly on an edge: x <= edge
            (p_t, y_t), (p_n, y_n) = both(c, x, dtype)
            assert len(p_t) == len(p_n)
            assert all(same_bits(a, b) for a, b in zip(p_t, p_n)), (shape, dtype)
            assert same_bits(y_t, y_n), (shape, dtype)


def test_native_fewbit_threads(monkeypatch, chunks):
    monkeypatch.setattr(base, "THREAD_ELEMENTS", 1 << 10)
    x = torch.randn((6, 3000), generator=torch.Generator().manual_seed(1))
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            (p_t, y_t), (p_n, y_n) = both(FewBit(bits=3), x, torch.float32)
            assert all(same_bits(a, b) for a, b in zip(p_t, p_n)) and same_bits(y_t, y_n)
    finally:
        torch.set_num_threads(saved)


def test_native_fewbit_used_and_malformed_forms_refused(monkeypatch):
    c = FewBit(bits=3)
    x = torch.randn(2, 100)
    calls = []
    real_c, real_d = FewBit._compress_native, FewBit._decompress_native
    monkeypatch.setattr(FewBit, "_compress_native", lambda *a: calls.append("c") or real_c(*a))
    monkeypatch.setattr(FewBit, "_decompress_native", lambda *a: calls.append("d") or real_d(*a))
    packed = c.compress(x)
    c.decompress(packed, (100,), torch.float32)
    assert calls == ["c", "d"]
    calls.clear()
    with pytest.raises((RuntimeError, ValueError)):  # a short plane: the PyTorch path says so
        c.decompress((packed[0][:, :-1], packed[1]), (100,), torch.float32)
    c.decompress(packed, (100,), torch.float16)  # no native float16 output
    assert calls == []


def test_repeated_fewbit_calls_reuse_their_plan_and_still_check_their_inputs():
    """A second call of a shape takes the remembered plan and gives the first call's bits;
    another dtype, a strided view, a short plane, another output dtype and ``NATIVE`` off
    do not take it, and still get the right answer or the error."""
    c = FewBit(bits=3)
    x = torch.randn((4, 8, 32), generator=torch.Generator().manual_seed(2)) * 3
    first = c.compress(x)
    y_first = c.decompress(first, (8, 32), torch.float32)
    assert (x.shape, x.dtype) in c._encode_plans
    assert (first[0].shape, (8, 32), torch.float32) in c._decode_plans
    again = c.compress(x)
    assert all(same_bits(a, b) for a, b in zip(first, again))
    assert same_bits(c.decompress(again, (8, 32), torch.float32), y_first)
    (p_t, y_t), (p_n, y_n) = both(c, x, torch.float32)  # NATIVE off, then on (the plan)
    assert all(same_bits(a, b) for a, b in zip(p_t, first)) and same_bits(y_t, y_first)
    assert all(same_bits(a, b) for a, b in zip(p_n, first)) and same_bits(y_n, y_first)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert all(same_bits(a, b) for a, b in zip(c.compress(strided), first))
    (p_t, y_t), (p_n, y_n) = both(c, x.double(), torch.float64)
    assert all(same_bits(a, b) for a, b in zip(p_t, p_n)) and same_bits(y_t, y_n)
    with pytest.raises((RuntimeError, ValueError)):
        c.decompress((first[0][:, :-1], first[1]), (8, 32), torch.float32)
    half = c.decompress(first, (8, 32), torch.float16)
    assert half.dtype == torch.float16 and same_bits(half, y_first.to(torch.float16))


@pytest.mark.parametrize("chunk_kind", ["fastest", "portable"])
def test_native_fewbit_any_edge_count(chunk_kind):
    """An edge count that is not 2**bits - 1 (5 edges, one 4-bit plane) takes the kernel's
    general loop: codes as torch.bucketize gives them, packed as base.pack_codes packs."""
    lib = native_module.library()
    lib.ufb_set_generic(1 if chunk_kind == "portable" else 0)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn((3, 2049), generator=g) * 2
        x[0, 0], x[1, 1] = math.nan, math.inf
        edges = torch.tensor([-1.5, -0.5, 0.0, 0.5, 1.5])
        x[2, 3] = 0.0  # on an edge: x <= edge
        out = torch.zeros((3, (2049 * 4 + 7) // 8), dtype=torch.uint8)
        lib.ufb_encode_f32(
            x.data_ptr(), 3, 2049, edges.data_ptr(), 5, 4, 0, out.data_ptr(), None, 1
        )
        codes = torch.where(torch.isnan(x), 5, torch.bucketize(x, edges))
        assert torch.equal(out, base.pack_codes(codes, 4))
    finally:
        lib.ufb_set_generic(0)
