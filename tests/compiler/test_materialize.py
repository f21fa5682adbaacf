"""``unroller.materialize``: the one path from a graph to a loaded module.

Nine places used to render, write and import generated code each their own way (a file
name here, a skipped atomic write there, a module left in ``sys.modules``); now each goes
through ``materialize`` (or its ``load_source`` / ``load_file`` for a text already rendered
or a file another process wrote). The scan below keeps it so: no other module of the
package or the benchmarks imports code from a file.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from unroller.api import graph_from_text
from unroller.compiler.options import Options
from unroller.materialize import digest, load_file, load_source, materialize, model_class

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "unroller/materialize.py": "the one place generated code is written and imported",
    "unroller/importer/source.py": (
        "imports the USER's network source file (``unroll import path/file.py:Name``), "
        "not generated code"
    ),
}
"""Modules that may import Python code from a file, each with the reason."""

IMPORTING = {"import_generated", "spec_from_file_location", "exec_module", "exec", "run_source"}
"""Calls that import a module from a file or run code text (``import_generated``: the
helper that did it before materialize, by its old name; ``exec`` and ``run_source``: how
materialize runs the checked text, compiled in memory)."""

MODEL = """\
model tiny {
    input x: f32[N, 4]
    target y: i64[N]
    h = linear(x, out_features=3)
    loss = cross_entropy(h, y)
    return loss, h
}
"""


def _sources() -> list[Path]:
    return sorted([*(ROOT / "unroller").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])


def _importing_calls(path: Path) -> list[str]:
    """Where ``path`` calls one of ``IMPORTING`` (as a name or an attribute), as
    ``line: name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in IMPORTING:
                found.append(f"{node.lineno}: {name}")
    return found


def test_only_materialize_imports_generated_code():
    """Every module of ``unroller/`` and ``benchmarks/`` but the allowed ones: no call that
    imports a module from a file (``import_generated``, ``spec_from_file_location``,
    ``exec_module``). A string holding such code (``benchmarks/equivalence.py`` runs the
    generator of another git revision in a subprocess, which may predate materialize) is
    not a call and is not counted."""
    offenders = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        calls = _importing_calls(path)
        if calls:
            offenders[rel] = calls
    assert offenders == {}, f"import generated code through unroller.materialize: {offenders}"


def test_the_scan_finds_an_import_of_a_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('m', 'm.py')\n"
        "spec.loader.exec_module(object())\n",
        encoding="utf-8",
    )
    assert _importing_calls(bad) == ["2: spec_from_file_location", "3: exec_module"]


def test_allowed_modules_exist_and_import_files():
    for rel in ALLOWED:
        assert _importing_calls(ROOT / rel), rel


def test_materialize_renders_writes_imports_and_reuses(tmp_path):
    graph = graph_from_text(MODEL, "tiny.txt")
    options = Options(scheme="nocompress")
    first = materialize(
        graph,
        "tiny.txt",
        options,
        folder=tmp_path,
        file_name="tiny_{digest}.py",
        module_name="test_materialize_{digest}",
    )
    assert first.path == tmp_path / f"tiny_{digest(first.source)}.py"
    assert first.path.read_text(encoding="utf-8") == first.source
    assert first.header is not None
    assert sys.modules[f"test_materialize_{digest(first.source)}"] is first.module
    stamp = first.path.stat().st_mtime_ns
    again = materialize(graph, "tiny.txt", options, folder=tmp_path, file_name="tiny_{digest}.py")
    assert again.path == first.path and first.path.stat().st_mtime_ns == stamp  # not rewritten
    loss = first.Model()(torch.randn(2, 4), torch.tensor([0, 2]))
    assert loss.dim() == 0
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary left


def test_a_temporary_module_leaves_no_file_and_no_module(tmp_path, monkeypatch):
    """What verify and the planner step: imported from a temporary folder that is removed
    right after, and taken out of ``sys.modules`` again; the class still runs."""
    folder = tmp_path / "made"
    monkeypatch.setattr(
        "unroller.materialize.tempfile.mkdtemp", lambda prefix: str(folder.mkdir() or folder)
    )
    graph = graph_from_text(MODEL, "tiny.txt")
    before = set(sys.modules)
    Model = model_class(graph, "tiny.txt")
    assert set(sys.modules) == before
    assert not folder.exists()
    assert Model()(torch.randn(2, 4), torch.tensor([0, 1])).dim() == 0


def test_a_changed_source_replaces_the_file_whole(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("x = 1\n", encoding="utf-8")
    loaded = load_source("x = 2\n", tmp_path, "m.py", "test_materialize_changed")
    assert loaded.module.x == 2 and path.read_text(encoding="utf-8") == "x = 2\n"
    assert load_file(path, "test_materialize_again", keep_module=False).x == 2
    assert "test_materialize_again" not in sys.modules


def test_the_auto_scheme_must_be_resolved_first(tmp_path):
    graph = graph_from_text(MODEL, "tiny.txt")
    with pytest.raises(Exception, match="auto"):
        materialize(graph, "tiny.txt", Options(scheme="auto"), folder=tmp_path)
