"""Kernels of the gpu platform against torch.nn / torch.nn.functional and torch.autograd.

Everything runs in float64: forwards must equal torch's (rel. error <= 1e-12, usually exact)
and gradients must match autograd's to rel. error <= 1e-10. Tests run on the CPU, and also on
CUDA when it is available.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from unroller.runtime import gpu as K

DT = torch.float64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FWD_TOL = 1e-12
BWD_TOL = 1e-10


@pytest.fixture(params=DEVICES)
def dev(request) -> str:
    torch.manual_seed(1234)
    return request.param


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    return ((a - b).norm() / max(b.norm().item(), 1e-300)).item()


def assert_fwd(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert rel(ours, ref.detach()) <= FWD_TOL


def assert_grads(ours, refs, needs=None) -> None:
    needs = needs if needs is not None else (True,) * len(refs)
    assert len(ours) == len(needs)
    for i, (o, r, n) in enumerate(zip(ours, refs, needs)):
        if not n:
            assert o is None, f"gradient {i} computed but not needed"
            continue
        assert o is not None, f"gradient {i} missing"
        assert rel(o, r) <= BWD_TOL, f"gradient {i}: rel error {rel(o, r)}"


def rand(*shape, dev: str, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT, device=dev).requires_grad_(grad)


def autograd(out: torch.Tensor, leaves, g: torch.Tensor | None = None):
    g = torch.randn_like(out) if g is None else g
    return g, torch.autograd.grad(out, leaves, g)


class AtenCalls(TorchDispatchMode):
    """Records the aten ops (and their args) called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket.__name__), args))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- convolutions

CONV_CASES = [
    # cin, cout, kernel, stride, padding, dilation, groups, bias
    (4, 6, (3, 2), (2, 1), (1, 2), (1, 2), 2, True),
    (4, 4, (3, 3), (1, 1), (1, 1), (1, 1), 4, False),  # depthwise
    (3, 5, (1, 3), (1, 2), (0, 1), (2, 1), 1, True),
    (2, 3, (2, 2), (2, 2), (0, 0), (1, 1), 1, False),
]


@pytest.mark.parametrize("cin,cout,k,s,p,d,groups,bias", CONV_CASES)
def test_conv2d(dev, cin, cout, k, s, p, d, groups, bias):
    m = nn.Conv2d(cin, cout, k, s, p, d, groups, bias).to(dev, DT)
    x = rand(2, cin, 7, 6, dev=dev)
    ref = m(x)
    params = [m.weight] + ([m.bias] if bias else [])
    g, ref_grads = autograd(ref, [x, *params])
    kw = dict(stride=s, padding=p, dilation=d, groups=groups)
    with torch.no_grad():
        y = K.conv2d(x, m.weight, m.bias, **kw)
        needs = (True, True, bias)
        grads = K.conv2d_backward(g, x, m.weight, **kw, needs=needs)
    assert_fwd(y, ref)
    assert_grads(grads, list(ref_grads) + [None] * (3 - len(ref_grads)), needs)


CONVT_CASES = [
    # cin, cout, kernel, stride, padding, output_padding, dilation, groups, bias
    (4, 6, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 2, True),
    (3, 2, (3, 2), (2, 3), (1, 0), (1, 2), (1, 1), 1, False),
    (2, 4, (2, 3), (2, 2), (0, 1), (1, 0), (2, 1), 2, True),
    (4, 4, (3, 3), (2, 1), (1, 1), (0, 0), (1, 1), 4, False),  # depthwise
]


