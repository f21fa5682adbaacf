"""The test suite itself: every test asserts something, and the tests build into a cache
folder of their own, never the user's."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, TESTS

# calls that fail a test by themselves (pytest.raises/warns/fail, torch.testing's asserts)
FAILING_CALLS = {"raises", "warns", "fail", "deprecated_call", "assert_close", "assert_allclose"}


def _called(fn: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def _asserts_itself(fn: ast.AST) -> bool:
    if any(isinstance(node, (ast.Assert, ast.Raise)) for node in ast.walk(fn)):
        return True
    return bool(_called(fn) & FAILING_CALLS)


def _functions(files: list[Path]) -> dict[str, list[tuple[Path, ast.AST]]]:
    found: dict[str, list[tuple[Path, ast.AST]]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append((path, node))
    return found


def silent_tests(files: list[Path]) -> list[str]:
    """``path:line name`` of each test function in ``files`` with no assert, no raise, no
    pytest.raises (or the like) and no call of a helper (any function of that name in
    ``files``) that asserts, directly or through helpers of its own."""
    functions = _functions(files)
    helpers = {n: defs for n, defs in functions.items() if not n.startswith("test")}
    asserting = {n for n, defs in helpers.items() if any(_asserts_itself(f) for _, f in defs)}
    grew = True
    while grew:
        grew = False
        for name, defs in helpers.items():
            if name not in asserting and any(_called(f) & asserting for _, f in defs):
                asserting.add(name)
                grew = True
    return [
        f"{path}:{fn.lineno} {name}"
        for name, defs in functions.items()
        if name.startswith("test")  # pytest's default python_functions
        for path, fn in defs
        if not _asserts_itself(fn) and not _called(fn) & asserting
    ]


def test_every_test_asserts_something():
    """A test whose body can only pass (no assert, no pytest.raises, no asserting helper)
    claims what it does not check."""
    assert silent_tests(sorted(TESTS.rglob("*.py"))) == []


def test_the_scan_finds_a_test_asserting_nothing(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def check(x):\n    assert x\n"
        "def run(x):\n    check(x)\n"
        "def quiet(x):\n    return x\n"
        "def test_direct():\n    assert 1\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_through_helpers():\n    run(1)\n"
        "def test_silent():\n    quiet(1)\n",
        encoding="utf-8",
    )
    found = silent_tests([tmp_path / "test_x.py"])
    assert [line.rsplit(" ", 1)[1] for line in found] == ["test_silent"]


def test_the_cache_is_not_the_users():
    """conftest points UNROLLER_CACHE_DIR (the native kernels' builds, one-shot sources) at
    a folder of the tests' own, and a subprocess a test starts sees the same."""
    from unroller import oneshot
    from unroller.compress import native

    folder = Path(os.environ["UNROLLER_CACHE_DIR"])
    users = [Path.home() / ".cache"]
    if os.environ.get("XDG_CACHE_HOME"):
        users.append(Path(os.environ["XDG_CACHE_HOME"]))
    for user in users:
        assert not folder.resolve().is_relative_to(user.resolve()), (folder, user)
    assert native.cache_dir() == folder / "native"
    assert oneshot.cache_dir() == folder / "generated"
    seen = subprocess.run(
        [sys.executable, "-c", "from unroller.compress import native; print(native.cache_dir())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    assert seen == str(folder / "native")
