"""Whole models: the generated unrolled step against torch.autograd on torch.nn, float64.

For every model file in tests/models: same weights, same batch; the loss, every
parameter gradient, the batch-norm running statistics after the step, and predict()
in evaluation mode must agree to 1e-10 relative.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from unroller.bench.reference import DECLS, make_inputs
from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import suite_model_path as model_path

TOL = 1e-10


def run_both(build, stem: str, batch: int = 3, steps: int = 2):
    torch.manual_seed(0)
    ref = REFERENCES[stem]().double()
    gen = build(model_path(stem)).Model().double()
    missing = gen.load_state_dict(ref.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    assert list(gen.state_dict()) == list(ref.state_dict())
    losses = []
    for step in range(steps):  # two steps: gradients accumulate, running stats move twice
        inputs = make_inputs(stem, batch, seed=step)
        torch.manual_seed(100 + step)
        ref_loss = ref(*inputs)[0]
        ref_loss.backward()
        torch.manual_seed(100 + step)
        loss = gen(*inputs)
        assert loss.dim() == 0 and not loss.requires_grad
        losses.append((float(loss), float(ref_loss.detach())))
        assert rel_err(loss, ref_loss) <= TOL, (step, float(loss), float(ref_loss))
    return ref, gen


@pytest.mark.parametrize("stem", sorted(REFERENCES))
def test_gradients_match_autograd(build, stem):
    ref, gen = run_both(build, stem)
    ref_params = dict(ref.named_parameters())
    for name, param in gen.named_parameters():
        want = ref_params[name].grad
        if want is None:
            assert param.grad is None, name
            continue
        assert param.grad is not None, f"{name}: no gradient"
        assert rel_err(param.grad, want) <= TOL, (name, rel_err(param.grad, want))
    ref_buffers = dict(ref.named_buffers())
    for name, buf in gen.named_buffers():
        if buf.is_floating_point():
            assert rel_err(buf, ref_buffers[name]) <= TOL, name
        else:
            assert torch.equal(buf, ref_buffers[name]), name


@pytest.mark.parametrize("stem", sorted(REFERENCES))
def test_predict_matches_eval_mode(build, stem):
    ref, gen = run_both(build, stem, steps=1)
    inputs = make_inputs(stem, 2, seed=7)
    n_inputs = sum(1 for d in DECLS[stem] if d.kind == "input")
    want = ref.predict(*inputs[:n_inputs])
    got = gen.predict(*inputs[:n_inputs])
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL
