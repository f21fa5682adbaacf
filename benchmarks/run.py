"""`make bench`: the benchmark harness entry point.

Today it runs the core benchmark (generated step vs torch.autograd on the same torch.nn
model: step time, peak step memory, bytes saved for backward) on the ResNet-like and
U-Net-like models. `--full` runs more repetitions. Results go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import core_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="more repetitions (slower)")
    args, rest = parser.parse_known_args(argv)
    defaults = ["--batch-size", "32", "--repeats", "31" if args.full else "11", "--warmup", "3"]
    return core_bench.main([*defaults, *rest])


if __name__ == "__main__":
    sys.exit(main())
