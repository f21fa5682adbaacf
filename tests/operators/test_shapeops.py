"""The shape and tensor ops of spec v2 (expand, transpose, permute, select, slice, matmul,
softmax, log_softmax, mean, sum, pad) and ``N`` in a size tuple, beyond the kernel table.

* Every op refuses a bad call at the statement with an exact ``FILE:LINE:COL: error:``
  message pointing at the culprit (the batch dim is never transposed, permuted, selected,
  sliced, reduced or padded; out-of-range dims, indices and bounds, bad permutations and
  inner-dim mismatches are errors); a bare ``N`` outside a size tuple is an error too.
* The shape rules take values without the batch dim (free parameters) where the spec
  allows them (expand, matmul) and refuse them, saying so, elsewhere.
* End to end: a small model using every op, generated for gpu and ipu (nocompress and
  dct-dense), whose float64 gradients equal torch.autograd's on the same torch model.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, rel_err
from torch import nn

from unroller.api import graph_from_text
from unroller.compiler.options import Options
from unroller.compiler.shapes import ShapeError, TensorType, expand, matmul, reduce, softmax
from unroller.errors import ModelError
from unroller.runtime import common, gpu, ipu, ipu_device, poptorch_emulation, shapeops

FILE = "bad.txt"
HEAD = "model m {\n    input x: f32[N, 4, 6]\n    target y: i64[N]\n"
TAIL = (
    "    f_ = flatten(x)\n    l_ = linear(f_, out_features=3)\n"
    "    loss_ = cross_entropy(l_, y)\n    return loss_\n}\n"
)

# (statement on line 4, the column the caret points at (the culprit: a keyword, its value
# or an input), the exact message after "error: ")
ERRORS = [
    (
        "a = expand(x, size=(N, 4, 6, 2))",
        19,
        "a: expand: size (N, 4, 6, 2) adds 1 dim(s) in front of the batch dim of f32[N, 4, 6]; N stays first",
    ),
    (
        "a = expand(x, size=(2, N, 4, 6))",
        19,
        "a: expand: N may appear only first in size (2, N, 4, 6)",
    ),
    (
        "a = expand(x, size=(N, 5, -1))",
        19,
        "a: expand: cannot expand dim 1 of f32[N, 4, 6] (size 4) to 5: only dims of size 1 grow",
    ),
    (
        "a = expand(x, size=(N, -1))",
        19,
        "a: expand: size (N, -1) has 2 dims, fewer than the input's f32[N, 4, 6]",
    ),
    (
        "a = expand(x, size=(N, 0, 6))",
        24,
        "expand: argument 'size' must be a tuple of sizes (positive integers, -1 to keep a dim, N for the batch), got (N, 0, 6)",
    ),
    (
        'a = expand(x, size="N")',
        24,
        "expand: argument 'size' must be a tuple of sizes (positive integers, -1 to keep a dim, N for the batch), got 'N'",
    ),
    (
        "a = transpose(x, dim0=0, dim1=2)",
        22,
        "a: transpose: dim0 0 is the batch dim N of f32[N, 4, 6], which stays where it is",
    ),
    (
        "a = transpose(x, dim0=-3, dim1=1)",
        22,
        "a: transpose: dim0 -3 is the batch dim N of f32[N, 4, 6], which stays where it is",
    ),
    (
        "a = transpose(x, dim0=1, dim1=3)",
        30,
        "a: transpose: dim1 3 is out of range for f32[N, 4, 6] (dims -3 to 2)",
    ),
    (
        "a = permute(x, dims=(0, 2, 2))",
        20,
        "a: permute: dims (0, 2, 2) is not a permutation of the 3 dims of f32[N, 4, 6] (a dim repeats)",
    ),
    ("a = permute(x, dims=(1, 0, 2))", 20, "a: permute: dims (1, 0, 2) must keep dim 0 (N) first"),
    (
        "a = permute(x, dims=(0, 1))",
        20,
        "a: permute: dims (0, 1) is not a permutation of the 3 dims of f32[N, 4, 6]",
    ),
    (
        "a = select(x, dim=2, index=6)",
        26,
        "a: select: index 6 is out of range for dim 2 of f32[N, 4, 6] (size 6)",
    ),
    (
        "a = select(x, dim=1, index=-5)",
        26,
        "a: select: index -5 is out of range for dim 1 of f32[N, 4, 6] (size 4)",
    ),
    (
        "a = select(x, dim=0, index=0)",
        19,
        "a: select: dim 0 is the batch dim N of f32[N, 4, 6], which stays where it is",
    ),
    (
        "a = slice(x, dim=2, start=1, end=7)",
        34,
        "a: slice: end 7 is out of range for dim 2 of f32[N, 4, 6] (size 6)",
    ),
    (
        "a = slice(x, dim=2, start=4, end=2)",
        25,
        "a: slice: the slice 4:2 of dim 2 of f32[N, 4, 6] is empty",
    ),
    (
        "a = slice(x, dim=0, start=1)",
        18,
        "a: slice: dim 0 is the batch dim N of f32[N, 4, 6], which stays where it is",
    ),
    ("a = slice(x, dim=1, step=0)", 30, "slice: argument 'step' must be an integer >= 1, got 0"),
    (
        "a = matmul(x, x)",
        19,
        "a: matmul: the inner dims differ: f32[N, 4, 6] @ f32[N, 4, 6] (6 against 4)",
    ),
    ("a = matmul(x, y)", 19, "a: matmul needs matrices (2 dims or more), got i64[N]"),
    (
        "a = softmax(x, dim=0)",
        20,
        "a: softmax: dim 0 is the batch dim N of f32[N, 4, 6], which stays where it is",
    ),
    (
        "a = log_softmax(x, dim=3)",
        24,
        "a: log_softmax: dim 3 is out of range for f32[N, 4, 6] (dims -3 to 2)",
    ),
    ("a = mean(x, dim=(1, -2))", 17, "a: mean: dim (1, -2) names a dim twice"),
    (
        "a = mean(x, dim=(0, 1))",
        17,
        "a: mean: dim 0 is the batch dim N of f32[N, 4, 6], which stays where it is",
    ),
    ("a = sum(x, dim=4)", 16, "a: sum: dim 4 is out of range for f32[N, 4, 6] (dims -3 to 2)"),
    (
        "a = pad(x, pad=(1, 1, 1, 1, 1, 1))",
        16,
        "a: pad: pad (1, 1, 1, 1, 1, 1) needs an even length of at most 4 for f32[N, 4, 6] (pairs for the last dims; the batch dim is never padded)",
    ),
    (
        "a = pad(x, pad=(1, 1, 1))",
        16,
        "a: pad: pad (1, 1, 1) needs an even length of at most 4 for f32[N, 4, 6] (pairs for the last dims; the batch dim is never padded)",
    ),
    (
        "a = pad(x, pad=(1, -1))",
        20,
        "pad: argument 'pad' must be a tuple of integers >= 0, got (1, -1)",
    ),
    (
        'a = pad(x, pad=(1, 1), mode="reflect")',
        33,
        "pad: argument 'mode' must be a string: one of 'constant', got 'reflect'",
    ),
    (
        "a = reshape(x, shape=(N, 24))",
        26,
        "reshape: argument 'shape' must be a tuple of integers, got N: the batch size N may appear only in a size tuple (as expand's size=(N, -1, -1))",
    ),
    (
        "a = linear(x, out_features=N)",
        32,
        "linear: argument 'out_features' must be an integer, got N: the batch size N may appear only in a size tuple (as expand's size=(N, -1, -1))",
    ),
    (
        "a = slice(x, dim=1, end=N)",
        29,
        "slice: argument 'end' must be an integer, got N: the batch size N may appear only in a size tuple (as expand's size=(N, -1, -1))",
    ),
]


def _source(line: str) -> str:
    return HEAD + f"    {line}\n" + TAIL


@pytest.mark.parametrize("line,col,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_call_is_an_error_at_the_culprit(line: str, col: int, message: str):
    source = _source(line)
    with pytest.raises(ModelError) as info:
        graph_from_text(source, FILE)
    first = info.value.format(FILE, source).splitlines()[0]
    assert first == f"{FILE}:4:{col}: error: {message}"


def test_error_scaffolding_is_valid():
    """Only the statement under test is wrong: the model without it builds."""
    assert graph_from_text(HEAD + TAIL, FILE).loss.name == "loss_"


def test_cli_reports_a_bad_permutation_and_exits_2(tmp_path: Path):
    line = "a = permute(x, dims=(1, 0, 2))"
    (tmp_path / FILE).write_text(_source(line), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "unroller.cli", "generate", FILE, "-o", "out.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"{FILE}:4:20: error: a: permute: dims (1, 0, 2) must keep dim 0 (N) first"
    ), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out.py").exists()


# ---------------------------------------------------------------- N in a size


def test_n_in_a_size_through_a_block_parameter():
    """N is a constant like any other: a block may take it by keyword."""
    source = (
        "model m {\n    input x: f32[N, 1, 6]\n    target y: f32[N, 3, 6]\n"
        "    block grow(v, n, k) {\n        e = expand(v, size=(n, k, -1))\n        return e\n    }\n"
        "    g = grow(x, n=N, k=3)\n    loss = mse_loss(g, y)\n    return loss\n}\n"
    )
    graph = graph_from_text(source, FILE)
    node = graph.node("g.e")
    assert node.output.type == TensorType("f32", ("N", 3, 6))
    assert node.kernel_kwargs == {"size": (-1, 3, -1)}  # a batched input keeps its N
    assert "size=(N, 3, -1)" in node.text


def test_quoted_n_is_a_string_not_the_batch():
    with pytest.raises(ModelError, match="got \\('N', -1, -1\\)"):
        graph_from_text(_source('a = expand(x, size=("N", -1, -1))'), FILE)


def test_expand_of_an_unbatched_value_reads_the_step_batch_size():
    """check_inputs records the batch size at the entry of every step and prediction;
    expand(size=(N, ...)) of a free parameter reads it."""
    x = torch.zeros(5, 3, 4)
    common.check_inputs(("x", x, "f32", (3, 4)))
    token = torch.randn(1, 1, 4)
    for K in (gpu, ipu):
        out = K.expand(token, size=("N", -1, -1))
        assert out.shape == (5, 1, 4) and torch.equal(out[3], token[0])
        (g,) = K.expand_backward(torch.ones(5, 1, 4), input_shape=(1, 1, 4))
        assert torch.equal(g, torch.full((1, 1, 4), 5.0))


# ---------------------------------------------------------------- values without N


def _t(*shape) -> TensorType:
    return TensorType("f32", tuple(shape))


def test_shape_rules_take_unbatched_values_where_the_spec_allows():
    token = expand("expand", [_t(1, 1, 64)], {"size": ("N", -1, -1)})
    assert token.type == _t("N", 1, 64) and token.derived["size"] == ("N", -1, -1)
    pos = expand("expand", [_t(16, 64)], {"size": ("N", -1, -1)})
    assert pos.type == _t("N", 16, 64)
    assert matmul("matmul", [_t("N", 10, 64), _t(64, 32)], {}).type == _t("N", 10, 32)
    assert matmul("matmul", [_t(32, 10), _t("N", 10, 64)], {}).type == _t("N", 32, 64)
    heads = matmul("matmul", [_t("N", 4, 10, 16), _t(4, 16, 10)], {})
    assert heads.type == _t("N", 4, 10, 10)
    assert matmul("matmul", [_t("N", 8), _t(8, 3)], {}).type == _t("N", 3)  # rows: samples


@pytest.mark.parametrize(
    "rule,inputs,args,message",
    [
        (
            expand,
            [_t(2, 1, 64)],
            {"size": ("N", -1, -1)},
            "cannot expand dim 0 of f32[2, 1, 64] (size 2) to N",
        ),
        (
            expand,
            [_t(1, 1, 64)],
            {"size": (-1, -1, -1)},
            "the output needs the batch dim first: size[0] must be N for f32[1, 1, 64]",
        ),
        (
            matmul,
            [_t(10, 64), _t(64, 32)],
            {},
            "the result f32[10, 32] must have the batch dim N first (neither input has",
        ),
        (
            matmul,
            [_t("N", 10, 64), _t(3, 64, 32)],
            {},
            "batch dims [N] and [3] do not broadcast (N against 3)",
        ),
        (
            matmul,
            [_t("N", 10, 64), _t(1, 1, 64, 32)],
            {},
            "the result f32[1, N, 10, 32] must have the batch dim N first (it is not first",
        ),
        (
            matmul,
            [_t("N", 8), _t("N", 8, 3)],
            {},
            "f32[N, 8] @ f32[N, 8, 3] would use the batch dim N as a matrix dim",
        ),
        (
            matmul,
            [_t(3, "N"), _t("N", 8)],
            {},
            "f32[3, N] @ f32[N, 8] would use the batch dim N as a matrix dim",
        ),
        (
            softmax,
            [_t(1, 1, 64)],
            {"dim": -1},
            "softmax needs a tensor with the batch dim N first, got f32[1, 1, 64]",
        ),
        (
            reduce,
            [_t(16, 64)],
            {"dim": (1,), "keepdim": False},
            "mean needs a tensor with the batch dim N first, got f32[16, 64]",
        ),
    ],
)
def test_shape_rules_refuse_what_would_lose_n(rule, inputs, args, message):
    name = "mean" if rule is reduce else rule.__name__
    with pytest.raises(ShapeError) as info:
        rule(name, inputs, args)
    assert message in info.value.message


# ---------------------------------------------------------------- builtins shadowed


@pytest.mark.parametrize("module", [gpu, ipu, shapeops])
def test_runtime_modules_call_no_bare_sum_or_slice(module):
    """The kernels sum and slice shadow the builtins in these modules: a bare sum(...) or
    slice(...) there would call a kernel (a later edit must use the builtins' module)."""
    tree = ast.parse(Path(module.__file__).read_text())
    bare = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("sum", "slice")
    ]
    assert not bare, bare


