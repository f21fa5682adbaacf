"""Normalisation and 1-D operators (spec v2): layernorm, rmsnorm, groupnorm, batchnorm1d,
conv1d, maxpool1d, avgpool1d, adaptive_avgpool1d, batchnorm2d's affine / track_running_stats
and the pools' ceil_mode.

The kernels themselves are checked against torch.autograd by tests/runtime/test_kernels.py (their
rows are in tests/opinfo.py). Here: each operator's bad inputs give an exact
``FILE:LINE:COL: error: ...`` at the culprit, and whole models using every one of them,
generated for gpu and ipu, give float64 gradients equal to torch.autograd on the
equivalent torch.nn model to 1e-10.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import Tensor, nn

from unroller.api import generate_from_text, graph_from_text
from unroller.compiler.options import Options
from unroller.errors import ModelError
from unroller.runtime import ipu_device

TOL = 1e-10
FILE = "bad.txt"
ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- bad inputs

HEAD = """\
model m {
    input x: f32[N, 4, 6, 6]
    input s: f32[N, 4, 10]
    target y: i64[N]
"""
TAIL = """\
    f = flatten(o)
    l = linear(f, out_features=2)
    loss = cross_entropy(l, y)
    return loss
}
"""

# (id, the statement (line 5), the text the caret points at (its first occurrence after
# "o = ": the operator or the input for a shape problem, the argument's name for a problem
# with its value in context, the value for a value of the wrong type), the exact message)
ERRORS = [
    (
        "layernorm-not-trailing",
        "o = layernorm(s, normalized_shape=(4, 9))",
        "normalized_shape",
        "o: layernorm: normalized_shape (4, 9) must equal the input's trailing dims (4, 10) "
        "(input f32[N, 4, 10])",
    ),
    (
        "layernorm-reaches-the-batch-dim",
        "o = layernorm(s, normalized_shape=(3, 4, 10))",
        "normalized_shape",
        "o: layernorm: normalized_shape (3, 4, 10) has 3 dims but the input f32[N, 4, 10] has "
        "only 2 besides the batch dim, which is never normalised",
    ),
    (
        "layernorm-int-shape",
        "o = layernorm(s, normalized_shape=4)",
        "normalized_shape",
        "o: layernorm: normalized_shape (4,) must equal the input's trailing dims (10,) "
        "(input f32[N, 4, 10])",
    ),
    (
        "rmsnorm-not-trailing",
        "o = rmsnorm(s, normalized_shape=(4, 9))",
        "normalized_shape",
        "o: rmsnorm: normalized_shape (4, 9) must equal the input's trailing dims (4, 10) "
        "(input f32[N, 4, 10])",
    ),
    (
        "rmsnorm-eps-negative",
        "o = rmsnorm(s, normalized_shape=10, eps=-1.0)",
        "-1.0",
        "rmsnorm: argument 'eps' must be a number >= 0.0, got -1.0",
    ),
    (
        "groupnorm-groups-do-not-divide",
        "o = groupnorm(x, num_groups=3)",
        "num_groups",
        "o: groupnorm: num_groups (3) must divide the number of channels (4)",
    ),
    (
        "groupnorm-zero-groups",
        "o = groupnorm(x, num_groups=0)",
        "0)",
        "groupnorm: argument 'num_groups' must be an integer >= 1, got 0",
    ),
    (
        "batchnorm1d-image",
        "o = batchnorm1d(x)",
        "x",
        "o: batchnorm1d needs a 2-D input [N, C] or a 3-D input [N, C, L], got f32[N, 4, 6, 6]",
    ),
    (
        "batchnorm2d-affine-not-bool",
        "o = batchnorm2d(x, affine=1)",
        "1)",
        "batchnorm2d: argument 'affine' must be true or false, got 1",
    ),
    (
        "conv1d-image",
        "o = conv1d(x, out_channels=4, kernel_size=3)",
        "x",
        "o: conv1d needs a 3-D input [N, C, L], got f32[N, 4, 6, 6]",
    ),
    (
        "conv1d-groups",
        "o = conv1d(s, out_channels=6, kernel_size=3, groups=4)",
        "groups",
        "o: conv1d: in_channels (4) and out_channels (6) must both be divisible by groups (4)",
    ),
    (
        "conv1d-too-short",
        "o = conv1d(s, out_channels=6, kernel_size=12)",
        "conv1d",
        "o: conv1d output length would be -1 (below 1) for input length 10: the input is too "
        "short for this kernel, stride and padding",
    ),
    (
        "conv1d-pair-size",
        "o = conv1d(s, out_channels=6, kernel_size=(3, 3))",
        "(3, 3)",
        "conv1d: argument 'kernel_size' must be an integer, got (3, 3)",
    ),
    (
        "maxpool1d-padding",
        "o = maxpool1d(s, kernel_size=2, padding=2)",
        "padding",
        "o: maxpool1d: padding 2 must be at most half the kernel size 2",
    ),
    (
        "avgpool1d-image",
        "o = avgpool1d(x, kernel_size=2)",
        "x",
        "o: avgpool1d needs a 3-D input [N, C, L], got f32[N, 4, 6, 6]",
    ),
    (
        "adaptive_avgpool1d-image",
        "o = adaptive_avgpool1d(x, output_size=2)",
        "x",
        "o: adaptive_avgpool1d needs a 3-D input [N, C, L], got f32[N, 4, 6, 6]",
    ),
    (
        "maxpool2d-ceil_mode-not-bool",
        "o = maxpool2d(x, kernel_size=2, ceil_mode=1)",
        "1)",
        "maxpool2d: argument 'ceil_mode' must be true or false, got 1",
    ),
]


def _source(statement: str) -> str:
    return f"{HEAD}    {statement}\n{TAIL}"


def _expected(statement: str, token: str, message: str) -> str:
    col = len("    ") + statement.index(token, len("o = ")) + 1
    return f"{FILE}:5:{col}: error: {message}"


@pytest.mark.parametrize(
    "statement, token, message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_bad_input_is_reported_at_the_culprit(statement: str, token: str, message: str):
    source = _source(statement)
    with pytest.raises(ModelError) as info:
        graph_from_text(source, FILE)
    first = info.value.format(FILE, source).splitlines()[0]
    assert first == _expected(statement, token, message)


@pytest.mark.parametrize(
    "statement, op, dims",
    [
        ("o = layernorm(s, normalized_shape=(4, 10))", "layernorm", (4, 10)),
        ("o = groupnorm(x, num_groups=2)", "groupnorm", (4, 6, 6)),
        ("o = rmsnorm(s, normalized_shape=(4, 10))", "rmsnorm", (4, 10)),
    ],
)
def test_the_scaffolding_is_valid(statement, op, dims):
    """Each case differs from a valid model only in its mistake: the same head and tail
    around a valid statement build a graph, ``o`` of the operator and shape expected."""
    graph = graph_from_text(_source(statement), FILE)
    node = graph.node("o")
    assert node.op.name == op
    assert tuple(node.output.type.shape[1:]) == dims
    assert graph.loss.name == "loss" and [n.name for n in graph.nodes] == ["o", "f", "l", "loss"]


def test_cli_reports_a_bad_norm_and_exits_2(tmp_path: Path):
    statement, token, message = ERRORS[0][1:]
    bad = tmp_path / FILE
    bad.write_text(_source(statement))
    done = subprocess.run(
        [sys.executable, "-m", "unroller.cli", "generate", FILE, "-o", "out.py"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert _expected(statement, token, message) in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.py").exists()


# ---------------------------------------------------------------- whole models

SEQUENCE = """\
model sequence {
    input x: f32[N, 4, 15]
    target y: i64[N]
    c1 = conv1d(x, out_channels=8, kernel_size=3, padding=1, bias=false)
    bn = batchnorm1d(c1)
    r1 = relu(bn)
    p1 = maxpool1d(r1, kernel_size=2, ceil_mode=true)
    c2 = conv1d(p1, out_channels=8, kernel_size=3, stride=2, padding=1, bias=false)
    gn = groupnorm(c2, num_groups=4)
    r2 = relu(gn)
    p2 = maxpool1d(r2, kernel_size=3, stride=1, padding=1)
    a1 = avgpool1d(p2, kernel_size=3, stride=2, padding=1, ceil_mode=true)
    ln = layernorm(a1, normalized_shape=(8, 3))
    p3 = adaptive_avgpool1d(ln, output_size=2)
    f = flatten(p3)
    r3 = relu(f)
    bn0 = batchnorm1d(r3, affine=false, momentum=0.2)
    l = linear(bn0, out_features=5)
    loss = cross_entropy(l, y)
    return loss, l
}
"""


class Sequence(nn.Module):
    """SEQUENCE in torch.nn (attribute names = statement names = state-dict prefixes)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.c2 = nn.Conv1d(8, 8, 3, stride=2, padding=1, bias=False)
        self.gn = nn.GroupNorm(4, 8)
        self.ln = nn.LayerNorm((8, 3))
        self.bn0 = nn.BatchNorm1d(16, affine=False, momentum=0.2)
        self.l = nn.Linear(16, 5)

    def logits(self, x: Tensor) -> Tensor:
        h = F.max_pool1d(F.relu(self.bn(self.c1(x))), 2, ceil_mode=True)
        h = F.max_pool1d(F.relu(self.gn(self.c2(h))), 3, 1, 1)
        h = self.ln(F.avg_pool1d(h, 3, 2, 1, ceil_mode=True))
        return self.l(self.bn0(F.relu(F.adaptive_avg_pool1d(h, 2).flatten(1))))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.logits(x), y)


