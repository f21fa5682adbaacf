"""``sciml:PATH``: the real SciML-Bench 1.2.0 data, when the user has it on disk.

Nothing is downloaded: PATH is a directory the user points at, and its contents say
which benchmark it holds (the layouts SciML-Bench's own loaders read):

- EMDenoise (``em_graphene_sim``): ``graphene_img_noise.h5`` and
  ``graphene_img_clean.h5``, each with a dataset ``images`` of shape (N, H, W, 1)
  (channels last; (N, H, W) and (N, 1, H, W) are accepted too). Found in PATH or in
  ``PATH/train`` (then ``PATH/test`` is the test split if it has the pair, otherwise the
  last 20 % of the training images are). Both are scaled to [0, 1] with the clean
  training images' minimum and maximum (SciML-Bench 1.2.0 applies none; PSNR needs a
  known range).
- SLSTRCloud (``cloud_slstr_ds1``): HDF5 files ``S3A*.hdf`` (or ``*.h5``) anywhere
  under PATH, each with ``refs`` (H, W, 6), ``bts`` (H, W, 3) and ``bayes`` (H, W, 1).
  As SciML-Bench does: ``refs`` and ``bts`` are each standardised over the whole
  array (over its finite values), stacked to 9 channels, and the mask is
  ``bayes != 0``; NaNs then become 0 (the mean). Each
  scene is centre-cropped to a whole number of model-sized tiles and cut into them.
  Scenes are split 80/20 in sorted-name order (a single scene: its tiles are).
- OpticalDamage (``optical_damage_ds1``): TIFF images in ``training/undamaged`` and
  ``validation/undamaged`` (the test split). As SciML-Bench does: each image is scaled
  to [0, 1] by its minimum and maximum (NaNs to 0) and the 200 x 200 window at rows
  150-350, columns 270-470 is cut out (the whole image, if smaller), then resized to
  the model's size. These are TIFF files in the real data set, read with Pillow.

Images of another size than the model's are resized with area averaging (masks are
re-thresholded at 0.5).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from unroller.data.core import DatasetError, Signature, Split, TaskData, check

EM_FILES = ("graphene_img_noise.h5", "graphene_img_clean.h5")
# Sentinel-3A/B scene files first (SciML-Bench reads S3A*.hdf); any HDF5 file otherwise.
SLSTR_PATTERNS = (("S3A*.hdf", "S3B*.hdf"), ("*.hdf", "*.h5"))
OPTICS_CROP = (150, 350, 270, 470)
HOLDOUT = 0.2


def _h5py():
    try:
        import h5py
    except ImportError:
        raise DatasetError(
            "sciml: datasets are read from HDF5 with h5py, which is not installed: "
            "pip install h5py (or the project's [data] extra)"
        ) from None
    return h5py


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    line = lines[0].strip() if lines else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _dtype_name(dtype: np.dtype) -> str:
    h5py = _h5py()
    if h5py.check_string_dtype(dtype) is not None or dtype.kind in "SU":
        return "strings"
    if dtype.kind == "V":
        return "compound records" if dtype.names else "opaque bytes"
    if dtype.kind == "c":
        return "complex numbers"
    if dtype.kind == "O":
        return "object references or variable-length data"
    return f"values of type {dtype}"


# h5py reports damaged files and objects with these (DatasetError is none of them)
H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


def _read(path: Path, key: str, finite: str | None = None) -> Tensor:
    """The HDF5 dataset ``key`` of ``path`` as float64: a non-empty array of real
    numbers; ``finite`` is "all" (no NaN or infinity allowed) or "any" (at least one
    finite value)."""
    h5py = _h5py()
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory, not an HDF5 file")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    try:
        handle = h5py.File(path, "r")
    except H5_ERRORS as exc:
        raise DatasetError(f"{path}: not a readable HDF5 file ({_one_line(exc)})") from None
    try:
        with handle:
            if key not in handle:
                found = ", ".join(handle) or "nothing"
                raise DatasetError(f"{path}: no dataset '{key}' (found: {found})")
            item = handle[key]
            if not isinstance(item, h5py.Dataset):
                kind = "a group" if isinstance(item, h5py.Group) else f"a {type(item).__name__}"
                raise DatasetError(f"{path}: '{key}' is {kind}, not a dataset of numbers")
            if item.dtype.kind not in "biuf":
                raise DatasetError(
                    f"{path}: dataset '{key}' holds {_dtype_name(item.dtype)}, not numbers"
                )
            if item.shape is None or item.size == 0:
                shape = "no dataspace" if item.shape is None else f"shape {list(item.shape)}"
                raise DatasetError(f"{path}: dataset '{key}' is empty ({shape})")
            # np.asarray also converts big-endian or integer data to native float64
            values = torch.from_numpy(np.asarray(item[()], dtype=np.float64))
    except H5_ERRORS as exc:
        raise DatasetError(f"{path}: cannot read dataset '{key}' ({_one_line(exc)})") from None
    if finite is not None:
        good = int(torch.isfinite(values).sum())
        if good == 0:
            raise DatasetError(
                f"{path}: dataset '{key}' holds no finite values (all {values.numel()} are "
                "NaN or infinite)"
            )
        if finite == "all" and good < values.numel():
            raise DatasetError(
                f"{path}: dataset '{key}' holds {values.numel() - good} NaN or infinite "
                f"value(s) (of {values.numel()}); these images must be finite"
            )
    return values


def _channels_first(images: Tensor, path: Path) -> Tensor:
    """(N, H, W), (N, H, W, 1) or (N, 1, H, W) -> (N, 1, H, W)."""
    if images.dim() == 3:
        return images[:, None]
    if images.dim() == 4 and images.shape[-1] == 1:
        return images.permute(0, 3, 1, 2)
    if images.dim() == 4 and images.shape[1] == 1:
        return images
    raise DatasetError(
        f"{path}: dataset 'images' has shape {list(images.shape)}; expected single-channel "
        "images (N, H, W), (N, H, W, 1) or (N, 1, H, W)"
    )


def _resize(images: Tensor, height: int, width: int) -> Tensor:
    if tuple(images.shape[-2:]) == (height, width):
        return images
    return F.interpolate(images, size=(height, width), mode="area")


def _holdout(count: int) -> int:
    return max(1, round(count * HOLDOUT)) if count > 1 else 0


# -- EMDenoise -------------------------------------------------------------------------


def _em_pair(directory: Path) -> tuple[Tensor, Tensor]:
    noisy_path, clean_path = directory / EM_FILES[0], directory / EM_FILES[1]
    noisy = _channels_first(_read(noisy_path, "images", finite="all"), noisy_path)
    clean = _channels_first(_read(clean_path, "images", finite="all"), clean_path)
    if noisy.shape != clean.shape:
        raise DatasetError(
            f"{directory}: noisy images {list(noisy.shape)} and clean images "
            f"{list(clean.shape)} differ in shape"
        )
    return noisy, clean


def _em_denoise(root: Path, sig: Signature, name: str) -> TaskData:
    check(sig, name, "denoising", channels=1)
    train_dir = root / "train" if (root / "train" / EM_FILES[0]).exists() else root
    noisy, clean = _em_pair(train_dir)
    if (root / "test" / EM_FILES[0]).exists():
        test_noisy, test_clean = _em_pair(root / "test")
    else:
        cut = len(noisy) - _holdout(len(noisy))
        noisy, test_noisy = noisy[:cut], noisy[cut:]
        clean, test_clean = clean[:cut], clean[cut:]
    low, high = clean.min(), clean.max()
    span = (high - low).clamp_min(1e-12)
    _, height, width = sig.input_shape

    def prepare(images: Tensor) -> Tensor:
        return _resize((images - low) / span, height, width).float()

    return TaskData(
        name=name,
        task="denoising",
        synthetic=False,
        description=f"SciML-Bench EMDenoise data from {root}, {len(noisy)} train / {len(test_noisy)} test",
        train=Split(prepare(noisy), prepare(clean)),
        test=Split(prepare(test_noisy), prepare(test_clean)),
    )


# -- SLSTRCloud ------------------------------------------------------------------------


def _slstr_files(root: Path) -> list[Path]:
    for patterns in SLSTR_PATTERNS:
        found = sorted({p for pattern in patterns for p in root.rglob(pattern) if p.is_file()})
        if found:
            return found
    return []


def _standardise(values: Tensor) -> Tensor:
    """Zero mean, unit std over the finite values; NaNs become 0 (the mean) afterwards."""
    finite = values[torch.isfinite(values)]
    if finite.numel() == 0:
        return torch.zeros_like(values)
    mean, std = finite.mean(), finite.std().nan_to_num(0.0).clamp_min(1e-12)
    return torch.nan_to_num((values - mean) / std, nan=0.0, posinf=0.0, neginf=0.0)


def _tiles(images: Tensor, height: int, width: int) -> Tensor:
    """(C, H, W) -> (T, C, height, width): centre crop to whole tiles, then cut."""
    channels, full_h, full_w = images.shape
    rows, cols = full_h // height, full_w // width
    if rows == 0 or cols == 0:
        return F.interpolate(images[None], size=(height, width), mode="area")
    top, left = (full_h - rows * height) // 2, (full_w - cols * width) // 2
    crop = images[:, top : top + rows * height, left : left + cols * width]
    tiles = crop.reshape(channels, rows, height, cols, width).permute(1, 3, 0, 2, 4)
    return tiles.reshape(rows * cols, channels, height, width)


def _scene(path: Path, height: int, width: int) -> tuple[Tensor, Tensor]:
    refs, bts, bayes = (_read(path, key, finite="any") for key in ("refs", "bts", "bayes"))
    if refs.dim() == 2:
        refs = refs[..., None]
    if bts.dim() == 2:
        bts = bts[..., None]
    if bayes.dim() == 3 and bayes.shape[-1] == 1:
        bayes = bayes[..., 0]
    for key, values, layout in (
        ("refs", refs, "(H, W, C)"),
        ("bts", bts, "(H, W, C)"),
        ("bayes", bayes, "(H, W) or (H, W, 1)"),
    ):
        if values.dim() != (2 if key == "bayes" else 3):
            raise DatasetError(
                f"{path}: dataset '{key}' has shape {list(values.shape)}; expected {layout}"
            )
    if not refs.shape[:2] == bts.shape[:2] == bayes.shape:
        raise DatasetError(
            f"{path}: datasets 'refs' {list(refs.shape)}, 'bts' {list(bts.shape)} and "
            f"'bayes' {list(bayes.shape)} differ in height and width"
        )
    image = torch.cat([_standardise(refs), _standardise(bts)], dim=-1).permute(2, 0, 1)
    mask = (torch.nan_to_num(bayes, nan=0.0) != 0).to(torch.float64)[None]
    return _tiles(image, height, width), (_tiles(mask, height, width) > 0.5).to(torch.float64)


def _slstr_cloud(root: Path, files: list[Path], sig: Signature, name: str) -> TaskData:
    channels, height, width = sig.input_shape
    check(sig, name, "segmentation", channels=None)
    scenes = [_scene(path, height, width) for path in files]
    if scenes[0][0].shape[1] != channels:
        raise DatasetError(
            f"{files[0]}: the scenes give {scenes[0][0].shape[1]}-channel images, but "
            f"{sig.describe()} takes {channels}"
        )
    if len(scenes) > 1:
        cut = len(scenes) - _holdout(len(scenes))
        train, test = scenes[:cut], scenes[cut:]
        x, y = torch.cat([s[0] for s in train]), torch.cat([s[1] for s in train])
        tx, ty = torch.cat([s[0] for s in test]), torch.cat([s[1] for s in test])
    else:
        x, y = scenes[0]
        cut = len(x) - _holdout(len(x))
        x, tx, y, ty = x[:cut], x[cut:], y[:cut], y[cut:]
    return TaskData(
        name=name,
        task="segmentation",
        synthetic=False,
        description=(
            f"SciML-Bench SLSTRCloud data from {root}: {len(files)} scene(s), "
            f"{len(x)} train / {len(tx)} test tiles of {height}x{width}"
        ),
        train=Split(x.float(), y.float()),
        test=Split(tx.float(), ty.float()),
    )


# -- OpticalDamage ---------------------------------------------------------------------


def _tiff_images(directory: Path, height: int, width: int) -> Tensor:
    try:
        from PIL import Image
    except ImportError:
        raise DatasetError(
            "reading the OpticalDamage TIFF images needs Pillow: pip install pillow"
        ) from None
    files = sorted(p for p in directory.iterdir() if p.suffix.lower() in (".tif", ".tiff"))
    if not files:
        raise DatasetError(f"{directory}: no TIFF images")
    images = []
    for path in files:
        try:
            with Image.open(path) as handle:
                array = torch.from_numpy(np.asarray(handle.convert("F"), dtype=np.float64).copy())
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise DatasetError(f"{path}: not a readable TIFF image ({_one_line(exc)})") from None
        if array.numel() == 0 or not torch.isfinite(array).any():
            raise DatasetError(f"{path}: the image holds no finite values")
        array = torch.nan_to_num(array, nan=0.0)
        array = (array - array.min()) / (array.max() - array.min()).clamp_min(1e-12)
        top, bottom, left, right = OPTICS_CROP
        if array.shape[0] >= bottom and array.shape[1] >= right:
            array = array[top:bottom, left:right]
        images.append(_resize(array[None, None], height, width)[0])
    return torch.stack(images)


def _optical_damage(root: Path, sig: Signature, name: str) -> TaskData:
    check(sig, name, "autoencoding", channels=1)
    _, height, width = sig.input_shape
    train = _tiff_images(root / "training" / "undamaged", height, width)
    test_dir = root / "validation" / "undamaged"
    if test_dir.is_dir():
        test = _tiff_images(test_dir, height, width)
    else:
        cut = len(train) - _holdout(len(train))
        train, test = train[:cut], train[cut:]
    return TaskData(
        name=name,
        task="autoencoding",
        synthetic=False,
        description=f"SciML-Bench OpticalDamage data from {root}, {len(train)} train / {len(test)} test",
        train=Split(train.float(), None),
        test=Split(test.float(), None),
    )


def build(sig: Signature, name: str, path: str, **_: object) -> TaskData:
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise DatasetError(f"sciml: {root} is a file; PATH must be a SciML-Bench data folder")
    if not root.is_dir():
        raise DatasetError(f"sciml: no such directory: {root}")
    if (root / EM_FILES[0]).exists() or (root / "train" / EM_FILES[0]).exists():
        return _em_denoise(root, sig, name)
    if (root / "training" / "undamaged").is_dir():
        return _optical_damage(root, sig, name)
    files = _slstr_files(root)
    if files:
        return _slstr_cloud(root, files, sig, name)
    raise DatasetError(
        f"sciml: {root} holds none of the known layouts: EMDenoise ({' + '.join(EM_FILES)}, "
        "in it or in train/), SLSTRCloud (S3A*.hdf scenes with refs, bts, bayes) or "
        "OpticalDamage (training/undamaged/*.TIFF)"
    )
