"""The wheel carries grammars/ and templates/, so an install outside the checkout works."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    assert "unroller/ops.toml" in names
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
