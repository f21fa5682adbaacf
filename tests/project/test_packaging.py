"""The wheel carries grammars/, templates/ and the CLI package, and nothing in it needs the
checkout (no import of the benchmarks/ folder), so an install outside the checkout works."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{result.stderr[-2000:]}")
    (found,) = out.glob("unroller-*.whl")
    return found


def test_wheel_contains_grammar_templates_and_registry(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "unroller/_data/grammars/model.lark" in names
    assert "unroller/_data/templates/gpu/module.py.j2" in names
    assert "unroller/compiler/ops.toml" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_generates_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    model = tmp_path / "m.txt"
    model.write_text(
        "model m {\n  input x: f32[N, 4]\n  target y: f32[N, 2]\n"
        "  a = linear(x, out_features=2)\n  loss = mse_loss(a, y)\n  return loss, a\n}\n"
    )
    code = (
        "import unroller.resources as r, unroller.api as api;"
        "assert '_data' in str(r.resource_dir('grammars')), r.resource_dir('grammars');"
        "print(api.generate_source('m.txt').splitlines()[0])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# unroller: ")


def test_wheel_carries_the_cli_package_and_its_entry_point(wheel):
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    for module in sorted((ROOT / "unroller" / "cli").glob("*.py")):
        assert f"unroller/cli/{module.name}" in names
    assert "unroller/cli.py" not in names and "unroller/cli_train.py" not in names
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    lines = archive.read(entry_points).decode().splitlines()
    assert any(line.replace(" ", "") == "unroll=unroller.cli:main" for line in lines), lines


def imports_benchmarks(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
            return True
    return False


def test_wheel_code_does_not_import_the_benchmarks_folder(wheel):
    archive = zipfile.ZipFile(wheel)
    offenders = [
        name
        for name in archive.namelist()
        if name.endswith(".py") and imports_benchmarks(archive.read(name).decode("utf-8"))
    ]
    assert offenders == []


def test_installed_wheel_runs_the_cli(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    code = (
        "import os, sys, unroller.cli as c;"
        "assert c.__file__.startswith(os.environ['PYTHONPATH']), c.__file__;"
        "sys.argv[0] = 'unroll'; c.main()"
    )
    for args in (["--help"], ["generate", "--help"], ["ops"]):
        result = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout
