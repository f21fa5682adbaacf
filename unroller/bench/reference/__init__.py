"""The one zoo of plain ``torch.nn`` references, shared by the tests and the harness.

Every model file of the project (``benchmarks/models/*.txt`` and ``tests/models/*.txt``)
has a reference here whose attribute tree mirrors the file's value names, so its
``state_dict()`` keys are exactly the generated module's, in the same order, and
``load_state_dict(strict=True)`` works both ways. One module per job:

- ``base``: ``Reference``, the forward / checkpointed forward / predict contract;
- ``blocks``: the ResNet and U-Net families both folders use;
- ``published``: the benchmark networks; ``batches``: their synthetic batches;
- ``registry``: ``BENCHMARKS``, one ``Benchmark`` per file of ``benchmarks/models/``;
- ``suite_models``: ``SUITE_REFERENCES``, ``make_inputs``, ``DECLS`` for ``tests/models/``.
"""

from __future__ import annotations

from unroller.bench.reference.base import Reference, StageRunner
from unroller.bench.reference.registry import BENCHMARKS, Benchmark
from unroller.bench.reference.suite_models import (
    DECLS,
    SUITE_REFERENCES,
    Decl,
    declared_in_file,
    make_inputs,
    num_inputs,
    suite_model_path,
)

__all__ = [
    "BENCHMARKS",
    "DECLS",
    "SUITE_REFERENCES",
    "Benchmark",
    "Decl",
    "Reference",
    "StageRunner",
    "declared_in_file",
    "make_inputs",
    "num_inputs",
    "suite_model_path",
]
