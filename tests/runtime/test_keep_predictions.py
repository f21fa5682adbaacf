"""A training step hands out its predictions when asked (``common.keep_predictions``).

The generated step has one ``K.hand_out(stash, name, value)`` line after each prediction;
inside ``keep_predictions()`` the step's predictions land in the yielded dict, as its own
training forward made them (batch statistics here, not the running ones ``predict()``
uses), equal to the torch.nn reference's train-mode output in float64; outside it a step
keeps none. Compression changes only what the backward reads, so under a lossy scheme the
handed-out predictions are still exact. ``fanout`` has two predictions: both are handed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import make_inputs
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.options import Options
from unroller.runtime import ipu_device
from unroller.runtime.common import keep_predictions


@pytest.fixture
def emulated():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


def _pair(build, name: str, options: Options):
    torch.manual_seed(0)
    ref = REFERENCES[name]().double()
    gen = build(model_path(name), options).Model().double()
    gen.load_state_dict(ref.state_dict())
    return gen, ref


@pytest.mark.parametrize(
    "platform, scheme",
    [("gpu", "nocompress"), ("gpu", "quant"), ("ipu", "nocompress")],
)
def test_the_step_hands_out_its_training_predictions(build, emulated, platform, scheme):
    gen, ref = _pair(build, "tiny_resnet", Options(platform=platform, scheme=scheme))
    inputs = make_inputs("tiny_resnet", 4, seed=1)
    _, want = ref(*inputs)
    with keep_predictions() as kept:
        gen(*inputs)
    assert list(kept) == ["fc"]
    assert rel_err(kept["fc"], want) <= 1e-10
    with torch.no_grad():
        evaluated = gen.predict(*inputs[:-1])
    evaluated = evaluated[0] if isinstance(evaluated, tuple) else evaluated
    assert rel_err(kept["fc"], evaluated) > 1e-6  # batch statistics, not the running ones


def test_every_prediction_is_handed_and_none_is_kept_unasked(build):
    gen, ref = _pair(build, "fanout", Options())
    inputs = make_inputs("fanout", 3, seed=2)
    _, *want = ref(*inputs)
    with keep_predictions() as kept:
        gen(*inputs)
    assert len(kept) == 2 == len(want)
    for got in kept.values():  # by shape: the text's outputs in another order
        (expected,) = [w for w in want if w.shape == got.shape]
        assert rel_err(got, expected) <= 1e-10
    gen(*inputs)
    assert gen.stash_log.predictions is None
