"""``quant`` on the tensors transformers save, at 8, 4 and 2 bits, and its native kernels.

- native vs PyTorch: the compiled kernels (compress/native) give the packed bytes and the
  decompressed tensors of the PyTorch fast path bit for bit, on token tensors [N, L, E],
  their [N*L, E] views and per-head tensors [N, H, L, D], at every bit width, dtype and
  awkward length (skipped, with the reason, where no compiler is found);
- error bounds: |x - decode(encode(x))| <= scale / 2 per group (round to nearest), < scale
  (stochastic), checked on every element against the group's own stored scale;
- stochastic rounding is unbiased: over many seeded generators the mean of the round trips
  converges to x within a Bernstein bound computed from each element's variance
  scale**2 * p * (1 - p) (p the fractional part of its code), per element and summed;
- packed sizes are what docs/compressors.md says: N * (ceil(M * bits / 8) + 2 * groups * w);
- edge cases: constant rows, zero and -0.0 rows, NaN and +-inf (their group decodes to NaN,
  the others are untouched), lengths that do not fill a byte, empty batches and rows;
- the loader: UNROLLER_NATIVE=0 and a missing compiler fall back; a built library is reused
  from the cache; malformed packed forms never reach the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.codec_agreement import same_bits
from tests.native_variants import variants, x86_only
from unroller.compiler.schemes import ROWS, load_config, make_codec
from unroller.compress import Quant, base, make, native, packed_nbytes

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BITS = [8, 4, 2]


@pytest.fixture(scope="module")
def native_lib():
    """The native kernels, or a skip that says why they could not be had."""
    lib = native.library()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.build_error() or 'disabled'}")
    return lib


@contextlib.contextmanager
def native_path(on: bool) -> Iterator[None]:
    saved = base.NATIVE
    base.NATIVE = on
    try:
        yield
    finally:
        base.NATIVE = saved


def trip(c: Quant, x: torch.Tensor, seed: int = 0, dtype: torch.dtype | None = None):
    """(packed, decompressed), the noise from a generator seeded with ``seed``."""
    with torch.no_grad():
        packed = c.compress(x, generator=torch.Generator().manual_seed(seed))
        y = c.decompress(packed, tuple(x.shape[1:]), dtype or x.dtype)
    assert packed_nbytes(packed) == c.stored_bytes(tuple(x.shape), x.dtype)
    return packed, y


def tokens(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Token-like rows: normal values with a per-row scale spanning six decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.logspace(-3, 3, shape[-2] if len(shape) > 1 else 1, dtype=torch.float64).view(
        *([1] * (len(shape) - 2)), -1, 1
    )
    return x.to(dtype)


def hostile(dtype: torch.dtype) -> torch.Tensor:
    """[3, 6, 13] rows: NaN, +inf, -inf, a huge range (the halving step), constants, zeros,
    -0.0, a mix of +0.0 and -0.0, subnormals, and ordinary rows."""
    fin = torch.finfo(dtype)
    x = tokens((3, 6, 13), seed=3, dtype=torch.float64)
    x[0, 0, 4] = float("nan")
    x[0, 1, 0] = float("inf")
    x[0, 2, 12] = -float("inf")
    x[0, 3] = fin.max * 0.75
    x[0, 3, 5] = -fin.max * 0.75
    x[1, 0] = 7.25
    x[1, 1] = 0.0
    x[1, 2] = -0.0
    x[1, 3, ::2] = -0.0
    x[1, 3, 1::2] = 0.0
    x[1, 4, :6] = -0.0
    x[1, 4, 6:] = 0.5
    x[2, 0] = fin.smallest_normal / 4
    x[2, 0, 3] = 0.0
    return x.to(dtype)


def per_group(values: torch.Tensor, x_shape: tuple[int, ...], group: int) -> torch.Tensor:
    """[N, groups] per-group values spread over the [N, M] elements of each sample."""
    m = math.prod(x_shape[1:])
    ids = (torch.arange(m) // group).expand(x_shape[0], -1)
    return values.double().gather(1, ids).view(x_shape)


def group_of(c: Quant, shape: tuple[int, ...]) -> int:
    return c.layout(shape)[2]


# -- the layouts: per row ---------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_token_layouts_group_per_row(bits):
    """[N, L, E] and [N*L, E] group per token; [N, H, L, D] rows get group_size = D from
    the planner (Codec.fit with the rows layout); the stored scales are each row's own."""
    x = tokens((2, 5, 24))
    codec = make_codec("quant", {"bits": bits})
    levels = (1 << bits) - 1
    for shape in [(2, 5, 24), (10, 24), (2, 3, 5, 8)]:
        fitted, why = codec.fit(shape, ROWS)
        c = fitted.instance()
        assert why == "" and group_of(c, shape) == shape[-1]
        t = x.reshape(shape)
        (_, mn, scale), _ = trip(c, t)
        rows = t.reshape(-1, shape[-1]).double()
        assert torch.equal(mn.reshape(-1).double(), rows.amin(-1))
        expect = ((rows.amax(-1) - rows.amin(-1)) / levels).float()
        assert torch.allclose(scale.reshape(-1), expect, rtol=1e-6, atol=0)


