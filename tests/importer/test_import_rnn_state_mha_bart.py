"""Importer gaps closed: an RNN's final state, nn.MultiheadAttention's key_padding_mask,
eager attention with a mask added to its scores, BART. Each imports, generates and
verifies exactly in float64 (1e-10); what stays refused is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SLOW_MARK
from torch import nn

from unroller.analysis.verify import verify_text
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")


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


# ---------------------------------------------------------------- key_padding_mask


class PaddedAttention(nn.Module):
    """nn.MultiheadAttention with a key_padding_mask input (True pads), causal or not."""

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.causal = causal
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(5) if self.causal else None
        y = self.attn(
            h,
            h,
            h,
            key_padding_mask=key_padding_mask,
            attn_mask=mask,
            need_weights=False,
            is_causal=self.causal,
        )[0]
        return self.head(y.mean(1))


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with src_key_padding_mask (made float once, read by each layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x), src_key_padding_mask=key_padding_mask).mean(1))


def padded(kind: str = "attention", causal: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return PaddedEncoder() if kind == "encoder" else PaddedAttention(causal)


PADDED_INPUTS = ["x: f32[N, 5, 6]", "key_padding_mask: bool[N, 5]"]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize(
    "kwargs", [{}, {"causal": True}, {"kind": "encoder"}], ids=["mha", "causal", "encoder"]
)
def test_a_key_padding_mask_input_verifies_exactly(kwargs):
    """True pads: padding_mask(invert=true), expanded, is the attention's bias input."""
    text = import_network("padded", PADDED_INPUTS, built=padded(**kwargs)).text
    assert "input key_padding_mask: bool[N, 5]" in text
    assert text.count("= padding_mask(key_padding_mask, invert=true)") == 1
    assert "key_padding_bias, num_heads=2" in text
    report = verify_text(text, padded, kwargs, batch_size=4)
    assert report.ok, report.problems or report.table()


def test_a_float_key_padding_mask_is_refused():
    with pytest.raises(ImportFailure) as failed:
        import_network("padded", ["x: f32[N, 5, 6]", "key_padding_mask: f32[N, 5]"], built=padded())
    assert "a key_padding_mask must be a boolean model input [N, S]" in str(failed.value)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
@pytest.mark.parametrize("learned", [False, True], ids=["mask", "learned"])
def test_multihead_attention_kernels_add_the_bias(platform, learned):
    """Forward and backward with a padding bias (no gradient) or a learned one (its
    gradient summed over the heads) against nn.MultiheadAttention's autograd."""
    import importlib

    from unroller.runtime.common import padding_mask

    kernels = importlib.import_module(f"unroller.runtime.{platform}")
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    if learned:
        bias = torch.randn(3, 1, 5, 5, dtype=torch.float64, requires_grad=True)
        scores = bias.expand(3, 2, 5, 5).reshape(6, 5, 5)
        want = layer(x, x, x, attn_mask=scores, need_weights=False)[0]
    else:
        pads = torch.zeros(3, 5, dtype=torch.bool)
        pads[1, 3:] = True
        pads[2, 1] = True
        bias = padding_mask(pads, invert=True).to(torch.float64).expand(3, 1, 5, 5)
        want = layer(x, x, x, key_padding_mask=pads, need_weights=False)[0]
    g = torch.randn_like(want)
    want.backward(g)
    y, *saved = kernels.multihead_attention(x.detach(), bias.detach(), layer, num_heads=2)
    torch.testing.assert_close(y, want.detach(), rtol=1e-10, atol=1e-12)
    needs = (True, learned, True, True, True, True)
    grads = kernels.multihead_attention_backward(
        g, x.detach(), layer, *saved, bias.detach(), needs=needs
    )
    if learned:
        torch.testing.assert_close(grads[1], bias.grad, rtol=1e-10, atol=1e-12)
    else:
        assert grads[1] is None  # not asked: the mask's bias has no gradient
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[2], layer.in_proj_weight.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[5], layer.out_proj.bias.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- eager attention, causal mask


