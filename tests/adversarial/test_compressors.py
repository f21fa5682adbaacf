"""Compressors (unroller.compress) on edge inputs and hostile parameters.

Every round trip here runs in four formulations: the IPU-safe one, the fast CPU one, the fast
one without host shortcuts (what CUDA runs) and the fast one in tiny blocks with every
read-back check taken; all four must give the same packed tensors and the same decompressed
tensor bit for bit (NaN payloads aside), and each path must decompress the other's packed
form to the same bits. Then the documented contract: shape and dtype of the result, exact
``stored_bytes``, and the error bound stated in each compressor's docstring.

One reproducer per reported case (empty batch, zero-size C/H/W, constant images of odd
size, float16 65504 through bf16 storage, parameter validation), then a seeded property test
over random compressors, shapes (0, 1, odd, larger), dtypes, value ranges (normal, scaled
over the dtype's range, constant, smooth, extreme, subnormal, sparse, NaN/inf) and memory
layouts (permuted, strided, channels_last, storage offset).
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
import torch.nn.functional as F

from tests.codec_agreement import assert_agree, assert_dct_close, native_dct, same_bits
from unroller.compress import (
    COMPRESSORS,
    Bits,
    Compressor,
    Dct,
    ParamError,
    Quant,
    base,
    make,
    packed_nbytes,
)
from unroller.compress.dct import MAX_BLOCK, prescale_exponent

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF = (torch.float16, torch.bfloat16)
STORAGE_EPS = {"bf16": 2.0**-8, "f16": 2.0**-11, "f32": 2.0**-24}
STORAGE_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

FORMULATIONS = {
    "safe": {"IPU_SAFE": True},
    "fast": {},
    "device": {"_HOST_SHORTCUTS": False},
    "blocks": {"CHUNK_ELEMENTS": 301, "CHECK_ELEMENTS": 0},
}


# helpers ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Single-threaded torch: these tensors are tiny, and on a loaded machine intra-op threads
    make each small op wait (20x slower); results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def formulation(name: str):
    saved = {k: getattr(base, k) for k in FORMULATIONS[name]}
    try:
        for k, v in FORMULATIONS[name].items():
            setattr(base, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(base, k, v)


def run(c: Compressor, x: torch.Tensor, dtype: torch.dtype | None = None, seed: int = 0):
    """Round trips in every formulation (same RNG seed); asserts they agree bit for bit and
    the interface contract holds. Returns the IPU-safe (packed, decompressed)."""
    out_dtype = dtype or x.dtype
    shape = tuple(x.shape[1:])
    results = {}
    inexact = {}  # formulations that ran the native DCT kernel (codec_agreement)
    # on CUDA the fast path has no host shortcuts or blocks: "device" and "blocks" are "fast"
    for name in FORMULATIONS if x.device.type == "cpu" else ("safe", "fast"):
        with formulation(name), torch.no_grad():
            torch.manual_seed(seed)
            packed = c.compress(x)
            results[name] = (packed, c.decompress(packed, shape, out_dtype))
            inexact[name] = native_dct(c, x.dtype, x.device)
    packed_safe, y_safe = results["safe"]
    assert isinstance(packed_safe, tuple)
    assert all(isinstance(p, torch.Tensor) and p.shape[0] == x.shape[0] for p in packed_safe)
    assert all(p.device == x.device for p in packed_safe)
    assert all(y.device == x.device for _, y in results.values())
    assert packed_nbytes(packed_safe) == c.stored_bytes(tuple(x.shape), x.dtype), c
    assert y_safe.shape == x.shape and y_safe.dtype == out_dtype and y_safe.is_contiguous()
    for name, got in results.items():
        assert_agree(c, got, results["safe"], inexact[name], (name, c))
    packed_fast = results["fast"][0]
    with formulation("safe"), torch.no_grad():  # fast packed form -> IPU-safe decompress
        y = c.decompress(packed_fast, shape, out_dtype)
    if inexact["fast"]:  # the same codes: only the inverse transform's rounding differs
        assert_dct_close(c, packed_fast, results["fast"][1], packed_fast, y, c)
        check_dct(c, x, *results["fast"])  # the native round trip meets the documented bound
    else:
        assert same_bits(y, y_safe), c
    with torch.no_grad():  # IPU-safe packed form -> fast decompress
        y = c.decompress(packed_safe, shape, out_dtype)
    if inexact["fast"]:
        assert_dct_close(c, packed_safe, y, packed_safe, y_safe, c)
    else:
        assert same_bits(y, y_safe), c
    return packed_safe, y_safe


def tiny(dtype: torch.dtype) -> float:
    """The smallest subnormal of a float dtype: the absolute rounding step near zero."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def dct_reference(x: torch.Tensor, block: int, keep: int, fold: bool):
    """(exact chop in float64 [N, C, H, W], norm of each replicated-padded plane [N, C]):
    block-diagonal DCT matrices over the whole plane and a selection mask."""
    n, c, h, w = x.shape
    i = torch.arange(block, dtype=torch.float64).view(-1, 1)
    j = torch.arange(block, dtype=torch.float64).view(1, -1)
    t = torch.cos((2 * j + 1) * i * math.pi / (2 * block)) * math.sqrt(2 / block)
    t[0] = 1 / math.sqrt(block)
    hb, wb = -(-h // block), -(-w // block)
    dh, dw = torch.block_diag(*[t] * hb), torch.block_diag(*[t] * wb)
    keep_mask = (i < keep) & (j < keep) & ((i + j < keep) | (not fold))
    mask = keep_mask.double().repeat(hb, wb)
    xp = F.pad(x.double(), (0, wb * block - w, 0, hb * block - h), mode="replicate")
    coeffs = dh @ xp @ dw.T
    return (dh.T @ (coeffs * mask) @ dw)[:, :, :h, :w], xp.flatten(2).norm(dim=-1)


def bad_tiles(x: torch.Tensor, block: int) -> torch.Tensor:
    """bool [N, C, H, W]: the pixels of every tile that holds a NaN or inf input."""
    n, c, h, w = x.shape
    hb, wb = -(-h // block), -(-w // block)
    bad = F.pad((~torch.isfinite(x)).float(), (0, wb * block - w, 0, hb * block - h))
    tiles = bad.view(n, c, hb, block, wb, block).amax(dim=(3, 5), keepdim=True) > 0
    return tiles.expand(n, c, hb, block, wb, block).reshape(n, c, hb * block, wb * block)[
        :, :, :h, :w
    ]


def check_dct(c: Dct, x: torch.Tensor, packed, y: torch.Tensor) -> None:
    """The documented behaviour of Dct (see its docstring) on one round trip."""
    if x.numel() == 0:
        return
    block, keep, fold = c.params["block"], c.params["keep"], c.params["fold"]
    storage = c.params["storage"]
    e = prescale_exponent(block)
    wd = torch.float64 if x.dtype == torch.float64 else torch.float32
    finite_in = torch.isfinite(x).flatten(2).all(-1)  # [N, C]
    xs = torch.where(torch.isfinite(x), x.double(), 0.0)
    top = xs.abs().flatten(2).amax(-1)  # largest finite |x| per (sample, channel)
    # the range the docstring guarantees: no overflow of the work dtype or of the storage
    limit = torch.finfo(wd).max / (1.3 * block)
    if storage != "int8":
        limit = min(limit, torch.finfo(STORAGE_DTYPE[storage]).max * (1 - 2**-8))
    in_range = top <= limit
    finite_out = torch.isfinite(y).flatten(2).all(-1)
    # non-finite inputs propagate: the whole channel (int8) or the tiles holding them
    if storage == "int8":
        lost = ~finite_in[..., None, None].expand(y.shape)
    else:
        lost = bad_tiles(x, block)
    assert not torch.isfinite(y[lost]).any(), "a non-finite input came back finite"
    if storage != "int8":  # other tiles of the channel are unaffected
        assert torch.isfinite(y[(~lost) & in_range[..., None, None]]).all()
    # finite channels in range come back finite; out of range they may overflow to inf (never
    # to a finite wrong value: finite outputs must still meet the bound below)
    assert bool(finite_out[finite_in & in_range].all()), "finite input in range became inf"
    # Everything per (sample, channel) in units of 2**s >= top (exact powers of two), so
    # that the float64 reference cannot overflow for inputs near float64's max.
    unit = torch.ldexp(torch.ones_like(top), -torch.frexp(top)[1])[..., None, None]  # 2**-s
    ref, pad_norm = dct_reference(xs * unit, block, keep, fold)
    top_out = torch.finfo(y.dtype).max * unit  # the chop, saturated to the output's range
    ref = torch.minimum(torch.maximum(ref, -top_out), top_out)
    ys = torch.where(torch.isfinite(y), y.double(), 0.0) * unit
    err = (ys - ref).flatten(2).norm(dim=-1)
    unit = unit[..., 0, 0]
    kept = packed[0][0, 0].numel()
    if storage == "int8":
        bound = math.sqrt(kept) * (packed[1].double() * unit) * 2**e / 2
    else:
        bound = STORAGE_EPS[storage] * pad_norm
        bound = bound + math.sqrt(kept) * 2**e * tiny(STORAGE_DTYPE[storage]) * unit
    eps_out = torch.finfo(x.dtype).eps if x.dtype in HALF else 0.0
    slack = (4e-6 if wd == torch.float32 else 1e-14) * pad_norm
    slack = slack + eps_out * ((xs.flatten(2) * unit[..., None]).norm(dim=-1) + pad_norm)
    area = math.sqrt(x.shape[2] * x.shape[3])
    slack = slack + area * (64 * block * 2**e * tiny(wd) + tiny(x.dtype)) * unit
    ok = err <= bound * 1.001 + slack
    check = finite_in & finite_out
    assert bool(ok[check].all()), (err[check & ~ok], bound[check & ~ok], slack[check & ~ok])


def check_quant(c: Quant, x: torch.Tensor, packed, y: torch.Tensor) -> None:
    """The documented behaviour of Quant: |x - x_hat| <= scale / 2 (nearest) or < scale
    (stochastic) plus float rounding; a group holding NaN or inf decompresses to all NaN."""
    n, m, g, groups = c.layout(tuple(x.shape))
    if n * m == 0:
        assert all(p.numel() == 0 for p in packed)
        return
    codes, mn, scale = packed
    xf, yf = x.reshape(n, m).double(), y.reshape(n, m).double()
    padded = torch.cat([xf, xf[:, -1:].expand(n, groups * g - m)], dim=1)
    bad_group = (~torch.isfinite(padded)).view(n, groups, g).any(-1)
    ids = torch.arange(m) // g
    bad = bad_group[:, ids]
    assert torch.isnan(yf[bad]).all(), "a group with NaN/inf has a non-NaN value"
    assert torch.isfinite(yf[~bad]).all(), "a finite group became non-finite"
    levels = (1 << c.params["bits"]) - 1
    sc = scale.double()[:, ids]
    gmax = (mn.double().abs() + levels * scale.double())[:, ids]
    wd = torch.float64 if x.dtype == torch.float64 else torch.float32
    step = sc if c.params["stochastic"] else sc / 2
    eps_out = torch.finfo(x.dtype).eps
    tol = step * (1 + 1e-4) + 8 * torch.finfo(wd).eps * gmax + eps_out * (xf.abs() + sc)
    tol = tol + tiny(x.dtype) + tiny(wd)
    err = (xf - yf).abs()
    assert bool((err[~bad] <= tol[~bad]).all()), float((err - tol)[~bad].max())


def check(c: Compressor, x: torch.Tensor, packed, y: torch.Tensor) -> None:
    if isinstance(c, Bits):
        assert torch.equal(y, x)
    elif isinstance(c, Dct):
        check_dct(c, x, packed, y)
    else:
        check_quant(c, x, packed, y)


# compressors used by the reproducers ---------------------------------------------------

DCTS = [
    Dct(),
    Dct(fold=True),
    Dct(storage="bf16"),
    Dct(storage="f16", fold=True, block=4, keep=3),
    Dct(keep=8, storage="f32"),
    Dct(block=5, keep=2),
    Dct(block=1, keep=1, fold=True),
    Dct(block=64, keep=64, storage="f32"),
]
QUANTS = [
    Quant(),
    Quant(bits=4),
    Quant(bits=2, group_size=7),
    Quant(bits=8, group_size=1),
    Quant(bits=2, stochastic=True),
    Quant(bits=4, group_size=5, stochastic=True),
]


# 1. empty batch: round trip on both paths ------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_empty_batch_round_trips_on_every_path(dtype):
    for c in DCTS:
        x = torch.zeros((0, 3, 7, 13), dtype=dtype)
        packed, y = run(c, x)
        assert packed_nbytes(packed) == 0 and y.shape == (0, 3, 7, 13)
    for c in QUANTS:
        for shape in [(0, 3, 7, 13), (0, 5), (0,)]:
            packed, y = run(c, torch.zeros(shape, dtype=dtype))
            assert packed_nbytes(packed) == 0 and y.shape == shape
    run(Bits(), torch.zeros((0, 3, 7), dtype=torch.bool))


# 2. zero-size C, H or W: round trip (documented), never RuntimeError/IndexError ---------


@pytest.mark.parametrize("shape", [(2, 0, 8, 8), (2, 3, 0, 8), (2, 3, 8, 0), (1, 1, 0, 0)])
def test_zero_size_feature_dims_round_trip(shape):
    for c in DCTS:
        packed, y = run(c, torch.zeros(shape))
        assert y.shape == shape
        if c.params["storage"] == "int8":  # one scale per (sample, channel), 1 when empty
            assert packed[1].shape == shape[:2] and bool((packed[1] == 1).all())
    for c in QUANTS:
        packed, y = run(c, torch.zeros(shape, dtype=torch.float16))
        assert y.shape == shape and all(p.numel() == 0 for p in packed)
    run(Quant(), torch.zeros((3, 0)))
    run(Bits(), torch.zeros(shape, dtype=torch.bool))


# 3. constant images of any size: exact to float rounding (edge replication) -------------


@pytest.mark.parametrize("hw", [(1, 1), (7, 13), (1, 13), (13, 1), (9, 9), (8, 8), (15, 17)])
@pytest.mark.parametrize("block, keep, fold", [(8, 4, False), (8, 4, True), (5, 2, False)])
def test_dct_constant_image_any_size(hw, block, keep, fold):
    levels = torch.tensor([3.7, -2.5, 0.0, 1e3, 1e-3])
    x = levels.view(1, -1, 1, 1).expand(2, 5, *hw).contiguous()
    bounds = {"int8": 1e-6, "f32": 1e-6, "bf16": 2.0**-8, "f16": 2.0**-11}
    for storage, bound in bounds.items():
        for dtype in FLOATS:
            c = Dct(block=block, keep=keep, fold=fold, storage=storage)
            xd = x.to(dtype)
            _, y = run(c, xd)
            assert torch.equal(y[:, 2], torch.zeros_like(y[:, 2]))  # all-zero channel
            eps_out = torch.finfo(dtype).eps / 2 if dtype in HALF else 0.0
            for ch in (0, 1, 3, 4):
                err = float((y[:, ch].double() - xd[:, ch].double()).abs().max())
                assert err <= (bound + eps_out) * abs(float(xd[0, ch, 0, 0])), (
                    storage,
                    dtype,
                    ch,
                    err,
                )


def test_dct_constant_1x1_and_7x13_reported_cases():
    """The issue's figures: 43% (1x1) and 19% (7x13) error before edge replication."""
    for hw in [(1, 1), (7, 13)]:
        x = torch.full((1, 1, *hw), 3.0)
        _, y = run(Dct(), x)
        assert float((y - x).norm() / x.norm()) <= 1e-6


# 4. float16 65504 through every storage: never inf --------------------------------------


@pytest.mark.parametrize("storage", ["int8", "bf16", "f16", "f32"])
def test_float16_max_survives_every_storage(storage):
    fmax = torch.finfo(torch.float16).max
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 9, 13, generator=g) * 20000).clamp(-fmax, fmax)
    x[0, 0] = fmax  # a constant plane at the max (the reported case through bf16)
    x[0, 1, ::2] = -fmax
    x[1, 2, 3, 4] = fmax
    x = x.half()
    for c in [
        Dct(storage=storage),
        Dct(storage=storage, keep=8),
        Dct(storage=storage, block=3, keep=2),
    ]:
        packed, y = run(c, x)
        assert torch.isfinite(y).all(), c
        assert float(y.abs().max()) <= fmax
        check_dct(c, x, packed, y)
        assert torch.equal(y[0, 0], x[0, 0])  # constant plane: back exactly
    for c in QUANTS:
        packed, y = run(c, x)
        assert torch.isfinite(y).all()
        check_quant(c, x, packed, y)