IMAGE = """\
model image {
    input x: f32[N, 3, 9, 9]
    target y: i64[N]
    c = conv2d(x, out_channels=6, kernel_size=3, padding=1, bias=false)
    bn = batchnorm2d(c, affine=false, track_running_stats=false)
    gn = groupnorm(bn, num_groups=3, eps=1e-3)
    r = relu(gn)
    p = maxpool2d(r, kernel_size=2, ceil_mode=true)
    bt = batchnorm2d(p, momentum=0.3, affine=false)
    a = avgpool2d(bt, kernel_size=2, ceil_mode=true)
    ln = layernorm(a, normalized_shape=(3, 3), bias=false)
    f = flatten(ln)
    l = linear(f, out_features=4)
    loss = cross_entropy(l, y)
    return loss, l
}
"""


class Image(nn.Module):
    """IMAGE in torch.nn."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6, affine=False, track_running_stats=False)
        self.gn = nn.GroupNorm(3, 6, eps=1e-3)
        self.bt = nn.BatchNorm2d(6, momentum=0.3, affine=False)
        self.ln = nn.LayerNorm((3, 3), bias=False)
        self.l = nn.Linear(54, 4)

    def logits(self, x: Tensor) -> Tensor:
        h = F.relu(self.gn(self.bn(self.c(x))))
        h = self.bt(F.max_pool2d(h, 2, ceil_mode=True))
        h = self.ln(F.avg_pool2d(h, 2, ceil_mode=True))
        return self.l(h.flatten(1))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.logits(x), y)


TOKENS = """\
model tokens {
    input x: f32[N, 6, 8]
    target y: i64[N]
    r1 = rmsnorm(x, normalized_shape=8)
    l1 = linear(r1, out_features=12)
    a = relu(l1)
    r2 = rmsnorm(a, normalized_shape=(6, 12), eps=1e-3)
    r3 = rmsnorm(r2, normalized_shape=12, elementwise_affine=false, eps=0.5)
    f = flatten(r3)
    l = linear(f, out_features=4)
    loss = cross_entropy(l, y)
    return loss, l
}
"""


class Tokens(nn.Module):
    """TOKENS in torch.nn: RMSNorm with the default eps (None: the dtype's epsilon), over two
    dims, and without a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.r1 = nn.RMSNorm(8)
        self.l1 = nn.Linear(8, 12)
        self.r2 = nn.RMSNorm((6, 12), eps=1e-3)
        self.r3 = nn.RMSNorm(12, eps=0.5, elementwise_affine=False)
        self.l = nn.Linear(72, 4)

    def logits(self, x: Tensor) -> Tensor:
        h = self.r2(F.relu(self.l1(self.r1(x))))
        return self.l(self.r3(h).flatten(1))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.logits(x), y)


