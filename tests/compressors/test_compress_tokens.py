"""Compression of what transformers save: token tensors [N, L, E], attention maps
[N, H, L, L] and GELU/SiLU inputs.

- quant groups per last-dim row (per token, per attention row), never one scale for a
  whole sample or head; image maps [N, C, H, W] keep their per-channel groups. The error
  bound per row, |x_hat - x| <= (row max - row min) / (2 (2**bits - 1)), is checked on
  hostile rows (all zeros, one token with a huge outlier, flat next to peaked softmax rows).
- fewbit: the few-bit backward of GELU/SiLU (a 1-4 bit code of the derivative), its
  levels and representatives, both formulations bit-identical, the gradient error bounded.
- the stash plan and `unroll graph` say why each tensor stayed raw (dct needs a 4-D map).
- end to end: a token model (linear, gelu, linear, mse_loss on [N, 16, 32]) generated for
  gpu and ipu under every scheme; exact to 1e-10 where nothing lossy is kept, within the
  measured bound under quant.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_grads_close, rel_err
from typer.testing import CliRunner

from unroller.api import compression_config, graph_from_text
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.compiler.registry import RegistryError, _op_spec, load_registry
from unroller.compiler.schemes import MAP, ROWS, SCHEMES, builtin, load_config, make_codec
from unroller.compiler.stash import plan_stash
from unroller.compress import base, make
from unroller.compress.fewbit import (
    DERIVATIVES,
    gelu_derivative,
    gelu_derivative_levels,
    silu_derivative,
    silu_derivative_levels,
)
from unroller.errors import ConfigError
from unroller.runtime import ipu_device, poptorch_emulation

TOKENS = """
model tokens {
    input x: f32[N, 16, 32]
    target y: f32[N, 16, 8]
    fc1 = linear(x, out_features=64)
    act = gelu(fc1)
    fc2 = linear(act, out_features=8)
    loss = mse_loss(fc2, y)
    return loss, fc2
}
"""

# Relative L2 error of each parameter's gradient against exact autograd, float64, batch 4,
# default init (quant, gelu's input as a 3-bit derivative code and act as 8-bit per-token
# quant: fc1.weight 0.080, fc1.bias 0.062, fc2 0.004; the other schemes keep nothing lossy
# on this model: dct needs a 4-D map). auto: forms with a round-trip error of at most 0.2
# (AUTO_MAX_ERROR) where they lower the peak (none here: exact). Every bound is below 1,
# which a zero or sign-flipped gradient of any one parameter exceeds.
TOKEN_BOUND = {
    "nocompress": 1e-10,
    "dct-first": 1e-10,
    "dct-dense": 1e-10,
    "quant": 0.15,
    "auto": 0.2,
}


def row_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Half a quantisation step of each last-dim row: the round-to-nearest error bound."""
    span = x.amax(dim=-1, keepdim=True) - x.amin(dim=-1, keepdim=True)
    return span / (2 * ((1 << bits) - 1))


def roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.instance().decompress(codec.instance().compress(x), x.shape[1:], x.dtype)


# -- quant: per-row groups -------------------------------------------------------------


def hostile_tokens(dtype=torch.float64) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(3, 16, 32, dtype=dtype)
    x[0, 3] = 0.0  # a row of zeros
    x[1, 5, 7] = 1e6  # one token with a huge outlier
    x[2] *= torch.logspace(-6, 3, 16, dtype=dtype).unsqueeze(-1)  # rows of very different scale
    return x


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quant_groups_token_tensors_per_token_within_the_row_bound(bits):
    codec = make_codec("quant", {"bits": bits})
    x = hostile_tokens()
    fitted, why = codec.fit(tuple(x.shape), ROWS)
    assert fitted is codec and why == ""  # [N, L, E]: the default groups are the tokens
    err = (roundtrip(fitted, x) - x).abs()
    bound = row_bound(x, bits) * (1 + 1e-12) + 1e-300
    assert (err <= bound).all()
    assert torch.equal(roundtrip(fitted, x)[0, 3], x[0, 3])  # the zero row is exact
    # the outlier token does not touch the other tokens of its sample
    others = torch.cat([x[1, :5], x[1, 6:]])
    near = row_bound(others, bits).max() * (1 + 1e-12)
    assert err[1, :5].max() <= near and err[1, 6:].max() <= near
    # the tiny rows keep their relative precision: error relative to the row's own range
    rel = err[2] / (x[2].amax(-1, keepdim=True) - x[2].amin(-1, keepdim=True))
    assert rel.max() <= 0.5 / ((1 << bits) - 1) * (1 + 1e-9)


