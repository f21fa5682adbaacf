"""``NodeView``: what an ``onnx_ops`` mapper sees of one ONNX node.

Kept apart from the mapper so that the mapper's pieces (``onnx_collapse``) build views
without importing the front end."""

from __future__ import annotations

import numpy as np

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH
from unroller.importer.onnx_nodes import (
    B1,
    B2,
    UNBOUNDED,
    attr_value,
    non_finite,
)


class NodeView:
    """What an ``onnx_ops`` mapper sees of one node (see that module's docstring)."""

    def __init__(self, mapper, index: int):
        self.m = mapper
        self.index = index
        self.node = mapper.nodes[index]
        self.op = self.node.op_type
        self.opset = mapper.opset
        self.attrs = {a.name: attr_value(mapper.onnx, a) for a in self.node.attribute}

    def attr(self, name: str, default=None):
        """An attribute's value; an infinite or NaN float is the file's error (the model
        language has no literal for it), except where ONNX gives it a meaning."""
        value = self.attrs.get(name, default)
        if name in self.attrs and non_finite(value) and (self.op, name) not in UNBOUNDED:
            self.m.invalid(self.index, f"its attribute {name} is {value}: expected a finite number")
        return value

    def has(self, i: int) -> bool:
        return i < len(self.node.input) and self.node.input[i] != ""

    def input_name(self, i: int) -> str:
        return self.node.input[i]

    def inputs(self) -> list[int]:
        return [i for i in range(len(self.node.input)) if self.has(i)]

    def is_data(self, i: int) -> bool:
        return self.has(i) and self.node.input[i] in self.m.data

    def value(self, i: int) -> str:
        return self.m.value_of(self.node.input[i])

    def alias(self, i: int) -> str:
        return self.value(i)

    def in_shape(self, i: int) -> tuple:
        return self.m.shape(self.node.input[i])

    def unbatched(self, i: int) -> tuple[int, ...] | None:
        """The shape of input ``i`` when it is a parameter's value without the batch dim (a
        class token, a position table), else None. Maps it first (its statement)."""
        name = self.node.input[i]
        if name in self.m.parameters:
            self.m.value_of(name)
        return self.m.unbatched.get(name)

    def set_unbatched(self, shape: tuple[int, ...]) -> None:
        """This node's output is a value without the batch dim (rows of a table)."""
        self.m.unbatched[self.node.output[0]] = tuple(shape)

    def fx_call(self):
        """The ATen call the dynamo exporter recorded for this node, or None."""
        return self.m.fx[self.index]

    def out_shape(self, k: int = 0) -> tuple:
        return self.m.shape(self.node.output[k])

    def dtype(self, i: int) -> int | None:
        return self.m.dtypes.get(self.node.input[i])

    def const(self, i: int, what: str) -> np.ndarray:
        """A constant argument's value; Refuse if it is data or depends on the batch."""
        if not self.has(i):
            raise Refuse(f"it has no {what}")
        name = self.node.input[i]
        if name in self.m.data:
            raise Refuse(f"its {what} is computed from the input data, not a constant")
        a, b = self.m.pair(name)
        if a is not b and not np.array_equal(a, b):
            raise Refuse(f"its {what} depends on the batch size")
        return a

    def const_pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """A constant input's values at both batch sizes (the same array at a fixed batch)."""
        if self.is_data(i):
            raise Refuse(f"its input {i} is computed from the input data, not a constant")
        return self.m.pair(self.node.input[i])

    def sizes(self, i: int, what: str) -> tuple:
        """A 1-D integer shape argument, with ``N`` where it is the batch size."""
        if not self.has(i):
            raise Refuse(f"it has no {what}")
        name = self.node.input[i]
        if name in self.m.data:
            raise Refuse(f"its {what} is computed from the input data")
        a, b = (np.asarray(v).reshape(-1) for v in self.m.pair(name))
        out: list = []
        for k, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
            if x == y:
                fixed_batch = self.m.batch is not None and k == 0 and x == self.m.batch
                out.append(BATCH if fixed_batch else int(x))
            elif (x, y) == (B1, B2):
                out.append(BATCH)
            else:
                raise Refuse(f"its {what} has a size computed from the batch size other than N")
        return tuple(out)

    def is_weight(self, i: int, leaf: str) -> bool:
        """Whether input ``i`` is an initializer named like a module's ``leaf``."""
        if not self.has(i) or self.node.input[i] in self.m.data:
            return False
        name = self.node.input[i]
        if name not in self.m.inits and name not in self.m.aliases:
            return False
        path, _, got = name.rpartition(".")
        return got == leaf and bool(path)

    def is_initializer(self, i: int) -> bool:
        name = self.node.input[i] if self.has(i) else ""
        return name in self.m.inits or name in self.m.aliases

    def param_shape(self, i: int, leaf: str) -> tuple[int, ...]:
        key = self.m.weight_key(self.node.input[i], leaf)
        return tuple(self.m.init_shape(key))

    def transposed_weight(self, i: int) -> str | None:
        """The initializer input ``i`` is the transpose of (``MatMul`` by ``W^T``)."""
        return self.m.transposed.get(self.node.input[i]) if self.has(i) else None

    def initializer_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.m.init_shape(name))

    def layer(self, **roles: int | str) -> str:
        """The statement name of a layer whose state is these initializers (leaf name ->
        input index, or a value name): their common module path."""
        names = {
            leaf: (self.node.input[ref] if isinstance(ref, int) else ref)
            for leaf, ref in roles.items()
        }
        return self.m.claim(names)

    def buffer(self, key: str, shape: tuple[int, ...]) -> None:
        """State the imported module holds that the file does not (num_batches_tracked)."""
        self.m.state[key] = (None, tuple(shape))

    def stmt(self, op: str, args: list[str], layer: str | None = None, **kwargs) -> str:
        return self.m.add_stmt(self.index, op, args, layer, kwargs)

    def users(self, k: int = 0) -> list[NodeView]:
        """The live nodes that read output ``k`` (to fuse a following ``Add``)."""
        out = self.node.output[k]
        if out == self.m.output:
            return []
        return [NodeView(self.m, j) for j in self.m.live_users(out)]

    def absorb(self, other: NodeView, value: str) -> None:
        """``other``'s output is ``value`` (a bias ``Add`` fused into a linear)."""
        self.m.absorbed[other.index] = value

    def module_class(self) -> str:
        return self.m.where[self.index].cls

    def where(self) -> str:
        return self.m.where[self.index].path

    def note(self, text: str) -> None:
        if text not in self.m.notes:
            self.m.notes.append(text)
