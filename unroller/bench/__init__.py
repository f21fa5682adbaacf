"""The benchmark harness: ``unroll bench``, ``make bench`` and ``python -m benchmarks.X``.

Installed with the package, so ``unroll bench`` works without importing the checkout's
``benchmarks/`` folder (which keeps only model files, results and thin entry scripts);
the model files are still read from the checkout (``paths``), or from ``--models-dir``.

Four presets, one command line (``cli``):

- the suite (default; ``make bench``): ours per scheme against autograd, checkpointing
  and hook-based compression, with the memory-budget search (``suite``, ``config``,
  ``models``, ``peers``, ``measure``, ``budget``, ``targets``, ``output``, ``plots``);
- ``core``: the generated step against autograd on the first models (``core``,
  ``core_report``; ``python -m benchmarks.core_bench``);
- ``compress``: compressor throughput and what each scheme stores and costs
  (``compress``, ``codec_bench``, ``scheme_bench``, ``compress_report``;
  ``python -m benchmarks.compress_bench``);
- ``scaling`` (also any command line with ``--pipeline`` or ``--data-parallel``): one
  process against a K-stage pipeline and K data-parallel processes over gloo, per
  scheme, with the bytes on the wire and the gradient error they add (``scaling``).

Shared by all: ``options`` (flags), ``paths``, ``machine``, ``stats``, ``timing``,
``profiling``, ``saved``, ``steps``, ``stashed``, and ``reference``, the one zoo of
``torch.nn`` references that the tests use too.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The full harness command line (``sys.argv[1:]`` by default): what ``make bench``
    and ``unroll bench ARGS...`` run. Returns the exit status (0, or 2 on bad arguments
    or a run that cannot start)."""
    from unroller.bench.cli import run

    return run(sys.argv[1:] if argv is None else argv, prog="unroll bench")
