"""`make bench`, `python -m benchmarks.run`: the benchmark harness from a checkout.

The harness is ``unroller.bench`` (installed with the package, so ``unroll bench`` runs
the same thing); this script only names the command. ``python -m benchmarks.run --help``
lists the flags; ``python -m benchmarks.run core|compress ...`` picks the other presets.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from unroller.bench.cli import run


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.run") -> int:
    """The harness under this script's name (kept for callers of the old entry point;
    new code calls ``unroller.bench.main``)."""
    return run(sys.argv[1:] if argv is None else argv, prog)


if __name__ == "__main__":
    sys.exit(main())
