"""Hostile or careless input to ``unroll plan`` and ``unroll estimate``, and path names too
long for the file system in every command.

``plan -o`` once replaced any file, the model text itself included, wrote its config
even when no plan met the budget (exit 1), and created missing folders: it now follows
``generate -o`` (refused before the probe step, ``--force``, ``--mkdir``) and never
replaces the model file. ``estimate`` once stopped its batch search at 65,536 (gpu) /
4,096 (ipu) and printed the cap as the largest batch: it now searches to the real limit,
and a search that reaches its ceiling says "at least". A path component over 255
characters (ENAMETOOLONG) was a traceback in check, lint, diff, plan and more: it is one
``error:`` line, exit 2, in every command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import time_limit

import unroller.analysis.estimate as estimate_module
import unroller.analysis.plan as planner
from tests.adversarial import cli_cases
from tests.adversarial.cli_cases import invoke
from unroller.api import load_graph
from unroller.compiler.options import Options

MODEL = """\
model lin {
    input x: f32[N, 6]
    target y: f32[N, 2]
    h = linear(x, out_features=5)
    a = tanh(h)
    o = linear(a, out_features=2)
    loss = mse_loss(o, y)
    return loss, o
}
"""
PLAN = ["plan", "m.txt", "--batch-size", "4", "--probe-batch", "2"]
LONG = "x" * 300  # over NAME_MAX (255) on every common file system


def refused(result, *phrases: str) -> str:
    return cli_cases.refused(result, *phrases, located=True)


@pytest.fixture(autouse=True)
def alarm():
    """No case may block or search for long."""
    with time_limit(60, TimeoutError("ran for 60 s")):
        yield


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.txt").write_text(MODEL, encoding="utf-8")
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ---- plan -o ----------------------------------------------------------------------------


@pytest.fixture
def no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused -o is refused before the probe step: reaching it fails the test."""

    def probe(*args, **kwargs):
        raise AssertionError("the probe step ran before -o was refused")

    monkeypatch.setattr(planner, "run_probe", probe)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_plan_never_replaces_the_model_file(work: Path, no_probe, force: list[str]):
    (work / "alias.txt").symlink_to("m.txt")
    for name in ("m.txt", "./m.txt", "alias.txt", str(work / "m.txt")):
        refused(invoke(*PLAN, "-o", name, *force), "is the input file", "never replaced")
    assert (work / "m.txt").read_text(encoding="utf-8") == MODEL


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_generate_never_replaces_its_model_or_config(work: Path, force: list[str]):
    (work / "c.toml").write_text('[default]\ncompressor = "quant"\nbits = 8\n')
    (work / "alias.txt").symlink_to("m.txt")
    before = snapshot(work)
    for name in ("m.txt", "alias.txt", str(work / "m.txt")):
        refused(invoke("generate", "m.txt", "-o", name, *force), "is the input file")
    config = ["--compress-config", "c.toml"]
    refused(invoke("generate", "m.txt", *config, "-o", "c.toml", *force), "is the input file")
    assert snapshot(work) == before


def test_plan_replaces_only_a_config_it_wrote(work: Path):
    (work / "mine.toml").write_text("# my own notes\n[default]\ncompressor = 'none'\n")
    before = snapshot(work)
    refused(invoke(*PLAN, "-o", "mine.toml"), "not written by unroll plan", "--force")
    assert snapshot(work) == before
    assert invoke(*PLAN, "-o", "plan.toml").exit_code == 0  # new: written
    written = (work / "plan.toml").read_text()
    assert written.startswith("# Written by unroll plan")
    assert invoke(*PLAN, "-o", "plan.toml").exit_code == 0  # its own: replaced
    assert invoke(*PLAN, "-o", "mine.toml", "--force").exit_code == 0
    assert (work / "mine.toml").read_text() == written


def test_plan_writes_nothing_when_the_budget_is_not_met(work: Path):
    result = invoke(*PLAN, "--memory-budget", "1", "-o", "plan.toml")
    assert result.exit_code == 1, result.output
    assert "plan.toml not written: no plan fits the memory budget" in result.stderr
    assert not (work / "plan.toml").exists()
    assert invoke(*PLAN, "-o", "plan.toml").exit_code == 0
    before = snapshot(work)
    assert invoke(*PLAN, "--memory-budget", "1", "-o", "plan.toml").exit_code == 1
    assert snapshot(work) == before  # the earlier config is kept, not replaced


