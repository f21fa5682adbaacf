"""Patterns of Hugging Face models recognised across several ATen nodes before the walk:
constants (masks, zero states, uniform gathers), rotary embeddings, position ids, T5's
relative attention bias, and biases hidden behind a mask; each becomes one statement or is
absorbed into the statement that reads it."""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from unroller.importer import rotary
from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH, EXAMPLE_BATCH
from unroller.importer.torch_nodes import (
    COPIES,
    Poisoned,
    constant_value,
    draws_random,
    is_size_value,
    target_name,
)
from unroller.importer.torch_view import NodeView
from unroller.runtime.positions import relative_buckets

_RESHAPES = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")


class _Patterns:
    """The torch mapper's multi-node patterns: found once in ``__init__``, mapped
    during the walk (``_map_rotary``, ``_map_relative_bias``)."""

    def _constant_nodes(self) -> set[fx.Node]:
        """Tensors computed from sizes and constants only (masks, ``zeros`` states):
        not statements; a consumer that accepts them (an attention mask) evaluates them."""
        constant: set[fx.Node] = set()
        for node in self.nodes:
            if node.op == "placeholder":
                if node.name in self.constants:
                    constant.add(node)
            elif node.op == "call_function" and not is_size_value(node):
                if target_name(node) == "aten.sym_size.int" or draws_random(node):
                    continue  # a random draw is not a constant of the code
                inputs = [a for a in node.all_input_nodes if not is_size_value(a)]
                if all(a in constant for a in inputs):
                    constant.add(node)
                elif self._uniform_gather(node, constant):
                    constant.add(node)
        return constant

    def _uniform_gather(self, node: fx.Node, constant: set[fx.Node]) -> bool:
        """A gather from a constant tensor whose elements are all one value (RoBERTa's
        zero token types gathered at the position ids): that value everywhere, whatever
        the indices, so a constant of the index's shape (``self.uniform``)."""
        if target_name(node) != "aten.gather.default" or node.args[0] not in constant:
            return False
        try:
            source = constant_value(self, node.args[0])
        except Refuse:
            return False
        if not isinstance(source, torch.Tensor) or source.numel() == 0:
            return False
        first = source.reshape(-1)[0]
        if not bool((source == first).all()):
            return False
        self.uniform[node] = first.item()
        return True

    def _rotary_patterns(self) -> tuple[dict[fx.Node, rotary.Rotary], set[fx.Node]]:
        """Rotary embeddings (``rotary``): the final add of each -> the match; the nodes
        the matches replace, which are then not mapped one by one."""
        found: dict[fx.Node, rotary.Rotary] = {}
        absorbed: set[fx.Node] = set()
        tries = None
        for node in self.nodes:
            if (
                node not in self.live
                or node in self.groups
                or target_name(node) != "aten.add.Tensor"
            ):
                continue
            if tries is None:
                tries = rotary.candidates(self.module)
            hit = rotary.match(
                node, target_name, self.constant, lambda n: constant_value(self, n), tries
            )
            if hit is None:
                continue
            inside = hit.nodes | {node}
            if any(u not in inside for n in hit.nodes for u in n.users if u in self.live):
                continue  # a part of it is read elsewhere: map the nodes one by one
            found[node] = hit
            absorbed |= hit.nodes
        return found, absorbed

    def _position_patterns(self) -> dict[fx.Node, tuple[fx.Node, int]]:
        """Position ids computed from the token ids (RoBERTa's
        ``create_position_ids_from_input_ids``): an integer tensor that an embedding looks
        up, computed from one integer input only, whose values equal ``padded_positions``
        of that input for the embedding's padding_idx on sample ids, padding included ->
        (the input, padding_idx). Its nodes are then not mapped one by one."""
        found: dict[fx.Node, tuple[fx.Node, int]] = {}
        for node in self.nodes:
            if node not in self.live or target_name(node) != "aten.embedding.default":
                continue
            idx = node.args[1] if len(node.args) > 1 else None
            if not isinstance(idx, fx.Node) or idx.op == "placeholder" or idx in self.constant:
                continue
            hit = self._positions_of(node, idx)
            if hit is not None:
                found[idx] = hit
                self.absorbed |= hit[2]
        return {k: (ids, pad) for k, (ids, pad, _) in found.items()}

    def _relative_bias_patterns(self) -> dict[fx.Node, tuple[fx.Node, dict]]:
        """T5's relative position bias: a table (an embedding's weight) looked up at a
        constant [L, S] index table without the batch dim, permuted to [H, L, S] and
        unsqueezed to [1, H, L, S] -> the unsqueeze: (the embedding node, the
        ``relative_position_bias`` arguments). Taken only when the constant indices equal the
        op's buckets bit for bit, for a max_distance the module holds (T5Attention's
        ``relative_attention_max_distance``) and one direction or both; the nodes are then
        not mapped one by one."""
        found: dict[fx.Node, tuple[fx.Node, dict]] = {}
        for node in self.nodes:
            if node not in self.live or target_name(node) != "aten.embedding.default":
                continue
            ids = node.args[1] if len(node.args) > 1 else None
            if ids not in self.constant or len(node.users) != 1:
                continue
            (permute,) = node.users
            if target_name(permute) != "aten.permute.default" or len(permute.users) != 1:
                continue
            (unsqueeze,) = permute.users
            if (
                [int(d) for d in permute.args[1]] != [2, 0, 1]
                or target_name(unsqueeze) != "aten.unsqueeze.default"
                or int(unsqueeze.args[1]) != 0
            ):
                continue
            kwargs = self._bucket_kwargs(node, ids)
            if kwargs is not None:
                found[unsqueeze] = (node, kwargs)
                self.absorbed |= {node, permute}
        return found

    def _absorb_masked_biases(self) -> None:
        """An attention's attn_mask written ``where(constant mask, bias, lowest)`` (and
        copies of it) is read whole by the attention statement (``attention_bias``): its
        nodes are not mapped one by one when nothing else reads them."""
        for node in self.nodes:
            if node not in self.live or node in self.groups:
                continue
            if target_name(node) != "aten.scaled_dot_product_attention.default":
                continue
            mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            if not isinstance(mask, fx.Node) or mask in self.constant:
                continue
            chain, current = [], mask
            while target_name(current) in COPIES:
                chain.append(current)
                current = current.args[0]
            if target_name(current) == "aten.where.ScalarOther" and (
                current.args[0] in self.constant
                or current.args[0] in self.padding.found
                or current.args[0] in self.padding.refused
            ):
                chain.append(current)
                inside = set(chain) | {node}
                if all(u in inside for n in chain for u in n.users if u in self.live):
                    self.absorbed |= set(chain)

    def _repeated_kv_patterns(self) -> dict[fx.Node, tuple[fx.Node, fx.Node]]:
        """Grouped-query attention written with Hugging Face's ``repeat_kv`` (each key and
        value head unsqueezed, expanded over its group of query heads and reshaped to the
        query's head count) -> the attention node: (the key, the value) before repeating.
        The attention then reads them with ``enable_gqa``: the same sums, and the step keeps
        the Hkv heads for the backward instead of a copy per query head (as autograd does
        when Hugging Face passes ``enable_gqa`` to SDPA, which it does without a mask). The
        repeat's nodes are not mapped when nothing else reads them."""
        found: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
        for node in self.nodes:
            if node not in self.live or node in self.groups:
                continue
            if target_name(node) != "aten.scaled_dot_product_attention.default":
                continue
            if node.kwargs.get("enable_gqa") or (len(node.args) > 7 and node.args[7]):
                continue
            hits = [self._repeat_source(node.args[i]) for i in (1, 2)]
            if any(hit is None for hit in hits):
                continue
            (key, key_chain), (value, value_chain) = hits
            chain = set(key_chain) | set(value_chain)
            if any(u not in chain | {node} for n in chain for u in n.users if u in self.live):
                continue  # the repeated heads are read elsewhere too
            found[node] = (key, value)
            self.absorbed |= chain
        return found

    def _repeat_source(self, node: object) -> tuple[fx.Node, list[fx.Node]] | None:
        """(x, the nodes from x's unsqueeze to ``node``) when ``node`` is ``repeat_kv(x)``:
        x [N, Hkv, S, D] unsqueezed at dim 2, expanded to [N, Hkv, R, S, D] (R > 1) and
        reshaped to [N, Hkv * R, S, D]; else None."""
        if not isinstance(node, fx.Node):
            return None
        chain = []
        current = node
        while target_name(current) in COPIES:
            chain.append(current)
            current = current.args[0]
        if target_name(current) not in _RESHAPES:
            return None
        reshape = current
        expand = reshape.args[0]
        if not isinstance(expand, fx.Node) or target_name(expand) != "aten.expand.default":
            return None
        unsqueeze = expand.args[0]
        if not isinstance(unsqueeze, fx.Node) or target_name(unsqueeze) != "aten.unsqueeze.default":
            return None
        source = unsqueeze.args[0]
        try:
            shapes = [self.shape(n) for n in (source, expand, node)]
        except Refuse:
            return None
        src, big, out = shapes
        if len(src) != 4 or len(big) != 5 or int(unsqueeze.args[1]) not in (2, -3):
            return None
        groups = big[2]
        if not isinstance(groups, int) or groups < 2 or big[:2] + big[3:] != src:
            return None
        if not isinstance(src[1], int) or out != (src[0], src[1] * groups, *src[2:]):
            return None
        return source, [*chain, reshape, expand, unsqueeze]

    def _bucket_kwargs(self, embedding: fx.Node, ids: fx.Node) -> dict | None:
        try:
            table = constant_value(self, ids)
        except Refuse:
            return None
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.long:
            return None
        buckets = int(embedding.args[0].meta["val"].shape[0])
        distances = []
        for path, _ in reversed(self.stack(embedding)):
            with contextlib.suppress(AttributeError):
                found = self.module.get_submodule(path).relative_attention_max_distance
                if isinstance(found, int):
                    distances.append(found)
        length, keys = (int(d) for d in table.shape)
        for distance in dict.fromkeys([*distances, 128]):
            for both in (True, False):
                kwargs = dict(
                    num_buckets=buckets,
                    query_length=length,
                    key_length=keys,
                    max_distance=distance,
                    bidirectional=both,
                )
                with contextlib.suppress(ValueError, ZeroDivisionError, RuntimeError):
                    ours = relative_buckets(length, keys, buckets, distance, both)
                    if distance > buckets // (2 if both else 1) // 2 and torch.equal(ours, table):
                        return kwargs
        return None

    def _positions_of(self, embedding: fx.Node, idx: fx.Node):
        val = idx.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.int64 or val.dim() != 2:
            return None
        inputs, inside = set(), []
        todo, seen = [idx], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            if current.op == "placeholder":
                if current.name not in self.user_inputs:
                    return None  # reads a parameter or buffer
                inputs.add(current)
                continue
            if target_name(current) != "aten.sym_size.int":
                inside.append(current)
                todo.extend(current.all_input_nodes)
        if len(inputs) != 1:
            return None
        (ids,) = inputs
        if ids.meta["val"].dtype != torch.int64 or tuple(ids.meta["val"].shape[1:]) != tuple(
            val.shape[1:]
        ):
            return None
        inside_set = set(inside)
        if any(
            u not in inside_set and u is not embedding
            for n in inside
            for u in n.users
            if u in self.live and n is not idx
        ):
            return None  # a part of it is read elsewhere
        path, _ = self.where(embedding)
        pads = []
        with contextlib.suppress(AttributeError):
            pads.append(self.module.get_submodule(path).padding_idx)
        pads += [1, 0]
        for pad in dict.fromkeys(p for p in pads if isinstance(p, int) and p >= 0):
            if self._computes_positions(idx, ids, inside_set, pad):
                return ids, pad, inside_set - {idx}
        return None

    def _computes_positions(self, idx, ids, inside: set, pad: int) -> bool:
        """Whether the subgraph gives ``padded_positions(sample, pad)`` on sample ids (with
        padding tokens, rows of only padding and rows without any)."""
        from unroller.runtime.common import padded_positions

        length = int(ids.meta["val"].shape[1])
        generator = torch.Generator().manual_seed(0)
        for trial in range(4):
            sample = torch.randint(0, pad + 50, (EXAMPLE_BATCH, length), generator=generator)
            sample[:, ::3] = pad if trial % 2 else sample[:, ::3]
            if trial == 3:
                sample[0] = pad
            try:
                got = self._run_on(idx, ids, sample, inside)
            except Exception:  # noqa: BLE001 - not a computation of the ids alone
                return False
            if not isinstance(got, torch.Tensor) or not torch.equal(
                got, padded_positions(sample, padding_idx=pad)
            ):
                return False
        return True

    def _run_on(self, idx: fx.Node, ids: fx.Node, sample: torch.Tensor, inside: set) -> object:
        """The value of ``idx`` with the input ``ids`` set to ``sample``."""
        values: dict[fx.Node, object] = {ids: sample}
        for node in self.nodes:
            if target_name(node) == "aten.sym_size.int":
                if node.args[0] is ids:
                    values[node] = sample.shape[int(node.args[1])]
                continue
            if node not in inside:
                continue
            args = fx.node.map_arg(node.args, values.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
            values[node] = node.target(*args, **kwargs)
        return values.get(idx)

    def padding_value(self, mask: fx.Node) -> str:
        """The ``padding_mask`` statement of the input a matched mask is computed from
        (``masks.find``): one per input, named by the first mask read."""
        ids, _ = self.padding.found[mask]
        if ids not in self.padding_values:
            length = self.dim(ids.meta["val"].shape[1])
            self.padding_values[ids] = self.add_stmt(
                mask, "padding_mask", [self.value_of(ids)], None, {}, (BATCH, 1, 1, length)
            )
        return self.padding_values[ids]

    def _map_rotary(self, node: fx.Node, hit: rotary.Rotary) -> None:
        """One ``rotary`` statement for a matched rotary embedding (``_rotary_patterns``)."""
        if hit.theta is None:
            self._fail(node, "rotary position embedding", hit.why)
            return
        try:
            view = NodeView(self, node, target_name(node))
            kwargs = {"theta": hit.theta}
            if hit.scaling != 1.0:
                kwargs["scaling"] = hit.scaling
            self.values[node] = view.stmt("rotary", [self.value_of(hit.x)], **kwargs)
        except Poisoned:
            self._poison(node)
        except Refuse as exc:
            self._fail(node, "rotary position embedding", str(exc))

    def _map_relative_bias(self, node: fx.Node, embedding: fx.Node, kwargs: dict) -> None:
        """One ``relative_position_bias`` statement for a matched T5 bias, named by its
        table's module (``_relative_bias_patterns``)."""
        try:
            view = NodeView(self, embedding, target_name(embedding))
            layer = view.layer("weight")
            heads = int(embedding.args[0].meta["val"].shape[1])
            self.values[node] = view.stmt(
                "relative_position_bias",
                [],
                layer=layer,
                value_shape=self.shape(node),
                heads=heads,
                **kwargs,
            )
        except Poisoned:
            self._poison(node)
        except Refuse as exc:
            self._fail(node, "relative position bias", str(exc))
