"""Every module the benchmark harness would build generates.

The cases come from the harness's own list (``unroller.bench.suite.ours_builds``) under the
flags of ``make bench`` (the quick preset), ``make bench FULL=1`` (``--full``) and the
emulated IPU run (``--platform ipu --emulate``, both presets): every suite model x every
scheme x every variant those runs measure (``+recompute``, ``+blocks+pieces``, ``auto``),
at the resolution each run uses. A new model, scheme or variant in the harness is a new
case here without editing this file. Nothing is timed or run: each module is generated
(black stood in for by a check that the text compiles, since black takes 80% of a
render and only re-lays the lines) and, where the harness predicts memory, the memory
model simulates it, as the harness does before measuring.

The rows of a group share one parse of their model text. Cases whose model text and
options are the same in two runs (the spec-v2 models run at one size in both presets) are
generated once. The groups only the full presets build (the
quick presets' models and rows at a larger resolution) run under ``make test-slow``, and so
do the ``auto`` plans of the two models whose plan takes seconds (``STAND_IN_PLAN``): in
``make test`` their ``auto`` rows generate from a stand-in plan (``stand_in_plan``) that
gives their saved tensors every form the planner chooses from, while the planner itself
runs on the eight other suite models.
"""

from __future__ import annotations

import hashlib

import pytest
from conftest import SLOW, SLOW_MARK, fast_format

from unroller import api
from unroller.analysis import plan, search
from unroller.bench import config, models, suite
from unroller.bench.reference import BENCHMARKS
from unroller.compiler import codegen
from unroller.compiler.schemes import SCHEMES

#: the harness runs whose builds are generated: (label, argv of `unroll bench`)
RUNS = (
    ("quick", []),
    ("full", ["--full"]),
    ("ipu-quick", ["--platform", "ipu", "--emulate"]),
    ("ipu-full", ["--platform", "ipu", "--emulate", "--full"]),
)


def _cases() -> dict[str, list[tuple[str, str, suite.OursBuild]]]:
    """The distinct builds of every run, grouped by model text: (run label, benchmark,
    OursBuild) per build, under a key naming the benchmark and its resolution. One group
    runs in one process, so an ``auto`` plan (a probe step of the model) is made once per
    text (``search.auto_config`` remembers it) and serves ``auto``, ``auto+recompute``, the
    ipu module and the memory model."""
    seen: set[tuple[str, str]] = set()
    groups: dict[str, list[tuple[str, str, suite.OursBuild]]] = {}
    for label, argv in RUNS:
        args = config.parse_args(argv)
        for name in args.benchmarks:
            bench = BENCHMARKS[name]
            resolution = models.resolution_of(bench, args)
            text = bench.model_text(resolution)
            for build in suite.ours_builds(bench, args, resolution):
                key = (hashlib.sha256(text.encode()).hexdigest(), repr(build.options))
                if key not in seen:
                    seen.add(key)
                    groups.setdefault(f"{name}@{resolution}", []).append((label, name, build))
    return groups


GROUPS = _cases()
CASES = [case for cases in GROUPS.values() for case in cases]


def test_the_list_covers_every_model_scheme_and_variant():
    """The list is the harness's: each suite model, each scheme, and the variant rows
    the presets turn on, appear (so a preset or list that ran nothing fails here)."""
    names = {(name, build.name) for _, name, build in CASES}
    for bench in config.SUITE:
        for scheme in SCHEMES:
            assert (bench, f"ours:{scheme}") in names
    assert {b for b, _ in names} == set(config.SUITE)
    rows = {n for _, n in names}
    for scheme in config.RECOMPUTE_SCHEMES:
        assert f"ours:{scheme}+recompute" in rows
    for scheme in config.SEGMENT_SCHEMES:
        assert f"ours:{scheme}+blocks+pieces" in rows
    for scheme in config.SELECTIVE_SCHEMES:
        assert f"ours:{scheme}+blocks+keep" in rows
    assert {label for label, _, _ in CASES} == {label for label, _ in RUNS}
    platforms = {build.options.platform for _, _, build in CASES}
    assert platforms == {"gpu", "ipu"}


