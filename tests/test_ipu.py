"""The ipu platform under the CPU emulation of PopTorch: the whole step in the module,
the surrogate loss, pipelining over 1, 2 and 4 IPUs, replication and device iterations.

Every check compares with the gpu-platform module plus a torch.optim.SGD step on the
same weights and batch, in float64, to 1e-9 relative.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import rel_err

from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.codegen import Options
from unroller.runtime import ipu_device, poptorch_emulation

TOL = 1e-9
SGD = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    poptorch_emulation.placements.clear()
    yield poptorch_emulation
    ipu_device.use_emulation(False)


def models(build, stem, scheme, num_ipus):
    torch.manual_seed(0)
    ref = REFERENCES[stem]()
    gpu = build(model_path(stem), Options(scheme=scheme)).Model().double()
    ipu = build(model_path(stem), Options(platform="ipu", scheme=scheme, num_ipus=num_ipus)).Model()
    gpu.load_state_dict(ref.state_dict())
    ipu.load_state_dict(ref.state_dict())
    return gpu, ipu.double()


def gpu_steps(gpu, batches):
    opt = torch.optim.SGD(gpu.parameters(), **SGD)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(gpu(*batch))
        opt.step()
    return losses


def assert_same_state(gpu, ipu):
    want = gpu.state_dict()
    for key, value in ipu.state_dict().items():
        if value.is_floating_point():
            assert rel_err(value, want[key]) <= TOL, (key, rel_err(value, want[key]))
        else:
            assert torch.equal(value, want[key]), key


# 4 IPUs under SLOW=1: 2 already splits every model into a pipeline (make test's time)
def _ipu_matrix():
    """Every model and scheme on 1 IPU; 2 IPUs for the ResNet in make test, for the rest
    and 4 IPUs under SLOW=1."""
    for stem in ("resnet_like", "unet_like", "autoencoder"):
        for scheme in ("nocompress", "dct-dense"):
            for num_ipus in (1, 2, 4):
                fast = num_ipus == 1 or (num_ipus == 2 and stem == "resnet_like")
                marks = () if fast else (pytest.mark.slow,)
                yield pytest.param(stem, scheme, num_ipus, marks=marks)


@pytest.mark.parametrize("stem, scheme, num_ipus", list(_ipu_matrix()))
def test_emulated_ipu_step_equals_gpu_step_plus_sgd(build, emulation, stem, scheme, num_ipus):
    gpu, ipu = models(build, stem, scheme, num_ipus)
    batch = make_inputs(stem, 4)
    (want,) = gpu_steps(gpu, [batch])
    opts = emulation.Options()
    training = emulation.trainingModel(ipu, opts, emulation.optim.SGD(ipu.parameters(), **SGD))
    surrogate, loss = training(*batch)
    assert rel_err(loss, want) <= TOL
    assert_same_state(gpu, ipu)
    if num_ipus > 1:
        ids = [ipu_id for _, ipu_id in emulation.placements]
        assert set(ids) == set(range(num_ipus))
        forward = [i for u, i in emulation.placements if u.startswith("forward")]
        backward = [i for u, i in emulation.placements if u.startswith("backward")]
        assert forward == sorted(forward) and backward == sorted(backward, reverse=True)
    else:
        assert emulation.placements == []


def test_replicas_and_gradient_accumulation_average_like_one_big_batch(build, emulation):
    """No batch norm here, so splitting the batch changes nothing but the arithmetic order."""
    stem = "fanout"
    gpu, ipu = models(build, stem, "nocompress", 2)
    batch = make_inputs(stem, 8)
    (want,) = gpu_steps(gpu, [batch])
    opts = emulation.Options().replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    training = emulation.trainingModel(ipu, opts, emulation.optim.SGD(ipu.parameters(), **SGD))
    _, loss = training(*batch)
    assert rel_err(loss, want) <= TOL  # mean over the four micro-batch losses
    assert_same_state(gpu, ipu)


def test_device_iterations_are_consecutive_steps(build, emulation):
    stem = "resnet_like"
    gpu, ipu = models(build, stem, "nocompress", 1)
    first, second = make_inputs(stem, 3, seed=1), make_inputs(stem, 3, seed=2)
    losses = gpu_steps(gpu, [first, second])
    opts = emulation.Options().deviceIterations(2)
    training = emulation.trainingModel(ipu, opts, emulation.optim.SGD(ipu.parameters(), **SGD))
    both = [torch.cat([a, b]) for a, b in zip(first, second)]
    _, loss = training(*both)
    assert rel_err(loss, losses[-1]) <= TOL
    assert_same_state(gpu, ipu)
    training.copyWeightsToHost()
    assert training.copies_to_host == 1


def test_stage_starts_from_the_user(build, emulation):
    module = build(
        model_path("resnet_like"),
        Options(platform="ipu", num_ipus=2, stage_starts=("layer2.0.conv1",)),
    )
    text = open(module.__file__).read()
    assert "IPU 1: layer2.0.conv1" in text
    head, tail = text.split('with poptorch.Block(user_id="forward1", ipu_id=1)', 1)
    # the block layer2.0 (its first node starts stage 1) is called on IPU 1 only
    forward_head = head.split("def forward(", 1)[1]
    assert 'L.within("layer2.0")' in tail and 'L.within("layer2.0")' not in forward_head


def test_without_poptorch_the_module_says_so_and_exits_2(build, tmp_path):
    module = build(model_path("tiny_resnet"), Options(platform="ipu"))
    result = subprocess.run(
        [sys.executable, module.__file__, "--steps", "1"], capture_output=True, text=True
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "PopTorch" in lines[0] and "--emulate" in lines[0]


@pytest.mark.slow  # a second interpreter running an emulated step: make test-slow
def test_the_module_runs_as_a_script_under_emulation(build, tmp_path):
    module = build(model_path("tiny_resnet"), Options(platform="ipu"))
    result = subprocess.run(
        [sys.executable, module.__file__, "--emulate", "--steps", "1", "--replication-factor", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "CPU emulation" in result.stdout and "step 0: loss" in result.stdout


def test_the_runner_sets_the_options(emulation, monkeypatch, tmp_path):
    seen = {}
    real = emulation.trainingModel

    def spy(model, options, optimizer):
        seen.update(options.settings)
        return real(model, options, optimizer)

    monkeypatch.setattr(emulation, "trainingModel", spy)
    from unroller.api import generate_source, import_generated, write_atomic

    out = tmp_path / "m.py"
    write_atomic(out, generate_source(model_path("tiny_resnet"), Options(platform="ipu")))
    module = import_generated(out, "ipu_runner_probe")
    argv = ["--emulate", "--steps", "1", "--device-batch-size", "2", "--device-iterations", "2"]
    argv += ["--replication-factor", "2", "--random-seed", "7", "--profile", str(tmp_path / "p")]
    assert ipu_device.run_main(module.Model, module.INPUTS, module.NUM_IPUS, argv) == 0
    assert seen["deviceIterations"] == 2 and seen["replicationFactor"] == 2
    assert seen["randomSeed"] == 7
    import json
    import os

    assert json.loads(os.environ["POPLAR_ENGINE_OPTIONS"])["autoReport.directory"] == str(
        tmp_path / "p"
    )


def test_dilated_conv_is_refused_for_the_ipu():
    from unroller.api import generate_from_text
    from unroller.errors import ModelError

    text = """model m {
        input x: f32[N, 2, 9, 9]
        target y: f32[N, 3, 5, 5]
        c = conv2d(x, out_channels=3, kernel_size=3, dilation=2)
        loss = mse_loss(c, y)
        return loss
    }"""
    generate_from_text(text, Options(platform="gpu"))
    with pytest.raises(ModelError, match="dilation"):
        generate_from_text(text, Options(platform="ipu"))


def test_per_ipu_report_in_unroll_graph(monkeypatch):
    import json

    from typer.testing import CliRunner

    from unroller.cli import app

    monkeypatch.chdir(model_path("resnet_like").parent.parent.parent)
    args = ["graph", "benchmarks/models/unet_like.txt", "--platform", "ipu", "--num-ipus", "4"]
    args += ["--scheme", "dct-dense", "--batch-size", "8"]
    result = CliRunner().invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    ipus = report["ipus"]
    assert [r["ipu"] for r in ipus["ipus"]] == [0, 1, 2, 3]
    assert (
        sum(r["stash_stored_bytes"] for r in ipus["ipus"]) == report["stash"]["total_stored_bytes"]
    )
    assert sum(r["nodes"] for r in ipus["ipus"]) == len(report["nodes"])
    assert len(ipus["boundaries"]) == 3 and all(b["forward_bytes"] > 0 for b in ipus["boundaries"])
    table = CliRunner().invoke(app, args)
    assert "of 900 MB" in table.stdout and "IPU 2 -> 3:" in table.stdout
    wrong = CliRunner().invoke(app, ["graph", "benchmarks/models/unet_like.txt", "--num-ipus", "2"])
    assert wrong.exit_code == 2


def test_unroll_lint_passes_on_generated_ipu_code_and_fails_on_a_bad_module(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from unroller.cli import app

    root = model_path("resnet_like").parent.parent.parent
    monkeypatch.chdir(root)
    ok = CliRunner().invoke(app, ["lint", "generated/ipu/quick/dct-dense.py"])
    assert ok.exit_code == 0, ok.output
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n\n\ndef f(x):\n    return torch.nn.functional.interpolate(x, scale_factor=2, mode='bilinear')\n"
    )
    result = CliRunner().invoke(app, ["lint", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:5:" in result.output and "bilinear" in result.output
