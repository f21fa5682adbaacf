"""Frozen parameters: ``frozen=true`` (every parameter of a statement) or
``frozen_PARAM=true`` (one of them) do not train, as ``requires_grad_(False)`` in torch.

- gradients: the trained ones equal torch.autograd's (the original with those parameters
  frozen) to 1e-10 in float64 on gpu and ipu (CPU emulation of PopTorch); frozen ones stay
  None, and ``requires_grad`` is off in the generated module;
- memory: a frozen layer whose inputs need no gradient has no backward and keeps nothing
  (a frozen backbone under a trained head), and a frozen linear keeps no input (only its
  weight's gradient reads it: the registry's ``saved_for``);
- errors are located: not a boolean, a parameter the op lacks, an op without parameters,
  a tie between a frozen and a trained parameter;
- import: a Hugging Face GPT-2 with a frozen embedding and first block imports with
  ``frozen=true`` and verifies exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

from unroller.api import graph_from_text
from unroller.compiler.options import Options
from unroller.errors import ModelError
from unroller.runtime import ipu_device

TEXT = """model frz {
    input x: f32[N, 8]
    target y: i64[N]
    body = linear(x, out_features=16, frozen=true)
    act = relu(body)
    mid = linear(act, out_features=16, frozen_bias=true)
    act2 = gelu(mid)
    mid2 = linear(act2, out_features=16, frozen=true)
    head = linear(mid2, out_features=4)
    loss = cross_entropy(head, y)
    return loss, head
}
"""


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.mid2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        for p in (*self.body.parameters(), self.mid.bias, *self.mid2.parameters()):
            p.requires_grad_(False)

    def forward(self, x, y):
        head = self.head(self.mid2(F.gelu(self.mid(torch.relu(self.body(x))))))
        return F.cross_entropy(head, y), head


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_trained_gradients_match_autograd_and_frozen_stay_none(build, emulation, platform):
    torch.manual_seed(0)
    ref = Reference().double()
    model = build(TEXT, Options(platform=platform)).Model().double()
    model.load_state_dict(ref.state_dict())
    x, y = torch.randn(5, 8, dtype=torch.float64), torch.randint(0, 4, (5,))
    ref_loss, _ = ref(x, y)
    ref_loss.backward()
    if platform == "gpu":
        loss = model(x, y)
    else:
        surrogate, loss = model(x, y)
        surrogate.backward()
    assert rel_err(loss, ref_loss) <= 1e-10
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.requires_grad == r.requires_grad, name
        if r.requires_grad:
            assert rel_err(p.grad, r.grad) <= 1e-10, name
        else:
            assert p.grad is None, name


def test_frozen_layers_keep_nothing_they_do_not_need():
    graph = graph_from_text(TEXT, "frz.txt")
    body, mid2 = graph.node("body"), graph.node("mid2")
    assert not body.needs_backward and body.saved == ()  # no gradient flows into it
    assert mid2.needs_backward and mid2.needs == (True, False, False)
    assert [(a.entry, a.kind) for a in mid2.saved] == [("x", "none"), ("weight", "layer")]
    unfrozen = graph_from_text(
        TEXT.replace(", frozen=true", "").replace(", frozen_bias=true", ""), "frz.txt"
    )
    assert unfrozen.node("body").saved and unfrozen.node("mid2").saved[0].kind == "value"


def _error(text: str) -> ModelError:
    with pytest.raises(ModelError) as caught:
        graph_from_text(text, "frz.txt")
    return caught.value


@pytest.mark.parametrize(
    "old,new,message,line",
    [
        ("frozen=true)\n    act =", "frozen=1)\n    act =", "frozen takes true or false, got 1", 4),
        ("frozen_bias=true", "frozen_scale=true", "linear has no parameter 'scale' to freeze", 6),
        (
            "act = relu(body)",
            "act = relu(body, frozen=true)",
            "relu has no parameters to freeze",
            5,
        ),
    ],
)
def test_misuse_is_a_located_error(old, new, message, line):
    error = _error(TEXT.replace(old, new, 1))
    assert message in str(error) and error.loc.line == line, str(error)


def test_a_tie_between_frozen_and_trained_is_refused():
    text = TEXT.replace(
        "head = linear(mid2, out_features=4)",
        'head = linear(mid2, out_features=16, tied_weight="mid2.weight")',
    ).replace("loss = cross_entropy(head, y)", "loss = cross_entropy(head, y)")
    assert "which does not train: freeze both or neither" in str(_error(text))


ZOO = str(Path(__file__).parents[1] / "import_zoo.py")


def test_a_frozen_backbone_imports_and_verifies_exactly():
    pytest.importorskip("transformers")
    from unroller.analysis.verify import verify_text
    from unroller.importer.api import import_network

    kwargs = {
        "attn_implementation": "sdpa",
        "tie_word_embeddings": False,
        "freeze": ["transformer.wte", "transformer.wpe", "transformer.h.0"],
    }
    text = import_network(
        f"{ZOO}:hf_gpt2", ["ids: i64[N, 16]"], "y: i64[N, 16]", kwargs=kwargs
    ).text
    assert (
        "transformer.wte = embedding(ids, num_embeddings=64, embedding_dim=32, frozen=true)" in text
    )
    assert "frozen" not in next(line for line in text.splitlines() if "lm_head =" in line)
    graph = graph_from_text(text, "gpt2.txt")
    assert not graph.node("transformer.wte").needs_backward
    report = verify_text(text, f"{ZOO}:hf_gpt2", kwargs)
    assert report.ok, report.problems or report.table()


def test_the_memory_model_keeps_no_gradient_for_frozen_parameters():
    """Frozen parameters get no ``.grad``: the predicted parameter-gradient bytes are those
    of the trained ones only (mid.weight and head's weight and bias, float32)."""
    from unroller.api import simulate

    trained = (16 * 16) + (4 * 16 + 4)
    assert simulate(TEXT, Options(), 4).param_grad_bytes == trained * 4
