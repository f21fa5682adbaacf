"""No class in the package is over 500 lines.

A class that size is several jobs sharing one namespace of attributes: each method can
read and change what any other set, so a change to one job (a new lowering pass, one more
importer operator) has to be checked against all of them. Split by job, each part can be
read and tested alone. The limit counts from the ``class`` line to its last line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "unroller"
MAX_LINES = 500


def _classes(path: Path) -> list[tuple[str, int]]:
    """``(file:line name, lines)`` for every class of ``path``, nested ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        (f"{path.name}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def test_no_class_over_500_lines():
    sizes = [found for path in sorted(PACKAGE.rglob("*.py")) for found in _classes(path)]
    assert len(sizes) > 50, "the scan found the package's classes"
    long = [f"{where} ({lines} lines)" for where, lines in sizes if lines > MAX_LINES]
    assert long == [], "split these classes by job:\n" + "\n".join(long)


def test_the_scan_measures_a_class_from_its_first_to_its_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    probe = tmp_path / "probe.py"
    probe.write_text(f"class Big:\n{body}\n\n\nclass Small:\n    class Inner:\n        pass\n")
    assert _classes(probe) == [
        ("probe.py:1 Big", MAX_LINES + 1),
        ("probe.py:504 Small", 3),
        ("probe.py:505 Inner", 2),
    ]
