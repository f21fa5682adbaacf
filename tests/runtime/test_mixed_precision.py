"""``--precision``: what each precision computes, checked against autograd.

A mixed precision (bf16-mixed, fp16-mixed) follows torch.autocast's policy with its casts
written out as statements; a plain one (bf16, fp16) moves everything to the low dtype. The
accuracy contract (tests/precision_contract.py): against a float64 reference, a mixed
step's loss and every gradient are no worse than autograd under torch.autocast on the same
network; a plain one's no worse than autograd on the module moved to that dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import fast_subset
from precision_contract import violations
from torch import nn

import unroller
from unroller.api import generate_from_text, graph_from_text
from unroller.bench.reference.registry import BENCHMARKS
from unroller.compiler.options import Options
from unroller.errors import OptionValueError

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


def _net_class(tmp_path, precision: str, **options):
    from unroller.materialize import materialize

    graph = graph_from_text(NET, "net.txt", precision=precision)
    from unroller.api import compression_config

    opts = Options(precision=precision, **options)
    return materialize(
        graph, "net.txt", opts, compression_config(opts, graph), folder=tmp_path, readable=False
    ).Model


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 12, 16, generator=gen), torch.randint(0, 5, (4, 12), generator=gen)


# ---------------------------------------------------------------- the graph


def test_mixed_precision_casts_follow_the_registry_classes():
    graph = graph_from_text(NET, "net.txt", precision="bf16-mixed")
    types = {n.name: (n.op.name, n.output.type.dtype, n.cast_params) for n in graph.nodes}
    assert types["x.bf16"] == ("cast", "bf16", "")  # a linear runs in the low dtype
    assert types["fc1"] == ("linear", "bf16", "bf16")  # its weights through the cast cache
    assert types["act"] == ("gelu", "bf16", "")  # promote: its input's dtype
    assert types["fc2.f32"] == ("cast", "f32", "")  # add(f32, bf16) promotes to float32
    assert types["norm"] == ("layernorm", "f32", "")  # fp32 class
    # the loss on bf16 logits: cross_entropy's low_precision op, float32 inside, no cast
    assert types["loss"] == ("cross_entropy_low", "f32", "")
    params = [p.dtype for n in graph.nodes for p in n.params]
    assert params and set(params) == {"f32"}  # master weights
    assert graph.precision == "bf16-mixed"


def test_fp32_writes_no_cast_and_plain_bf16_relabels_everything():
    fp32 = graph_from_text(NET, "net.txt")
    assert not [n for n in fp32.nodes if n.op.name == "cast"]
    bf16 = graph_from_text(NET, "net.txt", precision="bf16")
    assert not [n for n in bf16.nodes if n.op.name == "cast"]
    assert {n.output.type.dtype for n in bf16.nodes} == {"bf16"}
    assert {p.dtype for n in bf16.nodes for p in n.params} == {"bf16"}


def test_generated_code_writes_each_cast_and_records_the_precision():
    source = generate_from_text(NET, Options(precision="fp16-mixed"), "net.txt")
    assert '"precision": "fp16-mixed"' in source.splitlines()[0]
    assert 'x_f16 = K.cast(x, dtype="f16")' in source
    assert 'L.cast("fc1", torch.float16)' in source
    assert "K.loss_seed(loss, scaler)" in source
    assert "def forward(self, x, y, scaler=None):" in source
    fp32 = generate_from_text(NET, Options(), "net.txt")
    assert "cast" not in fp32 and "scaler" not in fp32


@pytest.mark.parametrize("bad", ["bf17", "BF16-MIXED", "fp32; import os", "", None, 16])
def test_an_unknown_precision_is_refused(bad):
    with pytest.raises(OptionValueError, match="precision"):
        Options(precision=bad)


def test_ipu_refuses_bfloat16_with_the_reason():
    with pytest.raises(OptionValueError, match="no bfloat16"):
        Options(platform="ipu", precision="bf16-mixed")


def test_a_statement_named_like_a_cast_keeps_its_name():
    text = NET.replace("    r = add(x, fc2)", "    fc2.f32 = relu(fc2)\n    r = add(x, fc2)")
    graph = graph_from_text(text, "net.txt", precision="bf16-mixed")
    names = [n.name for n in graph.nodes]
    assert len(names) == len(set(names))
    assert graph.node("fc2.f32").op.name == "relu"
    assert graph.node("fc2.f32_2").op.name == "cast"


# ---------------------------------------------------------------- the step


def _reference(model) -> nn.Module:
    """The same network in torch.nn, with the generated module's weights."""

    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
            self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 5)

        def forward(self, x, y):
            r = x + self.fc2(nn.functional.gelu(self.fc1(x)))
            head = self.head(self.norm(r))
            return nn.functional.cross_entropy(head.permute(0, 2, 1), y)

    ref = Ref()
    ref.load_state_dict(model.state_dict())
    return ref


