"""Block instances as calls of shared functions (unroller/compiler/outline.py).

What must hold: instances that compile to the same code share one function; instances
that differ (a compressor chosen by name, a pipeline stage boundary inside a block) get
their own variant or stay inline, and every variant computes exactly what autograd does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import rel_err

from unroller.api import generate_from_text, generate_source, load_graph
from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.ir import Step
from unroller.compiler.lower import Lowering
from unroller.compiler.options import Options
from unroller.runtime import ipu_device, poptorch_emulation

ROOT = Path(__file__).resolve().parents[2]


def functions_and_calls(source: str) -> tuple[dict[str, ast.FunctionDef], list[str]]:
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    calls = [
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in functions
    ]
    return functions, calls


def test_resnet34_blocks_share_one_function_per_kind():
    text = (ROOT / "generated/gpu/resnet34/nocompress.py").read_text()
    functions, calls = functions_and_calls(text)
    # 16 instances of two block kinds: a handful of functions, each called per instance
    assert len(functions) <= 9
    assert calls.count("basic_forward") >= 10
    assert sum(c.endswith("_forward") or c.endswith("_forward_v2") for c in calls) == 16
    assert sum("_backward" in c for c in calls) == 16
    assert sum("_predict" in c for c in calls) == 16
    # inside a function, names are the block's own: no instance prefix leaks in
    code = functions["basic_forward"].body[1:]  # after the docstring
    body = "\n".join(ast.unparse(statement) for statement in code)
    assert "layer1" not in body and "L['conv1']" in body


def test_a_rule_by_instance_name_gives_that_instance_its_own_variant(tmp_path):
    config = tmp_path / "one.toml"
    config.write_text('[[rule]]\nname = "layer1.0.*"\ncompressor = "dct"\n')
    model = ROOT / "benchmarks/models/resnet34.txt"
    text = generate_source(model, Options(compress_config=str(config)), label="resnet34.txt")
    functions, calls = functions_and_calls(text)
    tree = ast.parse(text)
    forward = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_step"
    )
    first = next(
        n.func.id
        for n in ast.walk(forward)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and any(isinstance(a, ast.Call) and "layer1.0" in ast.unparse(a) for a in n.args)
    )
    # layer1.0 compresses, its siblings do not: not the same function
    assert "CODEC_DCT" in ast.unparse(functions[first])
    assert calls.count(first) == 1
    assert first != "basic_forward" or calls.count("basic_forward") == 1


def test_run_ends_are_where_the_flat_program_changes_instance():
    graph = load_graph(model_path("resnet_like"))
    steps: list[Step] = Lowering(graph).training_steps()
    forward_runs: list[str] = []
    for step in steps:
        if step.section == "forward" and step.calls:
            name = step.calls[0].name
            if not forward_runs or forward_runs[-1] != name:
                forward_runs.append(name)
    # each instance's forward steps (kernels, stash, raw record) are contiguous
    assert len(forward_runs) == len(set(forward_runs))


def test_an_instance_split_over_two_ipus_stays_inline_and_exact(build):
    """A stage boundary inside a block: that instance is emitted inline, the others are
    calls, and the emulated 2-IPU step still equals the gpu step plus SGD."""
    options = Options(platform="ipu", num_ipus=2, stage_starts=("layer2.0.bn1",))
    module = build(model_path("resnet_like"), options, readable=True)
    text = Path(module.__file__).read_text()
    assert 'L["layer2.0.conv1"]' in text  # inline: full names
    assert 'L.within("layer1.0")' in text  # the others: calls
    torch.manual_seed(0)
    ref = REFERENCES["resnet_like"]()
    gpu = build(model_path("resnet_like"), Options()).Model().double()
    ipu = module.Model()
    gpu.load_state_dict(ref.state_dict())
    ipu.load_state_dict(ref.state_dict())
    ipu = ipu.double()
    batch = make_inputs("resnet_like", 4)
    sgd = dict(lr=0.1)
    loss = gpu(*batch)
    torch.optim.SGD(gpu.parameters(), **sgd).step()
    ipu_device.use_emulation()
    try:
        training = poptorch_emulation.trainingModel(
            ipu, poptorch_emulation.Options(), poptorch_emulation.optim.SGD(ipu.parameters(), **sgd)
        )
        _, ipu_loss = training(*batch)
    finally:
        ipu_device.use_emulation(False)
    assert rel_err(ipu_loss, loss) <= 1e-9
    for (name, a), b in zip(gpu.state_dict().items(), ipu.state_dict().values()):
        if a.is_floating_point():
            assert rel_err(b, a) <= 1e-9, name


def test_block_local_names_never_shadow_the_module_functions():
    """A value inside a block named like a block function keeps working."""
    text = """
    model m {
        input x: f32[N, 2, 4, 4]
        target y: f32[N, 2, 4, 4]
        block unit(x) {
            unit_forward = conv2d(x, out_channels=2, kernel_size=1)
            unit_backward = relu(unit_forward)
            return unit_backward
        }
        a = unit(x)
        b = unit(a)
        loss = mse_loss(b, y)
        return loss
    }
    """
    source = generate_from_text(text, Options(), label="m.txt")
    functions, calls = functions_and_calls(source)
    assert calls and all(c in functions for c in calls)
    namespace: dict = {}
    exec(compile(source, "m.py", "exec"), namespace)
    model = namespace["Model"]().double()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    y = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    loss = model(x, y)
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_equivalence_tool_finds_the_working_tree_equal_to_head(capsys):
    """benchmarks/equivalence.py: HEAD against itself is bit-identical (the tool runs)."""
    from benchmarks.equivalence import main

    assert main(["--before", "HEAD", "--models", "fanout", "--schemes", "nocompress"]) == 0
    assert "bit-identical" in capsys.readouterr().out
