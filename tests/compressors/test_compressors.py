"""Compressors of saved activations (unroller.compress): round trips, exact byte counts, error
bounds, non-finite inputs, parameter validation.

The error figures in docs/compressors.md come from ``test_measured_errors`` below (relative L2
error on [4, 8, 64, 64] float32 tensors: a random normal one, a sum of three low-frequency
sinusoids, and a Gaussian-blurred (sigma 3) random field).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.codec_agreement import assert_agree, assert_dct_close, native_dct, same_bits
from unroller.compress import (
    COMPRESSORS,
    Bits,
    Compressor,
    Dct,
    FewBit,
    ParamSpec,
    Quant,
    base,
    get,
    make,
    packed_nbytes,
)
from unroller.compress import bits as bits_module

ROOT = Path(__file__).resolve().parents[2]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA"))]
HYP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# helpers ---------------------------------------------------------------------------------


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def roundtrip(c: Compressor, x: torch.Tensor, dtype: torch.dtype | None = None):
    """(packed, decompressed) under no_grad, with the interface's invariants checked."""
    with torch.no_grad():
        packed = c.compress(x)
        assert isinstance(packed, tuple) and all(isinstance(p, torch.Tensor) for p in packed)
        assert all(p.shape[0] == x.shape[0] for p in packed), [p.shape for p in packed]
        assert all(p.device == x.device for p in packed)
        assert packed_nbytes(packed) == c.stored_bytes(tuple(x.shape), x.dtype)
        out_dtype = dtype or x.dtype
        y = c.decompress(packed, tuple(x.shape[1:]), out_dtype)
    assert y.shape == x.shape and y.dtype == out_dtype and y.device == x.device
    assert y.is_contiguous()
    return packed, y


def sinusoid_field(shape, seed=0) -> torch.Tensor:
    """Sum of three plane waves per (sample, channel), at most 1.5 cycles across the image."""
    n, c, h, w = shape
    g = torch.Generator().manual_seed(seed)
    yy = torch.arange(h, dtype=torch.float64).view(h, 1) / h
    xx = torch.arange(w, dtype=torch.float64).view(1, w) / w
    out = torch.zeros(shape, dtype=torch.float64)
    for _ in range(3):
        a, fy, fx, ph = (torch.rand(n, c, 1, 1, generator=g, dtype=torch.float64) for _ in "1234")
        out += (a - 0.5) * 4 * torch.cos(2 * math.pi * (1.5 * fy * yy + 1.5 * fx * xx + ph))
    return out.float()


def blurred_field(shape, sigma=3.0, seed=0) -> torch.Tensor:
    """A random normal field blurred with a Gaussian of std ``sigma`` pixels, unit std."""
    n, c, h, w = shape
    g = torch.Generator().manual_seed(seed)
    r = int(3 * sigma)
    k = torch.exp(-(torch.arange(-r, r + 1, dtype=torch.float64) ** 2) / (2 * sigma**2))
    k = k / k.sum()
    z = torch.randn(n * c, 1, h + 2 * r, w + 2 * r, generator=g, dtype=torch.float64)
    z = F.conv2d(F.conv2d(z, k.view(1, 1, -1, 1)), k.view(1, 1, 1, -1)).view(shape)
    return (z / z.std()).float()