def test_plan_creates_a_folder_only_with_mkdir(work: Path, no_probe):
    refused(invoke(*PLAN, "-o", "new/sub/x.toml"), "does not exist", "--mkdir")
    assert not (work / "new").exists()


def test_plan_mkdir_creates_the_folder(work: Path):
    assert invoke(*PLAN, "-o", "new/sub/x.toml", "--mkdir").exit_code == 0
    assert (work / "new" / "sub" / "x.toml").read_text().startswith("# Written by unroll plan")


def test_plan_refuses_devices_and_folders_as_output(work: Path, no_probe):
    refused(invoke(*PLAN, "-o", "/dev/null"), "character device")
    (work / "dir").mkdir()
    refused(invoke(*PLAN, "-o", "dir"), "is a folder")


# ---- estimate's batch search -------------------------------------------------------------


def estimate_json(*args: str) -> dict:
    result = invoke("estimate", "m.txt", "--scheme", "nocompress", "--format", "json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_gpu_max_batch_is_the_real_limit_not_a_cap(work: Path):
    """80 GiB holds far more than 65,536 samples of this model: the answer is the last
    batch whose predicted total fits, the next one does not."""
    row = estimate_json("--platform", "gpu")["rows"][0]
    batch, device = row["max_batch"], row["device_bytes"]
    assert batch > 1 << 16 and not row["max_batch_at_least"]
    graph = load_graph("m.txt")
    config = Options(platform="gpu").compression(graph)
    state = row["state_bytes"]
    assert estimate_module._gpu_total(graph, config, batch, state)[0] <= device
    assert estimate_module._gpu_total(graph, config, batch + 1, state)[0] > device


def test_ipu_largest_on_chip_is_the_real_limit_not_a_cap(work: Path):
    row = estimate_json("--platform", "ipu")["rows"][0]
    largest = row["largest_on_chip_micro_batch"]
    assert largest > 4096 and not row["largest_on_chip_at_least"]
    graph, options = load_graph("m.txt"), Options(platform="ipu")
    assert estimate_module.estimate_ipu(graph, options, largest, 1).fits_on_chip
    assert not estimate_module.estimate_ipu(graph, options, largest + 1, 1).fits_on_chip


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_a_search_that_reaches_its_ceiling_says_at_least(
    work: Path, monkeypatch: pytest.MonkeyPatch, platform: str
):
    monkeypatch.setattr(estimate_module, "SEARCH_CEILING", 1024)
    row = estimate_json("--platform", platform)["rows"][0]
    key = "max_batch" if platform == "gpu" else "largest_on_chip_micro_batch"
    flag = "max_batch_at_least" if platform == "gpu" else "largest_on_chip_at_least"
    assert row[key] == 1024 and row[flag] is True
    result = invoke("estimate", "m.txt", "--platform", platform, "--scheme", "nocompress")
    assert result.exit_code == 0, result.output
    assert ">=1024" in result.stdout
    assert "the largest batch is at least 1024" in result.stdout


# ---- path components too long ------------------------------------------------------------

LONG_CASES = {
    "generate-model": ["generate", LONG],
    "generate-nested-model": ["generate", f"{LONG}/m.txt"],
    "generate-output": ["generate", "m.txt", "-o", LONG],
    "generate-output-folder": ["generate", "m.txt", "-o", f"{LONG}/x.py", "--mkdir"],
    "generate-config": ["generate", "m.txt", "--compress-config", LONG],
    "diff-model": ["diff", LONG],
    "diff-against": ["diff", "m.txt", "--against", LONG],
    "check-folder": ["check", LONG],
    "graph-model": ["graph", LONG],
    "lint-path": ["lint", LONG],
    "plan-model": ["plan", LONG],
    "plan-output": [*PLAN, "-o", LONG],
    "plan-output-folder": [*PLAN, "-o", f"{LONG}/p.toml", "--mkdir"],
    "estimate-model": ["estimate", LONG],
    "estimate-config": ["estimate", "m.txt", "--compress-config", LONG],
}


@pytest.mark.parametrize("case", LONG_CASES)
def test_a_name_too_long_is_one_error_line(work: Path, no_probe, case: str):
    before = snapshot(work)
    line = refused(invoke(*LONG_CASES[case]))
    phrase = "no checked-in file" if case == "diff-model" else "too long"  # looked up first
    assert phrase in line.lower(), line
    assert snapshot(work) == before and sorted(p.name for p in work.iterdir()) == ["m.txt"]