def _generates(name: str, build: suite.OursBuild) -> str | None:
    """None when the module of one harness row generates (compiling Python) and, on the
    gpu platform, the memory model simulates it at batch 2 as the harness asks it to;
    else what went wrong."""
    bench = BENCHMARKS[name]
    try:
        source = bench.generate(build.options)
        header = source.splitlines()[0]
        if "class Model" not in source or f'"scheme": "{build.scheme}"' not in header:
            return "no Model class, or the header names another scheme"
        if build.options.platform == "gpu":
            predicted = models.predict_memory(bench, build.options, 2)
            if predicted is None or not predicted["peak_bytes"] > 0:
                return f"the memory model predicted {predicted}"
    except Exception as exc:  # noqa: BLE001 - every failing build is reported, not the first
        return f"{type(exc).__name__}: {exc}"
    return None


def _group_params() -> list:
    """Each group a case; a group only the full presets build (the same models and rows as
    the quick presets at a larger resolution: 20-25 s each for the largest) runs under
    ``make test-slow``."""
    return [
        pytest.param(
            group,
            marks=() if {label for label, _, _ in GROUPS[group]} & QUICK else SLOW_MARK,
        )
        for group in sorted(GROUPS)
    ]


#: the runs of ``make bench`` and the emulated IPU's quick preset
QUICK = {"quick", "ipu-quick"}


#: the groups whose ``auto`` plan takes seconds (5 s each on one core, the others 0.2-1.3 s:
#: a probe step and checked steps of ResNet-34, and of MobileNetV2 in five rounds): their
#: ``auto`` rows are generated from ``stand_in_plan`` unless SLOW=1
STAND_IN_PLAN = {"resnet34@32", "mobilenet_v2@32"}


def stand_in_plan(graph, label="<model>", segments=(), build=None, **moves):
    """A config of the ``auto`` plan's form (one ``tensor`` rule per compressed saved
    tensor) without its probe steps: the plannable tensors take the planner's candidates
    in turn, raw included, so every codec form that fits some tensor of the model is
    generated and simulated."""
    assign = {}
    for i, stashed in enumerate(plan.plannable(graph)):
        choices = plan.candidates(stashed)
        assign[stashed.key] = choices[i % len(choices)]
    return plan.config_of(assign, segments=segments or ())


def test_the_stand_in_plan_compresses_in_every_form_that_fits():
    """The stand-in gives a model's saved tensors the codecs the planner chooses from,
    several kinds of them, and leaves some raw."""
    bench = BENCHMARKS["resnet34"]
    from unroller.api import graph_from_text

    graph = graph_from_text(bench.model_text(32), "resnet34", 32)
    got = stand_in_plan(graph)
    keys = {s.key for s in plan.plannable(graph)}
    assert {rule.tensor for rule in got.rules} < keys
    kinds = {rule.codec.name for rule in got.rules}
    assert {"quant", "dct"} <= kinds, kinds


def _parse_once(monkeypatch) -> dict:
    """``api.graph_from_text`` parses and builds each (text, label, resolution) once: the
    rows of a group (generation, the memory model at two batches, the harness's block
    check) share the graph, which nothing changes (the returned dict: key -> (graph, its
    repr when built), for the test to check that)."""
    built: dict = {}
    real = api.graph_from_text

    def graph_from_text(source, filename="<string>", resolution=None, precision="fp32"):
        key = (source, filename, resolution, precision)
        if key not in built:
            graph = real(source, filename, resolution, precision)
            built[key] = (graph, repr(graph))
        return built[key][0]

    monkeypatch.setattr(api, "graph_from_text", graph_from_text)
    return built


@pytest.mark.parametrize("group", _group_params())
def test_harness_builds_generate(monkeypatch, group):
    """Every harness row on one model text generates: the failures, if any, each named by
    run, benchmark and row. The rows share the graph of their text (``_parse_once``), which
    is still as built at the end."""
    monkeypatch.setattr(codegen.black, "format_str", fast_format)
    if group in STAND_IN_PLAN and not SLOW:
        monkeypatch.setattr(search, "auto_config", stand_in_plan)
    built = _parse_once(monkeypatch)
    failures = [
        f"{label} {name} {build.name}: {problem}"
        for label, name, build in GROUPS[group]
        if (problem := _generates(name, build)) is not None
    ]
    assert not failures, "\n".join(failures)
    changed = [key[1:] for key, (graph, was) in built.items() if repr(graph) != was]
    assert built and not changed, f"a shared graph was changed: {changed}"