def _tensors(loss, net: nn.Module) -> dict:
    """The loss and every parameter gradient, by name: what the contract compares."""
    return {"loss": loss, **{k: p.grad for k, p in net.named_parameters()}}


def _float64_reference(ref: nn.Module, batch) -> dict:
    ref64 = copy.deepcopy(ref).double()
    loss = ref64(*[t.double() if t.is_floating_point() else t for t in batch])
    loss.backward()
    return _tensors(loss, ref64)


def _autocast_peer(ref: nn.Module, batch, dtype) -> dict:
    peer = copy.deepcopy(ref)
    with torch.autocast("cpu", dtype=dtype):
        loss = peer(*batch)
    loss.backward()
    return _tensors(loss, peer)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_step_keeps_the_accuracy_contract(tmp_path, precision):
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    model = _net_class(tmp_path, precision)()
    ref = _reference(model)
    batch = _batch()
    loss = model(*batch)
    assert loss.dtype == torch.float32
    ours = _tensors(loss, model)
    assert all(g.dtype == torch.float32 for g in ours.values())
    reference = _float64_reference(ref, batch)
    low = "bf16" if precision == "bf16-mixed" else "f16"
    assert not violations(ours, _autocast_peer(ref, batch, dtype), reference, low)
    assert float((loss.double() - reference["loss"]).abs()) > 0  # it did round


def test_the_contract_fails_a_step_that_rounds_twice(tmp_path, monkeypatch):
    """The criterion is not vacuous: a cast that is 3% off (a wrong scale) breaks it."""
    from unroller.runtime import precision as kernels

    real = kernels.cast

    def twice(x, *, dtype):
        if dtype == "bf16":
            x = x * 1.03
        return real(x, dtype=dtype)

    model = _net_class(tmp_path, "bf16-mixed")()
    ref = _reference(model)
    batch = _batch()
    monkeypatch.setattr(kernels, "cast", twice)
    import unroller.runtime.gpu as K

    monkeypatch.setattr(K, "cast", twice)
    ours = _tensors(model(*batch), model)
    peer = _autocast_peer(ref, batch, torch.bfloat16)
    assert violations(ours, peer, _float64_reference(ref, batch))


def test_an_ambient_autocast_of_the_same_dtype_changes_nothing(tmp_path):
    model = _net_class(tmp_path, "bf16-mixed")()
    batch = _batch()
    plain = model(*batch)
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = model(*batch)
    assert torch.equal(plain, inside)
    assert all(torch.equal(a, p.grad) for a, p in zip(plain_grads, model.parameters()))


def test_an_ambient_autocast_of_another_dtype_is_refused_naming_the_precision(tmp_path):
    model = _net_class(tmp_path, "bf16-mixed")()
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError) as info:
        model(*_batch())
    message = str(info.value)
    assert "\n" not in message and "--precision fp16-mixed" in message
    assert all(p.grad is None for p in model.parameters())


