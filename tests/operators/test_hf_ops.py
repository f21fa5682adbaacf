"""The two registry operators Hugging Face models need, end to end.

* ``embedding_rows``: rows start .. start+length-1 of an nn.Embedding table, without the
  batch dim (positions and token types read at constant ids), a layer without inputs;
* ``transposed_linear``: Hugging Face's ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc), weight
  stored [in_features, out_features], ``addmm(bias, x, weight)`` on the last dim.

The kernels themselves are checked against torch.autograd by tests/runtime/test_kernels.py (rows in
tests/opinfo.py, bit for bit on both platforms). Here: what only a whole model shows (a
BERT-style embeddings block and two GPT-2 blocks, float64, against a torch.nn twin to 1e-10,
generated for gpu and for the emulated ipu), the exact ``FILE:LINE:COL`` errors, the
registry's zero-input layer, the modules and their initialisation (Hugging Face's own
Conv1D where transformers is installed), and the bit-exact match of a position table's
gradient with autograd's ``embedding(arange)`` broadcast over the batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

from unroller.api import generate_from_text, graph_from_text
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.compiler.registry import RegistryError, load_registry
from unroller.errors import ModelError
from unroller.runtime import common, gpu, ipu, ipu_device, poptorch_emulation

TOL = 1e-10
F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]
LENGTH, WIDTH, VOCAB, START = 6, 8, 11, 2

# A BERT-style embeddings block (word + position + token type, LayerNorm) feeding two GPT-2
# blocks whose projections are Conv1D layers, an untied Conv1D head without a bias.
MODEL = """\
model hf_tiny {
    input ids: i64[N, 6]
    target y: i64[N, 6]
    block embeddings(ids) {
        word_embeddings = embedding(ids, num_embeddings=11, embedding_dim=8)
        position_embeddings = embedding_rows(num_embeddings=10, embedding_dim=8, length=6, start=2)
        token_type_embeddings = embedding_rows(num_embeddings=2, embedding_dim=8, length=1)
        positioned = add(word_embeddings, position_embeddings)
        typed = add(positioned, token_type_embeddings)
        LayerNorm = layernorm(typed, normalized_shape=8, eps=1e-12)
        return LayerNorm
    }
    block attention(x) {
        c_attn = transposed_linear(x, out_features=24)
        q = slice(c_attn, dim=2, start=0, end=8)
        k = slice(c_attn, dim=2, start=8, end=16)
        v = slice(c_attn, dim=2, start=16, end=24)
        qh = reshape(q, shape=(6, 2, 4))
        kh = reshape(k, shape=(6, 2, 4))
        vh = reshape(v, shape=(6, 2, 4))
        qt = transpose(qh, dim0=1, dim1=2)
        kt = transpose(kh, dim0=1, dim1=2)
        vt = transpose(vh, dim0=1, dim1=2)
        ctx = scaled_dot_product_attention(qt, kt, vt, is_causal=true)
        merged = transpose(ctx, dim0=1, dim1=2)
        flat = reshape(merged, shape=(6, 8))
        c_proj = transposed_linear(flat, out_features=8)
        return c_proj
    }
    block mlp(x) {
        c_fc = transposed_linear(x, out_features=32)
        act = gelu(c_fc, approximate="tanh")
        c_proj = transposed_linear(act, out_features=8)
        return c_proj
    }
    block gpt2_block(x) {
        ln_1 = layernorm(x, normalized_shape=8)
        attn = attention(ln_1)
        r1 = add(x, attn)
        ln_2 = layernorm(r1, normalized_shape=8)
        mlp = mlp(ln_2)
        r2 = add(r1, mlp)
        return r2
    }
    embeddings = embeddings(ids)
    h.0 = gpt2_block(embeddings)
    h.1 = gpt2_block(h.0)
    ln_f = layernorm(h.1, normalized_shape=8)
    lm_head = transposed_linear(ln_f, out_features=11, bias=false)
    logits = transpose(lm_head, dim0=1, dim1=2)
    loss = cross_entropy(logits, y)
    return loss, lm_head
}
"""


# ---------------------------------------------------------------- the torch.nn twin


class Conv1D(nn.Module):
    """Hugging Face's Conv1D, written from its documented behaviour (weight [nx, nf],
    addmm on x viewed as rows); ``bias=False`` is the plain product, for the head."""

    def __init__(self, nf: int, nx: int, bias: bool = True) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.view(-1, x.size(-1))
        y = rows.mm(self.weight) if self.bias is None else torch.addmm(self.bias, rows, self.weight)
        return y.view(*x.shape[:-1], self.nf)


class Embeddings(nn.Module):
    """BERT's embeddings: positions are rows START.. of their table (ids arange), token
    types the row 0 of theirs for every token (ids zeros), as Hugging Face looks them up."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.position_embeddings = nn.Embedding(10, WIDTH)
        self.token_type_embeddings = nn.Embedding(2, WIDTH)
        self.LayerNorm = nn.LayerNorm(WIDTH, eps=1e-12)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.position_embeddings(torch.arange(START, START + LENGTH)[None])
        types = self.token_type_embeddings(torch.zeros_like(ids))
        return self.LayerNorm(self.word_embeddings(ids) + positions + types)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * WIDTH, WIDTH)
        self.c_proj = Conv1D(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (
            t.reshape(n, LENGTH, 2, 4).transpose(1, 2) for t in self.c_attn(x).split(WIDTH, 2)
        )
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(ctx.transpose(1, 2).reshape(n, LENGTH, WIDTH))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * WIDTH, WIDTH)
        self.c_proj = Conv1D(WIDTH, 4 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln_2, self.mlp = nn.LayerNorm(WIDTH), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r1 = x + self.attn(self.ln_1(x))
        return r1 + self.mlp(self.ln_2(r1))


class HfTiny(nn.Module):
    """MODEL in torch.nn, with the same state-dict keys."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = Conv1D(VOCAB, WIDTH, bias=False)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(ids)
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(ids).transpose(1, 2), y)


def _randomize(model: nn.Module) -> nn.Module:
    """Layer norms away from 1 and 0, so a missing weight or bias shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or "LayerNorm" in name:
                param.copy_(torch.rand(param.shape) + 0.5 if name.endswith("weight") else 0.3)
    return model


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (3, LENGTH), generator=g), torch.randint(
        0, VOCAB, (3, LENGTH), generator=g
    )


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    poptorch_emulation.placements.clear()
    yield poptorch_emulation
    ipu_device.use_emulation(False)


