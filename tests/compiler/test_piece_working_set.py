"""The backward working set under lossy schemes (``Platform.piece_bytes``): batch norm and
convolution backward in pieces of the batch, inputs restored a piece at a time, input
gradients written in place or added into the gradient so far, and the memory model of it.

A CNN's step peaks in the backward of its first, largest stage, where the stash is already
compressed: what sets the peak there is the full-size tensors the backward holds beside it.
These tests check that the kernels compute the same gradients (float64: the summation order
changes, to about 1e-15), that the generated step does (the same model and scheme with and
without pieces), and that the memory model still predicts the measured peak.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from analysis.test_memory_plan import assert_model_brackets_the_measured_peak
from conftest import fast_subset, rel_err

import unroller.runtime.gpu as K
from unroller import compress as C
from unroller.analysis.memory import simulate_graph
from unroller.api import generate_from_text, graph_from_text, simulate
from unroller.compiler import platforms
from unroller.compiler.options import Options

TOL = 1e-10
ROOT = Path(__file__).resolve().parents[2]
RESNET_LIKE = (ROOT / "tests" / "models" / "resnet_like.txt").read_text()


def _batchnorm(shape: tuple[int, ...], affine: bool) -> torch.nn.Module:
    kind = torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d
    layer = kind(shape[1], affine=affine).double()
    if affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-1.0, 1.0)
    return layer


@pytest.mark.parametrize("shape", [(7, 3, 5, 4), (6, 4, 9), (9, 5)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_batchnorm_backward_in_pieces_matches_autograd(shape, affine, in_place):
    """Pieces of 1, 2 and 3 samples (the last one shorter) against torch.autograd in float64;
    ``in_place`` writes the input gradient into the output gradient it was given."""
    torch.manual_seed(0)
    layer = _batchnorm(shape, affine)
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).requires_grad_()
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    want = [x.grad] + ([layer.weight.grad, layer.bias.grad] if affine else [])
    with torch.no_grad():
        _, mean, invstd = K.batchnorm2d(x.detach(), _batchnorm(shape, affine))
        sample = x[0].numel() * x.element_size()
        for per in (1, 2, 3):
            given = g.clone()
            got = K.batchnorm2d_backward(
                given, x.detach(), layer, mean, invstd, piece_bytes=per * sample, in_place=in_place
            )
            assert (got[0].data_ptr() == given.data_ptr()) == in_place
            for a, b in zip(got, want):
                assert rel_err(a, b) <= TOL
            assert got[1:] == (None, None) or affine


def test_batchnorm_backward_reads_a_restored_input_piece_by_piece():
    """A RestoredInPieces input gives the gradients of its decompressed tensor; without
    pieces (``piece_bytes`` 0, or a batch of one piece) the kernel is aten's, bit for bit."""
    torch.manual_seed(1)
    x = torch.randn(6, 4, 16, 16, dtype=torch.float64)
    codec = C.make("dct")
    packed = codec.compress(x)
    restored = codec.decompress(packed, (4, 16, 16), torch.float64)
    layer = _batchnorm(x.shape, True)
    with torch.no_grad():
        _, mean, invstd = K.batchnorm2d(restored, _batchnorm(x.shape, True))
        g = torch.randn_like(x)
        whole = K.batchnorm2d_backward(g, restored, layer, mean, invstd)
        lazy = K.restore_in_pieces(codec, packed, (4, 16, 16), torch.float64)
        pieces = K.batchnorm2d_backward(g.clone(), lazy, layer, mean, invstd, piece_bytes=20000)
        for a, b in zip(pieces, whole):
            assert rel_err(a, b) <= TOL
        one = K.batchnorm2d_backward(g, lazy, layer, mean, invstd, piece_bytes=1 << 30)
        assert all(torch.equal(a, b) for a, b in zip(one, whole))


@pytest.mark.parametrize("name", ["dct", "quant"])
def test_a_packed_form_decompresses_piece_by_piece(name):
    """Compressors pack each sample on its own: rows of the packed tensors are the packed
    form of those samples, which is what restoring a piece at a time reads."""
    torch.manual_seed(2)
    codec = C.make(name)
    x = torch.randn(7, 3, 12, 10)
    packed = codec.compress(x)
    whole = codec.decompress(packed, (3, 12, 10), torch.float32)
    lazy = K.restore_in_pieces(codec, packed, (3, 12, 10), torch.float32)
    assert lazy.shape == x.shape and lazy.dtype == torch.float32
    assert torch.allclose(lazy.narrow(0, 2, 3), whole[2:5], rtol=1e-6, atol=1e-6)
    assert torch.equal(lazy.whole(), whole)


@pytest.mark.parametrize("mask", [False, True])
def test_relu_backward_in_place_is_the_same_kernel(mask):
    torch.manual_seed(3)
    y = torch.relu(torch.randn(4, 6, dtype=torch.float64))
    saved = y > 0 if mask else y
    g = torch.randn(4, 6, dtype=torch.float64)
    want = K.relu_backward(g, saved)[0]
    given = g.clone()
    (got,) = K.relu_backward(given, saved, in_place=True)
    assert got.data_ptr() == given.data_ptr() and torch.equal(got, want)


