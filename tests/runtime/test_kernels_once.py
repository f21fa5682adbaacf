"""The two platforms' kernel modules write nothing twice.

What both platforms compute the same way lives once (``runtime.common``, ``runtime.derived``,
the op-family modules), and the calling convention of a kernel whose formulation differs is
written once too (``runtime.conventions``). A run of six or more lines that ``gpu.py`` and
``ipu.py`` share is a piece of one of those that was copied instead, and two definitions of a
name with the same body are a shared kernel kept twice: either is a fix made in one platform
and missed in the other waiting to happen. Lines are compared stripped, with blank lines,
comments and import statements left out (the imports are how each module assembles its
namespace, and name the same shared kernels).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "unroller" / "runtime"
PLATFORMS = (RUNTIME / "gpu.py", RUNTIME / "ipu.py")
RUN = 6


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of each line that is not blank, a comment or an import."""
    text = path.read_text(encoding="utf-8")
    imports = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.update(range(node.lineno, node.end_lineno + 1))
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if number not in imports and line.strip() and not line.strip().startswith("#")
    ]


def shared_runs(a: list[tuple[int, str]], b: list[tuple[int, str]], size: int = RUN) -> list:
    """Each maximal run of at least ``size`` consecutive lines of ``a`` that ``b`` also holds
    consecutively: (first line in a, last line in a, first line in b, length)."""
    where: dict[tuple[str, ...], list[int]] = {}
    for j in range(len(b) - size + 1):
        where.setdefault(tuple(t for _, t in b[j : j + size]), []).append(j)
    runs = []
    for i in range(len(a) - size + 1):
        for j in where.get(tuple(t for _, t in a[i : i + size]), []):
            if i and j and a[i - 1][1] == b[j - 1][1]:
                continue  # inside a longer run, reported from its start
            n = size
            while i + n < len(a) and j + n < len(b) and a[i + n][1] == b[j + n][1]:
                n += 1
            runs.append((a[i][0], a[i + n - 1][0], b[j][0], n))
    return runs


def _definitions(path: Path) -> dict[str, str]:
    """Each top-level function, class and assignment of ``path``: name -> its body's AST,
    docstring left out (two platforms may explain one body differently)."""
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            found[node.name] = ast.dump(ast.Module(body=body, type_ignores=[]))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = ast.dump(node.value)
    return found


def test_the_platform_modules_share_no_run_of_six_lines():
    gpu, ipu = (_code_lines(p) for p in PLATFORMS)
    runs = shared_runs(gpu, ipu)
    assert not runs, "gpu.py and ipu.py repeat these runs (gpu lines ~ ipu lines):\n" + "\n".join(
        f"  gpu.py:{a}-{b} ~ ipu.py:{c} ({n} lines)" for a, b, c, n in runs
    )


def test_no_name_is_defined_in_both_with_the_same_body():
    gpu, ipu = (_definitions(p) for p in PLATFORMS)
    same = sorted(
        name
        for name in gpu.keys() & ipu.keys()
        if gpu[name] == ipu[name] and not name.startswith("__")  # __all__: each one's exports
    )
    assert not same, f"defined in both gpu.py and ipu.py with the same body: {same}"


def test_the_line_run_comparison_finds_a_copied_run():
    """The check above can fail: a six-line run is found, a five-line one is not, and a run
    is reported once from its start."""
    lines = [(n, f"x{n} = {n}") for n in range(1, 9)]
    assert shared_runs(lines, [(0, "y = 0"), *lines]) == [(1, 8, 1, 8)]
    assert shared_runs(lines[:5], lines[:5]) == []


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_every_kernel_keeps_the_convention_defaults(platform):
    """A kernel written under ``conventions.implements`` takes the stub's parameters, defaults
    included (what generated code leaves out is the registry default)."""
    from unroller.runtime import conventions, gpu, ipu

    module = {"gpu": gpu, "ipu": ipu}[platform]
    for name, stub in vars(conventions).items():
        if not inspect.isfunction(stub) or stub.__module__ != conventions.__name__:
            continue
        if name == "implements":
            continue
        want = inspect.signature(stub).parameters
        have = inspect.signature(getattr(module, name)).parameters
        assert list(have)[: len(want)] == list(want), name
        for p in want.values():
            assert have[p.name].default == p.default and have[p.name].kind == p.kind, (name, p)


def test_derived_kernels_are_made_from_each_platforms_own():
    from unroller.runtime import gpu, ipu

    for name in ("maxpool1d", "avgpool1d_backward", "scaled_dot_product_attention_eval"):
        assert getattr(gpu, name) is not getattr(ipu, name)
        assert name in gpu.__all__ and name in ipu.__all__
