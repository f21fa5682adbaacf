"""``unroll import`` of Hugging Face ``transformers`` models built from tiny configs.

No weights are downloaded: ``tests/import_zoo.py`` builds BERT (sequence classification)
and GPT-2 (language model head) from 2-layer configs with every dropout at 0. What makes
them importable: their masks and position / token-type ids are tensors built from sizes
and constants, folded at import (an attention mask that masks nothing or is causal; a
table looked up at a constant row range is ``embedding_rows``), GPT-2's ``Conv1D`` is
``transposed_linear`` and its written-out tanh gelu is ``gelu(approximate="tanh")``.
Each is checked exactly (float64, 1e-10) against the original by ``unroller.analysis.verify``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import imported_text

from unroller.analysis.verify import verify_text
from unroller.importer.api import import_network

pytest.importorskip("transformers")

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_sequence_classifier_imports_exactly(attention):
    kwargs = {"attn_implementation": attention}
    imported = import_network(f"{ZOO}:hf_bert", ["ids: i64[N, 16]"], kwargs=kwargs)
    text = imported.text
    assert "bert.embeddings.position_embeddings = embedding_rows(" in text
    assert "block bert_layer(" in text
    report = verify_text(text, f"{ZOO}:hf_bert", kwargs)
    assert report.ok, report.problems or report.table()


def test_gpt2_lm_head_imports_exactly_with_a_causal_mask():
    kwargs = {"attn_implementation": "sdpa", "tie_word_embeddings": False}
    imported = import_network(f"{ZOO}:hf_gpt2", ["ids: i64[N, 16]"], "y: i64[N, 16]", kwargs=kwargs)
    text = imported.text
    assert "is_causal=true" in text
    assert "= transposed_linear(" in text
    assert 'approximate="tanh"' in text
    assert "block gpt2_block(" in text
    report = verify_text(text, f"{ZOO}:hf_gpt2", kwargs)
    assert report.ok, report.problems or report.table()


def test_gpt2_with_tied_weights_imports_the_tie():
    """GPT-2's default tied head: one tensor under two keys becomes ``tied_weight`` on the
    head (the verify of it is in tests/compiler/test_ties.py)."""
    kwargs = {"attn_implementation": "sdpa", "tie_word_embeddings": True}
    imported = import_network(f"{ZOO}:hf_gpt2", ["ids: i64[N, 16]"], "y: i64[N, 16]", kwargs=kwargs)
    assert (
        'lm_head = linear(transformer.ln_f, out_features=64, bias=false, tied_weight="transformer.wte.weight")'
        in imported.text
    )


@pytest.mark.parametrize("spec,target", [("hf_bert", None), ("hf_gpt2", "y: i64[N, 16]")])
@pytest.mark.parametrize("dropout_mode", ["seeded", "off"])
def test_default_dropout_imports_and_verifies_exactly(spec, target, dropout_mode):
    """Dropout 0.1 everywhere (the configs' default), attention probabilities included: the
    attention keeps dropout=0.1, and verify runs the original with the generated kernel's
    masks (seeded) or with every dropout off, exactly either way."""
    kwargs = {"attn_implementation": "sdpa", "dropout": 0.1}
    if spec == "hf_gpt2":
        kwargs["tie_word_embeddings"] = True
    text = imported_text(f"{ZOO}:{spec}", ["ids: i64[N, 16]"], target, kwargs=kwargs)
    attention = [line for line in text.splitlines() if "scaled_dot_product_attention(" in line]
    assert attention and all("dropout=0.1" in line for line in attention)
    report = verify_text(text, f"{ZOO}:{spec}", kwargs, dropout=dropout_mode)
    assert report.ok, report.problems or report.table()
    assert any("scaled_dot_product_attention (p=0.1)" in note for note in report.notes)


def test_attention_dropout_is_refused_on_the_ipu_platform():
    from unroller.api import generate_from_text
    from unroller.compiler.options import Options
    from unroller.errors import ModelError

    kwargs = {"attn_implementation": "sdpa", "dropout": 0.1}
    text = imported_text(f"{ZOO}:hf_bert", ["ids: i64[N, 16]"], None, kwargs=kwargs)
    with pytest.raises((ModelError, NotImplementedError), match="attention dropout"):
        generate_from_text(text, Options(platform="ipu"))


@pytest.mark.parametrize("dropout_mode", ["seeded", "off"])
def test_distilbert_at_its_defaults_imports_and_verifies_exactly(dropout_mode):
    """DistilBERT with every default (dropout 0.1 on hidden states and attention, 0.2 before
    the classifier)."""
    text = imported_text(f"{ZOO}:hf_distilbert", ["ids: i64[N, 16]"])
    assert "dropout=0.1" in text and "p=0.2" in text
    report = verify_text(text, f"{ZOO}:hf_distilbert", {}, dropout=dropout_mode)
    assert report.ok, report.problems or report.table()


@pytest.mark.parametrize("dropout_mode", ["seeded", "off"])
def test_roberta_at_its_defaults_imports_and_verifies_exactly(dropout_mode):
    """RoBERTa: position ids computed from the token ids (padding tokens at padding_idx)
    are one ``padded_positions`` statement, and its zero token types gathered at them are
    a constant row; dropout 0.1 everywhere."""
    text = imported_text(f"{ZOO}:hf_roberta", ["ids: i64[N, 16]"])
    assert "roberta.embeddings.positions = padded_positions(ids, padding_idx=1)" in text
    assert "token_type_embeddings = embedding_rows(" in text
    report = verify_text(text, f"{ZOO}:hf_roberta", {}, dropout=dropout_mode)
    assert report.ok, report.problems or report.table()


def test_padded_positions_is_roberta_s_function():
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    from unroller.runtime import gpu, ipu

    ids = torch.randint(0, 9, (5, 12), generator=torch.Generator().manual_seed(0))
    ids[:, ::4] = 1
    ids[0] = 1
    want = RobertaEmbeddings.create_position_ids_from_input_ids(ids, 1)
    for kernels in (gpu, ipu):
        assert torch.equal(kernels.padded_positions(ids, padding_idx=1), want)
