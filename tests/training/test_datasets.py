"""The dataset package ``unroller.data``: signatures, digits, the synthetic sets and the
``sciml:PATH`` loaders (on small SciML-Bench-layout files written here)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unroller import data
from unroller.api import graph_from_text
from unroller.data import DatasetError

h5py = pytest.importorskip("h5py")
Image = pytest.importorskip("PIL.Image")


# -- model texts -----------------------------------------------------------------------


def classifier(channels=3, height=32, width=32, classes=10, name="c"):
    return f"""
model {name} {{
    input x: f32[N, {channels}, {height}, {width}]
    target y: i64[N]
    c1 = conv2d(x, out_channels=4, kernel_size=3, padding=1)
    r = relu(c1)
    pool = adaptive_avgpool2d(r, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features={classes})
    loss = cross_entropy(fc, y)
    return loss, fc
}}
"""


def denoiser(channels=1, height=16, width=16, loss="mse_loss", name="dn"):
    return f"""
model {name} {{
    input x: f32[N, {channels}, {height}, {width}]
    target y: f32[N, 1, {height}, {width}]
    c = conv2d(x, out_channels=1, kernel_size=3, padding=1)
    loss = {loss}(c, y)
    return loss, c
}}
"""


def segmenter(channels=9, height=16, width=16, logits=False, name="seg"):
    if logits:
        head = "loss = bce_with_logits(c, y)\n    return loss, c"
    else:
        head = "p = sigmoid(c)\n    loss = bce_loss(p, y)\n    return loss, p"
    return f"""
model {name} {{
    input x: f32[N, {channels}, {height}, {width}]
    target y: f32[N, 1, {height}, {width}]
    c = conv2d(x, out_channels=1, kernel_size=3, padding=1)
    {head}
}}
"""


def autoencoder(channels=1, height=16, width=16, name="ae"):
    return f"""
model {name} {{
    input x: f32[N, {channels}, {height}, {width}]
    c = conv2d(x, out_channels={channels}, kernel_size=3, padding=1)
    p = sigmoid(c)
    loss = mse_loss(p, x)
    return loss, p
}}
"""


FLAT_CLASSIFIER = """
model flatc {
    input x: f32[N, 64]
    target y: i64[N]
    fc = linear(x, out_features=10)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""

TWO_INPUTS = """
model two_in {
    input a: f32[N, 1, 8, 8]
    input b: f32[N, 1, 8, 8]
    target y: f32[N, 1, 8, 8]
    s = add(a, b)
    loss = mse_loss(s, y)
    return loss, s
}
"""

TWO_PREDICTIONS = """
model two_out {
    input x: f32[N, 1, 8, 8]
    target y: f32[N, 1, 8, 8]
    s = relu(x)
    t = sigmoid(x)
    loss = mse_loss(s, y)
    return loss, s, t
}
"""

TWO_TARGETS = """
model two_tgt {
    input x: f32[N, 1, 8, 8]
    target y: f32[N, 1, 8, 8]
    target z: f32[N, 1, 8, 8]
    s = relu(x)
    loss = mse_loss(s, y)
    return loss, s
}
"""


@cache
def sig(text: str) -> data.Signature:
    return data.signature(graph_from_text(text))


# -- signature() -----------------------------------------------------------------------


def test_signature_of_a_classifier():
    s = sig(classifier())
    assert s.model == "c"
    assert s.input_name == "x"
    assert s.input_shape == (3, 32, 32)
    assert s.target_name == "y"
    assert s.target_shape == ()
    assert s.target_dtype == "i64"
    assert s.pred_shape == (10,)
    assert s.loss_op == "cross_entropy"
    assert s.task == "classification"
    assert s.logits is False
    assert "'c'" in s.describe() and "[3, 32, 32]" in s.describe()


@pytest.mark.parametrize(
    "text, loss_op, task, logits",
    [
        (classifier(), "cross_entropy", "classification", False),
        (denoiser(), "mse_loss", "denoising", False),
        (denoiser(loss="l1_loss"), "l1_loss", "denoising", False),
        (segmenter(), "bce_loss", "segmentation", False),
        (segmenter(logits=True), "bce_with_logits", "segmentation", True),
        (autoencoder(), "mse_loss", "autoencoding", False),
    ],
    ids=["classifier", "denoiser", "denoiser-l1", "segmenter", "segmenter-logits", "autoenc"],
)
def test_signature_task_follows_the_loss_op(text, loss_op, task, logits):
    s = sig(text)
    assert s.loss_op == loss_op
    assert s.task == task
    assert s.logits is logits


def test_signature_shapes_of_segmenter_and_autoencoder():
    seg = sig(segmenter(channels=9, height=16, width=24))
    assert seg.input_shape == (9, 16, 24)
    assert seg.target_shape == (1, 16, 24)
    assert seg.target_dtype == "f32"
    assert seg.pred_shape == (1, 16, 24)
    ae = sig(autoencoder(channels=2))
    assert ae.target_name is None and ae.target_shape is None and ae.target_dtype is None
    assert ae.pred_shape == (2, 16, 16)


@pytest.mark.parametrize(
    "text, fragment",
    [
        (TWO_INPUTS, "2 input(s)"),
        (TWO_PREDICTIONS, "2 prediction(s)"),
        (TWO_TARGETS, "2 target(s)"),
    ],
    ids=["two-inputs", "two-predictions", "two-targets"],
)
def test_signature_rejects_models_with_several_inputs_or_outputs(text, fragment):
    graph = graph_from_text(text)
    with pytest.raises(DatasetError) as info:
        data.signature(graph)
    message = str(info.value)
    assert fragment in message
    assert f"'{graph.name}'" in message
    assert "one input" in message


# -- digits ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_rgb():
    return data.load("digits", sig(classifier(3, 32, 32)))


@pytest.fixture(scope="module")
def digits_grey():
    return data.load("digits", sig(classifier(1, 16, 16)))


@pytest.fixture(scope="module")
def sklearn_digits():
    from sklearn.datasets import load_digits

    return load_digits()


def test_digits_sizes_and_metadata(digits_rgb):
    assert len(digits_rgb.train) + len(digits_rgb.test) == 1797
    assert len(digits_rgb.test) == 360
    assert len(digits_rgb.train) == 1437
    assert digits_rgb.name == "digits"
    assert digits_rgb.task == "classification"
    assert digits_rgb.synthetic is False
    assert digits_rgb.title == "digits"
    assert "synthetic" not in digits_rgb.title
    assert "scikit-learn" in digits_rgb.description
    assert "1437 train / 360 test" in digits_rgb.description


def test_digits_split_is_fixed_stratified_and_disjoint(sklearn_digits):
    train, test = data.digits.split_indices()
    again_train, again_test = data.digits.split_indices()
    assert train == again_train and test == again_test
    assert len(test) == 360
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(1797))
    labels = np.asarray(sklearn_digits.target)
    for digit in range(10):
        in_class = int((labels == digit).sum())
        in_test = int((labels[test] == digit).sum())
        assert abs(in_test - 0.2 * in_class) <= 1, (digit, in_test, in_class)


