"""Hugging Face's sparse mixture-of-experts blocks import as one ``moe`` statement each,
exact against the block (float64, 1e-10), registry only: Mixtral's (top-k renormalised) and
Qwen2-MoE's (float32 router softmax, shared expert), recognised by their source."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from unroller.analysis.verify import verify_module
from unroller.api import graph_from_text
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

SPEC = "x: f32[N, 6, 8]"


def _block(family: str, **extra) -> nn.Module:
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(
            hidden_size=8, intermediate_size=5, num_local_experts=4, num_experts_per_tok=2,
            **extra,
        )  # fmt: skip
        return MixtralSparseMoeBlock(config)
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(
        hidden_size=8, moe_intermediate_size=5, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=7, **extra,
    )  # fmt: skip
    return Qwen2MoeSparseMoeBlock(config)


class Net(nn.Module):
    """A projection, the block, a head: x's gradient flows through the block."""

    def __init__(self, family: str, **extra) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.moe = _block(family, **extra)
        with torch.no_grad():  # wide enough that the tokens spread over the experts
            for p in self.moe.parameters():
                p.normal_(0.0, 0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


CASES = {
    "mixtral": ({}, "moe = moe(inp, num_experts=4, top_k=2, intermediate=5)"),
    "qwen2_moe": (
        {},
        "moe = moe(inp, num_experts=4, top_k=2, intermediate=5, norm_topk=false, "
        "router_float32=true, shared_intermediate=7)",
    ),
    "qwen2_moe-norm": (
        {"norm_topk_prob": True},
        "moe = moe(inp, num_experts=4, top_k=2, intermediate=5, router_float32=true, "
        "shared_intermediate=7)",
    ),
}


def _net(name: str) -> Net:
    extra, _ = CASES[name]
    return Net(name.partition("-")[0], **extra)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_block_is_one_moe_statement(name):
    text = import_network("net", [SPEC], built=_net(name), fallback=False).text
    assert CASES[name][1] in text, text
    assert "aten(" not in text and "topk(" not in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_block_verifies_exactly(name):
    net = _net(name)
    implementation = net.moe.experts.config._experts_implementation
    report = verify_module(net, (torch.randn(4, 6, 8),), torch.randn(4, 6, 3), loss="mse_loss")
    assert report.ok, report.problems or report.table()
    assert net.moe.experts.config._experts_implementation == implementation  # left as it was
    if implementation not in (None, "eager"):
        assert any("eager implementation" in note for note in report.notes), report.notes


def test_every_expert_is_used_so_every_expert_gradient_is_checked():
    """The routing is not degenerate: over the verify batch every expert gets tokens."""
    net = _net("mixtral").double()
    x = net.inp(torch.randn(4, 6, 8, dtype=torch.float64)).reshape(-1, 8)
    chosen = net.moe.gate(x)[2]
    assert set(chosen.flatten().tolist()) == {0, 1, 2, 3}


def test_router_jitter_in_training_is_refused():
    net = _net("mixtral")
    net.moe.jitter_noise = 0.1
    with pytest.raises(ImportFailure, match="jitter noise 0.1"):
        import_network("net", [SPEC], built=net, fallback=False)


def test_the_ipu_platform_refuses_it_with_the_reason():
    text = import_network("net", [SPEC], built=_net("mixtral"), fallback=False).text
    graph = graph_from_text(text, "net.txt")
    from unroller.runtime import ipu

    node = next(n for n in graph.nodes if n.op.name == "moe")
    assert re.search("data-dependent sizes", ipu.unsupported("moe", node.args))


def test_verify_steps_grouped_mm_experts_eagerly_and_says_so():
    """A block inside a PreTrainedModel runs grouped_mm, which takes no float64: verify's
    copy runs the eager experts (noted), the caller's module keeps its implementation."""
    net = _net("mixtral")
    net.moe.experts.config._experts_implementation = "grouped_mm"
    report = verify_module(net, (torch.randn(4, 6, 8),), torch.randn(4, 6, 3), loss="mse_loss")
    assert report.ok, report.problems or report.table()
    assert any("eager implementation, not grouped_mm" in n for n in report.notes), report.notes
    assert net.moe.experts.config._experts_implementation == "grouped_mm"


def test_capture_traces_eager_experts_as_grouped_mm_and_restores_them():
    from unroller.importer.hf_moe import traceable_experts

    net = _net("mixtral")
    config = net.moe.experts.config
    before = config._experts_implementation
    with traceable_experts(net):
        assert config._experts_implementation == "grouped_mm"
    assert config._experts_implementation == before


def test_a_keyword_batch_is_refused_when_the_models_loss_adds_the_router_loss():
    """Mixtral with output_router_logits=True adds the load-balancing loss to its own: the
    step, which computes the cross-entropy alone, says so rather than train another loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from unroller.importer.hf_batch import batch_plan

    config = MixtralConfig(
        vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        output_router_logits=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="output_router_logits"):
        batch_plan(MixtralForCausalLM(config))
    config.output_router_logits = False
    assert batch_plan(MixtralForCausalLM(config)).kind == "causal"
