"""``python -m unroller.bench ARGS``: the harness, as ``unroll bench ARGS``."""

from __future__ import annotations

import sys

from unroller.bench.cli import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], prog="python -m unroller.bench"))
