"""A statement's parameters and buffers: their tensors, the model's budget of elements,
and the ``frozen``, ``tied_`` and ``shares`` keywords that say which train and which are
shared.

These keywords are no operator's arguments: the builder takes them out of a call's
keywords (``tie_words``, ``freeze_words``, ``share_word``) before the registry checks the
rest, applies them to the tensors ``param_tensors`` makes, checks a ``shares`` against the
earlier statement it names at once (``shared_layer``), and checks the ties across
statements once every statement is built (``check_ties``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from unroller.compiler import shapes
from unroller.compiler.ast import Call
from unroller.compiler.graph.args import render_const
from unroller.compiler.graph.model import MAX_PARAMETERS, Node, ParamTensor
from unroller.compiler.registry import OpSpec, eval_expr
from unroller.compiler.shapes import size_problem
from unroller.errors import ModelError, did_you_mean

FROZEN = "frozen"
"""``frozen=true`` on a statement with parameters (``frozen_PARAM=true``: one of them): they
do not train, as ``requires_grad_(False)`` in torch; their gradient is never computed, and a
layer whose inputs need no gradient either has no backward and keeps nothing for it (a
frozen backbone under a trained head)."""

TIED_PREFIX = "tied_"
"""``tied_PARAM="KEY"`` on a statement with parameters: its PARAM is the tensor that the
state-dict key KEY names (another statement's parameter), as ``lm_head.weight =
embed.weight`` ties them in torch; gradients of both uses add up in the one ``.grad``."""
SHARES = "shares"
"""``shares="NAME"`` on a statement with parameters or buffers: it calls the layer that
the earlier statement NAME made (the same operator, built alike) instead of a layer of its
own, as a torch module called twice does (ALBERT runs one layer per hidden layer): its
parameters and buffers are NAME's, it adds no state-dict key, and the gradients of every
call add up in the one ``.grad``. Without it, a module called twice would need a second
key the original's state dict lacks."""
_KEY_PART = r"(?:[A-Za-z_][A-Za-z0-9_]*|0|[1-9][0-9]*)"
_TIED_KEY = re.compile(rf"{_KEY_PART}(?:\.{_KEY_PART})*")


def param_tensors(
    op: OpSpec,
    specs: tuple,
    trainable: bool,
    full_name: str,
    result: shapes.ShapeResult,
    args: dict[str, Any],
    float_dtype: str,
) -> list[ParamTensor]:
    """The parameters (or buffers) ``specs`` of one call, shapes evaluated from its
    arguments and derived values; a free tensor is keyed by the statement's name."""
    env = {**args, **result.derived}
    return [
        ParamTensor(
            name=result.derived["name"] if op.free else spec.name,
            key=full_name if op.free else f"{full_name}.{spec.name}",
            shape=tuple(eval_expr(spec.shape, env)),
            dtype=spec.dtype or float_dtype,
            trainable=trainable,
            present=spec.present(args),
        )
        for spec in specs
    ]


class ParameterBudget:
    """The model's parameter and buffer elements so far, against ``MAX_PARAMETERS``: a
    model whose tensors alone would need terabytes is refused at the statement that
    passes the limit, before anything is generated."""

    def __init__(self) -> None:
        self.elements = 0

    def add(self, op: OpSpec, stmt: Call, full_name: str, tensors: list[ParamTensor]) -> None:
        """Add the call's tensors to the model's element count, refusing any tensor, or a
        model total, beyond the limits."""
        for tensor in tensors:
            if not tensor.present:  # its shape may be empty (moe without a shared expert)
                continue
            problem = size_problem(tensor.shape)
            if problem:
                raise ModelError(
                    f"{full_name}: {op.name}'s {tensor.name} would be "
                    f"[{', '.join(map(str, tensor.shape))}]: {problem}",
                    stmt.op_loc,
                )
            self.elements += math.prod(tensor.shape)
        if self.elements > MAX_PARAMETERS:
            raise ModelError(
                f"{full_name}: the model's parameters and buffers reach "
                f"{self.elements:,} elements, more than the limit of "
                f"{MAX_PARAMETERS:,} (2**34)",
                stmt.op_loc,
            )


def tie_words(op: OpSpec, stmt: Call) -> dict[str, str]:
    """The ``tied_PARAM`` keywords of a statement: parameter name -> keyword."""
    return {
        kw.name[len(TIED_PREFIX) :]: kw.name
        for kw in stmt.kwargs
        if kw.name.startswith(TIED_PREFIX) and kw.name not in op.args
    }


def share_word(op: OpSpec, stmt: Call) -> str | None:
    """``shares`` when the statement has that keyword (and the operator no such argument)."""
    found = any(kw.name == SHARES for kw in stmt.kwargs) and SHARES not in op.args
    return SHARES if found else None


def shared_layer(
    op: OpSpec,
    stmt: Call,
    given: dict[str, Any],
    earlier: dict[str, Node],
    env: dict[str, Any],
    mine: list[ParamTensor],
    others: set[str],
) -> Node:
    """The earlier node whose layer a ``shares="NAME"`` statement calls, checked: a string
    naming an earlier statement of the same operator that shares no layer itself, built
    with the same constructor arguments and tensors (``mine``: this call's, as its own
    layer would have them), and no ``tied_`` or ``frozen`` keyword beside it (``others``:
    those are the layer's, written on NAME). Errors point at the keyword."""
    locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
    loc = locs[SHARES]
    for word in others:
        raise ModelError(
            f"{word} beside {SHARES}: a shared layer's parameters are tied or frozen where "
            "the layer is made, on the statement it names",
            locs[word],
        )
    if op.free or not (op.params or op.buffers):
        what = "a free parameter is a value: read it again" if op.free else "nothing to share"
        raise ModelError(f"{op.name} has no layer to share ({what})", loc)
    name = given[SHARES]
    if not isinstance(name, str) or not _TIED_KEY.fullmatch(name):
        raise ModelError(
            f"{SHARES} takes the full name of an earlier statement as a string "
            '("layers.0.fc"), got ' + render_const(name),
            loc,
        )
    owner = earlier.get(name)
    if owner is None:
        raise ModelError(
            f"{SHARES}={name!r} names no earlier statement{did_you_mean(name, list(earlier))}",
            loc,
        )
    if owner.shares:
        raise ModelError(
            f"{SHARES}={name!r} shares the layer of {owner.shares!r} itself; name {owner.shares!r}",
            loc,
        )
    if owner.op is not op:
        raise ModelError(
            f"{name} is a {owner.op.name}, not a {op.name}: a shared layer is one operator's",
            loc,
        )
    theirs = {**owner.args, **owner.derived}
    spec = op.module
    for key in (*spec.args, *spec.kwargs) if spec is not None else ():
        if env.get(key) != theirs.get(key):
            raise ModelError(
                f"this call's layer would be built with {key}={render_const(env.get(key))}, "
                f"{name}'s is built with {key}={render_const(theirs.get(key))}",
                loc,
            )
    for tensor, other in zip(mine, (*owner.params, *owner.buffers)):
        if (tensor.shape, tensor.dtype, tensor.present) != (
            other.shape,
            other.dtype,
            other.present,
        ):
            raise ModelError(
                f"its {tensor.name} would be {_typed(tensor)} but {other.key} is "
                f"{_typed(other)}: a shared layer's tensors are the same",
                loc,
            )
    return owner


def _typed(tensor: ParamTensor) -> str:
    return f"{tensor.dtype}[{', '.join(map(str, tensor.shape))}]" if tensor.present else "absent"


def freeze_words(op: OpSpec, stmt: Call) -> dict[str, str]:
    """``frozen`` / ``frozen_PARAM`` keywords: keyword -> parameter name ("" for all)."""
    found = {}
    for kw in stmt.kwargs:
        if kw.name in op.args:
            continue
        if kw.name == FROZEN:
            found[kw.name] = ""
        elif kw.name.startswith(FROZEN + "_"):
            found[kw.name] = kw.name[len(FROZEN) + 1 :]
    return found


def frozen_params(
    op: OpSpec, stmt: Call, given: dict[str, Any], freezes: dict[str, str], params: list
) -> list[str]:
    """The parameters ``frozen=true`` / ``frozen_PARAM=true`` freeze, checked."""
    locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
    names = [p.name for p in params if p.present]
    found: list[str] = []
    for word, name in freezes.items():
        if not isinstance(given[word], bool):
            raise ModelError(
                f"{word} takes true or false, got {render_const(given[word])}", locs[word]
            )
        if not names:
            raise ModelError(f"{op.name} has no parameters to freeze", locs[word])
        if name and name not in names:
            raise ModelError(
                f"{op.name} has no parameter '{name}' to freeze (its parameters: "
                f"{', '.join(names)})",
                locs[word],
            )
        if given[word]:
            found += [name] if name else names
    return found


def tied_params(
    op: OpSpec, stmt: Call, given: dict[str, Any], ties: dict[str, str], params: list
) -> dict[str, str]:
    """Check each ``tied_PARAM="KEY"``: PARAM is a parameter of this statement and KEY a
    state-dict key (checked against the other statements when the graph is done)."""
    locs = {kw.name: kw.value.loc for kw in stmt.kwargs}
    names = [p.name for p in params if p.present]
    found = {}
    for name, word in ties.items():
        if name not in names:
            have = ", ".join(names) or "none"
            raise ModelError(
                f"{op.name} has no parameter '{name}' to tie (its parameters: {have})",
                locs[word],
            )
        key = given[word]
        if not isinstance(key, str) or not _TIED_KEY.fullmatch(key):
            raise ModelError(
                f"{word} takes the state-dict key of another statement's parameter as "
                'a string ("emb.weight"), got ' + render_const(key),
                locs[word],
            )
        found[name] = key
    return found


def check_ties(nodes: list[Node]) -> None:
    """Every tie names a parameter of another statement, untied itself, of the same
    shape and dtype."""
    params = {
        p.key: (node, p) for node in nodes if not node.shares for p in node.params if p.present
    }
    for node in nodes:
        if node.shares:
            continue  # its ties are its layer's, checked there
        for name, key in node.ties.items():
            mine = next(p for p in node.params if p.name == name)
            loc = node.loc
            if key not in params:
                raise ModelError(
                    f"{node.name}: tied_{name}={key!r} names no parameter of the model"
                    f"{did_you_mean(key, list(params))}",
                    loc,
                )
            other, theirs = params[key]
            if other is node:
                raise ModelError(f"{node.name}: tied_{name} names its own parameter", loc)
            if theirs.name in other.ties:
                raise ModelError(
                    f"{node.name}: tied_{name}={key!r} is tied itself; tie to "
                    f"{other.ties[theirs.name]!r}",
                    loc,
                )
            if mine.trainable != theirs.trainable:
                raise ModelError(
                    f"{node.name}: its {name} is tied to {key}, which "
                    f"{'does not train' if mine.trainable else 'trains'}: freeze both "
                    "or neither (they are one tensor)",
                    loc,
                )
            if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
                raise ModelError(
                    f"{node.name}: its {name} is {mine.dtype}[{', '.join(map(str, mine.shape))}]"
                    f" but {key} is {theirs.dtype}[{', '.join(map(str, theirs.shape))}]: a tied "
                    "parameter is one tensor",
                    loc,
                )
