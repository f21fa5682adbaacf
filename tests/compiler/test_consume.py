"""Backward kernels that consume a saved extra of their own (registry ``backward_consumes``):
cross entropy writes the logits' gradient into the log-probabilities its forward made and
nothing else reads, instead of aten's two logits-sized tensors (the nll gradient, then
log_softmax's input gradient). Once a transformer's layers run in pieces that backward is
the step's peak, so the memory model counts the gradient in that storage. Beside it, at
the same height, the copies aten makes of logits permuted from a head's [N, L, C] (the
forward's log_softmax input, linear's output gradient in the backward), which the memory
model counts too.

The kernel computes aten's products in another order (float64: within 1e-15 of aten's, not
bit for bit), so, like ``backward_in_place``, the code generator passes ``consume=True``
only where it shrinks the backward working set: under lossy schemes on a platform with
``piece_bytes``; nocompress stays op for op autograd's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from analysis.test_memory_plan import assert_model_brackets_the_measured_peak
from conftest import rel_err

import unroller.runtime.gpu as K
from unroller.analysis.memory import simulate_graph
from unroller.api import generate_from_text, graph_from_text
from unroller.compiler import platforms
from unroller.compiler.options import Options

TOL = 1e-10
IGNORE = -100

#: token logits [N, C, L] as a transformer head makes them, with label smoothing
TOKENS = """model tokens {
    input x: f32[N, 6, 8]
    target y: i64[N, 6]
    h = linear(x, out_features=16)
    r = relu(h)
    head = linear(r, out_features=11)
    logits = permute(head, dims=(0, 2, 1))
    loss = cross_entropy(logits, y, label_smoothing=LS)
    return loss
}
"""


def _case(shape: tuple[int, ...], ignored: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 logits of ``shape`` and targets: some ignored, none or all."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, dtype=torch.float64, generator=gen) * 3
    target = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=gen)
    if ignored == "some":
        target.view(-1)[::3] = IGNORE
    elif ignored == "all":
        target.fill_(IGNORE)
    return logits, target


@pytest.mark.parametrize("shape", [(7, 5), (4, 9, 3), (3, 6, 2, 4)])
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_consuming_kernel_matches_autograd(shape, ignored, label_smoothing):
    """The gradient written into log_probs equals torch.autograd's to 1e-10 relative (all
    targets ignored: zero, as autograd's and the kernel's without ``consume``)."""
    logits, target = _case(shape, ignored, seed=len(shape))
    x = logits.clone().requires_grad_(True)
    g = torch.tensor(1.7, dtype=torch.float64)
    loss = F.cross_entropy(x, target, ignore_index=IGNORE, label_smoothing=label_smoothing)
    (expected,) = torch.autograd.grad(loss, x, g)
    kwargs = {"ignore_index": IGNORE, "label_smoothing": label_smoothing}
    _, log_probs = K.cross_entropy(logits, target, **kwargs)
    (whole,) = K.cross_entropy_backward(g, log_probs.clone(), target, **kwargs)
    (got,) = K.cross_entropy_backward(g, log_probs, target, **kwargs, consume=True)
    assert got.data_ptr() == log_probs.data_ptr()  # made in the consumed storage
    if ignored == "all":
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(whole, got)
        assert torch.equal(expected, got)
    else:
        assert rel_err(got, expected) <= TOL
        assert rel_err(got, whole) <= TOL


def test_consume_leaves_needs_alone():
    logits, target = _case((5, 4), "some", seed=0)
    _, log_probs = K.cross_entropy(logits, target)
    g = torch.tensor(1.0, dtype=torch.float64)
    got = K.cross_entropy_backward(g, log_probs, target, consume=True, needs=(False, False))
    assert all(t is None for t in got)
    assert torch.equal(log_probs, K.cross_entropy(logits, target)[1])  # not touched


def _tokens(label_smoothing: float) -> str:
    return TOKENS.replace("LS", repr(label_smoothing))


def test_flag_emitted_under_lossy_schemes_only():
    text = _tokens(0.1)
    assert "consume=True" in generate_from_text(text, Options(scheme="quant"))
    # nocompress mirrors autograd's kernels; the IPU's graph compiler plans memory itself
    for options in (Options(scheme="nocompress"), Options(platform="ipu", scheme="quant")):
        assert "consume=" not in generate_from_text(text, options), options


def test_flag_not_emitted_for_a_logit_gradient_nobody_needs():
    """Logits made of no parameter: nothing to consume log_probs for."""
    text = """model bare {
    input x: f32[N, 5]
    target y: i64[N]
    loss = cross_entropy(x, y)
    return loss
}
"""
    assert "consume=" not in generate_from_text(text, Options(scheme="quant"))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_generated_step_with_and_without_consume(build, monkeypatch, label_smoothing):
    """Float64, the same lossy scheme with and without the working-set measures (piece_bytes
    0: neither ``consume`` nor pieces): the same loss and gradients to 1e-10."""
    from unroller.analysis.inputs import make_inputs

    text = _tokens(label_smoothing)
    modules, sources = [], []
    for piece_bytes in (1 << 20, 0):
        gpu = dataclasses.replace(platforms.GPU, piece_bytes=piece_bytes)
        monkeypatch.setitem(platforms.PLATFORMS, "gpu", gpu)
        sources.append(generate_from_text(text, Options(scheme="quant")))
        modules.append(build(text, Options(scheme="quant")).Model().double())
    assert "consume=True" in sources[0] and "consume=" not in sources[1]
    lean, whole = modules
    whole.load_state_dict(lean.state_dict())
    graph = graph_from_text(text, "tokens.txt")
    for step in range(2):
        inputs = list(make_inputs(graph, 5, step))
        inputs[1].view(-1)[::4] = IGNORE
        assert rel_err(lean(*inputs), whole(*inputs)) <= TOL
    for (name, a), b in zip(lean.named_parameters(), whole.parameters()):
        assert rel_err(a.grad, b.grad) <= TOL, name


def _loss_backward(events: list) -> tuple:
    """The event of the loss's backward step and the one before it."""
    at = next(
        i for i, e in enumerate(events) if e.section == "backward" and e.label.startswith("loss")
    )
    return events[at - 1], events[at]