# ---------------------------------------------------------------- end to end

MODEL = """\
model shapeops {
    input x: f32[N, 6, 8]
    target y: i64[N]
    q = linear(x, out_features=8)
    k = linear(x, out_features=8, bias=false)
    v = linear(x, out_features=8)
    kt = transpose(k, dim0=1, dim1=-1)
    scores = matmul(q, kt)
    attn = softmax(scores, dim=-1)
    o = matmul(attn, v)
    m = mean(o, dim=1, keepdim=true)
    e = expand(m, size=(N, 6, -1))
    r = add(o, e)
    p = permute(r, dims=(0, 2, 1))
    pp = pad(p, pad=(1, 1), value=0.5)
    sl = slice(pp, dim=2, start=1, end=7, step=2)
    sel = select(r, dim=1, index=-2)
    su = sum(sl, dim=2)
    c = concat(sel, su, dim=1)
    logits = linear(c, out_features=5)
    ls = log_softmax(logits, dim=1)
    pooled = mean(attn, dim=(1, 2))
    loss = cross_entropy(ls, y)
    return loss, logits, pooled
}
"""


class Reference(nn.Module):
    """MODEL in torch.nn / torch functions, with the same state-dict names."""

    def __init__(self) -> None:
        super().__init__()
        # k without a bias: softmax cancels it, so its gradient would be rounding noise
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
        self.logits = nn.Linear(16, 5)

    def forward(self, x, y):
        q, k, v = self.q(x), self.k(x), self.v(x)
        attn = torch.softmax(q @ k.transpose(1, -1), dim=-1)
        o = attn @ v
        r = o + o.mean(1, keepdim=True).expand(x.shape[0], 6, -1)
        p = torch.nn.functional.pad(r.permute(0, 2, 1), (1, 1), value=0.5)
        sl = p[:, :, 1:7:2]
        c = torch.cat([r.select(1, -2), sl.sum(2)], 1)
        logits = self.logits(c)
        loss = torch.nn.functional.cross_entropy(torch.log_softmax(logits, 1), y)
        return loss, logits, attn.mean((1, 2))


