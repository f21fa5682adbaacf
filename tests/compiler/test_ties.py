"""Tied parameters: ``tied_PARAM="KEY"`` on a statement makes its parameter the tensor of
another statement (a language model's head tied to its token embedding, as torch's
``head.weight = emb.weight``).

- the generated module holds one tensor under both state-dict keys, loads the original's
  state dict both ways, and its gradient (both uses added in the one ``.grad``) equals
  torch.autograd's to 1e-10 in float64 on gpu and on ipu (CPU emulation of PopTorch), for
  nocompress and a compressing scheme's loss;
- every misuse is a ``FILE:LINE:COL`` error naming what was expected: a parameter the
  statement does not have, a key that is not a string or not a dotted name (hostile text
  never reaches the code), a key no statement has, its own parameter, a tie to a tied
  parameter, another shape;
- Hugging Face's tied heads import and verify exactly: GPT-2 and Llama with
  ``tie_word_embeddings=True``.
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

TIED = """model tied {
    input ids: i64[N, 6]
    target y: i64[N, 6]
    emb = embedding(ids, num_embeddings=10, embedding_dim=4)
    h = gelu(emb)
    proj = linear(h, out_features=4)
    head = linear(proj, out_features=10, bias=false, tied_weight="emb.weight")
    logits = permute(head, dims=(0, 2, 1))
    loss = cross_entropy(logits, y)
    return loss, head
}
"""


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, y):
        head = self.head(self.proj(F.gelu(self.emb(ids))))
        return F.cross_entropy(head.permute(0, 2, 1), y), head


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_tied_gradients_match_autograd(build, emulation, platform):
    torch.manual_seed(0)
    ref = Reference().double()
    model = build(TIED, Options(platform=platform)).Model().double()
    assert list(model.state_dict()) == ["emb.weight", "proj.weight", "proj.bias", "head.weight"]
    assert model.head.weight is model.emb.weight
    result = model.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    ids, y = torch.randint(0, 10, (3, 6)), torch.randint(0, 10, (3, 6))
    ref_loss, _ = ref(ids, y)
    ref_loss.backward()
    if platform == "gpu":
        loss = model(ids, y)
    else:
        surrogate, loss = model(ids, y)
        surrogate.backward()
    assert rel_err(loss, ref_loss) <= 1e-10
    for (name, p), (ref_name, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == ref_name and rel_err(p.grad, r.grad) <= 1e-10, name
    # the embedding's gradient alone would miss the head's: both uses are in it
    assert rel_err(model.emb.weight.grad, ref.emb.weight.grad) <= 1e-10


def test_a_compressing_scheme_keeps_the_tie(build):
    torch.manual_seed(0)
    ref = Reference().double()
    model = build(TIED, Options(scheme="quant")).Model().double()
    model.load_state_dict(ref.state_dict())
    ids, y = torch.randint(0, 10, (3, 6)), torch.randint(0, 10, (3, 6))
    loss = model(ids, y)
    assert rel_err(loss, ref(ids, y)[0]) <= 1e-10  # the forward is never changed
    assert model.head.weight is model.emb.weight and model.emb.weight.grad is not None


def _error(text: str) -> ModelError:
    with pytest.raises(ModelError) as caught:
        graph_from_text(text, "tied.txt")
    return caught.value


@pytest.mark.parametrize(
    "keyword,message",
    [
        (
            'tied_bias="emb.weight"',
            "linear has no parameter 'bias' to tie (its parameters: weight)",
        ),
        ("tied_weight=3", "tied_weight takes the state-dict key of another statement's parameter"),
        ('tied_weight="emb.weight\\nimport os"', "tied_weight takes the state-dict key"),
        ('tied_weight="emb.weight; x"', "tied_weight takes the state-dict key"),
        ('tied_weight="emb.wieght"', "tied_weight='emb.wieght' names no parameter of the model"),
        ('tied_weight="head.weight"', "tied_weight names its own parameter"),
        ('tied_weight="proj.weight"', "its weight is f32[10, 4] but proj.weight is f32[4, 4]"),
    ],
)
def test_misuse_is_a_located_error(keyword, message):
    text = TIED.replace('tied_weight="emb.weight"', keyword)
    error = _error(text)
    assert message in str(error), str(error)
    assert error.loc.line == 7  # the head statement


def test_a_tie_to_a_tied_parameter_names_the_owner():
    text = TIED.replace(
        "    logits = permute(head, dims=(0, 2, 1))",
        '    head2 = linear(proj, out_features=10, bias=false, tied_weight="head.weight")\n'
        "    both = add(head, head2)\n"
        "    logits = permute(both, dims=(0, 2, 1))",
    )
    assert "tie to 'emb.weight'" in str(_error(text))


def test_the_graph_records_the_tie():
    graph = graph_from_text(TIED, "tied.txt")
    assert graph.node("head").ties == {"weight": "emb.weight"}
    assert graph.node("emb").ties == {}


ZOO = str(Path(__file__).parents[1] / "import_zoo.py")


@pytest.mark.parametrize(
    "spec,kwargs",
    [
        ("hf_gpt2", {"attn_implementation": "sdpa", "tie_word_embeddings": True}),
        ("hf_llama", {"tie_word_embeddings": True}),
    ],
)
def test_hugging_face_tied_heads_import_and_verify_exactly(spec, kwargs):
    pytest.importorskip("transformers")
    from unroller.analysis.verify import verify_text
    from unroller.importer.api import import_network

    text = import_network(f"{ZOO}:{spec}", ["ids: i64[N, 16]"], "y: i64[N, 16]", kwargs=kwargs).text
    head = next(line for line in text.splitlines() if line.lstrip().startswith("lm_head ="))
    assert 'tied_weight="' in head and ("embed_tokens" in head or "wte" in head)
    report = verify_text(text, f"{ZOO}:{spec}", kwargs)
    assert report.ok, report.problems or report.table()


def test_the_memory_model_counts_a_tied_gradient_once():
    """One tensor has one ``.grad``: the predicted parameter-gradient bytes of the tied model
    are the untied model's less the head's weight (10 x 4 float32)."""
    from unroller.api import simulate

    untied = TIED.replace(', tied_weight="emb.weight"', "")
    tied_bytes = simulate(TIED, Options(), 4).param_grad_bytes
    untied_bytes = simulate(untied, Options(), 4).param_grad_bytes
    assert untied_bytes - tied_bytes == 10 * 4 * 4
