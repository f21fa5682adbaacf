"""Results files name where things are relative to the repository, never as a path of the
machine that measured them: a clone has no /tmp/run or /home/someone, and a results file
that names one says nothing true about the clone. The writers record paths as
``unroller.bench.machine.shown_path`` and command lines as ``shown_argument`` do."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from unroller.bench.machine import shown_argument, shown_path

RESULTS = ROOT / "benchmarks" / "results"

# A POSIX path of two parts or more that starts at the root (/tmp/x, "/srv/a/b"), a home
# folder (~/x) or a Windows drive (C:\x); "a / b", "MiB/sample" and "1/12" are not.
ABSOLUTE = re.compile(r"(?<![\w.~/\\-])/(?:[\w.+-]+/)+[\w.+-]*|\b[A-Za-z]:\\|(?<![\w.])~/\w")


def _absolute_paths(text: str) -> list[str]:
    return [match.group(0) for match in ABSOLUTE.finditer(text)]


def test_no_results_file_names_an_absolute_path():
    bad = []
    for path in sorted(RESULTS.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # a plot
            continue
        found = _absolute_paths(data.decode("utf-8", errors="replace"))
        if found:
            bad.append(f"{path.relative_to(ROOT)}: {sorted(set(found))[:3]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text",
    [
        '"executable": "/srv/checkout/.venv/bin/python"',
        "--out-dir /tmp/full/emdenoise",
        "--out=/tmp/acc",
        "(real, /root/.pyenv/versions/3.11.7/lib/python3.11, tests left out)",
        "C:\\Users\\me\\run",
        "--models-dir ~/models",
    ],
)
def test_the_pattern_catches_machine_paths(text):
    assert _absolute_paths(text), text


@pytest.mark.parametrize(
    "text",
    [
        "--out-dir benchmarks/results/full/emdenoise",
        '"executable": ".venv/bin/python"',
        "| ours / autograd | 0.12 MiB/sample | 1/12 | p10/p90 |",
        "bits/char, 8/4/2 bits",
    ],
)
def test_the_pattern_passes_relative_paths_and_ratios(text):
    assert not _absolute_paths(text), text


def test_a_command_line_records_no_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = tmp_path / "runs" / "a"
    assert shown_path(inside) == "runs/a"
    assert shown_argument(str(inside)) == "runs/a"
    assert shown_argument(f"--out-dir={inside}") == "--out-dir=runs/a"
    assert shown_argument("/elsewhere/run") == "run"  # outside: its last part only
    for word in ("--iterations", "7", "--scheme=quant", "runs/b", "-"):
        assert shown_argument(word) == word
