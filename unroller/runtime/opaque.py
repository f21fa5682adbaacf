"""The ``aten`` operator: one ATen call run as is, the importer's exact fallback.

A network op that no registry operator computes (``addcmul``, ``cumsum``, advanced
indexing, ...) is imported as ``aten(t0, t1, op="aten.NAME.OVERLOAD", call="...")``: the
forward kernel runs ``torch.ops.aten.NAME.OVERLOAD`` on the call's arguments, and the
backward is that same call's vector-Jacobian product (``torch.autograd.grad`` of the call
recomputed from the saved inputs under ``torch.enable_grad()``), so the values and the
gradients are exactly torch's, whatever the op.

The call is text that reaches generated code only as a ``repr``'d string and is read here
by a parser that accepts nothing but literals: ``t0`` .. ``t7`` (the tensor inputs), ``N``
(the batch size: the first tensor input's first dim), numbers, ``True``/``False``/``None``,
``inf``, short plain strings, tuples and lists of those, ``torch.DTYPE``, and
``tensor((...), 'DTYPE')`` (a constant tensor, made on the inputs' device); positional
arguments then keywords. The op must be an overload of ``torch.ops.aten`` named
``aten.NAME.OVERLOAD`` in ASCII. Nothing here evaluates text as code.

A random op (its schema tagged ``nondeterministic_seeded``: ``randn_like``, ``bernoulli``)
draws from torch's stream re-seeded with one draw of it (the ``seed`` extra, one int64,
kept instead of the tensor), so the backward draws the same values again.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

#: the most tensor inputs one call reads (the registry's t0 .. t7)
MAX_TENSORS = 8
#: the most elements of a constant tensor written into a call
MAX_CONSTANT = 4096
#: the longest call text
MAX_CALL = 20000

_OP = re.compile(r"aten\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\Z")
_STRING = re.compile(r"[A-Za-z0-9_ .+-]{0,64}\Z")
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}
_ENUMS = {"strided": torch.strided, "contiguous_format": torch.contiguous_format}
_ENUMS["preserve_format"] = torch.preserve_format


class CallError(ValueError):
    """An op name or call text that is not a safe ATen call."""


def resolve(op: str) -> torch._ops.OpOverload:
    """``torch.ops.aten.NAME.OVERLOAD`` for ``aten.NAME.OVERLOAD``; CallError otherwise."""
    if not isinstance(op, str) or not op.isascii() or not _OP.match(op):
        raise CallError(
            f"op {op!r} is not an ATen overload: expected aten.NAME.OVERLOAD "
            "(ASCII letters, digits and underscores, e.g. aten.exp.default)"
        )
    _, name, overload = op.split(".")
    try:
        packet = getattr(torch.ops.aten, name)
        found = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise CallError(f"op {op!r}: torch.ops.aten has no such operator") from None
    if not isinstance(found, torch._ops.OpOverload) or found.namespace != "aten":
        raise CallError(f"op {op!r} is not an overload of torch.ops.aten")
    return found


def is_random(op: str) -> bool:
    """Whether the op draws from torch's random stream (schema tag nondeterministic_seeded)."""
    return torch.Tag.nondeterministic_seeded in resolve(op).tags


# ---------------------------------------------------------------- the call text


class _Ref:
    """Tensor input ``index`` in a parsed call."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Batch:
    """The batch size ``N`` in a parsed call."""


class _Constant:
    """``tensor(values, dtype)``: a constant tensor made on the inputs' device."""

    __slots__ = ("values", "dtype")

    def __init__(self, values: Any, dtype: torch.dtype):
        self.values = values
        self.dtype = dtype


