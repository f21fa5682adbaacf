"""Graph building: shape inference against real kernels, parameters, fan-out, liveness."""

from __future__ import annotations

import math

import pytest
import torch

import unroller.runtime.gpu as K
from unroller.analysis.report import graph_report
from unroller.api import graph_from_text, load_graph
from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.lower import Lowering

# (input shape after N, op call) -- the inferred shape must equal the kernel's output.
CASES = [
    (
        (3, 13, 11),
        "conv2d(x, out_channels=4, kernel_size=(3, 5), stride=(2, 1), padding=(1, 2), dilation=(2, 1))",
    ),
    ((4, 9, 9), "conv2d(x, out_channels=6, kernel_size=3, groups=2, bias=false)"),
    ((4, 9, 9), "conv2d(x, out_channels=4, kernel_size=3, groups=4)"),
    (
        (3, 5, 7),
        "conv_transpose2d(x, out_channels=2, kernel_size=(3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2))",
    ),
    (
        (4, 5, 6),
        "conv_transpose2d(x, out_channels=4, kernel_size=3, stride=2, dilation=2, groups=2, output_padding=1)",
    ),
    ((7,), "linear(x, out_features=3)"),
    ((2, 7), "linear(x, out_features=3, bias=false)"),
    ((3, 6, 6), "batchnorm2d(x, eps=0.001, momentum=0.3)"),
    ((3, 9, 8), "maxpool2d(x, kernel_size=3, stride=2, padding=1)"),
    ((3, 9, 8), "maxpool2d(x, kernel_size=(3, 2), stride=(2, 1))"),
    ((3, 9, 8), "avgpool2d(x, kernel_size=(3, 2), padding=(1, 1))"),
    ((3, 7, 5), "adaptive_avgpool2d(x, output_size=(3, 2))"),
    ((3, 7, 5), "adaptive_avgpool2d(x, output_size=1)"),
    ((3, 4, 5), "upsample(x, scale_factor=2)"),
    ((3, 4, 5), 'upsample(x, scale_factor=1.5, mode="bilinear")'),
    ((3, 4, 5), 'upsample(x, scale_factor=(2, 3), mode="bilinear", align_corners=true)'),
    ((3, 4, 5), "flatten(x)"),
    ((3, 4, 5), "flatten(x, start_dim=2)"),
    ((3, 4, 5), "reshape(x, shape=(5, -1))"),
    ((3, 4, 5), "dropout(x, p=0.25)"),
    ((3, 4, 5), 'gelu(x, approximate="tanh")'),
]


@pytest.mark.parametrize("in_shape, call", CASES)
def test_inferred_shape_equals_kernel_output(in_shape, call):
    dims = ", ".join(map(str, in_shape))
    text = f"""
    model m {{
        input x: f32[N, {dims}]
        y = {call}
        z = flatten(y)
        t = linear(z, out_features=1)
        loss = mse_loss(t, t)
        return loss
    }}"""
    graph = graph_from_text(text, "m.txt")
    node = graph.node("y")
    x = torch.randn(2, *in_shape)
    layer = []
    if node.params or node.buffers:
        spec, env = node.op.module, {**node.args, **node.derived}
        cls = getattr(torch.nn, spec.cls.rsplit(".", 1)[1])
        # the registry's constructor, as generated code calls it
        module = cls(*(env[a] for a in spec.args), **{k: env[k] for k in spec.kwargs})
        state = module.state_dict()
        for p in node.params:
            if p.present:
                assert tuple(p.shape) == tuple(state[p.name].shape), (p.name, p.shape)
            else:
                assert getattr(module, p.name) is None
        layer = [module]
    out = getattr(K, node.op.name)(x, *layer, **node.kernel_kwargs)
    out = out[0] if isinstance(out, tuple) else out
    assert (2, *node.output.type.shape[1:]) == tuple(out.shape)


def test_parameter_counts_match_the_generated_module(build):
    for stem in sorted(REFERENCES):
        graph = load_graph(model_path(stem))
        model = build(model_path(stem)).Model()
        report = graph_report(graph, 4)
        assert report["total_params"] == sum(p.numel() for p in model.parameters()), stem


def test_block_inlining_prefixes_and_fanout():
    graph = load_graph(model_path("tiny_resnet"))
    names = [n.name for n in graph.nodes]
    assert "layer1.0.conv1" in names and "layer1.1.bn2" in names
    r = graph.node("r").output
    # r feeds layer1.0.conv1 and the residual add of layer1.0
    assert {n.name for n, _ in r.consumers} == {"layer1.0.conv1", "layer1.0.s"}
    assert all(a.index < b.index for a, b in zip(graph.nodes, graph.nodes[1:]))
    assert graph.node("layer1.0.conv1").blocks[0].name == "layer1.0"


def test_saved_bytes_are_counted_once_when_shared():
    graph = load_graph(model_path("tiny_resnet"))
    report = graph_report(graph, 8)
    rows = {r["name"]: r for r in report["nodes"]}
    # relu saves its output; the next conv saves the same tensor as its input.
    assert rows["r"]["saved_bytes"] == 8 * 16 * 32 * 32 * 4
    assert rows["layer1.0.conv1"]["new_saved_bytes"] == 0
    assert report["total_saved_bytes"] == sum(r["new_saved_bytes"] for r in report["nodes"])


def test_liveness_releases_each_tensor_after_its_last_use():
    graph = load_graph(model_path("resnet_like"))
    emitter = Lowering(graph)
    steps = emitter.training_steps()
    defined: set[str] = set()
    released: set[str] = set()
    for step in steps:
        for ident, kind in step.events():  # a name written again holds a new value
            if kind == "r":
                assert ident not in released, f"{ident} read after release"
            else:
                released.discard(ident)
                defined.add(ident)
        released.update(step.release)
    # everything except the returned loss (and the inputs) is released
    loss = emitter.var(graph.loss).name
    leftovers = defined - released - {loss}
    assert not leftovers, leftovers


def test_nodes_off_the_loss_path_get_no_backward():
    text = """
    model m {
        input x: f32[N, 4]
        target y: f32[N, 2]
        a = linear(x, out_features=2)
        side = linear(x, out_features=3)
        loss = mse_loss(a, y)
        return loss, side
    }"""
    graph = graph_from_text(text, "m.txt")
    assert graph.node("a").needs_backward and not graph.node("side").needs_backward
    assert not graph.node("a").inputs[0].requires_grad
    assert graph.node("a").needs == (False, True, True)


@pytest.mark.parametrize("batch", [1, 7])
def test_numel_uses_the_batch(batch):
    graph = load_graph(model_path("unet_like"))
    t = graph.nodes[0].output.type
    assert t.numel(batch) == batch * math.prod(t.shape[1:])