def _batch(seed: int, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 5, (n,), generator=g)


def _assert_grads(params: dict[str, torch.Tensor], ref: nn.Module) -> None:
    for name, want in ref.named_parameters():
        got = params[name]
        assert got is not None, f"{name}: no gradient"
        assert rel_err(got, want.grad) <= 1e-10, (name, rel_err(got, want.grad))


@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense"])
def test_gpu_step_matches_autograd(build, scheme):
    torch.manual_seed(0)
    ref = Reference().double()
    gen = build(MODEL, Options(scheme=scheme)).Model().double()
    result = gen.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for step in range(2):  # gradients accumulate over two steps, as .backward() does
        x, y = _batch(step)
        ref_loss = ref(x, y)[0]
        ref_loss.backward()
        loss = gen(x, y)
        assert rel_err(loss, ref_loss) <= 1e-10
    _assert_grads({n: p.grad for n, p in gen.named_parameters()}, ref)
    x, _ = _batch(7, n=2)
    for got, want in zip(gen.predict(x), ref(x, torch.zeros(2, dtype=torch.long))[1:]):
        assert rel_err(got, want) <= 1e-10


@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense"])
def test_ipu_step_matches_autograd(build, scheme):
    """The ipu module under PopTorch's CPU emulation: the surrogate loss's gradient is the
    unrolled gradient, so backward() of it puts exactly that into .grad."""
    torch.manual_seed(0)
    ref = Reference().double()
    ipu_device.use_emulation()
    poptorch_emulation.placements.clear()
    try:
        gen = build(MODEL, Options(platform="ipu", scheme=scheme)).Model()
        gen.load_state_dict(ref.state_dict())
        gen = gen.double()
        x, y = _batch(3)
        ref_loss = ref(x, y)[0]
        ref_loss.backward()
        surrogate, loss = gen(x, y)
        assert rel_err(loss, ref_loss) <= 1e-10
        surrogate.backward()
    finally:
        ipu_device.use_emulation(False)
    _assert_grads({n: p.grad for n, p in gen.named_parameters()}, ref)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_compressed_activations_feed_the_backwards(build, platform):
    """quant replaces q, v, the transposed k (a non-contiguous view), the softmax output
    and the log_softmax output: each backward takes the decompressed tensor, and the
    gradients stay near autograd's (8-bit quantisation error, not a wrong formula)."""
    torch.manual_seed(0)
    ref = Reference().double()
    if platform == "ipu":
        ipu_device.use_emulation()
    try:
        gen = build(MODEL, Options(platform=platform, scheme="quant")).Model()
        gen.load_state_dict(ref.state_dict())
        gen = gen.double()
        x, y = _batch(5)
        ref(x, y)[0].backward()
        out = gen(x, y)
        if platform == "ipu":
            out[0].backward()
    finally:
        ipu_device.use_emulation(False)
    params = dict(gen.named_parameters())
    errors = {name: rel_err(params[name].grad, want.grad) for name, want in ref.named_parameters()}
    assert all(e <= 0.05 for e in errors.values()), errors
    assert errors["q.weight"] > 0, errors  # the compressed tensors were used
