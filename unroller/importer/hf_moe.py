"""Hugging Face's sparse mixture-of-experts blocks, as one ``moe`` statement.

Mixtral's block (router ``MixtralTopKRouter``, experts ``MixtralExperts``) and Qwen2-MoE's
(its router's softmax in float32, an optional renormalisation, plus a sigmoid-gated shared
expert) route each token to its top-k experts with data-dependent gathers and scatters
(``sort``, ``histc``, ``index_put_`` in a traced step), which no statement-by-statement
mapping can keep exact and which merge the tokens of every sample; the whole block is one
registry operator, ``moe`` (``unroller/runtime/moe.py``). A class is recognised by what it
computes, as ``hf_norms`` recognises norms: its methods are Mixtral's or Qwen2-MoE's
statement for statement (its own class name aside), so the many "Copied from" blocks
(MiniMax's, Qwen3-Next's, ...) import too, and a block that only looks alike never does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from unroller.importer.aten_ops import Refuse
from unroller.importer.hf_norms import _copy_of

_MIXTRAL = "mixtral.modeling_mixtral"
_QWEN2_MOE = "qwen2_moe.modeling_qwen2_moe"

#: family -> (its modeling module, its block class, its router class)
_FAMILIES = {
    "mixtral": (_MIXTRAL, "MixtralSparseMoeBlock", "MixtralTopKRouter"),
    "qwen2_moe": (_QWEN2_MOE, "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter"),
}


@functools.cache
def _kind(cls: type, part: int) -> str | None:
    """The family whose block (``part`` 1) or router (``part`` 2) ``cls`` is a copy of."""
    for kind, classes in _FAMILIES.items():
        if _copy_of(cls, classes[0], classes[part], ("forward", "__init__")):
            return kind
    return None


def _block_kind(cls: type) -> str | None:
    return _kind(cls, 1)


def _router_kind(cls: type) -> str | None:
    return _kind(cls, 2)


@functools.cache
def _is_swiglu_experts(cls: type) -> bool:
    return _copy_of(cls, _MIXTRAL, "MixtralExperts", ("forward",))


@functools.cache
def _is_swiglu_mlp(cls: type) -> bool:
    return _copy_of(cls, _QWEN2_MOE, "Qwen2MoeMLP", ("forward", "__init__"))


def is_hf_moe_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a block ``moe_kwargs`` maps (or refuses with its reason)."""
    return _block_kind(type(module)) is not None


def _silu(act: Any) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (torch.nn.SiLU, SiLUActivation))


def _experts_problem(experts: Any) -> str | None:
    from transformers.integrations import moe as hf_moe

    if not _is_swiglu_experts(type(experts)):
        return f"its experts ({type(experts).__name__}) are not Mixtral's"
    flags = {
        "has_gate": True,
        "has_bias": False,
        "is_transposed": False,
        "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    for flag, wanted in flags.items():
        if getattr(experts, flag, wanted) != wanted:
            return f"its experts have {flag}={not wanted}"
    if getattr(type(experts), "_apply_gate", None) is not hf_moe._default_apply_gate:
        return "its experts gate their MLPs another way"
    if not _silu(experts.act_fn):
        return f"its experts' activation is {type(experts.act_fn).__name__}, not SiLU"
    return None


def moe_kwargs(module: torch.nn.Module) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The ``moe`` statement's keywords for the block and the parameters it holds (their
    keys under the block), or Refuse with what differs from what ``moe`` computes."""
    kind = _block_kind(type(module))
    router, experts = module.gate, module.experts
    if _router_kind(type(router)) != kind:
        raise Refuse(f"its router ({type(router).__name__}) is not its family's")
    problem = _experts_problem(experts)
    if problem:
        raise Refuse(problem)
    if kind == "mixtral" and module.training and module.jitter_noise > 0:
        raise Refuse(f"router jitter noise {module.jitter_noise} in training (random draws)")
    num_experts, inter2, _ = experts.gate_up_proj.shape
    kwargs: dict[str, Any] = {
        "num_experts": int(num_experts),
        "top_k": int(router.top_k),
        "intermediate": int(inter2) // 2,
    }
    params = ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
    if kind == "qwen2_moe":
        if not router.norm_topk_prob:
            kwargs["norm_topk"] = False
        kwargs["router_float32"] = True
        shared = module.shared_expert
        if not _is_swiglu_mlp(type(shared)) or not _silu(shared.act_fn):
            raise Refuse(f"its shared expert ({type(shared).__name__}) is not a SwiGLU MLP")
        kwargs["shared_intermediate"] = int(shared.gate_proj.weight.shape[0])
        params += (
            "shared_expert.gate_proj.weight",
            "shared_expert.up_proj.weight",
            "shared_expert.down_proj.weight",
            "shared_expert_gate.weight",
        )
    return kwargs, params


def eager_experts(root: torch.nn.Module) -> list[str]:
    """Switch the experts of ``root`` (a float64 copy verify steps) to ``transformers``'
    eager implementation where another is set (its default ``grouped_mm`` takes no
    float64): the same per-token arithmetic, summed in another order. The implementations
    switched, for verify's note."""
    switched = []
    for module in root.modules():
        config = getattr(module, "config", None)
        current = getattr(config, "_experts_implementation", None)
        if current not in (None, "eager") and hasattr(module, "gate_up_proj"):
            config._experts_implementation = "eager"
            switched.append(current)
    return sorted(set(switched))


@contextlib.contextmanager
def traceable_experts(root: torch.nn.Module) -> Iterator[None]:
    """While the importer captures ``root``: experts left to their eager loop (a block built
    on its own, outside a ``PreTrainedModel``, has no implementation set) run
    ``grouped_mm``, which torch.export traces (the loop asks for a data-dependent count);
    the block is mapped whole (``moe``), so what the trace holds inside it is not read.
    Restored after."""
    changed = []
    for module in root.modules():
        config = getattr(module, "config", None)
        if (
            hasattr(module, "gate_up_proj")
            and hasattr(config, "_experts_implementation")
            and config._experts_implementation in (None, "eager")
            and _is_swiglu_experts(type(module))
        ):
            changed.append((config, config._experts_implementation))
            config._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        for config, before in reversed(changed):
            config._experts_implementation = before
