"""The importer's exact fallback: an ATen node no mapper handles becomes one ``aten``
statement that runs that very overload (``unroller.runtime.opaque``).

The node's arguments are written as the statement's ``call`` text: each tensor it reads
is a tensor input (``t0`` ..), a tensor built from sizes and constants only (an index
list) is written out as ``tensor((...), 'int64')``, a size is a number or ``N``, the
rest literals. An op with several results (``max.dim``, ``unbind``) is held until a
``getitem`` reads one of them, which becomes a statement with ``output=I``: each element
read is its own statement (the op runs once per element read, each with its own backward,
whose gradients add up as autograd's do). Nothing is approximated: what cannot be written
so (a device, a generator, a tensor computed otherwise than from constants of more than
``MAX_CONSTANT`` elements) is refused with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH
from unroller.importer.torch_nodes import Poisoned, constant_value, is_size_value, target_name
from unroller.runtime.opaque import _DTYPES, _STRING, MAX_CONSTANT, MAX_TENSORS, CallError, resolve

#: keyword arguments that only place the result (the kernel makes it where its inputs are)
_PLACEMENT = {"device", "pin_memory", "layout"}
#: ops that stop the gradient: refused, as before the fallback (a detach in a network is
#: most often a mistake the step would otherwise keep silently)
_GRADIENT_STOPS = {"aten.detach.default", "aten.detach_.default"}


@dataclass
class Parts:
    """A multi-result node, waiting for the ``getitem`` that reads one of its results."""

    op: str
    call: str
    inputs: list[str]


class _Writer:
    """The call text of one node, collecting the tensors it reads."""

    def __init__(self, mapper):
        self.m = mapper
        self.inputs: list[str] = []
        self.seen: dict[fx.Node, int] = {}

    def text(self, value) -> str:
        if isinstance(value, fx.Node):
            return self.node(value)
        if value is None or isinstance(value, bool):
            return repr(value)
        if isinstance(value, int):
            return repr(value)
        if isinstance(value, float):
            if math.isinf(value):
                return "inf" if value > 0 else "-inf"
            if math.isnan(value):
                raise Refuse("a NaN argument has no literal")
            return repr(value)
        if isinstance(value, str) and _STRING.match(value):
            return repr(value)
        if isinstance(value, torch.dtype):
            name = str(value).removeprefix("torch.")
            if name in _DTYPES:
                return f"torch.{name}"
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self.text(v) for v in value)
            if isinstance(value, list):
                return f"[{inner}]"
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if value in (torch.contiguous_format, torch.preserve_format):
            return f"torch.{str(value).removeprefix('torch.')}"
        raise Refuse(f"an argument {value!r} ({type(value).__name__}) has no literal")

    def node(self, node: fx.Node) -> str:
        if is_size_value(node):
            d = self.m.dim(node.meta["val"])
            if d == BATCH:
                return "N"
            if isinstance(d, str):
                raise Refuse(f"a size that depends on the batch ({d[1:]})")
            return repr(d)
        lifted = node.op == "placeholder" and node.name in self.m.constant_values
        if (node in self.m.constant or lifted) and node not in self.m.values:
            if any(isinstance(self.m.dim(d), str) for d in node.meta["val"].shape):
                raise Refuse(f"{node.name} is a constant whose shape holds the batch size")
            value = constant_value(self.m, node)
            if value.numel() > MAX_CONSTANT:
                raise Refuse(
                    f"a constant tensor of {value.numel()} elements (at most {MAX_CONSTANT})"
                )
            name = str(value.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise Refuse(f"a constant {name} tensor")
            return f"tensor({self.text(_tuples(value.tolist()))}, {name!r})"
        if node not in self.seen:
            if len(self.inputs) == MAX_TENSORS:
                raise Refuse(f"it reads more than {MAX_TENSORS} tensors")
            self.seen[node] = len(self.inputs)
            self.inputs.append(self.m.value_of(node))
        return f"t{self.seen[node]}"


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def opaque(mapper, node: fx.Node) -> str | Parts:
    """The ``aten`` statement for ``node`` (or its results, waiting for a getitem)."""
    target = target_name(node)
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
        raise Refuse("not an ATen operator: no registry operator computes it")
    try:
        resolve(target)
    except CallError as exc:
        raise Refuse(str(exc)) from None
    if target in _GRADIENT_STOPS:  # never an identity, nor a silent zero gradient
        raise Refuse("a gradient stop: no registry operator computes it")
    if node.target._schema.is_mutable:
        raise Refuse("an in-place or out= ATen op: no registry operator computes it")
    writer = _Writer(mapper)
    parts = [writer.text(a) for a in node.args]
    for key, value in node.kwargs.items():
        if key in _PLACEMENT or key == "generator" and value is None:
            continue
        parts.append(f"{key}={writer.text(value)}")
    if not writer.inputs:
        raise Refuse("it reads no tensor of the network: no registry operator computes it")
    call = ", ".join(parts)
    if isinstance(node.meta.get("val"), (tuple, list)):
        return Parts(target, call, writer.inputs)
    return mapper.add_stmt(node, "aten", writer.inputs, None, {"op": target, "call": call})


def opaque_part(mapper, parts: Parts, node: fx.Node) -> str:
    """One result of a multi-result op, read by ``getitem`` (``node``)."""
    index = node.args[1]
    if not isinstance(index, int) or index < 0:
        raise Refuse(f"a result index {index!r}")
    kwargs = {"op": parts.op, "call": parts.call, "output": index}
    return mapper.add_stmt(node, "aten", parts.inputs, None, kwargs)


def fallback(mapper, node: fx.Node, target: str) -> None:
    """The exact fallback for ``node``: one ``aten`` statement, or one result of a
    multi-result node waiting for it (``Parts``); a failure recorded as unmapped."""
    source = node.args[0] if target == "getitem" and node.args else None
    try:
        if isinstance(mapper.values.get(source), Parts):
            made = opaque_part(mapper, mapper.values[source], node)
            target = mapper.values[source].op
        else:
            made = opaque(mapper, node)
    except Poisoned:
        mapper._poison(node)
        return
    except Refuse as exc:
        mapper._fail(node, target, str(exc))
        return
    _record(mapper, node, made, target, "no registry operator computes it")


def instead(mapper, node: fx.Node, target: str, refused: str) -> bool:
    """The exact fallback for a node a registry mapper refused (an argument outside what
    the operator takes: softmax to another dtype, an add of a constant the language has no
    statement for, a tensor built from constants): one ``aten`` statement running that
    very call, when it can be written; False (nothing recorded) when it cannot, so the
    mapper's reason is the one reported."""
    if target == "getitem" or node.op != "call_function":
        return False
    merged = mapper.merged
    if any(n in merged.refused or n in merged.shapes for n in (node, *node.all_input_nodes)):
        return False  # rows merged with the batch: a per-sample question, not an operator's
    try:
        made = opaque(mapper, node)
    except (Refuse, Poisoned):
        return False
    _record(mapper, node, made, target, f"the registry's operator refused it ({refused})")
    return True


def _record(mapper, node: fx.Node, made: str | Parts, op: str, why: str) -> None:
    """``node``'s value: an ``aten`` statement, listed with ``why`` it is opaque, or a
    multi-result node's ``Parts`` waiting for the ``getitem`` that reads one."""
    mapper.values[node] = made
    if not isinstance(made, Parts):
        mapper.opaque.append(f"{made} = aten({op}): {why}; run as is")