@pytest.mark.parametrize("storage", ["int8", "bf16", "f32"])
def test_bfloat16_max_survives(storage):
    x = torch.full((1, 2, 5, 6), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    x[0, 1] *= -1
    _, y = run(Dct(storage=storage), x)
    assert torch.equal(y, x)


def test_f16_storage_overflow_is_loud():
    """A float32 input beyond float16's range with f16 storage: its tile overflows to
    non-finite values (documented), never to finite wrong ones; other tiles are unaffected."""
    x = torch.ones(1, 1, 16, 16)
    x[0, 0, 8:, 8:] = 1e5  # stored DC coefficient 1e5 > 65504
    _, y = run(Dct(storage="f16"), x)
    assert not torch.isfinite(y[0, 0, 8:, 8:]).any()
    assert torch.isfinite(y[0, 0, :8]).all() and torch.isfinite(y[0, 0, 8:, :8]).all()


def test_decompress_to_a_narrower_dtype_saturates():
    """Finite values past float16's max decompress to +-65504, not inf; inf stays inf."""
    x = torch.full((1, 2, 8, 8), 1e5)
    x[0, 1] = -1e5
    for c in [Dct(), Dct(storage="bf16"), Dct(storage="f32")]:
        _, y = run(c, x, dtype=torch.float16)
        assert bool((y[0, 0] == 65504).all()) and bool((y[0, 1] == -65504).all())
    x[0, 0, 0, 0] = math.inf
    _, y = run(Dct(storage="f32"), x, dtype=torch.float16)
    assert not torch.isfinite(y[0, 0]).any()


def test_float32_large_values_stay_finite():
    """The forward transform no longer overflows above 4e37: any finite float32 value up to
    float32's max / (1.3 * block) comes back finite and within the bound."""
    fmax = torch.finfo(torch.float32).max
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 11, 13, generator=g).clamp(-3, 3) * (fmax / (1.3 * 8) / 3)
    x[0, 0] = fmax / (1.3 * 8)
    for c in [Dct(), Dct(storage="bf16"), Dct(storage="f32", keep=8), Dct(fold=True)]:
        packed, y = run(c, x)
        assert torch.isfinite(y).all()
        check_dct(c, x, packed, y)


