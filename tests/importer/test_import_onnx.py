"""``unroll import`` of ONNX files: export -> import -> generate -> one exact training step.

Small torchvision-style CNNs written here (a ResNet with BasicBlocks and a projected shortcut,
a VGG with batch norm, a MobileNetV2 with ReLU6 and depthwise convs, a U-Net with bilinear and
nearest upsampling and a skip concatenation) are exported with the dynamo exporter, imported
from the file, and the generated gpu module, loaded with the ORIGINAL module's state dict
(strict=True), must make the same float64 training step as torch autograd on the original:
the loss, every gradient and the running statistics afterwards, to 1e-10 relative.

Export settings: ``torch.onnx.export(model.eval(), (x,), path, dynamo=True, optimize=False,
dynamic_shapes=...)``. ``dynamo=True`` keeps the state-dict names of the initializers and
writes each node's module path and class (the TorchScript exporter keeps names only with
``do_constant_folding=False``, and no classes). ``optimize=False`` because the default
optimizer folds every BatchNorm of an eval-mode module into the conv before it, which leaves
nothing to train (the importer refuses such a file and says so; tested below).

The same networks from ``tests/import_zoo.py`` (ResNet-18, VGG-11-BN, MobileNetV2, U-Net) run
too: VGG-11-BN (its 1x1 -> 7x7 adaptive pool is a GatherND chain in the file) always,
ResNet-18, MobileNetV2 and U-Net (5-15 s each to export) with SLOW=1.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
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


def _load_zoo():
    """tests/import_zoo.py by path (None without it: the networks below stand on their own)."""
    path = Path(__file__).parents[1] / "import_zoo.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("onnx_tests_import_zoo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


import_zoo = _load_zoo()

TOLERANCE = 1e-10
IMAGE = "x: f32[N, 3, 32, 32]"


# ---------------------------------------------------------------- networks


def conv_bn(cin: int, cout: int, stride: int = 1, groups: int = 1, kernel: int = 3):
    pad = (kernel - 1) // 2
    return [
        nn.Conv2d(cin, cout, kernel, stride, pad, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: one ReLU module called twice, an in-place shortcut add."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = conv_bn(cin, cout, stride)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = conv_bn(cout, cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(*conv_bn(cin, cout, stride, kernel=1))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetish(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = conv_bn(3, 8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.avgpool(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(x, 1))


class VGGish(nn.Module):
    """VGG with batch norm: a flat ``features`` Sequential, an adaptive pool from 2x2 to 3x3
    (which the exporter decomposes into a GatherND chain, read back as one statement), a classifier with dropout (p=0: an
    eval-mode export drops it, so the step comparison needs none)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in (8, "M", 16, "M", 16, "M", 16, "M"):
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((3, 3))
        self.classifier = nn.Sequential(
            nn.Linear(16 * 3 * 3, 32), nn.ReLU(True), nn.Dropout(0.0), nn.Linear(32, classes)
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(nn.Sequential(*conv_bn(cin, hidden, kernel=1), nn.ReLU6(inplace=True)))
        layers += [
            nn.Sequential(*conv_bn(hidden, hidden, stride, groups=hidden), nn.ReLU6(inplace=True)),
            *conv_bn(hidden, cout, kernel=1),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetish(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(*conv_bn(3, 8, 2), nn.ReLU6(inplace=True)),
            InvertedResidual(8, 8, 1, 1),
            InvertedResidual(8, 12, 2, 4),
            InvertedResidual(12, 12, 1, 4),
            InvertedResidual(12, 12, 1, 4),
            nn.Sequential(*conv_bn(12, 32, kernel=1), nn.ReLU6(inplace=True)),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(32, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        layers = [*conv_bn(cin, cout), nn.ReLU(True), *conv_bn(cout, cout), nn.ReLU(True)]
        self.double_conv = nn.Sequential(*layers)

    def forward(self, x):
        return self.double_conv(x)


class Up(nn.Module):
    """Upsample, pad to the skip's size (by 0 here), concatenate [skip, up], DoubleConv."""

    def __init__(self, cin: int, cout: int, mode: str):
        super().__init__()
        corners = {"align_corners": True} if mode == "bilinear" else {}
        self.up = nn.Upsample(scale_factor=2, mode=mode, **corners)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x, skip):
        x = self.up(x)
        dy, dx = skip.size(2) - x.size(2), skip.size(3) - x.size(3)
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], dim=1))


