"""Batch norm in generated code follows its module's train/eval flag, as torch's does.

In eval mode (every batch norm, ``model.eval()``; or some, the model in train mode: a
frozen-BN fine-tune) a layer normalises with its running statistics, updates nothing
(``num_batches_tracked`` included) and its backward is eval-mode batch norm's: the loss,
every gradient and every buffer equal torch.autograd's on the torch.nn reference with the
same flags, float64, to 1e-10 relative, over two steps, on gpu and on ipu (the CPU
emulation), plain, with ``--recompute`` and with segment recompute; under a lossy scheme
the loss stays exact and the gradients within the scheme's bound. The layers left in train
mode keep updating their statistics as torch's. The kernels on their own: eval forward,
backward, recompute, batchnorm1d's views, the backward in pieces, ``track_running_stats``
off, sync batch norm in eval mode. ``unroller.unroll`` of a torchvision-like ResNet-18
in eval mode and in a frozen-BN fine-tune gives autograd's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_grads_close, rel_err
from suite_steps import flat_grads
from torch import nn

import unroller
from unroller.api import compression_config, load_graph
from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.options import Options
from unroller.materialize import materialize
from unroller.parallel.data import SYNC_ATTR
from unroller.runtime import gpu, ipu, ipu_device

TOL = 1e-10
STEM = "tiny_resnet"  # a stem batch norm and two residual blocks of two each
SOME = ("bn1", "layer1.0.bn2")  # a frozen-BN fine-tune: these in eval, the model in train
KERNELS = {"gpu": gpu, "ipu": ipu}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """generated(options) -> the Model class of tiny_resnet, made once per options here
    (unformatted: these modules are run, never read)."""
    folder = tmp_path_factory.mktemp("bn_modes")
    graph = load_graph(model_path(STEM))
    made: dict[str, type] = {}

    def get(options: Options) -> type:
        key = repr(options)
        if key not in made:
            made[key] = materialize(
                graph,
                f"{STEM}.txt",
                options,
                compression_config(options, graph),
                folder=folder,
                file_name=f"m{len(made)}.py",
                module_name=f"bn_modes_{len(made)}_{{digest}}",
                readable=False,
                keep_module=False,
            ).Model
        return made[key]

    return get


@pytest.fixture
def emulated():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    return {p: m for p, m in model.named_modules() if "running_mean" in m._buffers}


def _pair(Model: type) -> tuple[nn.Module, nn.Module]:
    """(generated, reference) in float64 with the same weights and running statistics far
    from their initial 0 and 1, so that eval mode differs from a plain affine map."""
    torch.manual_seed(0)
    ref = REFERENCES[STEM]().double()
    with torch.no_grad():
        for layer in _norms(ref).values():
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 2.0)
            layer.num_batches_tracked.fill_(5)
    gen = Model().double()
    gen.load_state_dict(ref.state_dict())
    return gen, ref


def _set_modes(model: nn.Module, frozen: str) -> tuple[str, ...]:
    """``frozen`` "all": ``model.eval()``; "some": the model in train mode, SOME in eval.
    Returns the paths of the batch norms in eval mode."""
    if frozen == "all":
        model.eval()
        return tuple(_norms(model))
    model.train()
    for path in SOME:
        model.get_submodule(path).eval()
    return SOME


def _step(gen: nn.Module, ref: nn.Module, batch: int, seed: int):
    """One step of both on the same batch: (loss, reference loss); the ipu module's
    surrogate loss is backpropagated, its gradient being the unrolled one."""
    inputs = make_inputs(STEM, batch, seed=seed)
    ref_loss = ref(*inputs)[0]
    ref_loss.backward()
    out = gen(*inputs)
    if isinstance(out, tuple):  # ipu: (surrogate, loss)
        out[0].backward()
        out = out[1]
    return out, ref_loss


def _assert_buffers(gen, ref, frozen_paths, before) -> None:
    """Every buffer as the reference's; the eval-mode layers' exactly as they were, the
    train-mode layers' moved."""
    ref_buffers = dict(ref.named_buffers())
    for name, buf in gen.named_buffers():
        want = ref_buffers[name]
        if buf.is_floating_point():
            assert rel_err(buf, want) <= TOL, name
        else:
            assert torch.equal(buf, want), name
        frozen = name.rpartition(".")[0] in frozen_paths
        assert torch.equal(buf, before[name]) == frozen, (name, frozen)