def _literal(node: ast.AST, depth: int = 0) -> Any:
    """One argument of the call: a literal, a tensor reference, N, a dtype, a constant."""
    if depth > 16:
        raise CallError("call: nested too deeply")
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or type(value) in (bool, int):
            return value
        if type(value) is float and math.isfinite(value):
            return value
        if type(value) is str and _STRING.match(value):
            return value
        raise CallError(f"call: the constant {value!r} is not allowed")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _literal(node.operand, depth + 1)
        if type(inner) in (int, float):
            return -inner
        raise CallError("call: '-' applies to a number only")
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_literal(item, depth + 1) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Name):
        return _name(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "torch" and node.attr in {**_DTYPES, **_ENUMS}:
            return {**_DTYPES, **_ENUMS}[node.attr]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "tensor" and len(node.args) == 2 and not node.keywords:
            return _constant(node.args[0], node.args[1], depth)
    raise CallError(f"call: {ast.dump(node)[:60]} is not a literal, t0..t7, N or a dtype")


def _name(name: str) -> Any:
    """A bare name: ``t0`` .. ``t7``, ``N``, ``inf``."""
    found = re.fullmatch(r"t([0-7])", name)
    if found:
        return _Ref(int(found.group(1)))
    if name == "N":
        return _Batch()
    if name == "inf":
        return math.inf
    raise CallError(f"call: unknown name {name!r} (t0..t7, N, inf)")


def _constant(values: ast.AST, dtype: ast.AST, depth: int) -> _Constant:
    """``tensor(NESTED_TUPLE, 'DTYPE')``, bounded in size."""
    data = _literal(values, depth + 1)
    if not isinstance(dtype, ast.Constant) or dtype.value not in _DTYPES:
        raise CallError(f"call: tensor(...)'s dtype must be one of {sorted(_DTYPES)}")
    try:
        made = torch.tensor(data, dtype=_DTYPES[dtype.value])
    except (TypeError, ValueError, RuntimeError):
        raise CallError("call: tensor(...) needs nested tuples of numbers") from None
    if made.numel() > MAX_CONSTANT:
        raise CallError(f"call: a constant tensor of more than {MAX_CONSTANT} elements")
    return _Constant(data, _DTYPES[dtype.value])


@functools.lru_cache(maxsize=512)
def parse(call: str) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]:
    """The positional and keyword arguments of a call text (``t0, 1, keepdim=True``)."""
    if not isinstance(call, str) or not call.isascii() or len(call) > MAX_CALL:
        raise CallError("call: ASCII text of at most 20000 characters")
    try:
        tree = ast.parse(f"f({call})", mode="eval")
    except SyntaxError:
        raise CallError(f"call: {call[:60]!r} is not an argument list") from None
    body = tree.body
    if not isinstance(body, ast.Call) or any(isinstance(a, ast.Starred) for a in body.args):
        raise CallError("call: an argument list without * or **")
    if any(k.arg is None for k in body.keywords):
        raise CallError("call: an argument list without * or **")
    args = tuple(_literal(a) for a in body.args)
    kwargs = tuple((k.arg, _literal(k.value)) for k in body.keywords)
    return args, kwargs


def references(call: str) -> set[int]:
    """The tensor inputs a call text reads."""
    args, kwargs = parse(call)
    found: set[int] = set()

    def walk(value: Any) -> None:
        if isinstance(value, _Ref):
            found.add(value.index)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)

    for value in (*args, *(v for _, v in kwargs)):
        walk(value)
    return found


def _bind(value: Any, tensors: Sequence[Any], like: Tensor | None) -> Any:
    if isinstance(value, _Ref):
        return tensors[value.index]
    if isinstance(value, _Batch):
        return like.shape[0] if like is not None else 1
    if isinstance(value, _Constant):
        device = like.device if like is not None else None
        return torch.tensor(value.values, dtype=value.dtype, device=device)
    if isinstance(value, tuple):
        return tuple(_bind(v, tensors, like) for v in value)
    if isinstance(value, list):
        return [_bind(v, tensors, like) for v in value]
    return value


def run(op: str, call: str, tensors: Sequence[Any], output: int | None = None) -> Any:
    """The op on the call's arguments, the tensors in place of t0..t7; ``output`` picks one
    element of a tuple (or list) result."""
    func = resolve(op)
    args, kwargs = parse(call)
    like = next((t for t in tensors if isinstance(t, Tensor)), None)
    result = func(
        *(_bind(a, tensors, like) for a in args),
        **{k: _bind(v, tensors, like) for k, v in kwargs},
    )
    if output is not None:
        result = result[output]
    return _in_working_dtype(result, tensors)