def _reference() -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """The twin (seeded), its float64 loss and autograd's gradients."""
    torch.manual_seed(0)
    ref = _randomize(HfTiny()).double()
    loss = ref(*_batch())
    loss.backward()
    return ref, loss.detach(), {k: p.grad for k, p in ref.named_parameters()}


def _assert_grads(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, grad in want.items():
        assert got[key] is not None, key
        assert rel_err(got[key], grad) <= TOL, (key, rel_err(got[key], grad))


# ---------------------------------------------------------------- whole model, both platforms


def test_gpu_float64_equals_autograd(build):
    ref, ref_loss, ref_grads = _reference()
    model = build(MODEL).Model().double()
    assert set(model.state_dict()) == set(ref.state_dict())
    model.load_state_dict(ref.state_dict())
    ref.load_state_dict(model.state_dict())  # both ways: same keys, same shapes
    loss = model(*_batch())
    assert rel_err(loss, ref_loss) <= TOL
    _assert_grads({k: p.grad for k, p in model.named_parameters()}, ref_grads)
    ids, _ = _batch(5)
    with torch.no_grad():
        assert rel_err(model.predict(ids), ref.logits(ids)) <= TOL


def test_ipu_float64_equals_autograd(build, emulation):
    """One emulated PopTorch step with lr 0: the gradients the ipu module hands over."""
    ref, ref_loss, ref_grads = _reference()
    model = build(MODEL, Options(platform="ipu")).Model()
    model.load_state_dict(ref.state_dict())
    model = model.double()
    sgd = emulation.optim.SGD(model.parameters(), lr=0.0)
    _, loss = emulation.trainingModel(model, emulation.Options(), sgd)(*_batch())
    assert rel_err(loss, ref_loss) <= TOL
    _assert_grads({k: p.grad for k, p in model.named_parameters()}, ref_grads)


def test_generated_ipu_module_passes_lint(tmp_path):
    from typer.testing import CliRunner

    model, out = tmp_path / "hf_tiny.txt", tmp_path / "hf_tiny_ipu.py"
    model.write_text(MODEL, encoding="utf-8")
    runner = CliRunner()
    result = runner.invoke(app, ["generate", str(model), "--platform", "ipu", "-o", str(out)])
    assert result.exit_code == 0, result.output
    lint = runner.invoke(app, ["lint", str(out), "--platform", "ipu"])
    assert lint.exit_code == 0, lint.output


@pytest.mark.parametrize("scheme", ["quant", "dct-dense"])
def test_compressing_schemes_generate_and_step(build, scheme):
    """A value without the batch dim is never compressed; the Conv1D inputs may be."""
    model = build(MODEL, Options(scheme=scheme)).Model()
    loss = model(*_batch())
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------- the graph and the code


def test_graph_a_layer_without_inputs():
    graph = graph_from_text(MODEL)
    pos = graph.node("embeddings.position_embeddings")
    assert pos.inputs == [] and pos.op.inputs == ()
    assert pos.output.type.dtype == "f32" and pos.output.type.shape == (6, 8)  # no N
    assert pos.output.requires_grad and pos.needs_backward and pos.saved == ()
    assert [(p.key, p.shape) for p in pos.params] == [
        ("embeddings.position_embeddings.weight", (10, 8))
    ]
    assert graph.node("embeddings.token_type_embeddings").output.type.shape == (1, 8)
    head = graph.node("lm_head")
    assert [(p.key, p.shape, p.present) for p in head.params] == [
        ("lm_head.weight", (8, 11), True),
        ("lm_head.bias", (11,), False),
    ]


def test_graph_float64_model():
    text = MODEL.replace(
        "i64[N, 6]\n    target", "i64[N, 6]\n    input s: f64[N, 6, 8]\n    target"
    )
    text = text.replace(
        "typed = add(positioned, token_type_embeddings)", "typed = add(positioned, s)"
    )
    text = text.replace("embeddings = embeddings(ids)", "embeddings = embeddings(ids, s)")
    text = text.replace("block embeddings(ids)", "block embeddings(ids, s)")
    graph = graph_from_text(text)
    assert graph.node("embeddings.position_embeddings").output.type.dtype == "f64"


def test_generated_calls_and_modules():
    source = generate_from_text(MODEL, Options())
    assert 'K.embedding_rows(L["position_embeddings"], length=6, start=2)' in source
    assert 'K.embedding_rows(L["token_type_embeddings"], length=1)' in source  # start=0 left out
    assert "K.embedding_rows_backward(" in source and "num_embeddings=10, start=2" in source
    assert '"embeddings.position_embeddings", torch.nn.Embedding(10, 8)' in source
    assert '"h.0.attn.c_attn", K.transposed_linear_layer(8, 24)' in source
    assert '"lm_head", K.transposed_linear_layer(8, 11, bias=False)' in source


def test_registry_allows_no_inputs_only_with_parameters(tmp_path):
    ops = load_registry()
    assert ops["embedding_rows"].inputs == () and not ops["embedding_rows"].free
    bad = tmp_path / "bad.toml"
    bad.write_text('[nothing]\ndoc = "x"\nkind = "layer"\nshape = "same_float"\ninputs = []\n')
    with pytest.raises(RegistryError, match="needs 'inputs', 'variadic = true' or 'params'"):
        load_registry((str(bad),))


# ---------------------------------------------------------------- modules and initialisation


def test_transposed_linear_layer_is_initialised_as_conv1d():
    torch.manual_seed(0)
    layer = common.transposed_linear_layer(256, 300)
    assert dict(layer.named_parameters()).keys() == {"weight", "bias"}
    assert layer.weight.shape == (256, 300) and layer.bias.shape == (300,)
    assert torch.equal(layer.bias, torch.zeros(300))
    weight = layer.weight.detach()
    assert abs(float(weight.std()) - 0.02) < 0.001 and abs(float(weight.mean())) < 1e-3
    plain = common.transposed_linear_layer(4, 3, bias=False)
    assert plain.bias is None and set(plain.state_dict()) == {"weight"}
    assert "in_features=4, out_features=3, bias=False" in repr(plain)


def test_default_initialisation_equals_hugging_faces():
    """Same seed, same draws: Hugging Face's Conv1D and the factory agree bit for bit, and
    the generated model's state dict loads into a Hugging Face layer as it is."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(3)
    hf = pytorch_utils.Conv1D(24, 8)
    torch.manual_seed(3)
    ours = common.transposed_linear_layer(8, 24)
    assert torch.equal(hf.weight, ours.weight) and torch.equal(hf.bias, ours.bias)
    hf.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_kernels_equal_hugging_faces_conv1d_bit_for_bit(platform, dtype):
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    K = {"gpu": gpu, "ipu": ipu}[platform]
    torch.manual_seed(1)
    hf = pytorch_utils.Conv1D(5, 4).to(dtype)
    with torch.no_grad():
        hf.bias.copy_(torch.randn(5))
    x = torch.randn(2, 3, 4, dtype=dtype, requires_grad=True)
    want = hf(x)
    g = torch.randn_like(want)
    grads = torch.autograd.grad(want, (x, hf.weight, hf.bias), g)
    with torch.no_grad():
        y = K.transposed_linear(x, hf)
        got = K.transposed_linear_backward(g, x, hf)
    assert torch.equal(y, want)
    assert all(torch.equal(a, b) for a, b in zip(got, grads))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_position_gradient_equals_embedding_of_arange_bit_for_bit(platform, dtype):
    """Hugging Face looks positions up as embedding(arange) broadcast over the batch; the
    add's sum over the batch then embedding_rows' backward give autograd's values exactly."""
    K = {"gpu": gpu, "ipu": ipu}[platform]
    torch.manual_seed(2)
    table = nn.Embedding(9, 5).to(dtype)
    tokens = torch.randn(4, 6, 5, dtype=dtype)
    want = tokens + table(torch.arange(3, 9)[None])
    g = torch.randn_like(want)
    (ref,) = torch.autograd.grad(want, table.weight, g)
    with torch.no_grad():
        rows = K.embedding_rows(table, length=6, start=3)
        assert torch.equal(K.add(tokens, rows), want)
        _, g_rows = K.add_backward(g, b_shape=(6, 5))
        (got,) = K.embedding_rows_backward(g_rows, num_embeddings=9, start=3)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_layer_handles_may_be_plain_objects(platform):
    K = {"gpu": gpu, "ipu": ipu}[platform]
    weight = torch.randn(4, 3, dtype=F64)
    x = torch.randn(2, 5, 4, dtype=F64)
    assert torch.equal(K.transposed_linear(x, SimpleNamespace(weight=weight)), x @ weight)
    table = SimpleNamespace(weight=torch.randn(7, 2))
    assert torch.equal(K.embedding_rows(table, length=2, start=1), table.weight[1:3])


# ---------------------------------------------------------------- model errors

FILE = "bad.txt"
HEAD = """\
model m {
    input x: f32[N, 4, 6]
    input ids: i64[N, 6]
    input s: f32[N]
    target y: i64[N, 6]
"""
TAIL = """\
    loss = cross_entropy(x, y)
    return loss
}
"""

# (the statement at line 6, the exact first line of the error)
ERRORS = [
    (
        "p = embedding_rows(num_embeddings=10, embedding_dim=4, length=6, start=5)",
        "6:60: error: p: embedding_rows: rows 5 to 10 (start=5, length=6) are past the end "
        "of a table of num_embeddings=10 rows",
    ),
    (
        "p = embedding_rows(num_embeddings=10, embedding_dim=4, length=11)",
        "6:60: error: p: embedding_rows: rows 0 to 10 (start=0, length=11) are past the end "
        "of a table of num_embeddings=10 rows",
    ),
    (
        "p = embedding_rows(num_embeddings=10, embedding_dim=4, length=1, start=10)",
        "6:70: error: p: embedding_rows: rows 10 to 10 (start=10, length=1) are past the end "
        "of a table of num_embeddings=10 rows",
    ),
    (
        "p = embedding_rows(num_embeddings=10, embedding_dim=4, length=2, start=-1)",
        "6:76: error: embedding_rows: argument 'start' must be an integer >= 0, got -1",
    ),
    (
        "p = embedding_rows(num_embeddings=10, embedding_dim=4, length=0)",
        "6:67: error: embedding_rows: argument 'length' must be an integer >= 1, got 0",
    ),
    (
        "p = embedding_rows(num_embeddings=10, embedding_dim=4)",
        "6:9: error: embedding_rows needs the argument 'length' (an integer)",
    ),
    (
        "p = embedding_rows(ids, num_embeddings=10, embedding_dim=4, length=2)",
        "6:24: error: embedding_rows takes 0 tensor argument(s) (), got 1",
    ),
    (
        "t = transposed_linear(s, out_features=3)",
        "6:27: error: t: transposed_linear needs an input of at least 2 dims "
        "[N, ..., features], got f32[N]",
    ),
    (
        "t = transposed_linear(ids, out_features=3)",
        "6:27: error: t: transposed_linear needs a floating-point tensor, got i64[N, 6]",
    ),
    (
        "t = transposed_linear(x, out_features=0)",
        "6:43: error: transposed_linear: argument 'out_features' must be an integer >= 1, got 0",
    ),
    (
        "t = transposed_linear(x)",
        "6:9: error: transposed_linear needs the argument 'out_features' (an integer)",
    ),
]


def _bad_model(statement: str) -> str:
    return HEAD + f"    {statement}\n" + TAIL


def test_error_scaffolding_is_valid():
    graph = graph_from_text(_bad_model("t = transposed_linear(x, out_features=3)"), FILE)
    assert graph.node("t").output.type.shape == ("N", 4, 3)


@pytest.mark.parametrize("statement,expected", ERRORS, ids=[s for s, _ in ERRORS])
def test_model_error_is_exact(statement: str, expected: str):
    source = _bad_model(statement)
    with pytest.raises(ModelError) as info:
        graph_from_text(source, FILE)
    lines = info.value.format(FILE, source).splitlines()
    assert lines[0] == f"{FILE}:{expected}"
    col = int(expected.split(":")[1])
    assert lines[1] == "    " + source.splitlines()[5]
    assert lines[2].startswith("    " + " " * (col - 1) + "^")


@pytest.mark.parametrize("index", [0, 7])
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