@pytest.mark.parametrize("cin,cout,k,s,p,op,d,groups,bias", CONVT_CASES)
def test_conv_transpose2d(dev, cin, cout, k, s, p, op, d, groups, bias):
    m = nn.ConvTranspose2d(cin, cout, k, s, p, op, groups, bias, d).to(dev, DT)
    x = rand(2, cin, 5, 4, dev=dev)
    ref = m(x)
    params = [m.weight] + ([m.bias] if bias else [])
    g, ref_grads = autograd(ref, [x, *params])
    kw = dict(stride=s, padding=p, output_padding=op, dilation=d, groups=groups)
    with torch.no_grad():
        y = K.conv_transpose2d(x, m.weight, m.bias, **kw)
        needs = (True, True, bias)
        grads = K.conv_transpose2d_backward(g, x, m.weight, **kw, needs=needs)
    assert_fwd(y, ref)
    assert_grads(grads, list(ref_grads) + [None] * (3 - len(ref_grads)), needs)


@pytest.mark.parametrize(
    "needs", [(False, True, False), (True, False, False), (False, False, True), (False,) * 3]
)
def test_conv2d_needs_mask(dev, needs):
    m = nn.Conv2d(3, 4, 3, padding=1).to(dev, DT)
    x = rand(2, 3, 5, 5, dev=dev)
    g, ref_grads = autograd(m(x), [x, m.weight, m.bias])
    kw = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    with torch.no_grad(), AtenCalls() as calls:
        grads = K.conv2d_backward(g, x, m.weight, **kw, needs=needs)
    assert_grads(grads, ref_grads, needs)
    masks = [list(a[-1]) for name, a in calls.calls if name == "convolution_backward"]
    assert masks == ([list(needs)] if any(needs) else [])