def test_one_scale_per_sample_would_fail_the_row_bound():
    """The bound above is not vacuous: grouping the whole sample breaks it."""
    x = hostile_tokens()
    per_sample = make_codec("quant", {"bits": 8, "group_size": 16 * 32})
    err = (roundtrip(per_sample, x) - x).abs()
    assert not (err <= row_bound(x, 8) * (1 + 1e-12) + 1e-300).all()


def softmax_rows() -> torch.Tensor:
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 17, 17, dtype=torch.float64)
    logits[:, :, ::2] *= 30.0  # peaked rows (max near 1) next to flat rows (near 1/17)
    logits[:, :, 1::2] *= 0.01
    return logits.softmax(-1)


@pytest.mark.parametrize("bits", [8, 4])
def test_quant_groups_attention_maps_per_row(bits):
    p = softmax_rows()
    codec, why = make_codec("quant", {"bits": bits}).fit(tuple(p.shape), ROWS)
    assert why == "" and codec.kwargs["group_size"] == 17
    err = (roundtrip(codec, p) - p).abs()
    assert (err <= row_bound(p, bits) * (1 + 1e-9)).all()
    flat = err[:, :, 1::2] / p[:, :, 1::2]  # flat rows keep their relative precision
    assert flat.max() < 0.01 if bits == 8 else flat.max() < 0.05
    # one scale per head (the default for a 4-D map) loses the flat rows
    per_head, _ = make_codec("quant", {"bits": bits}).fit(tuple(p.shape), MAP)
    assert per_head.kwargs["group_size"] is None
    flat_per_head = (roundtrip(per_head, p) - p).abs()[:, :, 1::2] / p[:, :, 1::2]
    assert flat_per_head.max() > 5 * flat.max()


def test_image_maps_keep_their_groups_and_dct():
    quant, dct = make_codec("quant", {"bits": 8}), make_codec("dct", {}, min_size=8)
    assert quant.fit((4, 16, 32, 32), MAP) == (quant, "")
    assert dct.fit((4, 16, 32, 32), MAP) == (dct, "")


@pytest.mark.parametrize(
    "shape, layout, why",
    [
        ((4, 16, 32), MAP, "dct needs a 4-D map [N, C, H, W]; this is [N, L, E] = [4, 16, 32]"),
        ((4, 64), MAP, "dct needs a 4-D map [N, C, H, W]; this is [N, F] = [4, 64]"),
        (
            (4, 2, 17, 17),
            ROWS,
            "dct needs a 4-D map [N, C, H, W]; this is [N, H, L, L] = [4, 2, 17, 17]",
        ),
        ((4, 2, 3, 16, 16), MAP, "dct needs a 4-D map [N, C, H, W]; this is a rank-5 tensor"),
    ],
)
def test_dct_says_why_it_does_not_apply(shape, layout, why):
    codec, found = make_codec("dct", {}).fit(shape, layout)
    assert codec is None and found.startswith(why)


def test_min_size_says_why():
    codec, why = make_codec("dct", {}, min_size=8).fit((4, 3, 4, 4), MAP)
    assert codec is None and why == "min_size=8: H x W is 4 x 4, below 8"


# -- fewbit: the few-bit derivative code ------------------------------------------------


