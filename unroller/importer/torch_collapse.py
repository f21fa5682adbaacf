"""Module classes whose ATen chain is one registry operator (``COLLAPSED``:
``nn.MultiheadAttention``, transformers' ``Conv1D``, tanh GELU, RMSNorm and the sparse
mixture-of-experts blocks recognised by their source), and the mapper's part that finds their nodes and maps each call as one statement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import fx

from unroller.importer import masks
from unroller.importer.aten_ops import Refuse
from unroller.importer.hf_moe import is_hf_moe_block, moe_kwargs
from unroller.importer.hf_norms import is_hf_rmsnorm, rmsnorm_kwargs
from unroller.importer.model import BATCH, Stmt, shape_text, valid_path
from unroller.importer.torch_nodes import (
    Poisoned,
    call_group,
    is_causal_mask,
    is_size_value,
    qualname,
    reads_data,
    target_name,
    unusable_name,
)
from unroller.importer.torch_view import NodeView


def _multihead_attention(mapper, path, module, nodes, external, escaping) -> str:
    if not module.batch_first:
        raise Refuse("nn.MultiheadAttention without batch_first=True puts the batch in dim 1")
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise Refuse("kdim/vdim, add_bias_kv or add_zero_attn")
    data = []
    padding = []  # key_padding_mask: a boolean input [N, S], True where padded
    causal = False
    for node in external:
        try:
            mapper.shape(node)
        except Refuse:
            continue
        source = masks.key_padding_source(mapper, node, target_name)
        if source is not None:
            padding.append(source)
        elif reads_data(mapper, node):
            data.append(node)
        else:
            causal = is_causal_mask(mapper, node, causal, true_masks=True)
    if len(escaping) != 1:
        raise Refuse("the attention weights are used (need_weights=True)")
    if not data or any(not _is_sequence(mapper, n, module.embed_dim) for n in data):
        raise Refuse(
            "a key_padding_mask must be a boolean model input [N, S] (True pads), and an "
            "attn_mask the causal mask or one that masks nothing"
        )
    if len(data) > 1 or module.dropout != 0.0:
        if padding or causal or any(_is_sdpa_with_mask(n) for n in nodes):
            what = "cross-attention" if len(data) > 1 else f"attention dropout {module.dropout}"
            raise Refuse(
                f"a mask with {what}: only attention without a mask is written out of "
                "statements; build nn.MultiheadAttention with dropout=0.0 (self-attention) "
                "or call it without the mask"
            )
        return _composed_attention(mapper, path, module, nodes, data, escaping)
    for node in nodes:
        if target_name(node) == "aten.scaled_dot_product_attention.default":
            view = NodeView(mapper, node, target_name(node))
            causal = causal or bool(view.a["is_causal"])
    shape = mapper.shape(data[0])
    if len(shape) != 3 or shape[0] != BATCH:
        raise Refuse(f"self-attention on {shape_text(shape)}: expected [N, L, E]")
    names = ("in_proj_weight", "out_proj.weight")
    if module.in_proj_bias is not None:  # bias= governs both projections
        names += ("in_proj_bias", "out_proj.bias")
    kwargs = {
        "num_heads": module.num_heads,
        "bias": module.in_proj_bias is not None,
        "is_causal": causal,
    }
    args = [mapper.value_of(data[0])]
    if padding:
        args.append(_key_padding_bias(mapper, path, padding[0], shape[1]))
    return _collapsed_stmt(
        mapper, path, module, nodes, escaping, "multihead_attention", args, kwargs, names
    )


def _is_sequence(mapper, node: fx.Node, embed: int) -> bool:
    """Whether ``node`` can be a query, key or value ([N, L, E]), not a mask read as data."""
    shape = mapper.shape(node)
    value = node.meta.get("val")
    floating = isinstance(value, torch.Tensor) and value.dtype.is_floating_point
    return len(shape) == 3 and shape[0] == BATCH and shape[2] == embed and floating


def _is_sdpa_with_mask(node: fx.Node) -> bool:
    if target_name(node) != "aten.scaled_dot_product_attention.default":
        return False
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return mask is not None or bool(causal)


def _attention_inputs(nodes: list[fx.Node], data: list[fx.Node]) -> list[fx.Node]:
    """query, key, value: ``F.multi_head_attention_forward`` transposes (batch_first) the
    query first, then the key, then the value, each tensor once (``key is value`` shares
    one), so the order in which the module's nodes first read them says which is which."""
    order = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in data and arg not in order:
                order.append(arg)
    if len(order) == 1:
        return order * 3
    if len(order) == 2:  # key is value (cross-attention on a memory)
        return [order[0], order[1], order[1]]
    return order