@pytest.mark.parametrize(
    "factory,inputs,target",
    [
        ("hf_gpt2", ["input_ids: i64[N, 12]"], None),
        ("hf_t5", ["input_ids: i64[N, 12]", "decoder_input_ids: i64[N, 8]"], "y: i64[N, 8]"),
    ],
)
def test_eager_attention_with_the_causal_mask_verifies_exactly(factory, inputs, target):
    """The constant causal mask added to the scores is one causal_mask statement."""
    pytest.importorskip("transformers")
    kwargs = {"attn_implementation": "eager"}
    text = import_network(f"{ZOO}:{factory}", inputs, target, kwargs=kwargs).text
    assert "= causal_mask(" in text
    assert "scaled_dot_product_attention" not in text
    report = verify_text(text, f"{ZOO}:{factory}", kwargs, batch_size=3)
    assert report.ok, report.problems or report.table()


def test_eager_llama_softmax_in_float32_runs_as_its_own_call():
    """Eager attention's softmax rounds to float32 inside, which the registry's softmax
    does not take: that very call runs as an opaque statement (its result back in the
    step's dtype, as the original's cast makes it), so even a float64 step equals the
    original's; registry only, it is refused with the reason."""
    pytest.importorskip("transformers")
    inputs = ["input_ids: i64[N, 12]"]
    kwargs = {"attn_implementation": "eager"}
    text = import_network(f"{ZOO}:hf_llama", inputs, kwargs=kwargs).text
    assert 'op="aten.softmax.int"' in text
    report = verify_text(text, f"{ZOO}:hf_llama", kwargs)
    assert report.ok, report.problems or report.table()
    with pytest.raises(ImportFailure) as failed:
        import_network(f"{ZOO}:hf_llama", inputs, kwargs=kwargs, fallback=False)
    assert "softmax with a dtype" in str(failed.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [5, 3])
def test_causal_mask_kernel_is_the_add_of_hugging_face_s_mask(dtype, rows):
    from unroller.runtime.common import causal_mask, causal_mask_backward

    torch.manual_seed(0)
    x = torch.randn(2, 3, rows, 5, dtype=dtype) * 10
    keep = torch.ones(rows, 5, dtype=torch.bool).tril(5 - rows)
    lowest = torch.full_like(x[0, 0], torch.finfo(dtype).min)
    added = x + torch.where(keep, torch.zeros_like(lowest), lowest)
    assert torch.equal(causal_mask(x), added)
    g = torch.randn_like(x)
    (grad,) = causal_mask_backward(g)
    assert torch.equal(grad[..., ~keep], torch.zeros_like(grad[..., ~keep]))
    assert torch.equal(grad[..., keep], g[..., keep])


# ---------------------------------------------------------------- BART


BART_INPUTS = ["input_ids: i64[N, 12]", "decoder_input_ids: i64[N, 8]"]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="default"),
        # make test: BART without dropout is the default case's statements less its dropouts
        pytest.param({"dropout": 0.0}, id="off", marks=SLOW_MARK),
        pytest.param({"attn_implementation": "eager"}, id="eager"),
    ],
)
def test_bart_verifies_exactly(kwargs):
    """Scaled, tied, offset-positioned embeddings; final_logits_bias, a buffer read as data,
    a frozen parameter under its key (compared as the buffer it is)."""
    pytest.importorskip("transformers")
    text = import_network(f"{ZOO}:hf_bart", BART_INPUTS, "y: i64[N, 8]", kwargs=kwargs).text
    assert "final_logits_bias = parameter(shape=(1, 64), frozen=true)" in text
    assert "embedding_rows(num_embeddings=34, embedding_dim=32, length=8, start=2)" in text
    assert 'tied_weight="model.shared.weight"' in text
    report = verify_text(text, f"{ZOO}:hf_bart", kwargs, batch_size=3)
    assert report.ok, report.problems or report.table()
    assert any(row.name == "buffer final_logits_bias" for row in report.rows)


class WrittenBuffer(nn.Module):
    """A buffer read as data and then updated: not a constant of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + self.avg
        self.avg.mul_(0.5)
        return y


def test_a_buffer_read_as_data_and_written_is_refused():
    with pytest.raises(ImportFailure) as failed:
        import_network("written", ["x: f32[N, 4]"], built=WrittenBuffer())
    assert "writes avg in place" in str(failed.value)