# 5. NaN / inf: propagated, identically on both paths ------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_at_the_padded_edge(bad):
    """A non-finite value in the last row / column of an odd-size plane is copied into the
    padding of its own tile only."""
    x = torch.randn(2, 2, 11, 13, generator=torch.Generator().manual_seed(2))
    x[1, 1, 10, 12] = bad
    x[0, 1, 10, 3] = bad
    for c in DCTS:
        packed, y = run(c, x)
        check_dct(c, x, packed, y)
        assert torch.isfinite(y[:, 0]).all()
    for c in QUANTS:
        packed, y = run(c, x)
        check_quant(c, x, packed, y)


# 6. non-contiguous inputs ------------------------------------------------------------------


def test_noncontiguous_inputs_match_contiguous():
    x = torch.randn(2, 3, 9, 13, generator=torch.Generator().manual_seed(3))
    views = [
        x.contiguous(memory_format=torch.channels_last),
        x.transpose(2, 3).contiguous().transpose(2, 3),
        torch.cat([x, x], dim=3)[..., ::2].clone().copy_(x),
        torch.zeros(2, 3, 9, 27)[..., 1::2].copy_(x),
        x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0),
        x[:, :1].expand(2, 3, 9, 13),
    ]
    for v in views:
        want = x if v.stride()[1] != 0 else x[:, :1].expand(2, 3, 9, 13).contiguous()
        for c in DCTS + QUANTS:
            packed, y = run(c, v)
            packed_c, y_c = run(c, want)
            assert all(same_bits(p, q) for p, q in zip(packed, packed_c)) and same_bits(y, y_c)
        run(Bits(), v > 0)