def test_digits_split_is_the_documented_one(sklearn_digits):
    """scikit-learn's train_test_split, 20 % test, stratified, random_state=0."""
    from sklearn.model_selection import train_test_split

    _, test = train_test_split(
        list(range(1797)), test_size=0.2, stratify=sklearn_digits.target, random_state=0
    )
    assert data.digits.split_indices()[1] == sorted(test)


def test_digits_two_loads_give_the_same_split(digits_grey):
    again = data.load("digits", sig(classifier(1, 16, 16)))
    assert torch.equal(again.test.targets, digits_grey.test.targets)
    assert torch.equal(again.test.inputs, digits_grey.test.inputs)
    assert torch.equal(again.train.targets, digits_grey.train.targets)


@pytest.mark.parametrize(
    "fixture, shape", [("digits_rgb", (3, 32, 32)), ("digits_grey", (1, 16, 16))]
)
def test_digits_input_shape_follows_the_model(request, fixture, shape):
    d = request.getfixturevalue(fixture)
    for split in (d.train, d.test):
        assert split.inputs.dtype == torch.float32
        assert tuple(split.inputs.shape[1:]) == shape
        assert torch.isfinite(split.inputs).all()


def test_digits_channels_are_identical_copies(digits_rgb, digits_grey):
    x = digits_rgb.train.inputs
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    assert x[:, 0].std() > 0.5  # not a constant image


def test_digits_train_split_is_standardised(digits_rgb, digits_grey):
    for d in (digits_rgb, digits_grey):
        x = d.train.inputs.double()
        assert abs(float(x.mean())) < 1e-4
        assert abs(float(x.std()) - 1.0) < 1e-3
        # the test split uses the training statistics, so it is only roughly standardised
        t = d.test.inputs.double()
        assert abs(float(t.mean())) < 0.1
        assert abs(float(t.std()) - 1.0) < 0.1


def test_digits_labels(digits_rgb):
    for split in (digits_rgb.train, digits_rgb.test):
        assert split.targets.dtype == torch.int64
        assert split.targets.shape == (len(split),)
        assert int(split.targets.min()) == 0 and int(split.targets.max()) == 9
        assert torch.unique(split.targets).tolist() == list(range(10))
        assert split.reference() is split.targets


def test_digits_images_match_their_labels(digits_grey, sklearn_digits):
    """Each 16x16 image, pooled back to 8x8, is the scikit-learn image at its index."""
    train_idx, test_idx = data.digits.split_indices()
    raw = torch.tensor(sklearn_digits.images, dtype=torch.float64).reshape(1797, 64)
    labels = torch.tensor(sklearn_digits.target)
    for split, idx in ((digits_grey.train, train_idx), (digits_grey.test, test_idx)):
        assert torch.equal(split.targets, labels[idx])
        pooled = F.avg_pool2d(split.inputs.double(), 2).reshape(len(split), 64)
        a = pooled - pooled.mean(dim=1, keepdim=True)
        b = raw[idx] - raw[idx].mean(dim=1, keepdim=True)
        corr = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
        assert float(corr.min()) > 0.9
        # and it is not just any digit: a shifted pairing correlates much worse
        shifted = (a * b.roll(1, dims=0)).sum(1) / (a.norm(dim=1) * b.roll(1, 0).norm(dim=1))
        assert float(shifted.mean()) < 0.7


def test_digits_cut_to_train_and_test_size(digits_grey):
    cut = data.load("digits", sig(classifier(1, 16, 16)), train_size=100, test_size=50)
    assert len(cut.train) == 100 and len(cut.test) == 50
    assert torch.equal(cut.train.inputs, digits_grey.train.inputs[:100])
    assert torch.equal(cut.test.targets, digits_grey.test.targets[:50])
    assert "the first 100 train / 50 test used" in cut.description
    assert "scikit-learn" in cut.description
    only_train = data.load("digits", sig(classifier(1, 16, 16)), train_size=7)
    assert len(only_train.train) == 7 and len(only_train.test) == 360


