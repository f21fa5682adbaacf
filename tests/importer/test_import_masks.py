"""Padding masks given as an input: Hugging Face's ``attention_mask`` imports as ``padding_mask``.

transformers turns ``attention_mask`` [N, S] into a 4-D mask with casts, index, ``&`` and
``where``; the importer recognises that subgraph by evaluating it on sample masks
(``unroller.importer.masks``) and the attention reads ``padding_mask(attention_mask)`` as its
bias, the causal part as ``is_causal``, added to a bias it already has (T5's relative
position bias). Each network is verified exactly (float64, 1e-10) with masks that pad;
a mask built any other way from an input is refused with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unroller.analysis.inputs import make_inputs
from unroller.analysis.verify import verify_text
from unroller.api import generate_from_text
from unroller.compiler.graph import build_graph
from unroller.compiler.options import Options
from unroller.compiler.parser import parse
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

pytest.importorskip("transformers")

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")
BERT_INPUTS = ["input_ids: i64[N, 12]", "attention_mask: i64[N, 12]"]
T5_INPUTS = [
    "input_ids: i64[N, 12]",
    "attention_mask: i64[N, 12]",
    "decoder_input_ids: i64[N, 8]",
]


@pytest.fixture(scope="module")
def t5_text() -> str:
    return import_network(f"{ZOO}:hf_t5", T5_INPUTS, "y: i64[N, 8]").text


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_with_an_attention_mask_verifies_exactly(attention):
    kwargs = {"attn_implementation": attention}
    text = import_network(f"{ZOO}:hf_bert", BERT_INPUTS, kwargs=kwargs).text
    assert "bert.padding_mask = padding_mask(attention_mask)" in text
    report = verify_text(text, f"{ZOO}:hf_bert", kwargs, batch_size=3)
    assert report.ok, report.problems or report.table()


def test_t5_with_an_attention_mask_verifies_exactly(t5_text):
    assert "encoder.padding_mask = padding_mask(attention_mask)" in t5_text
    # the encoder's relative position bias plus the padding mask, in both layers
    assert t5_text.count("masked_bias = add(encoder.block.0.layer.0.SelfAttention.rel") == 2
    # cross-attention reads the encoder's padding mask for the decoder's 8 queries
    assert "expand(encoder.padding_mask, size=(N, 1, 8, 12))" in t5_text
    report = verify_text(t5_text, f"{ZOO}:hf_t5", {}, batch_size=3)
    assert report.ok, report.problems or report.table()


def test_t5_with_a_decoder_attention_mask_verifies_exactly():
    """The decoder's mask is its padding mask AND the causal one: is_causal plus a bias."""
    inputs = [*T5_INPUTS, "decoder_attention_mask: i64[N, 8]"]
    text = import_network(f"{ZOO}:hf_t5", inputs, "y: i64[N, 8]").text
    assert "decoder.padding_mask = padding_mask(decoder_attention_mask)" in text
    assert "decoder.padding_mask)" in text and "is_causal=true" in text
    report = verify_text(text, f"{ZOO}:hf_t5", {}, batch_size=3)
    assert report.ok, report.problems or report.table()


def test_verify_feeds_padding_masks_that_pad(t5_text):
    """0 and 1 only, some padding, and every row's first token attended."""
    graph = build_graph(parse(t5_text, "<t5>"))
    names = [v.name for v in graph.inputs]
    mask = make_inputs(graph, 16, 0)[names.index("attention_mask")]
    assert set(mask.unique().tolist()) == {0, 1}
    assert bool((mask[:, 0] == 1).all())


def test_quant_generation_with_a_padding_mask_runs_a_step(t5_text):
    source = generate_from_text(t5_text, Options(scheme="quant"), label="t5_masked")
    namespace: dict = {}
    exec(compile(source, "t5_masked.py", "exec"), namespace)  # noqa: S102 - our own output
    model = namespace["Model"]()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    ids, decoder_ids = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 8))
    loss = model(ids, mask, decoder_ids, torch.randint(0, 64, (2, 8)))
    assert torch.isfinite(loss)
    rows = model.stash_report()["rows"]
    assert any("Quant" in row["compressor"] for row in rows)


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_padding_mask_kernels_give_bert_s_eager_mask(platform):
    """The kernel's bias against the one Hugging Face's eager BERT adds to its scores."""
    from transformers import BertConfig
    from transformers.masking_utils import create_bidirectional_mask

    from unroller.runtime import gpu, ipu

    kernels = {"gpu": gpu, "ipu": ipu}[platform]
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    ours = kernels.padding_mask(mask)
    config = BertConfig(attn_implementation="eager")
    embeds = torch.zeros(3, 5, 8)
    theirs = create_bidirectional_mask(config, embeds, mask)  # [N, 1, L, S]
    assert ours.shape == (3, 1, 1, 5)
    assert torch.equal(ours.expand_as(theirs), theirs)


# ---------------------------------------------------------------- masks built by hand


class MaskedAttention(nn.Module):
    """One attention layer whose boolean mask is built from a mask input (``how``): its
    padding mask, that and the causal mask, or something else."""

    def __init__(self, how: str = "padding") -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(16, 8)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids, attention_mask):
        batch, length = ids.shape
        x = self.embed(ids)
        q, k, v = (p(x).view(batch, length, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        keep = attention_mask.bool()[:, None, None, :]
        if self.how == "causal":
            causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
            keep = keep & causal
        elif self.how == "inverted":  # 1 pads: not Hugging Face's meaning
            keep = ~keep
        elif self.how == "threshold":
            keep = (attention_mask > 1)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(out.transpose(1, 2).reshape(batch, length, 8))


def masked_attention(how: str = "padding") -> nn.Module:
    """The factory verify builds the original from."""
    torch.manual_seed(0)
    return MaskedAttention(how)


INPUTS = ["ids: i64[N, 6]", "attention_mask: i64[N, 6]"]


@pytest.mark.parametrize("how,causal", [("padding", False), ("causal", True)])
def test_a_hand_built_mask_imports_with_its_causal_part(how, causal):
    imported = import_network("masked", INPUTS, built=masked_attention(how))
    assert "= padding_mask(attention_mask)" in imported.text
    assert ("is_causal=true" in imported.text) == causal
    report = verify_text(imported.text, masked_attention, {"how": how}, batch_size=4)
    assert report.ok, report.problems or report.table()


@pytest.mark.parametrize("how", ["inverted", "threshold"])
def test_a_mask_that_is_not_a_padding_mask_is_refused(how):
    with pytest.raises(ImportFailure) as failed:
        import_network("masked", INPUTS, built=masked_attention(how))
    message = str(failed.value)
    assert "not its padding mask" in message
    assert "'attention_mask'" in message
    assert message.count("\n") == 1  # one unmapped node: the attention, not the mask's ops
