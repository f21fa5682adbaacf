"""A generated module refuses inputs unlike its declarations at entry, naming the input.

Before, a 32x32 batch fed to a 64x64 dct-dense model failed deep in the backward pass
with "packed codes hold 64 bytes per sample, expected 256".
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import generated_text

from unroller.compiler.options import Options
from unroller.runtime import ipu_device, poptorch_emulation

MODEL = """
model m {
    input x: f32[N, 3, 16, 16]
    target y: i64[N]
    c = conv2d(x, out_channels=4, kernel_size=3, padding=1)
    r = relu(c)
    p = adaptive_avgpool2d(r, output_size=1)
    f = flatten(p)
    fc = linear(f, out_features=5)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""


@pytest.fixture(scope="module")
def gpu_module(tmp_path_factory):
    from unroller.api import import_generated, write_atomic

    path = tmp_path_factory.mktemp("entry") / "m.py"
    write_atomic(path, generated_text(MODEL, Options(scheme="dct-dense")))
    return import_generated(path, "entry_check_gpu")


X = torch.randn(2, 3, 16, 16)
Y = torch.tensor([1, 4])

BAD = [
    # (x, y, message pattern)
    (torch.randn(2, 3, 32, 32), Y, r"input 'x': expected shape f32\[N, 3, 16, 16\], got "),
    (torch.randn(2, 16, 16), Y, r"input 'x': expected shape f32\[N, 3, 16, 16\]"),
    (torch.randn(2, 1, 3, 16, 16), Y, r"input 'x': expected shape"),
    (torch.zeros(2, 3, 16, 16, dtype=torch.int64), Y, r"input 'x'.*floating-point"),
    (X, Y.float(), r"input 'y': expected i64\[N\] \(torch.int64\), got torch.float32"),
    (X, Y.int(), r"input 'y': expected i64\[N\] \(torch.int64\), got torch.int32"),
    (X, Y[None], r"input 'y': expected shape i64\[N\]"),
    (X, torch.tensor([1, 2, 3]), r"input 'y': batch size 3 differs from 'x' \(2\)"),
    (X[:0], Y[:0], r"input 'x': the batch is empty"),
    (X.numpy(), Y, r"input 'x': expected a tensor, got ndarray"),
]


@pytest.mark.parametrize("x, y, pattern", BAD, ids=range(len(BAD)))
def test_training_step_refuses_bad_inputs(gpu_module, x, y, pattern):
    model = gpu_module.Model()
    with pytest.raises(ValueError, match=pattern):
        model(x, y)
    assert all(p.grad is None for p in model.parameters())  # nothing ran


def test_the_message_names_expected_and_given(gpu_module):
    with pytest.raises(ValueError) as info:
        gpu_module.Model()(torch.randn(2, 3, 32, 32), Y)
    assert str(info.value) == (
        "input 'x': expected shape f32[N, 3, 16, 16], got torch.float32 of shape [2, 3, 32, 32]"
    )


def test_predict_checks_its_inputs(gpu_module):
    model = gpu_module.Model()
    assert model.predict(X).shape == (2, 5)
    with pytest.raises(ValueError, match=re.escape("input 'x': expected shape f32[N, 3, 16, 16]")):
        model.predict(torch.randn(2, 3, 15, 16))


def test_other_float_dtypes_follow_the_parameters(gpu_module):
    model = gpu_module.Model().double()
    loss = model(X.double(), Y)
    assert loss.dtype == torch.float64


def test_the_ipu_module_checks_too(tmp_path):
    from unroller.api import import_generated, write_atomic

    path = tmp_path / "m_ipu.py"
    write_atomic(path, generated_text(MODEL, Options(platform="ipu", num_ipus=2)))
    module = import_generated(path, "entry_check_ipu")
    ipu_device.use_emulation()
    try:
        training = poptorch_emulation.trainingModel(module.Model(), poptorch_emulation.Options())
        training(X, Y)
        with pytest.raises(ValueError, match=r"input 'x': expected shape"):
            training(torch.randn(2, 3, 8, 8), Y)
    finally:
        ipu_device.use_emulation(False)