@pytest.mark.parametrize(
    "text, fragments",
    [
        (denoiser(), ["'digits'", "'dn'", "classification", "denoising"]),
        (segmenter(channels=1), ["'digits'", "'seg'", "segmentation"]),
        (autoencoder(), ["'digits'", "'ae'"]),
        (classifier(1, 16, 16, classes=5, name="five"), ["'digits'", "10 classes", "'five'", "5"]),
        (FLAT_CLASSIFIER, ["'digits'", "'flatc'", "images"]),
    ],
    ids=["denoiser", "segmenter", "autoencoder", "five-classes", "flat-input"],
)
def test_digits_rejects_models_it_does_not_fit(text, fragments):
    with pytest.raises(DatasetError) as info:
        data.load("digits", sig(text))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_digits_accepts_more_than_ten_classes():
    d = data.load("digits", sig(classifier(1, 8, 8, classes=12)), train_size=4, test_size=4)
    assert d.train.inputs.shape == (4, 1, 8, 8)


# -- synthetic sets --------------------------------------------------------------------

SYNTHETIC_MODELS = {
    "denoise": denoiser(1, 16, 16),
    "clouds": segmenter(9, 16, 16),
    "optics": autoencoder(1, 16, 16),
}
SYNTHETIC_TASKS = {"denoise": "denoising", "clouds": "segmentation", "optics": "autoencoding"}


def synth(name, seed=0, train_size=12, test_size=6, text=None):
    return data.load(name, sig(text or SYNTHETIC_MODELS[name]), seed, train_size, test_size)


@pytest.mark.parametrize("name", ["denoise", "clouds", "optics"])
def test_synthetic_sets_are_named_synthetic(name):
    d = synth(name, seed=5)
    assert d.name == name
    assert d.synthetic is True
    assert "synthetic" in d.title
    assert d.description.startswith("synthetic")
    assert "seed 5" in d.description
    assert "12 train / 6 test" in d.description
    assert d.task == SYNTHETIC_TASKS[name]
    assert len(d.train) == 12 and len(d.test) == 6


def _splits_equal(a, b):
    for x, y in ((a.train, b.train), (a.test, b.test)):
        if not torch.equal(x.inputs, y.inputs):
            return False
        if (x.targets is None) != (y.targets is None):
            return False
        if x.targets is not None and not torch.equal(x.targets, y.targets):
            return False
    return True


@pytest.mark.parametrize("name", ["denoise", "clouds", "optics"])
def test_synthetic_sets_are_deterministic(name):
    first, again = synth(name, seed=3), synth(name, seed=3)
    assert _splits_equal(first, again)
    other = synth(name, seed=4)
    assert not torch.equal(first.train.inputs, other.train.inputs)
    assert not torch.equal(first.test.inputs, other.test.inputs)
    # train and test are different samples, not one sample twice
    assert not torch.equal(first.train.inputs[:6], first.test.inputs)


@pytest.mark.parametrize("name", ["denoise", "clouds", "optics"])
def test_synthetic_sets_leave_the_global_rng_alone(name):
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    synth(name)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("name", ["denoise", "clouds", "optics"])
def test_synthetic_split_sizes_are_independent(name):
    small, large = synth(name, train_size=4, test_size=6), synth(name, train_size=15, test_size=6)
    assert len(small.train) == 4 and len(large.train) == 15
    assert torch.equal(small.test.inputs, large.test.inputs)
    if small.test.targets is not None:
        assert torch.equal(small.test.targets, large.test.targets)
    short, longer = synth(name, train_size=5, test_size=3), synth(name, train_size=5, test_size=9)
    assert torch.equal(short.train.inputs, longer.train.inputs)


@pytest.mark.parametrize(
    "name, text, input_shape, target_shape",
    [
        ("denoise", denoiser(1, 16, 16), (1, 16, 16), (1, 16, 16)),
        ("denoise", denoiser(1, 8, 12), (1, 8, 12), (1, 8, 12)),
        ("clouds", segmenter(9, 16, 16), (9, 16, 16), (1, 16, 16)),
        ("clouds", segmenter(4, 12, 8, logits=True), (4, 12, 8), (1, 12, 8)),
        ("optics", autoencoder(1, 16, 16), (1, 16, 16), None),
        ("optics", autoencoder(3, 8, 16), (3, 8, 16), None),
    ],
)
def test_synthetic_shapes_and_dtypes_follow_the_model(name, text, input_shape, target_shape):
    d = synth(name, text=text, train_size=5, test_size=3)
    for split, count in ((d.train, 5), (d.test, 3)):
        assert split.inputs.dtype == torch.float32
        assert tuple(split.inputs.shape) == (count, *input_shape)
        if target_shape is None:
            assert split.targets is None
        else:
            assert split.targets.dtype == torch.float32
            assert tuple(split.targets.shape) == (count, *target_shape)


def test_synthetic_default_sizes():
    d = data.load("denoise", sig(denoiser(1, 8, 8)))
    assert (len(d.train), len(d.test)) == data.synthetic.DEFAULT_SIZES["denoise"]


def test_denoise_input_is_a_noisy_version_of_the_target():
    d = synth("denoise", train_size=32, test_size=8)
    for split in (d.train, d.test):
        clean, noisy = split.targets.double(), split.inputs.double()
        assert float(clean.min()) >= 0.0 and float(clean.max()) <= 1.0
        assert float(clean.std()) > 0.1  # the clean images have structure
        assert float(noisy.min()) >= 0.0
        assert float((noisy - clean).abs().mean()) > 0.05
        corr = torch.corrcoef(torch.stack([noisy.flatten(), clean.flatten()]))[0, 1]
        assert float(corr) > 0.6
        # shot noise is unbiased and counts photons: multiples of 1 / PHOTONS
        assert abs(float((noisy - clean).mean())) < 0.02
        counts = noisy * data.synthetic.PHOTONS
        assert float((counts - counts.round()).abs().max()) < 1e-4
    assert split.reference() is split.targets


