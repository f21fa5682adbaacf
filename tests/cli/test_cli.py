"""The `unroll` command line: generate, diff, check, graph, --help, --version.

Most tests run the Typer app in process (``CliRunner``, fast); the ones where the real
exit status, the absence of a traceback or the process boundary matter (determinism
across ``PYTHONHASHSEED``) run the installed ``unroll`` script in a subprocess. Generated
files record their source relative to the working directory, so every test works in a
temporary directory it changes into.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unroller import __version__
from unroller.api import generate_source, load_model_class
from unroller.cli import app
from unroller.compiler.codegen import edited_by_hand, read_header
from unroller.compiler.options import Options

UNROLL = Path(sys.executable).with_name("unroll")
MODELS = Path(__file__).resolve().parents[1] / "models"

SMALL = """\
model small {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    c1 = conv2d(x, out_channels=4, kernel_size=3, padding=1)
    b1 = batchnorm2d(c1)
    r1 = relu(b1)
    p = maxpool2d(r1, kernel_size=2)
    f = flatten(p)
    fc = linear(f, out_features=10)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""
OTHER = """\
model other {
    input x: f32[N, 6]
    target y: f32[N, 2]
    h = linear(x, out_features=5)
    a = tanh(h)
    o = linear(a, out_features=2)
    loss = mse_loss(o, y)
    return loss, o
}
"""
BROKEN = SMALL.replace("kernel_size=2)", "kernel_size=2, strid=2)")

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp working directory holding small.txt and other.txt."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.txt").write_text(SMALL, encoding="utf-8")
    (tmp_path / "other.txt").write_text(OTHER, encoding="utf-8")
    return tmp_path


def fresh(model: str = "small.txt") -> str:
    return generate_source(model, Options())


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def run_unroll(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(UNROLL), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env},
        timeout=120,
    )


# ---- help and version -----------------------------------------------------------------


@pytest.mark.parametrize("command", [None, "generate", "diff", "check", "graph", "ops"])
def test_help_has_an_example(command: str | None):
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    assert "Example" in result.stdout
    assert "unroll " in result.stdout.split("Example", 1)[1]


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"unroller {__version__}"


def test_ops_lists_the_registry():
    result = invoke("ops")
    assert result.exit_code == 0
    assert result.stdout.startswith("conv2d(x, out_channels, kernel_size")
    assert "cross_entropy(logits, target, label_smoothing=0.0, ignore_index=-100)" in result.stdout


# ---- generate -------------------------------------------------------------------------


