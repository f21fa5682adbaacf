"""Seeded inputs and targets of a graph's declared shapes, with values its consumers accept.

One step of a generated module needs a batch: verify compares the generated step with the
original on one, the planner's probe step measures the tensors kept for backward on one,
and the tests run models on them. Integer inputs must stay below what reads them (an
embedding's rows, a loss's classes, a padding mask's 0 and 1), which the graph says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unroller.compiler.dtypes import is_float, torch_dtype
from unroller.compiler.graph import Graph, Value

if TYPE_CHECKING:
    import torch

#: Ops an integer input may flow through on its way to what bounds it (embedding, a loss).
PASS_THROUGH = ("permute", "transpose", "reshape", "flatten", "select", "slice", "expand")


def make_inputs(graph: Graph, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Seeded tensors of the declared shapes, in declaration order (inputs and targets).

    Float: standard normal in float64, except targets of binary cross-entropy, uniform in
    [0, 1). Integer: uniform in [0, bound) with the bound what consumes them allows
    (``num_embeddings``, the class count of a cross-entropy or nll_loss), else [0, 2); a
    padding mask (read by ``padding_mask``) attends to every row's first token."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for value in graph.inputs:
        shape = (batch_size, *value.type.shape[1:])
        if is_float(value.type.dtype):
            if feeds_bce_target(value):
                tensor = torch.rand(shape, generator=generator, dtype=torch.float64)
            else:
                tensor = torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            high = integer_bound(value) or 2
            dtype = torch_dtype(value.type.dtype)
            tensor = torch.randint(0, high, shape, generator=generator, dtype=dtype)
            if feeds_padding_mask(value) and len(shape) == 2:
                # a padding mask: 0 and 1, the first token of every row attended, so that no
                # query row is all padding, causal or not (the original may give it NaN);
                # True / nonzero pads where the mask is inverted (key_padding_mask)
                tensor[:, 0] = 0 if feeds_padding_mask(value, inverted=True) else 1
        tensors.append(tensor)
    return tensors


def integer_bound(value: Value) -> int | None:
    """The exclusive upper bound of valid integers for ``value`` (the smallest over its
    consumers), following shape ops; None when nothing bounds it."""
    bounds = []
    for node, index in value.consumers:
        op = node.op.name
        if op == "embedding":
            bounds.append(int(node.args["num_embeddings"]))
        elif op == "padding_mask":  # 1 attends, 0 pads
            bounds.append(2)
        elif node.op.target == "classes" and index == 1:  # registry ``target``
            bounds.append(int(node.inputs[0].type.shape[1]))
        elif op in PASS_THROUGH:
            found = integer_bound(node.output)
            if found:
                bounds.append(found)
    return min(bounds) if bounds else None


def feeds_padding_mask(value: Value, inverted: bool | None = None) -> bool:
    """Whether ``value`` reaches a ``padding_mask`` (one with ``invert`` as asked, if asked)."""
    for node, _ in value.consumers:
        if node.op.name == "padding_mask":
            if inverted is None or bool(node.args.get("invert")) == inverted:
                return True
        elif node.op.name in PASS_THROUGH and feeds_padding_mask(node.output, inverted):
            return True
    return False


def feeds_bce_target(value: Value) -> bool:
    for node, index in value.consumers:
        if node.op.target == "probabilities" and index == 1:
            return True
        if node.op.name in PASS_THROUGH and feeds_bce_target(node.output):
            return True
    return False