# 7. parameter validation -----------------------------------------------------------------

BAD_PARAMS = [
    ("dct", "block", [10**6, 65, 0, -1, True, False, 8.0, math.nan, math.inf, "8", None, [8]]),
    ("dct", "keep", [10**6, 65, 0, -3, True, 4.0, math.nan, -math.inf, "4", None, (4,)]),
    ("dct", "storage", ["int4", "INT8", "", 8, None, True, b"int8", "x" * 10_000]),
    ("dct", "fold", [1, 0, "true", "False", None, 1.0, math.nan]),
    ("quant", "bits", [16, 1, 3, 0, True, 8.0, "8", None, math.nan]),
    ("quant", "group_size", [0, -1, True, 2.5, math.nan, math.inf, "4", [4]]),
    ("quant", "stochastic", [0, 1, "no", None, 0.0]),
]


@pytest.mark.parametrize(
    "name, param, value",
    [(n, p, v) for n, p, values in BAD_PARAMS for v in values],
    ids=lambda v: repr(v)[:20],
)
def test_bad_parameter_values_name_the_parameter(name, param, value):
    with pytest.raises(ParamError) as info:
        make(name, **{param: value})
    assert isinstance(info.value, ValueError)
    assert info.value.param == param
    assert f"'{param}'" in str(info.value)
    assert len(str(info.value)) < 300  # a huge value is shown cut short


