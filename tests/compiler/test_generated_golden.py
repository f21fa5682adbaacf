"""generated/ is the golden copy: it must equal what the generator emits now."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.generate_all import targets
from unroller.api import generate_source
from unroller.cli import app
from unroller.compiler.codegen import edited_by_hand, read_header
from unroller.compiler.options import Options

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model, options, out", targets(), ids=lambda t: str(t)[-40:])
def test_checked_in_file_exists_and_is_untouched(model, options, out):
    """Every target is checked in, records its options and was not edited by hand.
    (Byte-identical regeneration of all of them is `unroll check generated`, which
    `make test` runs before pytest; it is not repeated here.)"""
    assert out.exists(), f"{out} is missing: run `make generate`"
    text = out.read_text(encoding="utf-8")
    header = read_header(text)
    assert header["source"] == model.relative_to(ROOT).as_posix()
    assert Options.from_header(header) == options
    assert not edited_by_hand(text)


def test_one_golden_file_regenerates_byte_identically(monkeypatch):
    monkeypatch.chdir(ROOT)
    model = ROOT / "benchmarks/models/quick.txt"
    golden = ROOT / "generated/gpu/quick/dct-dense.py"
    label = model.relative_to(ROOT).as_posix()
    assert golden.read_text() == generate_source(model, Options(scheme="dct-dense"), label=label)
    result = CliRunner().invoke(app, ["diff", label, "--platform", "gpu", "--scheme", "dct-dense"])
    assert result.exit_code == 0 and result.output == ""


def test_diff_shows_a_changed_model(tmp_path, monkeypatch):
    """Edit a copy of a golden model: diff exits 1 and shows the changed lines."""
    monkeypatch.chdir(ROOT)
    src = (ROOT / "benchmarks/models/quick.txt").read_text()
    changed = tmp_path / "quick.txt"
    changed.write_text(src.replace("out_features=10", "out_features=7"))
    golden = ROOT / "generated/gpu/quick/nocompress.py"
    result = CliRunner().invoke(app, ["diff", str(changed), "--against", str(golden)])
    assert result.exit_code == 1
    assert '-        K.add_layer(self, "linear", torch.nn.Linear(64, 10))' in result.output
    assert '+        K.add_layer(self, "linear", torch.nn.Linear(64, 7))' in result.output


def test_generation_is_deterministic():
    a = generate_source(ROOT / "benchmarks/models/unet_like.txt", label="x.txt")
    b = generate_source(ROOT / "benchmarks/models/unet_like.txt", label="x.txt")
    assert a == b
    assert os.linesep not in a.replace("\n", "") or os.linesep == "\n"
