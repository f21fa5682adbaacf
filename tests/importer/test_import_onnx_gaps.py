"""ONNX import gaps closed exactly: ``Gemm(transB=0)`` (the weight stored [in, out]), a
constant ``Cos``/``Sin`` folded, ``SplitToSequence`` read by ``SequenceAt`` at constant
positions, and ONNX ops no registry operator computes that run as their ATen twin (the
``aten`` fallback, refused under ``fallback=False``).

Each file is built by hand from a small torch module's float32 weights; the generated
module, loaded with that module's state dict (strict=True), must make the same float64
training step as torch autograd on the module (loss and every gradient to 1e-10 relative)
and predict what ``onnx.reference`` computes from the file.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

onnx = pytest.importorskip("onnx")

from unroller.api import generate_from_text, import_generated, write_atomic  # noqa: E402
from unroller.compiler.options import Options  # noqa: E402
from unroller.importer.api import import_network  # noqa: E402
from unroller.importer.model import ImportFailure  # noqa: E402
from unroller.importer.onnx_frontend import onnx_state_dict  # noqa: E402

TOLERANCE = 1e-10
make = onnx.helper.make_node


def _save(nodes, inits, inputs, outputs, folder: Path, opset: int = 18) -> tuple:
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    path = folder / "case.onnx"
    onnx.save(model, str(path))
    return model, str(path)


def _tensor(name: str, shape):
    return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def _weights(module: nn.Module) -> list:
    """The module's parameters as float32 initializers named by their state-dict keys."""
    return [
        onnx.numpy_helper.from_array(p.detach().float().numpy(), k)
        for k, p in module.state_dict().items()
    ]


def _ints(name: str, values) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(values, np.int64), name)


def _generated(text: str, folder: Path):
    source = generate_from_text(text, Options(platform="gpu", scheme="nocompress"))
    path = write_atomic(folder / "gaps_generated.py", source)
    return import_generated(path, f"onnx_gaps_{abs(hash(str(path)))}").Model


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / max(scale, 1e-300)


