"""`python -m benchmarks.compress_bench`: the compress preset (``unroll bench compress``).

Compressor throughput and what each scheme stores and costs; writes
``benchmarks/results/compress_bench.{json,md}``. The code is ``unroller.bench.compress``.
"""

from __future__ import annotations

import sys

from unroller.bench.compress import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m benchmarks.compress_bench"))
