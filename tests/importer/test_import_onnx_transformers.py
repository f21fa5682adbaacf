"""``unroll import`` of ONNX transformers: export -> import -> generate -> verify exactly.

Tiny Hugging Face models (``BertForSequenceClassification``, ``ViTForImageClassification``)
are exported in eval mode with the dynamo exporter (``optimize=False``, a symbolic batch),
imported from the file, and ``unroll verify`` compares the generated module, loaded with the
ORIGINAL module's state dict (strict), against the original in float64: the loss, every
gradient, the eval predictions, to 1e-10 relative. Each model is exported once per module.

The exporter writes LayerNormalization, ``Transpose(W)`` + MatMul + Add of the bias for
every Linear, Gather for embeddings (position and token-type ids are constants built from
sizes), parameters read as data (ViT's class token and position table), and
``scaled_dot_product_attention`` decomposed into about a dozen nodes (q and k scaled by
sqrt(scale), MatMul, the mask added, Softmax, rows of NaN zeroed, MatMul by v); the
importer reads each back as the registry operator the torch importer writes for it.
Hand-built graphs below pin each of these and the refusals.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_grads_close

onnx = pytest.importorskip("onnx")
transformers = pytest.importorskip("transformers")

from unroller.analysis.verify import NOISE_NOTE, verify_text  # noqa: E402
from unroller.api import generate_from_text, import_generated, write_atomic  # noqa: E402
from unroller.compiler.options import Options  # noqa: E402
from unroller.importer.api import import_network  # noqa: E402
from unroller.importer.model import ImportFailure  # noqa: E402
from unroller.importer.onnx_frontend import onnx_state_dict  # noqa: E402

TOLERANCE = 1e-10
TOKENS = "ids: i64[N, 8]"
IMAGE = "x: f32[N, 3, 32, 32]"


# ---------------------------------------------------------------- models and exports


def bert(pad_token_id: int | None = 0) -> torch.nn.Module:
    """A 2-layer BERT classifier (sdpa attention, dropout 0 so eval and train agree)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).train()


def vit() -> torch.nn.Module:
    """A 2-layer ViT classifier on 32x32 images in 8x8 patches (a class token, 17 tokens)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    torch.manual_seed(0)
    return ViTForImageClassification(config).train()


#: name -> (factory, example input, --input)
MODELS = {
    "bert": (bert, lambda: torch.randint(1, 64, (2, 8)), TOKENS),
    "vit": (vit, lambda: torch.randn(2, 3, 32, 32), IMAGE),
}


def export(module: torch.nn.Module, example: torch.Tensor, path: Path, dynamo: bool = True):
    """The module exported in eval mode, quietly, batch symbolic; train mode again after."""
    if dynamo:
        options = {"dynamo": True, "optimize": False}
        options["dynamic_shapes"] = ({0: torch.export.Dim("N")},)
    else:
        options = {"dynamo": False, "do_constant_folding": False, "input_names": ["ids"]}
        options["dynamic_axes"] = {"ids": {0: "N"}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (example,), str(path), **options)
    module.train()
    return path


class _Exports(dict):
    """name -> (original module, its ONNX file), exported on first use."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __missing__(self, name: str):
        factory, example, _ = MODELS[name]
        module = factory()
        self[name] = (module, export(module, example(), self.folder / f"{name}.onnx"))
        return self[name]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _Exports(tmp_path_factory.mktemp("onnx_transformers"))


def imported_text(name: str, exported) -> str:
    _, path = exported[name]
    return import_network(str(path), [MODELS[name][2]]).text


def assert_verifies(text: str, module: torch.nn.Module) -> float:
    """``unroll verify``'s float64 check; the largest relative error."""
    report = verify_text(text, module)
    assert report.ok, report.render()
    assert not report.problems, report.problems
    # zero in exact arithmetic (the key projection's bias under softmax): judged, as verify
    # judges it, against the step's largest gradient; every other row relatively
    noise = [row.name for row in report.rows if row.note.startswith(NOISE_NOTE)]
    assert all(name.endswith("attention.self.key.bias") for name in noise), noise
    worst = max(row.rel for row in report.rows if not row.note.startswith(NOISE_NOTE))
    assert worst <= TOLERANCE
    return worst