def test_conv_backward_in_place_on_a_restored_input():
    """Same-shape convolution: the input gradient overwrites ``g`` piece by piece, from an
    input restored a piece at a time."""
    torch.manual_seed(4)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    x = torch.randn(5, 4, 8, 8, dtype=torch.float64)
    codec = C.make("quant")
    packed = codec.compress(x)
    restored = codec.decompress(packed, (4, 8, 8), torch.float64)
    g = torch.randn(5, 4, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        whole = K.conv2d_backward(g, restored, conv, padding=(1, 1))
        lazy = K.restore_in_pieces(codec, packed, (4, 8, 8), torch.float64)
        given = g.clone()
        two = 2 * 4 * 8 * 8 * 8
        got = K.conv2d_backward(given, lazy, conv, padding=(1, 1), piece_bytes=two, in_place=True)
    assert got[0].data_ptr() == given.data_ptr()
    for a, b in zip(got, whole):
        assert rel_err(a, b) <= 1e-13


def test_piece_samples_keeps_the_weight_gradient_worth_its_sums():
    assert K.piece_samples(16, 256 * 1024, 1 << 20) == 4  # 1 MiB of 256 KiB samples
    assert K.piece_samples(16, 256 * 1024, 0) == 16  # 0: whole
    assert K.piece_samples(16, 32 * 1024, 1 << 20, weight_bytes=9 << 20) == 16
    assert K.piece_samples(1, 1 << 30, 1) == 1


def _platform(monkeypatch, piece_bytes: int) -> None:
    """The gpu platform with pieces of ``piece_bytes`` (0: none), for what is generated next."""
    gpu = dataclasses.replace(platforms.GPU, piece_bytes=piece_bytes)
    monkeypatch.setitem(platforms.PLATFORMS, "gpu", gpu)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 32 KiB, so that the small test models split their batch."""
    _platform(monkeypatch, 32 * 1024)


def test_generated_resnet_uses_every_measure(small_pieces):
    text = generate_from_text(RESNET_LIKE, Options(scheme="dct-dense"))
    for marker in ("piece_bytes=32768", "K.restore_in_pieces(", "in_place=True", "add_into="):
        assert marker in text, marker
    assert ".add_(grad_x)" in text  # the residual's sum made in the new part


STEMS = ["resnet_like", "all_ops", "fanout", "unet_like", "autoencoder", "nonsquare"]
PAIRS = [(stem, scheme) for stem in STEMS for scheme in ("dct-dense", "quant")]


@pytest.mark.parametrize(
    "stem, scheme",
    fast_subset(
        PAIRS, [("resnet_like", "dct-dense"), ("all_ops", "quant"), ("fanout", "dct-dense")]
    ),
)
def test_generated_step_in_pieces_equals_the_whole_step(build, monkeypatch, stem, scheme):
    """Float64, pieces of about one sample: the step with every working-set measure (pieces,
    restored pieces, in place, added into the gradient so far or into the new part) gives
    the loss, gradients and running statistics of the same scheme's step without them."""
    from unroller.analysis.inputs import make_inputs

    path = ROOT / "tests" / "models" / f"{stem}.txt"
    modules = []
    for piece_bytes in (1024, 0):
        _platform(monkeypatch, piece_bytes)
        modules.append(build(path, Options(scheme=scheme)).Model().double())
    lean, whole = modules
    whole.load_state_dict(lean.state_dict())
    graph = graph_from_text(path.read_text(), path.name)
    for step in range(2):
        inputs = make_inputs(graph, 5, step)
        assert rel_err(lean(*inputs), whole(*inputs)) <= TOL
    grads = [(n, a.grad, b.grad) for (n, a), b in zip(lean.named_parameters(), whole.parameters())]
    assert all((a is None) == (b is None) for _, a, b in grads)
    largest = max(b.norm() for _, _, b in grads if b is not None)
    for name, a, b in grads:
        if b is not None:  # one zero in exact arithmetic (a batch norm's bias before another
            # batch norm) is rounding noise: judged against the step's largest gradient
            scale = b.norm() if b.norm() > 1e-9 * largest else largest
            assert (a - b).norm() <= TOL * scale, name
    for (name, a), b in zip(lean.named_buffers(), whole.buffers()):
        assert rel_err(a.double(), b.double()) <= TOL, name


@pytest.mark.parametrize("scheme", ["dct-dense", "quant"])
def test_memory_model_predicts_the_step_in_pieces(small_pieces, scheme):
    """The ResNet-like net at batch 24, where every stage runs in pieces."""
    graph = graph_from_text(RESNET_LIKE, "resnet_like.txt")
    config = Options(scheme=scheme).compression(graph)
    assert_model_brackets_the_measured_peak(graph, config, 24)


def test_resnet34_per_sample_peak_is_under_an_eighth_of_the_stash_kept_raw():
    """The memory model of ResNet-34 on 32x32 images: bytes per extra sample of the step peak
    (batch 8 to 16) under dct-dense against nocompress's, which keeps what autograd keeps
    (measured: the same 6.1 MiB per sample as autograd's step)."""
    text = (ROOT / "benchmarks" / "models" / "resnet34.txt").read_text()

    def per_sample(scheme: str) -> float:
        peaks = [simulate(text, Options(scheme=scheme), n).peak_bytes for n in (8, 16)]
        return (peaks[1] - peaks[0]) / 8

    assert 8 * per_sample("dct-dense") <= per_sample("nocompress")


def test_nothing_changes_for_nocompress_or_the_ipu():
    graph = graph_from_text(RESNET_LIKE, "resnet_like.txt")
    for options in (Options(scheme="nocompress"), Options(platform="ipu", scheme="dct-dense")):
        text = generate_from_text(RESNET_LIKE, options)
        for marker in ("piece_bytes", "in_place", "add_into", "restore_in_pieces", ".add_("):
            assert marker not in text, (options, marker)
    plain = simulate_graph(graph, Options(scheme="nocompress").compression(graph), 4)
    assert plain.peak_bytes > 0