def randn(shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dct_reference(x: torch.Tensor, block: int, keep: int, fold: bool) -> torch.Tensor:
    """What DCT+Chop reconstructs before any storage rounding, in float64, written the other
    way round: block-diagonal DCT matrices over the whole plane padded by edge replication and
    a selection mask."""
    n, c, h, w = x.shape
    t = torch.tensor(
        [
            [
                (math.sqrt(1 / block) if i == 0 else math.sqrt(2 / block))
                * math.cos((2 * j + 1) * i * math.pi / (2 * block))
                for j in range(block)
            ]
            for i in range(block)
        ],
        dtype=torch.float64,
    )
    hb, wb = -(-h // block), -(-w // block)
    dh, dw = torch.block_diag(*[t] * hb), torch.block_diag(*[t] * wb)
    mask = torch.tensor(
        [
            [i < keep and j < keep and (not fold or i + j < keep) for j in range(block)]
            for i in range(block)
        ],
        dtype=torch.float64,
    ).repeat(hb, wb)
    xp = F.pad(x.double(), (0, wb * block - w, 0, hb * block - h), mode="replicate")
    coeffs = dh @ xp @ dw.T
    return (dh.T @ (coeffs * mask) @ dw)[:, :, :h, :w]


def quant_group_ids(shape, group_size) -> torch.Tensor:
    """Group index of each element of a flattened sample (the documented grouping)."""
    m = math.prod(shape[1:])
    if group_size is None:
        g = math.prod(shape[2:]) if len(shape) >= 3 else m
    else:
        g = group_size
    return torch.arange(m) // g


def assert_quant_bound(c: Quant, x: torch.Tensor, y: torch.Tensor, packed) -> None:
    """|x - x_hat| <= scale/2 (nearest) or scale (stochastic), plus float rounding slack."""
    _, mn, scale = packed
    n = x.shape[0]
    ids = quant_group_ids(tuple(x.shape), c.params["group_size"]).to(x.device).expand(n, -1)
    sc = scale.double().gather(1, ids)
    levels = (1 << c.params["bits"]) - 1
    gmax = (mn.double().abs() + levels * scale.double()).gather(1, ids)  # >= |x| in the group
    eps_w = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    eps_out = torch.finfo(x.dtype).eps
    xd, yd = x.double().reshape(n, -1), y.double().reshape(n, -1)
    step = sc if c.params["stochastic"] else sc / 2
    tol = step * (1 + 1e-4) + 8 * eps_w * gmax + eps_out * (xd.abs() + sc)
    err = (xd - yd).abs()
    assert bool((err <= tol).all()), f"max excess {float((err - tol).max())}"


# registry and parameters -----------------------------------------------------------------


def test_registry():
    assert COMPRESSORS == {"dct": Dct, "quant": Quant, "bits": Bits, "fewbit": FewBit}
    for name, cls in COMPRESSORS.items():
        assert get(name) is cls and cls.name == name
        assert issubclass(cls, Compressor)
        assert all(isinstance(s, ParamSpec) for s in cls.PARAMS.values())
        inst = make(name)
        assert inst.params == {k: s.default for k, s in cls.PARAMS.items()}
        assert len(cls.param_docs()) == len(cls.PARAMS)
    assert Bits.lossless and not Dct.lossless and not Quant.lossless


def test_repr_and_params():
    assert repr(make("dct")) == "Dct(block=8, keep=4, storage='int8', fold=False)"
    assert repr(make("dct", fold=True, keep=2)) == "Dct(block=8, keep=2, storage='int8', fold=True)"
    assert repr(make("quant", bits=4)) == "Quant(bits=4, group_size=None, stochastic=False)"
    assert repr(make("bits")) == "Bits()"
    c = make("quant", stochastic=True, group_size=32)
    assert list(c.params) == ["bits", "group_size", "stochastic"]
    assert c.params == {"bits": 8, "group_size": 32, "stochastic": True}
    assert make("dct", keep=4) == make("dct") and hash(make("dct", keep=4)) == hash(make("dct"))
    assert make("dct", keep=3) != make("dct")


@pytest.mark.parametrize(
    "name, params, words",
    [
        ("nope", {}, ["'nope'", "'dct'", "'quant'", "'bits'"]),
        ("dct", {"blok": 8}, ["'blok'", "block", "keep", "storage", "fold"]),
        ("dct", {"keep": 9}, ["'keep'", "<= block (8)"]),
        ("dct", {"block": 4, "keep": 5}, ["'keep'", "<= block (4)"]),
        ("dct", {"block": 0}, ["'block'", ">= 1"]),
        ("dct", {"keep": 0}, ["'keep'", ">= 1"]),
        ("dct", {"storage": "int4"}, ["'storage'", "'int8', 'bf16', 'f16', 'f32'"]),
        ("dct", {"fold": 1}, ["'fold'", "True or False"]),
        ("dct", {"block": 8.0}, ["'block'", "an int"]),
        ("dct", {"block": True}, ["'block'"]),
        ("quant", {"bits": 3}, ["'bits'", "one of 8, 4, 2"]),
        ("quant", {"bits": True}, ["'bits'", "one of 8, 4, 2"]),
        ("quant", {"group_size": 0}, ["'group_size'", ">= 1 or None"]),
        ("quant", {"stochastic": "yes"}, ["'stochastic'"]),
        ("bits", {"x": 1}, ["'x'", "none"]),
    ],
)
def test_make_errors(name, params, words):
    with pytest.raises(ValueError) as info:
        make(name, **params)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_input_errors():
    with pytest.raises(ValueError, match="4-D"):
        make("dct").compress(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="4-D"):
        make("dct").stored_bytes((2, 3, 4, 5, 6), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        make("dct").compress(torch.zeros(2, 3, 4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        make("quant").compress(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch"):
        make("quant").compress(torch.tensor(1.0))
    with pytest.raises(ValueError, match="bool"):
        make("bits").compress(torch.ones(2, 3))
    with pytest.raises(ValueError, match="bool"):
        make("bits").stored_bytes((2, 3), torch.float32)


def test_docs_cover_every_compressor_and_parameter():
    text = (ROOT / "docs" / "compressors.md").read_text()
    for name, cls in COMPRESSORS.items():
        assert f"`{name}`" in text
        for p in cls.PARAMS:
            assert f"`{p}`" in text, p


# exact byte counts ---------------------------------------------------------------------


def test_dct_bytes_64x64():
    n, c = 3, 5
    shape = (n, c, 64, 64)
    raw = n * c * 64 * 64 * 4
    # 8 x 8 = 64 tiles per plane; keep 4: 16 coefficients per tile
    cases = {
        Dct(): n * c * (64 * 16 * 1 + 4),  # int8 codes + one float32 scale per (n, c)
        Dct(fold=True): n * c * (64 * 10 * 1 + 4),  # 10 of the 16 (i + j < 4)
        Dct(storage="bf16"): n * c * 64 * 16 * 2,
        Dct(storage="f16"): n * c * 64 * 16 * 2,
        Dct(storage="f32"): n * c * 64 * 16 * 4,
        Dct(keep=8, storage="f32"): raw,
        Dct(keep=2): n * c * (64 * 4 + 4),
    }
    x = randn(shape)
    for comp, expected in cases.items():
        assert comp.stored_bytes(shape, torch.float32) == expected
        assert packed_nbytes(roundtrip(comp, x)[0]) == expected
    assert raw / cases[Dct()] == pytest.approx(16384 / 1028)  # 15.94x
    assert raw / cases[Dct(fold=True)] == pytest.approx(16384 / 644)  # 25.44x
    # float64 input: the int8 scales are float64
    assert Dct().stored_bytes(shape, torch.float64) == n * c * (64 * 16 + 8)


def test_quant_bytes():
    shape = (2, 3, 8, 8)  # 192 elements per sample, 3 channel groups
    assert Quant().stored_bytes(shape, torch.float32) == 2 * (192 + 3 * 8)
    assert Quant(bits=4).stored_bytes(shape, torch.float32) == 2 * (96 + 3 * 8)
    assert Quant(bits=2).stored_bytes(shape, torch.float32) == 2 * (48 + 3 * 8)
    assert Quant(bits=2).stored_bytes(shape, torch.float64) == 2 * (48 + 3 * 16)
    assert Quant(bits=4, group_size=50).stored_bytes(shape, torch.float16) == 2 * (96 + 4 * 8)
    assert Quant(bits=4).stored_bytes((5, 7), torch.float32) == 5 * (4 + 8)  # odd count padded
    for bits in (8, 4, 2):
        x = randn((2, 3, 8, 8))
        (codes, mn, scale), _ = roundtrip(Quant(bits=bits), x)
        assert codes.dtype == torch.uint8 and codes.shape == (2, 192 * bits // 8)
        assert mn.shape == scale.shape == (2, 3) and mn.dtype == torch.float32


def test_bits_bytes():
    assert Bits().stored_bytes((4, 3, 5, 5), torch.bool) == 4 * 10
    assert Bits().stored_bytes((4, 16), torch.bool) == 4 * 2
    assert Bits().stored_bytes((4,), torch.bool) == 4


SHAPES_4D = [(1, 1, 1, 1), (1, 1, 8, 8), (2, 3, 7, 9), (3, 2, 16, 5), (1, 4, 20, 20), (2, 1, 1, 13)]


@pytest.mark.parametrize("shape", SHAPES_4D)
@pytest.mark.parametrize("dtype", FLOATS)
def test_stored_bytes_exact_many_shapes(shape, dtype):
    x = randn(shape, dtype=dtype)
    comps = [
        Dct(),
        Dct(fold=True, block=4, keep=3),
        Dct(block=5, keep=5, storage="f16"),
        Dct(block=3, keep=1, storage="bf16", fold=True),
        Quant(),
        Quant(bits=4, group_size=7),
        Quant(bits=2, group_size=1),
        Quant(bits=2, stochastic=True),
    ]
    for comp in comps:
        packed = comp.compress(x)
        assert packed_nbytes(packed) == comp.stored_bytes(shape, dtype), comp
    mask = x > 0
    assert packed_nbytes(Bits().compress(mask)) == Bits().stored_bytes(shape, torch.bool)


# DCT+Chop ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 2, 13, 21), (2, 1, 1, 1)])
@pytest.mark.parametrize(
    "block, keep, fold", [(8, 4, False), (8, 4, True), (4, 3, True), (5, 2, False)]
)
def test_dct_matches_block_reference(shape, block, keep, fold):
    x = randn(shape)
    _, y = roundtrip(Dct(block=block, keep=keep, storage="f32", fold=fold), x)
    assert rel(y, dct_reference(x, block, keep, fold)) <= 1e-6
    x64 = randn(shape, dtype=torch.float64)
    _, y64 = roundtrip(Dct(block=block, keep=keep, storage="f32", fold=fold), x64)
    assert rel(y64, dct_reference(x64, block, keep, fold)) <= 1e-6


@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (1, 2, 13, 21), (1, 1, 1, 1)])
@pytest.mark.parametrize("block", [8, 5, 1])
def test_dct_full_keep_is_lossless(shape, block):
    c = Dct(block=block, keep=block, storage="f32")
    x = randn(shape)
    assert rel(roundtrip(c, x)[1], x) <= 1e-6
    x64 = randn(shape, dtype=torch.float64)
    assert rel(roundtrip(c, x64)[1], x64) <= 1e-6


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 64, 64), (1, 3, 16, 24)])
def test_dct_constant_image(shape, fold):
    levels = torch.tensor([-2.5, 0.0, 1.0, 1e3])[: shape[1]]
    x = levels.view(1, -1, 1, 1).expand(shape).contiguous()
    packed, y = roundtrip(Dct(fold=fold), x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[:, 1], torch.zeros_like(y[:, 1]))  # all-zero channel: exact zeros
    for ch in range(shape[1]):
        assert rel(y[:, ch], x[:, ch]) <= 1e-6  # only int8 (and float) rounding


@pytest.mark.parametrize("storage", ["int8", "bf16", "f16", "f32"])
def test_dct_zeros(storage):
    x = torch.zeros(2, 3, 10, 10)
    packed, y = roundtrip(Dct(storage=storage, fold=True), x)
    assert torch.equal(y, x)


def test_dct_deterministic_and_batch_one():
    x = randn((1, 3, 17, 9))
    c = Dct()
    a, b = c.compress(x), c.compress(x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    y = roundtrip(c, x)[1]
    assert torch.equal(y, c.decompress(a, (3, 17, 9), torch.float32))


@pytest.mark.parametrize("storage", ["int8", "f32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_dct_nonfinite_propagates(storage, bad):
    x = randn((2, 3, 16, 16))
    x[1, 2, 9, 3] = bad
    _, y = roundtrip(Dct(storage=storage), x)
    assert not torch.isfinite(y[1, 2, 8:16, 0:8]).any()  # the tile holding it
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :2]).all()
    if storage == "f32":
        assert torch.isfinite(y[1, 2, :8]).all()  # other tiles of the channel unaffected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dct_half_inputs(dtype):
    x = sinusoid_field((2, 3, 32, 32)).to(dtype)
    _, y = roundtrip(Dct(), x)
    assert rel(y, x) <= 0.03
    _, y = roundtrip(Dct(keep=8, storage="f32"), x)
    assert rel(y, x) <= torch.finfo(dtype).eps


# quant ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group_size", [None, 1, 5, 64, 10_000])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quant_error_bound(bits, group_size, stochastic):
    torch.manual_seed(0)
    c = Quant(bits=bits, group_size=group_size, stochastic=stochastic)
    for shape in [(3, 4, 9, 7), (2, 33), (1, 5), (2, 3, 1, 1), (2, 3, 5)]:
        x = randn(shape) * 3 + 1
        packed, y = roundtrip(c, x)
        assert_quant_bound(c, x, y, packed)


@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_dtypes(dtype):
    x = randn((2, 3, 6, 5), dtype=dtype)
    for c in [Quant(), Quant(bits=4, group_size=8), Quant(bits=2, stochastic=True)]:
        packed, y = roundtrip(c, x)
        side = torch.float64 if dtype == torch.float64 else torch.float32
        assert packed[1].dtype == packed[2].dtype == side
        assert_quant_bound(c, x, y, packed)


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_constant_groups_exact(group_size, dtype):
    # a subnormal value of each dtype
    tiny = {torch.float32: 1e-40, torch.float64: 1e-310, torch.float16: 1e-7}.get(dtype, 1e-40)
    vals = torch.tensor([3.7, -0.0, tiny, 0.0, -1234.5], dtype=torch.float64).to(dtype)
    x = vals.view(1, -1, 1, 1).expand(2, 5, 2, 2).contiguous()
    for bits in (8, 4, 2):
        _, y = roundtrip(Quant(bits=bits, group_size=group_size), x)
        assert torch.equal(y, x)
    _, y = roundtrip(Quant(bits=2), torch.zeros(3, 7, dtype=dtype))
    assert torch.equal(y, torch.zeros(3, 7, dtype=dtype))


@pytest.mark.parametrize(
    "dtype, values",
    [
        (torch.float32, [1e38, -1e38, 3.4e38, -3.4e38, 0.0, 1.0, 2e-45]),
        (torch.float32, [torch.finfo(torch.float32).max] * 2 + [torch.finfo(torch.float32).min]),
        (torch.float32, [torch.finfo(torch.float32).max, 3e38]),
        (torch.bfloat16, [3e38, -3e38, 1.0]),
        (torch.float16, [65504.0, -65504.0, 0.5]),
        (torch.float64, [1.7e308, -1.7e308, 1.0]),
    ],
)
@pytest.mark.parametrize("bits", [8, 2])
def test_quant_huge_values(dtype, values, bits):
    x = torch.tensor(values, dtype=torch.float64).to(dtype).view(1, -1).repeat(2, 1)
    c = Quant(bits=bits)
    packed, y = roundtrip(c, x)
    assert all(torch.isfinite(p).all() for p in packed[1:])
    assert torch.isfinite(y).all()
    assert_quant_bound(c, x, y, packed)
    # extremes reconstruct to themselves (up to float rounding)
    assert rel(y.max(), x.max()) <= 1e-6 and rel(y.min(), x.min()) <= 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_nonfinite_propagates(bad, dtype):
    x = randn((2, 3, 4, 5), dtype=dtype)
    x[1, 2, 3, 1] = bad
    clean = x.clone()
    clean[1, 2, 3, 1] = 0
    for c in [Quant(), Quant(bits=4, stochastic=True)]:
        torch.manual_seed(0)
        _, y = roundtrip(c, x)
        assert torch.isnan(y[1, 2]).all()  # the whole group: never a finite value
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :2]).all()
        torch.manual_seed(0)
        _, y_clean = roundtrip(c, clean)
        # the other groups come out exactly as they do without the bad value
        assert torch.equal(y[0], y_clean[0]) and torch.equal(y[1, :2], y_clean[1, :2])
    # groups of consecutive elements: only the group holding the bad value
    c = Quant(bits=2, group_size=7)
    flat = randn((2, 30), dtype=dtype)
    flat[0, 15] = bad
    _, y = roundtrip(c, flat)
    assert torch.isnan(y[0, 14:21]).all()
    assert torch.isfinite(y[0, :14]).all() and torch.isfinite(y[0, 21:]).all()
    assert torch.isfinite(y[1]).all()


def test_quant_all_nonfinite_group():
    x = torch.tensor([[float("inf")] * 4, [-float("inf")] * 4, [float("nan")] * 4, [1.0] * 4])
    _, y = roundtrip(Quant(), x)
    assert torch.isnan(y[:3]).all() and torch.equal(y[3], x[3])


def test_quant_stochastic_unbiased():
    torch.manual_seed(1234)
    x = randn((1, 1000), seed=7)
    c = Quant(bits=2, stochastic=True)
    reps = 400
    total = torch.zeros(1, 1000, dtype=torch.float64)
    for _ in range(reps):
        packed, y = roundtrip(c, x)
        total += y.double()
    scale = float(packed[2])
    sd = scale / 2 / math.sqrt(reps)  # per-element std of the mean is at most this
    diff = total / reps - x.double()
    assert float(diff.abs().max()) <= 6 * sd
    assert abs(float(diff.mean())) <= 6 * sd / math.sqrt(1000)
    # round-to-nearest is visibly biased on the same data
    _, y0 = roundtrip(Quant(bits=2), x)
    assert float((y0.double() - x.double()).abs().mean()) > 8 * float(diff.abs().mean())


def test_quant_stochastic_uses_global_rng():
    x = randn((2, 3, 5, 5))
    c = Quant(bits=2, stochastic=True)
    torch.manual_seed(5)
    a = c.compress(x)
    torch.manual_seed(5)
    b = c.compress(x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    d = Quant(bits=2)
    assert all(torch.equal(p, q) for p, q in zip(d.compress(x), d.compress(x)))


def test_quant_4bit_halves_bytes():
    x = randn((2, 3, 10, 10))
    c8, c4, c2 = (Quant(bits=b).compress(x)[0] for b in (8, 4, 2))
    assert c4.numel() * 2 == c8.numel() and c2.numel() * 4 == c8.numel()


# bits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(1,), (3,), (2, 8), (2, 9), (1, 3, 5, 7), (4, 1, 1, 1), (2, 16, 3)]
)
def test_bits_roundtrip(shape):
    g = torch.Generator().manual_seed(0)
    for mask in [torch.rand(shape, generator=g) > 0.5, torch.ones(shape, dtype=torch.bool)]:
        mask = mask.clone()
        packed, y = roundtrip(Bits(), mask)
        assert torch.equal(y, mask)
        assert packed[0].dtype == torch.uint8
        assert packed[0].shape == (shape[0], -(-math.prod(shape[1:]) // 8))
    zeros = torch.zeros(shape, dtype=torch.bool)
    assert torch.equal(roundtrip(Bits(), zeros)[1], zeros)
    assert torch.equal(roundtrip(Bits(), mask, torch.float32)[1], mask.float())


def test_bits_layout():
    mask = torch.tensor([[True, False, False, False, False, False, False, True, True]])
    (packed,) = Bits().compress(mask)
    assert packed.tolist() == [[0b10000001, 0b00000001]]


# property tests ------------------------------------------------------------------------


@st.composite
def dct_cases(draw):
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    h, w = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    block = draw(st.sampled_from([8, 8, 4, 3, 1, 10]))
    keep = draw(st.integers(1, block))
    storage = draw(st.sampled_from(["int8", "bf16", "f16", "f32"]))
    fold = draw(st.booleans())
    dtype = draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**16))
    return (n, c, h, w), Dct(block=block, keep=keep, storage=storage, fold=fold), dtype, seed


@HYP
@given(dct_cases())
# a 1 x 3 map in 8 x 8 blocks: replication makes the padded plane's norm 3.5x x's
@example(((2, 4, 1, 3), Dct(block=8, keep=2, storage="bf16"), torch.float32, 2))
def test_dct_properties(case):
    shape, c, dtype, seed = case
    x = randn(shape, seed, dtype)
    packed, y = roundtrip(c, x)
    block, keep, fold = c.params["block"], c.params["keep"], c.params["fold"]
    # the error against the exact chop is storage rounding only; the inverse transform is an
    # isometry on coefficients, so per (sample, channel) it is at most the coefficient error.
    ref = dct_reference(x, block, keep, fold)
    err = (y.double() - ref).flatten(2).norm(dim=-1)  # [N, C]
    x_norm = x.double().flatten(2).norm(dim=-1)
    eps_in = torch.finfo(dtype).eps
    slack = (2e-6 + eps_in) * (x_norm + ref.flatten(2).norm(dim=-1))
    if c.params["storage"] == "int8":
        kept = packed[0][0, 0].numel()
        # the packed coefficients are the DCT's divided by 2**e, e = ceil(log2(block))
        bound = math.sqrt(kept) * packed[1].double() * 2 ** (block - 1).bit_length() / 2
    else:
        # unit roundoff of the coefficients, so of the plane they transform: the plane padded
        # to whole blocks by edge replication, whose norm exceeds x's on small maps (a 1 x 3
        # plane padded to 8 x 8 repeats its last column five times and its row seven)
        storage_eps = {"bf16": 2**-8, "f16": 2**-11, "f32": 2**-24}[c.params["storage"]]
        h, w = shape[2:]
        padded = F.pad(x.double(), (0, -w % block, 0, -h % block), mode="replicate")
        bound = storage_eps * padded.flatten(2).norm(dim=-1)
    assert bool((err <= bound * 1.001 + slack).all()), (err, bound)
    if keep == block and c.params["storage"] == "f32" and not fold:
        assert rel(y, x) <= 1e-6 + eps_in


@st.composite
def quant_cases(draw):
    rank = draw(st.sampled_from([2, 3, 4]))
    n = draw(st.integers(1, 3))
    if rank == 2:
        shape = (n, draw(st.integers(1, 50)))
    elif rank == 3:
        shape = (n, draw(st.integers(1, 4)), draw(st.integers(1, 20)))
    else:
        shape = (n, draw(st.integers(1, 4)), draw(st.integers(1, 20)), draw(st.integers(1, 20)))
    c = Quant(
        bits=draw(st.sampled_from([8, 4, 2])),
        group_size=draw(st.one_of(st.none(), st.integers(1, 70))),
        stochastic=draw(st.booleans()),
    )
    dtype = draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**16))
    return shape, c, dtype, seed


