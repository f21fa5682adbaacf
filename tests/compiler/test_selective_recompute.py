"""Selective segment recompute (``segment_keep`` in a compress config): the statements it
names inside recomputed segments are not run again; the forward keeps what they make and the
recompute starts from it, remaking only the cheap statements between them.

Exact under nocompress (float64, 1e-10 against autograd: transformers whole and in pieces,
a ResNet-like CNN with batch norm), within the scheme's error under quant, never a matrix
product in the recompute, the memory model brackets the measured peak, and a config that
misuses the key is refused at its line and column."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_grads_close, grad_errors, rel_err
from suite_steps import bench_step, measured_peak, suite_pair, suite_step

from unroller.analysis.memory import simulate_graph
from unroller.analysis.plan import config_toml
from unroller.api import graph_from_text
from unroller.compiler.options import Options
from unroller.compiler.schemes import CompressionConfig, load_config
from unroller.compiler.stash import plan_stash, rerun_nodes
from unroller.errors import ConfigError

TOL = 1e-10
GPT = Path("benchmarks/models/gpt_tiny.txt")
QUANT = '[default]\ncompressor = "quant"\nbits = 8\n'


def _config(tmp_path: Path, keep: str, piece_size: int = 0, body: str = "") -> Path:
    """A compress config recomputing every block, keeping ``keep`` (a TOML value)."""
    lines = ['recompute_segments = "blocks"', f"segment_keep = {keep}"]
    if piece_size:
        lines.append(f"segment_piece_size = {piece_size}")
    path = tmp_path / "selective.toml"
    path.write_text("\n".join(lines) + "\n" + body)
    return path


def _recompute_functions(source: str) -> str:
    """The bodies of the generated ``*_recompute`` functions, together."""
    chunks = source.split("\ndef ")
    return "\n".join(c for c in chunks if c.split("(")[0].endswith("_recompute"))


@pytest.mark.parametrize(
    "name,batch,piece_size",
    [("gpt_tiny", 4, 0), ("gpt_tiny", 5, 2), ("vit_tiny", 3, 2), ("bert_encoder", 3, 0)],
)
def test_exact_without_compression(tmp_path, name, batch, piece_size):
    """Every matrix product kept: the loss and every gradient as autograd's to 1e-10, whole
    and in pieces (batch 5 in pieces of 2: the last one smaller), and the recompute
    functions call no linear layer or attention, only the cheap statements."""
    options = Options(compress_config=str(_config(tmp_path, '"matmuls"', piece_size)))
    loss, gen, ref_loss, ref, source = bench_step(tmp_path, name, options, batch)
    assert rel_err(loss, ref_loss) <= TOL
    assert_grads_close(gen, ref, TOL)
    recompute = _recompute_functions(source)
    assert "K.layernorm(" in recompute
    assert "K.linear(" not in recompute and "attention(" not in recompute
    if piece_size:
        assert f".split({piece_size})" in source


def test_exact_on_a_cnn_with_batch_norm(build, tmp_path):
    """resnet_like, its convolutions kept: batch norm (its recompute kernel) and relu are
    remade from the kept convolution outputs; float64 gradients, loss and running
    statistics as autograd's to 1e-10."""
    options = Options(compress_config=str(_config(tmp_path, '"matmuls"')))
    gen, ref = suite_pair(build, "resnet_like", options)
    loss, ref_loss = suite_step(gen, ref, "resnet_like", 4, 0)
    assert rel_err(loss, ref_loss) <= TOL
    assert_grads_close(gen, ref, TOL)
    for name, buffer in ref.named_buffers():
        if buffer.is_floating_point():
            assert rel_err(gen.state_dict()[name], buffer) <= TOL, name


def test_the_plan_keeps_what_kept_statements_make():
    """gpt_tiny, the attention kept by name: its saved extras and its output are kept by
    the forward, the recompute does not run it and restores its output instead; the
    feed-forward linear layers are run again (not kept)."""
    graph = graph_from_text(GPT.read_text(), "gpt_tiny.txt")
    config = CompressionConfig(segments=("blocks",), segment_keep=("layers.*.self_attn",))
    plan = plan_stash(graph, config)
    by_key = plan.by_key()
    for segment in plan.segments:
        attention = f"{segment.name}.self_attn"
        assert segment.kept == [attention]
        assert attention in segment.inputs  # r1 = add(x, self_attn) is remade from it
        for extra in ("q", "k", "v", "context"):
            assert by_key[f"{attention}:{extra}"].segment is None  # the forward keeps it
        rerun = rerun_nodes(segment, [by_key[k].producer for k in segment.internal])
        names = {n.name for n in rerun}
        assert attention not in names
        assert f"{segment.name}.linear1" in names and f"{segment.name}.r1" in names


