"""Where compression appears in generated code: right after the forward op, before the
first backward reader, compressed once, raw released when the forward pass is done."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from unroller.api import load_graph
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.cli import app
from unroller.compiler.lower import Lowering
from unroller.compiler.options import Options
from unroller.compiler.stash import plan_stash


def lowering(stem: str, scheme: str) -> Lowering:
    graph = load_graph(model_path(stem))
    return Lowering(graph, plan_stash(graph, Options(scheme=scheme).compression()))


def test_compress_follows_the_producer_and_raw_is_released_in_forward():
    em = lowering("resnet_like", "dct-dense")
    steps = em.training_steps()
    compressed = [s for s in em.plan.entries if all(f.kind != "raw" for f in s.forms)]
    assert compressed
    for stashed in compressed:
        raw = em.raw_var(stashed.key).name
        made = next(i for i, s in enumerate(steps) if raw in s.writes())
        # the next step compresses it (once per form), before any other forward op
        assert any(".compress(" in line for line in steps[made + 1].text()), stashed.key
        released = next(i for i, s in enumerate(steps) if raw in s.release)
        assert steps[released].section == "forward", f"{stashed.key} kept raw into backward"


#: A restore: decompressed whole, or handed to kernels that decompress it by piece.
RESTORES = (".decompress(", "K.restore_in_pieces(")


def test_decompress_comes_right_before_the_first_reader():
    em = lowering("unet_like", "dct-dense")
    steps = em.training_steps()

    def restores(step) -> bool:
        return any(r in line for line in step.text() for r in RESTORES)

    for i, step in enumerate(steps):
        if restores(step):
            restored = step.writes()[0]
            j = i + 1
            while restores(steps[j]):
                j += 1
            assert restored in steps[j].reads(), (restored, steps[j].comment)


def test_a_tensor_shared_by_two_readers_is_compressed_once():
    em = lowering("resnet_like", "dct-dense")
    text = "\n".join(line for s in em.training_steps() for line in s.text())
    # r feeds layer1.0.conv1 (dct) and the residual add; relu reads its mask; the
    # convolution decompresses it a piece of the batch at a time
    assert text.count("r_dct = CODEC_DCT.compress(r)") == 1
    assert text.count("K.restore_in_pieces(CODEC_DCT, r_dct") == 1
    assert "CODEC_DCT.decompress(r_dct" not in text


def test_scheme_diff_shows_the_compress_and_decompress_calls(monkeypatch):
    monkeypatch.chdir(model_path("resnet_like").parent.parent.parent)
    result = CliRunner().invoke(
        app,
        ["diff", "tests/models/resnet_like.txt", "--scheme", "nocompress", "--scheme", "dct-dense"],
    )
    assert result.exit_code == 1
    added = [
        line for line in result.output.splitlines() if line.startswith("+") and "CODEC_DCT" in line
    ]
    assert any(".compress(" in line for line in added)
    assert any(r in line for line in added for r in RESTORES)


def test_nan_in_an_activation_propagates_under_quant(build):
    """A NaN activation must not become a finite wrong gradient through quantisation."""
    module = build(model_path("unet_like"), Options(scheme="quant"))
    torch.manual_seed(0)
    model = module.Model().double()
    x, y = make_inputs("unet_like", 2)
    x[0, 0, 3, 3] = float("nan")
    model(x, y)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert any(torch.isnan(g).any() for g in grads)