class UNetish(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.inc = DoubleConv(3, 8)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(8, 16))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(16, 16))
        self.up1 = Up(32, 8, "bilinear")
        self.up2 = Up(16, 8, "nearest")
        self.outc = nn.Conv2d(8, classes, 1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        return self.outc(self.up2(self.up1(x3, x2), x1))


#: name -> (factory, --target or None, blocks the text must define)
NETS = {
    "resnet": (ResNetish, None, ["basic_block"]),
    "vgg": (VGGish, None, []),
    "mobilenet": (MobileNetish, None, ["inverted_residual"]),
    "unet": (UNetish, "y: i64[N, 32, 32]", ["double_conv"]),
}


# ---------------------------------------------------------------- helpers


def export(module: nn.Module, path: Path, dynamic: bool = True, **options) -> Path:
    """The module exported in eval mode (quietly: the exporter prints progress)."""
    x = torch.randn(2, 3, 32, 32)
    shapes = ({0: torch.export.Dim("N")},) if dynamic else None
    options = {"dynamo": True, "optimize": False, **options}
    if options["dynamo"]:
        options["dynamic_shapes"] = shapes
    else:
        options.setdefault("input_names", ["x"])
        options["dynamic_axes"] = {"x": {0: "N"}} if dynamic else None
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (x,), str(path), **options)
    module.train()
    return path


def build(factory, seed: int = 0) -> nn.Module:
    """A network with non-trivial batch norm state (so that every tensor is checked)."""
    torch.manual_seed(seed)
    module = factory()
    for sub in module.modules():
        if isinstance(sub, nn.BatchNorm2d):
            with torch.no_grad():
                sub.weight.uniform_(0.5, 1.5)
                sub.bias.uniform_(-0.2, 0.2)
                sub.running_mean.uniform_(-0.1, 0.1)
                sub.running_var.uniform_(0.5, 1.5)
    return module.train()


def generated_model(text: str, folder: Path, name: str):
    source = generate_from_text(text, Options(platform="gpu", scheme="nocompress"))
    path = write_atomic(folder / f"{name}_generated.py", source)
    return import_generated(path, f"onnx_import_{name}_{abs(hash(str(path)))}").Model


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() if want.numel() else 0.0
    return (got - want).abs().max().item() / max(scale, 1e-300) if want.numel() else 0.0


def step_matches(original: nn.Module, model_class, target: str | None) -> None:
    """One float64 training step of the generated module (loaded with the original's
    state dict, strict) against torch autograd on the original: loss, gradients, buffers."""
    reference = original.double().train()
    generated = model_class().double().train()
    generated.load_state_dict(reference.state_dict(), strict=True)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 4, (2, 32, 32)) if target else torch.randint(0, 10, (2,))
    loss = generated(x, y)
    want = F.cross_entropy(reference(x), y)
    want.backward()
    assert relative(loss.detach(), want.detach()) <= TOLERANCE
    grads = dict(generated.named_parameters())
    for key, param in reference.named_parameters():
        assert grads[key].grad is not None, key
        assert relative(grads[key].grad, param.grad) <= TOLERANCE, key
    buffers = dict(generated.named_buffers())
    for key, buffer in reference.named_buffers():
        assert relative(buffers[key].double(), buffer.double()) <= TOLERANCE, key


