"""Where the model files and results of a checkout are, found from the installed package.

The model files (``benchmarks/models/``, ``tests/models/``) and the results folder are
not in the wheel: they live in a checkout of the project. The harness looks for them
next to the package (an editable install or a plain checkout), then under the working
directory, and otherwise says how to point it at them (``--models-dir``), instead of
failing later with a bare missing-file error.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARK_MODELS = Path("benchmarks") / "models"
SUITE_MODELS = Path("tests") / "models"
RESULTS = Path("benchmarks") / "results"
OUTSIDE_RESULTS = Path("benchmark-results")  # the default results folder outside a checkout


class ModelsNotFound(FileNotFoundError):
    """The model files are not where a checkout keeps them (and no folder was given)."""


def checkout_root() -> Path | None:
    """The checkout this package runs from, or the working directory if it is one; None
    when neither holds ``benchmarks/models/``."""
    for candidate in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (candidate / BENCHMARK_MODELS).is_dir():
            return candidate
    return None


def benchmark_models_dir(override: Path | None = None) -> Path:
    """``override`` if given (it must be a folder), else the checkout's
    ``benchmarks/models/``; ModelsNotFound says what to do when there is none."""
    if override is not None:
        if not Path(override).is_dir():
            raise ModelsNotFound(f"--models-dir {override}: not a folder")
        return Path(override)
    root = checkout_root()
    if root is None:
        raise ModelsNotFound(
            f"the benchmark model files ({BENCHMARK_MODELS}/*.txt) are not here: they live "
            "in a checkout of the project, which this installed package is not part of; run "
            "from a checkout, or pass --models-dir DIR"
        )
    return root / BENCHMARK_MODELS


def suite_models_dir() -> Path:
    """The test suite's model files, ``tests/models/`` of the checkout."""
    root = checkout_root()
    if root is None or not (root / SUITE_MODELS).is_dir():
        raise ModelsNotFound(f"the test model files ({SUITE_MODELS}/*.txt) need a checkout")
    return root / SUITE_MODELS


def default_results_dir() -> Path:
    """``benchmarks/results/`` of the checkout, or ``./benchmark-results`` outside one."""
    root = checkout_root()
    return OUTSIDE_RESULTS if root is None else root / RESULTS
