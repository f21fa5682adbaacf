"""Import gaps found on real networks, each closed exactly (float64, 1e-10 relative).

Each case is a tiny network built without downloads, imported and verified against the
original under autograd (``verify_module``): string conv padding, an activation module
called twice, a parameter ``forward`` never reads, a causal LM's default ``use_cache``,
RMSNorm copies whose source differs from Llama's only in comments, stochastic depth.

Of the networks that showed them, these import and verify: DINOv2, mT5, Llama with its
default ``use_cache``, SegFormer (at ``drop_path_rate=0.0``; at its default, stochastic depth
is ``drop_path``) and ALBERT (6 of 7 at their default structure; with several layers its one
layer is called again, ``shares=``: tests/importer/test_import_shared.py). Still refused,
named: Swin (window partition). Gemma2 (eager attention whose softmax rounds to float32 inside) imports through
the fallback: benchmarks/network_zoo.py measures it.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from unroller.analysis.verify import verify_module
from unroller.importer.api import import_network, module_text
from unroller.importer.model import ImportFailure


def _verified(net, inputs, target=None, **kwargs):
    """The imported text of ``net``, after checking it against ``net`` exactly."""
    torch.manual_seed(0)
    report = verify_module(net, inputs, target, **kwargs)
    assert report.ok, report.problems or report.table()
    return module_text(net, inputs, target)


class _Conv(nn.Module):
    """A convolution with string padding, flattened into a linear head."""

    def __init__(self, padding, kernel=3, dilation=1, one_d=False):
        super().__init__()
        conv = nn.Conv1d if one_d else nn.Conv2d
        self.c = conv(3, 4, kernel, padding=padding, dilation=dilation)
        side = 8 if padding == "same" else 8 - dilation * (kernel - 1)
        self.fc = nn.Linear(4 * side ** (1 if one_d else 2), 5)

    def forward(self, x):
        return self.fc(self.c(x).flatten(1))


@pytest.mark.parametrize(
    "padding, kernel, dilation, one_d",
    [("valid", 3, 1, False), ("same", 3, 1, False), ("same", 4, 2, False), ("same", 5, 1, True)],
)
def test_string_conv_padding_imports_as_numbers(padding, kernel, dilation, one_d):
    x = torch.randn(2, 3, 8) if one_d else torch.randn(2, 3, 8, 8)
    _verified(_Conv(padding, kernel, dilation, one_d), (x,))


def test_same_padding_with_an_even_kernel_falls_back_to_the_exact_call():
    """The registry's conv2d takes symmetric padding only; 'same' with an even kernel pads
    one more on the right: that very call runs as an opaque statement, exactly; without
    the fallback the conv's reason is given."""
    x = torch.randn(2, 3, 8, 8)
    text = _verified(_Conv("same", 4), (x,))
    assert 'op="aten.conv2d.padding"' in text and "one more on the right" in text
    with pytest.raises(ImportFailure, match="one more on the right"):
        import_network("conv", ["x0: f32[N, 3, 8, 8]"], built=_Conv("same", 4), fallback=False)


class _SharedActivation(nn.Module):
    """One activation instance called twice: a plain one, and transformers' tanh GELU,
    which maps as one collapsed statement per call (ALBERT's shared activation)."""

    def __init__(self, act):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(8, 8), nn.Linear(8, 5), act

    def forward(self, x):
        return self.b(self.act(self.a(self.act(x))))


@pytest.mark.parametrize("tanh_gelu", [False, True])
def test_an_activation_called_twice_gets_two_statements(tanh_gelu):
    from transformers.activations import NewGELUActivation

    net = _SharedActivation(NewGELUActivation() if tanh_gelu else nn.GELU())
    assert "act_1 = gelu(" in _verified(net, (torch.randn(2, 8),))


class _UnreadToken(nn.Module):
    """A parameter ``forward`` never reads (DINOv2's ``mask_token``), trainable or frozen."""

    def __init__(self, frozen=False):
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.mask_token = nn.Parameter(torch.zeros(1, 8), requires_grad=not frozen)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_parameter_forward_never_reads_is_held_without_a_gradient(frozen):
    net = _UnreadToken(frozen)
    text = _verified(net, (torch.randn(2, 8),))
    frozen_text = ", frozen=true" if frozen else ""
    assert f"mask_token = parameter(shape=(1, 8){frozen_text})" in text


def test_dinov2_imports_and_verifies():
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    text = _verified(Dinov2Model(config), (torch.randn(2, 3, 16, 16),))
    assert "embeddings.mask_token = parameter(" in text