class _Exports(dict):
    """name -> (original module, its ONNX file), each network exported on first use (an
    xdist worker exports only the networks its tests read)."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, name):
        module = build(NETS[name][0])
        self[name] = (module, export(module, self.folder / f"{name}.onnx"))
        return self[name]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (original module, its ONNX file): each network exported once, lazily."""
    return _Exports(tmp_path_factory.mktemp("onnx"))


# ---------------------------------------------------------------- exact imports


# one network in the fast suite (the zoo CNNs follow it through test_zoo_network_from_onnx)
@pytest.mark.parametrize(
    "name", [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(NETS)]
)
def test_exported_cnn_trains_exactly_like_the_original(name, exported, tmp_path):
    module, path = exported[name]
    _, target, blocks = NETS[name]
    imported = import_network(str(path), [IMAGE], target)
    for block in blocks:
        assert f"block {block}(" in imported.text, imported.text
    model_class = generated_model(imported.text, tmp_path, name)
    step_matches(build(NETS[name][0]), model_class, target)


def test_statement_names_and_comments_follow_the_module_tree(exported):
    text = import_network(str(exported["resnet"][1]), [IMAGE]).text
    assert "conv1 = conv2d(x, out_channels=8, kernel_size=3, padding=1, bias=false)" in text
    assert "layer2.0.downsample.0 = conv2d(layer1.1, out_channels=16, kernel_size=1" in text
    assert "layer1.0 = basic_block(maxpool, out_channels=8)  # BasicBlock [N, 8, 16, 16]" in text
    assert "avgpool = adaptive_avgpool2d(layer2.1, output_size=1)  # AdaptiveAvgPool2d" in text
    assert "fc = linear(view, out_features=10)  # Linear [N, 10]" in text
    assert f"# {__name__}.BasicBlock: 3 instances" in text
    assert "# read from ONNX (opset" in text
    vgg = import_network(str(exported["vgg"][1]), [IMAGE]).text
    assert "classifier.2 (Dropout) was exported as an identity" in vgg


def test_momentum_and_eps_read_back_as_torch_wrote_them(exported):
    imported = import_network(str(exported["vgg"][1]), [IMAGE])
    norms = [s for s in imported.model.stmts if s.op == "batchnorm2d"]
    assert norms and all(s.kwargs["momentum"] == 0.1 for s in norms)
    assert all(s.kwargs["eps"] == 1e-5 for s in norms)


def test_state_dict_from_the_file_is_the_originals(exported, tmp_path):
    module, path = exported["mobilenet"]
    state = onnx_state_dict(path)
    original = module.state_dict()
    assert set(state) == set(original)
    for key, value in original.items():
        if key.endswith("num_batches_tracked"):
            assert state[key].dtype == torch.int64 and state[key].shape == ()
            continue
        assert torch.equal(state[key], value), key
    imported = import_network(str(path), [IMAGE])
    assert {k: tuple(v.shape) for k, v in state.items()} == imported.state
    model = generated_model(imported.text, tmp_path, "mobilenet_weights")()
    model.load_state_dict(state, strict=True)


@pytest.mark.slow
def test_fixed_batch_export_imports_as_the_dynamic_one(exported, tmp_path):
    module, path = exported["resnet"]
    fixed = export(build(ResNetish), tmp_path / "fixed.onnx", dynamic=False)
    text = import_network(str(fixed), [IMAGE], name="net").text
    assert "# the file fixes the batch at 2: read as N" in text
    dynamic = import_network(str(path), [IMAGE], name="net").text
    strip = lambda t: [line for line in t.splitlines() if not line.startswith("#")]  # noqa: E731
    assert strip(text) == strip(dynamic)