def test_clouds_masks_are_binary_and_balanced():
    d = synth("clouds", train_size=24, test_size=12)
    for split in (d.train, d.test):
        values = torch.unique(split.targets)
        assert values.tolist() == [0.0, 1.0]
        share = float(split.targets.mean())
        assert 0.2 < share < 0.8
        assert torch.isfinite(split.inputs).all()


def _pixels(split):
    channels = split.inputs.shape[1]
    x = split.inputs.double().permute(0, 2, 3, 1).reshape(-1, channels)
    return torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)


def test_clouds_hidden_rule_is_shared_by_train_and_test():
    d = synth("clouds", seed=2, train_size=24, test_size=12)
    x, y = _pixels(d.train), d.train.targets.double().reshape(-1)
    weights = torch.linalg.lstsq(x, (2 * y - 1)[:, None]).solution
    test_y = d.test.targets.double().reshape(-1)
    predicted = ((_pixels(d.test) @ weights)[:, 0] > 0).double()
    accuracy = float((predicted == test_y).double().mean())
    chance = max(float(test_y.mean()), 1 - float(test_y.mean()))
    assert accuracy > 0.85
    assert accuracy > chance + 0.2


def test_clouds_with_logits_model():
    text = segmenter(9, 16, 16, logits=True)
    assert sig(text).logits is True
    d = synth("clouds", text=text, train_size=4, test_size=2)
    assert torch.unique(d.train.targets).tolist() == [0.0, 1.0]


def test_optics_images_have_small_bright_defects():
    d = synth("optics", text=autoencoder(1, 32, 32), train_size=48, test_size=8)
    for split in (d.train, d.test):
        assert split.targets is None
        assert split.reference() is split.inputs
        assert float(split.inputs.min()) >= 0.0 and float(split.inputs.max()) <= 1.0
    x = d.train.inputs.double()
    local = F.avg_pool2d(x, 7, stride=1, padding=3, count_include_pad=False)
    bump = (x - local).amax(dim=(1, 2, 3))
    with_defects = bump > 0.2
    # 0-6 defects per image: most images have one, some have none
    assert 0.5 < float(with_defects.double().mean()) < 1.0
    background = x.median()
    peaks = x.amax(dim=(1, 2, 3))
    assert float(peaks[with_defects].min()) > float(background) + 0.3
    # the defects are small: few pixels stand out from their neighbourhood
    bright_share = ((x - local) > 0.1).double().mean(dim=(1, 2, 3))
    assert float(bright_share.max()) < 0.1


@pytest.mark.parametrize(
    "name, text, fragments",
    [
        ("clouds", classifier(), ["'clouds'", "'c'", "segmentation", "classification"]),
        ("denoise", segmenter(1, 16, 16), ["'denoise'", "'seg'", "denoising"]),
        ("optics", denoiser(), ["'optics'", "'dn'"]),
        ("optics", classifier(1, 16, 16, name="k"), ["'optics'", "'k'"]),
        ("denoise", autoencoder(), ["'denoise'", "'ae'"]),
        ("clouds", FLAT_CLASSIFIER, ["'clouds'", "'flatc'"]),
    ],
    ids=[
        "clouds-on-classifier",
        "denoise-on-segmenter",
        "optics-on-denoiser",
        "optics-on-cls",
        "denoise-on-autoencoder",
        "clouds-on-flat",
    ],
)
def test_synthetic_set_on_a_mismatched_model(name, text, fragments):
    with pytest.raises(DatasetError) as info:
        data.load(name, sig(text), 0, 4, 2)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_denoise_targets_match_the_declared_target_of_a_multichannel_model():
    """A C-channel denoiser is served, not refused: each input channel is an independent
    noisy exposure of the one clean image, which is the declared one-channel target."""
    s = sig(denoiser(channels=3))
    d = data.load("denoise", s, 0, 4, 2)
    for split in (d.train, d.test):
        assert tuple(split.inputs.shape[1:]) == s.input_shape == (3, 16, 16)
        assert tuple(split.targets.shape[1:]) == s.target_shape == (1, 16, 16)
    x, clean = d.train.inputs.double(), d.train.targets.double()
    assert not torch.equal(x[:, 0], x[:, 1]) and not torch.equal(x[:, 1], x[:, 2])
    # the three exposures' mean is nearer the clean image than any one exposure
    one = (x[:, :1] - clean).norm()
    assert (x.mean(1, keepdim=True) - clean).norm() < 0.75 * one


# -- load() ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["mnist", "sciml:", "Digits", ""])
def test_load_unknown_dataset_lists_known_names(spec):
    with pytest.raises(DatasetError) as info:
        data.load(spec, sig(classifier()))
    message = str(info.value)
    assert f"'{spec}'" in message
    for name in data.NAMES:
        assert name in message


@pytest.mark.parametrize(
    "sizes", [{"train_size": 0}, {"test_size": 0}, {"train_size": -3}, {"test_size": -1}]
)
@pytest.mark.parametrize("spec", ["digits", "denoise"])
def test_load_rejects_non_positive_sizes(spec, sizes):
    text = classifier(1, 8, 8) if spec == "digits" else denoiser()
    with pytest.raises(DatasetError, match="positive"):
        data.load(spec, sig(text), **sizes)


# -- sciml: helpers --------------------------------------------------------------------


def write_h5(path: Path, **arrays):
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as handle:
        for key, value in arrays.items():
            handle[key] = value


