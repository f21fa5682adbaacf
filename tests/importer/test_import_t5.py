"""T5-style encoder-decoders: ``unroll import`` of ``transformers.T5ForConditionalGeneration``
built from a tiny config (no downloads), verified exactly against the original.

What makes T5 importable: named inputs (``decoder_input_ids`` reaches forward by keyword),
``T5LayerNorm`` recognised by its source as ``rmsnorm``, the relative position bias as the
``relative_position_bias`` operator (its constant bucket table matched bit for bit) feeding
``scaled_dot_product_attention`` as its additive ``bias`` input (the decoder's causal mask
on top), cross-attention (query from the decoder, key and value from the encoder's output),
and the shared embedding, which no forward call reads, held by a ``parameter`` statement
that the encoder's and decoder's embeddings and the head are tied to.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unroller.analysis.verify import verify_text
from unroller.api import generate_from_text
from unroller.compiler.options import Options
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure
from unroller.runtime.positions import relative_buckets

pytest.importorskip("transformers")

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")
SPEC = f"{ZOO}:hf_t5"
INPUTS = ["input_ids: i64[N, 12]", "decoder_input_ids: i64[N, 8]"]
TARGET = "y: i64[N, 8]"


def imported(**kwargs) -> str:
    return import_network(SPEC, INPUTS, TARGET, kwargs=kwargs).text


@pytest.fixture(scope="module")
def t5_text() -> str:
    return imported()


def test_t5_imports_with_its_parts(t5_text):
    text = t5_text
    assert "shared.weight = parameter(shape=(64, 32))" in text
    for user in ("encoder.embed_tokens = embedding(", "decoder.embed_tokens = embedding("):
        line = next(line for line in text.splitlines() if user in line)
        assert 'tied_weight="shared.weight"' in line
    assert "lm_head = linear(" in text and text.count('tied_weight="shared.weight"') == 3
    assert text.count("= relative_position_bias(") == 2  # the first layer of each stack
    encoder_bias = "bidirectional" not in next(
        line for line in text.splitlines() if "encoder.block.0.layer.0.SelfAttention.rel" in line
    )
    assert encoder_bias  # the encoder's is bidirectional, the default
    assert "bidirectional=false" in text  # the decoder's looks one way
    assert "rmsnorm(" in text and "layer_norm" in text
    decoder_self = next(
        line
        for line in text.splitlines()
        if "decoder.block.0.layer.0.SelfAttention.scaled_dot_product_attention =" in line
    )
    assert "relative_attention_bias, is_causal=true, scale=1.0" in decoder_self
    assert "EncDecAttention.k = linear(x1," in text  # keys and values from a second input
    cross = next(line for line in text.splitlines() if "decoder.block.0.layer.1 = " in line)
    assert "encoder.final_layer_norm)" in cross  # ... the encoder's output


def test_t5_verifies_exactly(t5_text):
    report = verify_text(t5_text, SPEC, {})
    assert report.ok, report.problems or report.table()
    names = {row.name for row in report.rows}
    assert "grad encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in names
    assert "grad decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in names


@pytest.fixture(scope="module")
def t5_dropout_text() -> str:
    """T5 at its default dropout (one import for both modes below)."""
    return imported(dropout=0.1)


@pytest.mark.parametrize("dropout_mode", ["seeded", "off"])
def test_t5_at_its_default_dropout_verifies_exactly(t5_dropout_text, dropout_mode):
    """T5's default dropout (0.1) everywhere, the attention probabilities included: the
    attentions keep dropout=0.1 beside their bias, and verify runs the original with the
    generated kernels' masks (or every dropout off)."""
    kwargs = {"dropout": 0.1}
    text = t5_dropout_text
    attention = [line for line in text.splitlines() if "scaled_dot_product_attention(" in line]
    assert attention and all("dropout=0.1" in line for line in attention)
    report = verify_text(text, SPEC, kwargs, dropout=dropout_mode)
    assert report.ok, report.problems or report.table()


def test_gated_gelu_t5_v1_1_style_verifies_exactly():
    """T5 v1.1's feed-forward: a tanh-GELU gate times a linear (``wi_0``, ``wi_1``)."""
    kwargs = {"feed_forward_proj": "gated-gelu"}
    text = imported(**kwargs)
    assert "DenseReluDense.wi_0 = linear(" in text and 'approximate="tanh"' in text
    report = verify_text(text, SPEC, kwargs)
    assert report.ok, report.problems or report.table()


def test_quant_generation_of_an_imported_t5_runs_a_step(t5_text):
    source = generate_from_text(t5_text, Options(scheme="quant"), label="t5")
    namespace: dict = {}
    exec(compile(source, "t5_quant.py", "exec"), namespace)  # noqa: S102 - our own output
    model = namespace["Model"]()
    loss = model(
        torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    )
    assert torch.isfinite(loss)
    rows = model.stash_report()["rows"]
    assert any("Quant" in row["compressor"] for row in rows)
    biases = [row for row in rows if row["tensor"].endswith("relative_attention_bias")]
    assert all("Quant" not in row["compressor"] for row in biases)  # a bias is kept exact


@pytest.mark.parametrize("buckets,distance", [(8, 16), (32, 128), (6, 9), (4, 5)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_are_t5s_bit_for_bit(buckets, distance, bidirectional):
    """The operator's bucket table equals T5's own function's, for queries and keys of
    different lengths (offsets on the log scale and past max_distance included)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    for length, keys in [(7, 7), (40, 33), (3, 150)]:
        offsets = torch.arange(keys)[None, :] - torch.arange(length)[:, None]
        theirs = T5Attention._relative_position_bucket(
            offsets, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
        )
        ours = relative_buckets(length, keys, buckets, distance, bidirectional)
        assert torch.equal(ours, theirs)


def test_t5_layernorm_is_recognised_by_its_source():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    from unroller.importer.hf_norms import float64_twin, is_t5_layernorm

    assert is_t5_layernorm(T5LayerNorm) and not is_t5_layernorm(LlamaRMSNorm)
    norm = T5LayerNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 6)
    twin = float64_twin(norm)
    assert twin.weight is norm.weight
    assert torch.equal(twin(x), norm(x))  # float32: the same numbers


def test_an_input_named_after_a_parameter_that_an_earlier_input_fills_is_refused():
    """``input_ids`` is forward's first parameter: an input declared before it by another
    name fills it by position, so naming it too would pass it twice."""
    inputs = ["ids: i64[N, 12]", "input_ids: i64[N, 8]"]
    with pytest.raises(ImportFailure, match="already fills by position"):
        import_network(SPEC, inputs, TARGET)