def test_torchscript_export_keeps_names_without_constant_folding(tmp_path):
    """The TorchScript exporter names nodes /layer1/layer1.0/Add and shares equal
    initializers (a fresh network's BatchNorm ones and zeros) through Identity nodes whose
    outputs carry the state-dict keys: each key is still its own tensor."""
    torch.manual_seed(0)
    module = ResNetish().train()
    path = export(
        module,
        tmp_path / "ts.onnx",
        dynamo=False,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.PRESERVE,
    )
    assert any(n.op_type == "Identity" for n in onnx.load(str(path)).graph.node)
    imported = import_network(str(path), [IMAGE])
    assert "layer2.0.downsample.0 = conv2d(" in imported.text
    assert "layer1.0.add = add(layer1.0.bn2, maxpool)" in imported.text
    state = onnx_state_dict(path)
    assert set(state) == set(module.state_dict())
    for key, value in module.state_dict().items():
        if not key.endswith("num_batches_tracked"):
            assert torch.equal(state[key], value), key
    model_class = generated_model(imported.text, tmp_path, "ts")
    model_class().load_state_dict(state, strict=True)
    step_matches(module, model_class, None)


# ---------------------------------------------------------------- refusals


def test_batchnorm_folded_by_an_exporter_is_refused(tmp_path):
    module = build(ResNetish)
    folded = export(module, tmp_path / "folded.onnx", dynamo=False)  # eval mode: BN folded
    with pytest.raises(ImportFailure) as caught:
        import_network(str(folded), [IMAGE])
    text = caught.value.format()
    assert "onnx::Conv_" in text and "do_constant_folding=False" in text
    assert len(caught.value.unmapped) == 10  # every conv, all at once
    assert {u.module_path for u in caught.value.unmapped} >= {"conv1", "layer2.0.downsample.0"}


def _model(nodes, inits, inputs, outputs, opset: int = 18):
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def _tensor(name: str, shape: list, elem: int = onnx.TensorProto.FLOAT):
    return onnx.helper.make_tensor_value_info(name, elem, shape)