@HYP
@given(quant_cases())
def test_quant_properties(case):
    shape, c, dtype, seed = case
    torch.manual_seed(seed)
    x = randn(shape, seed, dtype) * 10 ** (seed % 7 - 3)
    packed, y = roundtrip(c, x)
    codes, mn, scale = packed
    groups = int(quant_group_ids(shape, c.params["group_size"])[-1]) + 1
    assert mn.shape == scale.shape == (shape[0], groups)
    assert codes.shape == (shape[0], -(-math.prod(shape[1:]) * c.params["bits"] // 8))
    assert_quant_bound(c, x, y, packed)


@HYP
@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=4).map(
        lambda s: tuple([min(s[0], 3)] + s[1:])
    ),
    st.integers(0, 2**16),
)
def test_bits_properties(shape, seed):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    packed, y = roundtrip(Bits(), mask)
    assert torch.equal(y, mask)


# measured errors (the figures in docs/compressors.md) ------------------------------------

FIELD_SHAPE = (4, 8, 64, 64)
# (compressor, bound on random normal, on sinusoids, on blurred field); lower bounds on the
# random case check that the chop really drops energy (about sqrt(1 - kept/64)).
MEASURED = [
    (Dct(), (0.85, 0.88), 0.025, 0.06),
    (Dct(fold=True), (0.90, 0.93), 0.025, 0.075),
    (Dct(storage="bf16"), (0.85, 0.88), 0.016, 0.055),
    (Dct(keep=2), (0.95, 0.98), 0.062, 0.32),
    (Dct(keep=8), (0.0, 0.011), 0.022, 0.032),
    (Dct(keep=8, storage="f32"), (0.0, 1e-6), 1e-6, 1e-6),
    (Quant(), (0.0, 0.011), 0.0055, 0.0087),
    (Quant(bits=4), (0.0, 0.18), 0.093, 0.15),
    (Quant(bits=2), (0.0, 0.93), 0.47, 0.74),
    (Quant(bits=4, group_size=64), (0.0, 0.116), 0.066, 0.086),
    (Quant(bits=2, group_size=64), (0.0, 0.58), 0.32, 0.43),
    (Quant(bits=2, stochastic=True), (0.0, 1.33), 0.66, 1.05),
]


