"""Every scheme on the test models: gradients close to nocompress (the error is printed),
nocompress bit-identical to the masks-off code, the stash report equal to the prediction,
and a small model that trains under every scheme."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import fast_subset, rel_err

from unroller.api import load_graph
from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.codegen import Options
from unroller.schemes import SCHEMES
from unroller.stash import plan_stash

# Relative L2 error of all parameter gradients together against nocompress, float64,
# batch 4, at PyTorch's default initialisation. Measured (2026-11-29): dct-first <= 0.24,
# dct-dense <= 0.84, quant <= 0.0042. At random init on small random images the
# activations are noise-like, so DCT+Chop (keep 16 of 64 coefficients) sits near its
# white-noise error sqrt(1 - 16/64) = 0.87; see docs/compressors.md. Asserted with margin.
GRAD_BOUND = {"nocompress": 0.0, "dct-first": 0.4, "dct-dense": 1.0, "quant": 0.01}
# The fixed schemes; auto is planned per model from a probe step (tests/test_memory_plan.py,
# and the float32 stash report below).
FIXED = [s for s in SCHEMES if s != "auto"]


def step(module, stem, batch=4, seed=0, **options):
    torch.manual_seed(0)
    ref = REFERENCES[stem]().double()
    model = module.Model().double()
    model.load_state_dict(ref.state_dict())
    inputs = make_inputs(stem, batch, seed=seed)
    torch.manual_seed(1)
    loss = model(*inputs)
    return model, loss


@pytest.mark.parametrize(
    "stem", fast_subset(sorted(REFERENCES), ["all_ops", "resnet_like", "unet_like"])
)
def test_nocompress_masks_are_bit_identical_to_no_masks(build, stem):
    with_masks, loss_a = step(build(model_path(stem), Options(scheme="nocompress")), stem)
    without, loss_b = step(build(model_path(stem), Options(scheme="nocompress", opt_level=0)), stem)
    assert torch.equal(loss_a, loss_b)
    grads = dict(without.named_parameters())
    for name, p in with_masks.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, grads[name].grad), name


# make test: every scheme and every model at least once; all 12 pairs with SLOW=1
GRADIENT_PAIRS = [
    (stem, scheme)
    for stem in ("resnet_like", "unet_like", "autoencoder", "fanout")
    for scheme in FIXED
    if scheme != "nocompress"
]
GRADIENT_FAST = [
    ("resnet_like", "dct-dense"),
    ("resnet_like", "quant"),
    ("unet_like", "dct-first"),
    ("autoencoder", "quant"),
    ("fanout", "dct-dense"),
]


@pytest.mark.parametrize("stem, scheme", fast_subset(GRADIENT_PAIRS, GRADIENT_FAST))
def test_scheme_gradients_close_to_nocompress(build, stem, scheme, capsys):
    exact, loss_exact = step(build(model_path(stem), Options(scheme="nocompress")), stem)
    approx, loss_approx = step(build(model_path(stem), Options(scheme=scheme)), stem)
    assert torch.equal(loss_exact, loss_approx)  # the forward pass is never changed
    grads = dict(exact.named_parameters())
    errors = {
        name: rel_err(p.grad, grads[name].grad)
        for name, p in approx.named_parameters()
        if p.grad is not None
    }
    worst = max(errors, key=errors.get)
    flat = torch.cat([p.grad.flatten() for p in approx.parameters() if p.grad is not None])
    want = torch.cat(
        [grads[n].grad.flatten() for n, p in approx.named_parameters() if p.grad is not None]
    )
    overall = rel_err(flat, want)
    with capsys.disabled():
        print(
            f"\n{stem} {scheme}: gradient error overall {overall:.2e}, "
            f"worst parameter {errors[worst]:.2e} ({worst})"
        )
    assert overall <= GRAD_BOUND[scheme], overall
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters() if p.grad is not None)


@pytest.mark.parametrize("stem", ["resnet_like", "unet_like", "autoencoder"])
def test_lossless_compressor_config_reproduces_nocompress(build, stem, tmp_path):
    """The plumbing check: DCT keeping every coefficient in f32 must give (almost) the
    uncompressed gradients, so any larger error in the schemes is the compressor's."""
    config = tmp_path / "lossless.toml"
    config.write_text('[default]\ncompressor = "dct"\nkeep = 8\nstorage = "f32"\n')
    exact, _ = step(build(model_path(stem), Options(scheme="nocompress")), stem)
    approx, _ = step(build(model_path(stem), Options(compress_config=str(config))), stem)
    source = open(sys.modules[type(approx).__module__].__file__).read()
    assert "K.restore_in_pieces(CODEC_DCT," in source  # convolutions' inputs, by piece
    grads = dict(exact.named_parameters())
    for name, p in approx.named_parameters():
        if p.grad is not None:
            assert rel_err(p.grad, grads[name].grad) <= 1e-5, name