def write_em(directory: Path, noisy: np.ndarray, clean: np.ndarray):
    write_h5(directory / "graphene_img_noise.h5", images=noisy)
    write_h5(directory / "graphene_img_clean.h5", images=clean)


def em_images(count, height=16, width=16, seed=0, low=2.0, high=7.0):
    """(noisy, clean) float32 arrays (N, H, W, 1), not symmetric under a transpose."""
    rng = np.random.default_rng(seed)
    ramp = np.arange(height)[:, None] * 0.3 + np.arange(width)[None, :] * 0.05
    clean = rng.uniform(low, high, (count, height, width)) + ramp
    noisy = clean + rng.normal(0, 0.5, clean.shape)
    return noisy[..., None].astype(np.float32), clean[..., None].astype(np.float32)


def scaled_first(images: np.ndarray, low: float, high: float) -> torch.Tensor:
    """(N, H, W, 1) -> (N, 1, H, W), min-max scaled with the given range."""
    array = (images.astype(np.float64) - low) / (high - low)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(0, 3, 1, 2)))


def sciml(path: Path, text: str, **kwargs):
    return data.load(f"sciml:{path}", sig(text), **kwargs)


# -- sciml: EMDenoise ------------------------------------------------------------------


def test_em_with_a_test_folder(tmp_path):
    noisy, clean = em_images(10, seed=1)
    test_noisy, test_clean = em_images(4, seed=2, low=0.0, high=12.0)
    write_em(tmp_path / "train", noisy, clean)
    write_em(tmp_path / "test", test_noisy, test_clean)
    d = sciml(tmp_path, denoiser())
    low, high = float(clean.min()), float(clean.max())
    assert d.task == "denoising" and d.synthetic is False
    assert d.name == f"sciml:{tmp_path}"
    assert "EMDenoise" in d.description and "10 train / 4 test" in d.description
    assert d.train.inputs.dtype == torch.float32 and d.train.targets.dtype == torch.float32
    assert d.train.inputs.shape == (10, 1, 16, 16)
    assert d.test.inputs.shape == (4, 1, 16, 16)
    torch.testing.assert_close(d.train.targets.double(), scaled_first(clean, low, high))
    torch.testing.assert_close(d.train.inputs.double(), scaled_first(noisy, low, high))
    # the test split is scaled with the *training* range, so it may leave [0, 1]
    torch.testing.assert_close(d.test.targets.double(), scaled_first(test_clean, low, high))
    torch.testing.assert_close(d.test.inputs.double(), scaled_first(test_noisy, low, high))
    assert float(d.train.targets.min()) == pytest.approx(0.0, abs=1e-6)
    assert float(d.train.targets.max()) == pytest.approx(1.0, abs=1e-6)
    assert float(d.test.targets.max()) > 1.0


def test_em_channels_first_is_not_a_transpose(tmp_path):
    noisy, clean = em_images(3, height=16, width=16, seed=3)
    write_em(tmp_path / "train", noisy, clean)
    d = sciml(tmp_path, denoiser())
    image = d.train.targets[0, 0].double()
    # the ramp grows 0.3 per row and 0.05 per column
    assert float((image[-1, :] - image[0, :]).mean()) > 3 * float(
        (image[:, -1] - image[:, 0]).mean()
    )
    low, high = float(clean.min()), float(clean.max())
    expected = (clean[0, :, :, 0].astype(np.float64) - low) / (high - low)
    torch.testing.assert_close(image, torch.from_numpy(expected), atol=1e-6, rtol=1e-6)


def test_em_without_a_test_folder_holds_out_the_last_fifth(tmp_path):
    noisy, clean = em_images(10, seed=4)
    clean[9, 0, 0, 0] = 100.0  # outside the training images, so it must not set the range
    write_em(tmp_path / "train", noisy, clean)
    d = sciml(tmp_path, denoiser())
    assert len(d.train) == 8 and len(d.test) == 2
    low, high = float(clean[:8].min()), float(clean[:8].max())
    torch.testing.assert_close(d.train.targets.double(), scaled_first(clean[:8], low, high))
    torch.testing.assert_close(d.test.targets.double(), scaled_first(clean[8:], low, high))
    torch.testing.assert_close(d.test.inputs.double(), scaled_first(noisy[8:], low, high))
    assert float(d.test.targets.max()) > 5.0
    assert "8 train / 2 test" in d.description


def test_em_files_directly_in_the_folder(tmp_path):
    noisy, clean = em_images(5, seed=5)
    write_em(tmp_path, noisy, clean)
    d = sciml(tmp_path, denoiser())
    assert len(d.train) == 4 and len(d.test) == 1
    low, high = float(clean[:4].min()), float(clean[:4].max())
    torch.testing.assert_close(d.train.inputs.double(), scaled_first(noisy[:4], low, high))


@pytest.mark.parametrize("layout", ["NHW", "N1HW"])
def test_em_other_single_channel_layouts(tmp_path, layout):
    noisy, clean = em_images(5, seed=6)
    if layout == "NHW":
        stored_noisy, stored_clean = noisy[..., 0], clean[..., 0]
    else:
        stored_noisy, stored_clean = noisy.transpose(0, 3, 1, 2), clean.transpose(0, 3, 1, 2)
    write_em(tmp_path / "train", stored_noisy, stored_clean)
    d = sciml(tmp_path, denoiser())
    low, high = float(clean[:4].min()), float(clean[:4].max())
    torch.testing.assert_close(d.train.targets.double(), scaled_first(clean[:4], low, high))


