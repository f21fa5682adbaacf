"""Padding masks given as an input: Hugging Face's ``attention_mask`` [N, S] -> ``padding_mask``.

transformers builds the 4-D attention mask from ``attention_mask`` with casts, index,
``&`` and ``where`` (its masking_utils), ops no registry operator maps one by one. They are
recognised here by what they compute, not by how: a boolean or float tensor [N, 1 or H, L, S]
computed from one integer input [N, S] alone (sizes and constants aside) that equals, on
sample masks, that input's padding mask (nonzero attends), ANDed with the causal mask or
not; a float one holds 0 where attended and a huge negative number where not. The
attention then reads ``padding_mask(input)`` as its bias (and is_causal), added to a bias it
already has. Anything else built from such an input is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from unroller.importer.model import BATCH, EXAMPLE_BATCH

#: a float mask's padded entries are at most this (lowest float, or -inf)
HUGE_NEGATIVE = -1e30


@dataclass
class PaddingMasks:
    """What ``find`` learnt: matched masks -> (the input, causal); refused ones -> why;
    the nodes that the statements replace."""

    found: dict[fx.Node, tuple[fx.Node, bool]] = field(default_factory=dict)
    refused: dict[fx.Node, str] = field(default_factory=dict)
    absorbed: set[fx.Node] = field(default_factory=set)


def _reads(mapper, target_name, is_size) -> dict[fx.Node, frozenset | None]:
    """Per node, the user inputs it is computed from; None when it reads a parameter or
    buffer (or cannot be followed)."""
    reads: dict[fx.Node, frozenset | None] = {}
    for node in mapper.nodes:
        if node.op == "placeholder":
            if node.name in mapper.user_inputs:
                reads[node] = frozenset([node])
            elif node.name in mapper.constants:
                reads[node] = frozenset()
            else:
                reads[node] = None
        elif node.op != "call_function":
            reads[node] = None
        elif is_size(node) or target_name(node) == "aten.sym_size.int" or node in mapper.uniform:
            reads[node] = frozenset()
        else:
            found: frozenset | None = frozenset()
            for arg in node.all_input_nodes:
                theirs = reads.get(arg)
                if theirs is None:
                    found = None
                    break
                found = found | theirs
            reads[node] = found
    return reads


def _mask_input(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 2
        and not val.is_floating_point()
        and not val.is_complex()
    )


def find(mapper, target_name, is_size) -> PaddingMasks:
    """The padding masks of the graph (see the module docstring)."""
    out = PaddingMasks()
    reads = _reads(mapper, target_name, is_size)
    inside: set[fx.Node] = set()  # the nodes computing the masks handled
    for node in mapper.nodes:
        source = reads.get(node)
        if (
            node.op != "call_function"
            or node not in mapper.live
            or node in mapper.constant
            or not source
            or len(source) != 1
        ):
            continue
        (ids,) = source
        val = node.meta.get("val")
        if not _mask_input(ids) or not isinstance(val, torch.Tensor) or val.dim() != 4:
            continue
        if val.dtype != torch.bool and not val.is_floating_point():
            continue
        users = [u for u in node.users if u in mapper.live]
        if not users or all(reads.get(u) == source for u in users):
            continue  # not the last node of the mask
        causal, why = _evaluate(mapper, node, ids, target_name)
        reader_only = all(_reads_as_mask(u, node, target_name) for u in users)
        if why is None and val.is_floating_point():
            added = [u for u in users if not _reads_as_mask(u, node, target_name)]
            if not _adds_only(added, target_name) or (causal and added):
                why = (
                    "an additive padding mask read other than as an attention's mask or "
                    "added to its scores (or added and also causal): import with "
                    "attn_implementation='sdpa'"
                )
        if why is not None:
            if not reader_only:
                continue  # mapped one by one (and refused there if no operator maps it)
            out.refused[node] = why
        else:
            out.found[node] = (ids, causal)
        inside |= _closure(node, ids, reads, target_name)
    handled = set(out.found) | set(out.refused)
    for node in inside - handled:
        if all(u in inside or u in handled for u in node.users if u in mapper.live):
            out.absorbed.add(node)
    for node in handled:
        if node in out.refused or node.meta["val"].dtype == torch.bool:
            out.absorbed.add(node)
    return out


def _reads_as_mask(user: fx.Node, mask: fx.Node, target_name) -> bool:
    """Whether ``user`` reads ``mask`` as an attention's attn_mask or as the condition of a
    ``where(mask, bias, lowest)`` (through copies)."""
    name = target_name(user)
    if name == "aten.scaled_dot_product_attention.default":
        return user.kwargs.get("attn_mask", user.args[3] if len(user.args) > 3 else None) is mask
    if name == "aten.where.ScalarOther":
        return user.args[0] is mask and mask not in user.args[1:]
    return False


def _adds_only(users: list[fx.Node], target_name) -> bool:
    return all(target_name(u) in ("aten.add.Tensor", "aten.add_.Tensor") for u in users)


def _closure(node: fx.Node, ids: fx.Node, reads, target_name) -> set[fx.Node]:
    """The nodes computing ``node`` from ``ids`` (the input and size reads left out)."""
    inside: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if current in inside or current is ids or current.op != "call_function":
            continue
        if target_name(current) == "aten.sym_size.int":
            continue
        inside.add(current)
        todo.extend(a for a in current.all_input_nodes if reads.get(a) is not None)
    return inside


def samples(batch: int, length: int) -> list[torch.Tensor]:
    """Sample padding masks [batch, length] of 0 and 1, each row attending somewhere: random
    ones, none padded, padding on the right and on the left."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        sample = torch.randint(0, 2, (batch, length), generator=generator)
        sample[torch.arange(batch), torch.randint(0, length, (batch,), generator=generator)] = 1
        out.append(sample)
    out.append(torch.ones(batch, length, dtype=torch.long))
    right = torch.ones(batch, length, dtype=torch.long)
    left = right.clone()
    for row in range(batch):
        right[row, length - min(row, length - 1) :] = 0
        left[row, : min(row, length - 1)] = 0
    return out + [right, left]