def test_keeping_nothing_that_matches_changes_nothing():
    """A glob that names no statement: the same plan as plain segment recompute."""
    graph = graph_from_text(GPT.read_text(), "gpt_tiny.txt")
    plain = plan_stash(graph, CompressionConfig(segments=("blocks",)))
    config = CompressionConfig(segments=("blocks",), segment_keep=("no.such.*",))
    same = plan_stash(graph, config)
    assert [(s.key, s.forms, s.segment) for s in plain.entries] == [
        (s.key, s.forms, s.segment) for s in same.entries
    ]


def test_quant_keeps_the_scheme_error(tmp_path):
    """Under quant, selective segments in pieces: each parameter within 0.1 of autograd
    (the recompute starts from the kept, restored matrix products, so their error reaches
    what it remakes) and no parameter more than 2.5x its error with whole segments; the
    loss is the forward's, the same bits."""
    whole_config = tmp_path / "whole.toml"
    whole_config.write_text('recompute_segments = "blocks"\nderivatives = true\n' + QUANT)
    whole = bench_step(
        tmp_path / "whole", "gpt_tiny", Options(compress_config=str(whole_config)), 4
    )
    body = "derivatives = true\n" + QUANT
    path = _config(tmp_path, '"matmuls"', 2, body)
    selective = bench_step(tmp_path / "sel", "gpt_tiny", Options(compress_config=str(path)), 4)
    assert torch.equal(whole[0], selective[0])
    errors = assert_grads_close(selective[1], selective[3], 0.1)
    assert max(errors.values()) > 1e-6  # something is compressed
    plain = grad_errors(whole[1], whole[3])
    over = {p: (e, plain[p]) for p, e in errors.items() if e > 2.5 * plain[p] + 1e-9}
    assert not over, over


def test_memory_model_brackets_the_measured_peak():
    """gpt_tiny under quant at batch 8, every matrix product kept, pieces of 2: the measured
    peak between the model's with no kernel scratch and with twice its tables' (each within
    6%, as tests/analysis/test_memory_plan.py)."""
    graph = graph_from_text(GPT.read_text(), "gpt_tiny.txt")
    base = Options(scheme="quant").compression(graph)
    config = CompressionConfig(
        default=base.default,
        derivatives=True,
        segments=("blocks",),
        segment_piece_size=2,
        segment_keep=("matmuls",),
    )
    low, high = (simulate_graph(graph, config, 8, kernel_scale=k).peak_bytes for k in (0.0, 2.0))
    measured = measured_peak(graph, config, 8)
    assert 0.94 * low <= measured <= 1.06 * high, (low, measured, high)


def test_config_key_round_trips_and_refuses_misuse(tmp_path):
    """``segment_keep`` loads as a string or a list, a planned config writes it back;
    without recompute_segments, or with a glob holding other characters, it is an error at
    its line and column."""
    path = _config(tmp_path, '["layers.*.self_attn", "matmuls"]')
    config = load_config(path)
    assert config.segment_keep == ("layers.*.self_attn", "matmuls")
    assert load_config(_config(tmp_path, '"matmuls"')).segment_keep == ("matmuls",)
    again = tmp_path / "again.toml"
    again.write_text(config_toml(config, ["written back"]))
    assert load_config(again).segment_keep == config.segment_keep
    for text, message in (
        ('segment_keep = "matmuls"\n', "1:1: error: 'segment_keep' names statements inside"),
        (
            'recompute_segments = "blocks"\nsegment_keep = ["a\\"); import os #"]\n',
            "2:16: error: bad node name",
        ),
        ('recompute_segments = "blocks"\nsegment_keep = 3\n', "'segment_keep' must be a list"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(bad)
        assert message in str(info.value), str(info.value)


def test_cli_records_it_and_check_regenerates(tmp_path):
    """``--segment-keep`` on the command line: the header records it, ``unroll check``
    regenerates the same bytes, and the file is the one a config file with the key gives."""
    from typer.testing import CliRunner

    from unroller.cli import app
    from unroller.compiler.codegen import read_header

    runner = CliRunner()
    out = tmp_path / "gen" / "m.py"
    args = ["generate", str(GPT), "--recompute-segments", "blocks"]
    args += ["--segment-keep", "matmuls,layers.0.norm1", "-o", str(out), "--mkdir"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    header = read_header(out.read_text())
    assert header["segment_keep"] == ["matmuls", "layers.0.norm1"]
    assert "not run again (selective recompute)" in out.read_text()
    assert "Keeps for its own backward only what its kept statements make" in out.read_text()
    checked = runner.invoke(app, ["check", str(out.parent)])
    assert checked.exit_code == 0, checked.output
    assert "1 up to date" in checked.output
    path = _config(tmp_path, '["matmuls", "layers.0.norm1"]')
    from_file = tmp_path / "file.py"
    result = runner.invoke(
        app, ["generate", str(GPT), "--compress-config", str(path), "-o", str(from_file)]
    )
    assert result.exit_code == 0, result.output
    same = _recompute_functions(from_file.read_text())
    assert same and _recompute_functions(out.read_text()) == same