# ---------------------------------------------------------------- linear


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (2, 2, 3, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(dev, shape, bias):
    m = nn.Linear(4, 3, bias=bias).to(dev, DT)
    x = rand(*shape, dev=dev)
    ref = m(x)
    params = [m.weight] + ([m.bias] if bias else [])
    g, ref_grads = autograd(ref, [x, *params])
    with torch.no_grad():
        y = K.linear(x, m.weight, m.bias)
        needs = (True, True, bias)
        grads = K.linear_backward(g, x, m.weight, needs=needs)
    assert_fwd(y, ref)
    assert_grads(grads, list(ref_grads) + [None] * (3 - len(ref_grads)), needs)
    with torch.no_grad():
        only_w = K.linear_backward(g, x, m.weight, needs=(False, True, False))
    assert_grads(only_w, ref_grads[:2] + (None,), (False, True, False))


# ---------------------------------------------------------------- batch norm


def _bn_pair(dev, momentum, affine=True):
    ref = nn.BatchNorm2d(3, eps=1e-3, momentum=momentum, affine=affine).to(dev, DT)
    with torch.no_grad():
        if affine:
            ref.weight.copy_(torch.rand(3) + 0.5)
            ref.bias.copy_(torch.randn(3))
        ref.running_mean.copy_(torch.randn(3))
        ref.running_var.copy_(torch.rand(3) + 0.5)
        ref.num_batches_tracked.fill_(4)
    bufs = [b.detach().clone() for b in (ref.running_mean, ref.running_var)]
    nbt = ref.num_batches_tracked.detach().clone()
    return ref, bufs, nbt


@pytest.mark.parametrize("momentum", [0.2, None])
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm2d_train(dev, momentum, affine):
    ref, (rm, rv), nbt = _bn_pair(dev, momentum, affine)
    ref.train()
    x = rand(4, 3, 5, 4, dev=dev)
    out = ref(x)
    leaves = [x] + ([ref.weight, ref.bias] if affine else [])
    g, ref_grads = autograd(out, leaves)
    kw = dict(eps=1e-3, momentum=momentum)
    with torch.no_grad():
        y, save_mean, save_invstd = K.batchnorm2d(x, ref.weight, ref.bias, rm, rv, nbt, **kw)
        needs = (True, True, True) if affine else (True,)
        grads = K.batchnorm2d_backward(g, x, ref.weight, save_mean, save_invstd, **kw, needs=needs)
    assert_fwd(y, out)
    # exact on the CPU; on CUDA torch takes cuDNN's batch norm, which rounds differently
    assert_fwd(rm, ref.running_mean)
    assert_fwd(rv, ref.running_var)
    if dev == "cpu":
        assert torch.equal(rm, ref.running_mean) and torch.equal(rv, ref.running_var)
    assert torch.equal(nbt, ref.num_batches_tracked) and nbt.item() == 5
    assert_grads(grads, ref_grads, needs)


def test_batchnorm2d_needs_mask(dev):
    ref, (rm, rv), nbt = _bn_pair(dev, 0.1)
    x = rand(4, 3, 3, 3, dev=dev)
    g, ref_grads = autograd(ref(x), [x, ref.weight, ref.bias])
    with torch.no_grad():
        _, sm, si = K.batchnorm2d(x, ref.weight, ref.bias, rm, rv, nbt, eps=1e-3, momentum=0.1)
        for needs in [(False, True, True), (True, False, False), (False, False, True)]:
            grads = K.batchnorm2d_backward(
                g, x, ref.weight, sm, si, eps=1e-3, momentum=0.1, needs=needs
            )
            assert_grads(grads, ref_grads, needs)


def test_batchnorm2d_eval(dev):
    ref, (rm, rv), nbt = _bn_pair(dev, 0.1)
    ref.eval()
    x = rand(2, 3, 4, 4, dev=dev, grad=False)
    before = [t.clone() for t in (rm, rv, nbt)]
    with torch.no_grad():
        y = K.batchnorm2d_eval(x, ref.weight, ref.bias, rm, rv, nbt, eps=1e-3, momentum=0.1)
    assert_fwd(y, ref(x))
    assert all(torch.equal(a, b) for a, b in zip(before, (rm, rv, nbt)))


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize(
    "name,ref_fn,kw,saves_output",
    [
        ("relu", torch.relu, {}, True),
        ("sigmoid", torch.sigmoid, {}, True),
        ("tanh", torch.tanh, {}, True),
        ("gelu", lambda x: F.gelu(x), {"approximate": "none"}, False),
        ("gelu", lambda x: F.gelu(x, approximate="tanh"), {"approximate": "tanh"}, False),
        ("leaky_relu", lambda x: F.leaky_relu(x, 0.1), {"negative_slope": 0.1}, False),
        ("leaky_relu", lambda x: F.leaky_relu(x, 0.0), {"negative_slope": 0.0}, False),
    ],
)
def test_activations(dev, name, ref_fn, kw, saves_output):
    x = rand(3, 4, 5, dev=dev)
    ref = ref_fn(x)
    g, ref_grads = autograd(ref, [x])
    with torch.no_grad():
        y = getattr(K, name)(x, **kw)
        saved = y if saves_output else x
        grads = getattr(K, name + "_backward")(g, saved, **kw, needs=(True,))
        assert getattr(K, name + "_backward")(g, saved, **kw, needs=(False,)) == (None,)
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)


# ---------------------------------------------------------------- pooling


@pytest.mark.parametrize(
    "k,s,p", [((3, 3), (2, 2), (1, 1)), ((2, 3), (1, 2), (1, 1)), ((2, 2), (2, 2), (0, 0))]
)
def test_maxpool2d(dev, k, s, p):
    x = rand(2, 3, 9, 8, dev=dev)
    ref, ref_idx = F.max_pool2d(x, k, s, p, return_indices=True)
    plain = nn.MaxPool2d(k, s, p)(x)
    g, ref_grads = autograd(plain, [x])
    kw = dict(kernel_size=k, stride=s, padding=p)
    with torch.no_grad():
        y, idx = K.maxpool2d(x, **kw)
        grads = K.maxpool2d_backward(g, idx, **kw, input_hw=(9, 8), needs=(True,))
    assert torch.equal(y, plain.detach()) and torch.equal(idx, ref_idx)
    assert_grads(grads, ref_grads)