def _in_working_dtype(result: Any, tensors: Sequence[Any]) -> Any:
    """A float result in the float dtype of the call's float inputs: the language has one
    float dtype, which the whole step computes in (``model.double()``), so a call that
    computes in another (``softmax(x, dtype=torch.float32)``, as eager attention's) rounds
    there and comes back, as the original's next cast (``.to(query.dtype)``) does."""
    working = next(
        (t.dtype for t in tensors if isinstance(t, Tensor) and t.is_floating_point()), None
    )
    if isinstance(result, Tensor) and result.is_floating_point() and working is not None:
        return result.to(working)
    return result


# ---------------------------------------------------------------- kernels


def _seed() -> Tensor:
    """One draw of torch's random stream (CPU) re-seeding a random op."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


def _seeded(seed: Tensor | None, tensors: Sequence[Any], draw: Callable[[], Any]) -> Any:
    """``draw()`` with torch's stream seeded by ``seed`` (and left as it was after), or as
    it is when there is no seed (a deterministic op)."""
    if seed is None:
        return draw()
    devices = [t.device for t in tensors if isinstance(t, Tensor) and t.device.type == "cuda"]
    with torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices})):
        torch.manual_seed(int(seed.reshape(-1)[0].item()))
        return draw()


def aten(
    t0: Tensor | None,
    t1: Tensor | None = None,
    t2: Tensor | None = None,
    t3: Tensor | None = None,
    t4: Tensor | None = None,
    t5: Tensor | None = None,
    t6: Tensor | None = None,
    t7: Tensor | None = None,
    *,
    op: str,
    call: str,
    output: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(the call's result, the seed of a random op or None)."""
    tensors = (t0, t1, t2, t3, t4, t5, t6, t7)
    seed = _seed() if is_random(op) else None
    out = _seeded(seed, tensors, lambda: run(op, call, tensors, output))
    return out, seed


def aten_backward(
    g: Tensor,
    t0: Tensor | None,
    t1: Tensor | None = None,
    t2: Tensor | None = None,
    t3: Tensor | None = None,
    t4: Tensor | None = None,
    t5: Tensor | None = None,
    t6: Tensor | None = None,
    t7: Tensor | None = None,
    seed: Tensor | None = None,
    *,
    op: str,
    call: str,
    output: int | None = None,
    needs: Sequence[bool] | None = None,
) -> tuple[Tensor | None, ...]:
    """The call's vector-Jacobian product with g: the call run again on the saved inputs
    (a random op with its kept seed) under ``enable_grad``, then ``autograd.grad``; a
    float input it does not reach gets zeros, a non-float one None."""
    tensors = [t0, t1, t2, t3, t4, t5, t6, t7]
    wanted = [
        i
        for i, t in enumerate(tensors)
        if isinstance(t, Tensor)
        and t.is_floating_point()
        and (needs is None or (i < len(needs) and needs[i]))
    ]
    count = len(needs) if needs is not None else sum(t is not None for t in tensors)
    grads: list[Tensor | None] = [None] * count
    if not wanted:
        return tuple(grads)
    with torch.enable_grad():
        for i in wanted:
            tensors[i] = tensors[i].detach().requires_grad_()
        out = _seeded(seed, tensors, lambda: run(op, call, tensors, output))
        leaves = [tensors[i] for i in wanted]
        if isinstance(out, Tensor) and out.requires_grad:
            found = torch.autograd.grad(out, leaves, g, allow_unused=True)
        else:  # an integer result (argmax) or one no input reaches: no gradient
            found = (None,) * len(leaves)
    for i, grad in zip(wanted, found):
        if i < count:
            grads[i] = grad if grad is not None else torch.zeros_like(tensors[i].detach())
    return tuple(grads)