@pytest.fixture(scope="module")
def fields():
    return {
        "randn": randn(FIELD_SHAPE),
        "sinusoid": sinusoid_field(FIELD_SHAPE),
        "blurred": blurred_field(FIELD_SHAPE),
    }


@pytest.mark.parametrize("comp, rand_bounds, sin_bound, blur_bound", MEASURED, ids=repr)
def test_measured_errors(fields, comp, rand_bounds, sin_bound, blur_bound):
    torch.manual_seed(0)
    errs = {k: rel(roundtrip(comp, x)[1], x) for k, x in fields.items()}
    assert rand_bounds[0] <= errs["randn"] <= rand_bounds[1], errs
    assert errs["sinusoid"] <= sin_bound, errs
    assert errs["blurred"] <= blur_bound, errs


# devices -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_devices(device, dtype):
    x_cpu = sinusoid_field((2, 3, 19, 12)).to(dtype)
    x = x_cpu.to(device)
    for c in [Dct(), Dct(fold=True, storage="bf16"), Quant(bits=4), Quant(bits=2, group_size=5)]:
        packed, y = roundtrip(c, x)
        _, y_cpu = roundtrip(c, x_cpu)
        assert rel(y.cpu(), y_cpu) <= 2e-2  # same algorithm; rounding ties may differ
        if isinstance(c, Quant):
            assert_quant_bound(c, x, y, packed)
    mask = x > 0.1
    packed, y = roundtrip(Bits(), mask)
    assert torch.equal(y, mask)
    torch.manual_seed(0)
    _, y = roundtrip(Quant(stochastic=True), x)
    assert torch.isfinite(y).all()