def _options(platform: str, route: str, scheme: str = "nocompress") -> Options:
    extra = {"plain": {}, "recompute": {"recompute": True}}.get(route)
    if extra is None:  # segment recompute of every block instance
        extra = {"recompute_segments": ("blocks",)}
    return Options(platform=platform, scheme=scheme, **extra)


@pytest.mark.parametrize("frozen", ["all", "some"])
@pytest.mark.parametrize("route", ["plain", "recompute", "segments"])
@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_eval_mode_batch_norm_is_autograds(generated, emulated, platform, route, frozen):
    gen, ref = _pair(generated(_options(platform, route)))
    paths = _set_modes(ref, frozen)
    assert _set_modes(gen, frozen) == paths
    before = {k: v.clone() for k, v in gen.state_dict().items() if "running" in k or "num" in k}
    for seed in range(2):  # gradients accumulate; the train-mode statistics move twice
        loss, ref_loss = _step(gen, ref, 3, seed)
        assert rel_err(loss, ref_loss) <= TOL, (seed, float(loss), float(ref_loss))
    assert_grads_close(gen, ref, TOL)
    _assert_buffers(gen, ref, paths, before)


@pytest.mark.parametrize(
    "platform, scheme",
    [("gpu", "dct-dense"), ("gpu", "quant"), ("ipu", "dct-dense"), ("ipu", "quant")],
)
def test_a_lossy_scheme_in_eval_mode(generated, emulated, monkeypatch, platform, scheme):
    """The forward is exact, so the loss is; the gradients carry the kept tensors' error:
    quant's within 2% on every parameter, dct's (coarse on these 32 x 32 random maps: a
    batch norm's weight gradient is ~50% off, as in train mode) within 6% on the whole
    gradient. Batch 10: on gpu the lossy backward of the stem's batch norm runs in pieces."""
    pieces = []
    whole = gpu._batchnorm_eval_backward

    def spy(g, *args):
        pieces.append(args[-2] < g.shape[0])  # step < batch
        return whole(g, *args)

    monkeypatch.setattr(gpu, "_batchnorm_eval_backward", spy)
    gen, ref = _pair(generated(_options(platform, "plain", scheme)))
    paths = _set_modes(ref, "all")
    _set_modes(gen, "all")
    before = {k: v.clone() for k, v in gen.state_dict().items() if "running" in k or "num" in k}
    loss, ref_loss = _step(gen, ref, 10, 0)
    assert rel_err(loss, ref_loss) <= TOL
    if scheme == "quant":
        assert_grads_close(gen, ref, 0.02)
    else:
        assert 0 < rel_err(flat_grads(gen), flat_grads(ref)) <= 0.06
    _assert_buffers(gen, ref, paths, before)
    assert any(pieces) == (platform == "gpu"), pieces


# -- the kernels on their own ---------------------------------------------------------------


def _layer(dims: int, affine: bool = True, track: bool = True) -> nn.Module:
    torch.manual_seed(1)
    cls = nn.BatchNorm2d if dims == 4 else nn.BatchNorm1d
    layer = cls(3, affine=affine, track_running_stats=track).double()
    with torch.no_grad():
        if affine:
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
        if track:
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 2.0)
    return layer.eval()


def _kernel_step(K, dims: int, layer: nn.Module, x: torch.Tensor, g: torch.Tensor, **kwargs):
    """The platform's forward and backward of one batch norm: (y, gradients)."""
    name = "batchnorm2d" if dims == 4 else "batchnorm1d"
    y, mean, invstd = getattr(K, name)(x, layer)
    grads = getattr(K, f"{name}_backward")(g.clone(), x, layer, mean, invstd, **kwargs)
    return y, grads


