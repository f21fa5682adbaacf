"""Shared layers: ``shares="NAME"`` on a statement makes it a later call of the layer the
earlier statement NAME made (a torch module called more than once, as ALBERT calls one
layer per hidden layer), with no state-dict key of its own.

- the generated module holds each layer once (its state dict is the reference's, loaded
  both ways), and the gradients of every call, added in the one ``.grad``, equal
  torch.autograd's to 1e-10 in float64 on gpu and on ipu (CPU emulation of PopTorch), with
  a compressing scheme too, and with a tie on the shared layer;
- every misuse is a ``FILE:LINE:COL`` error at the keyword, naming what was expected.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

from unroller.api import graph_from_text
from unroller.compiler.options import Options
from unroller.errors import ModelError
from unroller.runtime import ipu_device

SHARED = """model shared {
    input x: f32[N, 4]
    target y: i64[N]
    fc = linear(x, out_features=4)
    a = tanh(fc)
    fc_1 = linear(a, out_features=4, shares="fc")
    norm = layernorm(fc_1, normalized_shape=4)
    b = gelu(norm)
    fc_2 = linear(b, out_features=4, shares="fc")
    norm_1 = layernorm(fc_2, normalized_shape=4, shares="norm")
    head = linear(norm_1, out_features=3)
    loss = cross_entropy(head, y)
    return loss, head
}
"""


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x, y):
        h = self.fc(torch.tanh(self.fc(x)))
        h = self.norm(self.fc(F.gelu(self.norm(h))))
        head = self.head(h)
        return F.cross_entropy(head, y), head


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


def _step(model, platform, x, y):
    if platform == "gpu":
        return model(x, y)
    surrogate, loss = model(x, y)
    surrogate.backward()
    return loss


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_every_call_s_gradient_adds_into_one_grad(build, emulation, platform):
    torch.manual_seed(0)
    ref = Reference().double()
    model = build(SHARED, Options(platform=platform)).Model().double()
    assert list(model.state_dict()) == list(ref.state_dict())
    result = model.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    for _ in range(2):  # a second step accumulates as loss.backward() does
        ref_loss, _ = ref(x, y)
        ref_loss.backward()
        loss = _step(model, platform, x, y)
        assert rel_err(loss, ref_loss) <= 1e-10
    for (name, p), (ref_name, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == ref_name and rel_err(p.grad, r.grad) <= 1e-10, name
    # one call's gradient alone is far from the sum
    assert rel_err(ref.fc.weight.grad / 3, ref.fc.weight.grad) > 0.5
    assert rel_err(model.predict(x), ref(x, y)[1]) <= 1e-10


def test_a_compressing_scheme_and_a_tie(build):
    text = SHARED.replace(
        "head = linear(norm_1, out_features=3)",
        'back = linear(norm_1, out_features=4, bias=false, tied_weight="fc.weight")\n'
        "    head = linear(back, out_features=3)",
    )

    class Tied(Reference):
        def __init__(self):
            super().__init__()
            self.back = nn.Linear(4, 4, bias=False)
            self.back.weight = self.fc.weight

        def forward(self, x, y):
            h = self.fc(torch.tanh(self.fc(x)))
            h = self.norm(self.fc(F.gelu(self.norm(h))))
            head = self.head(self.back(h))
            return F.cross_entropy(head, y), head

    torch.manual_seed(0)
    ref = Tied().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    ref(x, y)[0].backward()
    exact = build(text).Model().double()
    exact.load_state_dict(ref.state_dict())
    assert exact.back.weight is exact.fc.weight
    assert rel_err(exact(x, y), ref(x, y)[0]) <= 1e-10
    assert rel_err(exact.fc.weight.grad, ref.fc.weight.grad) <= 1e-10  # four uses
    lossy = build(text, Options(scheme="quant")).Model().double()
    lossy.load_state_dict(ref.state_dict())
    assert rel_err(lossy(x, y), ref(x, y)[0]) <= 1e-10  # the forward is never changed
    assert lossy.fc.weight.grad is not None


def _error(text: str) -> ModelError:
    with pytest.raises(ModelError) as caught:
        graph_from_text(text, "shared.txt")
    return caught.value


@pytest.mark.parametrize(
    "call,message,word",
    [
        ("linear(a, out_features=4, shares=3)", "shares takes the full name of an earlier", ""),
        ('linear(a, out_features=4, shares="fc\\nimport os")', "shares takes the full name", ""),
        ('linear(a, out_features=4, shares="fcc")', "shares='fcc' names no earlier statement", ""),
        ('linear(a, out_features=4, shares="norm")', "shares='norm' names no earlier", ""),
        ('linear(a, out_features=4, shares="a")', "a is a tanh, not a linear", ""),
        ('linear(a, out_features=5, shares="fc")', "with out_features=5, fc's is built", ""),
        ('linear(a, out_features=4, bias=false, shares="fc")', "with bias=false", ""),
        ('tanh(a, shares="fc")', "tanh has no layer to share", ""),
        (
            'linear(a, out_features=4, shares="fc", tied_weight="fc.weight")',
            "tied_weight beside shares: a shared layer's parameters are tied or frozen",
            "tied_weight",
        ),
        ('linear(a, out_features=4, shares="fc", frozen=true)', "frozen beside shares", "frozen"),
    ],
)
def test_misuse_is_a_located_error(call, message, word):
    """At the value of ``shares`` (or of the keyword that may not stand beside it)."""
    text = SHARED.replace('linear(a, out_features=4, shares="fc")', call)
    error = _error(text)
    assert message in str(error), str(error)
    line = text.splitlines()[5]
    word = word or "shares"
    column = line.index(f"{word}=") + len(word) + 2  # 1-based, after the "="
    assert (error.loc.line, error.loc.col) == (6, column), str(error)
    shown = error.format("shared.txt", text)
    assert shown.startswith(f"shared.txt:6:{column}: error: "), shown


def test_a_chain_names_the_layer():
    text = SHARED.replace('shares="fc")\n    norm_1', 'shares="fc_1")\n    norm_1')
    error = _error(text)
    assert "shares='fc_1' shares the layer of 'fc' itself; name 'fc'" in str(error)
    assert error.loc.line == 9


def test_other_input_shapes_are_refused():
    text = SHARED.replace(
        "    head = linear(norm_1, out_features=3)",
        "    wide = concat(norm_1, norm_1, dim=1)\n"
        '    again = linear(wide, out_features=4, shares="fc")\n'
        "    head = linear(again, out_features=3)",
    )
    assert "built with in_features=8, fc's is built with in_features=4" in str(_error(text))


def test_a_free_parameter_is_not_shared():
    text = SHARED.replace(
        "    head = linear(norm_1, out_features=3)",
        '    p = parameter(shape=(4,))\n    q = parameter(shape=(4,), shares="p")\n'
        "    head = linear(norm_1, out_features=3)",
    )
    assert "parameter has no layer to share (a free parameter is a value" in str(_error(text))


def test_the_graph_records_the_layer():
    graph = graph_from_text(SHARED, "shared.txt")
    fc, fc_2 = graph.node("fc"), graph.node("fc_2")
    assert (fc.shares, fc_2.shares, fc_2.layer) == ("", "fc", "fc")
    assert fc_2.params == fc.params and [p.key for p in fc_2.params] == ["fc.weight", "fc.bias"]


def test_shared_layers_stay_on_one_stage(build):
    with pytest.raises(ModelError, match="a shared layer's calls go on one stage"):
        build(SHARED, Options(platform="ipu", num_ipus=2, stage_starts=("norm",)))
