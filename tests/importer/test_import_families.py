"""More module families through ``unroll import``: what the ``CASES`` of
``tests/importer/test_import_torch.py`` cannot say.

``CASES`` checks import -> verify (1e-10, float64) and the recovered blocks of
EfficientNet-B0, DenseNet and the TCN. Here: the structure those texts must have (the
squeeze-excitation gate broadcast over H and W, DenseNet's concat of every earlier feature
map, the causal TCN's chomp), the autoencoder under ``mse_loss`` (the CASES test imports
with cross_entropy only), the refusals (stochastic depth), and ConvNeXt (its layer scale a free parameter).

Depthwise float64 convolutions run one group at a time on the CPU; with several threads on
a busy machine their synchronisation dominates, so these tests run single-threaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from unroller.analysis.verify import verify_text
from unroller.cli import app
from unroller.importer.api import import_network

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")
runner = CliRunner()

EFFICIENTNET = {"width_mult": 0.1, "depth_mult": 0.5}
DENSENET = {"growth_rate": 4, "block_config": [2, 2], "num_init_features": 8, "bn_size": 2}
CONVNEXT = {"widths": [8, 16], "depths": [2, 1], "layer_scale": 0.5}
IMAGES = "x: f32[N, 3, 32, 32]"


@pytest.fixture(autouse=True)
def one_thread():
    """Single-threaded: per-group convolutions are dominated by thread hand-offs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _import_and_verify(name: str, inputs: str, kwargs: dict, **options) -> str:
    """The imported text, after checking it verifies exactly against the original."""
    imported = import_network(f"{ZOO}:{name}", [inputs], kwargs=kwargs, **options)
    report = verify_text(imported.text, f"{ZOO}:{name}", kwargs)
    assert report.ok, report.problems or report.table()
    return imported.text


def test_efficientnet_squeeze_excitation_gates_the_map():
    """Squeeze-excitation: pool, 1x1 conv, SiLU, 1x1 conv, sigmoid, and the gate
    ``[N, C, 1, 1]`` times the map ``[N, C, H, W]``; the classifier's in-place dropout.
    (Import only: the ``CASES`` entry verifies the same network, dropout 0.2 included.
    Matched by pattern: which level of the module tree becomes a block is the block
    recovery's choice, not the family's.)"""
    text = import_network(f"{ZOO}:efficientnet_b0", [IMAGES], kwargs=EFFICIENTNET).text
    for pattern in (
        r"(\S*)avgpool = adaptive_avgpool2d\(\S+, output_size=1\)  # AdaptiveAvgPool2d",
        r"(\S*)activation = silu\(\1fc1\)  # SiLU",
        r"(\S*)scale_activation = sigmoid\(\1fc2\)  # Sigmoid",
        r"(\S*)mul = mul\(\1scale_activation, \S+\)  # SqueezeExcitation \[N, 8, 16, 16\]",
        r"features\.1\.0\.add = add\(features\.1\.0\.block\.2\.1, features\.0\S*\)",
        r"classifier\.0 = dropout\(flatten, p=0\.2\)",
    ):
        assert re.search(pattern, text), (pattern, text)
    assert "stochastic_depth" not in text  # the identity at p=0


@pytest.mark.slow
def test_efficientnet_with_stochastic_depth_verifies():
    """torchvision's StochasticDepth (0.2, per row) as drop_path: exact, at batch 8."""
    torch.manual_seed(0)
    kwargs = {**EFFICIENTNET, "stochastic_depth_prob": 0.2}
    report = verify_text(
        import_network(f"{ZOO}:efficientnet_b0", [IMAGES], kwargs=kwargs).text,
        f"{ZOO}:efficientnet_b0",
        kwargs,
        batch_size=8,
    )
    assert report.ok, report.problems or report.table()


def test_densenet_concatenates_every_earlier_feature_map():
    """The first dense layer reads its input as is (the concat of one tensor), the second
    the concat of the input and the first's new features; the block returns all of them;
    transitions end in a 2x2 average pool."""
    text = _import_and_verify("densenet", IMAGES, DENSENET)
    for line in (
        "denselayer1.norm1 = batchnorm2d(x)",
        "denselayer2.cat = concat(x, denselayer1.conv2)",
        "cat = concat(x, denselayer1.conv2, denselayer2.conv2)",
        "features.transition1.pool = avgpool2d(features.transition1.conv, kernel_size=2, "
        "stride=2)",
        "features.denseblock2 = dense_block(features.transition1.pool)",
    ):
        assert line in text, text


def test_causal_tcn_chomps_the_padding():
    text = _import_and_verify("tcn", "x: f32[N, 4, 32]", {"causal": True})
    assert "block temporal_block(" in text
    assert "chomp1 = slice(conv1, dim=2, end=end)" in text
    assert "network.1.chomp1 = slice(network.1.conv1, dim=2, end=-4)" in text


def test_autoencoder_reconstructs_under_mse_loss():
    text = _import_and_verify("autoencoder", "x: f32[N, 32]", {}, loss="mse_loss")
    assert "target y: f32[N, 32]" in text
    assert "sigmoid = sigmoid(decoder2)  # Sigmoid [N, 32]" in text
    assert "loss = mse_loss(sigmoid, y)" in text


def test_cli_imports_and_verifies_the_autoencoder(tmp_path):
    out = tmp_path / "ae.txt"
    spec = f"{ZOO}:autoencoder"
    args = ["import", spec, "--input", "x: f32[N, 32]", "--loss", "mse_loss", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    checked = runner.invoke(app, ["verify", str(out), "--against", spec])
    assert checked.exit_code == 0, checked.output


def test_convnext_imports_and_verifies_exactly():
    text = _import_and_verify("convnext_tiny", IMAGES, CONVNEXT)
    assert "block cn_block(" in text
    assert "layer_scale = parameter(shape=shape)" in text
    assert "mul = mul(layer_scale, block.6)" in text