def _autograd(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    twin = copy.deepcopy(layer)
    xx = x.clone().requires_grad_()
    y = twin(xx)
    y.backward(g)
    params = [] if twin.weight is None else [twin.weight.grad, twin.bias.grad]
    return y.detach(), [xx.grad, *params], twin


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(5, 3, 4, 6), (5, 3, 7), (5, 3)])
@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_eval_kernels_are_autograds(platform, shape, affine):
    K, dims = KERNELS[platform], len(shape)
    layer = _layer(dims, affine)
    x = torch.randn(shape, dtype=torch.float64)
    g = torch.randn(shape, dtype=torch.float64)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    y, grads = _kernel_step(K, dims, layer, x, g)
    want_y, want, twin = _autograd(layer, x, g)
    assert rel_err(y, want_y) <= TOL
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) <= TOL
    for k, v in layer.state_dict().items():
        assert torch.equal(v, state[k]), k  # nothing updated, as the eval-mode twin
        assert torch.equal(v, twin.state_dict()[k]), k
    name = "batchnorm2d" if dims == 4 else "batchnorm1d"
    assert torch.equal(getattr(K, f"{name}_recompute")(x, layer), y)  # the same output again


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_without_running_statistics_eval_mode_uses_the_batchs(platform):
    """track_running_stats=False: batch statistics in both modes, as torch."""
    layer = _layer(4, track=False)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    g = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    y, grads = _kernel_step(KERNELS[platform], 4, layer, x, g)
    want_y, want, _ = _autograd(layer, x, g)
    assert rel_err(y, want_y) <= TOL
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) <= TOL


@pytest.mark.parametrize("in_place", [False, True])
def test_the_eval_backward_in_pieces_is_the_whole_batchs(in_place):
    layer = _layer(4)
    x = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    g = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    piece = 2 * 3 * 4 * 4 * 8  # two samples a piece: 2 + 2 + 2 + 1
    _, grads = _kernel_step(gpu, 4, layer, x, g, piece_bytes=piece, in_place=in_place)
    _, want, _ = _autograd(layer, x, g)
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) <= TOL
    _, needs_x = _kernel_step(gpu, 4, layer, x, g, piece_bytes=piece, needs=(True, False, False))
    assert needs_x[1] is None and needs_x[2] is None and rel_err(needs_x[0], want[0]) <= TOL


def test_sync_batch_norm_in_eval_mode_is_plain_eval_batch_norm():
    """As nn.SyncBatchNorm in eval mode: no statistics cross processes (none run here: a
    call reaching torch.distributed would fail)."""
    layer = _layer(4)
    setattr(layer, SYNC_ATTR, object())
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    g = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    y, grads = _kernel_step(gpu, 4, layer, x, g)
    want_y, want, _ = _autograd(layer, x, g)
    assert rel_err(y, want_y) <= TOL
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) <= TOL
    assert torch.equal(gpu.batchnorm2d_recompute(x, layer), y)


# -- unroller.unroll: a torchvision-like ResNet-18 -------------------------------------------


@pytest.fixture(scope="module")
def resnet_step(tmp_path_factory):
    from import_zoo import resnet18

    torch.manual_seed(0)
    net = resnet18(num_classes=5, width=4).double()
    with torch.no_grad():
        for layer in _norms(net).values():
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 5, (2,))
    step = unroller.unroll(net, x, y, directory=tmp_path_factory.mktemp("unrolled"))
    return net, step, x, y


@pytest.mark.parametrize("frozen", ["all", "some"])
def test_unroll_follows_each_batch_norms_flag(resnet_step, frozen):
    net, step, x, y = resnet_step
    net.zero_grad(set_to_none=True)
    net.train()
    if frozen == "all":
        net.eval()
        paths = tuple(_norms(net))
    else:  # the usual frozen-BN fine-tune of detection and segmentation: every batch norm
        paths = tuple(p for p in _norms(net) if p != "layer4.1.bn2")  # but one
        for path in paths:
            net.get_submodule(path).eval()
    twin = copy.deepcopy(net)
    before = {k: v.clone() for k, v in net.named_buffers()}
    loss = step(x, y)
    want = F.cross_entropy(twin(x), y)
    want.backward()
    assert rel_err(loss, want) <= TOL
    assert_grads_close(net, twin, TOL)
    twin_buffers = dict(twin.named_buffers())
    for name, buf in net.named_buffers():
        assert rel_err(buf, twin_buffers[name]) <= TOL, name
        assert torch.equal(buf, before[name]) == (name.rpartition(".")[0] in paths), name
