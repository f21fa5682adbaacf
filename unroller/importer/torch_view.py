"""``NodeView``: what an ``aten_ops`` mapper sees of one node of the exported graph.

Kept apart from the mapper so that the mapper's pieces (``torch_collapse``,
``torch_patterns``) build views without importing the front end."""

from __future__ import annotations

import torch
from torch import fx

from unroller.importer import batch_merge
from unroller.importer.aten_ops import Refuse, schema_arguments
from unroller.importer.model import BATCH
from unroller.importer.torch_nodes import (
    constant_value,
    is_causal_mask,
    is_size_value,
    reads_data,
    target_name,
    through_copies,
)


class NodeView:
    """What an ``aten_ops`` mapper sees of one node (see that module's docstring)."""

    def __init__(self, mapper, node: fx.Node, target: str):
        self.m = mapper
        self.node = node
        self.target = target
        self.a = schema_arguments(node)
        if node in mapper.merged.lead:  # dims counted on the unmerged shape
            self.a = batch_merge.unmerge_dims(self.a, mapper.merged.lead[node])
        self.keys = list(self.a)
        for one, other in (("self", "input"), ("input", "self")):
            if one in self.a and other not in self.a:  # mappers may say either
                self.a[other] = self.a[one]
        self.keys = list(self.a)

    def _arg(self, key):
        return self.a[self.keys[key]] if isinstance(key, int) else self.a[key]

    def is_tensor(self, value) -> bool:
        return isinstance(value, fx.Node) and not is_size_value(value)

    def value(self, key) -> str:
        return self.m.value_of(self._arg(key))

    def value_of(self, node) -> str:
        return self.m.value_of(node)

    def in_shape(self, key) -> tuple:
        return self.m.shape(self._arg(key))

    def shape_of(self, node) -> tuple:
        return self.m.shape(node)

    def out_shape(self) -> tuple:
        return self.m.shape(self.node)

    def sizes(self, values) -> tuple:
        out = []
        for v in values:
            val = v.meta.get("val") if isinstance(v, fx.Node) else v
            d = self.m.dim(val)
            if isinstance(d, str) and d != BATCH:
                raise Refuse(f"a size that depends on the batch ({d[1:]})")
            out.append(d)
        return tuple(out)

    def param_key(self, key: str) -> str | None:
        node = self.a.get(key)
        if node is None:
            return None
        if not isinstance(node, fx.Node) or node.name not in self.m.params:
            raise Refuse(f"its {key} is computed, not a parameter")
        return self.m.params[node.name]

    def param_shape(self, key: str) -> tuple[int, ...]:
        self.param_key(key)
        return tuple(int(d) for d in self.a[key].meta["val"].shape)

    def layer(self, *param_keys: str, **buffer_keys: str) -> str:
        """The statement name of a layer whose tensors are these parameters and buffers:
        their common module path, each key named as the registry names it."""
        owner = None
        claims = []
        for key in param_keys:
            full = self.param_key(key)
            if full is None:
                continue
            claims.append((full, key, True))
        for key, arg in buffer_keys.items():
            node = self.a.get(arg)
            if node is None:
                continue
            if not isinstance(node, fx.Node) or node.name not in self.m.buffers:
                raise Refuse(f"its {arg} is not a buffer")
            claims.append((self.m.buffers[node.name], key, False))
        ties = {}
        for i, (full, key, is_param) in enumerate(claims):
            if is_param and self.m.shared_keys.get(full):
                full, tied_to = self._tied_claim(full, key)
                claims[i] = (full, key, is_param)
                if tied_to is not None:
                    ties[key] = tied_to
            path, _, leaf = full.rpartition(".")
            if leaf != key:
                raise Refuse(f"its {key} is the tensor {full}, not a module's '{key}'")
            if owner is not None and path != owner:
                raise Refuse(f"its tensors belong to different modules ({owner}, {path})")
            owner = path
        if owner is None:
            raise Refuse("no parameter or buffer names the layer")
        keys = frozenset(full for full, _, _ in claims)
        if self.m.layer_claims.get(owner) == keys:
            return owner  # a later call of that layer: ``add_stmt`` writes it ``shares=``
        for full, _, _ in claims:
            if full in self.m.used_params or full in self.m.used_buffers:
                raise Refuse(f"{full} is used by two operators (shared weights)")
        self.m.layer_claims[owner] = keys
        if ties:
            self.m.ties[owner] = ties
        for full, _, is_param in claims:
            if is_param:
                self.m.used_params[full] = owner
            else:
                self.m.used_buffers.add(full)
        return owner

    def _tied_claim(self, full: str, key: str) -> tuple[str, str | None]:
        """(the key this node's layer holds the tensor ``full`` under, the key it is tied to
        or None). torch.export names a tensor that several modules share (tied weights) by
        one of its keys; the node's own module holds it as its ``key`` parameter, and the
        first key of the tensor in state-dict order owns it, the others are tied to it."""
        path, _ = self.m.where(self.node)
        try:
            theirs = self.m.module.get_parameter(full)
            mine = self.m.module.get_submodule(path)._parameters.get(key) if path else None
        except AttributeError:
            return full, None
        if mine is None or mine is not theirs:
            return full, None
        own = f"{path}.{key}"
        first = self.m.first_keys.get(id(theirs), own)
        return own, (first if first != own else None)

    def expect_buffer(self, key: str) -> None:
        if key not in self.m.buffers.values():
            raise Refuse(f"the module has no buffer {key}")
        self.m.used_buffers.add(key)

    def stmt(
        self, op: str, args: list[str], layer: str | None = None, value_shape=None, **kwargs
    ) -> str:
        """A statement for this node; ``value_shape`` when the registry op's output differs
        from the node's (a value without the batch dim that broadcasts like the node's)."""
        return self.m.add_stmt(self.node, op, args, layer, kwargs, value_shape)

    def alias(self, key) -> str:
        return self.m.value_of(self._arg(key))

    def constant(self, key):
        """The value of an argument computed from sizes and constants only (evaluated at
        the capture batch size), else None."""
        node = self._arg(key)
        if isinstance(node, fx.Node) and node in self.m.constant:
            return constant_value(self.m, node)
        return None

    def causal_mask(self, mask, causal: bool) -> bool:
        return is_causal_mask(self.m, mask, causal)

    def attention_bias(self, mask, causal: bool) -> tuple[bool, str | None]:
        """(causal, the value of an additive score bias or None) for an attention's
        attn_mask: a constant mask is the causal one or nothing (``is_causal_mask``); one
        computed from the weights or inputs is a bias, where Hugging Face writes it as
        ``where(constant mask, bias, lowest float)``, the constant part read as the causal
        mask or nothing and the bias kept; a float mask as it is."""
        if not reads_data(self.m, mask):
            return is_causal_mask(self.m, mask, causal), None
        node = through_copies(mask)
        padding = self.m.padding
        if target_name(node) == "aten.where.ScalarOther" and node.args[0] in padding.refused:
            raise Refuse(padding.refused[node.args[0]])
        if node in padding.refused:
            raise Refuse(padding.refused[node])
        if node in padding.found:  # a padding mask given as an input (masks.find)
            # [N, 1, 1, S] broadcast to the attention's [N, 1, L, S] (a view)
            size = (BATCH, 1, self.out_shape()[2], self.m.shape(node)[-1])
            key = (padding.found[node][0], size)
            if key not in self.m.padding_values:
                pad = self.m.padding_value(node)
                stmt = self.m.add_stmt(node, "expand", [pad], None, {"size": size}, size)
                self.m.padding_values[key] = stmt
            return causal or padding.found[node][1], self.m.padding_values[key]
        if target_name(node) == "aten.where.ScalarOther" and node.args[0] in padding.found:
            lowest = node.args[2]
            if not isinstance(lowest, (int, float)) or lowest > -1e30:
                raise Refuse(f"an attention mask filled with {lowest!r}: expected a lowest float")
            # the bias where attended, and (near) lowest where padded: probabilities 0 there
            pad = self.m.padding_value(node.args[0])
            summed = self.m.add_stmt(node, "add", [self.m.value_of(node.args[1]), pad], None, {})
            return causal or padding.found[node.args[0]][1], summed
        if target_name(node) == "aten.where.ScalarOther" and node.args[0] in self.m.constant:
            lowest = node.args[2]
            if not isinstance(lowest, (int, float)) or lowest > -1e30:
                raise Refuse(f"an attention mask filled with {lowest!r}: expected a lowest float")
            causal = is_causal_mask(self.m, node.args[0], causal)
            return causal, self.m.value_of(node.args[1])
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            raise Refuse("a boolean attention mask computed from the inputs or the weights")
        return causal, self.m.value_of(node)
