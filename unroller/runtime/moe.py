"""The ``moe`` kernels (gpu platform): a sparse mixture of experts, as Mixtral's block.

Each token (a row of x [N, ..., E]) is routed on its own: router logits x W_r^T, softmax over
the experts (in float32 when ``router_float32``, as Qwen2-MoE's ``dtype=torch.float``;
Mixtral's ``router_logits.float()`` is a cast, the identity in the float32 step the
importer reads, so its text computes in the model's dtype), the
top_k experts with their probabilities as weights (renormalised to sum 1 when
``norm_topk``); each chosen expert's SwiGLU MLP, silu(x W_g^T) * (x W_u^T) W_d^T, scaled by
its weight and summed, experts in index order, as Hugging Face's eager loop adds them
(``index_add_`` per expert). With a shared expert (Qwen2-MoE's, ``shared_intermediate``
> 0: the layer then holds it), sigmoid(x w_s^T) times a shared
SwiGLU MLP is added. The parameters are the block's, under its state-dict keys:
``gate.weight`` [X, E], ``experts.gate_up_proj`` [X, 2I, E] (gate rows first),
``experts.down_proj`` [X, E, I], and ``shared_expert.{gate,up,down}_proj.weight``,
``shared_expert_gate.weight`` [1, E].

The forward keeps x and the chosen experts' indices [N, ..., k] (integers, kept exact): the
backward routes with those, whatever a compressed x gives back, and remakes the router's
probabilities and each expert's hidden activations from x. The experts' rows are gathered
and scattered with dynamic sizes, which PopTorch does not run: the ipu platform refuses the
operator (``unroller.runtime.ipu.unsupported``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from unroller.runtime import conventions
from unroller.runtime.common import _fit


def _router(rows: Tensor, layer: Any, router_float32: bool) -> tuple[Tensor, Tensor]:
    """(logits [T, X], probabilities [T, X]; float32 when ``router_float32``)."""
    logits = F.linear(rows, layer.gate.weight)
    if router_float32:
        return logits, torch.softmax(logits, dim=-1, dtype=torch.float32)
    return logits, torch.softmax(logits, dim=-1)


def _weights(probs: Tensor, index: Tensor, norm_topk: bool, dtype: torch.dtype) -> Tensor:
    """The chosen experts' weights [T, k] in the model's dtype."""
    top = probs.gather(-1, index)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


def _expert_rows(index: Tensor, expert: int) -> tuple[Tensor, Tensor]:
    """(top-k positions, token rows) routed to ``expert``, in Hugging Face's order."""
    top_k_pos, token_idx = torch.where((index == expert).t())
    return top_k_pos, token_idx