def test_requires_grad_input_under_no_grad():
    x = randn((2, 3, 8, 8)).requires_grad_()
    for c in [Dct(), Quant(bits=4)]:
        packed, y = roundtrip(c, x)
        assert not any(p.requires_grad for p in packed) and not y.requires_grad


# fast cpu/cuda path vs IPU-safe path ---------------------------------------------------
#
# Every compressor has an IPU-safe formulation (only PopTorch-supported operations; used for
# tensors on other devices and everywhere with base.IPU_SAFE) and a fast one for CPU and CUDA.
# Both must give BIT-identical packed tensors and decompressed tensors. "device" runs the fast
# formulation without host shortcuts (no read-backs, no numpy, no blocks): what CUDA runs;
# "blocks" splits the CPU work into tiny blocks so that block edges fall everywhere, and reads
# back the checks that skip steps however small the tensor. "fast" runs the native kernels
# where a compressor has them and they could be built (compress/native), "torch" the fast
# path's PyTorch formulation in their place.

FORMULATIONS = {
    "safe": {"IPU_SAFE": True},
    "fast": {},
    "torch": {"NATIVE": False},
    "device": {"_HOST_SHORTCUTS": False},
    "blocks": {"CHUNK_ELEMENTS": 301, "CHECK_ELEMENTS": 0, "NATIVE": False},
}
HYP_FAST = settings(HYP, max_examples=50)


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


