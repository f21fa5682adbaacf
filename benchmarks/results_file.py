"""The command line of a script that writes one results file from other results.

Such a script (``benchmarks.accuracy_goals``, ``benchmarks.stash_per_token``) measures
nothing: it turns result files into the table a guide includes. Run plainly it rewrites its
file; with ``--check`` it changes nothing and exits 1 when the file is not what it would
write, naming the command that refreshes it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_or_check(
    description: str, out: Path, command: str, report: Callable[[], str], argv: Sequence[str] | None
) -> int:
    """``report()`` written to ``out``, or with ``--check`` compared with it; the exit status."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {out.name} is stale")
    args = parser.parse_args(argv)
    text = report()
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{shown}: stale, run: {command}")
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {shown}")
    return 0