def test_generate_to_stdout(work: Path):
    for args in (["generate", "small.txt"], ["generate", "small.txt", "-o", "-"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert result.stdout == fresh()
    assert listing(work) == ["other.txt", "small.txt"]


def test_generate_to_file_records_the_relative_source(work: Path):
    args = ["--platform", "gpu", "--scheme", "nocompress", "-o", "gen/small.py", "--mkdir"]
    result = invoke("generate", "small.txt", *args)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "wrote gen/small.py" in result.stderr
    text = (work / "gen/small.py").read_text(encoding="utf-8")
    assert text == fresh()
    header = read_header(text)
    assert header["source"] == "small.txt"
    assert header["platform"] == "gpu" and header["scheme"] == "nocompress"
    assert not edited_by_hand(text)
    # Atomic write: the temp file was renamed, nothing else is left beside it.
    assert listing(work / "gen") == ["small.py"]


def test_generate_replaces_an_untouched_generated_file(work: Path):
    assert invoke("generate", "small.txt", "-o", "out.py").exit_code == 0
    (work / "small.txt").write_text(SMALL.replace("out_features=10", "out_features=7"))
    result = invoke("generate", "small.txt", "-o", "out.py")
    assert result.exit_code == 0, result.output
    assert "Linear(64, 7" in (work / "out.py").read_text()
    assert listing(work) == ["other.txt", "out.py", "small.txt"]


def test_generate_refuses_a_hand_edited_file_until_forced(work: Path):
    assert invoke("generate", "small.txt", "-o", "out.py").exit_code == 0
    out = work / "out.py"
    lines = out.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if "K.relu(" in line)
    lines[index] = lines[index].replace("K.relu(", "K.gelu(")  # a one-line hand edit
    edited = "".join(lines)
    out.write_text(edited)
    result = invoke("generate", "small.txt", "-o", "out.py")
    assert result.exit_code != 0
    assert "edited by hand" in result.stderr and "--force" in result.stderr
    assert out.read_text() == edited
    result = invoke("generate", "small.txt", "-o", "out.py", "--force")
    assert result.exit_code == 0, result.output
    assert out.read_text() == fresh()


def test_generate_refuses_a_non_generated_file_until_forced(work: Path):
    out = work / "notes.py"
    out.write_text("print('mine')\n")
    result = invoke("generate", "small.txt", "-o", "notes.py")
    assert result.exit_code != 0
    assert "not generated by unroller" in result.stderr
    assert out.read_text() == "print('mine')\n"
    assert invoke("generate", "small.txt", "-o", "notes.py", "--force").exit_code == 0
    assert out.read_text() == fresh()


def test_generate_model_error_leaves_existing_file_untouched(work: Path):
    assert invoke("generate", "small.txt", "-o", "out.py").exit_code == 0
    before = (work / "out.py").read_bytes()
    (work / "small.txt").write_text(BROKEN)
    for extra in ([], ["--force"]):
        result = invoke("generate", "small.txt", "-o", "out.py", *extra)
        assert result.exit_code == 2
        assert result.stderr.startswith("small.txt:7:")
        assert "error: maxpool2d has no argument 'strid'" in result.stderr
        assert (work / "out.py").read_bytes() == before
    assert listing(work) == ["other.txt", "out.py", "small.txt"]


def test_generate_failed_write_leaves_file_and_no_temp(work: Path, monkeypatch):
    assert invoke("generate", "small.txt", "-o", "out.py").exit_code == 0
    before = (work / "out.py").read_bytes()
    (work / "small.txt").write_text(SMALL.replace("out_features=10", "out_features=7"))

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("unroller.files.os.replace", broken_replace)
    result = invoke("generate", "small.txt", "-o", "out.py")
    assert result.exit_code == 2, result.output
    assert "cannot write out.py" in result.stderr
    assert (work / "out.py").read_bytes() == before
    assert listing(work) == ["other.txt", "out.py", "small.txt"]


def test_generate_to_a_folder_is_an_error(work: Path):
    (work / "gen").mkdir()
    for extra in ([], ["--force"]):
        result = invoke("generate", "small.txt", "-o", "gen", *extra)
        assert result.exit_code == 2
        assert "gen is a folder" in result.stderr
    assert listing(work / "gen") == []


def test_unknown_platform_and_scheme(work: Path):
    result = invoke("generate", "small.txt", "--platform", "tpu")
    assert result.exit_code == 2 and "unknown platform 'tpu'" in result.stderr
    result = invoke("generate", "small.txt", "--scheme", "zip")
    assert result.exit_code == 2 and "unknown scheme 'zip'" in result.stderr


def test_generate_subprocess_error_has_no_traceback(work: Path):
    (work / "small.txt").write_text(BROKEN)
    (work / "out.py").write_text(fresh("other.txt"))
    before = (work / "out.py").read_bytes()
    result = run_unroll("generate", "small.txt", "-o", "out.py", cwd=work)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "small.txt:7:" in result.stderr and "^" in result.stderr
    assert (work / "out.py").read_bytes() == before


@pytest.mark.slow  # 10 s: make test-slow (generation within one process is checked fast)
def test_generation_is_deterministic_across_processes(work: Path):
    shutil.copy(MODELS / "tiny_resnet.txt", work / "tiny_resnet.txt")
    texts = []
    for seed in ("0", "12345"):
        result = run_unroll("generate", "tiny_resnet.txt", cwd=work, PYTHONHASHSEED=seed)
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout)
    assert texts[0] == texts[1]
    assert texts[0] == fresh("tiny_resnet.txt")


# ---- diff -----------------------------------------------------------------------------


def test_diff_against_a_file(work: Path):
    assert invoke("generate", "small.txt", "-o", "out.py").exit_code == 0
    result = invoke("diff", "small.txt", "--platform", "gpu", "--against", "out.py")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    (work / "small.txt").write_text(SMALL.replace("out_features=10", "out_features=7"))
    result = invoke("diff", "small.txt", "--platform", "gpu", "--against", "out.py")
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "--- out.py"
    assert lines[1].startswith("+++ small.txt")
    assert any(line.startswith("@@ -") for line in lines)
    assert any(line.startswith("-") and "torch.nn.Linear(64, 10" in line for line in lines)
    assert any(line.startswith("+") and "torch.nn.Linear(64, 7" in line for line in lines)
    # Only the recorded hash, the checksum and what follows from the edit changed.
    changed = [line for line in lines[2:] if line[:1] in "+-"]
    assert len(changed) == 14, changed
    assert all(("out_features=" in c or "Linear(64, " in c or "unroller" in c) for c in changed)