def _init(name: str, shape: tuple, seed: int = 0):
    rng = np.random.default_rng(seed)
    return onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def test_every_unmapped_node_is_listed_once_with_name_and_op(tmp_path):
    """Erf, a Gather on data and an LSTM: all three listed; the ops after them are not."""
    make = onnx.helper.make_node
    nodes = [
        make("Conv", ["x", "conv.weight"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        make("Erf", ["c"], ["e"], name="erf_node"),
        make("Relu", ["e"], ["r"], name="after_erf"),
        make("Gather", ["r", "idx"], ["g"], name="gather_node", axis=1),
        make("Reshape", ["g", "shape"], ["seq"], name="to_sequence"),
        make("LSTM", ["seq", "W", "R"], ["h"], name="lstm_node", hidden_size=4),
        make("Relu", ["h"], ["out"], name="after_lstm"),
    ]
    inits = [
        _init("conv.weight", (4, 3, 3, 3)),
        onnx.numpy_helper.from_array(np.array([0, 2], np.int64), "idx"),
        onnx.numpy_helper.from_array(np.array([0, -1, 8], np.int64), "shape"),
        _init("W", (1, 16, 8)),
        _init("R", (1, 16, 4)),
    ]
    model = _model(nodes, inits, [_tensor("x", ["N", 3, 8, 8])], [_tensor("out", None)])
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ImportFailure) as caught:
        import_network(str(path), ["x: f32[N, 3, 8, 8]"], fallback=False)
    unmapped = caught.value.unmapped
    assert [u.op for u in unmapped] == [
        "onnx::Erf (erf_node)",
        "onnx::Gather (gather_node)",
        "onnx::LSTM (lstm_node)",
    ], caught.value.format()
    assert "no registry operator computes Erf" in unmapped[0].reason
    assert "only one index (select) is mapped" in unmapped[1].reason
    assert "no registry operator computes LSTM" in unmapped[2].reason


def test_unsupported_ops_of_an_exported_module_name_their_module_path(tmp_path):
    class Mixer(nn.Module):
        def forward(self, x):
            return torch.cumsum(torch.special.erf(x), dim=1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.mix = Mixer()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            x = self.mix(self.conv(x)).mean(dim=(2, 3))
            return self.fc(x[:, torch.tensor([0, 1, 2, 3])])

    path = export(Net(), tmp_path / "net.onnx")
    with pytest.raises(ImportFailure) as caught:
        import_network(str(path), [IMAGE], fallback=False)
    found = {(u.module_path, u.op.split(" ")[0]) for u in caught.value.unmapped}
    assert ("mix", "onnx::Erf") in found and ("mix", "onnx::CumSum") in found, found
    assert any(op.startswith("onnx::Gather") and path == "" for path, op in found), found
    assert "test_import_onnx.py:" in caught.value.format()  # the source line


@pytest.mark.parametrize(
    "spec, message",
    [
        ("x: f32[N, 3, 64, 64]", r"the ONNX input 'x' is \[N, 3, 32, 32\]"),
        ("x: f32[N, 3, 32]", r"has 4 dims \[N, 3, 32, 32\]"),
        ("x: i64[N, 3, 32, 32]", "the ONNX input 'x' is f32"),
    ],
)
def test_wrong_input_declaration_is_a_clear_error(exported, spec, message):
    with pytest.raises(ImportFailure, match=message) as caught:
        import_network(str(exported["vgg"][1]), [spec])
    assert not caught.value.unmapped


def test_input_count_must_match(exported):
    with pytest.raises(ImportFailure, match=r"takes 1 input\(s\) \('x'\); --input declares 2"):
        import_network(str(exported["vgg"][1]), [IMAGE, "z: f32[N, 3]"])


def test_optimizer_folded_batchnorm_is_refused_with_the_fix(tmp_path):
    make = onnx.helper.make_node
    conv = make("Conv", ["x", "conv.weight"], ["y"], name="fused")
    prop = conv.metadata_props.add()
    prop.key, prop.value = "pkg.onnxscript.rewriter.rule_name", "FuseBatchNormIntoConv"
    model = _model(
        [conv],
        [_init("conv.weight", (4, 3, 1, 1))],
        [_tensor("x", ["N", 3, 4, 4])],
        [_tensor("y", None)],
    )
    path = tmp_path / "fused.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ImportFailure, match="optimize=False"):
        import_network(str(path), ["x: f32[N, 3, 4, 4]"], loss="mse_loss")


@pytest.mark.parametrize(
    "nodes, inits, reason",
    [
        (  # one weight read by two convs
            [("Conv", ["x", "conv.weight"], ["a"], {}), ("Conv", ["a", "conv.weight"], ["y"], {})],
            [("conv.weight", (3, 3, 1, 1))],
            "used by two operators",
        ),
        (  # a weight without a module path
            [("Conv", ["x", "w0"], ["y"], {})],
            [("w0", (3, 3, 1, 1))],
            "names no module's weight",
        ),
        (  # a constant tensor feeding math
            [("Add", ["x", "shift"], ["y"], {})],
            [("shift", (3, 1, 1))],
            "no registry operator takes a constant operand",
        ),
        (  # Gemm (transB=0: the weight stored [in, out]) by a weight of the wrong shape
            [("Flatten", ["x"], ["f"], {}), ("Gemm", ["f", "fc.weight"], ["y"], {})],
            [("fc.weight", (5, 48))],
            "by a weight [5, 48]",
        ),
        (  # resizing modes torch's upsample does not compute
            [("Resize", ["x", "", "scales"], ["y"], {"mode": "cubic"})],
            [("scales", None)],
            "cubic resizing",
        ),
        (
            [("Resize", ["x", "", "scales"], ["y"], {"mode": "nearest"})],
            [("scales", None)],
            "torch's 'nearest' is 'asymmetric' with 'floor'",
        ),
        (  # the batch moved
            [("Transpose", ["x"], ["y"], {"perm": [1, 0, 2, 3]})],
            [],
            "moves the batch dim",
        ),
        (
            [("Pad", ["x", "pads"], ["y"], {"mode": "reflect"})],
            [("pads", "pads")],
            "reflect padding",
        ),
    ],
)
def test_inexact_or_ambiguous_nodes_are_refused(tmp_path, nodes, inits, reason):
    make = onnx.helper.make_node
    graph_nodes = [
        make(op, ins, outs, name=f"n{k}", **attrs) for k, (op, ins, outs, attrs) in enumerate(nodes)
    ]
    tensors = []
    for name, shape in inits:
        if shape is None:
            tensors.append(onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), name))
        elif shape == "pads":
            tensors.append(onnx.numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1]), name))
        else:
            tensors.append(_init(name, shape))
    model = _model(graph_nodes, tensors, [_tensor("x", ["N", 3, 4, 4])], [_tensor("y", None)])
    path = tmp_path / "case.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ImportFailure) as caught:
        import_network(str(path), ["x: f32[N, 3, 4, 4]"], loss="mse_loss")
    assert reason in caught.value.format()