def _verifies(text: str, module: nn.Module, model, path: str, folder: Path, shape) -> None:
    """One float64 mse step of the generated module against autograd on ``module``, and
    its prediction against onnx.reference on the file (float32: to its rounding)."""
    module = module.double().train()
    generated = _generated(text, folder)().double().train()
    generated.load_state_dict(module.state_dict(), strict=True)
    assert set(onnx_state_dict(path)) == set(module.state_dict())
    torch.manual_seed(1)
    x = torch.randn(3, *shape, dtype=torch.float64)
    out = module(x)
    y = torch.randn_like(out)
    loss = generated(x, y)
    want = F.mse_loss(out, y)
    want.backward()
    assert _relative(loss.detach(), want.detach()) <= TOLERANCE
    grads = dict(generated.named_parameters())
    for key, param in module.named_parameters():
        assert grads[key].grad is not None, key
        assert _relative(grads[key].grad, param.grad) <= TOLERANCE, key
    x32 = x.float().numpy()
    reference = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x32})[0]
    got = generated.predict(torch.from_numpy(x32).double()).detach().numpy()
    assert np.allclose(got, reference, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- Gemm(transB=0)


class StoredDense(nn.Module):
    """x @ W + b with W stored [in, out] (a Keras Dense; torch.addmm of a raw matrix)."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.fc = nn.Module()
        self.fc.weight = nn.Parameter(torch.randn(6, 4))
        self.fc.bias = nn.Parameter(torch.randn(4)) if bias else None

    def forward(self, x):
        y = x @ self.fc.weight
        return y if self.fc.bias is None else y + self.fc.bias


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_gemm_with_the_weight_stored_in_out_is_a_transposed_linear(bias, tmp_path):
    """``Gemm(transB=0)``: ``transposed_linear``, its weight the file's [in, out] values."""
    torch.manual_seed(0)
    module = StoredDense(bias)
    inputs = ["x", "fc.weight", "fc.bias"] if bias else ["x", "fc.weight"]
    nodes = [make("Gemm", inputs, ["y"])]
    model, path = _save(
        nodes, _weights(module), [_tensor("x", ["N", 6])], [_tensor("y", ["N", 4])], tmp_path
    )
    text = import_network(path, ["x: f32[N, 6]"], loss="mse_loss").text
    want = "fc = transposed_linear(x, out_features=4)" if bias else "bias=false"
    assert want in text and "transposed_linear" in text, text
    _verifies(text, module, model, path, tmp_path, (6,))


# ---------------------------------------------------------------- constant Cos / Sin


class Rotated(nn.Module):
    """x cos(a) - x sin(a) through a linear layer (the factors folded at import)."""

    def __init__(self, cos: float, sin: float):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.cos, self.sin = cos, sin

    def forward(self, x):
        return self.fc(x * self.cos - x * self.sin)


def test_constant_cos_and_sin_are_folded(tmp_path):
    """``Cos`` and ``Sin`` of a constant angle are computed at import: scalar factors."""
    angle = np.array(0.7, np.float32)
    cos, sin = float(str(np.cos(angle))), float(str(np.sin(angle)))
    torch.manual_seed(0)
    module = Rotated(cos, sin)
    nodes = [
        make("Constant", [], ["angle"], value=onnx.numpy_helper.from_array(angle, "")),
        make("Cos", ["angle"], ["c"]),
        make("Sin", ["angle"], ["s"]),
        make("Mul", ["x", "c"], ["xc"]),
        make("Mul", ["x", "s"], ["xs"]),
        make("Sub", ["xc", "xs"], ["r"]),
        make("Gemm", ["r", "fc.weight", "fc.bias"], ["y"], transB=1),
    ]
    model, path = _save(
        nodes, _weights(module), [_tensor("x", ["N", 5])], [_tensor("y", ["N", 3])], tmp_path
    )
    text = import_network(path, ["x: f32[N, 5]"], loss="mse_loss").text
    assert f"factor={cos}" in text and f"factor={sin}" in text, text
    assert math.isclose(cos, math.cos(0.7), rel_tol=1e-6)
    _verifies(text, module, model, path, tmp_path, (5,))


# ---------------------------------------------------------------- SplitToSequence


class Pieces(nn.Module):
    """Pieces of x [N, 6, 4] along dim 1: x[:, 2:5] (split [2, 3, 1], position 1), x[:, 5]
    (keepdims=0 ones, position -1) and x[:, 4:] (split 2, position 2), mixed by linears."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        mid = self.a(x[:, 2:5]).sum(1)
        return mid + self.b(x[:, 5]) + x[:, 4:].sum((1, 2)).unsqueeze(1)


def test_split_to_sequence_read_at_constant_positions_is_slices(tmp_path):
    """Each ``SequenceAt`` of a ``SplitToSequence`` (a 1-D split, ones without keepdims, a
    scalar split) is a ``slice`` or ``select`` of the source."""
    torch.manual_seed(0)
    module = Pieces()
    nodes = [
        make("SplitToSequence", ["x", "sizes"], ["s1"], axis=1),
        make("SequenceAt", ["s1", "one"], ["p1"]),
        make("Transpose", ["a.weight"], ["at"], perm=[1, 0]),
        make("MatMul", ["p1", "at"], ["m1"]),
        make("Add", ["m1", "a.bias"], ["l1"]),
        make("ReduceSum", ["l1", "axis1"], ["r1"], keepdims=0),
        make("SplitToSequence", ["x"], ["s2"], axis=-2, keepdims=0),
        make("SequenceAt", ["s2", "last"], ["p2"]),
        make("Gemm", ["p2", "b.weight", "b.bias"], ["l2"], transB=1),
        make("SplitToSequence", ["x", "two"], ["s3"], axis=1),
        make("SequenceAt", ["s3", "two"], ["p3"]),
        make("ReduceSum", ["p3", "axes12"], ["r3"], keepdims=1),
        make("Squeeze", ["r3", "axis1"], ["q3"]),
        make("Add", ["r1", "l2"], ["y0"]),
        make("Add", ["y0", "q3"], ["y"]),
    ]
    consts = [
        _ints("sizes", [2, 3, 1]),
        _ints("one", 1),
        _ints("last", -1),
        _ints("two", 2),
        _ints("axis1", [1]),
        _ints("axes12", [1, 2]),
    ]
    model, path = _save(
        nodes,
        _weights(module) + consts,
        [_tensor("x", ["N", 6, 4])],
        [_tensor("y", ["N", 3])],
        tmp_path,
    )
    text = import_network(path, ["x: f32[N, 6, 4]"], loss="mse_loss").text
    assert "slice(x, dim=1, start=2, end=5)" in text, text
    assert "select(x, dim=1, index=5)" in text, text
    assert "slice(x, dim=1, start=4)" in text, text
    _verifies(text, module, model, path, tmp_path, (6, 4))


def test_a_sequence_read_otherwise_is_refused(tmp_path):
    nodes = [
        make("SplitToSequence", ["x"], ["s"], axis=1),
        make("ConcatFromSequence", ["s"], ["y"], axis=1),
    ]
    _, path = _save(nodes, [], [_tensor("x", ["N", 6])], [_tensor("y", ["N", 6])], tmp_path)
    with pytest.raises(ImportFailure) as caught:
        import_network(path, ["x: f32[N, 6]"], loss="mse_loss", fallback=False)
    assert "not SequenceAt" in caught.value.format()


# ---------------------------------------------------------------- the aten fallback


class Fallbacks(nn.Module):
    """Ops only an ATen overload computes: exp, cumsum, an L2 norm, pow, max, logsumexp."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)  # [N, 3, 4]
        e = torch.cumsum(torch.exp(h), 2)
        n = torch.linalg.vector_norm(e, 2, [2], True)  # [N, 3, 1]
        p = torch.maximum(h.pow(2.0), torch.sqrt(torch.abs(x)))
        return p / n + torch.logsumexp(h, [1], True)


def _fallback_graph(module: nn.Module) -> tuple[list, list]:
    nodes = [
        make("Transpose", ["fc.weight"], ["wt"], perm=[1, 0]),
        make("MatMul", ["x", "wt"], ["mm"]),
        make("Add", ["mm", "fc.bias"], ["h"]),
        make("Exp", ["h"], ["e0"]),
        make("CumSum", ["e0", "two"], ["e"]),
        make("ReduceL2", ["e", "axes2"], ["n"]),
        make("Pow", ["h", "power"], ["sq"]),
        make("Abs", ["x"], ["ax"]),
        make("Sqrt", ["ax"], ["rt"]),
        make("Max", ["sq", "rt"], ["p"]),
        make("Div", ["p", "n"], ["q"]),
        make("ReduceLogSumExp", ["h", "axes1"], ["l"]),
        make("Add", ["q", "l"], ["y"]),
    ]
    consts = [
        _ints("two", 2),
        _ints("axes2", [2]),
        _ints("axes1", [1]),
        onnx.numpy_helper.from_array(np.array(2.0, np.float32), "power"),
    ]
    return nodes, _weights(module) + consts


def test_onnx_ops_with_an_aten_twin_run_as_aten_statements(tmp_path):
    """Exp, CumSum, ReduceL2, Pow, Abs, Sqrt, Max and ReduceLogSumExp become ``aten``
    statements (each named in an ``opaque:`` note), exact in value and gradient."""
    torch.manual_seed(0)
    module = Fallbacks()
    nodes, inits = _fallback_graph(module)
    io = [_tensor("x", ["N", 3, 4])], [_tensor("y", ["N", 3, 4])]
    model, path = _save(nodes, inits, *io, tmp_path)
    imported = import_network(path, ["x: f32[N, 3, 4]"], loss="mse_loss")
    text = imported.text
    for call in (
        'op="aten.cumsum.default", call="t0, 2"',
        'op="aten.linalg_vector_norm.default", call="t0, 2, [2], True"',
        'op="aten.pow.Tensor_Scalar", call="t0, 2.0"',
        'op="aten.maximum.default", call="t0, t1"',
        'op="aten.logsumexp.default", call="t0, [1], True"',
    ):
        assert call in text, text
    opaque = [n for n in imported.model.notes if n.startswith("opaque: ")]
    assert len(opaque) == 8 and "onnx::CumSum" in " ".join(opaque), opaque
    _verifies(text, module, model, path, tmp_path, (3, 4))


def test_no_fallback_lists_the_ops_instead(tmp_path):
    """``fallback=False`` (``--no-fallback``) leaves every such op unmapped, all listed."""
    torch.manual_seed(0)
    nodes, inits = _fallback_graph(Fallbacks())
    io = [_tensor("x", ["N", 3, 4])], [_tensor("y", ["N", 3, 4])]
    _, path = _save(nodes, inits, *io, tmp_path)
    with pytest.raises(ImportFailure) as caught:
        import_network(path, ["x: f32[N, 3, 4]"], loss="mse_loss", fallback=False)
    listed = caught.value.format()
    for op in ("Exp", "Pow", "Abs", "Max", "ReduceLogSumExp"):
        assert f"onnx::{op}" in listed, listed


@pytest.mark.parametrize(
    "node, reason",
    [
        (make("CumSum", ["x", "zero"], ["y"]), "the batch dim"),
        (make("CumSum", ["x", "one"], ["y"], reverse=1), "exclusive or reversed"),
        (make("ReduceL2", ["x", "zero"], ["y"]), "over the batch dim"),
    ],
)
def test_fallbacks_that_would_not_be_exact_are_refused(node, reason, tmp_path):
    inits = [_ints("zero", [0]) if node.op_type == "ReduceL2" else _ints("zero", 0)]
    inits.append(_ints("one", 1))
    _, path = _save([node], inits, [_tensor("x", ["N", 6])], [_tensor("y", None)], tmp_path)
    with pytest.raises(ImportFailure) as caught:
        import_network(path, ["x: f32[N, 6]"], loss="mse_loss")
    assert reason in caught.value.format()


# ---------------------------------------------------------------- nn.MultiheadAttention


class CrossAttention(nn.Module):
    """Queries from x [N, 4, 8], keys and values from a memory m [N, 5, 8] (or keys from m
    and values from v), optionally with attention dropout; self-attention without m."""

    def __init__(self, mode: str = "cross", dropout: float = 0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dropout=dropout, batch_first=True)
        self.fc = nn.Linear(8, 3)
        self.mode = mode

    def forward(self, x, m, v):
        key, value = {"cross": (m, m), "kv": (m, v), "self": (x, x)}[self.mode]
        out = self.attn(x, key, value, need_weights=False)[0]
        return self.fc(out + m.mean(1, keepdim=True) + v.mean(1, keepdim=True))


MHA_INPUTS = ["x: f32[N, 4, 8]", "m: f32[N, 5, 8]", "v: f32[N, 5, 8]"]


@pytest.mark.parametrize(
    "mode, dropout",
    [("cross", 0.0), ("kv", 0.0), ("cross", 0.25), ("self", 0.25)],
    ids=["cross", "key_and_value_apart", "cross_dropout", "self_dropout"],
)
def test_multihead_attention_cross_or_with_dropout_verifies_exactly(mode, dropout):
    """Cross-attention or attention dropout, which the registry's ``multihead_attention``
    (self-attention, no dropout kernel) cannot say: the statements torch's forward runs
    (packed in-projection, heads, ``scaled_dot_product_attention`` with the dropout,
    ``out_proj``), checked by verify in float64 with seeded dropout masks."""
    from unroller.analysis.verify import verify_text

    def factory():
        torch.manual_seed(0)
        return CrossAttention(mode, dropout)

    text = import_network(
        "gaps:CrossAttention", MHA_INPUTS, "y: f32[N, 4, 3]", "mse_loss", built=factory()
    ).text
    assert "attn.in_proj_weight = parameter(shape=(24, 8))" in text, text
    assert "attn.out_proj = linear(" in text, text
    assert ("dropout=0.25" in text) == bool(dropout), text
    report = verify_text(text, factory, None, batch_size=3)
    assert report.ok, report.problems or report.table()


def test_self_attention_without_dropout_stays_one_statement():
    torch.manual_seed(0)
    text = import_network(
        "gaps:CrossAttention",
        MHA_INPUTS,
        "y: f32[N, 4, 3]",
        "mse_loss",
        built=CrossAttention("self"),
    ).text
    assert "attn = multihead_attention(x, num_heads=2)" in text, text