def assert_formulations_agree(
    c: Compressor, x: torch.Tensor, dtype=None, seed: int = 0, names=tuple(FORMULATIONS)
):
    """Round trips in every formulation (same RNG seed) equal the IPU-safe one bit for bit;
    the IPU-safe one's decompression of each packed form equals it too. Where a formulation
    ran the native DCT kernel, "equal" is that kernel's contract instead (codec_agreement)."""
    results, inexact = {}, {}
    for name in ("safe", *(n for n in names if n != "safe")):
        with formulation(name):
            torch.manual_seed(seed)
            results[name] = roundtrip(c, x, dtype)
            inexact[name] = native_dct(c, x.dtype, x.device)
    packed_safe, y_safe = results["safe"]
    for name, got in results.items():
        assert_agree(c, got, results["safe"], inexact[name], name)
    shape, out_dtype = tuple(x.shape[1:]), dtype or x.dtype
    native = inexact.get("fast", False)
    with formulation("safe"), torch.no_grad():  # and across: fast packed -> safe decompress
        y = c.decompress(results["fast"][0], shape, out_dtype)
        if native:  # the same codes: only the inverse transform's rounding differs
            assert_dct_close(c, results["fast"][0], results["fast"][1], results["fast"][0], y)
        else:
            assert same_bits(y, y_safe)
    with torch.no_grad():
        y = c.decompress(packed_safe, shape, out_dtype)
        if native:
            assert_dct_close(c, packed_safe, y, packed_safe, y_safe)
        else:
            assert same_bits(y, y_safe)