@pytest.mark.parametrize(
    "k,s,p,hw",
    [
        ((2, 2), (2, 2), (0, 0), (9, 8)),
        ((3, 2), (3, 2), (1, 0), (10, 7)),
        ((2, 2), (3, 3), (0, 0), (8, 8)),
    ],
)
def test_maxpool2d_mask_gives_the_same_gradient_bit_for_bit(dev, k, s, p, hw):
    """Non-overlapping windows: a 1-bit argmax mask replaces the indices exactly, ties too."""
    x = rand(2, 3, *hw, dev=dev)
    x = x.detach().clone()
    x[:, :, :2, :2] = 0.5  # a tie inside the first window
    kw = dict(kernel_size=k, stride=s, padding=p)
    g = rand(*K.maxpool2d(x, **kw)[0].shape, dev=dev)
    with torch.no_grad():
        _, idx = K.maxpool2d(x, **kw)
        want = K.maxpool2d_backward(g, idx, **kw, input_hw=hw, needs=(True,))[0]
        mask = K.maxpool2d_mask(idx, **kw, input_hw=hw)
        got = K.maxpool2d_backward(g, mask, **kw, input_hw=hw, needs=(True,))[0]
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert int(mask.sum()) == idx.numel()
    assert torch.equal(got, want)


def test_relu_and_leaky_relu_accept_masks_bit_for_bit(dev):
    x = rand(3, 4, 5, dev=dev).detach().clone()
    x[0, 0, :3] = 0.0
    g = rand(3, 4, 5, dev=dev)
    with torch.no_grad():
        y = K.relu(x)
        assert torch.equal(
            K.relu_backward(g, K.relu_mask(y), needs=(True,))[0],
            K.relu_backward(g, y, needs=(True,))[0],
        )
        a = K.leaky_relu_backward(g, x, negative_slope=0.2, needs=(True,))[0]
        m = K.leaky_relu_mask(x, negative_slope=0.2)
        assert torch.equal(K.leaky_relu_backward(g, m, negative_slope=0.2, needs=(True,))[0], a)


@pytest.mark.parametrize(
    "k,s,p", [((3, 2), (2, 1), (1, 1)), ((2, 2), (2, 2), (0, 0)), ((3, 3), (1, 1), (1, 1))]
)
def test_avgpool2d(dev, k, s, p):
    x = rand(2, 3, 7, 6, dev=dev)
    ref = nn.AvgPool2d(k, s, p)(x)
    g, ref_grads = autograd(ref, [x])
    kw = dict(kernel_size=k, stride=s, padding=p)
    with torch.no_grad():
        y = K.avgpool2d(x, **kw)
        grads = K.avgpool2d_backward(g, **kw, input_hw=(7, 6), needs=(True,))
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)
    assert grads[0].is_contiguous()


@pytest.mark.parametrize("in_hw,out_hw", [((7, 5), (1, 1)), ((7, 5), (3, 2)), ((8, 8), (4, 4))])
def test_adaptive_avgpool2d(dev, in_hw, out_hw):
    x = rand(2, 3, *in_hw, dev=dev)
    ref = nn.AdaptiveAvgPool2d(out_hw)(x)
    g, ref_grads = autograd(ref, [x])
    with torch.no_grad():
        y = K.adaptive_avgpool2d(x, output_size=out_hw)
        grads = K.adaptive_avgpool2d_backward(g, output_size=out_hw, input_hw=in_hw, needs=(True,))
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)


@pytest.mark.parametrize(
    "scale,mode,align",
    [
        (2.0, "nearest", None),
        (1.5, "nearest", None),
        ((2.0, 1.5), "nearest", None),
        (2.0, "bilinear", False),
        (2.0, "bilinear", True),
        (1.5, "bilinear", False),
        (1.5, "bilinear", True),
        ((1.5, 3.0), "bilinear", False),
    ],
)
def test_upsample(dev, scale, mode, align):
    x = rand(2, 3, 5, 4, dev=dev)
    ref = nn.Upsample(scale_factor=scale, mode=mode, align_corners=align)(x)
    g, ref_grads = autograd(ref, [x])
    sf = tuple(float(v) for v in scale) if isinstance(scale, tuple) else (scale, scale)
    kw = dict(scale_factor=sf, mode=mode, align_corners=bool(align))
    with torch.no_grad():
        y = K.upsample(x, **kw)
        grads = K.upsample_backward(g, **kw, input_hw=(5, 4), needs=(True,))
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)


