"""Malformed ``sciml:PATH`` data: each case is one ``DatasetError`` line naming the file
and the dataset (exit 2 from ``unroll train``, no traceback, no run folder written)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.train_models import AUTOENCODER, DENOISER, SEGMENTER
from unroller import data
from unroller.api import graph_from_text
from unroller.cli import app
from unroller.data import DatasetError

h5py = pytest.importorskip("h5py")

runner = CliRunner()


def signature(text: str):
    return data.signature(graph_from_text(text))


def load(path: Path, text: str = DENOISER):
    return data.load(f"sciml:{path}", signature(text))


def write_h5(path: Path, **arrays) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as handle:
        for key, value in arrays.items():
            if callable(value):
                value(handle, key)
            else:
                handle[key] = value
    return path


def images(count: int = 6, size: int = 16) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.uniform(0.0, 1.0, (count, size, size, 1)).astype(np.float32)


def em(root: Path, noisy=None, clean=None) -> tuple[Path, Path]:
    """An EMDenoise folder; ``noisy`` / ``clean`` replace the good ``images``."""
    good = images()
    noisy_path = write_h5(
        root / "train" / "graphene_img_noise.h5", images=good if noisy is None else noisy
    )
    clean_path = write_h5(
        root / "train" / "graphene_img_clean.h5", images=good if clean is None else clean
    )
    return noisy_path, clean_path


def refused(path: Path, *fragments: str, text: str = DENOISER) -> str:
    with pytest.raises(DatasetError) as info:
        load(path, text)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def group(handle, key):
    handle.create_group(key)["images"] = images()


def vlen_strings(handle, key):
    handle.create_dataset(
        key, data=np.array(["a", "b", "c"], dtype=object), dtype=h5py.string_dtype()
    )


def empty_dataspace(handle, key):
    handle.create_dataset(key, data=h5py.Empty("f4"))


def compound(handle, key):
    handle[key] = np.zeros((4, 16, 16), dtype=[("re", "f4"), ("im", "f4")])


# -- EMDenoise: what is inside the HDF5 files ------------------------------------------

BAD_IMAGES = {
    "byte strings": (np.array([b"one", b"two"]), "holds strings, not numbers"),
    "strings": (vlen_strings, "holds strings, not numbers"),
    "group": (group, "'images' is a group, not a dataset"),
    "zero images": (np.zeros((0, 16, 16, 1), np.float32), "is empty (shape [0, 16, 16, 1])"),
    "zero width": (np.zeros((4, 16, 0), np.float32), "is empty (shape [4, 16, 0])"),
    "no dataspace": (empty_dataspace, "is empty (no dataspace)"),
    "compound": (compound, "holds compound records"),
    "complex": (np.ones((4, 16, 16), np.complex64), "holds complex numbers"),
    "scalar": (np.float32(3.0), "has shape []"),
    "rank 2": (np.ones((16, 16), np.float32), "has shape [16, 16]"),
    "rank 5": (np.ones((2, 1, 16, 16, 1), np.float32), "has shape [2, 1, 16, 16, 1]"),
    "nan only": (np.full((4, 16, 16), np.nan, np.float32), "holds no finite values"),
    "inf only": (np.full((4, 16, 16), np.inf, np.float32), "holds no finite values"),
    "some nan": (
        np.where(np.arange(4 * 16 * 16).reshape(4, 16, 16) == 7, np.nan, 1.0),
        "holds 1 NaN or infinite value(s) (of 1024)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
@pytest.mark.parametrize("which", ["noisy", "clean"])
def test_em_bad_images_dataset(tmp_path, case, which):
    value, fragment = BAD_IMAGES[case]
    noisy_path, clean_path = em(tmp_path, **{which: value})
    path = noisy_path if which == "noisy" else clean_path
    refused(tmp_path, str(path), "'images'", fragment)


# -- EMDenoise: the files themselves ---------------------------------------------------


def _valid_h5_bytes(tmp_path: Path) -> bytes:
    return write_h5(tmp_path / "valid.h5", images=images(64)).read_bytes()


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p, blob: p.write_bytes(b""), "not a readable HDF5 file"),
        (
            lambda p, blob: p.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100),
            "not a readable HDF5 file",
        ),
        (lambda p, blob: p.write_bytes(blob[: len(blob) // 2]), "HDF5"),
        (lambda p, blob: p.write_bytes(blob[:600]), "not a readable HDF5 file"),
        (lambda p, blob: p.write_text("images = [1, 2, 3]\n"), "not a readable HDF5 file"),
        (lambda p, blob: p.mkdir(), "is a directory"),
    ],
    ids=["empty", "signature only", "truncated half", "truncated header", "text", "directory"],
)
def test_em_unreadable_clean_file(tmp_path, make, fragment):
    em(tmp_path)
    clean = tmp_path / "train" / "graphene_img_clean.h5"
    clean.unlink()
    make(clean, _valid_h5_bytes(tmp_path))
    refused(tmp_path, str(clean), fragment)


def test_em_clean_file_missing(tmp_path):
    noisy, clean = em(tmp_path)
    clean.unlink()
    refused(tmp_path, str(clean), "no such file")


def test_em_images_key_missing_in_an_empty_file(tmp_path):
    _, clean = em(tmp_path)
    clean.unlink()
    write_h5(clean)
    refused(tmp_path, str(clean), "no dataset 'images' (found: nothing)")


def test_em_integer_and_big_endian_images_still_load(tmp_path):
    count = 6
    em(
        tmp_path,
        noisy=(images(count) * 1000).astype(">i4"),
        clean=(images(count) * 1000).astype(np.uint16),
    )
    d = load(tmp_path)
    assert len(d.train) + len(d.test) == count


# -- the folder ------------------------------------------------------------------------


def test_empty_folder(tmp_path):
    refused(tmp_path, str(tmp_path), "none of the known layouts")


def test_missing_folder(tmp_path):
    refused(tmp_path / "nowhere", str(tmp_path / "nowhere"), "no such directory")


def test_a_file_instead_of_a_folder(tmp_path):
    path = write_h5(tmp_path / "graphene_img_noise.h5", images=images())
    refused(path, str(path), "is a file")


# -- SLSTRCloud scenes -----------------------------------------------------------------


def scene(path: Path, **replace) -> Path:
    rng = np.random.default_rng(1)
    arrays = {
        "refs": rng.uniform(size=(32, 32, 6)).astype(np.float32),
        "bts": rng.uniform(250, 300, size=(32, 32, 3)).astype(np.float32),
        "bayes": rng.integers(0, 2, size=(32, 32, 1)).astype(np.int32),
    }
    arrays.update(replace)
    return write_h5(path, **arrays)


@pytest.mark.parametrize(
    ("replace", "fragment"),
    [
        ({"refs": np.array([b"x"] * 4)}, "dataset 'refs' holds strings"),
        ({"bts": group}, "'bts' is a group"),
        ({"bayes": np.zeros((0, 32, 1), np.int32)}, "dataset 'bayes' is empty"),
        (
            {"refs": np.full((32, 32, 6), np.nan, np.float32)},
            "dataset 'refs' holds no finite values",
        ),
        ({"bts": np.ones((2, 32, 32, 3), np.float32)}, "dataset 'bts' has shape [2, 32, 32, 3]"),
        ({"bayes": np.ones((32, 32, 2), np.int32)}, "dataset 'bayes' has shape [32, 32, 2]"),
        ({"bts": np.ones((30, 32, 3), np.float32)}, "differ in height and width"),
    ],
    ids=[
        "string refs",
        "group bts",
        "empty bayes",
        "nan refs",
        "rank bts",
        "bayes channels",
        "sizes",
    ],
)
def test_slstr_bad_scene(tmp_path, replace, fragment):
    scene(tmp_path / "S3A_good.hdf")
    bad = scene(tmp_path / "S3A_zbad.hdf", **replace)
    refused(tmp_path, str(bad), fragment, text=SEGMENTER)


def test_slstr_corrupt_scene_file(tmp_path):
    scene(tmp_path / "S3A_good.hdf")
    bad = tmp_path / "S3A_zbad.hdf"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 4)
    refused(tmp_path, str(bad), "not a readable HDF5 file", text=SEGMENTER)


# -- OpticalDamage ---------------------------------------------------------------------


def test_optical_damage_nan_only_and_truncated_tiff(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    folder = tmp_path / "training" / "undamaged"
    folder.mkdir(parents=True)
    Image.fromarray(np.full((20, 20), np.nan, np.float32)).save(folder / "a.tiff")
    refused(tmp_path, str(folder / "a.tiff"), "no finite values", text=AUTOENCODER)
    Image.fromarray(np.ones((20, 20), np.float32)).save(folder / "a.tiff")
    blob = (folder / "a.tiff").read_bytes()
    (folder / "a.tiff").write_bytes(blob[: len(blob) // 3])
    refused(tmp_path, str(folder / "a.tiff"), "not a readable TIFF image", text=AUTOENCODER)


# -- through the CLI -------------------------------------------------------------------


@pytest.mark.parametrize("case", ["strings", "group", "zero images", "nan only"])
def test_cli_exit_2_one_line_no_traceback(tmp_path, case):
    value, fragment = BAD_IMAGES[case]
    _, clean = em(tmp_path / "data", clean=value)
    model = tmp_path / "model.txt"
    model.write_text(DENOISER, encoding="utf-8")
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", str(model), "--dataset", f"sciml:{tmp_path / 'data'}", "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unroll: error: "), result.output
    assert str(clean) in lines[0] and "'images'" in lines[0] and fragment in lines[0]
    assert not out.exists()


def test_cli_missing_and_empty_folder(tmp_path):
    model = tmp_path / "model.txt"
    model.write_text(DENOISER, encoding="utf-8")
    (tmp_path / "empty").mkdir()
    for folder, fragment in (
        (tmp_path / "nowhere", "no such directory"),
        (tmp_path / "empty", "none of the known layouts"),
    ):
        result = runner.invoke(
            app,
            ["train", str(model), "--dataset", f"sciml:{folder}", "--out", str(tmp_path / "run")],
        )
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert str(folder) in result.output and fragment in result.output
