"""The network zoo of ``benchmarks/network_zoo.py``: 45 ``transformers`` networks at their
library defaults but size, and the 29 networks of ``tests/import_zoo.py``.

The fast tests check the lists (45 distinct new networks, every override a size or a
special token id, the earlier list covering the import zoo) and build two of them; the slow
ones run three new networks through ``measure``, the function the benchmark runs in each of
its worker processes (``python -m benchmarks.network_zoo``, results in
``benchmarks/results/network_zoo.md``)."""

from __future__ import annotations

import re

import pytest

from benchmarks.network_zoo import (
    EARLIER,
    NEW,
    batch,
    build,
    find,
    measure,
    overrides,
    token_fixes,
)

#: The config arguments a network's size is made of: widths, depths, heads, vocabulary,
#: image and position-table sizes, and the nested configs of a two-tower model.
SIZE = re.compile(
    r"(vocab_size|decoder_vocab_size|hidden_sizes?|intermediate_size|\w*_intermediate_size"
    r"|num_hidden_layers|num_attention_heads|num_key_value_heads|head_dim|n_embd|n_layers?"
    r"|n_heads?|dim|hidden_dim|embedding_size|d_model|d_kv|d_ff|num_layers|num_heads"
    r"|\w+_layers|\w+_attention_heads|\w*ffn_dim|word_embed_proj_dim|rotary_dim|image_size"
    r"|depths|embed_dim|decoder_hidden_size|max_source_positions|projection_dim"
    r"|text_config|vision_config|\w+_token_id)"
)

#: The one override that is not a size: T5Config() has no decoder_start_token_id, without
#: which T5 cannot shift its labels; every pretrained T5 config has 0.
NOT_A_SIZE = {("t5", "decoder_start_token_id")}


def test_the_new_list_is_45_distinct_networks():
    assert len(NEW) == 45
    assert len({net.name for net in NEW}) == 45
    assert len({net.model for net in NEW}) == 45
    assert all(net.config for net in NEW)


def test_new_networks_change_only_sizes():
    """What each entry gives; ``overrides`` adds only the special token ids a small
    vocabulary no longer holds (``token_fixes``)."""
    for net in NEW:
        for key in net.sizes:
            assert SIZE.fullmatch(key) or (net.name, key) in NOT_A_SIZE, (net.name, key)
            for word in ("drop", "attn_implementation", "use_cache", "act", "rope", "norm"):
                assert word not in key, (net.name, key)


def test_token_ids_outside_a_small_vocabulary_move_to_its_last_id():
    from transformers import GPT2Config

    _, net = find("new:gpt2")
    assert token_fixes(GPT2Config, net.sizes) == {"bos_token_id": 127, "eos_token_id": 127}
    assert set(overrides(net)) == set(net.sizes) | {"bos_token_id", "eos_token_id"}


def test_the_earlier_list_is_the_import_zoo_less_unsupported():
    from import_zoo import ZOO

    names = {net.name for net in EARLIER}
    assert len(EARLIER) == len(names) == 29
    assert set(ZOO) - {"unsupported"} <= names
    assert "unsupported" not in names


@pytest.mark.parametrize("name", ["new:gpt2", "new:vit"])
def test_a_new_network_builds_with_its_batch(name):
    _, net = find(name)
    module = build(net)
    inputs, target = batch(net, module)
    out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
    assert out.logits.shape[0] == 2
    if isinstance(inputs, dict):
        assert out.loss is not None and target is None


@pytest.mark.slow  # about 20 s
@pytest.mark.parametrize("name, fallback", [("llama", True), ("bert", False), ("vit", True)])
def test_new_networks_verify_exactly_through_the_benchmark(name, fallback):
    _, net = find(f"new:{name}")
    found = measure(net, fallback)
    assert found["status"] == "verified", found
    assert found["max_rel"] <= 1e-10
    assert found["opaque"] == 0 or fallback