def test_parameter_bounds_and_combinations():
    assert make("dct", block=MAX_BLOCK, keep=MAX_BLOCK).params["block"] == 64
    assert make("dct", block=1, keep=1).params["keep"] == 1
    for block, keep in [(4, 5), (1, 2), (8, 64)]:
        with pytest.raises(ParamError, match="'keep'") as info:
            make("dct", block=block, keep=keep)
        assert info.value.param == "keep"
    for name in COMPRESSORS:
        with pytest.raises(ParamError, match="'nope'") as info:
            make(name, nope=1)
        assert info.value.param == "nope"
    with pytest.raises(ParamError, match="'block'"):
        Dct.validate_params({"block": 10**6})
    # group_size has no upper bound: larger than a sample means one group per sample
    assert make("quant", group_size=10**12).params["group_size"] == 10**12


# 8. seeded property test ----------------------------------------------------------------

DIMS = [0, 1, 1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 33, 64, 67]
MAX_ELEMENTS = 30_000


def draw_compressor(r: random.Random) -> Compressor:
    kind = r.choice(["dct"] * 5 + ["quant"] * 4 + ["bits"])
    if kind == "bits":
        return Bits()
    if kind == "quant":
        return Quant(
            bits=r.choice([8, 4, 2]),
            group_size=r.choice([None, None, None, 1, 2, 3, 7, 64, 100, 10**9]),
            stochastic=r.random() < 0.3,
        )
    block = r.choice([1, 2, 3, 4, 5, 7, 8, 8, 8, 8, 16, 64])
    keep = r.randint(1, block) if r.random() < 0.5 else min(block, r.choice([1, 2, 4, 8]))
    storage = r.choice(["int8", "int8", "bf16", "f16", "f32"])
    return Dct(block=block, keep=keep, storage=storage, fold=r.random() < 0.4)


