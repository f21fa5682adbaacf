"""The two larger benchmark transformers, gpt_small and bert_encoder, beyond what every
benchmark model gets in tests/networks/test_benchmark_models.py (state-dict keys, a float64 step
against autograd and the checkpointed reference, at a 32-token sequence).

- Their model files parse, and generate on both platforms; the ipu modules pass
  ``unroll lint`` (only PopTorch operations), and one emulated ipu step equals the gpu
  step plus SGD in float64 (gpt_small's under SLOW=1).
- The sequence length rewrite the quick preset relies on: only the input, the target and
  the position embedding change (width and length may be the same number), the file's
  own size gives the file's text, a bad length is one clear error.
- bert_encoder's masked batch: ~15% masked, at least one per sample, the target ignored
  (-100) everywhere else, so its loss is a mean over the masked positions only.
- Slow (SLOW=1): the float64 step against autograd at the full sizes (context 256 and 128
  tokens), and the quant scheme's loss and gradient against the reference's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, fast_subset, rel_err
from typer.testing import CliRunner

from unroller.api import graph_from_text
from unroller.bench.reference import BENCHMARKS
from unroller.bench.reference.batches import MASK_ID
from unroller.bench.reference.sequence import rewrite_context
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.compiler.parser import parse
from unroller.runtime import ipu_device, poptorch_emulation

TOL = 1e-10
NAMES = ("gpt_small", "bert_encoder")
SIZES = {"gpt_small": (256, 256, 6), "bert_encoder": (128, 128, 4)}  # length, width, layers
SGD = dict(lr=0.05, momentum=0.9)


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    yield poptorch_emulation
    ipu_device.use_emulation(False)


def _batch64(name: str, length: int, batch: int = 2) -> list[torch.Tensor]:
    found = BENCHMARKS[name].make_batch(batch, length, seed=3)
    return [t.double() if t.is_floating_point() else t for t in found]


@pytest.mark.parametrize("name", NAMES)
def test_model_files_parse_at_their_sizes(name):
    bench = BENCHMARKS[name]
    length, width, layers = SIZES[name]
    model = parse(bench.path.read_text(encoding="utf-8"), str(bench.path))
    assert model.name == name
    assert [(d.name, d.dtype, d.dims[1:]) for d in model.decls] == [
        ("ids", "i64", (length,)),
        ("y", "i64", (length,)),
    ]
    graph = graph_from_text(bench.model_text(), bench.label)
    assert tuple(graph.preds[0].type.shape[1:]) == (length, 128)  # vocabulary 128
    ref = bench.build()
    assert ref.pos_emb.shape == (length, width) and len(ref.layers) == layers


def test_sequence_rewrite_touches_only_the_length():
    for name in NAMES:
        bench = BENCHMARKS[name]
        text = bench.path.read_text(encoding="utf-8")
        length, width, _ = SIZES[name]
        assert bench.model_text(None) == text and bench.model_text(length) == text
        short = bench.model_text(32)
        assert "i64[N, 32]" in short and f"shape=(32, {width})" in short
        assert short.count("\n") == text.count("\n")
        # everything else (widths, vocabulary, heads) is the file's
        assert short.replace("32", str(length)) == text.replace("32", str(length))
        graph = graph_from_text(short, bench.label)
        assert tuple(graph.preds[0].type.shape[1:]) == (32, 128)
        for bad in (0, 8, 33, 250):
            assert not bench.valid_resolution(bad)
            with pytest.raises(ValueError, match="multiple of 16"):
                bench.build(bad)
            with pytest.raises(ValueError, match="multiple of 16"):
                bench.make_batch(1, bad)
    with pytest.raises(RuntimeError, match="expected one match"):
        rewrite_context("model m {\n}\n", 32)


def test_masked_batch():
    bench = BENCHMARKS["bert_encoder"]
    ids, y = bench.make_batch(64, seed=1)
    assert ids.shape == y.shape == (64, 128) and ids.dtype == y.dtype == torch.int64
    masked = y != -100
    assert masked.any(dim=1).all()  # at least one masked position per sample
    assert 0.10 < float(masked.double().mean()) < 0.20  # about BERT's 15%
    assert (ids[masked] == MASK_ID).all() and (ids[~masked] >= 32).all()
    assert ((y[masked] >= 32) & (y[masked] < 127)).all()
    again = bench.make_batch(64, seed=1)
    assert torch.equal(again[0], ids) and torch.equal(again[1], y)


# make test: bert_encoder (4 layers of width 128); gpt_small's 6 layers of width 256 take
# four times as long and run with SLOW=1
@pytest.mark.parametrize("name", fast_subset(NAMES, ["bert_encoder"]))
def test_generated_ipu_modules_pass_lint(tmp_path, name):
    out = tmp_path / f"{name}.py"
    runner = CliRunner()
    argv = ["generate", str(BENCHMARKS[name].path), "--platform", "ipu", "--scheme", "quant"]
    result = runner.invoke(app, [*argv, "-o", str(out)])
    assert result.exit_code == 0, result.output
    lint = runner.invoke(app, ["lint", str(out), "--platform", "ipu"])
    assert lint.exit_code == 0, lint.output


@pytest.mark.parametrize("name", fast_subset(NAMES, ["bert_encoder"]))
def test_emulated_ipu_step_equals_gpu_step_plus_sgd(build, emulation, name):
    """At a 16-token sequence, float64: one emulated ipu training step against the gpu
    module's step plus SGD."""
    bench = BENCHMARKS[name]
    text = bench.model_text(16)
    torch.manual_seed(0)
    ref = bench.build(16)
    gpu = build(text, Options()).Model()
    ipu = build(text, Options(platform="ipu")).Model()
    gpu.load_state_dict(ref.state_dict())
    ipu.load_state_dict(ref.state_dict())
    gpu, ipu = gpu.double(), ipu.double()
    batch = _batch64(name, 16)
    opt = torch.optim.SGD(gpu.parameters(), **SGD)
    want = gpu(*batch)
    opt.step()
    emu = emulation
    training = emu.trainingModel(ipu, emu.Options(), emu.optim.SGD(ipu.parameters(), **SGD))
    _, loss = training(*batch)
    assert rel_err(loss, want) <= 1e-9
    state = gpu.state_dict()
    for key, value in ipu.state_dict().items():
        assert rel_err(value, state[key]) <= 1e-9, key


