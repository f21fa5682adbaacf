"""The shape of the `unroll` package (unroller/cli/), checked so it stays that way.

No import cycles (each submodule imports alone, and the import graph walked with ``ast``
has no loop), nothing in the library imports the CLI, nothing imports the ``benchmarks``
folder (it is not in the wheel), no command tests a platform's name (it asks the
``Platform``), shared options are declared once, and ``unroll bench`` reaches
``unroller.bench`` only when it runs.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unroller.cli import app
from unroller.cli import train as train_commands
from unroller.compiler.platforms import PLATFORMS, platform
from unroller.compiler.schemes import SCHEMES

PACKAGE = Path(__file__).resolve().parents[2] / "unroller"
CLI = PACKAGE / "cli"
CLI_MODULES = sorted(
    f"unroller.cli.{p.stem}" for p in CLI.glob("*.py") if p.stem not in ("__init__", "__main__")
)

runner = CliRunner()


@functools.cache
def parsed(source: str) -> ast.Module:
    """The tree of one source text, parsed once per process: three checks below walk every
    file of the package (about 2 s of parsing each)."""
    return ast.parse(source)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions; ``from P import x``
    counts as ``P.x`` when ``x`` is a module of the tree, else as ``P``."""
    found: set[str] = set()
    package = module_name(path)
    if path.stem != "__init__":
        package = package.rsplit(".", 1)[0]
    for node in ast.walk(parsed(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                where = PACKAGE.parent.joinpath(*sub.split("."))
                is_module = where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()
                found.add(sub if is_module else base)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p): imported(p) for p in sorted(root.rglob("*.py"))}


