"""The kernels both platforms share are written and listed once: each in its family module,
whose ``__all__`` says what it shares; ``unroller.runtime.shared`` gathers them, and each
platform module takes them with one star import, so adding a shared kernel touches neither
platform module. ``unroll lint`` follows that star import to the definitions."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from unroller.lint import lint_module
from unroller.runtime import (
    common,
    gpu,
    ipu,
    norms,
    positions,
    precision,
    recurrent,
    shapeops,
    shared,
)

FAMILIES = (common, shapeops, norms, positions, precision, recurrent)
#: The shared names a platform defines again, its own formulation replacing the shared one.
OWN = {"gpu": {"linear", "linear_backward", "transposed_linear_backward"}, "ipu": {"unsupported"}}
PLATFORMS = {"gpu": gpu, "ipu": ipu}


def test_shared_is_every_family_export_once():
    names = [name for family in FAMILIES for name in family.__all__]
    assert len(names) == len(set(names)), "two family modules export the same name"
    assert shared.__all__ == sorted(names)
    for family in FAMILIES:
        for name in family.__all__:
            assert getattr(shared, name) is getattr(family, name), name


def test_family_exports_are_their_public_functions():
    """A family module's ``__all__`` is derived (common._exports): only the functions it
    keeps back by name are left out."""
    kept_back = {
        common: {"observe_stash", "keep_predictions"},
        positions: {"relative_buckets", "rotary_tables", "alibi_slopes", "alibi_bias"},
    }
    for family in FAMILIES:
        public = {
            name
            for name, obj in vars(family).items()
            if inspect.isfunction(obj)
            and not name.startswith("_")
            and obj.__module__ == family.__name__
        }
        assert set(family.__all__) == public - kept_back.get(family, set()), family.__name__


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_each_platform_takes_every_shared_name(platform):
    K = PLATFORMS[platform]
    for name in shared.__all__:
        assert name in K.__all__, name
        if name in OWN[platform]:
            assert getattr(K, name).__module__ == K.__name__, name
        else:
            assert getattr(K, name) is getattr(shared, name), name


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_platform_modules_import_by_name_only_what_their_own_code_uses(platform):
    """No re-export lists in gpu.py / ipu.py: a name imported from a family module is one
    the module's own code uses (a shared kernel reaches the platform through the star
    import alone)."""
    path = Path(PLATFORMS[platform].__file__)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    families = {family.__name__ for family in FAMILIES}
    imported = {
        alias.asname or alias.name: node.lineno
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module in families
        for alias in node.names
    }
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert {name for name in imported if name not in loaded} == set()
    stars = [
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
    ]
    assert stars == [shared.__name__]


def test_lint_follows_the_star_import_to_the_shared_definitions(tmp_path):
    """Linting ipu code checks the shared kernels it reaches through ``shared``, by name:
    common's relu and recurrent's lstm, not ipu's replaced ``unsupported`` from common nor
    gpu's accumulation."""
    gen = tmp_path / "gen.py"
    gen.write_text("import unroller.runtime.ipu as K\n", encoding="utf-8")
    report = lint_module(gen, "ipu")
    assert report.ok, report.format()
    checked = {path.name: names for path, names in report.partial.items()}
    assert {"relu", "linear", "collect"} <= set(checked["common.py"])
    assert "unsupported" not in checked["common.py"]
    assert {"lstm", "gru_backward"} <= set(checked["recurrent.py"])
    assert {"sum", "slice", "matmul"} <= set(checked["shapeops.py"])
    assert "accumulate" not in checked["shared.py"]
    assert Path(gpu.__file__).resolve() not in report.files
