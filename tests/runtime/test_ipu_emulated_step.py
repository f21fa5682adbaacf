"""The ipu platform under the CPU emulation of PopTorch: the whole step in the module,
the surrogate loss, pipelining over 1, 2 and 4 IPUs, replication and device iterations.

Every check compares with the gpu-platform module plus a torch.optim.SGD step on the
same weights and batch, in float64, to 1e-9 relative.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from conftest import rel_err

from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.options import Options
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
        readable=True,
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


# Dilated convolutions: PopTorch's ConvTranspose has no dilation, so the ipu kernels build
# the transposed convolution (conv2d's input gradient, conv_transpose2d's forward) as a plain
# dilated conv2d. A grid of kernel, stride, padding, dilation and groups, with inputs whose
# last rows the forward never reads and paddings wider than the dilated kernel.
GRID_K = [(1, 1), (3, 2), (2, 3)]
GRID_S = [(1, 1), (2, 2), (3, 1)]
GRID_P = [(0, 0), (1, 2), (3, 0)]
GRID_D = [(2, 2), (1, 3), (3, 2)]


def _dilated_conv2d_grid():
    for k, s, p, d, groups, h in itertools.product(GRID_K, GRID_S, GRID_P, GRID_D, (1, 2), (7, 8)):
        if all(size + 2 * p[i] > (k[i] - 1) * d[i] for i, size in enumerate((h, h - 1))):
            yield k, s, p, d, groups, h


def test_dilated_conv2d_gradients_equal_autograd():
    from unroller.runtime import ipu

    worst, count, unread = 0.0, 0, 0
    for k, s, p, d, groups, h in _dilated_conv2d_grid():
        torch.manual_seed(count)
        m = torch.nn.Conv2d(2 * groups, 3 * groups, k, s, p, d, groups).double()
        x = torch.randn(2, 2 * groups, h, h - 1, dtype=torch.float64, requires_grad=True)
        y = m(x)
        g = torch.randn_like(y)
        want = torch.autograd.grad(y, (x, m.weight, m.bias), g)
        kw = dict(stride=s, padding=p, dilation=d, groups=groups)
        got = ipu.conv2d_backward(g, x.detach(), m, **kw)
        for ours, ref in zip(got, want):
            assert ours.shape == ref.shape
            worst = max(worst, rel_err(ours, ref))
        count += 1
        last_read = (y.shape[2] - 1) * s[0] + (k[0] - 1) * d[0]
        unread += last_read < h + p[0] - 1  # the last input row: never read
    assert count > 200 and unread >= 40
    assert worst <= 1e-10, worst


def test_dilated_conv1d_gradients_equal_autograd():
    from unroller.runtime import ipu

    worst, count = 0.0, 0
    for k, s, p, d, groups in itertools.product((1, 2, 3), (1, 2, 3), (0, 1, 4), (2, 3), (1, 2)):
        torch.manual_seed(count)
        m = torch.nn.Conv1d(2 * groups, 3 * groups, k, s, p, d, groups).double()
        x = torch.randn(2, 2 * groups, 13, dtype=torch.float64, requires_grad=True)
        y = m(x)
        g = torch.randn_like(y)
        want = torch.autograd.grad(y, (x, m.weight, m.bias), g)
        got = ipu.conv1d_backward(g, x.detach(), m, stride=s, padding=p, dilation=d, groups=groups)
        worst = max([worst] + [rel_err(ours, ref) for ours, ref in zip(got, want)])
        count += 1
    assert worst <= 1e-10, worst


def test_dilated_conv_transpose2d_forward_equals_torch():
    """conv_transpose2d's forward with dilation is the same construction (plus the bias)."""
    from unroller.runtime import ipu

    worst, count = 0.0, 0
    ops = [(0, 0), (1, 0), (0, 2)]
    for k, s, p, op, d, groups in itertools.product(
        GRID_K, GRID_S, GRID_P[:2], ops, GRID_D, (1, 2)
    ):
        if any(op[i] >= max(s[i], d[i]) for i in (0, 1)):
            continue
        torch.manual_seed(count)
        m = torch.nn.ConvTranspose2d(2 * groups, 3 * groups, k, s, p, op, groups, True, d)
        m = m.double()
        x = torch.randn(2, 2 * groups, 5, 4, dtype=torch.float64)
        try:
            want = m(x)
        except RuntimeError:  # an output size below 1
            continue
        kw = dict(stride=s, padding=p, output_padding=op, dilation=d, groups=groups)
        got = ipu.conv_transpose2d(x, m, **kw)
        assert got.shape == want.shape
        worst = max(worst, rel_err(got, want))
        count += 1
    assert count > 100
    assert worst <= 1e-10, worst