@pytest.mark.parametrize("function", sorted(DERIVATIVES))
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_levels_are_attained_by_their_representatives(function, bits):
    derivative = {"gelu": gelu_derivative, "silu": silu_derivative}[function]
    edges, levels, reps = DERIVATIVES[function](bits)
    assert len(edges) == (1 << bits) - 1 and list(edges) == sorted(edges)
    bounds = [-math.inf, *edges, math.inf]
    for k, (level, rep) in enumerate(zip(levels, reps)):
        assert bounds[k] <= rep <= bounds[k + 1]
        assert abs(derivative(rep) - level) <= 1e-12


@pytest.mark.parametrize("function", ["gelu", "silu"])
def test_more_bits_never_fit_worse(function):
    """The dynamic programme is optimal: doubling the pieces cannot raise the error."""
    derivative = {"gelu": gelu_derivative, "silu": silu_derivative}[function]
    x = torch.linspace(-6, 6, 4001, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x)
    exact = torch.tensor([derivative(float(v)) for v in x], dtype=torch.float64)
    errors = []
    for bits in (1, 2, 3, 4):
        edges, levels, _ = DERIVATIVES[function](bits)
        approx = torch.tensor(levels, dtype=torch.float64)[
            torch.bucketize(x, torch.tensor(edges, dtype=torch.float64))
        ]
        errors.append(float((w * (approx - exact) ** 2).sum() / w.sum()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 20


# measured (2026-12-01, x and g ~ N(0, 1), 64x16x32): relative L2 error of the input gradient
# gelu 0.293 / 0.134 / 0.065 / 0.037 and silu 0.294 / 0.146 / 0.072 / 0.036 for 1-4 bits
FEWBIT_BOUND = {1: 0.32, 2: 0.16, 3: 0.08, 4: 0.045}


@pytest.mark.parametrize("function", ["gelu", "silu"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fewbit_gradient_error_is_bounded(function, bits):
    act = {"gelu": F.gelu, "silu": F.silu}[function]
    torch.manual_seed(0)
    x = torch.randn(64, 16, 32, dtype=torch.float64)
    g = torch.randn_like(x)
    codec = make("fewbit", function=function, bits=bits)
    packed = codec.compress(x)
    assert sum(p.numel() for p in packed) == codec.stored_bytes(tuple(x.shape), x.dtype)
    assert codec.stored_bytes(tuple(x.shape), x.dtype) == 64 * 16 * 32 * bits // 8
    x_hat = codec.decompress(packed, x.shape[1:], x.dtype)

    def grad(v):
        v = v.clone().requires_grad_()
        act(v).backward(g)
        return v.grad

    exact, approx = grad(x), grad(x_hat)
    assert rel_err(approx, exact) <= FEWBIT_BOUND[bits]
    # per element: the derivative is the level of x's interval
    edges, levels, _ = DERIVATIVES[function](bits)
    code = torch.bucketize(x, torch.tensor(edges, dtype=torch.float64))
    want = g * torch.tensor(levels, dtype=torch.float64)[code]
    assert rel_err(approx, want) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3])
def test_fewbit_formulations_agree_on_hostile_input(dtype, bits, monkeypatch):
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e30, -1e30], dtype=torch.float64)
    x[1, 1, :3] = torch.tensor([math.inf, -math.inf, 1e-30], dtype=torch.float64)
    x = x.to(dtype)
    codec = make("fewbit", function="gelu", bits=bits)
    fast = codec.compress(x)
    restored = codec.decompress(fast, x.shape[1:], dtype)
    monkeypatch.setattr(base, "IPU_SAFE", True)
    safe = codec.compress(x)
    assert all(torch.equal(a, b) for a, b in zip(fast, safe))
    assert torch.equal(codec.decompress(safe, x.shape[1:], dtype), restored)
    assert restored.dtype == dtype and torch.isfinite(restored).all()
    reps = gelu_derivative_levels(bits)[2]
    assert float(restored[1, 1, 0]) == pytest.approx(reps[-1], rel=1e-2)  # +inf: last
    assert float(restored[1, 1, 1]) == pytest.approx(reps[0], rel=1e-2)  # -inf: first
    assert silu_derivative_levels(bits)[0] != gelu_derivative_levels(bits)[0]


