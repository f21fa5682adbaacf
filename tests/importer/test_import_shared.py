"""A module with parameters called more than once imports as ``shares=`` statements.

ALBERT runs one layer group for every hidden layer (cross-layer parameter sharing), and a
network may call one block in a loop. The first call is the layer's statement; each later
one, ``NAME_1``, ``NAME_2``, ..., is written ``shares="NAME"``, so the text adds no
state-dict key the original lacks, and every call's gradient adds into the one ``.grad``
(``tests/compiler/test_shares.py`` has the language's side). A weight read by another
operator, or the same one with other arguments, stays refused as shared weights.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unroller.analysis.verify import verify_text
from unroller.importer.api import module_text
from unroller.importer.model import ImportFailure


class Block(nn.Module):
    """A linear and a layer norm, each called twice per call of the block."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.act(self.fc(x))
        return self.norm(x + self.act(self.fc(self.norm(h))))


class Looped(nn.Module):
    """Two blocks, then the first one three times more: one layer, many calls."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        for _ in range(3):
            x = self.layers[0](x)
        return self.head(x)


def test_a_module_called_again_shares_its_layer():
    torch.manual_seed(0)
    net, x, y = Looped(), torch.randn(4, 8), torch.randint(0, 3, (4,))
    text = module_text(net, (x,), y)
    report = verify_text(text, net)
    assert report.ok, report.problems or report.table()
    assert text.count('shares="layers.0.fc"') == 7 and text.count('shares="layers.1.fc"') == 1
    assert 'layers.0.fc_7 = linear(layers.0.norm_6, out_features=8, shares="layers.0.fc")' in text
    assert text.count("shares=") == 16  # fc and norm: 8 calls of layers.0, 2 of layers.1


class Reread(nn.Module):
    """A linear's weight read again by ``F.linear`` with another bias: not a call of the
    layer, so it stays refused."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(self.fc(x), self.fc.weight)


def test_another_reading_of_the_weights_stays_refused():
    with pytest.raises(ImportFailure) as caught:
        module_text(Reread(), (torch.randn(2, 4),), torch.randint(0, 4, (2,)))
    assert "shared weights" in caught.value.format()


def _albert(**sizes):
    from transformers import AlbertConfig, AlbertForSequenceClassification

    config = dict(vocab_size=64, embedding_size=16, hidden_size=32, intermediate_size=64)
    config.update(num_attention_heads=4, num_labels=3, **sizes)
    return AlbertForSequenceClassification(AlbertConfig(**config))


@pytest.mark.slow  # about 10 s on 2 busy cores
def test_albert_shares_one_layer_over_its_hidden_layers():
    """Three hidden layers, one layer group: its eight layers (query, key, value, dense, two
    layer norms, ffn, ffn_output) are called three times each, and the tanh GELU module too;
    verified exactly, loss, every gradient and the predictions."""
    torch.manual_seed(0)
    net = _albert(num_hidden_layers=3)
    ids, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 3, (2,))
    text = module_text(net, (ids,), y)
    report = verify_text(text, net)
    assert report.ok, report.problems or report.table()
    assert len(re.findall(r'shares="albert\.encoder\.albert_layer_groups\.0\.', text)) == 16
    assert "attention.query_2 = linear(" in text
    keys = {key for key, _ in net.named_parameters()}
    assert {row.name[len("grad ") :] for row in report.rows if row.name.startswith("grad ")} == keys