def test_a_plain_bf16_step_runs_in_bf16_and_takes_float32_batches(tmp_path):
    model = _net_class(tmp_path, "bf16")()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    batch = _batch()
    loss = model(*batch)  # float32 x: cast on the way in
    assert loss.dtype == torch.bfloat16
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.predict(batch[0]).dtype == torch.bfloat16
    ours = _tensors(loss, model)
    ref = _reference(model.float())
    peer = copy.deepcopy(ref).bfloat16()
    peer_loss = peer(batch[0].bfloat16(), batch[1])
    peer_loss.backward()
    assert not violations(ours, _tensors(peer_loss, peer), _float64_reference(ref, batch))


# ---------------------------------------------------------------- GradScaler


def test_fp16_mixed_with_a_grad_scaler_matches_the_unscaled_gradients(tmp_path):
    model = _net_class(tmp_path, "fp16-mixed")()
    batch = _batch()
    model(*batch)
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(*batch, scaler=scaler)
    assert loss.dtype == torch.float32  # the loss itself, not the scaled loss
    scaler.unscale_(opt)
    for a, p in zip(plain, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=2e-2, atol=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_an_overflow_skips_the_update_as_under_autograd(tmp_path):
    model = _net_class(tmp_path, "fp16-mixed")()
    ref = _reference(model)
    batch = _batch()
    results = []
    for run in ("ours", "autograd"):
        net = model if run == "ours" else ref
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)  # float16 overflows
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        before = [p.detach().clone() for p in net.parameters()]
        if run == "ours":
            net(*batch, scaler=scaler)
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = net(*batch)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, net.parameters()))
        results.append((unchanged, scaler.get_scale()))
    assert results[0] == results[1] == (True, 2.0**59)


# ---------------------------------------------------------------- benchmark models


@pytest.mark.parametrize(
    "name", fast_subset(sorted(BENCHMARKS), fast=("gpt_tiny", "quick", "tcn_small"))
)
def test_benchmark_models_keep_the_contract(tmp_path, name):
    """Every benchmark model (at the quick preset's input size), bf16-mixed."""
    bench = BENCHMARKS[name]
    resolution = bench.quick_resolution
    torch.manual_seed(0)
    ref = bench.build(resolution)
    options = Options(precision="bf16-mixed", resolution=resolution)
    model = bench.model_class(options, tmp_path, readable=False)()
    model.load_state_dict(ref.state_dict())
    batch = bench.make_batch(2, resolution)
    torch.manual_seed(1)  # the same dropout masks in all three runs
    ours = _tensors(model(*batch), model)
    ref64 = copy.deepcopy(ref).double()
    torch.manual_seed(1)
    loss64 = ref64(*[t.double() if t.is_floating_point() else t for t in batch])[0]
    loss64.backward()
    peer = copy.deepcopy(ref)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peer_loss = peer(*batch)[0]
    peer_loss.backward()
    assert not violations(ours, _tensors(peer_loss, peer), _tensors(loss64, ref64))


def test_unroll_takes_precision_and_a_scaler():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = unroller.unroll(net, x, y, precision="fp16-mixed")
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    loss = step(x, y, scaler=scaler)
    assert loss.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in net.parameters())
    plain = unroller.unroll(net, x, y)
    with pytest.raises(TypeError, match="mixed-precision"):
        plain(x, y, scaler=scaler)


def test_the_memory_model_counts_the_cast_cache_and_the_low_precision_activations():
    from unroller.api import simulate

    fp32, mixed = (simulate(NET, Options(precision=p), 8) for p in ("fp32", "bf16-mixed"))
    lower_weights = (16 * 32 + 32) + (32 * 16 + 16) + (16 * 5 + 5)  # fc1, fc2, head
    assert mixed.param_grad_bytes - fp32.param_grad_bytes == 2 * lower_weights
    assert mixed.stash_bytes < fp32.stash_bytes