def test_the_transposed_conv_helper_without_dilation_equals_conv_transpose2d():
    """The helper is also right where the kernels call F.conv_transpose2d (dilation 1)."""
    from unroller.runtime import ipu

    for k, s, p, groups in itertools.product(GRID_K, GRID_S, GRID_P[:2], (1, 2)):
        torch.manual_seed(0)
        w = torch.randn(2 * groups, 3, *k, dtype=torch.float64)
        g = torch.randn(2, 2 * groups, 4, 5, dtype=torch.float64)
        want = torch.nn.functional.conv_transpose2d(g, w, None, s, p, 0, groups)
        got = ipu._transposed_conv(g, w, tuple(want.shape[2:]), s, p, (1, 1), groups)
        assert rel_err(got, want) <= 1e-12


DILATED = {
    "image": (
        """model m {
        input x: f32[N, 2, 13, 12]
        target y: f32[N, 3, 5, 7]
        a = conv2d(x, out_channels=4, kernel_size=3, stride=2, padding=1, dilation=2)
        r = relu(a)
        b = conv2d(r, out_channels=4, kernel_size=(2, 3), stride=(3, 2), padding=1,
                   dilation=(2, 1), groups=2)
        c = conv_transpose2d(b, out_channels=3, kernel_size=3, stride=2, padding=1, dilation=2)
        loss = mse_loss(c, y)
        return loss
    }""",
        dict(
            a=lambda: torch.nn.Conv2d(2, 4, 3, 2, 1, 2),
            b=lambda: torch.nn.Conv2d(4, 4, (2, 3), (3, 2), 1, (2, 1), 2),
            c=lambda: torch.nn.ConvTranspose2d(4, 3, 3, 2, 1, dilation=2),
        ),
        (2, 13, 12),
        (3, 5, 7),
    ),
    "sequence": (
        """model m {
        input x: f32[N, 3, 16]
        target y: f32[N, 2, 2]
        a = conv1d(x, out_channels=4, kernel_size=3, stride=2, padding=1, dilation=3)
        r = relu(a)
        b = conv1d(r, out_channels=2, kernel_size=2, stride=2, dilation=2, groups=2)
        loss = mse_loss(b, y)
        return loss
    }""",
        dict(
            a=lambda: torch.nn.Conv1d(3, 4, 3, 2, 1, 3),
            b=lambda: torch.nn.Conv1d(4, 2, 2, 2, 0, 2, 2),
        ),
        (3, 16),
        (2, 2),
    ),
}


@pytest.mark.parametrize("name", sorted(DILATED))
def test_dilated_conv_model_for_the_ipu_equals_torch_nn(build, emulation, name):
    """A model of dilated convolutions (strides leaving input rows unread, groups, a dilated
    conv_transpose2d) generated for the ipu platform: loss and every parameter gradient equal
    torch.nn's in float64."""
    text, layers, x_shape, y_shape = DILATED[name]
    torch.manual_seed(0)
    ref = torch.nn.ModuleDict({k: make() for k, make in layers.items()}).double()
    ipu = build(text, Options(platform="ipu")).Model()
    ipu.load_state_dict(ref.state_dict())
    ipu.double()
    x = torch.randn(2, *x_shape, dtype=torch.float64)
    y = torch.randn(2, *y_shape, dtype=torch.float64)
    surrogate, loss = ipu(x, y)
    surrogate.backward()
    h = ref["a"](x).relu()
    h = ref["b"](h)
    if "c" in ref:
        h = ref["c"](h)
    want = torch.nn.functional.mse_loss(h, y)
    want.backward()
    assert rel_err(loss, want) <= 1e-12
    grads = dict(ipu.named_parameters())
    for key, p in ref.named_parameters():
        assert rel_err(grads[key].grad, p.grad) <= 1e-10, key


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