def test_memory_model_counts_the_gradient_in_log_probs(monkeypatch):
    """Under quant the loss backward makes no logits-sized tensor: while it runs the step
    holds what it held before (log_probs turns into the gradient, stash no more), where
    without ``consume`` it holds two more logits-sized tensors."""
    graph = graph_from_text(_tokens(0.0), "tokens.txt")
    config = Options(scheme="quant").compression(graph)
    logits = 64 * 11 * 6 * 4
    found = []
    for piece_bytes in (1 << 20, 0):
        gpu = dataclasses.replace(platforms.GPU, piece_bytes=piece_bytes)
        monkeypatch.setitem(platforms.PLATFORMS, "gpu", gpu)
        found.append(_loss_backward(simulate_graph(graph, config, 64).events))
    (before, lean), (_, whole) = found
    assert lean.during_bytes <= before.live_bytes
    assert lean.stash_bytes + logits == before.stash_bytes
    assert whole.during_bytes - lean.during_bytes >= logits


@pytest.mark.parametrize("scheme", ["nocompress", "quant"])
def test_memory_model_counts_the_copies_of_reordered_logits(scheme):
    """Logits permuted from a head's [N, L, C]: cross_entropy keeps that layout (no copy in
    the forward) and hands back a gradient that permutes back contiguous (no copy in
    linear's backward); the model, counting neither, brackets the measured peak."""
    graph = graph_from_text(_tokens(0.0), "tokens.txt")
    assert_model_brackets_the_measured_peak(graph, Options(scheme=scheme).compression(graph), 64)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("consume", [False, True])
def test_token_logits_keep_their_layout(label_smoothing, consume):
    """A token head's logits [N, L, C] seen as [N, C, L] (classes innermost in memory): the
    log-probabilities keep that layout, and the logits' gradient, with or without
    ``consume``, permutes back to a contiguous [N, L, C] tensor (the head's linear backward
    then copies nothing); loss and gradient as autograd's in float64 to 1e-10, ignored
    targets included. Logits already [N, C, L]-contiguous take aten's kernels as before."""
    head = torch.randn(3, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 5, (3, 7), generator=torch.Generator().manual_seed(2))
    target.view(-1)[::3] = IGNORE
    leaf = head.clone().requires_grad_()
    ref = F.cross_entropy(leaf.permute(0, 2, 1), target, label_smoothing=label_smoothing)
    ref.backward()
    loss, log_probs = K.cross_entropy(
        head.permute(0, 2, 1), target, label_smoothing=label_smoothing
    )
    assert log_probs.movedim(1, -1).is_contiguous()
    (grad,) = K.cross_entropy_backward(
        torch.ones((), dtype=torch.float64),
        log_probs,
        target,
        label_smoothing=label_smoothing,
        needs=(True,),
        consume=consume,
    )
    assert grad.permute(0, 2, 1).is_contiguous()
    assert rel_err(loss, ref) <= TOL and rel_err(grad.permute(0, 2, 1), leaf.grad) <= TOL
    plain, plain_lp = K.cross_entropy(head.permute(0, 2, 1).contiguous(), target)
    assert plain_lp.is_contiguous()
    nothing = torch.full_like(target, IGNORE)  # every target ignored: nan, as torch's
    assert torch.isnan(K.cross_entropy(head.permute(0, 2, 1), nothing)[0])
    assert torch.isnan(F.cross_entropy(head.permute(0, 2, 1), nothing))
