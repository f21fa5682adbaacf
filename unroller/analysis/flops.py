"""FLOPs of one forward op, from the graph's shapes.

Both the planner (the cost of recomputing a segment) and the estimate (an IPU step's
roofline) count them; here, below both, the planner need not import the estimate, which
resolves configs the planner makes.
"""

from __future__ import annotations

import math

from unroller.compiler.graph import Node

#: a weighted op whose output elements each reduce fewer inputs than this (a depthwise 3 x 3
#: convolution: 9) is "thin": memory-bound kernels that run far below the machine's dense
#: FLOP rate, which the step time model charges at a rate of their own
THIN_REDUCTION = 64


def is_thin(node: Node) -> bool:
    """Whether ``node`` is a weighted op with fewer than ``THIN_REDUCTION`` multiply-adds
    per output element (see ``THIN_REDUCTION``)."""
    weight = next((p for p in node.params if p.name == "weight" and p.present), None)
    if node.op.weighted is None or weight is None:
        return False
    return math.prod(weight.shape[1:]) < THIN_REDUCTION


def forward_flops(node: Node, batch: int) -> float:
    """FLOPs of one forward op: 2 x multiply-adds for convolutions, linear layers, matrix
    products and attention; one per output element for the rest."""
    out = node.output.type.numel(batch)
    name = node.op.name
    weight = next((p for p in node.params if p.name == "weight" and p.present), None)
    if node.op.weighted is not None and weight is not None:
        # registry ``weighted``: each output element (a transposed convolution's: each input
        # element) meets the weight's per-output elements
        per_element = math.prod(weight.shape[1:])
        if node.op.weighted == "input":
            return 2.0 * node.inputs[0].type.numel(batch) * per_element
        return 2.0 * out * per_element
    if name == "matmul" and len(node.inputs) == 2:
        inner = node.inputs[0].type.shape[-1]
        return 2.0 * out * (inner if isinstance(inner, int) else 1)
    if name in ("multihead_attention", "scaled_dot_product_attention"):
        x = node.inputs[0].type
        length, embed = x.shape[-2], x.shape[-1]
        n = x.numel(batch) // (length * embed)
        projections = 8.0 * n * length * embed * embed if name == "multihead_attention" else 0
        return projections + 4.0 * n * length * length * embed
    return float(out)