def _reference_step(name: str, length: int, batch: list[torch.Tensor]):
    torch.manual_seed(0)
    ref = BENCHMARKS[name].build(length).double()
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    loss = ref(*batch)[0]
    loss.backward()
    return ref, initial, loss.detach()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_full_size_step_matches_autograd(tmp_path, name):
    """The declared sizes (context 256 / 128 tokens), batch 1, float64, to 1e-10."""
    bench = BENCHMARKS[name]
    length = SIZES[name][0]
    batch = _batch64(name, length, batch=1)
    ref, initial, want = _reference_step(name, length, batch)
    gen = bench.model_class(Options(), tmp_path, readable=False)().double()
    gen.load_state_dict(initial, strict=True)
    loss = gen(*batch)
    assert rel_err(loss, want) <= TOL
    grads = dict(ref.named_parameters())
    for key, param in gen.named_parameters():
        assert rel_err(param.grad, grads[key].grad) <= TOL, key


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_quant_scheme_trains_on_the_same_loss(tmp_path, name):
    """quant compresses only what the backward reads: the loss is the reference's exactly,
    and each parameter's gradient is within 0.3 relative of the exact one without being
    it (8-bit rows and the few-bit GELU derivative codes move each parameter's gradient by
    up to 0.087 in gpt_small, 0.112 in bert_encoder; the codecs are deterministic, so only
    float64 rounding, orders of magnitude smaller, differs between machines)."""
    bench = BENCHMARKS[name]
    batch = _batch64(name, 32)
    ref, initial, want = _reference_step(name, 32, batch)
    options = Options(scheme="quant", resolution=32)
    gen = bench.model_class(options, tmp_path, readable=False)().double()
    gen.load_state_dict(initial, strict=True)
    loss = gen(*batch)
    assert rel_err(loss, want) <= TOL
    errors = assert_grads_close(gen, ref, 0.3)  # each parameter
    assert max(errors.values()) > TOL  # compressed: not the exact gradient