def _evaluate(mapper, node: fx.Node, ids: fx.Node, target_name) -> tuple[bool, str | None]:
    """(causal, None) when ``node`` is the padding mask of ``ids`` (ANDed with the causal
    mask when causal) on every sample, else (False, why not)."""

    length = int(ids.meta["val"].shape[1])
    name = mapper.user_inputs.get(ids.name, ids.name)
    why = (
        f"an attention mask computed from the input {name!r} that is not its padding mask "
        "(nonzero attends, 0 pads, as Hugging Face's attention_mask), alone or with the "
        "causal mask, on sample masks"
    )
    verdicts = set()
    for sample in samples(EXAMPLE_BATCH, length):
        sample = sample.to(ids.meta["val"].dtype)
        try:
            got = _run(mapper, node, ids, sample, target_name)
        except Exception:  # noqa: BLE001 - not computable from the mask alone: not ours
            return False, why
        verdict = _compare(got, sample)
        if verdict is None:
            return False, why
        verdicts.add(verdict)
    if verdicts == {"both"}:
        return False, None  # every sample attends everywhere the causal mask does too
    verdicts.discard("both")
    if len(verdicts) != 1:
        return False, why
    return verdicts.pop() == "causal", None


def _compare(got: object, sample: torch.Tensor) -> str | None:
    """ "padding", "causal" (padding AND causal), "both" (either) or None (neither)."""
    if not isinstance(got, torch.Tensor) or got.dim() != 4:
        return None
    if got.shape[0] != sample.shape[0] or got.shape[-1] != sample.shape[1]:
        return None
    if got.dtype == torch.bool:
        keep = got
    elif got.is_floating_point():
        keep = got == 0
        if not bool((got[~keep] <= HUGE_NEGATIVE).all()):
            return None
    else:
        return None
    padding = (sample != 0)[:, None, None, :]
    length, keys = got.shape[-2:]
    causal = padding & torch.ones(length, keys, dtype=torch.bool).tril()
    is_padding = torch.equal(keep, padding.expand(got.shape))
    is_causal = torch.equal(keep, causal.expand(got.shape))
    if is_padding and is_causal:
        return "both"
    return "padding" if is_padding else "causal" if is_causal else None