@pytest.mark.parametrize("scheme", FIXED)
@pytest.mark.parametrize("stem", ["resnet_like", "unet_like", "nonsquare", "fanout"])
def test_stash_report_equals_prediction(build, stem, scheme):
    model, _ = step(build(model_path(stem), Options(scheme=scheme)), stem, batch=3)
    measured = model.stash_report()
    predicted = plan_stash(load_graph(model_path(stem)), Options(scheme=scheme).compression())
    # the step ran in float64: predict with the dtype the tensors had
    want = predicted.report(3)
    got_rows = {r["tensor"]: r for r in measured["rows"]}
    assert set(got_rows) == {r["tensor"] for r in want["rows"]}
    for row in want["rows"]:
        got = got_rows[row["tensor"]]
        assert list(got["shape"]) == list(row["shape"]), row["tensor"]
        # float64 run: raw bytes are twice the f32 prediction for float tensors
        scale = 2 if row["raw_bytes"] and got["raw_bytes"] == 2 * row["raw_bytes"] else 1
        assert got["raw_bytes"] == scale * row["raw_bytes"], row["tensor"]
    assert measured["total_raw_bytes"] == sum(r["raw_bytes"] for r in measured["rows"])


@pytest.mark.parametrize("scheme", FIXED)
def test_stash_report_equals_prediction_in_float32(build, scheme):
    stem = "resnet_like"
    module = build(model_path(stem), Options(scheme=scheme))
    torch.manual_seed(0)
    model = module.Model()
    model(*make_inputs(stem, 5, dtype=torch.float32))
    measured = model.stash_report()
    graph = load_graph(model_path(stem))
    want = plan_stash(graph, Options(scheme=scheme).compression(graph)).report(5)
    assert measured["total_raw_bytes"] == want["total_raw_bytes"]
    assert measured["total_stored_bytes"] == want["total_stored_bytes"]
    by_tensor = {r["tensor"]: r["stored_bytes"] for r in measured["rows"]}
    for row in want["rows"]:
        assert by_tensor[row["tensor"]] == row["stored_bytes"], row["tensor"]


TRAIN_MODEL = """
model small_cnn {
    input x: f32[N, 1, 16, 16]
    target y: i64[N]
    c1 = conv2d(x, out_channels=8, kernel_size=3, padding=1)
    b1 = batchnorm2d(c1)
    r1 = relu(b1)
    p1 = maxpool2d(r1, kernel_size=2)
    c2 = conv2d(p1, out_channels=16, kernel_size=3, padding=1)
    r2 = relu(c2)
    g = avgpool2d(r2, kernel_size=4)
    f = flatten(g)
    logits = linear(f, out_features=4)
    loss = cross_entropy(logits, y)
    return loss, logits
}
"""


def synthetic_task(n=256, seed=0):
    """Four classes of 16x16 images: a bright blob in one of the four quadrants, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=gen)
    x = 1.0 * torch.randn(n, 1, 16, 16, generator=gen)
    for i, label in enumerate(y.tolist()):
        r, c = divmod(label, 2)
        x[i, 0, 8 * r + 2 : 8 * r + 6, 8 * c + 2 : 8 * c + 6] += 0.6
    return x, y


def train(module, epochs=10, batch=32):
    torch.manual_seed(0)
    model = module.Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = synthetic_task()
    losses = []
    for _ in range(epochs):
        total = 0.0
        for i in range(0, len(x), batch):
            opt.zero_grad(set_to_none=True)
            total += float(model(x[i : i + batch], y[i : i + batch])) * len(x[i : i + batch])
            opt.step()
        losses.append(total / len(x))
    return losses


def test_small_model_trains_under_every_scheme(build, capsys):
    final = {}
    for scheme in FIXED:
        losses = train(build(TRAIN_MODEL, Options(scheme=scheme)))
        final[scheme] = losses[-1]
        assert losses[-1] < 0.5 * losses[0], (scheme, losses)  # it learns
    with capsys.disabled():
        print("\nfinal training loss per scheme:", {k: round(v, 4) for k, v in final.items()})
    for scheme, loss in final.items():
        assert loss <= 1.10 * final["nocompress"] + 1e-3, (scheme, loss, final["nocompress"])
