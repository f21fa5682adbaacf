"""The working set per sample (``unroller.analysis.working_set``): the memory model of a
plan's step with its stash free, and what ``unroll plan --max-time-ratio`` says of it."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ROOT
from typer.testing import CliRunner

from unroller.analysis.memory import simulate_graph
from unroller.analysis.search import fixed_plans
from unroller.analysis.working_set import _most, working_set_bound
from unroller.api import compression_config, load_graph
from unroller.cli import app
from unroller.compiler.options import Options

RESNET_LIKE = ROOT / "tests" / "models" / "resnet_like.txt"


@pytest.fixture(scope="module")
def graph():
    return load_graph(RESNET_LIKE, None, "fp32")


@pytest.mark.parametrize("scheme", ["nocompress", "quant", "dct-dense"])
def test_the_working_set_is_what_the_peak_holds_beside_the_stash(graph, scheme):
    """At every batch the most held beside the stash is at most the peak, and the peak is
    that plus at most the stash held then; per sample, a lossier scheme's working set is no
    larger than the plan's own bytes per sample here, and the stash it leaves out is what
    the scheme compressed (nocompress keeps more of it than dct-dense)."""
    config = compression_config(Options(scheme=scheme), graph)
    for batch in (4, 8):
        sim = simulate_graph(graph, config, batch)
        most, event = _most(sim)
        assert 0 < most <= sim.peak_bytes
        assert most == event.during_bytes - event.stash_bytes
        assert sim.peak_bytes <= most + max(e.stash_bytes for e in sim.events)
    bound = working_set_bound(graph, config, (4, 8))
    assert 0 < bound.per_sample <= bound.plan_per_sample
    assert bound.section in ("forward", "backward", "recompute")


def test_compression_closes_on_the_working_set(graph):
    """What a scheme keeps per sample beyond its working set shrinks as it compresses
    more: nocompress > quant > dct-dense."""
    gaps = {}
    for scheme in ("nocompress", "quant", "dct-dense"):
        bound = working_set_bound(graph, compression_config(Options(scheme=scheme), graph), (4, 8))
        gaps[scheme] = bound.plan_per_sample - bound.per_sample
    assert gaps["nocompress"] > gaps["quant"] > gaps["dct-dense"] >= 0


def test_fixed_plans_cover_the_search_structures(graph):
    """Every structure with none, quant and dct-dense forms, labelled as the search labels
    them; the plain ones first."""
    plans = fixed_plans(graph, 8)
    labels = [label for label, _ in plans]
    assert labels[:3] == ["forms none", "forms quant", "forms dct-dense"]
    assert any("--recompute" in label for label in labels)
    assert any("segments" in label for label in labels)
    assert len(set(labels)) == len(labels)


def test_plan_search_prints_the_chosen_plans_working_set():
    result = CliRunner().invoke(
        app,
        [
            "plan",
            str(ROOT / "benchmarks" / "models" / "quick.txt"),
            "--max-time-ratio",
            "1.5",
            "--batch-size",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    chosen = re.search(r"^(.*)<- chosen$", result.output, re.M)
    assert chosen, result.output
    found = re.search(
        r"of which its working set: ([\d,]+) bytes per sample \(the (\w+) of ", result.output
    )
    assert found, result.output
    per_sample = float(re.findall(r"  ([\d,]+)  ", chosen.group(1))[0].replace(",", ""))
    assert 0 < float(found.group(1).replace(",", "")) <= per_sample


def test_codec_working_memory_is_measured_per_codec_path(monkeypatch):
    """A codec's working memory is measured for the CPU path its calls take: with the
    native kernels switched off (as the native kernels' tests do) the PyTorch formulation's
    buffers, with them on, none; a figure taken in one state is never handed out in the
    other (a process that measured with them off once predicted other peaks, and the
    --recompute guard chose otherwise, for the rest of its life)."""
    from unroller.analysis.memory import codec_transients
    from unroller.compiler.schemes import make_codec
    from unroller.compress import base

    codec = make_codec("quant", {"bits": 8})
    shape = (8, 9, 10)  # a shape no other test measures
    monkeypatch.setattr(base, "NATIVE", False)
    formulation = codec_transients(codec, shape, "f32")
    assert formulation[0] > 0
    monkeypatch.setattr(base, "NATIVE", True)
    if base.native_path(torch.empty(0)) is None:
        pytest.skip("no native kernels here (no C++ compiler)")
    assert codec_transients(codec, shape, "f32") == (0.0, 0.0)
    monkeypatch.setattr(base, "NATIVE", False)
    assert codec_transients(codec, shape, "f32") == formulation
