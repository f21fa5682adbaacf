"""Generation is a pure function of a graph and a resolved compression config, and the
layers above it are acyclic: the code generator, and what makes its output run
(``unroller.materialize``, ``unroller.analysis.inputs``), import nothing that drives them (the
planner, verify, the memory model, the benchmark harness, the library layer); the planner
steps modules through ``materialize`` and imports neither verify nor the library layer;
no library module sits on an import cycle. Rendering a built-in scheme never loads (and so
can never run) the planner."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "unroller"

CORE_PACKAGE = "unroller.compiler"
"""The modules that turn model text into a generated module (with ``unroller.errors``)."""

OUTSIDE = (
    "unroller.analysis.plan",
    "unroller.analysis.verify",
    "unroller.analysis.memory",
    "unroller.bench",
    "unroller.api",
)
"""What generation must never import: they observe or drive it, from above."""

RENDER = """
import json, sys
from unroller.compiler.codegen import render
from unroller.compiler.options import Options
from unroller.compiler.graph import build_graph
from unroller.compiler.parser import parse

text = open(sys.argv[1], encoding="utf-8").read()
graph = build_graph(parse(text, "quick.txt"))
sizes = {}
for platform in ("gpu", "ipu"):
    options = Options(platform=platform, scheme="quant")
    sizes[platform] = len(render(graph, "quick.txt", options, options.compression()))
print(json.dumps({"sizes": sizes, "modules": sorted(sys.modules)}))
"""


def test_rendering_a_builtin_scheme_imports_nothing_that_drives_generation():
    """A fresh interpreter renders a benchmark model for both platforms; afterwards none of
    the planner, verify, the memory model, the benchmark harness or the library layer (nor
    a submodule of one) has been imported."""
    model = ROOT / "benchmarks" / "models" / "quick.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", RENDER, str(model)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["sizes"]["gpu"] > 0 and found["sizes"]["ipu"] > 0
    loaded = [m for m in found["modules"] if any(m == o or m.startswith(o + ".") for o in OUTSIDE)]
    assert loaded == [], f"rendering imported {loaded}"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, at module level or inside functions (a lazy
    import is still a dependency), with the packages they sit in; the root package is left
    out: its ``__init__`` imports nothing at module level (its conveniences import lazily,
    when called), and every submodule would otherwise depend on everything."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            named.add(module)
            named.update(f"{module}.{alias.name}" for alias in node.names)
    found = set()
    for dotted in named:
        parts = dotted.split(".")
        for end in range(2, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                found.add(prefix)
    return found


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _closure(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches, each with the module that imports it on the way."""
    via, todo = {start: ""}, [start]
    while todo:
        module = todo.pop()
        for found in graph[module]:
            if found not in via:
                via[found] = module
                todo.append(found)
    return via


def _chain(via: dict[str, str], module: str) -> str:
    chain = [module]
    while via[chain[-1]]:
        chain.append(via[chain[-1]])
    return " <- ".join(chain)


BELOW = {
    "unroller.compiler.codegen": OUTSIDE,
    "unroller.materialize": OUTSIDE,
    "unroller.analysis.inputs": OUTSIDE,
    "unroller.analysis.plan": (
        "unroller.analysis.verify",
        "unroller.api",
        "unroller.oneshot",
        "unroller.bench",
    ),
}
"""What each module must never reach: the code generator and what makes its output run (a
module written and imported, a seeded batch) stay below everything that drives them; the
planner steps the modules it plans through ``materialize``, not through verify or the
library layer above it."""


@pytest.mark.parametrize("module", sorted(BELOW))
def test_a_lower_module_never_reaches_what_drives_it(import_graph, module):
    via = _closure(import_graph, module)
    above = BELOW[module]
    reached = [m for m in via if any(m == o or m.startswith(o + ".") for o in above)]
    assert reached == [], [_chain(via, m) for m in reached]


def _cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One import cycle among ``nodes`` (edges through any module count), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for found in sorted(graph[module]):
            if state.get(found) == 1 and found in nodes:
                return path[path.index(found) :] + [found]
            if found not in state:
                cycle = visit(found)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(nodes):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_core_modules_import_no_cycle(import_graph):
    core = {m for m in import_graph if m.startswith(CORE_PACKAGE + ".")} | {"unroller.errors"}
    assert {"unroller.compiler.codegen", "unroller.compiler.graph"} <= core
    within = {m: import_graph[m] & core for m in core}
    assert _cycle(within, core) is None


LIBRARY = (
    "unroller.api",
    "unroller.analysis.plan",
    "unroller.analysis.verify",
    "unroller.analysis.estimate",
    "unroller.analysis.memory",
    "unroller.oneshot",
    "unroller.materialize",
    "unroller.analysis.inputs",
    "unroller.importer.api",
    "unroller.importer.torch_frontend",
    "unroller.importer.masks",
    "unroller.importer.batch_merge",
)
"""The library layer's modules: none may sit on an import cycle."""


def _cycle_through(graph: dict[str, set[str]], module: str) -> list[str] | None:
    """One import cycle through ``module`` (any modules on the way), or None: a path from
    each module it imports back to it."""
    for found in sorted(graph[module]):
        via = _closure(graph, found)
        if module in via:
            return [module, *reversed(_chain(via, module).split(" <- "))]
    return None


@pytest.mark.parametrize("module", LIBRARY)
def test_no_import_cycle_passes_through_the_library_layer(import_graph, module):
    """Counting imports inside functions: were one of these modules on a cycle, which loads
    first would depend on call order, and no module of the cycle could be read or tested
    alone."""
    assert module in import_graph
    assert _cycle_through(import_graph, module) is None


def test_the_cycle_check_through_a_module_finds_one():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(graph, "d") is None


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph, set(graph)) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}, {"a", "b"}) is None


def test_the_stash_observer_sees_every_kept_tensor_by_full_name():
    """The probe step reads saved tensors through ``observe_stash``, not by replacing
    ``stash``: each log made inside the block reports raw tensors by full (block) name."""
    import torch

    from unroller.runtime.common import observe_stash, stash, stash_log, stash_raw

    seen: dict[str, torch.Tensor] = {}
    x, y = torch.ones(2, 3), torch.zeros(2)
    with observe_stash(lambda key, t: seen.setdefault(key, t)):
        log = stash_log()
        stash_raw(log.within("blk"), {"x": x})
        stash(log, "y", y)
    assert set(seen) == {"blk.x", "y"} and seen["blk.x"] is x
    assert [row[0] for row in log] == ["blk.x", "y"]
    stash_raw(stash_log(), {"z": x})  # outside the block: nobody is told
    assert set(seen) == {"blk.x", "y"}


def test_the_step_observer_sees_each_training_step_with_its_node():
    from unroller.compiler.graph import build_graph
    from unroller.compiler.lower import Lowering
    from unroller.compiler.parser import parse

    text = (ROOT / "benchmarks" / "models" / "quick.txt").read_text(encoding="utf-8")
    graph = build_graph(parse(text, "quick.txt"))
    made: list[tuple[str, str]] = []
    steps = Lowering(graph, observer=lambda s, n: made.append((s.section, n.name))).training_steps()
    trained = {n.name for n in graph.nodes}
    assert {name for _, name in made} == trained
    assert {section for section, _ in made} >= {"forward", "backward"}
    assert len(made) <= len(steps)