def test_shape_only_backwards_take_no_activation():
    for name in ["avgpool2d_backward", "adaptive_avgpool2d_backward", "upsample_backward"]:
        params = list(inspect.signature(getattr(K, name)).parameters.values())
        positional = [p.name for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
        assert positional == ["g"], name
        assert "input_hw" in [p.name for p in params]


# ---------------------------------------------------------------- arithmetic and shapes


def test_add_mul(dev):
    a, b = rand(2, 3, 4, dev=dev), rand(2, 3, 4, dev=dev)
    ref = a + b
    g, ref_grads = autograd(ref, [a, b])
    with torch.no_grad():
        assert torch.equal(K.add(a, b), ref.detach())
        assert_grads(K.add_backward(g, needs=(True, True)), ref_grads)
        assert_grads(K.add_backward(g, needs=(False, True)), ref_grads, (False, True))
    ref = a * b
    g, ref_grads = autograd(ref, [a, b])
    with torch.no_grad():
        assert torch.equal(K.mul(a, b), ref.detach())
        assert_grads(K.mul_backward(g, a, b, needs=(True, True)), ref_grads)
        assert_grads(K.mul_backward(g, a, b, needs=(True, False)), ref_grads, (True, False))


def test_mul_same_tensor(dev):
    a = rand(3, 4, dev=dev)
    ref = a * a
    g, (ref_ga,) = autograd(ref, [a])
    with torch.no_grad():
        y = K.mul(a, a)
        ga, gb = K.mul_backward(g, a, a, needs=(True, True))
    assert torch.equal(y, ref.detach())
    assert rel(ga + gb, ref_ga) <= BWD_TOL


def test_concat(dev):
    xs = [rand(2, n, 3, 2, dev=dev) for n in (2, 3, 1)]
    ref = torch.cat(xs, 1)
    g, ref_grads = autograd(ref, xs)
    with torch.no_grad():
        y = K.concat(*xs, dim=1)
        grads = K.concat_backward(g, dim=1, sizes=(2, 3, 1), needs=(True, True, True))
        some = K.concat_backward(g, dim=1, sizes=(2, 3, 1), needs=(False, True, False))
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)
    assert_grads(some, ref_grads, (False, True, False))


@pytest.mark.parametrize("start_dim", [1, 2])
def test_flatten(dev, start_dim):
    x = rand(2, 3, 4, 5, dev=dev)
    ref = nn.Flatten(start_dim)(x)
    g, ref_grads = autograd(ref, [x])
    with torch.no_grad():
        y = K.flatten(x, start_dim=start_dim)
        grads = K.flatten_backward(g, input_shape=(3, 4, 5), needs=(True,))
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)


