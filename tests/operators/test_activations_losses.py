"""Spec v2's activations, losses and embedding, end to end.

The kernels themselves are checked op by op against torch.autograd by tests/runtime/test_kernels.py
(rows in tests/opinfo.py). Here: what only whole models show.

* Model errors: each operator's typical mistake is refused at the statement with the exact
  ``FILE:LINE:COL: error: ...`` line (the caret at the culprit), in process and by the CLI.
* The graph: an ``input`` of i64 ids feeds a non-loss op (embedding) and never asks for a
  gradient; the embedding's output takes the model's float dtype; padding_idx is optional
  (None unless given) and reaches nn.Embedding and the kernels.
* Generated code, gpu and ipu (the ipu one under the CPU emulation of PopTorch), schemes
  nocompress and dct-dense: with nocompress the float64 loss and every parameter gradient
  equal torch.autograd on an equivalent torch.nn model to 1e-10; with dct-dense (lossy) ipu
  equals gpu to 1e-9, and the 1-bit masks of relu6 / hardtanh / hardsigmoid are used.
* ids out of range are a runtime error, as in torch; an all-ignored batch gives nan as torch.
* gelu(approximate="tanh"): gpu bit for bit, ipu to rounding, over a wide range.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

from unroller.api import generate_from_text, graph_from_text
from unroller.compiler.options import Options
from unroller.errors import ModelError
from unroller.runtime import gpu, ipu, ipu_device, poptorch_emulation

TOL = 1e-10
F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- model errors

FILE = "bad.txt"
HEAD = """\
model m {
    input x: f32[N, 4, 6]
    input ids: i64[N, 6]
    input s: f32[N]
    target y: i64[N, 6]
    target z: i64[N]
"""
TAIL = """\
    loss = cross_entropy(x, y)
    return loss
}
"""

# (the statement at line 7, the exact first line of the error)
ERRORS = [
    ("a = relu6(ids)", "7:15: error: a: relu6 needs a floating-point tensor, got i64[N, 6]"),
    (
        "a = hardtanh(x, min_val=2.0, max_val=1.0)",
        "7:34: error: a: hardtanh: max_val (1.0) must not be less than min_val (2.0)",
    ),
    ('a = elu(x, alpha="big")', "7:22: error: elu: argument 'alpha' must be a number, got 'big'"),
    (
        "a = softplus(x, betta=2.0)",
        "7:21: error: softplus has no argument 'betta' (did you mean 'beta'?) "
        "(it takes: beta, threshold)",
    ),
    (
        'a = gelu(x, approximate="fast")',
        "7:29: error: gelu: argument 'approximate' must be a string: one of 'none', 'tanh', "
        "got 'fast'",
    ),
    ("a = mish(x, x)", "7:17: error: mish takes 1 tensor argument(s) (x), got 2"),
    (
        "a = hardswish(ids)",
        "7:19: error: a: hardswish needs a floating-point tensor, got i64[N, 6]",
    ),
    ("a = silu(y)", "7:14: error: a: silu needs a floating-point tensor, got i64[N, 6]"),
    ("a = hardsigmoid(z)", "7:21: error: a: hardsigmoid needs a floating-point tensor, got i64[N]"),
    (
        "l = cross_entropy(x, z)",
        "7:26: error: l: cross_entropy needs class indices i64[N, 6] as its target "
        "(the dims of f32[N, 4, 6] without C, dim 1), got i64[N]",
    ),
    (
        "l = cross_entropy(s, z)",
        "7:23: error: l: cross_entropy needs an input of logits [N, C] or [N, C, d1, ...], "
        "got f32[N]",
    ),
    (
        "l = cross_entropy(x, ids, label_smoothing=1.5)",
        "7:47: error: cross_entropy: argument 'label_smoothing' must be a number <= 1.0, got 1.5",
    ),
    (
        "l = nll_loss(x, z)",
        "7:21: error: l: nll_loss needs class indices i64[N, 6] as its target "
        "(the dims of f32[N, 4, 6] without C, dim 1), got i64[N]",
    ),
    (
        "l = nll_loss(x, y, ignore_index=0.5)",
        "7:37: error: nll_loss: argument 'ignore_index' must be an integer, got 0.5",
    ),
    (
        "e = embedding(x, num_embeddings=10, embedding_dim=3)",
        "7:19: error: e: embedding needs integer ids i64[N, ...], got f32[N, 4, 6]",
    ),
    (
        "e = embedding(ids, num_embeddings=10, embedding_dim=3, padding_idx=10)",
        "7:60: error: e: embedding: padding_idx 10 is out of range for num_embeddings=10 "
        "(it must be in [-10, 9])",
    ),
    (
        "e = embedding(ids, num_embeddings=10, embedding_dim=3, padding_idx=-11)",
        "7:60: error: e: embedding: padding_idx -11 is out of range for num_embeddings=10 "
        "(it must be in [-10, 9])",
    ),
    (
        "e = embedding(ids, embedding_dim=3)",
        "7:9: error: embedding needs the argument 'num_embeddings' (an integer)",
    ),
    (
        'e = embedding(ids, num_embeddings=10, embedding_dim=3, padding_idx="none")',
        "7:72: error: embedding: argument 'padding_idx' must be an integer, got 'none'",
    ),
]


def _bad_model(statement: str) -> str:
    return HEAD + f"    {statement}\n" + TAIL


def test_error_scaffolding_is_valid():
    graph = graph_from_text(_bad_model("a = relu6(x)"), FILE)
    assert graph.node("a").op.name == "relu6"


@pytest.mark.parametrize("statement,expected", ERRORS, ids=[s for s, _ in ERRORS])
def test_model_error_is_exact(statement: str, expected: str):
    source = _bad_model(statement)
    with pytest.raises(ModelError) as info:
        graph_from_text(source, FILE)
    lines = info.value.format(FILE, source).splitlines()
    assert lines[0] == f"{FILE}:{expected}"
    col = int(expected.split(":")[1])
    assert lines[1] == "    " + source.splitlines()[6]
    assert lines[2].startswith("    " + " " * (col - 1) + "^")


@pytest.mark.parametrize("index", [0, 9, 15])
def test_cli_reports_the_error_and_exits_2(tmp_path: Path, index: int):
    statement, expected = ERRORS[index]
    (tmp_path / FILE).write_text(_bad_model(statement), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "unroller.cli", "generate", FILE, "-o", "out.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[0] == f"{FILE}:{expected}"
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.py").exists()


# ---------------------------------------------------------------- graph facts


def test_integer_input_feeds_embedding_and_needs_no_gradient():
    graph = graph_from_text(TOKENS)
    ids = next(v for v in graph.inputs if v.name == "ids")
    assert ids.kind == "input" and ids.type.dtype == "i64" and not ids.requires_grad
    emb = graph.node("emb")
    assert emb.output.type.dtype == "f32" and emb.output.type.shape == ("N", 7, 5)
    assert emb.output.requires_grad and emb.needs_backward
    assert emb.args["padding_idx"] == 0
    assert [p.key for p in emb.params] == ["emb.weight"] and emb.params[0].shape == (12, 5)


def test_embedding_output_takes_the_model_float_dtype():
    text = """model m {
        input x: f64[N, 3, 4]
        input ids: i64[N, 3]
        target y: f64[N, 3, 4]
        e = embedding(ids, num_embeddings=5, embedding_dim=4)
        s = add(e, x)
        loss = mse_loss(s, y)
        return loss
    }"""
    graph = graph_from_text(text)
    assert graph.node("e").output.type.dtype == "f64"
    assert graph.node("e").params[0].dtype == "f64"
    assert graph.node("e").args["padding_idx"] is None  # optional: None unless given


def test_padding_idx_reaches_module_and_kernels_only_when_given():
    source = generate_from_text(TOKENS, Options())
    assert "torch.nn.Embedding(12, 5, padding_idx=0)" in source
    assert "K.embedding(ids, " in source and "padding_idx=0" in source
    plain = generate_from_text(TOKENS.replace(", padding_idx=0", ""), Options())
    assert "torch.nn.Embedding(12, 5)" in plain and "padding_idx" not in plain


# ---------------------------------------------------------------- whole models

ACTIVATIONS = """\
model acts {
    input x: f32[N, 4, 8, 8]
    target y: i64[N, 8, 8]
    c1 = conv2d(x, out_channels=6, kernel_size=3, padding=1)
    a1 = relu6(c1)
    c2 = conv2d(a1, out_channels=6, kernel_size=1)
    a2 = hardtanh(c2, min_val=-0.2, max_val=0.3)
    c3 = conv2d(a2, out_channels=6, kernel_size=1)
    a3 = hardswish(c3)
    c4 = conv2d(a3, out_channels=6, kernel_size=1)
    a4 = hardsigmoid(c4)
    c5 = conv2d(a4, out_channels=6, kernel_size=1)
    a5 = silu(c5)
    c6 = conv2d(a5, out_channels=6, kernel_size=1)
    a6 = mish(c6)
    c7 = conv2d(a6, out_channels=6, kernel_size=1)
    a7 = elu(c7, alpha=0.7)
    c8 = conv2d(a7, out_channels=6, kernel_size=1)
    a8 = softplus(c8, beta=2.0, threshold=1.0)
    c9 = conv2d(a8, out_channels=5, kernel_size=1)
    a9 = gelu(c9, approximate="tanh")
    loss = cross_entropy(a9, y, label_smoothing=0.1, ignore_index=-1)
    return loss, a9
}
"""

TOKENS = """\
model tokens {
    input ids: i64[N, 7]
    target y: i64[N, 7]
    emb = embedding(ids, num_embeddings=12, embedding_dim=5, padding_idx=0)
    h = linear(emb, out_features=4)
    a = elu(h)
    f = flatten(a)
    scores = linear(f, out_features=21)
    per_token = reshape(scores, shape=(3, 7))
    loss = nll_loss(per_token, y, ignore_index=2)
    return loss, per_token
}
"""


class Activations(nn.Module):
    """ACTIVATIONS in torch.nn / functional, with the same state-dict names."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 6, 3, padding=1)
        for i in range(2, 9):
            setattr(self, f"c{i}", nn.Conv2d(6, 6, 1))
        self.c9 = nn.Conv2d(6, 5, 1)

    def forward(self, x, y):
        a = F.relu6(self.c1(x))
        a = F.hardtanh(self.c2(a), -0.2, 0.3)
        a = F.hardswish(self.c3(a))
        a = F.hardsigmoid(self.c4(a))
        a = F.silu(self.c5(a))
        a = F.mish(self.c6(a))
        a = F.elu(self.c7(a), alpha=0.7)
        a = F.softplus(self.c8(a), beta=2.0, threshold=1.0)
        logits = F.gelu(self.c9(a), approximate="tanh")
        return F.cross_entropy(logits, y, label_smoothing=0.1, ignore_index=-1)


