"""Rotary position embeddings in a traced graph, as one ``rotary`` statement.

Hugging Face's Llama family turns q and k with ``apply_rotary_pos_emb``: x * cos +
rotate_half(x) * sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). Traced, that is an
add of two products whose other factors, cos and sin, are tables computed from sizes and
the rotary module's constants: tensors no statement of the language holds. The statement
``rotary(x, theta=..., scaling=...)`` makes the same tables itself
(``unroller.runtime.positions``), so the pattern maps to it when the traced tables are,
bit for bit, the ones it makes for some theta and scaling: the candidates come from the
model's config (``rope_theta``, ``rope_parameters``) and its rotary modules'
``attention_scaling``. Other tables (scaled ropes: linear, dynamic, yarn, llama3) do not
match, and the import says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from unroller.runtime.positions import rotary_tables

#: thetas tried besides the config's: Llama 1-2 / Mistral, Llama 3, Qwen2
DEFAULT_THETAS = (10000.0, 500000.0, 1000000.0)


@dataclass
class Rotary:
    """One matched ``x * cos + rotate_half(x) * sin``: its input, its tables' constants
    (None, with ``why``, when the structure matched but no tables did) and every node it
    replaces besides the final add."""

    x: fx.Node
    theta: float | None
    scaling: float
    nodes: set[fx.Node] = field(default_factory=set)
    why: str = ""


def candidates(module: torch.nn.Module) -> tuple[list[float], list[float]]:
    """(thetas, scalings) to try: the config's and the rotary modules' first, then the
    common defaults."""
    thetas: list[float] = []
    scalings: list[float] = []
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None:
            found = [getattr(config, "rope_theta", None)]
            params = getattr(config, "rope_parameters", None)
            if isinstance(params, dict):
                found.append(params.get("rope_theta"))
                found += [p.get("rope_theta") for p in params.values() if isinstance(p, dict)]
            thetas += [float(t) for t in found if isinstance(t, (int, float))]
        scale = getattr(sub, "attention_scaling", None)
        if isinstance(scale, (int, float)):
            scalings.append(float(scale))
    thetas += DEFAULT_THETAS
    scalings.append(1.0)
    return list(dict.fromkeys(thetas)), list(dict.fromkeys(scalings))


def _is(node, target_name: Callable, *names: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and target_name(node) in names


def _last_dim(node: fx.Node, dim) -> bool:
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor) and isinstance(dim, int) and dim % val.dim() == val.dim() - 1
    )


def _half_slice(node, target_name: Callable, x: fx.Node, upper: bool) -> bool:
    """``x[..., D/2:]`` (upper) or ``x[..., :D/2]``."""
    if not _is(node, target_name, "aten.slice.Tensor") or node.args[0] is not x:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end = args[1], args[2], args[3]
    size = x.meta["val"].shape[-1]
    half = size // 2
    if not _last_dim(x, dim if dim is not None else 0):
        return False
    start = 0 if start is None else start
    if upper:
        return start == half and (end is None or end >= size)
    return start == 0 and end == half


def _rotated(node, target_name: Callable) -> tuple[fx.Node, set[fx.Node]] | None:
    """(x, nodes) when ``node`` is cat(-x[..., D/2:], x[..., :D/2]) on the last dim."""
    if not _is(node, target_name, "aten.cat.default"):
        return None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, low = parts
    if not _is(neg, target_name, "aten.neg.default"):
        return None
    high = neg.args[0]
    if not _is(high, target_name, "aten.slice.Tensor"):
        return None
    x = high.args[0]
    if not (_half_slice(high, target_name, x, True) and _half_slice(low, target_name, x, False)):
        return None
    if not _last_dim(node, dim) or x.meta["val"].shape[-1] % 2:
        return None
    return x, {node, neg, high, low}


def match(
    add: fx.Node,
    target_name: Callable,
    constant: set[fx.Node],
    evaluate: Callable[[fx.Node], object],
    tries: tuple[Iterable[float], Iterable[float]],
) -> Rotary | None:
    """The rotary pattern ending at ``add``, else None (see the module docstring)."""
    if not _is(add, target_name, "aten.add.Tensor") or len(add.args) != 2:
        return None
    if add.kwargs.get("alpha", 1) != 1:
        return None
    first, second = add.args
    for plain, turned in ((first, second), (second, first)):
        if not (
            _is(plain, target_name, "aten.mul.Tensor")
            and _is(turned, target_name, "aten.mul.Tensor")
        ):
            return None
        found = _factors(plain, turned, target_name, constant)
        if found is None:
            continue
        x, cos_node, sin_node, nodes = found
        nodes |= {plain, turned}
        theta, scaling = _tables(x, evaluate(cos_node), evaluate(sin_node), tries)
        if theta is None:
            why = (
                "rotary position embeddings whose cos/sin tables are not the default rope at "
                f"any theta of the config or {', '.join(f'{t:g}' for t in DEFAULT_THETAS)} "
                "(scaled ropes: linear, dynamic, yarn, llama3; or positions other than 0..L-1)"
            )
            return Rotary(x, None, 1.0, nodes, why)
        return Rotary(x, theta, scaling, nodes)
    return None


def _factors(plain, turned, target_name, constant):
    """(x, cos node, sin node, nodes) when plain = x * cos and turned = rotate_half(x) * sin."""
    for x, cos_node in (plain.args, plain.args[::-1]):
        if cos_node not in constant or not isinstance(x, fx.Node) or x in constant:
            continue
        for rot, sin_node in (turned.args, turned.args[::-1]):
            if sin_node not in constant:
                continue
            found = _rotated(rot, target_name)
            if found is not None and found[0] is x:
                return x, cos_node, sin_node, set(found[1])
    return None


def _tables(x: fx.Node, cos, sin, tries) -> tuple[float | None, float]:
    """The (theta, scaling) whose tables equal ``cos`` and ``sin`` bit for bit."""
    val = x.meta["val"]
    length, dim = int(val.shape[-2]), int(val.shape[-1])
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return None, 1.0
    if tuple(cos.shape[-2:]) != (length, dim) or tuple(sin.shape[-2:]) != (length, dim):
        return None, 1.0
    cos_rows = cos.reshape(-1, length, dim)
    sin_rows = sin.reshape(-1, length, dim)
    thetas, scalings = tries
    for theta in thetas:
        for scaling in scalings:
            c, s = rotary_tables(length, dim, theta, scaling, cos.dtype, cos.device)
            if all(torch.equal(r, c) for r in cos_rows) and all(
                torch.equal(r, s) for r in sin_rows
            ):
                return theta, scaling
    return None, 1.0
