"""generated/ is the golden copy: it must equal what the generator emits now."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.generate_all import targets
from unroller.api import generate_source
from unroller.cli import app
from unroller.codegen import edited_by_hand, read_header

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("model, options, out", targets(), ids=lambda t: str(t)[-40:])
def test_checked_in_file_is_current(model, options, out):
    assert out.exists(), f"{out} is missing: run `make generate`"
    text = out.read_text(encoding="utf-8")
    assert text == generate_source(model, options, label=model.relative_to(ROOT).as_posix())
    header = read_header(text)
    assert header["platform"] == options.platform and header["scheme"] == options.scheme
    assert not edited_by_hand(text)


def test_check_and_diff_on_the_golden_files(monkeypatch):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    result = runner.invoke(app, ["check", "generated"])
    assert result.exit_code == 0, result.output
    model = "benchmarks/models/resnet_like.txt"
    result = runner.invoke(app, ["diff", model, "--platform", "gpu"])
    assert result.exit_code == 0 and result.output == ""


def test_diff_shows_a_changed_model(tmp_path, monkeypatch):
    """Edit a copy of a golden model: diff exits 1 and shows the changed lines."""
    monkeypatch.chdir(ROOT)
    src = (ROOT / "benchmarks/models/resnet_like.txt").read_text()
    changed = tmp_path / "resnet_like.txt"
    changed.write_text(src.replace("out_features=10", "out_features=7"))
    golden = ROOT / "generated/gpu/resnet_like/nocompress.py"
    result = CliRunner().invoke(app, ["diff", str(changed), "--against", str(golden)])
    assert result.exit_code == 1
    assert (
        '-        K.add_layer(self, "linear", torch.nn.Linear(64, 10, bias=True))' in result.output
    )
    assert (
        '+        K.add_layer(self, "linear", torch.nn.Linear(64, 7, bias=True))' in result.output
    )


def test_generation_is_deterministic():
    a = generate_source(ROOT / "benchmarks/models/unet_like.txt", label="x.txt")
    b = generate_source(ROOT / "benchmarks/models/unet_like.txt", label="x.txt")
    assert a == b
    assert os.linesep not in a.replace("\n", "") or os.linesep == "\n"