def test_mapped_hand_built_graph_computes_what_onnx_computes(tmp_path):
    """Ops the exported CNNs do not use (ConvTranspose, Slice, Gemm with a named bias,
    MatMul + Add by W^T, Clip, Pad, Softmax, nearest Resize, Sub, a scalar Mul), against
    onnx.reference running the file."""
    make = onnx.helper.make_node
    f32 = np.float32
    consts = {
        "scales": np.array([1, 1, 2, 2], f32),
        "pads": np.array([0, 0, 1, 0, 0, 0, 0, 1], np.int64),
        "lo": np.array(0, f32),
        "hi": np.array(6, f32),
        "half": np.array(0.5, f32),
        "shape": np.array([0, -1], np.int64),
        "starts": np.array([1], np.int64),
        "ends": np.array([8], np.int64),
        "axes": np.array([3], np.int64),
        "steps": np.array([2], np.int64),
    }
    nodes = [
        make("Conv", ["x", "stem.weight", "stem.bias"], ["c"], pads=[1, 1, 1, 1]),
        make("Clip", ["c", "lo", "hi"], ["r6"]),
        make("ConvTranspose", ["r6", "deconv.weight", "deconv.bias"], ["t"], strides=[2, 2]),
        make("Slice", ["t", "starts", "ends", "axes", "steps"], ["sl"]),
        make(
            "Resize",
            ["sl", "", "scales"],
            ["up"],
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
        ),
        make("Pad", ["up", "pads"], ["p"]),
        make("Mul", ["p", "half"], ["m"]),
        make("Sub", ["m", "p"], ["s"]),
        make("Reshape", ["s", "shape"], ["flat"]),
        make("Gemm", ["flat", "fc.weight", "fc.bias"], ["g"], transB=1),
        make("Transpose", ["head.weight"], ["wt"], perm=[1, 0]),
        make("MatMul", ["g", "wt"], ["mm"]),
        make("Add", ["mm", "head.bias"], ["h"]),
        make("Softmax", ["h"], ["y"], axis=-1),
    ]
    inits = [
        _init("stem.weight", (2, 3, 3, 3), 1),
        _init("stem.bias", (2,), 2),
        _init("deconv.weight", (2, 3, 2, 2), 7),
        _init("deconv.bias", (3,), 8),
        _init("fc.weight", (6, 3 * 17 * 9), 3),
        _init("fc.bias", (6,), 4),
        _init("head.weight", (5, 6), 5),
        _init("head.bias", (5,), 6),
    ]
    inits += [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()]
    model = _model(nodes, inits, [_tensor("x", ["N", 3, 4, 4])], [_tensor("y", ["N", 5])])
    path = tmp_path / "ops.onnx"
    onnx.save(model, str(path))
    imported = import_network(str(path), ["x: f32[N, 3, 4, 4]"], loss="mse_loss")
    ops = [s.op for s in imported.model.stmts]
    assert ops == [
        "conv2d",
        "relu6",
        "conv_transpose2d",
        "slice",
        "upsample",
        "pad",
        "scale",
        "sub",
        "reshape",
        "linear",
        "linear",
        "softmax",
        "mse_loss",
    ], ops
    state = onnx_state_dict(path)
    assert set(state) == {
        f"{m}.{p}" for m in ("stem", "deconv", "fc", "head") for p in ("weight", "bias")
    }
    head = onnx.numpy_helper.to_array(next(t for t in inits if t.name == "head.weight"))
    assert torch.equal(state["head.weight"], torch.tensor(head))
    generated = generated_model(imported.text, tmp_path, "ops")().double()
    generated.load_state_dict(state, strict=True)
    x = np.random.default_rng(7).standard_normal((3, 3, 4, 4)).astype(np.float32)
    want = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = generated.predict(torch.from_numpy(x).double()).detach().numpy()
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the zoo


