"""The memory model (unroller/analysis/memory.py), the planner (unroller/analysis/plan.py, `unroll plan`) and
the `auto` scheme: predictions against measured peaks, plans that fit, configs that load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomllib
from suite_steps import measured_peak
from typer.testing import CliRunner

from unroller.analysis.memory import simulate_graph
from unroller.analysis.plan import (
    config_of,
    make_plan,
    measured_error,
    plannable,
    run_probe,
    to_toml,
)
from unroller.api import graph_from_text, render_graph, simulate
from unroller.bench.reference import BENCHMARKS
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.compiler.schemes import CompressionConfig, ConfigError, load_config

QUICK = BENCHMARKS["quick"]
RES = 16
SLOW = os.environ.get("SLOW") == "1"

# A small network for the planner's tests: maps big enough for every candidate form.
TINY = """model tiny {
    input x: f32[N, 3, 16, 16]
    target y: i64[N]
    conv1 = conv2d(x, out_channels=8, kernel_size=3, padding=1, bias=false)
    bn1 = batchnorm2d(conv1)
    r1 = relu(bn1)
    conv2 = conv2d(r1, out_channels=8, kernel_size=3, padding=1, bias=false)
    bn2 = batchnorm2d(conv2)
    r2 = relu(bn2)
    conv3 = conv2d(r2, out_channels=8, kernel_size=3, padding=1, bias=false)
    bn3 = batchnorm2d(conv3)
    r3 = relu(bn3)
    conv4 = conv2d(r3, out_channels=8, kernel_size=3, padding=1, bias=false)
    bn4 = batchnorm2d(conv4)
    r4 = relu(bn4)
    conv5 = conv2d(r4, out_channels=8, kernel_size=3, padding=1)
    r5 = gelu(conv5)
    pool = adaptive_avgpool2d(r5, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=4)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""


def _text() -> str:
    return QUICK.model_text(RES)


def _graph():
    return graph_from_text(_text(), "quick.txt", RES)


def _tiny():
    return graph_from_text(TINY, "tiny.txt")


def assert_model_brackets_the_measured_peak(graph, config: CompressionConfig, batch: int) -> int:
    """The measured peak of one step lies between the memory model's predictions with no
    kernel scratch memory and with twice its tables' (``kernel_scale`` 0 and 2), each within
    6%. Why that holds on any machine: the tensors the generated code holds are the same
    bytes everywhere, but a kernel's scratch is not (oneDNN picks its convolution algorithm
    by CPU: the tables were measured on an AMD EPYC, and on an Intel Xeon the tiny CNN's
    convolution backward took about 1.5x that scratch). The 6% covers what the model does not
    count at all: scalars, the loss, index tensors. Returns the measured peak."""
    low = simulate_graph(graph, config, batch, kernel_scale=0.0).peak_bytes
    high = simulate_graph(graph, config, batch, kernel_scale=2.0).peak_bytes
    measured = measured_peak(graph, config, batch)
    assert 0.94 * low <= measured <= 1.06 * high, (low, measured, high)
    return measured


@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense", "quant"])
def test_predicted_peak_is_the_measured_one(scheme):
    graph = _tiny()
    config = Options(scheme=scheme).compression()
    sim = simulate_graph(graph, config, 8)
    assert_model_brackets_the_measured_peak(graph, config, 8)
    assert 0 < sim.floor_bytes <= sim.peak_bytes
    assert sim.stash_bytes <= sim.stash_raw_bytes


# Attention of both kinds, multi-head (causal and not) and scaled-dot-product on heads made by
# linear layers, with sequences long enough that the score tiles rule the peak (64 tokens,
# 16 wide, 4 heads: the scores would be 16 x the input).
ATTENTION = """model attn {
    input x: f32[N, 64, 16]
    input heads: f32[N, 2, 48, 16]
    target y: f32[N, 64, 16]
    target z: f32[N, 2, 48, 8]
    n1 = layernorm(x, normalized_shape=16)
    a = multihead_attention(n1, num_heads=4, is_causal=true)
    r = add(x, a)
    b = multihead_attention(r, num_heads=2)
    out = linear(b, out_features=16)
    q = linear(heads, out_features=8)
    k = linear(heads, out_features=8, bias=false)
    v = linear(heads, out_features=8)
    s = scaled_dot_product_attention(q, k, v, is_causal=true)
    loss1 = mse_loss(out, y)
    loss2 = mse_loss(s, z)
    loss = add(loss1, loss2)
    return loss, out
}
"""


@pytest.mark.parametrize("tile", [None, 8192], ids=["one-block", "blocks"])
def test_predicted_peak_is_the_measured_one_with_attention(monkeypatch, tile):
    """Attention block by block (unroller/runtime/attention.py): the model counts the score
    tiles its kernels hold (``attention.largest_tile``) beside q, k, v, the output and the
    row logsumexp they keep, in one block and (with 8 KiB tiles) in blocks of query rows."""
    from unroller.runtime import attention

    if tile is not None:
        monkeypatch.setattr(attention, "TILE_BYTES", tile)
    graph = graph_from_text(ATTENTION, "attn.txt")
    config = Options(scheme="nocompress").compression()
    sim = simulate_graph(graph, config, 8)
    assert_model_brackets_the_measured_peak(graph, config, 8)
    assert 0 < sim.floor_bytes <= sim.peak_bytes


@pytest.mark.skipif(not SLOW, reason="slow: run with SLOW=1 (make test-slow)")
@pytest.mark.parametrize("scheme", ["nocompress", "dct-dense", "quant"])
def test_predicted_peak_is_the_measured_one_on_a_resnet(scheme):
    graph = _graph()
    config = Options(scheme=scheme).compression()
    sim = simulate_graph(graph, config, 4)
    assert_model_brackets_the_measured_peak(graph, config, 4)
    assert 0 < sim.floor_bytes <= sim.peak_bytes


def test_compression_lowers_the_stash_and_the_prediction_scales_with_the_batch():
    base = simulate(_text(), Options(scheme="nocompress", resolution=RES), 8)
    dense = simulate(_text(), Options(scheme="dct-dense", resolution=RES), 8)
    assert dense.stash_bytes < base.stash_bytes / 4
    double = simulate(_text(), Options(scheme="nocompress", resolution=RES), 16)
    params = double.param_grad_bytes
    assert params == base.param_grad_bytes > 0
    # activations double, parameter gradients stay
    assert double.peak_bytes - params == pytest.approx(2 * (base.peak_bytes - params), rel=0.05)


def test_a_view_allocates_nothing():
    text = """model viewed {
    input x: f32[N, 4, 8, 8]
    target y: i64[N]
    flat = flatten(x)
    again = reshape(flat, shape=(256,))
    fc = linear(again, out_features=3)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""
    sim = simulate(text, Options(), 4)
    by_label = {e.label.split(" =")[0]: e for e in sim.events if e.section == "forward"}
    assert by_label["flat"].during_bytes == 0
    assert by_label["again"].during_bytes == 0
    assert by_label["fc"].during_bytes == 4 * 3 * 4


def test_plan_fits_a_budget_and_writes_a_config_that_loads(tmp_path):
    graph = _tiny()
    probe = run_probe(graph, batch_size=2)
    base = simulate_graph(graph, CompressionConfig(), 32).peak_bytes
    least = make_plan(graph, 32, None, probe).simulation.peak_bytes
    assert least < base * 0.8
    budget = (least + base) // 2
    plan = make_plan(graph, 32, budget, probe)
    assert plan.fits and plan.simulation.peak_bytes <= budget
    compressed = [r for r in plan.rows if r.choice.codec is not None]
    assert compressed and all(r.held_at_peak for r in compressed)
    assert 0 < plan.predicted_error < 1
    path = tmp_path / "plan.toml"
    path.write_text(to_toml(plan, ["a plan", "with\nno line break"]))
    loaded = load_config(path)
    assert {(r.tensor, r.codec) for r in loaded.rules} == {
        (r.tensor, r.codec) for r in plan.config.rules
    }
    again = simulate_graph(graph, loaded, 32)
    assert again.peak_bytes == plan.simulation.peak_bytes
    assert_model_brackets_the_measured_peak(graph, loaded, 32)
    error = measured_error(graph, plan, probe)
    assert 0 < error < 0.5


def test_an_unreachable_budget_says_so():
    graph = _tiny()
    plan = make_plan(graph, 8, 1024, run_probe(graph, batch_size=2))
    assert not plan.fits
    assert any("cannot be met" in note for note in plan.notes)


def test_max_error_rules_out_lossy_forms():
    graph = _tiny()
    probe = run_probe(graph, batch_size=2)
    plan = make_plan(graph, 32, 1024, probe, max_error=0.01)
    assert {r.choice.label for r in plan.rows} <= {"raw", "quant-8"}


def test_plannable_tensors_are_float_activations():
    keys = {s.key for s in plannable(_graph())}
    assert "layer1.0.conv1" in keys and "layer1.0.r1" in keys
    assert not any(":" in k for k in keys)  # batch statistics, indices stay exact


def test_tensor_rules_in_a_config_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[rule]]\ntensor = "layer1.*"\ncompressor = "quant"\nbits = 4\n')
    config = load_config(path)
    graph = _graph()
    sim = simulate_graph(graph, config, 4)
    assert sim.stash_bytes < simulate_graph(graph, CompressionConfig(), 4).stash_bytes
    path.write_text('[[rule]]\ntensor = "a\\nb"\ncompressor = "quant"\n')
    with pytest.raises(ConfigError, match="tensor"):
        load_config(path)
    assert config_of({}).rules == []


def test_auto_scheme_generates_a_planned_module():
    first = render_graph(_tiny(), "tiny.txt", Options(scheme="auto"))
    assert '"scheme": "auto"' in first.splitlines()[0]
    assert "tensors by name" in first  # the docstring sums the plan up
    if SLOW:  # the same text gives the same file
        assert render_graph(_tiny(), "tiny.txt", Options(scheme="auto")) == first


runner = CliRunner()


def test_cli_plan_writes_the_config_and_a_table(tmp_path):
    model = tmp_path / "tiny.txt"
    model.write_text(TINY)
    out = tmp_path / "plan.toml"
    result = runner.invoke(
        app,
        [
            "plan",
            str(model),
            "--batch-size",
            "16",
            "--memory-budget",
            "min",
            "--probe-batch",
            "2",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "predicted peak" in result.output and "at peak" in result.output
    data = tomllib.loads(out.read_text())
    assert data["default"]["compressor"] == "none"
    load_config(out)


def test_cli_plan_refuses_bad_input(tmp_path):
    model = tmp_path / "bad.txt"
    model.write_text("model m {\n    input x: f32[N, 3]\n    y = nosuchop(x)\n    return y\n}\n")
    result = runner.invoke(app, ["plan", str(model)])
    assert result.exit_code == 2
    assert "bad.txt:3:" in result.output and "Traceback" not in result.output
    good = tmp_path / "tiny.txt"
    good.write_text(TINY)
    result = runner.invoke(app, ["plan", str(good), "--memory-budget", "lots"])
    assert result.exit_code == 2 and "--memory-budget" in result.output


def test_cli_plan_header_keeps_hostile_paths_inside_comments(tmp_path):
    folder = tmp_path / 'x"\n[[rule]]\ntensor = "*"\ncompressor = "quant"\nbits = 2\n#'
    folder.mkdir()
    model = folder / "tiny.txt"
    model.write_text(TINY)
    out = tmp_path / "plan.toml"
    result = runner.invoke(
        app, ["plan", str(model), "--batch-size", "4", "--memory-budget", "1GiB", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    config = load_config(out)
    assert config.rules == []  # everything fits raw: no rule, none smuggled in


def test_cli_plan_with_segment_pieces(tmp_path):
    """--segment-piece-size plans the recomputed blocks in pieces: the least peak it reaches
    at batch 32 is lower than with whole segments, the config it writes says so, and that
    config generates a step whose memory model is the plan's."""
    model = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "gpt_tiny.txt"
    peaks = {}
    for size in (0, 4):
        out = tmp_path / f"plan{size}.toml"
        args = ["plan", str(model), "--batch-size", "32", "--probe-batch", "2"]
        args += ["--recompute-segments", "blocks", "-o", str(out)]
        if size:
            args += ["--segment-piece-size", str(size)]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        data = tomllib.loads(out.read_text())
        assert data["recompute_segments"] == ["blocks"]
        assert data.get("segment_piece_size", 0) == size
        config = load_config(out)
        assert config.segment_piece_size == size
        graph = graph_from_text(model.read_text(), "gpt_tiny.txt")
        peaks[size] = simulate_graph(graph, config, 32).peak_bytes
        assert f"{peaks[size] / 2**20:,.2f} MiB" in result.output  # the plan's own prediction
    assert peaks[4] < 0.5 * peaks[0]
    result = runner.invoke(app, ["plan", str(model), "--segment-piece-size", "4"])
    assert result.exit_code == 2 and "--recompute-segments" in result.output
