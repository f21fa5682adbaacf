"""`python -m benchmarks.core_bench`: the core preset of the harness (``unroll bench core``).

The generated unrolled step against torch.autograd on resnet_like and unet_like;
writes ``benchmarks/results/core_bench.json``. The code is ``unroller.bench.core``.
"""

from __future__ import annotations

import sys

from unroller.bench.core import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m benchmarks.core_bench"))