class Tokens(nn.Module):
    """TOKENS in torch.nn / functional."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 5, padding_idx=0)
        self.h = nn.Linear(5, 4)
        self.scores = nn.Linear(28, 21)

    def forward(self, ids, y):
        a = F.elu(self.h(self.emb(ids)))
        per_token = self.scores(a.flatten(1)).reshape(-1, 3, 7)
        return F.nll_loss(per_token, y, ignore_index=2)


def _activations_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(3, 4, 8, 8, generator=g, dtype=F64)
    y = torch.randint(0, 5, (3, 8, 8), generator=g)
    y.view(-1)[::7] = -1  # ignored pixels
    return x, y


def _tokens_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (4, 7), generator=g)
    ids[:, 0] = 0  # the padding row is used (and gets no gradient)
    ids[1, 3] = ids[2, 3] = 5  # a row used several times
    y = torch.randint(0, 3, (4, 7), generator=g)
    return ids, y


CASES = {
    "activations": (ACTIVATIONS, Activations, _activations_batch),
    "tokens": (TOKENS, Tokens, _tokens_batch),
}


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    poptorch_emulation.placements.clear()
    yield poptorch_emulation
    ipu_device.use_emulation(False)


def _reference(name: str) -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """The torch.nn model (seeded init), its loss and autograd's gradients, in float64."""
    _, cls, batch = CASES[name]
    torch.manual_seed(0)
    ref = cls().double()
    loss = ref(*batch())
    loss.backward()
    return ref, loss.detach(), {k: p.grad for k, p in ref.named_parameters()}