def import_alone(module: str) -> subprocess.CompletedProcess:
    """``import module`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )


@functools.cache
def cli_import() -> dict:
    """What a fresh interpreter that runs ``import unroller.cli`` holds afterwards: the
    modules loaded (``modules``, or ``error``, the traceback, when the import failed)."""
    code = (
        "import json, sys, traceback\n"
        "try:\n"
        "    import unroller.cli\n"
        "    print(json.dumps({'modules': sorted(sys.modules)}))\n"
        "except BaseException:\n"
        "    print(json.dumps({'error': traceback.format_exc()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["unroller.cli", *CLI_MODULES])
def test_each_cli_module_imports_alone(module: str):
    """``import unroller.cli.X`` runs the package's ``__init__`` (which imports its command
    groups) before X itself, in any interpreter: a module that import already loaded
    imports alone when it did (one interpreter answers for all of them, not one each at
    0.5-1.5 s); any other is imported in an interpreter of its own."""
    found = cli_import()
    assert "error" not in found, found.get("error")
    if module not in found["modules"]:
        result = import_alone(module)
        assert result.returncode == 0, result.stderr


def test_the_cli_modules_import_no_cycle():
    graph = import_graph(CLI)
    assert set(CLI_MODULES) <= set(graph)
    for module, targets in graph.items():
        if module not in ("unroller.cli", "unroller.cli.__main__"):  # the app and its runner
            assert "unroller.cli" not in targets, f"{module} imports the cli package back"

    def visit(module: str, path: tuple[str, ...]) -> None:
        for target in sorted(graph.get(module, ())):
            assert target not in path, " -> ".join((*path, target))
            visit(target, (*path, target))

    for module in graph:
        visit(module, (module,))


def test_the_library_does_not_import_the_cli():
    for module, targets in import_graph(PACKAGE).items():
        if not module.startswith("unroller.cli"):
            assert not {t for t in targets if t.startswith("unroller.cli")}, module


def benchmarks_imports(source: str) -> list[str]:
    """Imports of the checkout's ``benchmarks`` folder, static or by name."""
    found = []
    for node in ast.walk(parsed(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args:
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else None
            callee = node.func.id if isinstance(node.func, ast.Name) else callee
            first = node.args[0]
            if callee in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names = [str(first.value)]
        found += [n for n in names if n == "benchmarks" or n.startswith("benchmarks.")]
    return found


def test_nothing_in_the_package_imports_benchmarks():
    for path in PACKAGE.rglob("*.py"):
        assert not benchmarks_imports(path.read_text(encoding="utf-8")), path


def test_no_command_tests_a_platform_name():
    """Platform rules come from the Platform object: no ``platform == "ipu"`` in the CLI."""
    for path in CLI.glob("*.py"):
        for node in ast.walk(parsed(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = [s.value for s in sides if isinstance(s, ast.Constant)]
                assert not set(named) & set(PLATFORMS), f"{path.name}:{node.lineno}"


def _platform_name_tests(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Where ``path`` decides by a platform's name: a comparison with one (``platform ==
    "ipu"``, ``in ("gpu",)``) or a dict keyed by every platform's name (a dispatch table)."""
    names = set(PLATFORMS)
    found = []
    for node in ast.walk(parsed(path.read_text(encoding="utf-8"))):
        sides: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            sides += [
                e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts
            ]
        keys = node.keys if isinstance(node, ast.Dict) else []
        constants = {s.value for s in [*sides, *keys] if isinstance(s, ast.Constant)}
        if (sides and constants & names) or (keys and names <= constants):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_module_decides_by_a_platform_name():
    """What differs between platforms is a ``Platform`` attribute (``estimate``,
    ``call_list``, ``graph_compiled``, ``device_sram_bytes``, ...): the estimate's dispatch,
    lint's default platform and the benchmark's PopTorch paths ask it, so adding a platform
    never means finding every ``== "ipu"``. Only ``platforms.py`` names them."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "platforms.py":
            found += _platform_name_tests(path)
    assert found == []


def test_the_name_check_sees_a_comparison_and_a_dispatch(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text('x = a == "ipu"\ny = b in ("gpu",)\nT = {"gpu": 1, "ipu": 2}\nok = {"ipu": 0}\n')
    assert _platform_name_tests(bad, tmp_path) == ["bad.py:1", "bad.py:2", "bad.py:3"]


def test_every_platform_fact_has_its_implementation():
    """Each ``Platform.estimate`` kind has an estimate, and lint's default platform
    (``LINTED``) has its list of supported calls."""
    from unroller.cli.estimate import ESTIMATES
    from unroller.compiler.platforms import LINTED
    from unroller.lint.supported import supported_ops_path

    assert {p.estimate for p in PLATFORMS.values()} <= set(ESTIMATES)
    assert LINTED.call_list and supported_ops_path(LINTED.name).is_file()
    for p in PLATFORMS.values():
        assert supported_ops_path(p.name).is_file() == p.call_list, p.name


# ---- options ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "diff", "graph", "lint"])
def test_help_lists_the_platforms(command: str):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "|".join(PLATFORMS) in result.stdout
    for p in PLATFORMS.values():
        assert p.summary.split()[0] in result.stdout


@pytest.mark.parametrize("command", ["generate", "diff", "graph", "train"])
def test_help_lists_the_schemes(command: str):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "|".join(SCHEMES) in result.stdout


def test_train_and_accuracy_share_one_option_set():
    from unroller.training.loop import OPTIMIZERS, SCHEDULES, TrainConfig

    fields = set(inspect.signature(TrainConfig).parameters)
    train = inspect.signature(train_commands.train).parameters
    accuracy = inspect.signature(train_commands.accuracy).parameters
    for name in train_commands.TRAINING:
        assert name in fields, name
        assert train[name].annotation == accuracy[name].annotation, name
        assert train[name].default == accuracy[name].default, name
    help_text = runner.invoke(app, ["train", "--help"]).stdout
    assert all(name in help_text for name in (*OPTIMIZERS, *SCHEDULES))


def test_importing_the_cli_does_not_import_training():
    """Training imports torch: `unroll --help` and `unroll generate` do not pay for it."""
    found = cli_import()
    assert "error" not in found, found.get("error")
    assert "unroller.cli.train" in found["modules"]  # the modules were recorded
    assert "unroller.training.loop" not in found["modules"]


# ---- unroll bench ----------------------------------------------------------------------


def test_bench_forwards_every_argument(monkeypatch):
    seen: list[list[str]] = []
    harness = types.ModuleType("unroller.bench")
    harness.main = lambda argv=None: seen.append(list(argv)) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "unroller.bench", harness)
    args = ["--benchmark", "resnet34", "--scheme", "dct-dense", "--help"]
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 3, result.output
    assert seen == [args]


def test_bench_without_the_harness_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "unroller.bench", None)  # import raises ImportError
    result = runner.invoke(app, ["bench", "--benchmark", "resnet34"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("unroll: error: the benchmark harness")
    assert "Traceback" not in result.output


def test_platform_rules_come_from_the_platform(tmp_path, monkeypatch):
    """--num-ipus and --stage-starts are refused on a platform that does not pipeline, and
    a stage count outside the platform's ``stage_counts`` is refused."""
    monkeypatch.chdir(tmp_path)
    Path("m.txt").write_text(
        "model m {\n  input x: f32[N, 4]\n  target y: f32[N, 2]\n"
        "  a = linear(x, out_features=2)\n  loss = mse_loss(a, y)\n  return loss, a\n}\n"
    )
    for name in PLATFORMS:
        target = platform(name)
        base = ["generate", "m.txt", "--platform", name]
        if not target.pipelined:
            for extra in (["--num-ipus", "2"], ["--stage-starts", "a"]):
                result = runner.invoke(app, [*base, *extra])
                assert result.exit_code == 2, result.output
                assert "--num-ipus and --stage-starts are for --platform" in result.stderr
        bad = max(target.stage_counts) + 1
        result = runner.invoke(app, [*base, "--num-ipus", str(bad)])
        assert result.exit_code == 2, result.output
        if target.pipelined:
            counts = ", ".join(map(str, target.stage_counts))
            assert f"--num-ipus must be one of {counts}" in result.stderr