def _swiglu(rows: Tensor, gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(gate, up, output) of one SwiGLU MLP on ``rows``; gate_up [2I, E] (gate rows first)."""
    gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
    return gate, up, F.linear(F.silu(gate) * up, down)


@conventions.implements
def moe(x, layer, *, top_k, norm_topk, router_float32):
    """The block's output [N, ..., E] and the chosen experts' indices [N, ..., k]."""
    rows = x.reshape(-1, x.shape[-1])
    _, probs = _router(rows, layer, router_float32)
    index = probs.topk(top_k, dim=-1).indices
    weights = _weights(probs, index, norm_topk, rows.dtype)
    out = torch.zeros_like(rows)
    experts = layer.experts
    for expert in range(experts.gate_up_proj.shape[0]):
        top_k_pos, token_idx = _expert_rows(index, expert)
        if token_idx.numel() == 0:
            continue
        _, _, y = _swiglu(rows[token_idx], experts.gate_up_proj[expert], experts.down_proj[expert])
        out.index_add_(0, token_idx, y * weights[token_idx, top_k_pos, None])
    if hasattr(layer, "shared_expert"):
        out = out + _shared_forward(rows, layer)
    return out.reshape(x.shape), index.reshape(*x.shape[:-1], top_k)


def _shared_parts(rows: Tensor, layer: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The shared expert's (gate, up, MLP output, sigmoid gate) on ``rows``."""
    mlp = layer.shared_expert
    gate = F.linear(rows, mlp.gate_proj.weight)
    up = F.linear(rows, mlp.up_proj.weight)
    mlp_out = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    return gate, up, mlp_out, torch.sigmoid(F.linear(rows, layer.shared_expert_gate.weight))


def _shared_forward(rows: Tensor, layer: Any) -> Tensor:
    _, _, mlp_out, scale = _shared_parts(rows, layer)
    return scale * mlp_out


def _swiglu_grads(
    g_out: Tensor, gate: Tensor, up: Tensor, down: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One SwiGLU MLP's backward from its output's gradient: (gate's and up's
    pre-activation gradients, down's weight gradient), silu's derivative as aten's."""
    g_down = g_out.t().matmul(F.silu(gate) * up)
    g_hidden = g_out.matmul(down)
    g_gate = torch.ops.aten.silu_backward(g_hidden * up, gate)
    return g_gate, g_hidden * F.silu(gate), g_down


@conventions.implements
def moe_backward(g, x, layer, index, *, top_k, norm_topk, router_float32, needs):
    """Gradients of x and of the parameters, in the registry's order (gate.weight,
    experts.gate_up_proj, experts.down_proj, then the shared expert's four)."""
    rows = x.reshape(-1, x.shape[-1])
    g = g.reshape(-1, g.shape[-1])
    index = index.reshape(-1, top_k)
    experts = layer.experts
    logits, probs = _router(rows, layer, router_float32)
    weights = _weights(probs, index, norm_topk, rows.dtype)
    gx = torch.zeros_like(rows)
    g_weights = torch.zeros_like(weights)
    g_gate_up = torch.zeros_like(experts.gate_up_proj)
    g_down = torch.zeros_like(experts.down_proj)
    for expert in range(experts.gate_up_proj.shape[0]):
        top_k_pos, token_idx = _expert_rows(index, expert)
        if token_idx.numel() == 0:
            continue
        part = rows[token_idx]
        gate_up, down = experts.gate_up_proj[expert], experts.down_proj[expert]
        gate, up, y = _swiglu(part, gate_up, down)
        g_rows = g[token_idx]
        g_weights[token_idx, top_k_pos] = (g_rows * y).sum(dim=-1)
        g_gate, g_up, g_down[expert] = _swiglu_grads(
            g_rows * weights[token_idx, top_k_pos, None], gate, up, down
        )
        g_pre = torch.cat([g_gate, g_up], dim=-1)
        g_gate_up[expert] = g_pre.t().matmul(part)
        gx.index_add_(0, token_idx, g_pre.matmul(gate_up))
    g_logits = _router_backward(g_weights, probs, index, norm_topk, logits.dtype)
    g_router = g_logits.t().matmul(rows)
    gx = gx + g_logits.matmul(layer.gate.weight)
    grads: list[Tensor | None] = [None, g_router, g_gate_up, g_down]
    if hasattr(layer, "shared_expert"):
        gx_shared, *shared_grads = _shared_backward(g, rows, layer)
        gx = gx + gx_shared
        grads += shared_grads
    grads[0] = gx.reshape(x.shape)
    return _fit(grads, needs)


def _router_backward(
    g_weights: Tensor, probs: Tensor, index: Tensor, norm_topk: bool, dtype: torch.dtype
) -> Tensor:
    """The router logits' gradient [T, X] from the chosen weights' [T, k]: through the
    cast to the model's dtype, the renormalisation, the top-k selection and the softmax,
    each as autograd takes it (in the router's precision)."""
    g_top = g_weights.to(probs.dtype)
    if norm_topk:
        top = probs.gather(-1, index)
        total = top.sum(dim=-1, keepdim=True)
        # autograd's div backward, operation for operation (the router may be float32)
        g_total = (-g_top * ((top / total) / total)).sum(dim=-1, keepdim=True)
        g_top = g_top / total + g_total
    g_probs = torch.zeros_like(probs).scatter(-1, index, g_top)
    return torch.ops.aten._softmax_backward_data(g_probs, probs, -1, probs.dtype).to(dtype)


def _shared_backward(g: Tensor, rows: Tensor, layer: Any) -> list[Tensor]:
    """(x's gradient, then gate_proj, up_proj, down_proj and shared_expert_gate weights')."""
    mlp = layer.shared_expert
    gate, up, mlp_out, scale = _shared_parts(rows, layer)
    g_scale = (g * mlp_out).sum(dim=-1, keepdim=True)
    g_scale_pre = torch.ops.aten.sigmoid_backward(g_scale, scale)
    g_gate, g_up, g_down = _swiglu_grads(g * scale, gate, up, mlp.down_proj.weight)
    gx = (
        g_gate.matmul(mlp.gate_proj.weight)
        + g_up.matmul(mlp.up_proj.weight)
        + g_scale_pre.matmul(layer.shared_expert_gate.weight)
    )
    return [
        gx,
        g_gate.t().matmul(rows),
        g_up.t().matmul(rows),
        g_down,
        g_scale_pre.t().matmul(rows),
    ]


def moe_layer(  # unroller-lint: host-only (runs when the model is built)
    in_features: int, num_experts: int, intermediate: int, shared_intermediate: int = 0
) -> torch.nn.Module:
    """The module holding a ``moe`` statement's tensors under the block's state-dict keys
    (see the module docstring), initialised as ``transformers`` initialises Mixtral's:
    normal(0, 0.02)."""
    return _Moe(in_features, num_experts, intermediate, shared_intermediate)


def _normal(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.nn.init.normal_(torch.empty(*shape), 0.0, 0.02))


class _Moe(torch.nn.Module):
    """moe's parameters; the kernels compute, never ``forward``."""

    def __init__(self, hidden: int, experts: int, inter: int, shared: int) -> None:
        super().__init__()
        self.gate = torch.nn.Module()
        self.gate.weight = _normal(experts, hidden)
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj = _normal(experts, 2 * inter, hidden)
        self.experts.down_proj = _normal(experts, hidden, inter)
        if shared:
            self.shared_expert = torch.nn.Module()
            self.shared_expert.gate_proj = torch.nn.Linear(hidden, shared, bias=False)
            self.shared_expert.up_proj = torch.nn.Linear(hidden, shared, bias=False)
            self.shared_expert.down_proj = torch.nn.Linear(shared, hidden, bias=False)
            self.shared_expert_gate = torch.nn.Linear(hidden, 1, bias=False)
