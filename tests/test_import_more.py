"""Importer gaps closed: an RNN's final state, nn.MultiheadAttention's key_padding_mask,
eager attention with a mask added to its scores, BART. Each imports, generates and
verifies exactly in float64 (1e-10); what stays refused is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure
from unroller.verify import verify_text

ZOO = str(Path(__file__).parent / "import_zoo.py")


# ---------------------------------------------------------------- RNN final states


class FinalState(nn.Module):
    """A head on h_n of an nn.LSTM / nn.GRU, read as ``read`` says."""

    def __init__(
        self, kind: str = "lstm", layers: int = 2, bidirectional: bool = False, read: str = "last"
    ) -> None:
        super().__init__()
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(6, 8, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.read = read
        self.head = nn.Linear(16 if read == "both" else 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        if self.read == "both":  # the last layer's two directions
            z = torch.cat([h[-2], h[-1]], dim=1)
        elif self.read == "squeeze":
            z = h.squeeze(0)
        elif self.read == "cell":
            z = state[1][-1]
        elif self.read == "lower":
            z = h[0]
        else:
            z = h[-1]
        return self.head(z + 0 * out[:, 0, :8] if self.read == "with_output" else z)


def final_state(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return FinalState(**kwargs)


RNN_INPUT = ["x: f32[N, 5, 6]"]


@pytest.mark.parametrize(
    "kwargs,reads",
    [
        ({"kind": "lstm"}, ["select(rnn, dim=1, index=4)"]),
        ({"kind": "gru", "layers": 1, "read": "squeeze"}, ["select(rnn, dim=1, index=4)"]),
        ({"kind": "lstm", "bidirectional": True}, ["select(rnn, dim=1, index=0)", "start=8"]),
        (
            {"kind": "gru", "bidirectional": True, "read": "both"},
            ["select(rnn, dim=1, index=4)", "end=8", "select(rnn, dim=1, index=0)", "start=8"],
        ),
        ({"kind": "lstm", "read": "with_output"}, ["select(rnn, dim=1, index=4)"]),
    ],
)
def test_the_last_layer_s_final_state_is_read_from_the_output(kwargs, reads):
    """h_n[-1] is the output's last step (a reverse direction's: its first step's second
    half), exactly."""
    text = import_network("rnn", RNN_INPUT, built=final_state(**kwargs)).text
    for read in reads:
        assert read in text
    report = verify_text(text, final_state, kwargs, batch_size=3)
    assert report.ok, report.problems or report.table()


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"kind": "lstm", "read": "cell"}, "final cell state c_n of nn.LSTM"),
        ({"kind": "gru", "read": "lower"}, "reads h_n[0] of nn.GRU, the final state of layer 0"),
    ],
)
def test_other_final_states_are_refused_by_name(kwargs, reason):
    with pytest.raises(ImportFailure) as failed:
        import_network("rnn", RNN_INPUT, built=final_state(**kwargs))
    assert reason in str(failed.value)
    assert str(failed.value).count("\n") == 1
