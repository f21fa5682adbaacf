"""``unroll import`` of the decoder-LLM family: Hugging Face Llama, Mistral and Qwen2 built
from tiny configs with their default settings (no downloads).

What makes them importable: their RMSNorm class, recognised by its source
(``unroller.importer.hf_norms``), is one ``rmsnorm`` statement; rotary position embeddings
(``unroller.importer.rotary``) are one ``rotary`` statement whose tables equal the traced
ones bit for bit; grouped-query attention, whether ``repeat_kv`` (expand and reshape) or SDPA's
``enable_gqa``, is one ``scaled_dot_product_attention(..., enable_gqa=true)`` on the key
and value heads before repeating (the step keeps those); the SiLU-gated MLP and ``neg`` map op by op. Each verifies exactly (float64,
1e-10) against the original, whose RMSNorms are compared as ``torch.nn.RMSNorm`` (they cast
to float32 inside; the two agree bit for bit in float32, tested here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import imported_text

from unroller.analysis.verify import verify_text
from unroller.api import generate_from_text
from unroller.compiler.options import Options
from unroller.importer.api import import_network
from unroller.importer.hf_norms import float64_twin, is_llama_rmsnorm, swap_float64_twins
from unroller.importer.model import ImportFailure

transformers = pytest.importorskip("transformers")

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")
SPEC = f"{ZOO}:hf_llama"
INPUTS = ["ids: i64[N, 16]"]
TARGET = "y: i64[N, 16]"


def imported(**kwargs):
    """The text of hf_llama under ``kwargs`` (the zoo's defaults spelled out, so the same
    model is imported once per process: ``imported_text``)."""
    return imported_text(
        SPEC, INPUTS, TARGET, kwargs={"family": "llama", "use_cache": False} | kwargs
    )


@pytest.mark.parametrize("family,layers", [("llama", 2), ("mistral", 1), ("qwen2", 1)])
def test_decoder_family_imports_and_verifies_exactly(family, layers):
    """Llama with its two layers one block; Mistral and Qwen2 (the same layer, their own
    classes and config defaults) with one layer, which checks the same statements."""
    kwargs = {"family": family} if layers == 2 else {"family": family, "layers": layers}
    text = imported(**kwargs)
    assert text.count("= rmsnorm(") == 3  # two in the layer block, the final norm
    assert text.count("= rotary(") == 2  # q and k, in the layer block
    assert "self_attn.rotary = rotary(" in text and "self_attn.rotary_1 = rotary(" in text
    assert "= silu(" in text and "scaled_dot_product_attention(" in text
    report = verify_text(text, SPEC, kwargs)
    assert report.ok, report.problems or report.table()
    assert any("Hugging Face RMSNorm" in note for note in report.notes)


def test_repeat_kv_is_undone_into_enable_gqa():
    """Hugging Face repeats k and v per query head (``repeat_kv``) when it passes a mask,
    as under export: the attention reads the two heads before the repeat, with enable_gqa,
    and the repeat's expand and reshape are not statements (the step never keeps a copy
    of k and v per query head)."""
    text = imported()
    line = next(x for x in text.splitlines() if "= scaled_dot_product_attention(" in x)
    assert "enable_gqa=true" in line, line
    assert "expand(" not in text
    keys = line.split("(", 1)[1].split(",")[1].strip()
    assert f"{keys} = rotary(" in text  # the key after rotary, [N, 2, 16, 8]: not repeated


def test_grouped_query_attention_through_sdpa_enable_gqa(monkeypatch):
    """transformers passes enable_gqa to SDPA where it can (forced here): k and v keep their
    two heads for four query heads."""
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    text = import_network(SPEC, INPUTS, TARGET).text  # not the cached text: the variable matters
    assert "enable_gqa=true" in text and "expand(" not in text
    report = verify_text(text, SPEC, {})
    assert report.ok, report.problems or report.table()


def test_a_rope_theta_from_the_config_verifies_exactly():
    rope = {"rope_type": "default", "rope_theta": 12345.0}  # not one of the usual thetas
    kwargs = {"family": "qwen2", "rope_parameters": rope, "layers": 1}  # one layer reads it
    text = imported(**kwargs)
    assert text.count("rotary(") == 2 and "theta=12345.0" in text
    report = verify_text(text, SPEC, kwargs)
    assert report.ok, report.problems or report.table()


def test_scaled_rope_is_refused_with_the_reason():
    """Linear rope scaling divides the frequencies: the tables are not the default rope's,
    and the import names that, not a constant tensor."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ImportFailure, match="not the default rope"):
        imported(rope_parameters=rope, layers=1)