def _composed_attention(mapper, path, module, nodes, data, escaping) -> str:
    """``nn.MultiheadAttention`` as the statements torch's forward computes, where the
    registry's ``multihead_attention`` (self-attention, no dropout kernel) cannot say it:
    the packed in-projection of each input (a ``parameter`` holding ``in_proj_weight``,
    ``matmul``, the bias added, then the query's, key's or value's third sliced off), the
    heads split, ``scaled_dot_product_attention`` with the module's dropout (seeded, as
    torch's sdpa draws), the heads joined and ``out_proj`` a ``linear``."""
    query, key, value = _attention_inputs(nodes, data)
    heads, embed = module.num_heads, module.embed_dim
    weight, bias = _packed_parameters(mapper, path, nodes, module.in_proj_bias is not None)
    projected: dict[fx.Node, str] = {}
    parts = []
    for k, node in enumerate((query, key, value)):
        shape = mapper.shape(node)
        if len(shape) != 3 or shape[0] != BATCH or shape[2] != embed:
            raise Refuse(f"attention on {shape_text(shape)}: expected [N, L, {embed}]")
        length = shape[1]
        if node not in projected:
            projected[node] = _in_projection(mapper, path, node, weight, bias, embed, length)
        part = _stmt(
            mapper,
            path,
            "slice",
            [projected[node]],
            {"dim": 2, "start": k * embed, "end": (k + 1) * embed},
            (BATCH, length, embed),
        )
        split = (BATCH, length, heads, embed // heads)
        part = _stmt(mapper, path, "reshape", [part], {"shape": split[1:]}, split)
        swapped = (BATCH, heads, length, embed // heads)
        parts.append(_stmt(mapper, path, "transpose", [part], {"dim0": 1, "dim1": 2}, swapped))
    length = mapper.shape(query)[1]
    kwargs = {"dropout": float(module.dropout)} if module.dropout else {}
    shape = (BATCH, heads, length, embed // heads)
    context = _stmt(mapper, path, "scaled_dot_product_attention", parts, kwargs, shape)
    shape = (BATCH, length, heads, embed // heads)
    context = _stmt(mapper, path, "transpose", [context], {"dim0": 1, "dim1": 2}, shape)
    context = _stmt(
        mapper, path, "reshape", [context], {"shape": (length, embed)}, (BATCH, length, embed)
    )
    out = f"{path}.out_proj"
    names = ("weight", "bias") if module.out_proj.bias is not None else ("weight",)
    sub = module.out_proj
    kwargs = {"out_features": embed, "bias": sub.bias is not None}
    mapper.classes.setdefault(path, qualname(type(module)))
    return _collapsed_stmt(mapper, out, sub, nodes, escaping, "linear", [context], kwargs, names)


def _stmt(mapper, path: str, op: str, args: list[str], kwargs: dict, shape) -> str:
    name = mapper.unique(f"{path}.{op}")
    mapper.stmts.append(Stmt(name, op, args, kwargs, path, shape))
    return name


def _packed_parameters(mapper, path, nodes, bias: bool) -> tuple[str, str | None]:
    """``in_proj_weight`` (and ``in_proj_bias``) as ``parameter`` statements under their
    keys: the three projections are rows of one packed tensor, not three modules."""
    found = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg.name in mapper.params:
                found[mapper.params[arg.name]] = arg
    values = []
    for leaf in ("in_proj_weight", "in_proj_bias") if bias else ("in_proj_weight",):
        key = f"{path}.{leaf}"
        if key not in found:
            raise Refuse(f"the forward does not read {key}")
        values.append(mapper.value_of(found[key]))
    return values[0], values[1] if bias else None


def _in_projection(mapper, path, node, weight, bias, embed: int, length: int) -> str:
    """x [N, L, E] -> x @ in_proj_weight^T (+ in_proj_bias): [N, L, 3E], computed as
    (W @ x^T)^T, since ``matmul`` broadcasts a weight without N on the left."""
    x = mapper.value_of(node)
    rows = _stmt(mapper, path, "transpose", [x], {"dim0": 1, "dim1": 2}, (BATCH, embed, length))
    out = _stmt(mapper, path, "matmul", [weight, rows], {}, (BATCH, 3 * embed, length))
    shape = (BATCH, length, 3 * embed)
    out = _stmt(mapper, path, "transpose", [out], {"dim0": 1, "dim1": 2}, shape)
    return out if bias is None else _stmt(mapper, path, "add", [out, bias], {}, shape)


def _key_padding_bias(mapper, path: str, mask: fx.Node, length: int) -> str:
    """``padding_mask(mask, invert=true)`` expanded to the scores' [N, 1, L, S]: the bias
    the attention adds, 0 where attended and float32's lowest where padded (torch's -inf
    gives the same probabilities wherever a row attends somewhere). One per input and L."""
    keys = int(mask.meta["val"].shape[1])
    if keys != length:
        raise Refuse(f"a key_padding_mask of {keys} keys for self-attention on {length}")
    key = ("key_padding", mask)
    if key not in mapper.padding_values:
        name = mapper.unique(f"{path}.padding_mask")
        stmt = Stmt(
            name,
            "padding_mask",
            [mapper.value_of(mask)],
            {"invert": True},
            path,
            (BATCH, 1, 1, keys),
        )
        mapper.stmts.append(stmt)
        mapper.padding_values[key] = name
    size = (BATCH, 1, length, keys)
    if (key, size) not in mapper.padding_values:
        name = mapper.unique(f"{path}.key_padding_bias")
        pad = mapper.padding_values[key]
        mapper.stmts.append(Stmt(name, "expand", [pad], {"size": size}, path, size))
        mapper.padding_values[(key, size)] = name
    return mapper.padding_values[(key, size)]


_CASTS = ("aten.to.dtype", "aten._to_copy.default", "aten.alias.default")


def _same_dtype_cast(node: fx.Node, external: list[fx.Node]) -> bool:
    """Whether ``node`` casts a tensor from outside its module to the dtype it has."""
    if target_name(node) not in _CASTS or not node.args or node.args[0] not in external:
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
        and tuple(before.shape) == tuple(after.shape)
    )


def _one_input(mapper, path, external, escaping) -> fx.Node:
    """The single tensor a collapsed module reads, and the single value it returns."""
    data = [n for n in external if not is_size_value(n) and n not in mapper.constant]
    if len(data) != 1 or len(escaping) != 1:
        raise Refuse(f"expected one input and one output, got {len(data)} and {len(escaping)}")
    return data[0]


def _collapsed_stmt(mapper, path, module, nodes, escaping, op, args, kwargs, params=()) -> str:
    for leaf in params:
        key = f"{path}.{leaf}" if path else leaf
        if key in mapper.used_params:
            raise Refuse(f"{key} is used by two operators (tied weights)")
        mapper.used_params[key] = path
    if not valid_path(path):
        raise Refuse(unusable_name(path))
    if path in mapper.names and params:
        raise Refuse(f"{path} is called twice")
    name = mapper.unique(path)  # a module without parameters called again: path_1
    mapper.classes.setdefault(path, qualname(type(module)))
    mapper._record_classes(nodes[0])
    kwargs = {**kwargs, **mapper.frozen_kwargs(path)}
    mapper.stmts.append(Stmt(name, op, args, kwargs, path, mapper.shape(escaping[0])))
    return name


def _hf_conv1d(mapper, path, module, nodes, external, escaping) -> str:
    """transformers' Conv1D (GPT-2): y = x @ weight + bias with weight [in, out]."""
    x = _one_input(mapper, path, external, escaping)
    if module.bias is None:
        raise Refuse("a Conv1D without a bias")
    kwargs = {"out_features": int(module.weight.shape[1])}
    return _collapsed_stmt(
        mapper,
        path,
        module,
        nodes,
        escaping,
        "transposed_linear",
        [mapper.value_of(x)],
        kwargs,
        ("weight", "bias"),
    )


def _gelu_tanh(mapper, path, module, nodes, external, escaping) -> str:
    """transformers' NewGELUActivation / GELUTanh: the tanh approximation of gelu written
    out (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), which is gelu(approximate="tanh")."""
    x = _one_input(mapper, path, external, escaping)
    return _collapsed_stmt(
        mapper,
        path,
        module,
        nodes,
        escaping,
        "gelu",
        [mapper.value_of(x)],
        {"approximate": "tanh"},
    )


def _hf_rmsnorm(mapper, path, module, nodes, external, escaping) -> str:
    """A Hugging Face RMSNorm (``hf_norms``): pow, mean, rsqrt and mul, in float32 inside,
    which is ``torch.nn.RMSNorm``: one ``rmsnorm`` statement."""
    x = _one_input(mapper, path, external, escaping)
    kwargs = rmsnorm_kwargs(module)
    return _collapsed_stmt(
        mapper, path, module, nodes, escaping, "rmsnorm", [mapper.value_of(x)], kwargs, ("weight",)
    )


def _hf_moe(mapper, path, module, nodes, external, escaping) -> str:
    """A Hugging Face sparse mixture-of-experts block (``hf_moe``): one ``moe`` statement."""
    x = _one_input(mapper, path, external, escaping)
    kwargs, params = moe_kwargs(module)
    return _collapsed_stmt(
        mapper, path, module, nodes, escaping, "moe", [mapper.value_of(x)], kwargs, params
    )


#: Module classes mapped as one statement: qualified class name -> builder.
COLLAPSED: dict[str, Callable] = {
    "torch.nn.modules.activation.MultiheadAttention": _multihead_attention,
    "transformers.pytorch_utils.Conv1D": _hf_conv1d,
    "transformers.activations.NewGELUActivation": _gelu_tanh,
    "transformers.activations.GELUTanh": _gelu_tanh,
    "transformers.activations.PytorchGELUTanh": _gelu_tanh,
}


class _Collapse:
    """The torch mapper's collapsed module calls: which nodes belong to a module call
    that ``COLLAPSED`` maps whole, and that call's one statement."""

    def collapser(self, path: str, cls: str) -> Callable | None:
        """The builder that maps the module at ``path`` (class ``cls``) as one statement
        (``COLLAPSED``, or a Hugging Face RMSNorm recognised by its source), else None."""
        found = COLLAPSED.get(cls)
        if found is None and cls.startswith("transformers.") and path:
            with contextlib.suppress(AttributeError):
                module = self.module.get_submodule(path)
                if is_hf_rmsnorm(type(module)):
                    found = _hf_rmsnorm
                elif is_hf_moe_block(module):
                    found = _hf_moe
        return found

    def _collapsed_groups(self) -> dict[fx.Node, str]:
        groups = {}
        for node in self.nodes:
            if node.op != "call_function":
                continue
            for path, cls in self.stack(node):
                if self.collapser(path, cls) is not None:
                    groups[node] = call_group(node, path)
                    break
        return groups

    def _collapse(self, group: str) -> None:
        nodes = [n for n in self.nodes if self.groups.get(n) == group]
        path = group.partition("@")[0]
        members = set(nodes)
        cls = next(c for p, c in self.stack(nodes[0]) if p == path)
        external: list[fx.Node] = []
        for node in nodes:
            for arg in node.all_input_nodes:
                if (
                    arg in members
                    or is_size_value(arg)
                    or arg.op == "placeholder"
                    and (arg.name in self.params or arg.name in self.buffers)
                ):
                    continue
                if arg not in external:
                    external.append(arg)
        escaping = [
            n
            for n in nodes
            if not is_size_value(n) and any(u not in members and u in self.live for u in n.users)
        ]
        # a cast to the dtype a tensor already has is that tensor (Llama's RMSNorm casts its
        # input to float32, and the residual reads the cast): not an output of the module
        aliases = [n for n in escaping if _same_dtype_cast(n, external)]
        escaping = [n for n in escaping if n not in aliases]
        try:
            stmt = self.collapser(path, cls)(
                self, path, self.module.get_submodule(path), nodes, external, escaping
            )
        except Poisoned:
            for node in nodes:
                self._poison(node)
            return
        except Refuse as exc:
            self._fail(nodes[0], cls, str(exc))
            for node in nodes:
                self._poison(node)
            return
        for node in escaping:
            self.values[node] = stmt
        for node in aliases:
            self.values[node] = self.values[node.args[0]]
