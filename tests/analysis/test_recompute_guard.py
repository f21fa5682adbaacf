"""--recompute never makes a step keep more (unroller.analysis.recompute_guard).

The compiler's recompute plan (``Options.compression``) remakes every cheap chain it can;
on ResNet-34 under dct-dense that raises the memory model's peak (the remade chains hold
their restored inputs and outputs at once, in the backward). The resolved config
(``unroller.api.compression_config``, what generate, unroll, bench and estimate use) keeps
those tensors instead: its predicted peak is never above the same scheme's without
recompute at the guard's batches, nor its bytes per added sample between them. Held over
every benchmark model and scheme (a representative few in ``make test``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import fast_subset

from unroller.analysis.memory import Simulation, simulate_graph
from unroller.analysis.recompute_guard import GUARD_BATCHES, worse_at
from unroller.api import compression_config, graph_from_text
from unroller.compiler.options import Options
from unroller.compiler.schemes import load_config
from unroller.compiler.stash import RECOMPUTE, plan_stash
from unroller.errors import ConfigError

MODELS = Path(__file__).parents[2] / "benchmarks" / "models"


def _graph(stem: str):
    return graph_from_text((MODELS / f"{stem}.txt").read_text(), f"{stem}.txt")


def _sims(graph, config) -> list[Simulation]:
    return [simulate_graph(graph, config, batch) for batch in GUARD_BATCHES]


def _remade(graph, config) -> set[str]:
    return {e.key for e in plan_stash(graph, config).entries if RECOMPUTE in e.forms}


def test_resnet34_dct_dense_keeps_what_remaking_would_make_worse():
    graph = _graph("resnet34")
    unguarded = Options(scheme="dct-dense", recompute=True).compression(graph)
    plain = Options(scheme="dct-dense").compression(graph)
    base = _sims(graph, plain)
    assert worse_at(_sims(graph, unguarded), base) is not None  # what the guard is for
    guarded = compression_config(Options(scheme="dct-dense", recompute=True), graph)
    sims = _sims(graph, guarded)
    assert worse_at(sims, base) is None
    kept = set(guarded.recompute_keep)
    assert kept and "*" not in kept
    remade = _remade(graph, guarded)
    assert remade and not remade & kept  # some tensors still remade, none of the kept
    assert sims[-1].stash_bytes < base[-1].stash_bytes


GUARDED = fast_subset(
    [
        (stem, scheme)
        for stem in sorted(p.stem for p in MODELS.glob("*.txt"))
        for scheme in ("nocompress", "dct-dense", "quant")
    ],
    fast={("gpt_tiny", "quant"), ("unet_like", "dct-dense"), ("quick", "quant")},
)


@pytest.mark.parametrize("stem,scheme", GUARDED)
def test_recompute_never_raises_the_peak_or_the_bytes_per_sample(stem, scheme):
    graph = _graph(stem)
    config = compression_config(Options(scheme=scheme, recompute=True), graph)
    base = _sims(graph, dataclasses.replace(config, recompute=False, recompute_keep=()))
    assert worse_at(_sims(graph, config), base) is None, config.recompute_keep


def _sim(peak: int) -> Simulation:
    return Simulation(1, [], peak, "", (), 0, 0, 0, "", 0, 0)


def test_worse_at_compares_peaks_and_the_bytes_per_added_sample():
    base = [_sim(100), _sim(150), _sim(250)]
    assert worse_at([_sim(100), _sim(150), _sim(250)], base) is None
    assert worse_at([_sim(101), _sim(150), _sim(250)], base) == 0
    # lower everywhere, but more per added sample from the second batch to the third
    assert worse_at([_sim(50), _sim(60), _sim(170)], base) == 2
    assert worse_at([_sim(90), _sim(130), _sim(220)], base) is None


def test_a_config_file_names_tensors_recompute_keeps(tmp_path):
    graph = _graph("resnet34")
    path = tmp_path / "keep.toml"
    path.write_text('recompute = true\nrecompute_keep = ["layer4.*"]\n')
    config = load_config(path)
    assert config.recompute_keep == ("layer4.*",)
    remade = _remade(graph, config)
    assert remade and not any(k.startswith("layer4.") for k in remade)
    everything = _remade(graph, dataclasses.replace(config, recompute_keep=()))
    assert any(k.startswith("layer4.") for k in everything)


@pytest.mark.parametrize(
    "value,message",
    [
        ('"bn1"', "must be a list of saved tensor names"),
        ("[1]", "must be a list of saved tensor names"),
        ('["bn1; import os"]', "bad saved tensor name"),
        ('[""]', "bad saved tensor name"),
    ],
)
def test_a_bad_recompute_keep_is_a_config_error_at_its_line(tmp_path, value, message):
    path = tmp_path / "bad.toml"
    path.write_text(f"recompute = true\nrecompute_keep = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert "bad.toml:2:" in str(info.value)


def test_recompute_without_a_graph_is_refused():
    with pytest.raises(ValueError, match="--recompute is planned per model"):
        compression_config(Options(recompute=True))