MODELS = {
    "sequence": (SEQUENCE, Sequence, (4, 15), 5),
    "image": (IMAGE, Image, (3, 9, 9), 4),
    "tokens": (TOKENS, Tokens, (6, 8), 4),
}


def _reference(stem: str) -> nn.Module:
    torch.manual_seed(0)
    ref = MODELS[stem][1]().double()
    with torch.no_grad():  # affine parameters away from their 1 / 0 initialisation
        for name, p in ref.named_parameters():
            if name.startswith(("bn.", "gn.", "ln.", "r1.", "r2.")):
                p.add_(torch.rand_like(p) - 0.5)
    return ref


def _batch(stem: str, step: int, batch: int = 5) -> tuple[Tensor, Tensor]:
    _, _, shape, classes = MODELS[stem]
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(batch, *shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    return x, torch.randint(0, classes, (batch,), generator=gen)


def _assert_state(gen: nn.Module, ref: nn.Module) -> None:
    """Buffers (running stats, num_batches_tracked) as torch.nn left them."""
    want = dict(ref.named_buffers())
    assert set(dict(gen.named_buffers())) == set(want)
    for name, buf in gen.named_buffers():
        if buf.is_floating_point():
            assert rel_err(buf, want[name]) <= TOL, name
        else:
            assert torch.equal(buf, want[name]), name


def _assert_grads(grads: dict[str, Tensor | None], ref: nn.Module) -> None:
    for name, p in ref.named_parameters():
        assert grads[name] is not None, f"{name}: no gradient"
        assert rel_err(grads[name], p.grad) <= TOL, (name, rel_err(grads[name], p.grad))


@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense"])
@pytest.mark.parametrize("stem", sorted(MODELS))
def test_gpu_gradients_match_autograd(build, stem: str, scheme: str):
    """Two steps (gradients accumulate, running stats move twice), then predict() in eval
    mode. dct-dense compresses only 4-D activations: SEQUENCE has none, so its gradients stay
    exact; IMAGE's are lossy there (and compared with the ipu module's in the ipu test)."""
    ref = _reference(stem)
    gen = build(MODELS[stem][0], Options(scheme=scheme)).Model().double()
    result = gen.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert list(gen.state_dict()) == list(ref.state_dict())
    exact = scheme == "nocompress" or stem != "image"  # 3-D only: dct leaves it raw
    for step in range(2):
        x, y = _batch(stem, step)
        ref_loss = ref(x, y)
        ref_loss.backward()
        loss = gen(x, y)
        if exact:
            assert rel_err(loss, ref_loss) <= TOL
    if exact:
        _assert_grads({n: p.grad for n, p in gen.named_parameters()}, ref)
        _assert_state(gen, ref)
    else:  # lossy (the ipu test compares it with the ipu module's): every gradient is there
        for name, p in gen.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    x, _ = _batch(stem, 9)
    ref.eval()
    with torch.no_grad():
        got = gen.predict(x)
        assert rel_err(got, ref.logits(x)) <= TOL  # predict keeps nothing for a backward


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense"])
@pytest.mark.parametrize("stem", sorted(MODELS))
def test_ipu_gradients_match_autograd(build, emulation, stem: str, scheme: str):
    """The ipu module's step (emulated PopTorch on the CPU) hands its unrolled gradients to
    PopTorch through the surrogate loss sum(p * g): its autograd gradient is g itself. With
    dct-dense, IMAGE is compared with the gpu module of the same scheme (same codec)."""
    ref = _reference(stem)
    source = MODELS[stem][0]
    ipu = build(source, Options(platform="ipu", scheme=scheme)).Model().double()
    ipu.load_state_dict(ref.state_dict())
    x, y = _batch(stem, 0)
    surrogate, loss = ipu(x, y)
    surrogate.backward()
    grads = {n: p.grad for n, p in ipu.named_parameters()}
    if scheme == "nocompress" or stem != "image":
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert rel_err(loss, ref_loss) <= TOL
        _assert_grads(grads, ref)
        _assert_state(ipu, ref)
        return
    gpu = build(source, Options(scheme=scheme)).Model().double()
    gpu.load_state_dict(_reference(stem).state_dict())
    want = gpu(x, y)
    assert rel_err(loss, want) <= 1e-9
    for name, p in gpu.named_parameters():
        assert rel_err(grads[name], p.grad) <= 1e-9, name


def test_rmsnorm_backward_from_its_compressed_input(build):
    """Under quant, an rmsnorm keeps its input compressed (8-bit per-row groups; the model's
    input x stays raw, as every scheme leaves inputs) and its per-row rstd exact; the gradients then differ from autograd's by the codec's error only:
    within 2% of the largest gradient, where the inputs' own round-trip error is about 0.4%."""
    from unroller.compress import make

    ref = _reference("tokens")
    gen = build(TOKENS, Options(scheme="quant")).Model().double()
    gen.load_state_dict(ref.state_dict())
    x, y = _batch("tokens", 0)
    gen(x, y)
    ref(x, y).backward()
    kept = {r["tensor"]: r["compressor"] for r in gen.stash_report()["rows"]}
    assert kept["x"] == "raw", kept  # a model input: its caller holds it anyway
    assert "Quant(" in kept["a"] and "Quant(" in kept["r2"], kept  # r2's and r3's inputs
    assert [kept[f"r{i}:rstd"] for i in (1, 2, 3)] == ["raw"] * 3, kept
    codec_error = rel_err(make("quant").decompress(make("quant").compress(x), (6, 8), x.dtype), x)
    assert 0 < codec_error < 0.01
    errors = {}
    for name, p in ref.named_parameters():
        got = dict(gen.named_parameters())[name].grad
        errors[name] = float((got - p.grad).abs().max() / p.grad.abs().max())
    assert max(errors.values()) <= 0.02, errors
    assert min(errors["r1.weight"], errors["r2.weight"]) > 1e-6, errors  # the codec did act


def test_default_arguments_leave_the_generated_call_unchanged():
    """batchnorm2d's new affine / track_running_stats and the pools' ceil_mode at their
    defaults are left out of the generated module, so existing models generate as before."""
    source = """\
model m {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    b = batchnorm2d(x, affine=true, track_running_stats=true)
    p = maxpool2d(b, kernel_size=2, ceil_mode=false)
    a = avgpool2d(p, kernel_size=2, ceil_mode=false)
    f = flatten(a)
    l = linear(f, out_features=3)
    loss = cross_entropy(l, y)
    return loss
}
"""
    plain = source.replace(", affine=true, track_running_stats=true", "").replace(
        ", ceil_mode=false", ""
    )

    def code(text: str) -> list[str]:  # comments quote the model's statements
        lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        return [line for line in lines if not line.startswith(('"""', "model text"))]

    body = code(generate_from_text(source))
    assert not any(w in line for line in body for w in ("ceil_mode", "affine", "track_running"))
    assert body == code(generate_from_text(plain))


# ---------------------------------------------------------------- inferred shapes

SHAPES = [
    ((4, 10), "layernorm(x, normalized_shape=10)"),
    ((4, 10), "layernorm(x, normalized_shape=(4, 10), elementwise_affine=false)"),
    ((3, 4, 5), "layernorm(x, normalized_shape=(4, 5), bias=false)"),
    ((6, 4, 3), "groupnorm(x, num_groups=3)"),
    ((6,), "groupnorm(x, num_groups=2, affine=false)"),
    ((5,), "batchnorm1d(x)"),
    ((5, 7), "batchnorm1d(x, affine=false, track_running_stats=false)"),
    ((5, 7, 6), "batchnorm2d(x, affine=false)"),
    (
        (4, 11),
        "conv1d(x, out_channels=6, kernel_size=3, stride=2, padding=1, dilation=2, groups=2)",
    ),
    ((4, 11), "conv1d(x, out_channels=4, kernel_size=11, bias=false)"),
    ((3, 9), "maxpool1d(x, kernel_size=3, stride=2, padding=1)"),
    ((3, 8), "maxpool1d(x, kernel_size=3, stride=2, ceil_mode=true)"),
    ((3, 5), "maxpool1d(x, kernel_size=2, padding=1, ceil_mode=true)"),
    ((3, 8), "avgpool1d(x, kernel_size=3, stride=2, ceil_mode=true)"),
    ((3, 5), "avgpool1d(x, kernel_size=2, padding=1, ceil_mode=true)"),
    ((3, 7), "adaptive_avgpool1d(x, output_size=3)"),
    ((3, 8, 7), "maxpool2d(x, kernel_size=3, stride=2, ceil_mode=true)"),
    ((3, 5, 4), "maxpool2d(x, kernel_size=2, padding=1, ceil_mode=true)"),
    ((3, 8, 7), "avgpool2d(x, kernel_size=(3, 2), stride=2, ceil_mode=true)"),
]


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
@pytest.mark.parametrize("in_shape, call", SHAPES)
def test_inferred_shape_equals_kernel_and_torch_output(platform: str, in_shape, call: str):
    """The shape rule's output (ceil mode's last-window rule included) is what the kernels
    make (tests/runtime/test_kernels.py compares them with torch.nn), and the parameters and buffers
    present are exactly those of the registry's torch.nn class, with its shapes."""
    from unroller.runtime import gpu, ipu

    kernels = {"gpu": gpu, "ipu": ipu}[platform]
    text = f"""
    model m {{
        input x: f32[N, {", ".join(map(str, in_shape))}]
        y = {call}
        z = flatten(y)
        t = linear(z, out_features=1)
        loss = mse_loss(t, t)
        return loss
    }}"""
    node = graph_from_text(text, "m.txt").node("y")
    x = torch.randn(2, *in_shape)
    layer = []
    if node.op.module is not None:
        spec, env = node.op.module, {**node.args, **node.derived}
        cls = getattr(torch.nn, spec.cls.rsplit(".", 1)[1])
        module = cls(*(env[a] for a in spec.args), **{k: env[k] for k in spec.kwargs})
        state = module.state_dict()
        for t in (*node.params, *node.buffers):
            assert (t.name in state) == t.present, t.name
            if t.present:
                assert tuple(t.shape) == tuple(state[t.name].shape), t.name
        layer = [module]
    out = getattr(kernels, node.op.name)(x, *layer, **node.kernel_kwargs)
    out = out[0] if isinstance(out, tuple) else out
    assert (2, *node.output.type.shape[1:]) == tuple(out.shape)
