"""`unroll lint --platform ipu` against kernels of operators added through ``UNROLLER_OPS``.

A user operator (``clip``) is registered from a tmp folder as tests/compiler/test_add_op.py does; its
IPU kernel module reaches ``torch.ops.aten.hardtanh`` in one way or another. Linting the
generated IPU module must follow ``import <kernels> as K2`` into the kernel module, the
helpers the called kernel uses (in the same module or in a second user module) and report
the unsupported call at its own file and line with the chain that reaches it. A kernel module
that cannot be found or read is an error; a dynamic access lint cannot resolve is a warning
and checks all of the module it names.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import time_limit
from typer.testing import CliRunner

from unroller import lint
from unroller.api import generate_from_text, write_atomic
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.lint import LintReport, lint_module, lint_paths
from unroller.lint import linter as lint_linter
from unroller.lint import resolve as lint_resolve
from unroller.lint import source as lint_source

ROOT = Path(__file__).resolve().parents[2]

MODEL = """\
model adv {
    input x: f32[N, 5]
    target y: f32[N, 3]
    h = linear(x, out_features=3)
    s = clip(h)
    loss = mse_loss(s, y)
    return loss, s
}
"""

REGISTRY = """\
[clip]
doc = "clamp to [-1, 1]"
kind = "activation"
inputs = ["x"]
shape = "same_float"
saved = ["x"]
activations = ["x"]
kernels.ipu = "KERNELS"
kernels.gpu = "KERNELS"
"""

BACKWARD = """


def clip_backward(g, x, *, needs=None):
    return (g * ((x > -1) & (x < 1)) if needs is None or needs[0] else None,)
"""

_ids = itertools.count()


@dataclass
class UserOp:
    generated: Path  # tmp/gen/adv_ipu.py
    kernels: Path  # tmp/ops/<kernels>.py
    helpers: Path  # tmp/ops/<helpers>.py (may not exist)
    ops: Path  # the folder of the registry file and the modules
    name: str  # the kernel module's import name

    def line_of(self, path: Path, marker: str) -> int:
        lines = path.read_text(encoding="utf-8").splitlines()
        return next(i for i, text in enumerate(lines, 1) if marker in text)


@pytest.fixture
def user_op(tmp_path, monkeypatch):
    """user_op(kernel_source, helpers_source=None) -> UserOp: the modules written to tmp/ops,
    registered through UNROLLER_OPS, and the IPU module generated from MODEL to tmp/gen.
    ``KERNELS`` / ``HELPERS`` in the sources stand for the modules' (unique) names."""
    made: list[str] = []

    def make(kernel: str, helpers: str | None = None) -> UserOp:
        n = f"{os.getpid()}_{next(_ids)}"
        name, helper_name = f"adv_kern_{n}", f"adv_help_{n}"
        ops = tmp_path / "ops"
        ops.mkdir(exist_ok=True)

        def fill(text: str) -> str:
            return textwrap.dedent(text).replace("KERNELS", name).replace("HELPERS", helper_name)

        (ops / "registry.toml").write_text(fill(REGISTRY), encoding="utf-8")
        (ops / f"{name}.py").write_text(fill(kernel) + BACKWARD, encoding="utf-8")
        if helpers is not None:
            (ops / f"{helper_name}.py").write_text(fill(helpers), encoding="utf-8")
        monkeypatch.setenv("UNROLLER_OPS", str(ops / "registry.toml"))
        monkeypatch.syspath_prepend(str(ops))
        made.extend((name, helper_name))
        text = generate_from_text(MODEL, Options(platform="ipu"), label="adv.txt")
        generated = write_atomic(tmp_path / "gen" / "adv_ipu.py", text)
        for module in (name, helper_name):
            sys.modules.pop(module, None)
        return UserOp(generated, ops / f"{name}.py", ops / f"{helper_name}.py", ops, name)

    yield make
    for module in made:
        sys.modules.pop(module, None)


