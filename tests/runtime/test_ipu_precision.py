"""``--platform ipu --precision fp16-mixed / fp16`` under the CPU emulation of PopTorch.

The ipu module seeds its explicit backward with PopTorch's loss scaling S (``Model(
loss_scaling=S)``, the value its ``poptorch.optim.SGD`` is built with) and returns the
surrogate sum(p * g) / S, g the scaled gradient in the parameter's dtype: PopTorch's own
scaling multiplies that back to g and its optimizer divides g by S, so the update is the
one from dL/dp, while no float16 gradient in the unrolled backward is S times smaller.

Checked against the gpu module generated with the same precision, on the same weights and
batch (fp16-mixed with a ``torch.amp.GradScaler`` of the same scale, so that both backwards
round the same scaled float16 values): the gradients the emulated optimizer applies, divided
by S, agree with the gpu's per parameter to ``TOL`` = 2^-8 (four float16 epsilons), relative
to the gpu's gradient, or to the largest gradient for one that is zero in exact arithmetic (a
bias before batch norm, whose float16 value is rounding noise on both sides). The two
differ only where their kernels round differently: the ipu's layer norm, gelu and cross
entropy are written out, its float16 batch norm computes in float32 as torch's does.
Measured (CPU, torch 2.13): at most 5.4e-4 under fp16-mixed and 1.1e-3 under fp16.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import rel_err
from typer.testing import CliRunner

from unroller.api import compression_config, graph_from_text, import_generated, render, write_atomic
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.errors import OptionValueError
from unroller.runtime import ipu, ipu_device, poptorch_emulation

TOL = 2.0**-8
EXACT_ZERO = 1e-6  # a float64 gradient below this x the largest one is zero in exact arithmetic

NET = """
model net {
    input x: f32[N, 12, 16]
    target y: i64[N, 12]
    fc1 = linear(x, out_features=32)
    act = gelu(fc1)
    fc2 = linear(act, out_features=16)
    r = add(x, fc2)
    norm = layernorm(r, normalized_shape=16)
    head = linear(norm, out_features=5)
    logits = permute(head, dims=(0, 2, 1))
    loss = cross_entropy(logits, y)
    return loss, head
}
"""

CNN = """
model cnn {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    c1 = conv2d(x, out_channels=8, kernel_size=3, padding=1, bias=false)
    b1 = batchnorm2d(c1)
    r1 = relu(b1)
    c2 = conv2d(r1, out_channels=8, kernel_size=3, stride=2, padding=1)
    b2 = batchnorm2d(c2)
    r2 = relu(b2)
    pool = adaptive_avgpool2d(r2, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=5)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""
NETWORKS = {"net": NET, "cnn": CNN}
_MODULES: dict[tuple, object] = {}


def module(tmp_path_factory, network: str, readable: bool = False, **options):
    """The generated module of ``network`` under ``options``, rendered once per test run."""
    key = (network, readable, tuple(sorted(options.items())))
    if key not in _MODULES:
        opts = Options(**options)
        text = NETWORKS[network]
        graph = graph_from_text(text, f"{network}.txt", precision=opts.precision)
        source = render(graph, f"{network}.txt", opts, compression_config(opts, graph), readable)
        out = tmp_path_factory.mktemp("ipu_precision") / f"{network}.py"
        write_atomic(out, source)
        _MODULES[key] = import_generated(out, f"ipu_precision_{len(_MODULES)}")
    return _MODULES[key]


def batch(network: str, n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if network == "net":
        return torch.randn(n, 12, 16, generator=gen), torch.randint(0, 5, (n, 12), generator=gen)
    return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 5, (n,), generator=gen)


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    poptorch_emulation.placements.clear()
    yield poptorch_emulation
    ipu_device.use_emulation(False)


def models(tmp_path_factory, network: str, precision: str, num_ipus: int = 1, **ipu_kwargs):
    """(gpu, ipu) modules of ``network`` under ``precision``, with the same weights."""
    torch.manual_seed(0)
    gpu = module(tmp_path_factory, network, precision=precision).Model()
    ipu_module = module(
        tmp_path_factory, network, platform="ipu", precision=precision, num_ipus=num_ipus
    )
    ipu = ipu_module.Model(**ipu_kwargs)
    ipu.load_state_dict(gpu.state_dict())
    return gpu, ipu


def exact_zeros(tmp_path_factory, network: str, gpu) -> set[str]:
    """The parameters whose gradient is zero in exact arithmetic (float64, fp32 step)."""
    exact = module(tmp_path_factory, network).Model().double()
    exact.load_state_dict(gpu.state_dict())
    exact(*[t.double() if t.is_floating_point() else t for t in batch(network)])
    norms = {k: float(p.grad.norm()) for k, p in exact.named_parameters()}
    return {k for k, v in norms.items() if v <= EXACT_ZERO * max(norms.values())}


def gradient_errors(got: dict, want: dict, zeros: set[str]) -> dict[str, float]:
    largest = max(float(w.double().norm()) for w in want.values())
    errors = {}
    for name, w in want.items():
        scale = largest if name in zeros else float(w.double().norm())
        errors[name] = float((got[name].double() - w.double()).norm()) / scale
    return errors


def applied(optimizer, model) -> dict[str, torch.Tensor]:
    """Spy on the emulated optimizer: what each ``apply`` got, by parameter name."""
    names = {p: name for name, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}
    real = optimizer.apply

    def spy(grads):
        seen.update({names[p]: g.clone() for p, g in grads.items()})
        real(grads)

    optimizer.apply = spy
    return seen


# ---------------------------------------------------------------- the generated code


def test_the_module_is_poptorchs_half_model_seeded_with_its_loss_scaling(tmp_path_factory):
    fp16 = module(tmp_path_factory, "net", True, platform="ipu", precision="fp16")
    text = open(fp16.__file__).read()
    assert "self.half()" in text and "K.floats_in(torch.float16, x, y)" in text
    assert "grad_loss = K.loss_seed(loss, scaler)" in text
    assert "surrogate(P, grads, loss_scaling=scaler)" in text
    assert "(times the optimizer's loss scaling)" in text and "GradScaler" not in text
    model = fp16.Model()
    assert model.loss_scaling == 128.0 and fp16.Model(loss_scaling=64).loss_scaling == 64.0
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    mixed = module(tmp_path_factory, "net", True, platform="ipu", precision="fp16-mixed")
    text = open(mixed.__file__).read()
    assert 'L.cast("fc1", torch.float16)' in text and "self.half()" not in text
    assert {p.dtype for p in mixed.Model().parameters()} == {torch.float32}
    fp32 = open(module(tmp_path_factory, "net", True, platform="ipu").__file__).read()
    assert "loss_scaling" not in fp32 and "scaler" not in fp32


def test_collect_gives_each_parameter_its_gradient_in_its_dtype():
    """A float16 gradient of a float32 weight (read through the cast cache) is stored in
    float32, and a second use's adds up in float32, as autograd adds into ``.grad``."""
    layer = torch.nn.Linear(3, 2)
    handles = ipu.layers(torch.nn.ModuleDict({"fc": layer}))
    first, second = torch.randn(2, 3).half(), torch.randn(2, 3).half()
    grads: dict[str, torch.Tensor] = {}
    ipu.collect(grads, handles, "fc", weight=first)
    ipu.collect(grads, handles, "fc", weight=second)
    assert grads["fc.weight"].dtype == torch.float32
    assert torch.equal(grads["fc.weight"], first.float() + second.float())


def test_the_module_passes_the_ipu_lint_with_the_cast_cache_checked(tmp_path_factory):
    from unroller.lint import lint_module

    mixed = module(tmp_path_factory, "cnn", platform="ipu", precision="fp16-mixed")
    report = lint_module(mixed.__file__, "ipu")
    assert report.ok, report.format()
    assert not [w for w in report.warnings if w.file.name == "cast_cache.py"], report.format()
    host_only = {h.name for h in report.host_only if h.file.name == "cast_cache.py"}
    assert host_only == {"_attribute"}, host_only  # CastLayer.__getattr__ itself is checked


# ---------------------------------------------------------------- the step


CASES = [
    ("net", "fp16-mixed", 1),
    ("net", "fp16", 1),
    ("cnn", "fp16-mixed", 1),
    ("cnn", "fp16", 1),
    ("net", "fp16-mixed", 2),  # pipelined: each stage's surrogate divided by S
]


@pytest.mark.parametrize("network, precision, num_ipus", CASES)
def test_the_applied_gradients_are_the_gpu_steps(
    tmp_path_factory, emulation, network, precision, num_ipus
):
    gpu, ipu_model = models(tmp_path_factory, network, precision, num_ipus)
    scale = ipu_model.loss_scaling
    x, y = batch(network)
    if precision == "fp16-mixed":
        want_loss = gpu(x, y, scaler=torch.amp.GradScaler("cpu", init_scale=scale))
        want = {k: p.grad / scale for k, p in gpu.named_parameters()}
    else:  # a half model takes no GradScaler: the gpu step's gradients are unscaled
        want_loss = gpu(x, y)
        want = {k: p.grad for k, p in gpu.named_parameters()}
    optimizer = emulation.optim.SGD(ipu_model.parameters(), lr=0.1, loss_scaling=scale)
    seen = applied(optimizer, ipu_model)
    _, loss = emulation.trainingModel(ipu_model, emulation.Options(), optimizer)(x, y)
    assert rel_err(loss, want_loss) <= TOL
    assert {g.dtype for g in seen.values()} == {torch.float32}  # accum_type
    got = {k: g / scale for k, g in seen.items()}
    errors = gradient_errors(got, want, exact_zeros(tmp_path_factory, network, gpu))
    assert max(errors.values()) <= TOL, errors
    if precision == "fp16":  # the update rounded into the float16 weights
        assert {p.dtype for p in ipu_model.parameters()} == {torch.float16}


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16"])
def test_a_few_steps_train_as_the_gpu_module_with_sgd(tmp_path_factory, emulation, precision):
    """Three steps, momentum and two accumulated micro-batches per step (the float32
    accumulators and velocity of PopTorch's SGD) against the gpu module and torch's SGD
    (fp16-mixed: unscaled by the GradScaler; fp16: torch's SGD on the half weights)."""
    gpu, ipu_model = models(tmp_path_factory, "net", precision)
    scale = ipu_model.loss_scaling
    sgd = dict(lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(gpu.parameters(), **sgd)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale) if precision == "fp16-mixed" else None
    opts = emulation.Options()
    opts.Training.gradientAccumulation(2)
    optimizer = emulation.optim.SGD(ipu_model.parameters(), loss_scaling=scale, **sgd)
    training = emulation.trainingModel(ipu_model, opts, optimizer)
    for step in range(3):
        x, y = batch("net", n=8, seed=step)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            want = gpu(x, y)
            opt.step()
        else:
            want = gpu(x, y, scaler=scaler)
            scaler.step(opt)
            scaler.update()
        _, loss = training(x, y)
        assert rel_err(loss, want) <= TOL, step
    for name, value in ipu_model.state_dict().items():
        assert rel_err(value, gpu.state_dict()[name]) <= TOL, name
    assert all(torch.isfinite(p).all() for p in ipu_model.parameters())


@pytest.mark.parametrize("precision, huge", [("fp16-mixed", 2.0**24), ("fp16", 2.0**16)])
def test_an_overflow_under_static_loss_scaling_reaches_the_weights(
    tmp_path_factory, emulation, precision, huge
):
    """PopTorch with a static ``loss_scaling`` neither detects an overflow nor skips the step
    (torch.amp.GradScaler would): the inf gradients are applied and the weights are lost; the
    loss of the step, computed before the update, is finite. With the IPU's floating-point
    exceptions on, the call raises instead (emulated: a gradient or output not finite)."""
    _, ipu_model = models(tmp_path_factory, "net", precision, loss_scaling=huge)
    x, y = batch("net")
    optimizer = emulation.optim.SGD(ipu_model.parameters(), lr=0.1, loss_scaling=huge)
    seen = applied(optimizer, ipu_model)
    _, loss = emulation.trainingModel(ipu_model, emulation.Options(), optimizer)(x, y)
    assert torch.isfinite(loss)
    assert not all(torch.isfinite(g).all() for g in seen.values())
    assert not all(torch.isfinite(p).all() for p in ipu_model.parameters())

    _, ipu_model = models(tmp_path_factory, "net", precision, loss_scaling=huge)
    before = {k: v.clone() for k, v in ipu_model.state_dict().items()}
    opts = emulation.Options()
    opts.Precision.enableFloatingPointExceptions(True)
    optimizer = emulation.optim.SGD(ipu_model.parameters(), lr=0.1, loss_scaling=huge)
    with pytest.raises(RuntimeError, match="floating point exception"):
        emulation.trainingModel(ipu_model, opts, optimizer)(x, y)
    assert all(torch.equal(v, before[k]) for k, v in ipu_model.state_dict().items())


def test_the_run_script_builds_poptorchs_optimizer_with_the_modules_loss_scaling(
    tmp_path_factory, emulation, monkeypatch, capsys
):
    seen = {}
    real = emulation.trainingModel

    def spy(model, options, optimizer):
        seen.update(model=model, optimizer=optimizer)
        return real(model, options, optimizer)

    monkeypatch.setattr(emulation, "trainingModel", spy)
    fp16 = module(tmp_path_factory, "net", platform="ipu", precision="fp16")
    argv = ["--emulate", "--steps", "2", "--loss-scaling", "64", "--momentum", "0.9"]
    assert ipu_device.run_main(fp16.Model, fp16.INPUTS, fp16.NUM_IPUS, argv) == 0
    model, optimizer = seen["model"], seen["optimizer"]
    assert model.loss_scaling == optimizer.loss_scaling == 64.0
    assert optimizer.accum_type == optimizer.velocity_accum_type == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # the half model
    assert {s["momentum_buffer"].dtype for s in optimizer.state.values()} == {torch.float32}
    out = capsys.readouterr().out
    assert "loss scaling 64" in out and "step 1: loss" in out

    fp32 = module(tmp_path_factory, "net", platform="ipu")
    with pytest.raises(SystemExit) as exit_:
        ipu_device.run_main(fp32.Model, fp32.INPUTS, fp32.NUM_IPUS, ["--emulate", *argv[1:]])
    assert exit_.value.code == 2
    assert "--precision fp16-mixed or fp16" in capsys.readouterr().err


# ---------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_bfloat16_is_refused_in_one_line_with_the_reason(tmp_path, precision):
    model = tmp_path / "net.txt"
    model.write_text(NET)
    args = ["generate", str(model), "--platform", "ipu", "--precision", precision]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "m.py")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert f"--precision {precision}" in line and "--platform ipu" in line
    assert "has no bfloat16" in line and "fp16-mixed" in line
    with pytest.raises(OptionValueError, match="no bfloat16"):
        Options(platform="ipu", precision=precision)


def test_fp16_is_what_the_ipu_takes():
    for precision, num_ipus in itertools.product(["fp32", "fp16-mixed", "fp16"], [1, 4]):
        options = Options(platform="ipu", precision=precision, num_ipus=num_ipus)
        assert (options.precision, options.num_ipus) == (precision, num_ipus)