def _gpu_step(build, name: str, scheme: str, ref: nn.Module) -> tuple[torch.Tensor, dict]:
    text, _, batch = CASES[name]
    model = build(text, Options(scheme=scheme)).Model().double()
    result = model.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    loss = model(*batch())
    return loss, {k: p.grad for k, p in model.named_parameters()}


def _ipu_step(build, emulation, name: str, scheme: str, ref: nn.Module) -> tuple:
    """One emulated PopTorch training step with lr 0: the gradients the ipu module hands
    over (through its surrogate loss) are left in .grad, the weights unchanged."""
    text, _, batch = CASES[name]
    model = build(text, Options(platform="ipu", scheme=scheme)).Model()
    model.load_state_dict(ref.state_dict())
    model = model.double()
    sgd = emulation.optim.SGD(model.parameters(), lr=0.0)
    _, loss = emulation.trainingModel(model, emulation.Options(), sgd)(*batch())
    return loss, {k: p.grad for k, p in model.named_parameters()}


def _assert_grads(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want)
    for key, grad in want.items():
        assert got[key] is not None, key
        assert rel_err(got[key], grad) <= tol, (key, rel_err(got[key], grad))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_nocompress_equals_autograd(build, name):
    ref, ref_loss, ref_grads = _reference(name)
    loss, grads = _gpu_step(build, name, "nocompress", ref)
    assert rel_err(loss, ref_loss) <= TOL
    _assert_grads(grads, ref_grads, TOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ipu_nocompress_equals_autograd(build, emulation, name):
    ref, ref_loss, ref_grads = _reference(name)
    loss, grads = _ipu_step(build, emulation, name, "nocompress", ref)
    assert rel_err(loss, ref_loss) <= TOL
    _assert_grads(grads, ref_grads, TOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dct_dense_ipu_equals_gpu(build, emulation, name):
    """dct-dense is lossy (8x8 activations are DCT-compressed), so both platforms run the same
    compressed step: equal to 1e-9 (as tests/runtime/test_ipu_emulated_step.py). The forward is not compressed (the
    loss is autograd's); tokens has no 8x8 maps, so its gradients stay autograd's."""
    ref, ref_loss, ref_grads = _reference(name)
    gpu_loss, gpu_grads = _gpu_step(build, name, "dct-dense", ref)
    ipu_loss, ipu_grads = _ipu_step(build, emulation, name, "dct-dense", ref)
    assert rel_err(ipu_loss, gpu_loss) <= 1e-9
    _assert_grads(ipu_grads, gpu_grads, 1e-9)
    assert rel_err(gpu_loss, ref_loss) <= TOL
    if name == "tokens":
        _assert_grads(gpu_grads, ref_grads, TOL)
    else:
        assert rel_err(gpu_grads["c1.weight"], ref_grads["c1.weight"]) > 1e-6  # it is lossy


def test_the_padding_row_gets_no_gradient_and_ids_none(build):
    ref, _, ref_grads = _reference("tokens")
    _, grads = _gpu_step(build, "tokens", "nocompress", ref)
    assert torch.equal(grads["emb.weight"][0], torch.zeros(5, dtype=F64))
    assert ref_grads["emb.weight"][5].abs().sum() > 0


def test_masks_replace_the_saved_inputs_of_the_clamping_activations():
    source = generate_from_text(ACTIVATIONS, Options(scheme="dct-dense"))
    for kernel in ("relu6_mask", "hardtanh_mask", "hardsigmoid_mask"):
        assert f"K.{kernel}(" in source, kernel


def test_predict_matches_eval(build):
    ref, _, _ = _reference("tokens")
    module = build(TOKENS, Options())
    model = module.Model().double()
    model.load_state_dict(ref.state_dict())
    ids, _ = _tokens_batch(3)
    want = ref.scores(F.elu(ref.h(ref.emb(ids))).flatten(1)).reshape(-1, 3, 7)
    assert rel_err(model.predict(ids), want) <= TOL


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_ids_out_of_range_are_a_runtime_error(build, platform):
    module = build(TOKENS, Options(platform=platform))
    model = module.Model()
    ids, y = _tokens_batch()
    ids[0, 1] = 12
    with pytest.raises(IndexError):
        model.predict(ids) if platform == "ipu" else model(ids, y)


def _all_ignored(seed: int = 0) -> tuple[torch.Tensor, ...]:
    x, y = _activations_batch(seed)
    return x, torch.full_like(y, -1)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_all_ignored_batch_gives_nan_as_torch(build, emulation, platform, monkeypatch):
    """torch: the mean over no element is 0 / 0 = nan, and every gradient is zero."""
    monkeypatch.setitem(CASES, "activations", (ACTIVATIONS, Activations, _all_ignored))
    ref, ref_loss, ref_grads = _reference("activations")
    assert math.isnan(float(ref_loss))
    step = _gpu_step if platform == "gpu" else lambda *a: _ipu_step(a[0], emulation, *a[1:])
    loss, grads = step(build, "activations", "nocompress", ref)
    assert math.isnan(float(loss))
    for key, want in ref_grads.items():
        assert not want.any() and torch.equal(grads[key], want), key


# ---------------------------------------------------------------- gelu, tanh form


def test_gelu_tanh_gpu_is_bit_exact_and_ipu_within_rounding():
    torch.manual_seed(0)
    x = torch.cat([torch.linspace(-40, 40, 8001, dtype=F64), 3 * torch.randn(4000, dtype=F64)])
    x = torch.cat([x, torch.tensor([0.0, 1e-300, -1e-300, 5.0, -5.0], dtype=F64)])
    xr = x.clone().requires_grad_()
    ref = F.gelu(xr, approximate="tanh")
    g = torch.randn_like(x)
    (ref_grad,) = torch.autograd.grad(ref, xr, g)
    with torch.no_grad():
        assert torch.equal(gpu.gelu(x, approximate="tanh"), ref.detach())
        assert torch.equal(gpu.gelu_backward(g, x, approximate="tanh")[0], ref_grad)
        assert rel_err(ipu.gelu(x, approximate="tanh"), ref) <= 1e-15
        assert rel_err(ipu.gelu_backward(g, x, approximate="tanh")[0], ref_grad) <= 1e-14