def chain_names(call: lint.LintCall) -> list[str]:
    return [hop.name for hop in call.chain]


def the_error(report: LintReport, path: Path, line: int) -> lint.LintCall:
    at = [c for c in report.errors if c.file == path.resolve() and c.line == line]
    assert len(at) == 1, report.format()
    return at[0]


# ---------------------------------------------------------------- every way to reach hardtanh

VARIANTS = {
    "direct": (
        """\
        import torch


        def clip(x):
            return torch.ops.aten.hardtanh(x)  # BAD
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip"],
    ),
    "overload": (
        """\
        import torch


        def clip(x):
            return torch.ops.aten.hardtanh.default(x, -1.0, 1.0)  # BAD
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh.default",
        ["K2.clip"],
    ),
    "helper": (
        """\
        import torch


        def _clamp(x):
            return torch.ops.aten.hardtanh(x)  # BAD


        def clip(x):
            return _clamp(x) * 1.0
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip", "_clamp"],
    ),
    "second module": (
        """\
        import HELPERS as H


        def clip(x):
            return H.clamp(x)
        """,
        """\
        import torch


        def clamp(x):
            return torch.ops.aten.hardtanh(x)  # BAD
        """,
        "helpers",
        "torch.ops.aten.hardtanh",
        ["K2.clip", "H.clamp"],
    ),
    "helper of a second module": (
        """\
        from HELPERS import clamp


        def clip(x):
            return clamp(x)
        """,
        """\
        import torch


        def _inner(x):
            return torch.ops.aten.hardtanh(x)  # BAD


        def clamp(x):
            return _inner(x)
        """,
        "helpers",
        "torch.ops.aten.hardtanh",
        ["K2.clip", "clamp", "from HELPERS import clamp", "_inner"],
    ),
    "from torch.ops import aten": (
        """\
        from torch.ops import aten


        def clip(x):
            return aten.hardtanh(x)  # BAD
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip"],
    ),
    "from torch import ops": (
        """\
        from torch import ops


        def clip(x):
            return ops.aten.hardtanh(x)  # BAD
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip"],
    ),
    "getattr literal": (
        """\
        import torch


        def clip(x):
            return getattr(torch.ops.aten, "hardtanh")(x)  # BAD
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip"],
    ),
    "__import__": (
        """\
        def clip(x):
            return __import__("torch").ops.aten.hardtanh(x)  # BAD
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip"],
    ),
    "through a table": (
        """\
        import torch

        _ACTS = {"hardtanh": torch.ops.aten.hardtanh}  # BAD


        def clip(x):
            act = _ACTS["hardtanh"]
            return act(x)
        """,
        None,
        "kernels",
        "torch.ops.aten.hardtanh",
        ["K2.clip", "_ACTS"],
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hardtanh_in_a_user_kernel_is_flagged_with_its_chain(user_op, tmp_path, variant):
    kernel, helpers, where, name, chain = VARIANTS[variant]
    op = user_op(kernel, helpers)
    report = lint_module(op.generated, "ipu")
    assert not report.ok
    path = op.kernels if where == "kernels" else op.helpers
    line = op.line_of(path, "# BAD")
    error = the_error(report, path, line)
    assert error.name == name
    helpers_name = op.helpers.stem
    assert chain_names(error) == [c.replace("HELPERS", helpers_name) for c in chain]
    first = error.chain[0]
    assert first.file == op.generated.resolve()
    assert first.line == op.line_of(op.generated, "K2.clip(")
    # the report says where, what, and how it is reached
    lines = report.format(relative_to=tmp_path).splitlines()
    rel = path.relative_to(tmp_path)
    i = next(n for n, s in enumerate(lines) if s.startswith(f"{rel}:{line}:{error.col}: error:"))
    assert lines[i].startswith(f"{rel}:{line}:{error.col}: error: {name}")
    hops = " -> ".join(h.format(tmp_path) for h in error.chain)
    assert lines[i + 1] == f"    chain: {hops} -> {rel}:{line}:{error.col} {name}"
    assert hops.startswith(f"gen/adv_ipu.py:{first.line}:17 K2.clip")


def test_the_clean_kernel_passes_and_only_what_is_reached_counts(user_op):
    op = user_op(
        """\
        import torch
        import HELPERS as H


        def clip(x):
            return H.clamp(x)


        def gpu_only(x):  # not reached from the IPU module: not checked
            return torch.ops.aten.hardtanh(x)
        """,
        """\
        import torch


        def clamp(x):
            return torch.clamp(x, -1.0, 1.0)


        def unused(x):
            return torch.erf(x)
        """,
    )
    report = lint_module(op.generated, "ipu")
    assert report.ok, report.format()
    kernels, helpers = op.kernels.resolve(), op.helpers.resolve()
    assert {kernels, helpers} <= set(report.files)
    assert report.partial[kernels] == ("clip", "clip_backward")
    assert report.partial[helpers] == ("clamp",)
    assert [(c.file, c.name) for c in report.calls if c.file == helpers] == [
        (helpers, "torch.clamp")
    ]


def test_a_missing_kernel_module_is_an_error(user_op, tmp_path):
    op = user_op("import torch\n\n\ndef clip(x):\n    return torch.clamp(x, -1.0, 1.0)\n")
    op.kernels.unlink()
    report = lint_module(op.generated, "ipu")
    assert not report.ok
    line = op.line_of(op.generated, f"import {op.name} as K2")
    [error] = report.errors
    assert (error.kind, error.name, error.file, error.line) == (
        "import",
        op.name,
        op.generated.resolve(),
        line,
    )
    assert f"cannot find module {op.name}" in error.reason
    assert "1 modules that cannot be found, read or parsed" in report.summary()
    result = CliRunner().invoke(app, ["lint", str(op.generated), "--platform", "ipu"])
    assert result.exit_code == 1
    assert f"adv_ipu.py:{line}:1: error: cannot find module {op.name}" in result.output


CLEAN = "import torch\n\n\ndef clip(x):\n    return torch.clamp(x, -1.0, 1.0)\n"


@pytest.mark.parametrize("damage", ["not utf-8", "too large", "compiled", "syntax"])
def test_an_unreadable_kernel_module_is_an_error(user_op, monkeypatch, damage):
    op = user_op(CLEAN)
    if damage == "not utf-8":
        op.kernels.write_bytes(b"def clip(x):\n    return '\xff'\n")
        expected = "it is not utf-8 text (byte 25: invalid start byte)"
    elif damage == "too large":  # the cap is per module: only the padded kernel is refused
        monkeypatch.setattr(lint_source, "MAX_SOURCE_BYTES", 2**20)
        with op.kernels.open("a", encoding="utf-8") as handle:
            handle.write("#" * 2**20 + "\n")
        expected = "it is larger than 1 MiB, the most lint reads of one module"
    elif damage == "compiled":
        op.kernels.unlink()
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        op.kernels.with_name(op.name + suffix).write_bytes(b"\x7fELF not really")
        expected = f"{op.name}{suffix}, not Python source"
    else:
        op.kernels.write_text("def clip(x):\n    return (\n", encoding="utf-8")
        expected = "syntax error"
    report = lint_module(op.generated, "ipu")
    assert not report.ok
    [error] = report.errors
    assert expected in error.reason, error.reason
    assert error.kind in ("read", "import", "syntax")
    if error.kind != "import":  # the file itself, reached from the generated module
        assert chain_names(error) == ["K2.clip"]


def test_dynamic_access_to_a_kernel_module_is_a_warning_and_checks_all_of_it(user_op):
    op = user_op(
        """\
        import HELPERS as H


        def clip(x, which="clamp"):
            fn = getattr(H, which)
            return fn(x)
        """,
        """\
        import torch


        def clamp(x):
            return torch.clamp(x, -1.0, 1.0)


        def other(x):
            return torch.ops.aten.hardtanh(x)  # BAD
        """,
    )
    report = lint_module(op.generated, "ipu")
    [warning] = [w for w in report.warnings if w.file == op.kernels.resolve()]
    assert warning.name == "getattr(H, which)"
    assert warning.file == op.kernels.resolve()
    assert "all of it was checked" in warning.reason
    error = the_error(report, op.helpers, op.line_of(op.helpers, "# BAD"))
    assert chain_names(error) == ["K2.clip", "H"]
    assert op.helpers.resolve() not in report.partial


def test_dynamic_calls_lint_cannot_resolve_are_reported(tmp_path):
    path = tmp_path / "dyn.py"
    path.write_text(
        textwrap.dedent("""\
            import importlib

            import torch
            import torch.nn.functional as F


            def k(x, name, mod):
                a = getattr(x, name)()
                b = importlib.import_module(mod)
                c = __import__(mod)
                acts = [torch.erf, F.gelu]
                d = x.erf
                e = getattr(x, "erf")()
                f = getattr(torch, name)(x)
                g = run(torch.nn.functional, x)
                T = torch.ops
                F2 = torch.nn.functional
                h = eval("torch.erf")(x)
                return a, b, c, acts, d, e, f, g, T, F2.gelu(x), h
            """),
        encoding="utf-8",
    )
    report = lint_module(path, "ipu")
    errors = [(c.line, c.name) for c in report.errors]
    warnings = [(c.line, c.name) for c in report.warnings]
    assert errors == [
        (11, "torch.erf"),
        (14, "getattr(torch, name)"),
        (16, "torch.ops"),
        (19, "torch.ops"),  # every use of a torch.ops object
    ]
    assert warnings == [
        (8, "getattr(x, name)"),
        (9, "importlib.import_module(mod)"),
        (10, "__import__(mod)"),
        (12, "Tensor.erf"),
        (13, "Tensor.erf"),
        (15, "torch.nn.functional"),  # a torch module passed on: calls through it unseen
        (18, "eval(...)"),
    ]
    ok = [(c.line, c.name) for c in report.calls if c.severity == "ok"]
    assert ok == [(11, "torch.nn.functional.gelu"), (19, "torch.nn.functional.gelu")]


def test_the_kernel_module_is_found_where_python_would_find_it(user_op, monkeypatch):
    op = user_op(VARIANTS["direct"][0])
    # not on sys.path: found through the UNROLLER_OPS folder (searched last)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(op.ops)])
    report = lint_module(op.generated, "ipu")
    assert [c.file for c in report.errors] == [op.kernels.resolve()]
    # beside the generated module (its folder comes first, as when it runs as a script)
    beside = op.generated.with_name(op.kernels.name)
    beside.write_text(op.kernels.read_text(encoding="utf-8"), encoding="utf-8")
    report = lint_module(op.generated, "ipu")
    assert [c.file for c in report.errors] == [beside.resolve()]
    # neither: an error, not a silent pass
    beside.unlink()
    monkeypatch.delenv("UNROLLER_OPS")
    report = lint_module(op.generated, "ipu")
    assert [(c.kind, c.name) for c in report.errors] == [("import", op.name)]


def test_installed_modules_are_followed_only_when_the_registry_names_them(user_op, monkeypatch):
    """A kernel module installed among the libraries (site-packages) is still followed: the
    registry names it; a helper installed there that it imports is a library, not followed."""
    op = user_op(
        "import HELPERS as H\n\n\ndef clip(x):\n    return H.clamp(x)\n",
        "import torch\n\n\ndef clamp(x):\n    return torch.ops.aten.hardtanh(x)\n",
    )
    assert not lint_module(op.generated, "ipu").ok  # both in a user folder: followed
    libraries = (*lint_resolve._library_dirs(), op.ops.resolve())
    monkeypatch.setattr(lint_resolve, "_library_dirs", lambda: libraries)
    report = lint_module(op.generated, "ipu")
    assert report.ok, report.format()
    assert op.kernels.resolve() in report.files
    assert op.helpers.resolve() not in report.files


def test_a_kernel_package_with_relative_imports(tmp_path, monkeypatch):
    """kernels.ipu = "pkg.ipu": ``from . import helpers as H`` and ``from .impl import f``
    resolve inside the user package; what they reach is checked."""
    pkg_name = f"adv_pkg_{os.getpid()}"
    ops = tmp_path / "ops"
    pkg = ops / pkg_name
    (pkg / "impl").mkdir(parents=True)
    (ops / "registry.toml").write_text(
        REGISTRY.replace("KERNELS", f"{pkg_name}.ipu"), encoding="utf-8"
    )
    (pkg / "__init__.py").write_text("")
    (pkg / "ipu.py").write_text(
        "from . import helpers as H\nfrom .impl import deep\n\n\n"
        "def clip(x):\n    return H.clamp(x) + deep(x)\n" + BACKWARD
    )
    (pkg / "helpers.py").write_text("import torch\n\n\ndef clamp(x):\n    return torch.erf(x)\n")
    (pkg / "impl" / "__init__.py").write_text("from ..helpers import clamp as deep\n")
    monkeypatch.setenv("UNROLLER_OPS", str(ops / "registry.toml"))
    monkeypatch.syspath_prepend(str(ops))
    try:
        text = generate_from_text(MODEL, Options(platform="ipu"), label="adv.txt")
    finally:
        for name in [m for m in sys.modules if m.startswith(pkg_name)]:
            del sys.modules[name]
    generated = write_atomic(tmp_path / "gen" / "adv_ipu.py", text)
    report = lint_module(generated, "ipu")
    [error] = report.errors
    assert (error.file, error.line, error.name) == ((pkg / "helpers.py").resolve(), 5, "torch.erf")
    assert chain_names(error) == ["K2.clip", "H.clamp"]
    assert report.partial[(pkg / "impl" / "__init__.py").resolve()] == ("deep",)


def test_a_kernel_module_shared_by_many_generated_modules_is_read_once(
    user_op, tmp_path, monkeypatch
):
    op = user_op(VARIANTS["helper"][0])
    copy = op.generated.with_name("adv_ipu_copy.py")
    copy.write_text(op.generated.read_text(encoding="utf-8"), encoding="utf-8")
    reads: list[Path] = []
    real = lint_linter._read_source

    def counting(path, limit=None):
        reads.append(path)
        return real(path, limit)

    monkeypatch.setattr(lint_linter, "_read_source", counting)
    report = lint_paths([tmp_path / "gen"], "ipu")
    assert len(reads) == len(set(reads))
    assert reads.count(op.kernels.resolve()) == 1
    assert len([e for e in report.errors if e.file == op.kernels.resolve()]) == 1


def test_unroll_generate_then_lint_from_the_cli(tmp_path, monkeypatch):
    ops = tmp_path / "ops"
    ops.mkdir()
    name = f"adv_cli_{os.getpid()}"
    (ops / "registry.toml").write_text(REGISTRY.replace("KERNELS", name), encoding="utf-8")
    (ops / f"{name}.py").write_text(
        textwrap.dedent(VARIANTS["helper"][0]) + BACKWARD, encoding="utf-8"
    )
    (tmp_path / "adv.txt").write_text(MODEL, encoding="utf-8")
    monkeypatch.setenv("UNROLLER_OPS", str(ops / "registry.toml"))
    monkeypatch.syspath_prepend(str(ops))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    try:
        result = runner.invoke(
            app, ["generate", "adv.txt", "--platform", "ipu", "-o", "gen/adv_ipu.py", "--mkdir"]
        )
        assert result.exit_code == 0, result.output
        result = runner.invoke(app, ["lint", "gen/adv_ipu.py", "--platform", "ipu"])
    finally:
        sys.modules.pop(name, None)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    i = lines.index(
        f"ops/{name}.py:5:27: error: torch.ops.aten.hardtanh() is not supported on the IPU "
        "(a direct ATen operator: only the listed torch operations are supported)"
    )
    k2 = next(
        n
        for n, text in enumerate((tmp_path / "gen/adv_ipu.py").read_text().splitlines(), 1)
        if "K2.clip(" in text
    )
    assert lines[i + 1] == (
        f"    chain: gen/adv_ipu.py:{k2}:17 K2.clip -> ops/{name}.py:9:12 _clamp -> "
        f"ops/{name}.py:5:27 torch.ops.aten.hardtanh"
    )


# ---------------------------------------------------------------- what lint reads


@pytest.fixture
def alarm():
    """Fail instead of hanging should lint ever block on a FIFO or read a device."""
    with time_limit(10, TimeoutError("lint blocked")):
        yield


def test_only_regular_files_are_read(tmp_path, alarm):
    fifo = tmp_path / "gen" / "pipe.py"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    (tmp_path / "gen" / "ok.py").write_text("import torch\ny = torch.cos(1)\n")
    for paths in ([fifo], [tmp_path / "gen"]):
        report = lint_paths(paths, "ipu")
        [error] = report.errors
        assert error.kind == "read" and error.file == fifo.resolve()
        assert "it is a named pipe (FIFO), not a regular file" in error.reason
    if os.path.exists("/dev/zero"):
        [error] = lint_paths(["/dev/zero"], "ipu").errors
        assert "a character device, not a regular file" in error.reason
    with pytest.raises(FileNotFoundError):
        lint_paths([tmp_path / "missing.py"], "ipu")


def test_an_entry_in_another_encoding_is_read_as_python_would(tmp_path):
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\nimport torch\ny = torch.erf('\xe9')\n")
    report = lint_module(path, "ipu")
    assert [(c.line, c.col, c.name) for c in report.errors] == [(3, 11, "torch.erf")]
    path.write_bytes(b"# coding: no-such-codec\n")
    [error] = lint_module(path, "ipu").errors
    assert "encoding declaration is not valid" in error.reason


def test_the_checked_in_ipu_modules_stay_clean():
    report = lint_paths([ROOT / "generated" / "ipu" / "quick"], "ipu")
    assert report.errors == [], report.format()


def test_a_kept_scan_is_reused_only_while_its_answers_hold(tmp_path, monkeypatch):
    """A second run over unchanged files scans nothing again; a file whose star import now
    binds another name is scanned again though its own text is the same."""
    main = tmp_path / "main_mod.py"
    main.write_text("from star_helper import *\n\n\ndef f(x):\n    return h(x)\n", "utf-8")
    helper = tmp_path / "star_helper.py"
    helper.write_text("import torch\n\n\ndef g(x):\n    return torch.relu(x)\n", "utf-8")
    scanned: list[Path] = []

    class Counting(lint_linter._ModuleScanner):
        def scan(self):
            scanned.append(self.path)
            return super().scan()

    monkeypatch.setattr(lint_linter, "_ModuleScanner", Counting)
    first = lint_module(main, "ipu")
    assert first.ok, first.format()
    assert main.resolve() in scanned
    scanned.clear()
    again = lint_module(main, "ipu")
    assert scanned == []
    assert (again.calls, again.files, again.partial) == (first.calls, first.files, first.partial)
    # h is now bound by the star import: main's scan (same text) must follow it
    helper.write_text(
        "import torch\n\n\ndef g(x):\n    return torch.relu(x)\n\n\n"
        "def h(x):\n    return torch.ops.aten.hardtanh(x)\n",
        "utf-8",
    )
    report = lint_module(main, "ipu")
    assert main.resolve() in scanned
    assert [(c.file, c.name) for c in report.errors] == [
        (helper.resolve(), "torch.ops.aten.hardtanh")
    ]