ZOO_CASES = {
    "resnet18": ({}, None, ["basic_block"], True),
    "vgg11_bn": ({"hidden": 64, "dropout": 0.0}, None, [], True),
    "mobilenet_v2": ({"width_mult": 0.5, "dropout": 0.0}, None, ["inverted_residual"], True),
    "unet": ({}, "y: i64[N, 32, 32]", ["down", "up"], True),
}


ZOO_PARAMS = [
    pytest.param(name, marks=[pytest.mark.slow] if slow else [], id=name)
    for name, (_, _, _, slow) in ZOO_CASES.items()
]


@pytest.mark.skipif(import_zoo is None, reason="tests/import_zoo.py is not there")
@pytest.mark.parametrize("name", ZOO_PARAMS)
def test_zoo_network_from_onnx_trains_exactly(name, tmp_path):
    kwargs, target, blocks, _ = ZOO_CASES[name]
    factory = import_zoo.ZOO[name][0]
    torch.manual_seed(0)
    module = factory(**kwargs)
    path = export(module, tmp_path / f"{name}.onnx")
    imported = import_network(str(path), [IMAGE], target)
    for block in blocks:
        assert f"block {block}(" in imported.text, imported.text
    state = onnx_state_dict(path)
    assert set(state) == set(module.state_dict())
    model_class = generated_model(imported.text, tmp_path, name)
    step_matches(module, model_class, target)


def test_cli_weights_writes_a_state_dict_the_imported_module_loads(exported, tmp_path):
    """``unroll weights`` and ``unroll import`` of the same file: the .pt loads with
    strict=True into the generated module and holds the original's tensors."""
    from typer.testing import CliRunner

    from unroller.cli import app

    runner = CliRunner()
    module, path = exported["vgg"]
    text_path, weights = tmp_path / "vgg.txt", tmp_path / "vgg.pt"
    result = runner.invoke(app, ["import", str(path), "--input", IMAGE, "-o", str(text_path)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["weights", str(path), "-o", str(weights)])
    assert result.exit_code == 0, result.output
    again = runner.invoke(app, ["weights", str(path), "-o", str(weights)])
    assert again.exit_code == 2 and "--force" in again.output
    generated = tmp_path / "vgg_gen.py"
    write_atomic(generated, generate_from_text(text_path.read_text()))
    model = import_generated(generated).Model()
    state = torch.load(weights)
    model.load_state_dict(state, strict=True)
    for key, value in module.state_dict().items():
        if not key.endswith("num_batches_tracked"):
            assert torch.equal(model.state_dict()[key].to(value.dtype), value), key
    kwargs = runner.invoke(app, ["import", str(path), "--input", IMAGE, "--kwargs", "{}"])
    assert kwargs.exit_code == 0  # an empty --kwargs is no kwargs
    kwargs = runner.invoke(app, ["import", str(path), "--input", IMAGE, "--kwargs", '{"a": 1}'])
    assert kwargs.exit_code == 2 and "not built by a factory" in kwargs.output