def test_diff_against_the_checked_in_file(work: Path):
    result = invoke("diff", "small.txt")
    assert result.exit_code == 2
    assert "no checked-in file" in result.stderr
    out = "generated/gpu/small/nocompress.py"
    assert invoke("generate", "small.txt", "-o", out, "--mkdir").exit_code == 0
    result = invoke("diff", "small.txt", "--platform", "gpu")
    assert result.exit_code == 0 and result.stdout == ""
    (work / "small.txt").write_text(SMALL.replace("padding=1", "padding=0"))
    result = invoke("diff", "small.txt", "--platform", "gpu", "--scheme", "nocompress")
    assert result.exit_code == 1
    assert result.stdout.startswith("--- generated/gpu/small/nocompress.py\n+++ ")


def test_diff_finds_a_checked_in_file_by_its_header(work: Path):
    assert invoke("generate", "other.txt", "-o", "generated/misc/o.py", "--mkdir").exit_code == 0
    assert invoke("diff", "other.txt").exit_code == 0
    (work / "other.txt").write_text(OTHER.replace("out_features=5", "out_features=6"))
    result = invoke("diff", "other.txt")
    assert result.exit_code == 1
    assert result.stdout.startswith("--- generated/misc/o.py\n")


def test_diff_against_a_missing_file(work: Path):
    result = invoke("diff", "small.txt", "--against", "nope.py")
    assert result.exit_code == 2
    assert "nope.py does not exist" in result.stderr


def test_diff_scheme_against_itself_is_empty(work: Path):
    result = invoke("diff", "small.txt", "--scheme", "nocompress", "--scheme", "nocompress")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    result = invoke("diff", "small.txt", "--scheme", "nocompress", "--scheme", "bogus")
    assert result.exit_code == 2 and "unknown scheme 'bogus'" in result.stderr
    result = invoke("diff", "small.txt", *["--scheme", "nocompress"] * 3)
    assert result.exit_code == 2


def test_diff_model_error(work: Path):
    (work / "small.txt").write_text(BROKEN)
    result = invoke("diff", "small.txt", "--scheme", "nocompress", "--scheme", "nocompress")
    assert result.exit_code == 2
    assert result.stderr.startswith("small.txt:7:")


# ---- check ----------------------------------------------------------------------------


def test_check_fresh_and_stale(work: Path):
    for stem in ("small", "other"):
        assert (
            invoke(
                "generate", f"{stem}.txt", "-o", f"generated/gpu/{stem}/nocompress.py", "--mkdir"
            ).exit_code
            == 0
        )
    (work / "generated" / "README.md").write_text("not python\n")
    (work / "generated" / "__init__.py").write_text("")  # an empty __init__.py is fine
    result = invoke("check")
    assert result.exit_code == 0, result.output
    assert "2 up to date, 0 stale, 0 damaged/not generated" in result.stderr
    (work / "generated" / "helper.py").write_text("# not generated\n")  # any other .py is not
    result = invoke("check")
    assert result.exit_code == 1, result.output
    assert "generated/helper.py: not generated by unroller" in result.stderr
    assert "2 up to date, 0 stale, 1 damaged/not generated" in result.stderr
    (work / "generated" / "helper.py").unlink()

    (work / "other.txt").write_text(OTHER.replace("tanh", "sigmoid"))
    result = invoke("check", "generated")
    assert result.exit_code == 1
    assert "generated/gpu/other/nocompress.py" in result.stderr
    assert "generated/gpu/small/nocompress.py" not in result.stderr
    assert "1 up to date, 1 stale, 0 damaged" in result.stderr

    assert invoke("generate", "other.txt", "-o", "generated/gpu/other/nocompress.py").exit_code == 0
    result = invoke("check", "generated")
    assert result.exit_code == 0, result.output


def test_check_hand_edited_file_is_stale(work: Path):
    out = work / "gen" / "small.py"
    assert (
        invoke("generate", "small.txt", "-o", str(out.relative_to(work)), "--mkdir").exit_code == 0
    )
    out.write_text(out.read_text().replace("One training step", "One step"))
    result = invoke("check", "gen")
    assert result.exit_code == 1
    assert "gen/small.py" in result.stderr


def test_check_missing_source(work: Path):
    assert invoke("generate", "small.txt", "-o", "gen/small.py", "--mkdir").exit_code == 0
    assert invoke("generate", "other.txt", "-o", "gen/other.py").exit_code == 0
    (work / "small.txt").unlink()
    result = invoke("check", "gen")
    assert result.exit_code == 1
    assert "gen/small.py" in result.stderr and "missing" in result.stderr
    assert "gen/other.py" not in result.stderr


