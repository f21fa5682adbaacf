"""The benchmark networks (benchmarks/models/*.txt) against their torch.nn references
(unroller.bench.reference, ``BENCHMARKS``).

For every benchmark, at batch 2 and a reduced resolution (the small ResNets at their
native 32), in float64: the generated gpu module has the reference's state-dict keys
(same order, strict load both ways); one training step gives the loss, every parameter gradient and the
batch-norm running statistics of autograd on the reference to 1e-10 relative; and the
reference's ``forward_checkpointed`` gives what its plain ``forward`` gives, running
every stage again in backward. Also: the registry, the synthetic batches, and
OpticalDamage at other resolutions (its size-dependent model text).

The reference's autograd step is computed once per model and shared by the two tests
that compare against it (ResNet-34's float64 step takes seconds on two cores).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from conftest import rel_err

from unroller.api import at_resolution, graph_from_text
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.options import Options
from unroller.compiler.parser import parse

TOL = 1e-10
DROPOUT_SEED = 7  # seeded right before each forward: MobileNetV2's classifier has dropout
BATCH = 2
# Reduced resolutions for the float64 checks, small enough that the module stays within
# `make test`'s budget (ResNet-34 at its native 32 took most of it); the small ResNets
# keep their native 32, so both the resized and the declared size are checked.
TEST_RESOLUTION = {
    "resnet34": 16,
    "quick": 32,
    "resnet_like": 32,
    "emdenoise": 32,
    "slstrcloud": 16,
    "unet_like": 16,
    "opticaldamage": 16,
    # the spec-v2 models run at their declared size (a position embedding, a 1-D length)
    "vit_tiny": 32,
    "gpt_tiny": 64,
    # the larger transformers at a shorter sequence (their text rewritten to it): the same
    # layers and widths, a fraction of the float64 work
    "gpt_small": 32,
    "bert_encoder": 32,
    "tcn_small": 128,
    "mobilenet_v2": 32,
}
STEMS = sorted(BENCHMARKS)
# Same keys, another order: nn.TransformerEncoderLayer registers self_attn and linear1/2
# before norm1/norm2, which the model file (statement order) computes first.
KEY_ORDER_DIFFERS = {"gpt_tiny", "gpt_small", "bert_encoder"}
# ResNet-34 (21M parameters) is the same ResNet family as quick and resnet_like; its
# float64 steps run with SLOW=1 (`make test-slow`) so `make test` stays within budget.
HEAVY = ("resnet34",)
CHECKED = [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in STEMS]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """generated(name) -> the generated gpu ``Model`` class at TEST_RESOLUTION (cached)."""
    cache: dict[str, type] = {}

    def get(name: str):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            options = Options(resolution=TEST_RESOLUTION[name])
            cache[name] = BENCHMARKS[name].model_class(options, directory, readable=False)
        return cache[name]

    return get


def batch64(name: str, seed: int = 0) -> list[torch.Tensor]:
    batch = BENCHMARKS[name].make_batch(BATCH, TEST_RESOLUTION[name], seed)
    return [t.double() if t.is_floating_point() else t for t in batch]


@dataclass
class ReferenceStep:
    """One float64 autograd step of a reference from its default weights."""

    initial: dict[str, torch.Tensor]  # the state dict before the step
    batch: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]  # (loss, *preds), detached
    model: torch.nn.Module  # after the step: gradients in .grad, running stats moved


@pytest.fixture(scope="module")
def reference_step():
    """reference_step(name) -> ReferenceStep (cached per model)."""
    cache: dict[str, ReferenceStep] = {}

    def get(name: str) -> ReferenceStep:
        if name not in cache:
            torch.manual_seed(0)
            ref = BENCHMARKS[name].build(TEST_RESOLUTION[name]).double()
            initial = copy.deepcopy(ref.state_dict())
            batch = batch64(name)
            torch.manual_seed(DROPOUT_SEED)  # the same dropout draws in every run
            outputs = ref(*batch)
            outputs[0].backward()
            cache[name] = ReferenceStep(initial, batch, tuple(t.detach() for t in outputs), ref)
        return cache[name]

    yield get
    cache.clear()


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Same parameter gradients and buffers (1e-10 relative; integer buffers equal)."""
    b_params = dict(b.named_parameters())
    for name, param in a.named_parameters():
        want = b_params[name].grad
        assert want is not None and param.grad is not None, name
        assert rel_err(param.grad, want) <= TOL, (name, rel_err(param.grad, want))
    b_buffers = dict(b.named_buffers())
    for name, buf in a.named_buffers():
        if buf.is_floating_point():
            assert rel_err(buf, b_buffers[name]) <= TOL, name
        else:
            assert torch.equal(buf, b_buffers[name]), name


