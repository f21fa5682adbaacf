"""A generated step (gpu platform) called under an ambient ``torch.autocast`` refuses in one
line instead of failing deep in a backward kernel or computing in mixed dtypes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unroller
from unroller.api import load_model_class

TEXT = """
model net {
    input x: f32[N, 8]
    target y: i64[N]
    fc1 = linear(x, out_features=8)
    norm = layernorm(fc1, normalized_shape=8)
    fc2 = linear(norm, out_features=3)
    loss = cross_entropy(fc2, y)
    return loss, fc2
}
"""


def _step(tmp_path):
    path = tmp_path / "net.txt"
    path.write_text(TEXT)
    return load_model_class(path, directory=tmp_path)()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_step_under_autocast_is_refused_in_one_line(tmp_path, dtype):
    model = _step(tmp_path)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with torch.autocast("cpu", dtype=dtype), pytest.raises(RuntimeError) as info:
        model(x, y)
    message = str(info.value)
    assert "\n" not in message and "torch.autocast('cpu'" in message
    assert str(dtype).removeprefix("torch.") in message
    assert all(p.grad is None for p in model.parameters())  # nothing written
    loss = model(x, y)  # outside autocast: the step runs
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unroll_under_autocast_computes_the_matching_mixed_precision(dtype):
    """unroll's step, unrolled in fp32 and called under torch.autocast, is generated with
    the mixed precision that computes what that autocast would: the same numbers as a step
    unrolled with that precision, and the fp32 step again outside autocast."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = unroller.unroll(net, x)
    with torch.autocast("cpu", dtype=dtype):
        loss = step(x, y)
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    name = "bf16-mixed" if dtype == torch.bfloat16 else "fp16-mixed"
    assert torch.equal(loss, unroller.unroll(net, x, precision=name)(x, y))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    net.zero_grad(set_to_none=True)
    plain = step(x, y)  # outside autocast: the fp32 step
    assert '"precision"' not in step.source.splitlines()[0]
    assert plain.dtype == torch.float32 and not torch.equal(plain, loss)