# ---------------------------------------------------------------- exact imports


def test_bert_from_onnx_verifies_exactly(exported):
    module, path = exported["bert"]
    text = imported_text("bert", exported)
    assert "block bert_layer(x) {" in text
    assert "attention.self.query = linear(x, out_features=32)" in text
    assert (
        "attention.self.scaled_dot_product_attention = scaled_dot_product_attention("
        "attention.self.transpose, attention.self.transpose_1, attention.self.transpose_2, "
        "scale=0.25)" in text
    )
    assert "layernorm(attention.output.add, normalized_shape=32, eps=1e-12)" in text
    assert "embedding(ids, num_embeddings=64, embedding_dim=32, padding_idx=0)" in text
    assert "bert.embeddings.position_embeddings = embedding_rows(" in text
    assert "length=8)" in text
    assert "bert.embeddings.token_type_embeddings = embedding_rows(" in text
    assert_verifies(text, module)
    state = onnx_state_dict(path)
    assert set(state) == set(module.state_dict())
    for key, value in module.state_dict().items():
        assert torch.equal(state[key], value), key


def test_vit_from_onnx_verifies_exactly(exported):
    module, _ = exported["vit"]
    text = imported_text("vit", exported)
    assert "vit.embeddings.cls_token = parameter(shape=(1, 1, 32))" in text
    assert "expand(vit.embeddings.cls_token, size=(N, -1, -1))" in text
    assert "vit.embeddings.position_embeddings = parameter(shape=(1, 17, 32))" in text
    assert "add(vit.embeddings.cat, vit.embeddings.position_embeddings)" in text
    assert "scaled_dot_product_attention(" in text and "block vi_t_layer(x) {" in text
    assert_verifies(text, module)


def test_parameters_read_as_data_train(exported):
    """The class token and position table are trainable parameters of the generated
    module (named by their initializers), with the original's gradients."""
    module, _ = exported["vit"]
    text = imported_text("vit", exported)
    report = verify_text(text, module)
    names = {row.name for row in report.rows}
    for key in ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings"):
        assert f"grad {key}" in names, sorted(names)
    assert report.ok


@pytest.mark.parametrize("name", list(MODELS))
def test_quant_generation_runs(name, exported, tmp_path):
    """The compressed generation (``--scheme quant``) of the imported text trains: the
    forward loss is the original's, every parameter gets a finite gradient within the
    scheme's error of the original's."""
    module, _ = exported[name]
    text = imported_text(name, exported)
    source = generate_from_text(text, Options(scheme="quant"))
    path = write_atomic(tmp_path / f"{name}_quant.py", source)
    model = import_generated(path, f"onnx_transformers_quant_{name}").Model()
    model.load_state_dict(module.state_dict(), strict=True)
    torch.manual_seed(3)
    x = MODELS[name][1]()
    y = torch.randint(0, 3, (2,))
    loss = model(x, y)
    reference = module.float()
    logits = reference(x).logits
    want = torch.nn.functional.cross_entropy(logits, y)
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) <= 1e-5 * max(
        1.0, abs(float(want.detach()))
    )
    for key, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), key
    try:  # each parameter (measured: bert at most 0.076, vit 0.20 on a layer norm's weight);
        # the key biases' gradients are zero in exact arithmetic (softmax ignores a shift of
        # a query's scores), float32 noise in both, so judged against the largest gradient
        errors = assert_grads_close(model, reference, 0.5, floor=1e-3)
    finally:
        reference.zero_grad()
    assert max(errors.values()) > 0  # compressed: not the exact gradient


def test_torchscript_export_of_bert_imports_and_verifies(tmp_path):
    """The TorchScript exporter records no ATen calls: the embedding's padding_idx is not in
    the file (said in a note; a BERT without a padding token verifies exactly), the
    attention is its own MatMul/Softmax nodes, the mask that masks nothing a zero tensor."""
    module = bert(pad_token_id=None)
    path = export(module, torch.randint(0, 64, (2, 8)), tmp_path / "ts.onnx", dynamo=False)
    text = import_network(str(path), [TOKENS]).text
    assert "padding_idx is not in ONNX files" in text
    assert "softmax(" in text and "embedding_rows(" in text
    assert_verifies(text, module)


# ---------------------------------------------------------------- hand-built units


def _model(nodes, inits, inputs, outputs, opset: int = 18):
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def _tensor(name: str, shape, elem: int = onnx.TensorProto.FLOAT):
    return onnx.helper.make_tensor_value_info(name, elem, shape)


def _init(name: str, value) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(value), name)


def _random(name: str, shape: tuple, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return _init(name, rng.standard_normal(shape).astype(np.float32))


def _record(node, text: str):
    """The dynamo exporter's record of the ATen call on a node."""
    prop = node.metadata_props.add()
    prop.key, prop.value = "pkg.torch.onnx.fx_node", text
    return node


def _save(model, folder: Path, name: str = "case.onnx") -> str:
    path = folder / name
    onnx.save(model, str(path))
    return str(path)


def _generated(text: str, folder: Path, name: str):
    source = generate_from_text(text, Options(platform="gpu", scheme="nocompress"))
    path = write_atomic(folder / f"{name}_generated.py", source)
    return import_generated(path, f"onnx_transformers_{name}_{abs(hash(str(path)))}").Model


def _matches_reference(model, text: str, path: str, folder: Path, feeds: dict) -> None:
    """The generated module (the file's weights, strict) predicts what onnx.reference
    computes from the file."""
    generated = _generated(text, folder, Path(path).stem)().double()
    generated.load_state_dict(onnx_state_dict(path), strict=True)
    want = onnx.reference.ReferenceEvaluator(model).run(None, feeds)[0]
    args = [torch.from_numpy(v).double() for v in feeds.values()]
    got = generated.predict(*args).detach().numpy()
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_layer_normalization_units(tmp_path):
    """LayerNormalization with the module's weight and bias (eps read back as written),
    over two trailing dims, and with the constants 1 (no bias): the affine-free form."""
    make = onnx.helper.make_node
    nodes = [
        make("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["a"], epsilon=1e-6),
        make("LayerNormalization", ["a", "ln2.weight", "ln2.bias"], ["b"], axis=-2),
        make("Constant", [], ["ones"], value=_init("", np.ones(6, np.float32))),
        make("LayerNormalization", ["b", "ones"], ["y"]),
    ]
    inits = [
        _random("ln.weight", (6,), 1),
        _random("ln.bias", (6,), 2),
        _random("ln2.weight", (4, 6), 3),
        _random("ln2.bias", (4, 6), 4),
    ]
    model = _model(nodes, inits, [_tensor("x", ["N", 4, 6])], [_tensor("y", ["N", 4, 6])])
    path = _save(model, tmp_path)
    imported = import_network(path, ["x: f32[N, 4, 6]"], loss="mse_loss")
    text = imported.text
    assert "ln = layernorm(x, normalized_shape=6, eps=1e-06)" in text, text
    assert "ln2 = layernorm(ln, normalized_shape=(4, 6))" in text, text
    assert "layernorm(ln2, normalized_shape=6, elementwise_affine=false)" in text, text
    assert set(imported.state) == {"ln.weight", "ln.bias", "ln2.weight", "ln2.bias"}
    x = np.random.default_rng(5).standard_normal((3, 4, 6)).astype(np.float32)
    _matches_reference(model, text, path, tmp_path, {"x": x})


def test_matmul_add_initializer_is_a_linear_with_a_trainable_bias(tmp_path):
    """``Transpose(W)``, MatMul, Add of the bias initializer on a [N, L, E] input: one
    ``linear`` whose bias is a parameter named by its initializer (it gets a gradient)."""
    make = onnx.helper.make_node
    nodes = [
        make("Transpose", ["proj.weight"], ["wt"], perm=[1, 0]),
        make("MatMul", ["x", "wt"], ["mm"]),
        make("Add", ["mm", "proj.bias"], ["y"]),
    ]
    inits = [_random("proj.weight", (5, 6), 1), _random("proj.bias", (5,), 2)]
    model = _model(nodes, inits, [_tensor("x", ["N", 4, 6])], [_tensor("y", ["N", 4, 5])])
    path = _save(model, tmp_path)
    text = import_network(path, ["x: f32[N, 4, 6]"], loss="mse_loss").text
    assert "proj = linear(x, out_features=5)" in text, text
    state = onnx_state_dict(path)
    assert torch.equal(
        state["proj.bias"], torch.from_numpy(np.array(onnx.numpy_helper.to_array(inits[1])))
    )
    generated = _generated(text, tmp_path, "linear")().double()
    generated.load_state_dict(state, strict=True)
    assert "proj.bias" in dict(generated.named_parameters())
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    generated(x, torch.randn(2, 4, 5, dtype=torch.float64))
    assert generated.proj.bias.grad is not None and generated.proj.bias.grad.abs().sum() > 0
    x32 = np.random.default_rng(6).standard_normal((3, 4, 6)).astype(np.float32)
    _matches_reference(model, text, path, tmp_path, {"x": x32})


SDPA = (
    "%sdpa : [num_users=1] = call_function[target=torch.ops.aten.scaled_dot_product_attention"
    ".default](args = (%q, %k, %v, %mask), kwargs = {scale: 0.5})"
)


def _attention_graph(mask: np.ndarray):
    """The dynamo exporter's decomposition of sdpa(q, k, v, mask, scale=0.5), recorded."""
    make = onnx.helper.make_node
    nodes = [
        make("Sqrt", ["s"], ["root"]),
        make("Mul", ["q", "root"], ["qs"]),
        make("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        make("Mul", ["kt", "root"], ["ks"]),
        make("MatMul", ["qs", "ks"], ["scores"]),
        make("Add", ["scores", "mask"], ["masked"]),
        make("Softmax", ["masked"], ["p"], axis=-1),
        make("IsNaN", ["p"], ["nan"]),
        make("Where", ["nan", "zero", "p"], ["p0"]),
        make("MatMul", ["p0", "v"], ["y"]),
    ]
    for node in nodes:
        _record(node, SDPA)
    inits = [
        _init("s", np.array(0.5, np.float32)),
        _init("zero", np.array(0.0, np.float32)),
        _init("mask", mask.astype(np.float32)),
    ]
    shape = ["N", 2, 4, 8]
    inputs = [_tensor(n, shape) for n in ("q", "k", "v")]
    return _model(nodes, inits, inputs, [_tensor("y", shape)])


ATTENTION_INPUTS = ["q: f32[N, 2, 4, 8]", "k: f32[N, 2, 4, 8]", "v: f32[N, 2, 4, 8]"]


@pytest.mark.parametrize(
    "mask, want",
    [
        (np.zeros((1, 1, 4, 4)), "scaled_dot_product_attention(q, k, v, scale=0.5)"),
        (
            np.triu(np.full((4, 4), -np.inf), 1),
            "scaled_dot_product_attention(q, k, v, is_causal=true, scale=0.5)",
        ),
    ],
    ids=["no-mask", "causal"],
)
def test_decomposed_attention_is_one_statement(tmp_path, mask, want):
    model = _attention_graph(mask)
    path = _save(model, tmp_path)
    text = import_network(path, ATTENTION_INPUTS, loss="mse_loss").text
    assert want in text, text
    assert "matmul" not in text.replace("scaled_dot_product_attention", "")
    rng = np.random.default_rng(7)
    feeds = {n: rng.standard_normal((3, 2, 4, 8)).astype(np.float32) for n in "qkv"}
    _matches_reference(model, text, path, tmp_path, feeds)


# ---------------------------------------------------------------- refusals


def test_attention_mask_that_masks_tokens_is_refused(tmp_path):
    mask = np.zeros((1, 1, 4, 4))
    mask[..., 1] = -np.inf  # a padding mask: token 1 hidden from every query
    path = _save(_attention_graph(mask), tmp_path)
    with pytest.raises(ImportFailure) as caught:
        import_network(path, ATTENTION_INPUTS, loss="mse_loss")
    text = caught.value.format()
    assert "aten.scaled_dot_product_attention.default as exported" in text
    assert "masks more than the causal mask" in text


def _refused(tmp_path, nodes, inits, spec: str = "x: f32[N, 4, 6]", out=None) -> str:
    shape = ["N", *[int(d) for d in spec.split("[N, ")[1].rstrip("]").split(", ")]]
    model = _model(nodes, inits, [_tensor("x", shape)], [_tensor("y", out)])
    path = _save(model, tmp_path)
    with pytest.raises(ImportFailure) as caught:
        import_network(path, [spec], loss="mse_loss")
    return caught.value.format()


def test_matmul_by_a_raw_weight_is_refused(tmp_path):
    """A weight stored [in, out] (an optimizer folded the transpose) is not the Linear's
    [out, in] weight: refused, bias and all."""
    make = onnx.helper.make_node
    nodes = [make("MatMul", ["x", "proj.weight"], ["mm"]), make("Add", ["mm", "proj.bias"], ["y"])]
    inits = [_random("proj.weight", (6, 5)), _random("proj.bias", (5,))]
    text = _refused(tmp_path, nodes, inits)
    assert "not Transpose(W) of a module's weight" in text


ADD = (
    "%add : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor]"
    "(args = (%x, %{}_pos), kwargs = {{}})"
)


def test_parameter_and_buffer_operands(tmp_path):
    """The exporter's record says which initializer is a parameter: a parameter added with
    a broadcast that keeps the data's shape is mapped; one that would stretch the data,
    and a buffer (no trainable state to give it), are refused."""
    make = onnx.helper.make_node
    add = make("Add", ["x", "pos"], ["y"])
    _record(add, ADD.format("p"))
    model = _model(
        [add], [_random("pos", (1, 4, 6))], [_tensor("x", ["N", 4, 6])], [_tensor("y", None)]
    )
    path = _save(model, tmp_path, "param.onnx")
    text = import_network(path, ["x: f32[N, 4, 6]"], loss="mse_loss").text
    assert "pos = parameter(shape=(1, 4, 6))" in text and "add = add(x, pos)" in text, text

    stretch = make("Add", ["x", "pos"], ["y"])
    _record(stretch, ADD.format("p"))
    reason = _refused(tmp_path, [stretch], [_random("pos", (3, 6))], "x: f32[N, 1, 6]")
    assert "does not keep [N, 1, 6]" in reason, reason

    buffer = make("Add", ["x", "pos"], ["y"])
    _record(buffer, ADD.format("b"))
    reason = _refused(tmp_path, [buffer], [_random("pos", (1, 4, 6))])
    assert "no registry operator takes a constant operand" in reason, reason


def test_embedding_rows_that_are_not_a_range_are_refused(tmp_path):
    make = onnx.helper.make_node
    nodes = [
        make("Gather", ["emb.weight", "ids"], ["rows"]),
        make("Add", ["x", "rows"], ["y"]),
    ]
    inits = [_random("emb.weight", (10, 6)), _init("ids", np.array([[0, 2, 1, 3]], np.int64))]
    reason = _refused(tmp_path, nodes, inits)
    assert "not a contiguous range" in reason, reason


def test_layer_norm_with_a_computed_scale_is_refused(tmp_path):
    make = onnx.helper.make_node
    nodes = [
        make("Constant", [], ["twos"], value=_init("", np.full(6, 2, np.float32))),
        make("LayerNormalization", ["x", "twos"], ["y"]),
    ]
    reason = _refused(tmp_path, nodes, [])
    assert "computed constant other than 1" in reason, reason