# --------------------------------------------------------------------------- registry


def test_registry():
    assert set(BENCHMARKS) == {
        "resnet34",
        "emdenoise",
        "slstrcloud",
        "opticaldamage",
        "quick",
        "resnet_like",
        "unet_like",
        "vit_tiny",
        "gpt_tiny",
        "gpt_small",
        "bert_encoder",
        "tcn_small",
        "mobilenet_v2",
    }
    paper = {"emdenoise": 32, "slstrcloud": 4, "opticaldamage": 8, "resnet34": 32}
    for name, bench in BENCHMARKS.items():
        assert bench.name == name and bench.path.is_file()
        assert bench.label == f"benchmarks/models/{name}.txt"
        if name in paper:
            assert bench.from_paper and bench.paper_batch == paper[name]
        assert bench.valid_resolution(bench.native_resolution)
        assert bench.valid_resolution(bench.quick_resolution)
        assert bench.valid_resolution(TEST_RESOLUTION[name])
        model = parse(bench.path.read_text(), str(bench.path))
        assert model.name == name
        heights = {d.dims[2] for d in model.decls if len(d.dims) == 4}
        lengths = {d.dims[-1] for d in model.decls if len(d.dims) in (2, 3)}  # tokens, steps
        assert heights == {bench.native_resolution} or lengths == {bench.native_resolution}


@pytest.mark.parametrize("name", STEMS)
def test_make_batch(name):
    bench = BENCHMARKS[name]
    resolution = TEST_RESOLUTION[name]
    batch = bench.make_batch(3, resolution, seed=5)
    model = at_resolution(parse(bench.model_text(resolution)), resolution)
    assert len(batch) == len(model.decls)
    for t, decl in zip(batch, model.decls):
        assert tuple(t.shape) == (3, *decl.dims[1:]), decl.name
        assert t.dtype == {"f32": torch.float32, "i64": torch.int64}[decl.dtype]
        assert torch.isfinite(t.double()).all()
    again = bench.make_batch(3, resolution, seed=5)
    other = bench.make_batch(3, resolution, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(batch, again))
    assert not torch.equal(batch[0], other[0])
    x = batch[0]
    if name in ("resnet34", "quick"):
        assert -2.5 < float(x.min()) and float(x.max()) < 2.5
        assert 0 <= int(batch[1].min()) and int(batch[1].max()) < 10
    elif name == "emdenoise":
        noisy, clean = batch
        assert float(clean.min()) >= 0.0 and float(clean.max()) <= 1.0
        assert 0.05 < float((noisy - clean).std()) < 0.2
        # smooth: neighbouring pixels of the clean image differ little
        assert float((clean[..., 1:] - clean[..., :-1]).abs().mean()) < 0.1
    elif name == "slstrcloud":
        mask = batch[1]
        assert set(mask.unique().tolist()) == {0.0, 1.0}
        assert float(x[:, :6].min()) >= 0.0 and float(x[:, :6].max()) <= 1.0
        assert float(x[:, 6:].abs().max()) < 3.0
    elif name == "opticaldamage":
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    native = bench.make_batch(2, None, seed=1)  # None: the size the model file declares
    assert all(t.shape[-1] == bench.native_resolution for t in native if t.dim() == 4)


# --------------------------------------------------------------------------- generated vs reference