def test_fewbit_zero_size_roundtrips():
    codec = make("fewbit", function="silu", bits=3)
    x = torch.zeros(0, 4, 5)
    packed = codec.compress(x)
    assert codec.decompress(packed, (4, 5), x.dtype).shape == (0, 4, 5)


# -- registry and configs ----------------------------------------------------------------


def test_gelu_opts_in_with_one_registry_field():
    spec = load_registry()["gelu"].derivative["x"]
    assert (spec.function, spec.bits) == ("gelu", 3) and spec.function in DERIVATIVES


@pytest.mark.parametrize(
    "field, message",
    [
        ({"derivative": {"y": {"function": "gelu"}}}, "derivative.y must name a saved activation"),
        ({"derivative": {"x": {"function": 3}}}, "derivative.x must be"),
        ({"derivative": {"x": {"function": "gelu", "levels": 2}}}, "derivative.x must be"),
        ({"layout": "columns"}, "layout must be one of ('rows',)"),
    ],
)
def test_bad_registry_fields_are_refused(field, message):
    raw = {"doc": "d", "kind": "activation", "inputs": ["x"], "shape": "same_float"}
    raw |= {"saved": ["x"], "activations": ["x"], **field}
    with pytest.raises(RegistryError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _op_spec("op", raw, "ops.toml")


def test_derivatives_config_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('derivatives = true\n[default]\ncompressor = "none"\n')
    plan = plan_stash(graph_from_text(TOKENS), load_config(path))
    forms = {s.key: s.forms[0].label() for s in plan.entries}
    assert forms["fc1"] == "fewbit(bits=3, function='gelu')" and forms["act"] == "raw"
    path.write_text("derivatives = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    first = str(exc.value).splitlines()[0]
    assert first.endswith("c.toml:1:15: error: 'derivatives' must be true or false, not an integer")
    path.write_text('[default]\ncompressor = "fewbit"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    first = str(exc.value).splitlines()[0]
    assert first.endswith(
        "c.toml:2:14: error: 'fewbit' keeps an activation's derivative, not the activation; "
        "use one of dct, quant, none"
    )


# -- the stash plan and `unroll graph` -----------------------------------------------------


def plan_rows(scheme: str, text: str = TOKENS) -> dict[str, dict]:
    report = plan_stash(graph_from_text(text), builtin(scheme)).report(4)
    return {r["tensor"]: r for r in report["rows"]}


def test_each_scheme_on_tokens_says_what_it_kept_and_why():
    quant = plan_rows("quant")
    assert quant["fc1"]["compressor"] == "fewbit(bits=3, function='gelu')"
    assert quant["fc1"]["stored_bytes"] == 4 * 16 * 64 * 3 // 8
    assert quant["act"]["compressor"] == "quant(bits=8, group_size=None, stochastic=False)"
    assert quant["act"]["stored_bytes"] == 4 * (16 * 64 + 16 * 2 * 4)  # per-token mn, scale
    assert quant["x"]["why"] == "a model input: the caller holds it anyway"
    assert quant["fc2"]["why"] == "loss's backward needs a exactly"
    for scheme in ("dct-dense", "dct-first"):
        rows = plan_rows(scheme)
        assert all(r["compressor"] == "raw" for r in rows.values())
        assert rows["act"]["why"] == (
            "dct needs a 4-D map [N, C, H, W]; this is [N, L, E] = [N, 16, 64]"
        )
    assert plan_rows("nocompress")["act"]["why"] == "the scheme compresses no activations"


ANY_RANK = """
model any_rank {
    input x: f32[N, 120]
    target y: f32[N, 120]
    a = linear(x, out_features=120)
    r = reshape(a, shape=(2, 3, 4, 5))
    s5 = sigmoid(r)
    flat = reshape(s5, shape=(120,))
    t = tanh(flat)
    o = linear(t, out_features=120)
    loss = mse_loss(o, y)
    return loss, o
}
"""


def test_quant_takes_a_float_activation_of_any_rank():
    rows = plan_rows("quant", ANY_RANK)
    assert rows["s5"]["shape"] == [4, 2, 3, 4, 5]
    assert rows["s5"]["compressor"] == "quant(bits=8, group_size=None, stochastic=False)"
    assert rows["t"]["shape"] == [4, 120]
    assert rows["t"]["compressor"] == "quant(bits=8, group_size=None, stochastic=False)"
    dct = plan_rows("dct-dense", ANY_RANK)
    assert dct["s5"]["why"] == (
        "dct needs a 4-D map [N, C, H, W]; this is a rank-5 tensor [N, 2, 3, 4, 5]"
    )


def test_unroll_graph_prints_why(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text(TOKENS)
    runner = CliRunner()
    result = runner.invoke(app, ["graph", str(path), "--scheme", "dct-dense", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("tensor "))
    assert header.split()[-2:] == ["why", "raw"]
    act = [line for line in lines if line.startswith("act ")][-1]  # the stash table's row
    assert act.endswith("dct needs a 4-D map [N, C, H, W]; this is [N, L, E] = [N, 16, 64]")
    result = runner.invoke(app, ["graph", str(path), "--scheme", "quant", "--format", "json"])
    rows = {r["tensor"]: r for r in json.loads(result.stdout)["stash"]["rows"]}
    assert rows["act"]["why"] == "" and rows["fc1"]["compressor"].startswith("fewbit(")


# an out-of-tree attention-like op (softmax over the last dim) that declares its tensors
# rows, and silu opting in to the derivative code: one registry field each.
EXTRA_OPS = """
[rowsoftmax]
doc = "softmax over the last dim"
kind = "activation"
inputs = ["x"]
shape = "same_float"
saved = ["output"]
activations = ["output"]
layout = "rows"
kernels.gpu = "token_kernels"

[silu]
doc = "x * sigmoid(x)"
kind = "activation"
inputs = ["x"]
shape = "same_float"
saved = ["x"]
activations = ["x"]
derivative.x = { function = "silu", bits = 3 }
kernels.gpu = "token_kernels"
"""

KERNELS = """
import torch


def rowsoftmax(x):
    return torch.softmax(x, -1)


def rowsoftmax_backward(g, y, *, needs=None):
    return (torch._softmax_backward_data(g, y, -1, y.dtype),)


def silu(x):
    return torch.nn.functional.silu(x)


def silu_backward(g, x, *, needs=None):
    return (torch.ops.aten.silu_backward(g, x),)
"""

ATTENTION = """
model attention_like {
    input x: f32[N, 2, 8, 8]
    target y: f32[N, 2, 8, 8]
    a = linear(x, out_features=8)
    p = rowsoftmax(a)
    s = silu(p)
    b = linear(s, out_features=8)
    loss = mse_loss(b, y)
    return loss, b
}
"""


@pytest.fixture
def extra_ops(tmp_path, monkeypatch):
    (tmp_path / "extra_ops.toml").write_text(EXTRA_OPS)
    (tmp_path / "token_kernels.py").write_text(textwrap.dedent(KERNELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("UNROLLER_OPS", str(tmp_path / "extra_ops.toml"))
    sys.modules.pop("token_kernels", None)
    yield
    sys.modules.pop("token_kernels", None)


def test_rows_ops_get_per_row_quant_and_silu_gets_its_code(extra_ops, build):
    rows = plan_rows("quant", ATTENTION)
    # p: made by a rows op, read by silu and b: per attention row (8), not per head (64)
    # (two readers, two forms: rowsoftmax's backward reads p itself, silu's its derivative)
    assert rows["p"]["compressor"] == (
        "quant(bits=8, group_size=8, stochastic=False)+fewbit(bits=3, function='silu')"
    )
    assert "quant(bits=8, group_size=8, stochastic=False)" in rows["s"]["compressor"]
    dct = plan_rows("dct-dense", ATTENTION)
    assert dct["s"]["why"] == (
        "dct needs a 4-D map [N, C, H, W]; this is [N, H, L, L] = [N, 2, 8, 8]"
    )
    # end to end: silu's derivative code and the per-row quant, against autograd
    module = build(ATTENTION, scheme="quant")
    torch.manual_seed(0)
    model = module.Model().double()
    x = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    y = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    model(x, y)
    ref = {k: v.clone().requires_grad_() for k, v in model.state_dict().items()}
    h = F.linear(x, ref["a.weight"], ref["a.bias"]).softmax(-1)
    out = F.linear(F.silu(h), ref["b.weight"], ref["b.bias"])
    F.mse_loss(out, y).backward()
    # measured (2026-12-01): b.weight 9.4e-4 (8-bit per-row quant of s), a.weight 0.062 and
    # a.bias 0.046 (behind silu's 3-bit derivative code)
    bound = {"a.weight": 0.1, "a.bias": 0.1, "b.weight": 0.005, "b.bias": 1e-12}
    for name, p in model.named_parameters():
        assert rel_err(p.grad, ref[name].grad) <= bound[name], name


# -- end to end: the token model on both platforms ------------------------------------------


class TokenReference(torch.nn.Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 8)
        self.approximate = approximate

    def forward(self, x, y):
        out = self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
        return F.mse_loss(out, y)


def token_batch(seed: int = 0, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, 32, generator=gen, dtype=torch.float64)
    return x, torch.randn(n, 16, 8, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_token_model_gradients_on_gpu(build, scheme, approximate, capsys):
    """gelu's levels serve approximate="tanh" too (its derivative is within 9e-4)."""
    torch.manual_seed(0)
    ref = TokenReference(approximate).double()
    text = TOKENS.replace("gelu(fc1)", f'gelu(fc1, approximate="{approximate}")')
    model = build(text, scheme=scheme).Model().double()
    model.load_state_dict(ref.state_dict())
    x, y = token_batch()
    loss = model(x, y)
    want = ref(x, y)
    want.backward()
    assert rel_err(loss, want) <= 1e-12  # the forward pass is never changed
    errors = assert_grads_close(model, ref, TOKEN_BOUND[scheme])  # each parameter's
    with capsys.disabled():
        print(f"\ntokens {scheme} {approximate}: worst gradient error {max(errors.values()):.2e}")
    rows = {r["tensor"]: r for r in model.stash_report()["rows"]}
    derivatives = scheme == "quant"
    if scheme == "auto":  # as its plan says: the search may take quant's derivative codes
        config = compression_config(Options(scheme="auto"), graph_from_text(text, "tokens.txt"))
        derivatives = config.derivatives
    assert rows["fc1"]["compressor"].startswith("FewBit(") == derivatives


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    poptorch_emulation.placements.clear()
    yield poptorch_emulation
    ipu_device.use_emulation(False)


@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense", "quant"])
def test_token_model_on_emulated_ipu_equals_gpu(build, emulation, scheme):
    torch.manual_seed(0)
    ref = TokenReference()
    gpu = build(TOKENS, scheme=scheme).Model().double()
    ipu = build(TOKENS, platform="ipu", scheme=scheme).Model()
    gpu.load_state_dict(ref.state_dict())
    ipu.load_state_dict(ref.state_dict())
    ipu = ipu.double()
    batch = token_batch(1)
    sgd = dict(lr=0.1)
    opt = torch.optim.SGD(gpu.parameters(), **sgd)
    want = gpu(*batch)
    opt.step()
    training = emulation.trainingModel(
        ipu, emulation.Options(), emulation.optim.SGD(ipu.parameters(), **sgd)
    )
    _, loss = training(*batch)
    assert rel_err(loss, want) <= 1e-9
    state = gpu.state_dict()
    for key, value in ipu.state_dict().items():
        assert rel_err(value, state[key]) <= 1e-9, key


def test_ipu_module_with_the_derivative_code_lints_clean(build):
    """The fewbit codec runs on the IPU: only operations PopTorch supports."""
    from unroller.lint import lint_paths

    module = build(TOKENS, platform="ipu", scheme="quant", readable=True)
    assert "CODEC_FEWBIT.decompress(" in open(module.__file__).read()
    report = lint_paths([module.__file__], "ipu")
    assert report.ok, report.format()