def draw_shape(r: random.Random, c: Compressor) -> tuple[int, ...]:
    rank = 4 if isinstance(c, Dct) else r.choice([1, 2, 2, 3, 4, 4, 5])
    shape = [r.choice([0, 1, 1, 2, 3])] + [r.choice(DIMS) for _ in range(rank - 1)]
    block = c.params["block"] if isinstance(c, Dct) else 1

    def size() -> int:
        padded = shape[:2] + [-(-d // block) * block for d in shape[2:]]
        return math.prod(padded)

    while size() > MAX_ELEMENTS:
        i = max(range(len(shape)), key=lambda k: shape[k])
        shape[i] //= 2
    return tuple(shape)


def draw_values(r: random.Random, shape, dtype, g: torch.Generator) -> tuple[str, torch.Tensor]:
    if dtype == torch.bool:
        return "mask", torch.rand(shape, generator=g) < r.random()
    info = torch.finfo(dtype)
    kind = r.choice(["normal", "scaled", "scaled", "constant", "smooth", "extreme", "tiny"])
    kind = r.choice([kind, "sparse"]) if r.random() < 0.15 else kind
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "normal":
        x = z
    elif kind == "scaled":
        lo, hi = math.log10(info.smallest_normal) + 3, math.log10(info.max) - 3
        x = z * 10 ** r.uniform(lo, hi)
    elif kind == "constant":  # one value per (sample, channel), or per sample for rank <= 2
        per = shape[:2] if len(shape) >= 3 else shape[:1]
        v = torch.randn(per, generator=g, dtype=torch.float64) * 10 ** r.uniform(-3, 3)
        x = v.view(*per, *[1] * (len(shape) - len(per))).expand(shape).clone()
    elif kind == "smooth":
        x = z
        for d in range(max(1, len(shape) - 2), len(shape)):
            x = x.cumsum(d) / math.sqrt(max(1, shape[d]))
    elif kind == "extreme":  # up to the dtype's max, some exactly +-max
        x = z.clamp(-3, 3) * (info.max / 3)
        if x.numel():
            flat = x.view(-1)
            for _ in range(3):
                flat[r.randrange(flat.numel())] = r.choice([info.max, -info.max])
    elif kind == "tiny":  # normal and subnormal values near the dtype's smallest normal
        x = z * info.smallest_normal * 4
    else:  # sparse, with signed zeros
        keep = torch.rand(shape, generator=g) < 0.1
        x = torch.where(keep, z, torch.where(z > 0, 0.0, -0.0))
    x = x.to(dtype)
    if x.numel() and r.random() < 0.2:
        flat = x.view(-1)
        for _ in range(r.randint(1, 3)):
            flat[r.randrange(flat.numel())] = r.choice([math.nan, math.inf, -math.inf])
        kind += "+nonfinite"
    return kind, x


def relayout(r: random.Random, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The same values in another memory layout."""
    how = r.choice(["contiguous"] * 3 + ["permuted", "strided", "offset", "channels_last"])
    if how == "permuted" and x.dim() > 1:
        p = list(reversed(range(x.dim())))
        return how, x.permute(p).contiguous().permute(p)
    if how == "strided":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1] + 1, dtype=x.dtype)
        wide[..., 1::2] = x
        return how, wide[..., 1::2]
    if how == "offset":
        flat = torch.zeros(x.numel() + 3, dtype=x.dtype)
        flat[3:] = x.reshape(-1)
        return how, flat[3:].view(x.shape)
    if how == "channels_last" and x.dim() == 4:
        return how, x.contiguous(memory_format=torch.channels_last)
    return "contiguous", x


def property_case(seed: int, device: str) -> None:
    r = random.Random(seed)
    c = draw_compressor(r)
    shape = draw_shape(r, c)
    dtype = torch.bool if isinstance(c, Bits) else r.choice(FLOATS)
    kind, x = draw_values(r, shape, dtype, torch.Generator().manual_seed(seed))
    how, v = relayout(r, x)
    context = (c, shape, dtype, kind, how, device)
    packed, y = run(c, v.to(device) if device != "cpu" else v, seed=seed)
    if how != "contiguous":  # the layout changes nothing
        packed_c, y_c = run(c, x.contiguous().to(device), seed=seed)
        assert all(same_bits(p, q) for p, q in zip(packed, packed_c)), context
        assert same_bits(y, y_c), context
    try:
        check(c, x, tuple(p.cpu() for p in packed), y.cpu())
    except AssertionError as exc:
        raise AssertionError(f"{context}: {exc}") from None


@pytest.mark.parametrize("seed", range(300))
def test_property_every_compressor(seed):
    property_case(seed, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("seed", range(1000, 1150))
def test_property_every_compressor_cuda(seed):
    """On CUDA: the fast path and the IPU-safe path on CUDA tensors, bit for bit."""
    property_case(seed, "cuda")