@pytest.mark.parametrize("name", CHECKED)
def test_state_dict_keys(generated, name):
    ref = BENCHMARKS[name].build(TEST_RESOLUTION[name])
    gen = generated(name)()
    if name in KEY_ORDER_DIFFERS:
        assert sorted(gen.state_dict()) == sorted(ref.state_dict())
    else:
        assert list(gen.state_dict()) == list(ref.state_dict())
    gen.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(gen.state_dict(), strict=True)


@pytest.mark.parametrize("name", CHECKED)
def test_step_matches_autograd(generated, reference_step, name):
    want = reference_step(name)
    gen = generated(name)().double()
    gen.load_state_dict(want.initial, strict=True)
    torch.manual_seed(DROPOUT_SEED)
    loss = gen(*want.batch)
    assert loss.dim() == 0
    assert rel_err(loss, want.outputs[0]) <= TOL, (float(loss), float(want.outputs[0]))
    assert_same_state(gen, want.model)


@pytest.mark.parametrize("name", CHECKED)
def test_checkpointed_matches_forward(reference_step, name):
    want = reference_step(name)
    bench = BENCHMARKS[name]
    ckpt = bench.build(TEST_RESOLUTION[name]).double()
    ckpt.load_state_dict(want.initial, strict=True)
    calls: dict[str, int] = {}
    segments = bench.segments(ckpt)
    for seg, modules in segments.items():
        calls[seg] = 0

        def hook(module, args, seg=seg):
            calls[seg] += 1

        # a pre-hook: the recomputation in backward stops early, before a stage's last op
        modules[0].register_forward_pre_hook(hook)
    torch.manual_seed(DROPOUT_SEED)
    got = ckpt.forward_checkpointed(*want.batch)
    assert len(got) == len(want.outputs)
    for a, b in zip(got, want.outputs):
        assert rel_err(a, b) <= TOL
    assert all(n == 1 for n in calls.values()), calls
    got[0].backward()
    # every stage ran again during backward, and the running statistics moved once
    assert all(n == 2 for n in calls.values()), calls
    assert_same_state(ckpt, want.model)
    # the stages hold disjoint parameters
    ids = [id(p) for modules in segments.values() for m in modules for p in m.parameters()]
    assert len(ids) == len(set(ids)) > 0


# --------------------------------------------------------------------------- resolutions


def test_opticaldamage_resolutions():
    bench = BENCHMARKS["opticaldamage"]
    assert bench.model_text(None) == bench.path.read_text()
    assert bench.model_text(200) == bench.path.read_text()
    text = bench.model_text(48)
    assert "units=2304, side=12" in text and "f32[N, 1, 48, 48]" in text
    assert text.count("\n") == bench.path.read_text().count("\n")
    for resolution in (4, 48, 64):
        graph = graph_from_text(bench.model_text(resolution), bench.label)
        assert tuple(graph.preds[0].type.shape[1:]) == (1, resolution, resolution)
    for bad in (0, 2, 50, 202, 201):
        assert not bench.valid_resolution(bad)
        with pytest.raises(ValueError, match="multiple of 4"):
            bench.build(bad)
        with pytest.raises(ValueError, match="multiple of 4"):
            bench.make_batch(1, bad, 0)
        # 0 is refused by Options itself, before the model sees it
        with pytest.raises(ValueError, match="multiple of 4" if bad else "resolution=0"):
            bench.generate(Options(resolution=bad))
    with pytest.raises(ValueError, match="multiple of 8"):
        BENCHMARKS["emdenoise"].build(36)


def test_opticaldamage_native_keys_and_shapes(tmp_path):
    """At 200 x 200 the linear layers are 40000 x 512 and 512 x 40000 (41M parameters)."""
    bench = BENCHMARKS["opticaldamage"]
    ref = bench.build()
    gen = bench.model_class(Options(), tmp_path, readable=False)()
    assert ref.decoder.fc.weight.shape == (16 * 50 * 50, 512)
    assert list(gen.state_dict()) == list(ref.state_dict())
    gen.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(gen.state_dict(), strict=True)