FAST_COMPRESSORS = [
    Dct(),
    Dct(fold=True),
    Dct(storage="bf16"),
    Dct(storage="f16", fold=True, block=4, keep=3),
    Dct(keep=8, storage="f32"),
    Dct(block=5, keep=2),
    Dct(block=1, keep=1, fold=True),
    Quant(),
    Quant(bits=4),
    Quant(bits=2),
    Quant(bits=4, group_size=64),
    Quant(bits=2, group_size=7),
    Quant(bits=8, group_size=1),
    Quant(bits=2, stochastic=True),
    Quant(bits=4, group_size=5, stochastic=True),
    FewBit(),
    FewBit(bits=1, function="silu"),
    FewBit(bits=2),
    FewBit(bits=4, function="silu"),
]


@pytest.mark.parametrize("shape", [*SHAPES_4D, (3, 5, 33, 40)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_fast_path_bit_identical(shape, dtype):
    x = randn(shape, seed=sum(shape), dtype=dtype) * 3
    for c in FAST_COMPRESSORS:
        assert_formulations_agree(c, x, seed=len(shape))
    assert_formulations_agree(Bits(), x > 0.2)
    assert_formulations_agree(Bits(), x > 0.2, torch.float32)
    assert_formulations_agree(Quant(bits=4), x.flatten(1))  # rank 2: one group per sample
    assert_formulations_agree(Quant(bits=2, group_size=3), x.flatten(1)[:, :7])


@pytest.mark.parametrize("dtype", FLOATS)
def test_fast_path_bit_identical_special_values(dtype):
    """NaN, +-inf, the dtype's extremes, subnormals, -0.0, constant and all-zero channels."""
    fin = torch.finfo(dtype)
    x = randn((3, 4, 9, 10), seed=1).to(torch.float64)
    x[0, 0, 1, 2], x[0, 1, 3, 3], x[0, 2, 0, 0] = float("nan"), float("inf"), -float("inf")
    x[1, 0] = fin.max * 0.9
    x[1, 0, 4, 4] = -fin.max * 0.9  # huge range: the halving step
    x[1, 1] = fin.smallest_normal / 8  # subnormal constant channel
    x[1, 1, 0, :3] = 0.0
    x[1, 2] = -0.0
    x[1, 3] = 0.0
    x[2, 0] = 7.25
    x[2, 1] *= 1e-40 if dtype in (torch.float32, torch.bfloat16) else fin.smallest_normal
    x = x.to(dtype)
    for c in FAST_COMPRESSORS + [Quant(group_size=13), Quant(bits=2, group_size=90)]:
        assert_formulations_agree(c, x)
        if isinstance(c, Quant):  # finite, huge values only: no NaN, but groups halved
            assert_formulations_agree(c, x[1:2].contiguous(), seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_bit_identical_larger_than_a_block(device):
    """Inputs of more than base.CHUNK_ELEMENTS elements, so the CPU works block by block."""
    x = randn((2, 3, 420, 420)).to(device)
    x[1, 2, 5, 5] = float("nan")
    names = ("fast", "torch", "device")
    for c in [Dct(), Dct(fold=True), Quant(), Quant(bits=4), Quant(bits=2, group_size=100_000)]:
        assert_formulations_agree(c, x, names=names)
    assert_formulations_agree(Quant(bits=2, stochastic=True), x.flatten(1), names=names)
    assert_formulations_agree(Bits(), x > 0, names=names)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("host", [True, False])
def test_fast_code_packing_matches(bits, host, monkeypatch):
    monkeypatch.setattr(base, "_HOST_SHORTCUTS", host)
    g = torch.Generator().manual_seed(bits)
    for n, m in [(1, 1), (2, 7), (3, 8), (2, 9), (4, 64), (2, 1001)]:
        codes = torch.randint(0, 1 << bits, (n, m + 3), generator=g)
        for c in (codes[:, :m], codes[:, 3:]):  # non-contiguous, odd storage offset
            c8 = c.to(torch.uint8) if bits > 1 else c.bool()
            packed = base.pack_codes(c, bits)
            assert torch.equal(base.pack_codes_fast(c8, bits), packed)
            unpacked = base.unpack_codes_fast(packed, bits, m)
            assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.long(), c)
            assert torch.equal(base.unpack_codes(packed, bits, m).long(), c)


def test_ipu_safe_dispatch(monkeypatch):
    x = randn((2, 3, 8, 8))
    assert base.IPU_SAFE is False
    assert base.use_fast_path(x) and base.use_fast_path(x, x > 0)
    assert not base.use_fast_path(torch.empty(2, device="meta"))
    assert not base.use_fast_path(x, torch.empty(2, device="meta"))

    def boom(*args, **kwargs):
        raise AssertionError("fast path used")

    for cls in (Dct, Quant):
        monkeypatch.setattr(cls, "_compress_fast", boom)
        monkeypatch.setattr(cls, "_decompress_fast", boom)
    monkeypatch.setattr(Quant, "_compress_native", boom)
    monkeypatch.setattr(Quant, "_decompress_native", boom)
    monkeypatch.setattr(base, "pack_codes_fast", boom)
    monkeypatch.setattr(base, "unpack_codes_fast", boom)
    monkeypatch.setattr(bits_module, "pack_codes_fast", boom)
    monkeypatch.setattr(bits_module, "unpack_codes_fast", boom)
    comps = [Dct(), Dct(fold=True), Quant(bits=4), Quant(stochastic=True)]
    with pytest.raises(AssertionError, match="fast path used"):
        roundtrip(Quant(), x)
    # the flag, a device other than cpu/cuda, and a torch.jit trace select the IPU-safe path
    monkeypatch.setattr(base, "IPU_SAFE", True)
    for c in comps:
        roundtrip(c, x)
    roundtrip(Bits(), x > 0)
    monkeypatch.setattr(base, "IPU_SAFE", False)
    monkeypatch.setattr(base, "_FAST_DEVICES", ("cuda",))
    for c in comps:
        roundtrip(c, x)
    roundtrip(Bits(), x > 0)
    monkeypatch.setattr(base, "_FAST_DEVICES", ("cpu", "cuda"))
    for module, name in [(torch.jit, "is_tracing"), (torch.compiler, "is_compiling")]:
        with monkeypatch.context() as m:
            m.setattr(module, name, lambda: True)
            for c in comps:
                roundtrip(c, x)
            roundtrip(Bits(), x > 0)


@HYP_FAST
@given(dct_cases())
def test_dct_fast_path_properties(case):
    shape, c, dtype, seed = case
    x = randn(shape, seed, dtype) * 10 ** (seed % 5 - 2)
    assert_formulations_agree(c, x, seed=seed)


@HYP_FAST
@given(quant_cases())
def test_quant_fast_path_properties(case):
    shape, c, dtype, seed = case
    x = randn(shape, seed, dtype) * 10 ** (seed % 7 - 3)
    if seed % 5 == 0:
        x.view(-1)[seed % x.numel()] = [float("nan"), float("inf"), -float("inf")][seed % 3]
    assert_formulations_agree(c, x, seed=seed)


@HYP_FAST
@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=4).map(
        lambda s: tuple([min(s[0], 3)] + s[1:])
    ),
    st.integers(0, 2**16),
)
def test_bits_fast_path_properties(shape, seed):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    assert_formulations_agree(Bits(), mask)