def test_a_causal_lm_with_its_default_use_cache_imports():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert config.use_cache
    net = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    _verified(net, (ids,), torch.randint(0, 64, (2, 8)))
    assert net.config.use_cache  # left as it was


def test_rmsnorm_copies_whose_comments_differ_are_recognised():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.mt5.modeling_mt5 import MT5LayerNorm

    from unroller.importer.hf_norms import is_gemma_rmsnorm, is_t5_layernorm

    assert is_gemma_rmsnorm(Gemma2RMSNorm) and is_t5_layernorm(MT5LayerNorm)


class _Gemma2Norm(nn.Module):
    """Gemma2's RMSNorm (``1 + weight``) before a head: Gemma2 itself stays refused at its
    eager attention, whose softmax rounds to float32 inside."""

    def __init__(self):
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

        super().__init__()
        self.norm, self.fc = Gemma2RMSNorm(8), nn.Linear(8, 5)
        nn.init.normal_(self.norm.weight)

    def forward(self, x):
        return self.fc(self.norm(x))


def test_gemma2_rmsnorm_imports_as_rmsnorm():
    text = _verified(_Gemma2Norm(), (torch.randn(2, 4, 8),), torch.randint(0, 5, (2, 4)))
    assert "norm = rmsnorm(x0, normalized_shape=8, eps=1e-06, weight_offset=1.0)" in text


@pytest.mark.slow  # about 15 s
def test_mt5_imports_and_verifies():
    from transformers import MT5Config, MT5ForConditionalGeneration

    config = MT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, use_cache=False
    )
    ids = torch.randint(0, 64, (2, 8))
    inputs = {"input_ids": ids, "decoder_input_ids": ids}
    text = _verified(MT5ForConditionalGeneration(config), inputs, torch.randint(0, 64, (2, 8)))
    assert "layer_norm = rmsnorm(" in text


def _segformer(**kwargs):
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[3, 3],
        strides=[2, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=16,
        num_labels=3,
        **kwargs,
    )
    return SegformerForSemanticSegmentation(config)


@pytest.mark.slow  # about 15 s
def test_segformer_without_stochastic_depth_imports_and_verifies():
    _verified(_segformer(drop_path_rate=0.0), (torch.randn(2, 3, 16, 16),))


def test_segformer_stochastic_depth_is_drop_path():
    """Its default drop_path_rate (0.1, scaled by depth): Hugging Face's ``keep + rand``
    floored times ``x / keep`` per block, one ``drop_path`` each (verified end to end by
    ``python -m benchmarks.network_zoo --only segformer``)."""
    text = module_text(_segformer(), (torch.randn(2, 3, 16, 16),))
    assert re.findall(r"drop_path = drop_path\(\S+, p=([0-9.e-]+)\)", text) == ["0.1"], text
    assert "rand" not in text and "floor" not in text


def test_albert_with_one_layer_imports_and_verifies():
    """ALBERT's tanh GELU; with two layers its one shared layer is called twice, each
    later call a ``shares=`` statement (``tests/importer/test_import_shared.py``)."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    config = AlbertConfig(
        vocab_size=64,
        embedding_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_labels=3,
    )
    ids = torch.randint(0, 64, (2, 8))
    _verified(AlbertForSequenceClassification(config), (ids,), torch.randint(0, 3, (2,)))


class _MultiQuery(nn.Module):
    """Falcon's multi-query attention: one key/value head broadcast over every query head
    in ``F.scaled_dot_product_attention`` (no ``enable_gqa``)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 3)

    def forward(self, x):
        n, length, _ = x.shape
        q = self.q(x).view(n, length, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(n, length, 1, 4).transpose(1, 2).chunk(2, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(n, length, 8))


def test_one_key_value_head_broadcast_is_grouped_query_attention():
    text = _verified(_MultiQuery(), (torch.randn(2, 5, 8),))
    assert "enable_gqa=true" in text


class _IndexedPositions(nn.Module):
    """Whisper's learned positions: the table indexed by ``arange(L)`` repeated per sample
    (``weight[position_ids]``, an ``aten.index``), added to the input."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(16, 8), nn.Linear(8, 3)

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0).repeat(x.shape[0], 1)
        return self.fc(x + self.emb.weight[pos])


def test_a_table_indexed_by_constant_positions_is_embedding_rows():
    """Never the capture's batch size baked into a constant: the rows are one range shared
    by every sample (``embedding_rows``), at any batch size."""
    text = _verified(_IndexedPositions(), (torch.randn(2, 4, 8),))
    assert "embedding_rows(" in text and "aten(" not in text
