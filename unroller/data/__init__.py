"""Datasets for ``unroll train`` and ``unroll accuracy``; none is downloaded.

``load(spec, signature, seed, train_size, test_size)`` builds one for a model:

- ``digits``: real handwritten digits shipped inside scikit-learn (classification);
- ``denoise``, ``clouds``, ``optics``: task-like synthetic sets (named synthetic);
- ``pysource``: this Python's own standard library sources, for a character-level
  language model (real text, split by file);
- ``sciml:PATH``: the real SciML-Bench data the user has on disk.
"""

from __future__ import annotations

from unroller.data import digits, pysource, sciml, synthetic
from unroller.data.core import DatasetError, Signature, Split, TaskData, signature

NAMES = ("digits", "denoise", "clouds", "optics", "pysource", "sciml:PATH")

__all__ = ["NAMES", "DatasetError", "Signature", "Split", "TaskData", "load", "signature"]


def load(
    spec: str,
    sig: Signature,
    seed: int = 0,
    train_size: int | None = None,
    test_size: int | None = None,
) -> TaskData:
    """The dataset ``spec`` at the model's input shape, optionally cut to the first
    ``train_size`` / ``test_size`` samples of each split (for quick runs)."""
    for size in (train_size, test_size):
        if size is not None and size < 1:
            raise DatasetError(f"dataset sizes must be positive, got {size}")
    if spec == "digits":
        data = digits.build(sig)
    elif spec in synthetic.GENERATORS:
        data = synthetic.build(sig, spec, seed, train_size, test_size)
    elif spec == pysource.NAME:  # cut to the sizes as it is built: evenly spaced windows
        data = pysource.build(sig, spec, train_size, test_size)
    elif spec.startswith("sciml:") and len(spec) > len("sciml:"):
        data = sciml.build(sig, spec, spec[len("sciml:") :])
    else:
        raise DatasetError(f"unknown dataset '{spec}' (known: {', '.join(NAMES)})")
    if not data.synthetic and spec != pysource.NAME and (train_size or test_size):
        data.train, data.test = data.train.head(train_size), data.test.head(test_size)
        data.description += f"; the first {len(data.train)} train / {len(data.test)} test used"
    for split_name, split in (("training", data.train), ("test", data.test)):
        if len(split) == 0:
            raise DatasetError(
                f"dataset '{spec}' has an empty {split_name} split ({data.description})"
            )
    return data
