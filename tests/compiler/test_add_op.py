"""Adding an operator is one registry entry plus its kernels; nothing in the core changes.

This test adds `ext_softplus` (softplus, a built-in since v2, under another
name) from outside the package: a registry file and a kernel module
written into a temp dir, picked up through UNROLLER_OPS. The generated step must then
match autograd like every built-in op.
"""

from __future__ import annotations

import sys
import textwrap

import torch
import torch.nn.functional as F
from conftest import rel_err

REGISTRY_ENTRY = """
[ext_softplus]
doc = "log(1 + exp(beta * x)) / beta"
kind = "activation"
inputs = ["x"]
shape = "same_float"
args.beta = { type = "float", default = 1.0, min = 0.0 }
saved = ["x"]
activations = ["x"]
kernel_args = ["beta"]
kernels.gpu = "softplus_kernels"
"""

KERNELS = """
import torch


def ext_softplus(x, *, beta):
    return torch.nn.functional.softplus(x, beta=beta)


def ext_softplus_backward(g, x, *, beta, needs=None):
    return (g * torch.sigmoid(beta * x) if needs is None or needs[0] else None,)
"""

MODEL = """
model with_softplus {
    input x: f32[N, 5]
    target y: f32[N, 3]
    h = linear(x, out_features=4)
    s = ext_softplus(h, beta=2.0)
    out = linear(s, out_features=3)
    loss = mse_loss(out, y)
    return loss, out
}
"""


def test_an_added_op_generates_and_matches_autograd(tmp_path, monkeypatch, build):
    (tmp_path / "extra_ops.toml").write_text(REGISTRY_ENTRY)
    (tmp_path / "softplus_kernels.py").write_text(textwrap.dedent(KERNELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("UNROLLER_OPS", str(tmp_path / "extra_ops.toml"))
    sys.modules.pop("softplus_kernels", None)

    module = build(MODEL, readable=True)
    source = open(module.__file__).read()
    assert "import softplus_kernels as K2" in source
    assert "K2.ext_softplus_backward(" in source

    torch.manual_seed(0)
    gen = module.Model().double()
    h, out = torch.nn.Linear(5, 4).double(), torch.nn.Linear(4, 3).double()
    h.load_state_dict({k[2:]: v for k, v in gen.state_dict().items() if k.startswith("h.")})
    out.load_state_dict({k[4:]: v for k, v in gen.state_dict().items() if k.startswith("out.")})
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    want = F.mse_loss(out(F.softplus(h(x), beta=2.0)), y)
    want.backward()
    got = gen(x, y)
    assert rel_err(got, want) <= 1e-10
    assert rel_err(gen.get_submodule("h").weight.grad, h.weight.grad) <= 1e-10
    assert rel_err(gen.get_submodule("out").bias.grad, out.bias.grad) <= 1e-10


def test_unknown_op_without_the_entry(tmp_path, monkeypatch):
    from unroller.api import graph_from_text
    from unroller.errors import ModelError

    monkeypatch.delenv("UNROLLER_OPS", raising=False)
    try:
        graph_from_text(MODEL, "m.txt")
    except ModelError as exc:
        assert "unknown operator 'ext_softplus'" in exc.message
    else:
        raise AssertionError("ext_softplus should be unknown without its registry entry")