@pytest.mark.parametrize("shape", [(-1,), (4, -1), (6, 2, 5), (-1, 3, 2)])
def test_reshape(dev, shape):
    x = rand(2, 3, 4, 5, dev=dev)
    ref = x.reshape(2, *shape)
    g, ref_grads = autograd(ref, [x])
    with torch.no_grad():
        y = K.reshape(x, shape=shape)
        grads = K.reshape_backward(g, input_shape=(3, 4, 5), needs=(True,))
    assert torch.equal(y, ref.detach())
    assert_grads(grads, ref_grads)


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("p", [0.3, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(4, 50), (2, 3, 5, 4)])
def test_dropout_same_draws(dev, p, shape):
    x = rand(*shape, dev=dev)
    torch.manual_seed(7)
    ref = nn.Dropout(p).train()(x)
    g, ref_grads = autograd(ref, [x])
    torch.manual_seed(7)
    with torch.no_grad():
        y, mask = K.dropout(x, p=p)
        grads = K.dropout_backward(g, mask, p=p, needs=(True,))
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert torch.equal(y, ref.detach())
    assert torch.equal(grads[0], ref_grads[0])
    assert K.dropout_backward(g, mask, p=p, needs=(False,)) == (None,)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_p_edges(dev, p):
    x = rand(3, 4, dev=dev)
    ref = nn.Dropout(p).train()(x)
    g, ref_grads = autograd(ref, [x])
    with torch.no_grad():
        y, mask = K.dropout(x, p=p)
        grads = K.dropout_backward(g, mask, p=p, needs=(True,))
    assert torch.equal(y, ref.detach())
    assert torch.equal(grads[0], ref_grads[0])


def test_dropout_eval(dev):
    x = rand(3, 4, dev=dev, grad=False)
    assert torch.equal(K.dropout_eval(x, p=0.5), nn.Dropout(0.5).eval()(x))


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy(dev, ignore):
    logits = rand(6, 5, dev=dev)
    target = torch.randint(0, 5, (6,), device=dev)
    if ignore:
        target[2] = -100
    ref = F.cross_entropy(logits, target)
    g, ref_grads = autograd(ref, [logits])
    with torch.no_grad():
        loss, log_probs = K.cross_entropy(logits, target)
        grads = K.cross_entropy_backward(g, log_probs, target, needs=(True, False))
        none = K.cross_entropy_backward(g, log_probs, target, needs=(False, False))
    assert loss.dim() == 0 and torch.equal(loss, ref.detach())
    assert_grads(grads, [ref_grads[0], None], (True, False))
    assert none == (None, None)


def _bce_args(dev):
    p = torch.sigmoid(torch.randn(4, 5, dtype=DT, device=dev)).requires_grad_()
    t = torch.rand(4, 5, dtype=DT, device=dev).requires_grad_()
    return p, t


@pytest.mark.parametrize(
    "name,ref_fn,make",
    [
        ("mse_loss", F.mse_loss, lambda d: (rand(4, 5, dev=d), rand(4, 5, dev=d))),
        ("l1_loss", F.l1_loss, lambda d: (rand(4, 5, dev=d), rand(4, 5, dev=d))),
        ("bce_loss", F.binary_cross_entropy, _bce_args),
        ("bce_with_logits", F.binary_cross_entropy_with_logits, _bce_args),
    ],
)
def test_losses(dev, name, ref_fn, make):
    a, b = make(dev)
    ref = ref_fn(a, b)
    g, ref_grads = autograd(ref, [a, b], torch.tensor(1.7, dtype=DT, device=dev))
    with torch.no_grad():
        loss = getattr(K, name)(a, b)
        back = getattr(K, name + "_backward")
        grads = back(g, a, b, needs=(True, True))
        only_a = back(g, a, b, needs=(True, False))
        only_b = back(g, a, b, needs=(False, True))
    assert loss.dim() == 0
    assert_fwd(loss, ref)
    assert_grads(grads, ref_grads)
    assert_grads(only_a, ref_grads, (True, False))
    assert_grads(only_b, ref_grads, (False, True))


def test_mse_loss_same_tensor_args(dev):
    a = rand(3, 4, dev=dev)
    b = torch.tanh(a)
    ref = F.mse_loss(a, b)
    g, (ref_ga,) = autograd(ref, [a])
    with torch.no_grad():
        ga, gb = K.mse_loss_backward(g, a, b, needs=(True, True))
        (ga_tanh,) = K.tanh_backward(gb, b, needs=(True,))
    assert rel(ga + ga_tanh, ref_ga) <= BWD_TOL


# ---------------------------------------------------------------- helpers


def test_accumulate(dev):
    p = nn.Parameter(torch.randn(3, 4, dtype=DT, device=dev))
    ref = nn.Parameter(p.detach().clone())
    x1, x2 = rand(3, 4, dev=dev, grad=False), rand(3, 4, dev=dev, grad=False)
    (ref * x1).sum().backward()
    (ref * x2).sum().backward()
    K.accumulate(p, None)
    assert p.grad is None
    g1, g2 = x1.clone(), x2.clone()
    K.accumulate(p, g1)
    assert p.grad is not g1 and p.grad.data_ptr() != g1.data_ptr()
    first = p.grad
    K.accumulate(p, g2)
    assert p.grad is first  # added in place, as AccumulateGrad does
    assert torch.equal(g1, x1)  # the first gradient was not written into
    assert p.grad.dtype == DT and not p.grad.requires_grad
    assert rel(p.grad, ref.grad) <= BWD_TOL


def test_accumulate_shared_gradient(dev):
    a = nn.Parameter(torch.zeros(2, 3, dtype=DT, device=dev))
    b = nn.Parameter(torch.zeros(2, 3, dtype=DT, device=dev))
    g = torch.randn(2, 3, dtype=DT, device=dev)
    ga, gb = K.add_backward(g, needs=(True, True))
    K.accumulate(a, ga)
    K.accumulate(b, gb)
    K.accumulate(a, torch.ones_like(g))
    assert torch.equal(b.grad, g) and torch.equal(a.grad, g + 1)


TRICKY_PATHS = [
    "layer1.0.conv1",
    "layer1.0.bn1",
    "forward.training.double",
    "class.predict",
    "0.1",
    "double",
    "lambda",
]


def _build(dev) -> nn.Module:
    root = nn.Module()
    for path in TRICKY_PATHS:
        mod = nn.BatchNorm2d(2) if path.endswith("bn1") else nn.Linear(2, 3)
        K.add_layer(root, path, mod.to(dev, torch.float32))
    return root


def test_add_layer_tricky_names(dev):
    root = _build(dev)
    keys = set(root.state_dict())
    for path in TRICKY_PATHS:
        names = ["running_mean", "num_batches_tracked"] if path.endswith("bn1") else ["bias"]
        assert {f"{path}.weight"} | {f"{path}.{n}" for n in names} <= keys
    assert callable(root.forward) and callable(root.double)  # methods are not shadowed
    other = _build(dev)
    for t in other.state_dict().values():
        if t.is_floating_point():
            t.zero_()
    other.load_state_dict(root.state_dict(), strict=True)
    for k, v in root.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
    with pytest.raises(ValueError):
        K.add_layer(root, "a..b", nn.Linear(1, 1))


def test_tensors_after_double(dev):
    root = _build(dev)
    before = K.tensors(root)
    assert set(before) == set(root.state_dict())
    root.double()
    after = K.tensors(root)
    assert all(t.dtype == torch.float64 for k, t in after.items() if "num_batches" not in k)
    assert after["layer1.0.bn1.running_mean"] is root.layer1._modules["0"].bn1.running_mean
    assert after["class.predict.weight"] is root._modules["class"].predict.weight
    assert isinstance(after["class.predict.weight"], nn.Parameter)


def test_names():
    ops = """conv2d conv_transpose2d linear batchnorm2d relu sigmoid tanh gelu leaky_relu
        maxpool2d avgpool2d adaptive_avgpool2d upsample add mul concat flatten reshape dropout
        cross_entropy mse_loss l1_loss bce_loss bce_with_logits""".split()
    for op in ops:
        assert callable(getattr(K, op)) and callable(getattr(K, op + "_backward"))
    for name in ["batchnorm2d_eval", "dropout_eval", "accumulate", "add_layer", "tensors"]:
        assert callable(getattr(K, name))
    assert set(K.__all__) == {*ops, *(op + "_backward" for op in ops)} | {
        "batchnorm2d_eval",
        "dropout_eval",
        "accumulate",
        "add_layer",
        "tensors",
        "check_inputs",
    }