def _run(mapper, node: fx.Node, ids: fx.Node, sample: torch.Tensor, target_name) -> object:
    """The value of ``node`` with the input ``ids`` set to ``sample`` (sizes at the sample's
    batch, constants as captured)."""
    needed: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if current in needed:
            continue
        needed.add(current)
        if current.op == "placeholder" or target_name(current) == "aten.sym_size.int":
            continue
        if current in mapper.uniform:
            continue
        todo.extend(current.all_input_nodes)
    batch = sample.shape[0]
    values: dict[fx.Node, object] = {}
    for current in mapper.nodes:
        if current not in needed:
            continue
        if current is ids:
            values[current] = sample
        elif current.op == "placeholder":
            values[current] = mapper.constant_values[current.name]
        elif target_name(current) == "aten.sym_size.int":
            dim = int(current.args[1])
            if current.args[0] is ids:
                values[current] = sample.shape[dim]
            else:
                size = current.args[0].meta["val"].shape[dim]
                values[current] = batch if mapper.dim(size) == BATCH else int(size)
        elif current in mapper.uniform:
            shape = [batch if mapper.dim(d) == BATCH else int(d) for d in current.meta["val"].shape]
            dtype = current.meta["val"].dtype
            values[current] = torch.full(shape, mapper.uniform[current], dtype=dtype)
        else:
            args = fx.node.map_arg(current.args, values.__getitem__)
            kwargs = fx.node.map_arg(current.kwargs, values.__getitem__)
            values[current] = current.target(*args, **kwargs)
    return values[node]


# ---------------------------------------------------------------- nn.MultiheadAttention's key_padding_mask


def key_padding_source(mapper, node: fx.Node, target_name) -> fx.Node | None:
    """The boolean input [N, S] (True pads) that ``node`` is, or torch's float form of it
    (``F._canonical_mask``: ``masked_fill(zeros_like(m, float), m, -inf)``, which
    nn.TransformerEncoder and nn.MultiheadAttention make); else None."""
    if node.op == "placeholder":
        val = node.meta.get("val")
        ok = isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.dim() == 2
        return node if ok and node.name in mapper.user_inputs else None
    if target_name(node) not in ("aten.masked_fill.Scalar", "aten.masked_fill_.Scalar"):
        return None
    zeros, mask, value = node.args[:3]
    if not isinstance(zeros, fx.Node) or not isinstance(mask, fx.Node):
        return None
    if target_name(zeros) != "aten.zeros_like.default" or zeros.args[0] is not mask:
        return None
    if not (isinstance(value, float) and value <= HUGE_NEGATIVE):
        return None
    return key_padding_source(mapper, mask, target_name) if mask.op == "placeholder" else None


def absorb_key_padding(mapper, target_name) -> set[fx.Node]:
    """The float forms of a key padding mask made outside the attentions that read them
    (nn.TransformerEncoder's), with their ``zeros_like``: no statements of their own, as
    each attention reads the boolean input (``key_padding_source``)."""
    out: set[fx.Node] = set()
    for node in mapper.nodes:
        if node.op != "call_function" or node not in mapper.live or node in mapper.groups:
            continue
        if key_padding_source(mapper, node, target_name) is None:
            continue
        if all(u in mapper.groups for u in node.users if u in mapper.live):
            out |= {node, node.args[0]}
    return out