def test_em_resized_by_area_averaging(tmp_path):
    noisy, clean = em_images(5, height=16, width=16, seed=7)
    write_em(tmp_path / "train", noisy, clean)
    write_em(tmp_path / "test", *em_images(2, seed=8))
    d = sciml(tmp_path, denoiser(1, 8, 8))
    low, high = float(clean.min()), float(clean.max())
    full = scaled_first(clean, low, high)  # (5, 1, 16, 16)
    expected = full.reshape(5, 1, 8, 2, 8, 2).mean(dim=(3, 5))
    assert d.train.targets.shape == (5, 1, 8, 8)
    assert d.test.inputs.shape == (2, 1, 8, 8)
    torch.testing.assert_close(d.train.targets.double(), expected, atol=1e-6, rtol=1e-6)


def test_em_cut_by_load_sizes(tmp_path):
    noisy, clean = em_images(10, seed=9)
    write_em(tmp_path / "train", noisy, clean)
    full = sciml(tmp_path, denoiser())
    cut = sciml(tmp_path, denoiser(), train_size=3, test_size=1)
    assert len(cut.train) == 3 and len(cut.test) == 1
    assert torch.equal(cut.train.inputs, full.train.inputs[:3])
    assert "the first 3 train / 1 test used" in cut.description


def test_em_missing_images_key(tmp_path):
    noisy, clean = em_images(4)
    write_h5(tmp_path / "train" / "graphene_img_noise.h5", images=noisy)
    write_h5(tmp_path / "train" / "graphene_img_clean.h5", pictures=clean)
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser())
    message = str(info.value)
    assert "graphene_img_clean.h5" in message and str(tmp_path) in message
    assert "'images'" in message and "pictures" in message


def test_em_mismatched_noisy_and_clean_shapes(tmp_path):
    noisy, _ = em_images(4, seed=1)
    _, clean = em_images(5, seed=1)
    write_em(tmp_path / "train", noisy, clean)
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser())
    message = str(info.value)
    assert str(tmp_path / "train") in message
    assert "[4, 1, 16, 16]" in message and "[5, 1, 16, 16]" in message


def test_em_multichannel_images_rejected(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(4, 16, 16, 3)).astype(np.float32)
    write_em(tmp_path / "train", images, images)
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser())
    assert "graphene_img_noise.h5" in str(info.value)
    assert "single-channel" in str(info.value)


def test_em_unreadable_file(tmp_path):
    noisy, _ = em_images(4)
    write_h5(tmp_path / "train" / "graphene_img_noise.h5", images=noisy)
    (tmp_path / "train" / "graphene_img_clean.h5").write_bytes(b"this is not HDF5")
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser())
    assert str(tmp_path / "train" / "graphene_img_clean.h5") in str(info.value)


def test_em_test_folder_missing_the_clean_file(tmp_path):
    write_em(tmp_path / "train", *em_images(4))
    write_h5(tmp_path / "test" / "graphene_img_noise.h5", images=em_images(2)[0])
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser())
    assert str(tmp_path / "test" / "graphene_img_clean.h5") in str(info.value)


@pytest.mark.parametrize(
    "text, fragment",
    [
        (classifier(1, 16, 16), "classification"),
        (denoiser(channels=3), "3"),
        (segmenter(1, 16, 16), "segmentation"),
    ],
    ids=["classifier", "three-channels", "segmenter"],
)
def test_em_on_a_mismatched_model(tmp_path, text, fragment):
    write_em(tmp_path / "train", *em_images(4))
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, text)
    message = str(info.value)
    assert f"'sciml:{tmp_path}'" in message
    assert fragment in message


# -- sciml: SLSTRCloud -----------------------------------------------------------------


def slstr_scene(path: Path, height=40, width=36, seed=0, bayes_dtype=np.int32):
    rng = np.random.default_rng(seed)
    refs = rng.uniform(0.0, 1.0, (height, width, 6)) + np.arange(6) * 0.2
    bts = rng.uniform(250.0, 300.0, (height, width, 3))
    bayes = rng.choice([0, 0, 1, 2, 4], size=(height, width, 1)).astype(bayes_dtype)
    write_h5(path, refs=refs.astype(np.float32), bts=bts.astype(np.float32), bayes=bayes)
    return refs.astype(np.float32), bts.astype(np.float32), bayes


def standardised(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.float64)
    return (values - values.mean()) / values.std()


def expected_tiles(refs, bts, bayes, size=16):
    """Independently: standardise, stack, centre-crop to whole tiles, cut row-major."""
    image = np.concatenate([standardised(refs), standardised(bts)], axis=-1)
    mask = (bayes[..., 0] != 0).astype(np.float64)
    height, width = mask.shape
    rows, cols = height // size, width // size
    top, left = (height - rows * size) // 2, (width - cols * size) // 2
    tiles, masks = [], []
    for r in range(rows):
        for c in range(cols):
            ys = slice(top + r * size, top + (r + 1) * size)
            xs = slice(left + c * size, left + (c + 1) * size)
            tiles.append(image[ys, xs].transpose(2, 0, 1))
            masks.append(mask[None, ys, xs])
    return torch.from_numpy(np.stack(tiles)), torch.from_numpy(np.stack(masks))


