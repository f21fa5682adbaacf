"""OLMo and OLMo 2 (Hugging Face, tiny configs, no downloads): their norms compute in
float32 whatever the input's dtype, and ``verify`` compares them as what they compute.

``OlmoLayerNorm`` is ``F.layer_norm(x.to(torch.float32), ...).to(orig_dtype)`` and
``Olmo2RMSNorm`` casts its input to float32 before the norm. The importer traces in float32,
where both casts are no-ops, and a fixed ``.to(torch.float32)`` and the ``.to(orig_dtype)``
that follows the input are the same node of that graph: the text has ``layernorm`` and
``rmsnorm``, which in float64 compute in float64. The original, run in float64, rounds
through float32 there (its norm, forward and backward, in float32 arithmetic: rounding the
norm's input and output alone still differs by about 1e-7), so verify compared a float32
norm with a float64 one and found every value about 1e-7 apart. As for Llama's RMSNorm,
verify compares these classes (recognised by their source) as ``torch.nn.LayerNorm`` /
``torch.nn.RMSNorm``, which compute the same bit for bit in float32, tested here.
"""

from __future__ import annotations

import pytest
import torch

from unroller.analysis.verify import verify_module
from unroller.importer.api import import_network
from unroller.importer.hf_norms import (
    float64_twin,
    is_hf_rmsnorm,
    is_olmo2_rmsnorm,
    is_olmo_layernorm,
    swap_float64_twins,
)

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    use_cache=False,
)


def _network(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config_class, model_class = {
        "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    }[family]
    return model_class(config_class(**SIZES))


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, 64, (2, 8), generator=gen),
        "labels": torch.randint(0, 64, (2, 8), generator=gen),
    }


@pytest.mark.parametrize("family", ["olmo", "olmo2"])
def test_olmo_verifies_exactly(family):
    """Every value within 1e-10 in float64 (was about 3e-7 apart: the norms' float32 cast)."""
    report = verify_module(_network(family), _batch())
    assert report.ok, report.problems or report.table()
    assert any("cast" in note and "float32" in note for note in report.notes)


def test_olmo2_rmsnorm_is_one_rmsnorm_statement_without_the_fallback():
    """Olmo2RMSNorm (q_norm, k_norm, the layer norms) is ``rmsnorm``: the registry alone
    imports OLMo 2, with no opaque statement."""
    net = _network("olmo2")
    inputs, target = ["input_ids: i64[N, 8]"], "y: i64[N, 8]"
    text = import_network("olmo2", inputs, target, built=net, fallback=False).text
    assert text.count("= rmsnorm(") == 5 and "aten(" not in text  # 4 in the layer, the last


def test_olmo_norms_are_recognised_by_their_source():
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    assert is_olmo_layernorm(OlmoLayerNorm) and not is_olmo_layernorm(Olmo2RMSNorm)
    assert is_olmo2_rmsnorm(Olmo2RMSNorm) and is_hf_rmsnorm(Olmo2RMSNorm)
    assert not is_hf_rmsnorm(OlmoLayerNorm)  # a layer_norm the importer maps op by op
    copies = [("olmo3.modeling_olmo3", "Olmo3RMSNorm")]
    copies.append(("flex_olmo.modeling_flex_olmo", "FlexOlmoRMSNorm"))
    for module, name in copies:  # word for word Olmo2RMSNorm under another name
        found = pytest.importorskip(f"transformers.models.{module}")
        assert is_olmo2_rmsnorm(getattr(found, name))

    class OlmoLayerNorm2(torch.nn.Module):  # the name alone does not make it one
        def __init__(self, hidden_size):
            super().__init__()
            self.normalized_shape = (hidden_size,)

        def forward(self, x):
            return torch.nn.functional.layer_norm(x, self.normalized_shape, eps=1e-6)

    assert not is_olmo_layernorm(OlmoLayerNorm2)


def test_the_twins_equal_the_olmo_norms_in_float32_and_not_in_float64():
    """The twin computes what the norm computes in float32, bit for bit; in float64 the
    original's cast rounds, which is what verify compared before."""
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(0)
    rms = Olmo2RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        rms.weight.copy_(torch.randn(32))
    x = torch.randn(3, 7, 32) * 4 + 1
    for norm, kind in ((OlmoLayerNorm(32), torch.nn.LayerNorm), (rms, torch.nn.RMSNorm)):
        twin = float64_twin(norm)
        assert isinstance(twin, kind)
        assert torch.equal(norm(x), twin(x))
        wide = x.double()
        rel = (norm.double()(wide) - twin.double()(wide)).abs().max() / twin(wide).abs().max()
        assert rel > 1e-9  # float32 rounding: what the generated float64 code does not do
    assert float64_twin(rms).weight is rms.weight  # the same parameter: the key stays
    half = x.to(torch.bfloat16)  # OLMo 2's weight before its cast back: torch's order too
    assert torch.equal(rms.to(torch.bfloat16)(half), float64_twin(rms)(half))
    root = torch.nn.Sequential(OlmoLayerNorm(32), rms)
    assert swap_float64_twins(root) == ["0", "1"]
    assert isinstance(root[0], torch.nn.LayerNorm) and isinstance(root[1], torch.nn.RMSNorm)
