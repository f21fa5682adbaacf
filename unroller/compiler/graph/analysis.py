"""The built graph's outputs and what backward needs: the returned loss and predictions
checked, gradients propagated, each node's backward arguments resolved.

This runs once every statement is built: whether a value needs a gradient depends on
everything before it, and whether a node needs a backward step on everything after it
(it must reach the loss). The stash planner, the byte report and the code generator read
the result (``Node.needs_backward``, ``Node.saved``) and recompute none of it.
"""

from __future__ import annotations

from unroller.compiler import shapes
from unroller.compiler.ast import ModelAST
from unroller.compiler.dtypes import is_float
from unroller.compiler.graph.model import Graph, Node, SavedArg, Value
from unroller.compiler.graph.scope import Scope
from unroller.errors import ModelError, ModelWarning


def outputs(model: ModelAST, scope: Scope) -> tuple[Value, list[Value]]:
    """The model's returned loss and predictions: the loss a scalar made by loss ops, no
    prediction computed from a target (``predict()`` has none)."""
    ret = model.ret
    values = [scope.lookup(ref) for ref in ret.values]
    loss, loss_ref = values[0], ret.values[0]
    if loss.type.shape != ():
        raise ModelError(
            f"the model must return a scalar loss first; '{loss_ref.name}' is {loss.type}",
            loss_ref.loc,
        )
    if not _is_loss(loss):
        raise ModelError(
            f"'{loss_ref.name}' is a scalar but not produced by a loss op "
            f"(cross_entropy, mse_loss, ...)",
            loss_ref.loc,
        )
    for ref, value in zip(ret.values[1:], values[1:]):
        target = _target_behind(value)
        if target is not None:
            raise ModelError(
                f"prediction '{ref.name}' depends on target '{target.name}'; "
                f"predict() takes only inputs",
                ref.loc,
            )
    return loss, values[1:]


def analyse(graph: Graph) -> None:
    """Gradient requirements, which nodes reach the loss, and unused-name warnings."""
    for node in graph.nodes:
        node.output.requires_grad = is_float(node.output.type.dtype) and (
            any(p.present and p.trainable for p in node.params)
            or any(v.requires_grad for v in node.inputs)
        )  # an integer or bool output (argmax) has no gradient, as in torch
    reaches_loss = {id(graph.loss)}
    for node in reversed(graph.nodes):
        if id(node.output) in reaches_loss:
            for v in node.inputs:
                reaches_loss.add(id(v))
            node.needs_backward = node.output.requires_grad
    for node in graph.nodes:
        if node.needs_backward:
            node.saved = saved_args(node)
    used = {id(v) for v in graph.preds} | {id(graph.loss)}
    for value in graph.inputs:
        if not value.consumers:
            graph.warnings.append(
                ModelWarning(f"{value.kind} '{value.name}' is never used", value.loc)
            )
    for node in graph.nodes:
        if not node.output.consumers and id(node.output) not in used:
            graph.warnings.append(
                ModelWarning(
                    f"'{node.name}' is computed but never used (not returned, feeds nothing)",
                    node.loc,
                )
            )


def saved_args(node: Node) -> tuple[SavedArg, ...]:
    """The backward kernel's arguments after the output gradient (see ``SavedArg``)."""
    names = node.input_names
    layer_entries = {p.name for p in (*node.params, *node.buffers)}
    extras = {e.name: e for e in node.extras}
    found: list[SavedArg] = []
    wanted = dict(zip((*names, *(p.name for p in node.params)), node.needs))
    for entry in node.op.saved:
        readers = node.op.saved_for.get(entry)
        if readers is not None and not any(wanted.get(r, False) for r in readers):
            found.append(SavedArg(entry, "none"))  # only a gradient not needed reads it
            continue
        if entry in layer_entries:
            if not any(a.kind == "layer" for a in found):
                found.append(SavedArg(entry, "layer"))
            continue
        if entry in node.op.inputs and entry not in names:
            found.append(SavedArg(entry, "none"))  # an optional input left out
        elif entry in names:
            value = node.inputs[names.index(entry)]
            # A model input is the caller's tensor: compressing it would free nothing; nor
            # would compressing a value without the batch dim (a free parameter, or made
            # from parameters only), which would perturb weights besides.
            activation = (
                entry in node.op.activations
                and value.producer is not None
                and shapes.BATCH in value.type.shape
            )
            found.append(SavedArg(entry, "value", value.name, value.type, activation))
        elif entry == "output":
            activation = entry in node.op.activations and shapes.BATCH in node.output.type.shape
            found.append(SavedArg(entry, "value", node.output.name, node.output.type, activation))
        elif extras[entry].present:
            activation = entry in node.op.activations
            key = f"{node.name}:{entry}"
            found.append(SavedArg(entry, "extra", key, extras[entry].type, activation))
        else:
            found.append(SavedArg(entry, "none"))
    return tuple(found)


def _target_behind(value: Value) -> Value | None:
    """A target that ``value`` is computed from (the first found), or None."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.kind == "target":
            return v
        if v.producer is not None:
            stack.extend(v.producer.inputs)
    return None


def _is_loss(value: Value) -> bool:
    """Made by a loss op, or by add/mul of such values (walked without recursion)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer
        if node is None or v.type.shape != ():
            return False
        if node.op.is_loss:
            continue
        if node.op.name not in ("add", "mul"):
            return False
        stack.extend(node.inputs)
    return True