def test_slstr_tiles_standardisation_and_masks(tmp_path):
    first = slstr_scene(tmp_path / "S3A_SL_1_a.hdf", seed=1)
    second = slstr_scene(tmp_path / "S3A_SL_1_b.hdf", seed=2)
    d = sciml(tmp_path, segmenter(9, 16, 16))
    assert d.task == "segmentation" and d.synthetic is False
    assert "SLSTRCloud" in d.description and "2 scene(s)" in d.description
    # 40x36 -> centre crop 32x32 -> 2x2 tiles per scene; one scene each way
    assert d.train.inputs.shape == (4, 9, 16, 16)
    assert d.test.inputs.shape == (4, 9, 16, 16)
    assert d.train.inputs.dtype == torch.float32 and d.train.targets.dtype == torch.float32
    tiles, masks = expected_tiles(*first)
    torch.testing.assert_close(d.train.inputs.double(), tiles, atol=2e-3, rtol=2e-3)
    assert torch.equal(d.train.targets.double(), masks)
    tiles, masks = expected_tiles(*second)
    torch.testing.assert_close(d.test.inputs.double(), tiles, atol=2e-3, rtol=2e-3)
    assert torch.equal(d.test.targets.double(), masks)
    assert torch.unique(d.train.targets).tolist() == [0.0, 1.0]


def test_slstr_scenes_split_in_sorted_name_order(tmp_path):
    # written out of order, nested in a subfolder: found anywhere under PATH
    scenes = {}
    for name, seed in (("S3A_c.hdf", 3), ("S3A_a.hdf", 1), ("S3A_b.hdf", 2)):
        scenes[name] = slstr_scene(tmp_path / "one-day" / name, seed=seed)
    d = sciml(tmp_path, segmenter(9, 16, 16, logits=True))
    assert "3 scene(s)" in d.description
    assert len(d.train) == 8 and len(d.test) == 4
    tiles, _ = expected_tiles(*scenes["S3A_c.hdf"])
    torch.testing.assert_close(d.test.inputs.double(), tiles, atol=2e-3, rtol=2e-3)
    tiles_a, _ = expected_tiles(*scenes["S3A_a.hdf"])
    tiles_b, _ = expected_tiles(*scenes["S3A_b.hdf"])
    torch.testing.assert_close(
        d.train.inputs.double(), torch.cat([tiles_a, tiles_b]), atol=2e-3, rtol=2e-3
    )


def test_slstr_single_scene_splits_its_tiles(tmp_path):
    scene = slstr_scene(tmp_path / "S3A_only.hdf", height=48, width=64, seed=4)
    d = sciml(tmp_path, segmenter(9, 16, 16))
    tiles, masks = expected_tiles(*scene)
    assert len(tiles) == 12
    assert len(d.train) == 10 and len(d.test) == 2
    torch.testing.assert_close(d.test.inputs.double(), tiles[10:], atol=2e-3, rtol=2e-3)
    assert torch.equal(d.train.targets.double(), masks[:10])


def test_slstr_nans_are_handled(tmp_path):
    refs, bts, bayes = slstr_scene(tmp_path / "S3A_nan.hdf", seed=5, bayes_dtype=np.float32)
    refs[10, 10, 2] = np.nan
    bts[20, 5, 1] = np.nan
    bayes[12, 12, 0] = np.nan
    bayes[13, 12, 0] = 3.0
    write_h5(tmp_path / "S3A_nan.hdf", refs=refs, bts=bts, bayes=bayes)
    slstr_scene(tmp_path / "S3A_other.hdf", seed=6)
    d = sciml(tmp_path, segmenter(9, 16, 16))
    assert torch.isfinite(d.train.inputs).all()
    assert torch.unique(d.train.targets).tolist() == [0.0, 1.0]
    # NaNs become the mean (0) after standardising over the finite values
    assert float(d.train.inputs[0, 2, 6, 8]) == 0.0  # refs (10, 10, 2)
    assert float(d.train.inputs[2, 7, 0, 3]) == 0.0  # bts (20, 5, 1): tile 2, channel 6 + 1
    finite_bts = torch.from_numpy(bts[np.isfinite(bts)].astype(np.float64))
    expected = (float(bts[4, 2, 0]) - finite_bts.mean()) / finite_bts.std()
    assert float(d.train.inputs[0, 6, 0, 0]) == pytest.approx(float(expected), rel=1e-5)
    # pixel (12, 12) of the scene is (8, 10) in tile 0 after the (4, 2) crop offset
    assert float(d.train.targets[0, 0, 8, 10]) == 0.0
    assert float(d.train.targets[0, 0, 9, 10]) == 1.0


def test_slstr_small_scene_becomes_one_resized_tile(tmp_path):
    slstr_scene(tmp_path / "S3A_a.hdf", height=10, width=12, seed=7)
    slstr_scene(tmp_path / "S3A_b.hdf", height=10, width=12, seed=8)
    d = sciml(tmp_path, segmenter(9, 16, 16))
    assert d.train.inputs.shape == (1, 9, 16, 16) and d.test.inputs.shape == (1, 9, 16, 16)
    assert set(torch.unique(d.train.targets).tolist()) <= {0.0, 1.0}


def test_slstr_h5_scenes(tmp_path):
    slstr_scene(tmp_path / "scene_1.h5", seed=1)
    slstr_scene(tmp_path / "scene_2.h5", seed=2)
    d = sciml(tmp_path, segmenter(9, 16, 16))
    assert len(d.train) == 4 and len(d.test) == 4


def test_slstr_scene_missing_a_key(tmp_path):
    rng = np.random.default_rng(0)
    write_h5(
        tmp_path / "S3A_broken.hdf",
        refs=rng.uniform(size=(32, 32, 6)),
        bayes=np.zeros((32, 32, 1), dtype=np.int32),
    )
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, segmenter(9, 16, 16))
    assert "S3A_broken.hdf" in str(info.value) and "'bts'" in str(info.value)


def test_slstr_channel_mismatch_names_the_file(tmp_path):
    slstr_scene(tmp_path / "S3A_a.hdf", seed=1)
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, segmenter(3, 16, 16))
    message = str(info.value)
    assert str(tmp_path / "S3A_a.hdf") in message
    assert "9-channel" in message and "'seg'" in message