def test_quant_generation_of_an_imported_llama_runs_a_step():
    text = imported()
    source = generate_from_text(text, Options(scheme="quant"), label="llama")
    namespace: dict = {}
    exec(compile(source, "llama_quant.py", "exec"), namespace)  # noqa: S102 - our own output
    model = namespace["Model"]()
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, torch.randint(0, 64, (2, 16)))
    assert torch.isfinite(loss)
    report = model.stash_report()
    assert any("Quant" in row["compressor"] for row in report["rows"])
    kept = {row["tensor"].rsplit(".", 1)[-1] for row in report["rows"]}
    assert "transpose" not in kept and "transpose_1" not in kept  # rotary keeps no input


def test_rmsnorm_classes_are_recognised_by_their_source():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    assert is_llama_rmsnorm(LlamaRMSNorm) and is_llama_rmsnorm(MistralRMSNorm)
    assert is_llama_rmsnorm(Qwen2RMSNorm)
    assert not is_llama_rmsnorm(GemmaRMSNorm)  # 1 + weight: another formula

    class LlamaRMSNorm2(torch.nn.Module):  # the name alone does not make it one
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x):
            return x * self.weight

    assert not is_llama_rmsnorm(LlamaRMSNorm2)
    assert float64_twin(torch.nn.LayerNorm(4)) is None


def test_the_float64_twin_equals_hugging_face_rmsnorm_in_float32():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    twin = float64_twin(norm)
    assert twin.weight is norm.weight  # the same parameter: the state dict keeps its key
    x = torch.randn(3, 7, 32) * 4
    assert torch.equal(norm(x), twin(x))
    root = torch.nn.Sequential(norm)
    assert swap_float64_twins(root) == ["0"] and isinstance(root[0], torch.nn.RMSNorm)


def test_use_cache_is_captured_without_the_cache():
    """A config with use_cache=True (the default of every decoder): the key/value cache is
    an output only generation reads, so the capture runs with it off; the text is the one
    of use_cache=False, and the config is left as it was."""
    text = imported(use_cache=True)
    assert text == imported(use_cache=False)
    report = verify_text(text, SPEC, {"use_cache": True})
    assert report.ok, report.problems or report.table()


@pytest.mark.parametrize("factory", ["hf_gpt_neox", "hf_phi"])
def test_partial_rotary_decoders_import_and_verify_exactly(factory):
    """GPT-NeoX and Phi turn only part of each head (the rest passes through a ``concat``);
    GPT-NeoX takes q, k, v apart with ``chunk``."""
    spec = f"{ZOO}:{factory}"
    text = import_network(spec, INPUTS, TARGET).text
    assert text.count("= rotary(") == 2 and "concat(" in text
    report = verify_text(text, spec, {})
    assert report.ok, report.problems or report.table()


def test_gemma_imports_and_verifies_exactly():
    """Gemma's RMSNorm (times 1 + weight, recognised by its source) is ``rmsnorm`` with
    ``weight_offset=1.0``, and its embedding's constant scale is ``scale``."""
    spec = f"{ZOO}:hf_gemma"
    text = import_network(spec, INPUTS, TARGET).text
    assert text.count("weight_offset=1.0") == 3 and "= scale(model.embed_tokens, factor=" in text
    report = verify_text(text, spec, {})
    assert report.ok, report.problems or report.table()


def test_the_gemma_twin_equals_gemma_rmsnorm_in_float32():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from unroller.importer.hf_norms import is_gemma_rmsnorm

    assert is_gemma_rmsnorm(GemmaRMSNorm) and not is_llama_rmsnorm(GemmaRMSNorm)
    torch.manual_seed(0)
    norm = GemmaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    twin = float64_twin(norm)
    x = torch.randn(3, 5, 32) * 3
    assert twin.weight is norm.weight and torch.equal(norm(x), twin(x))
