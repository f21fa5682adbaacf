"""What the torch front end asks of single ``torch.fx`` nodes: the ATen name, whether it
is a size, a view, an in-place write or a random draw, and the value of a node computed
from sizes and constants only (an attention mask built with ``torch.triu``), checked to be
the causal mask. Leaf helpers, so that the mapper and its pieces share one definition."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH, EXAMPLE_BATCH
from unroller.importer.source import FILE_MODULES, WRAPPER_PREFIX, class_name


def strip_wrapper(path: str) -> str:
    """A path or state-dict key of the wrapper -> the user's module's."""
    if path == WRAPPER_PREFIX[:-1]:
        return ""
    return path[len(WRAPPER_PREFIX) :] if path.startswith(WRAPPER_PREFIX) else path


def call_group(node, path: str) -> str:
    """``path`` for the first call of that module in ``node``'s stack, ``path@K`` for its
    K-th repeat (export's ``nn_module_stack`` key suffix): a module called twice (ALBERT's
    shared layer, one activation instance used twice) is two calls, two groups."""
    for key, (where, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if strip_wrapper(where) == path and "@" in key:
            return f"{path}@{key.rpartition('@')[2]}"
    return path


def qualname(cls) -> str:
    if isinstance(cls, str):
        module, _, rest = cls.partition(".")
        return f"{FILE_MODULES[module]}.{rest}" if module in FILE_MODULES else cls
    return class_name(cls)


class Poisoned(Refuse):
    """Reads a value that already failed: reported once, at its root."""


def unusable_name(path: str) -> str:
    """Why a module path cannot name a statement."""
    return (
        f"the module path {path!r} cannot be a model-language name (each part must be an "
        "identifier or an integer without leading zeros)"
    )


def target_name(node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


#: ATen ops whose output shares its input's storage (an in-place write to it changes the
#: input too).
#: tensors made only to be filled by a random draw in place (``empty(...).bernoulli_(q)``)
FILLED = frozenset({"empty", "new_empty", "empty_like", "zeros", "new_zeros", "zeros_like"})


VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "select",
        "slice",
        "narrow",
        "transpose",
        "t",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "diagonal",
        "unflatten",
        "flatten",
        "split",
        "chunk",
        "unbind",
        "alias",
        "view_as",
        "expand_as",
        "unfold",
        "split_with_sizes",
        "movedim",
        "swapaxes",
        "real",
        "imag",
        "detach",
    }
)


def draws_random(node) -> bool:
    """Whether the op draws random numbers (bernoulli_, rand, dropout)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


#: the class names of stochastic depth modules (timm's DropPath, torchvision's
#: StochasticDepth, Hugging Face's *DropPath)
STOCHASTIC_DEPTH = re.compile(r"StochasticDepth|DropPath")


def stochastic_depth_attr(sub: Any) -> str | None:
    """The attribute holding a stochastic depth module's drop probability (``drop_prob``,
    or torchvision's ``p``) when ``sub`` is one that drops whole samples (not torchvision's
    ``mode="batch"``), else None. The importer maps such a module's draw as ``drop_path``
    and verify makes it draw as that kernel does: one test for both."""
    if not STOCHASTIC_DEPTH.search(type(sub).__name__) or getattr(sub, "mode", "row") != "row":
        return None
    return next((a for a in ("drop_prob", "p") if isinstance(getattr(sub, a, None), float)), None)


def short_name(node) -> str:
    """``aten.transpose.int`` -> ``transpose``."""
    parts = target_name(node).split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def writes_in_place(node) -> fx.Node | None:
    """The tensor an op writes in place (its first argument, when the schema says so)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return None
    first = schema.arguments[0].alias_info
    if first is None or not first.is_write:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def is_size_value(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, (torch.SymInt, int, float, bool)) and not isinstance(val, torch.Tensor)


COPIES = ("aten.contiguous.default", "aten.clone.default", "aten.alias.default")


def through_copies(node: fx.Node) -> fx.Node:
    """The node a chain of contiguous / clone / alias copies reads."""
    while target_name(node) in COPIES:
        node = node.args[0]
    return node


def dependencies(mapper, node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` is computed from, in graph order; a size read
    (``aten.sym_size.int``) is a leaf, so a mask built from the inputs' shapes only is
    constant. Refuse if it reads an input's values, a parameter or a buffer."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if current.name not in mapper.constants:
                raise Refuse("an attention mask computed from the inputs or the weights")
            continue
        if target_name(current) == "aten.sym_size.int" or current in mapper.uniform:
            continue
        todo.extend(current.all_input_nodes)
    return [n for n in mapper.nodes if n in seen]


def reads_data(mapper, node: fx.Node) -> bool:
    try:
        dependencies(mapper, node)
    except Refuse:
        return True
    return False


def constant_value(mapper, node: fx.Node) -> torch.Tensor:
    """The value of a node computed from sizes and constants only (a mask built with
    ``torch.triu``), evaluated at the capture batch size."""
    constants = mapper.constant_values
    values: dict[fx.Node, object] = {}
    for current in dependencies(mapper, node):
        if current.op == "placeholder":
            values[current] = constants[current.name]
        elif current in mapper.uniform:
            shape = [
                EXAMPLE_BATCH if mapper.dim(d) == BATCH else int(d)
                for d in current.meta["val"].shape
            ]
            dtype = current.meta["val"].dtype
            values[current] = torch.full(shape, mapper.uniform[current], dtype=dtype)
        elif target_name(current) == "aten.sym_size.int":
            dim = int(current.args[1])
            size = current.args[0].meta["val"].shape[dim]
            values[current] = EXAMPLE_BATCH if mapper.dim(size) == BATCH else int(size)
        else:
            args = fx.node.map_arg(current.args, lambda n: values[n])
            kwargs = fx.node.map_arg(current.kwargs, lambda n: values[n])
            values[current] = current.target(*args, **kwargs)
    return values[node]


def is_causal_mask(mapper, mask: fx.Node, causal: bool, true_masks: bool = False) -> bool:
    """An attention mask is accepted only when it is exactly the causal mask or masks
    nothing; returns whether attention is causal. A boolean mask's True means "attend" for
    scaled_dot_product_attention and "masked" for nn.MultiheadAttention (``true_masks``);
    a float mask is added to the scores (0 attends, -inf masks)."""
    value = constant_value(mapper, mask)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        raise Refuse("an attention mask that is not a 2-D (or broadcast) tensor")
    length, source = value.shape[-2:]
    allowed = torch.ones(length, source, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        keep = ~value if true_masks else value
    else:
        finite = torch.isfinite(value)
        if bool((value[finite] != 0).any()) or bool((value[~finite] > 0).any()):
            raise Refuse("an additive attention mask with values other than 0 and -inf")
        keep = finite
    keep = keep.reshape(-1, length, source)
    if bool(keep.all()):
        return causal
    if all(bool((k == allowed).all()) for k in keep):
        return True
    raise Refuse("an attention mask other than the causal one")