def test_slstr_on_a_denoiser(tmp_path):
    slstr_scene(tmp_path / "S3A_a.hdf", seed=1)
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser(9, 16, 16))
    assert "segmentation" in str(info.value) and "'dn'" in str(info.value)


# -- sciml: OpticalDamage --------------------------------------------------------------


def write_tiff(path: Path, array: np.ndarray):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def optics_expected(array: np.ndarray, size: int) -> torch.Tensor:
    """Scale by the whole image's range, crop the window if it fits, block-average."""
    values = array.astype(np.float64)
    values = (values - values.min()) / (values.max() - values.min())
    if values.shape[0] >= 350 and values.shape[1] >= 470:
        values = values[150:350, 270:470]
    height, width = values.shape
    blocks = values.reshape(size, height // size, size, width // size).mean(axis=(1, 3))
    return torch.from_numpy(blocks)[None]


def optics_image(height, width, seed, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    rows = np.arange(height)[:, None] * 2.0
    cols = np.arange(width)[None, :] * 0.5
    image = (rows + cols + rng.uniform(0, 20, (height, width))) * scale
    image[0, 0] = -40.0 * scale if dtype == np.float32 else 0
    return image.astype(dtype)


def test_optical_damage_scaling_crop_and_resize(tmp_path):
    a = optics_image(400, 500, seed=1)
    b = optics_image(400, 500, seed=2, dtype=np.uint16, scale=50.0)
    c = optics_image(40, 60, seed=3)  # smaller than the crop window: used whole
    write_tiff(tmp_path / "training" / "undamaged" / "b.TIFF", b)
    write_tiff(tmp_path / "training" / "undamaged" / "a.TIFF", a)
    write_tiff(tmp_path / "validation" / "undamaged" / "c.TIFF", c)
    (tmp_path / "training" / "undamaged" / "notes.txt").write_text("not an image")
    d = sciml(tmp_path, autoencoder(1, 20, 20))
    assert d.task == "autoencoding" and d.synthetic is False
    assert "OpticalDamage" in d.description and "2 train / 1 test" in d.description
    assert d.train.targets is None and d.test.targets is None
    assert d.train.reference() is d.train.inputs
    assert d.train.inputs.shape == (2, 1, 20, 20) and d.test.inputs.shape == (1, 1, 20, 20)
    assert d.train.inputs.dtype == torch.float32
    # sorted by name: a then b
    expected = torch.stack([optics_expected(a, 20), optics_expected(b, 20)])
    torch.testing.assert_close(d.train.inputs.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        d.test.inputs.double(), optics_expected(c, 20)[None], atol=1e-5, rtol=1e-5
    )
    # the crop is strictly inside [0, 1]: the image's extremes lie outside the window
    assert float(d.train.inputs.min()) > 0.0 and float(d.train.inputs.max()) < 1.0
    assert float(d.test.inputs.min()) >= 0.0 and float(d.test.inputs.max()) <= 1.0


def test_optical_damage_without_validation_holds_out(tmp_path):
    for index in range(3):
        write_tiff(
            tmp_path / "training" / "undamaged" / f"img{index}.tiff",
            optics_image(40, 40, seed=index),
        )
    d = sciml(tmp_path, autoencoder(1, 20, 20))
    assert len(d.train) == 2 and len(d.test) == 1
    torch.testing.assert_close(
        d.test.inputs[0].double(), optics_expected(optics_image(40, 40, seed=2), 20)
    )


def test_optical_damage_empty_folder(tmp_path):
    (tmp_path / "training" / "undamaged").mkdir(parents=True)
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, autoencoder(1, 16, 16))
    assert str(tmp_path / "training" / "undamaged") in str(info.value)
    assert "TIFF" in str(info.value)


@pytest.mark.parametrize(
    "text, fragment",
    [(denoiser(1, 16, 16), "'dn'"), (autoencoder(3, 16, 16), "3")],
    ids=["denoiser", "three-channels"],
)
def test_optical_damage_on_a_mismatched_model(tmp_path, text, fragment):
    write_tiff(tmp_path / "training" / "undamaged" / "a.tiff", optics_image(40, 40, seed=0))
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, text)
    assert fragment in str(info.value)
    assert f"'sciml:{tmp_path}'" in str(info.value)


def test_optical_damage_unreadable_tiff(tmp_path):
    write_tiff(tmp_path / "training" / "undamaged" / "a.tiff", optics_image(40, 40, seed=0))
    (tmp_path / "training" / "undamaged" / "b.tiff").write_bytes(b"not a TIFF at all")
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, autoencoder(1, 20, 20))
    assert "b.tiff" in str(info.value)


# -- sciml: errors common to all layouts -----------------------------------------------


def test_sciml_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as info:
        sciml(missing, denoiser())
    assert str(missing) in str(info.value)
    assert "no such directory" in str(info.value)


def test_sciml_path_is_a_file(tmp_path):
    path = tmp_path / "graphene_img_noise.h5"
    write_h5(path, images=np.zeros((2, 4, 4, 1), dtype=np.float32))
    with pytest.raises(DatasetError) as info:
        sciml(path, denoiser())
    assert str(path) in str(info.value)


def test_sciml_directory_without_a_known_layout(tmp_path):
    (tmp_path / "README.txt").write_text("nothing here")
    (tmp_path / "images").mkdir()
    with pytest.raises(DatasetError) as info:
        sciml(tmp_path, denoiser())
    message = str(info.value)
    assert str(tmp_path) in message
    for layout in ("EMDenoise", "SLSTRCloud", "OpticalDamage"):
        assert layout in message
