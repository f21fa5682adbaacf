"""``digits``: the real handwritten digits that ship inside scikit-learn.

1,797 8x8 grey images (values 0-16) of the digits 0-9, from the UCI optical
recognition data set; nothing is downloaded. They are scaled to [0, 1], upscaled
bilinearly to the model's H x W (32 x 32 for the CIFAR-style ResNets), repeated to the
model's channel count (3 for a ResNet), and standardised with the training split's
mean and standard deviation. The split is fixed: stratified, 20 % test (360 images),
scikit-learn's ``train_test_split`` with ``random_state=0``, independent of any seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unroller.data.core import DatasetError, Signature, Split, TaskData, check

TEST_FRACTION = 0.2
SPLIT_SEED = 0
NUM_CLASSES = 10


def _sklearn():
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise DatasetError(
            "the digits dataset is read from scikit-learn, which is not installed: "
            "pip install scikit-learn (or the project's [data] extra)"
        ) from None
    return load_digits, train_test_split


def split_indices() -> tuple[list[int], list[int]]:
    """The fixed stratified train/test split of the 1,797 images, as indices."""
    load_digits, train_test_split = _sklearn()
    labels = load_digits().target
    train, test = train_test_split(
        list(range(len(labels))),
        test_size=TEST_FRACTION,
        stratify=labels,
        random_state=SPLIT_SEED,
    )
    return sorted(train), sorted(test)


def build(sig: Signature, name: str = "digits", **_: object) -> TaskData:
    check(sig, name, "classification")
    if sig.pred_shape[-1] < NUM_CLASSES:
        raise DatasetError(
            f"dataset '{name}' has {NUM_CLASSES} classes, but {sig.describe()} predicts "
            f"{sig.pred_shape[-1]} scores"
        )
    load_digits, _ = _sklearn()
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float64) / 16.0  # [1797, 8, 8] in [0, 1]
    labels = torch.tensor(raw.target, dtype=torch.int64)
    channels, height, width = sig.input_shape
    images = F.interpolate(
        images[:, None], size=(height, width), mode="bilinear", align_corners=False
    )
    train_idx, test_idx = split_indices()
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = ((images - mean) / std).float().expand(-1, channels, -1, -1).contiguous()
    return TaskData(
        name=name,
        task="classification",
        synthetic=False,
        description=(
            f"scikit-learn digits (real, 1,797 images 8x8 -> {channels}x{height}x{width}), "
            f"stratified split {len(train_idx)} train / {len(test_idx)} test"
        ),
        train=Split(images[train_idx], labels[train_idx]),
        test=Split(images[test_idx], labels[test_idx]),
    )