# -- native == PyTorch -------------------------------------------------------------------


def assert_native_matches(c: Quant, x: torch.Tensor, seed: int = 0, dtype=None) -> None:
    with native_path(False):
        packed_t, y_t = trip(c, x, seed, dtype)
    with native_path(True):
        packed_n, y_n = trip(c, x, seed, dtype)
        # and across: packed by one path, decompressed by the other
        with torch.no_grad():
            y_cross = c.decompress(packed_t, tuple(x.shape[1:]), dtype or x.dtype)
    for i, (a, b) in enumerate(zip(packed_n, packed_t)):
        assert same_bits(a, b), (c, tuple(x.shape), x.dtype, "packed", i)
    assert same_bits(y_n, y_t), (c, tuple(x.shape), x.dtype, "decompressed")
    assert same_bits(y_cross, y_t), (c, tuple(x.shape), x.dtype, "cross")


SHAPES = [(4, 16, 64), (64, 64), (2, 3, 8, 16), (3, 5, 7), (2, 9, 13), (1, 1, 1), (5, 3), (2, 1)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits", BITS)
def test_native_is_bit_identical_to_pytorch(native_lib, bits, dtype):
    for k, shape in enumerate(SHAPES):
        x = tokens(shape, seed=k, dtype=dtype)
        for group_size in (None, shape[-1], 3, 5, 64, 1000):
            for stochastic in (False, True):
                c = Quant(bits=bits, group_size=group_size, stochastic=stochastic)
                assert_native_matches(c, x, seed=k)
    x = hostile(dtype)
    for group_size in (None, 13, 4, 7, 39):
        for stochastic in (False, True):
            c = Quant(bits=bits, group_size=group_size, stochastic=stochastic)
            assert_native_matches(c, x)
            assert_native_matches(c, x, dtype=torch.float32)  # decompressed to another dtype


def test_native_is_bit_identical_on_large_inputs_and_threads(native_lib, monkeypatch):
    """More elements than one thread takes (base.THREAD_ELEMENTS, lowered here so that a
    small tensor is split), on 1 and 2 threads."""
    monkeypatch.setattr(base, "THREAD_ELEMENTS", 1 << 14)
    x = tokens((6, 40, 1100), seed=5)
    x[3, 7, 100] = float("nan")
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for c in [Quant(), Quant(bits=4), Quant(bits=2, stochastic=True)]:
                assert_native_matches(c, x)
                assert_native_matches(c, x.reshape(240, 1100))
            assert_native_matches(Quant(bits=2, group_size=7), x.reshape(3, -1))
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(params=["fastest", "general"])
def quant_loops(request, native_lib):
    """Which loops the quant kernel runs: its fastest for this CPU (the short-group paths
    where it has AVX2), or the general ones only (``uq_set_generic``)."""
    native_lib.uq_set_generic(1 if request.param == "general" else 0)
    yield request.param
    native_lib.uq_set_generic(0)


def short_rows(group: int, dtype=torch.float32) -> torch.Tensor:
    """[3, 8, group] rows of every kind ``hostile`` has (NaN, +-inf, a range past the
    halving step, constants, zeros, -0.0, subnormals), at a row length the kernel's
    short-group paths take, plus ordinary rows."""
    fin = torch.finfo(dtype)
    x = tokens((3, 8, group), seed=group, dtype=torch.float64)
    x[0, 0, group // 2] = float("nan")
    x[0, 1, 0] = float("inf")
    x[0, 2, group - 1] = -float("inf")
    x[0, 3] = fin.max * 0.75
    x[0, 3, 1] = -fin.max * 0.75
    x[0, 4, 3] = float("nan")
    x[0, 4, 5] = float("inf")
    x[1, 0] = 7.25
    x[1, 1] = 0.0
    x[1, 2] = -0.0
    x[1, 3, ::2] = -0.0
    x[1, 3, 1::2] = 0.0
    x[1, 4, : group // 2] = -0.0
    x[1, 4, group // 2 :] = 0.5
    x[1, 5] = fin.max
    x[1, 5, 2] = -fin.max
    x[2, 0] = fin.smallest_normal / 4
    x[2, 0, 3] = 0.0
    x[2, 1] = x[2, 1].abs() + 1.0  # no zero in the row
    return x.to(dtype)


@pytest.mark.parametrize("group", [8, 16, 32, 64, 128, 24])
def test_native_short_groups_are_bit_identical(quant_loops, group):
    """Rows of 8 to 128 float32 elements at 8 bits, one group each (token rows [N, L, E] and
    per-head rows [N, H, L, D]), the kernel's short-group paths where the CPU has AVX2 and
    its general loops: the PyTorch path's bytes and values, every hostile row included (24:
    a length the short paths do not take)."""
    x = short_rows(group)
    assert_native_matches(Quant(), x)
    assert_native_matches(Quant(group_size=group), x.reshape(3, 2, 4, group))
    assert_native_matches(Quant(), x, dtype=torch.float64)  # decoded to another dtype
    assert_native_matches(Quant(group_size=group), x.reshape(3, -1))


@x86_only
def test_native_quant_same_bits_on_every_instruction_set_and_without_shuffles(tmp_path):
    """The quant kernel built for baseline x86-64, for AVX2 and without vector shuffles
    gives the library's bits on short and long rows, hostile ones included."""
    lib = native.library()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.build_error() or 'disabled'}")
    built = variants(tmp_path, "quant_kernels.cpp", "UQ_SHUFFLE")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for variant in built:
        variant.uq_encode_f32.argtypes = [p, p, i64, i64, i64, i32, p, p, p, i32]
        variant.uq_decode_f32.argtypes = [p, p, p, i64, i64, i64, i32, p, i32]
    for group in (8, 16, 32, 64, 128, 40):
        x = short_rows(group).reshape(3, -1).contiguous()
        n, m = x.shape
        for bits in (8, 4):
            results = []
            for variant in [lib, *built]:
                codes = torch.zeros(n, math.ceil(m * bits / 8), dtype=torch.uint8)
                mn, scale = torch.zeros(n, m // group), torch.zeros(n, m // group)
                out = torch.zeros(n, m)
                variant.uq_encode_f32(
                    x.data_ptr(),
                    None,
                    n,
                    m,
                    group,
                    bits,
                    *(t.data_ptr() for t in (codes, mn, scale)),
                    1,
                )
                variant.uq_decode_f32(
                    *(t.data_ptr() for t in (codes, mn, scale)),
                    n,
                    m,
                    group,
                    bits,
                    out.data_ptr(),
                    1,
                )
                results.append((codes, mn, scale, out))
            for got in results[1:]:
                assert all(same_bits(a, b) for a, b in zip(results[0], got)), (group, bits)


def test_repeated_calls_reuse_their_plan_and_still_check_their_inputs(native_lib):
    """The second call of a shape takes the remembered plan (``_encode_plans``,
    ``_decode_plans``) and gives the first call's bits; an input that differs in anything
    the plan assumed (dtype, contiguity, the packed tensors' dtypes or sizes, the output
    dtype, ``NATIVE`` off) does not take it and still gets the right answer or the error."""
    c = Quant(group_size=16)
    x = short_rows(16)
    first, y_first = trip(c, x)
    assert (x.shape, x.dtype) in c._encode_plans
    assert (first[0].shape, tuple(x.shape[1:]), x.dtype) in c._decode_plans
    again, y_again = trip(c, x)
    assert all(same_bits(a, b) for a, b in zip(first, again)) and same_bits(y_first, y_again)
    with native_path(False):
        expect, y_expect = trip(c, x)
    assert all(same_bits(a, b) for a, b in zip(first, expect)) and same_bits(y_first, y_expect)
    # another dtype of the same shape, and a strided view of it: not the float32 plan
    assert_native_matches(c, x.double())
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    assert_native_matches(c, strided)
    # packed tensors that differ from what the plan read: the general checks decide
    codes, mn, scale = first
    y = c.decompress((codes, mn.double(), scale.double()), tuple(x.shape[1:]), torch.float32)
    assert same_bits(y, y_first)
    with pytest.raises((ValueError, RuntimeError)):
        c.decompress((codes, mn[:, :-1], scale), tuple(x.shape[1:]), torch.float32)
    with pytest.raises((ValueError, RuntimeError)):
        c.decompress((codes, mn, scale[:1]), tuple(x.shape[1:]), torch.float32)
    half = c.decompress(first, tuple(x.shape[1:]), torch.float16)
    assert half.dtype == torch.float16
    assert same_bits(half, y_first.to(torch.float16))


def test_native_refuses_malformed_packed_forms(native_lib):
    """A packed form of the wrong size goes to the PyTorch path, which raises: the kernel
    never reads past a tensor's end."""
    c = Quant(bits=4)
    x = tokens((2, 4, 10))
    codes, mn, scale = c.compress(x)
    for bad in [(codes[:, :-1], mn, scale), (codes, mn[:, :-1], scale), (codes, mn, scale[:1])]:
        with pytest.raises((ValueError, RuntimeError)):
            c.decompress(bad, (4, 10), torch.float32)


# -- error bounds ------------------------------------------------------------------------


@pytest.mark.parametrize("on", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", BITS)
def test_round_to_nearest_within_half_a_step(on, dtype, bits):
    """|x - x_hat| <= scale / 2 on every element, scale the element's stored group scale,
    plus the arithmetic's rounding (a few units in the last place of the values involved)."""
    eps = torch.finfo(dtype).eps
    for shape in [(4, 16, 64), (64, 33), (2, 3, 5, 7)]:
        x = tokens(shape, seed=len(shape), dtype=dtype)
        for group_size in (None, 5):
            c = Quant(bits=bits, group_size=group_size)
            with native_path(on):
                (_, mn, scale), y = trip(c, x)
            g = group_of(c, shape)
            sc, lo = per_group(scale, shape, g), per_group(mn, shape, g)
            slack = 4 * eps * (lo.abs() + sc * ((1 << bits) - 1) + x.double().abs())
            err = (y.double() - x.double()).abs()
            assert (err <= sc / 2 + slack).all(), (shape, group_size, float((err - sc / 2).max()))


def bernstein(variance: torch.Tensor, spread: float, samples: int, delta: float) -> torch.Tensor:
    """t with P(|mean of ``samples`` draws - expectation| >= t) <= delta, for independent
    draws of the given ``variance`` whose values lie within ``spread`` of their expectation
    (Bernstein's inequality, solved for t)."""
    log = math.log(2 / delta)
    a = 2 * spread * log / 3
    return (a + torch.sqrt(a * a + 8 * samples * log * variance)) / (2 * samples)


@pytest.mark.parametrize("on", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", [4, 2])
def test_stochastic_rounding_is_unbiased(on, dtype, bits):
    """E[decode(encode(x))] = x. Each element rounds down or up a step of its group's scale,
    up with probability p (the fractional part of (x - mn) / scale): mean x, variance
    scale**2 * p * (1 - p), values within one scale of x. Over K seeded generators the mean
    must lie within Bernstein's bound for that variance (delta 1e-9 per element: a correct
    codec fails nowhere in this test with probability above 1e-5), and so must the sum of
    all errors in units of scale (which catches a bias far smaller than one element's
    bound). Round-to-nearest breaks the per-element bound (checked too)."""
    k_seeds, delta = 300, 1e-9
    x = tokens((2, 8, 32), seed=bits, dtype=dtype)
    c = Quant(bits=bits, stochastic=True)
    g = group_of(c, tuple(x.shape))
    total = torch.zeros(x.shape, dtype=torch.float64)
    with native_path(on):
        for seed in range(k_seeds):
            (_, mn, scale), y = trip(c, x, seed=seed)
            total += y.double()
        (_, mn, scale), y_nearest = trip(Quant(bits=bits), x)
    mean = total / k_seeds
    sc, lo = per_group(scale, tuple(x.shape), g), per_group(mn, tuple(x.shape), g)
    v = (x.double() - lo) / sc
    p = v - torch.floor(v)
    variance = p * (1 - p)  # in units of scale**2
    eps = torch.finfo(dtype).eps
    rounding = 8 * eps * (lo.abs() + sc * ((1 << bits) - 1) + x.double().abs())
    tol = bernstein(variance, 1.0, k_seeds, delta) * sc + rounding
    err = (mean - x.double()).abs()
    assert (err <= tol).all(), float((err / tol).max())
    # the sum over every element and seed, in units of scale: variance sum, spread 1
    n_all = x.numel() * k_seeds
    t_sum = bernstein(variance.sum() / x.numel(), 1.0, n_all, delta)
    bias = float(((mean - x.double()) / sc).mean())
    assert abs(bias) <= float(t_sum) + float((rounding / sc).max()), (bias, float(t_sum))
    # not vacuous: round-to-nearest has errors above the bound where p is near 1/2
    assert ((y_nearest.double() - x.double()).abs() > tol).any()


@pytest.mark.parametrize("on", [True, False], ids=["native", "pytorch"])
def test_stochastic_error_below_one_step(on):
    x = tokens((3, 8, 40), seed=9)
    c = Quant(bits=2, stochastic=True)
    with native_path(on):
        (_, mn, scale), y = trip(c, x, seed=4)
    sc, lo = per_group(scale, tuple(x.shape), 40), per_group(mn, tuple(x.shape), 40)
    slack = 4 * torch.finfo(torch.float32).eps * (lo.abs() + 3 * sc + x.double().abs())
    assert ((y.double() - x.double()).abs() < sc + slack).all()


def test_generator_makes_stochastic_rounding_reproducible():
    """A seeded generator fixes the noise on every path and leaves the global RNG alone;
    without one the noise comes from torch's global RNG (what training seeds)."""
    x = tokens((2, 6, 20))
    c = Quant(bits=2, stochastic=True)
    state = torch.get_rng_state()
    results = []
    for name in ("safe", "native", "pytorch"):
        with native_path(name == "native"):
            saved = base.IPU_SAFE
            base.IPU_SAFE = name == "safe"
            try:
                results.append(trip(c, x, seed=11))
            finally:
                base.IPU_SAFE = saved
    assert torch.equal(torch.get_rng_state(), state)
    for packed, y in results[1:]:
        assert all(same_bits(a, b) for a, b in zip(packed, results[0][0]))
        assert same_bits(y, results[0][1])
    other, _ = trip(c, x, seed=12)
    assert not torch.equal(other[0], results[0][0][0])
    torch.manual_seed(5)
    first = c.compress(x)
    torch.manual_seed(5)
    assert torch.equal(c.compress(x)[0], first[0])


# -- sizes and edge cases ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits", BITS)
def test_packed_sizes_are_the_documented_ones(bits, dtype):
    """N * (ceil(M * bits / 8) + 2 * groups * w), w = 8 for float64 inputs, else 4."""
    w = 8 if dtype == torch.float64 else 4
    for shape, group_size in [
        ((4, 16, 64), None),
        ((3, 5, 7), None),
        ((64, 33), None),
        ((2, 3, 5, 7), 7),
        ((2, 9, 13), 5),
        ((0, 4, 8), None),
        ((3, 0, 8), None),
    ]:
        c = Quant(bits=bits, group_size=group_size)
        n, m = shape[0], math.prod(shape[1:])
        groups = c.layout(shape)[3]
        expected = n * (math.ceil(m * bits / 8) + 2 * groups * w)
        assert c.stored_bytes(shape, dtype) == expected
        x = tokens(shape, dtype=dtype) if n * m else torch.zeros(shape, dtype=dtype)
        packed, y = trip(c, x)
        assert packed_nbytes(packed) == expected and y.shape == x.shape
        assert packed[0].shape == (n, math.ceil(m * bits / 8))


@pytest.mark.parametrize("on", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("bits", BITS)
def test_edge_rows(on, bits):
    """Constant, zero and -0.0 rows come back exactly (as +0.0 for zeros); a NaN or inf
    makes its whole row NaN and leaves the others as they are without it."""
    x = hostile(torch.float32)
    c = Quant(bits=bits)
    with native_path(on):
        _, y = trip(c, x)
        clean = x.clone()
        clean[0, :3] = 1.0
        _, y_clean = trip(c, clean)
    assert torch.isnan(y[0, :3]).all()
    assert same_bits(y[0, 3:], y_clean[0, 3:]) and same_bits(y[1:], y_clean[1:])
    assert torch.equal(y[1, 0], x[1, 0])  # a constant row
    for row in (1, 2, 3):  # zeros, -0.0, mixed: +0.0
        assert torch.equal(y[1, row].view(torch.int32), torch.zeros(13, dtype=torch.int32))
    assert torch.isfinite(y[0, 3]).all()  # a range near the dtype's max: halved, finite


def test_empty_batches_and_rows():
    for shape in [(0, 16, 64), (3, 0, 64), (3, 16, 0), (0, 5)]:
        x = torch.zeros(shape)
        for bits in BITS:
            packed, y = trip(Quant(bits=bits, stochastic=bits == 2), x)
            assert y.shape == x.shape and all(p.shape[0] == shape[0] for p in packed)


# -- the native loader -------------------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch):
    """native.library() as in a new process (its memo cleared, restored afterwards)."""
    saved = dict(native._state)
    native._state.clear()
    yield monkeypatch
    native._state.clear()
    native._state.update(saved)


def test_env_var_turns_the_native_path_off(fresh_loader):
    fresh_loader.setenv("UNROLLER_NATIVE", "0")
    assert native.library() is None and not native.enabled()
    x = tokens((2, 4, 16))
    _, y = trip(Quant(bits=4), x)  # the PyTorch path, same results
    with native_path(False):
        assert same_bits(trip(Quant(bits=4), x)[1], y)


def test_a_missing_compiler_falls_back(fresh_loader, tmp_path):
    fresh_loader.setenv("UNROLLER_CACHE_DIR", str(tmp_path))
    fresh_loader.setenv("CXX", "no-such-compiler-here")
    assert native.library() is None
    assert "no C++ compiler" in (native.build_error() or "")
    _, y = trip(Quant(bits=2), tokens((2, 4, 16)))
    assert torch.isfinite(y).all()


def test_a_built_library_is_reused_from_the_cache(native_lib, fresh_loader, tmp_path):
    """The first load builds (here: copies the library already built, to stay fast), the
    next process finds it under the same key and builds nothing."""
    built = []
    real = Path(native_lib._name)

    def fake_build(cxx, target):
        built.append(target)
        target.write_bytes(real.read_bytes())

    fresh_loader.setenv("UNROLLER_CACHE_DIR", str(tmp_path / "c"))
    fresh_loader.setattr(native, "_build", fake_build)
    assert native.library() is not None and len(built) == 1
    assert built[0].parent == tmp_path / "c" / "native"
    native._state.clear()
    assert native.library() is not None and len(built) == 1


def test_a_cache_folder_others_can_write_is_refused(fresh_loader, tmp_path):
    folder = tmp_path / "c" / "native"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    fresh_loader.setenv("UNROLLER_CACHE_DIR", str(tmp_path / "c"))
    fresh_loader.setattr(native, "_build", lambda cxx, target: target.write_bytes(b"x"))
    assert native.library() is None
    assert "writable by others" in (native.build_error() or "")


# -- the config ---------------------------------------------------------------------------


def test_config_keys_reach_the_codec(tmp_path):
    """bits, group_size and stochastic are quant's config keys (README, docs)."""
    path = tmp_path / "c.toml"
    path.write_text(
        '[default]\ncompressor = "quant"\nbits = 2\nstochastic = true\n'
        '[[rule]]\nname = "fc*"\ncompressor = "quant"\nbits = 4\ngroup_size = 32\n'
    )
    config = load_config(path)
    assert config.default.kwargs == {"bits": 2, "group_size": None, "stochastic": True}
    assert config.rules[0].codec.kwargs == {"bits": 4, "group_size": 32, "stochastic": False}
    assert make("quant", **config.default.kwargs).params["stochastic"] is True