def test_check_broken_source_is_reported(work: Path):
    assert invoke("generate", "small.txt", "-o", "gen/small.py", "--mkdir").exit_code == 0
    (work / "small.txt").write_text(BROKEN)
    result = invoke("check", "gen")
    assert result.exit_code == 1
    assert "gen/small.py" in result.stderr and "cannot regenerate" in result.stderr


def test_check_from_another_directory(work: Path, monkeypatch):
    """The recorded relative source is found from an ancestor of the generated file."""
    assert invoke("generate", "small.txt", "-o", "gen/small.py", "--mkdir").exit_code == 0
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = invoke("check", str(work / "gen"))
    assert result.exit_code == 0, result.output


def test_check_not_a_folder(work: Path):
    result = invoke("check", "small.txt")
    assert result.exit_code == 2
    assert "not a folder" in result.stderr


# ---- graph ----------------------------------------------------------------------------


@pytest.fixture
def tiny(work: Path) -> Path:
    shutil.copy(MODELS / "tiny_resnet.txt", work / "tiny_resnet.txt")
    return work / "tiny_resnet.txt"


def graph_json(*args: str) -> dict:
    result = invoke("graph", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_graph_json(tiny: Path):
    report = graph_json("tiny_resnet.txt", "--batch-size", "4")
    assert report["model"] == "tiny_resnet" and report["batch_size"] == 4
    nodes = report["nodes"]
    assert [n["name"] for n in nodes][:3] == ["conv1", "bn1", "r"]
    assert {"name", "op", "output", "params", "saved_bytes", "new_saved_bytes"} <= set(nodes[0])
    assert report["total_saved_bytes"] == sum(n["new_saved_bytes"] for n in nodes)
    assert report["total_params"] == sum(n["params"] for n in nodes)
    conv1 = nodes[0]
    assert conv1["op"] == "conv2d" and conv1["output"] == "f32[N, 16, 32, 32]"
    assert conv1["params"] == 16 * 3 * 3 * 3
    assert conv1["new_saved_bytes"] == 4 * 3 * 32 * 32 * 4  # its input x, f32, batch 4
    fc = next(n for n in nodes if n["name"] == "fc")
    assert fc["params"] == 16 * 10 + 10
    # The generated module has exactly the parameters the report counts.
    model = load_model_class(tiny)()
    assert report["total_params"] == sum(p.numel() for p in model.parameters())


def test_graph_batch_size_scales_activations(tiny: Path):
    small, large = graph_json("tiny_resnet.txt", "--batch-size", "1"), graph_json(
        "tiny_resnet.txt", "--batch-size", "8"
    )
    assert large["total_params"] == small["total_params"]
    assert large["nodes"][0]["new_saved_bytes"] == 8 * small["nodes"][0]["new_saved_bytes"]
    assert large["total_saved_bytes"] > 7 * small["total_saved_bytes"]


def test_graph_table(tiny: Path):
    report = graph_json("tiny_resnet.txt", "--batch-size", "32")
    result = invoke("graph", "tiny_resnet.txt", "--batch-size", "32")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["node", "op", "output"]
    for node in report["nodes"]:
        assert any(line.split()[:2] == [node["name"], node["op"]] for line in lines), node["name"]
    total = report["total_saved_bytes"]
    summary = next(line for line in lines if line.startswith("model "))
    assert f"{total:,} bytes" in summary
    assert "batch 32" in summary and f"{report['total_params']:,} parameters" in summary
    stash = report["stash"]
    assert f"({stash['total_stored_bytes']:,} bytes)" in lines[-1]
    assert lines[-1].startswith("scheme nocompress: kept for backward")


def test_graph_dot(tiny: Path):
    result = invoke("graph", "tiny_resnet.txt", "--format", "dot")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("digraph")
    assert result.stdout.rstrip().endswith("}")
    assert '"layer1.0.conv1" -> "layer1.0.bn1";' in result.stdout


def test_graph_errors(work: Path):
    result = invoke("graph", "small.txt", "--format", "xml")
    assert result.exit_code == 2 and "unknown format" in result.stderr
    result = invoke("graph", "small.txt", "--batch-size", "0")
    assert result.exit_code == 2
    (work / "small.txt").write_text(BROKEN)
    result = invoke("graph", "small.txt")
    assert result.exit_code == 2
    assert result.stderr.startswith("small.txt:7:")
    result = invoke("graph", "missing.txt")
    assert result.exit_code == 2 and "no such model file" in result.stderr
