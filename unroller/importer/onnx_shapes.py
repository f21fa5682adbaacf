"""Shapes and constants of an ONNX graph, node by node, at one or two batch sizes
(``B1``, ``B2``): ONNX shape inference and ``onnx.reference`` folding, each result's size
bounded before it is computed (the module docstring of ``onnx_frontend`` says why)."""

from __future__ import annotations

import math
from typing import NoReturn

import numpy as np

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH, ImportFailure
from unroller.importer.onnx_nodes import (
    DEFAULT_DOMAINS,
    FOLDED,
    MAX_CONST_ELEMENTS,
    MAX_INT,
    NUMERIC,
    SMALL,
    elem_of,
    itemsize,
    np_dtype_of,
    numel,
    one_line,
    type_name,
    value_dims,
)


class _Shapes:
    """The ONNX mapper's shape inference and constant folding (see the module docstring)."""

    def invalid(self, i: int, reason: str) -> NoReturn:
        """Stop at a node the file got wrong (not an operation the registry lacks): one
        line naming the file and the node."""
        node = self.nodes[i]
        label = f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node #{i}"
        raise ImportFailure(f"{self.source}: {label}: {reason}")

    def _infer_node(self, node, shapes: dict[str, tuple], which: int) -> None:
        """ONNX shape inference of one data node into ``shapes`` (run ``which``)."""
        if node.op_type == "SequenceAt" and node.domain in DEFAULT_DOMAINS:
            self._infer_piece(node, shapes)
            return
        helper = self.onnx.helper
        ins, inits, seen = [], [], set()
        for name in node.input:
            if not name or name in seen:
                continue
            seen.add(name)
            if name in self.data:
                dims = shapes.get(name)
                ins.append(helper.make_tensor_value_info(name, self.dtypes.get(name, 0), dims))
                continue
            if name in self.inits and name not in self.pairs:
                tensor = self.inits[name]
                elem, dims = tensor.data_type, list(tensor.dims)
                small = numel(tensor) <= SMALL
            else:
                value = self.pairs[name][which]
                tensor = (
                    self.onnx.numpy_helper.from_array(value, name) if value.size <= SMALL else None
                )
                elem, dims, small = (
                    elem_of(self.onnx, value),
                    list(value.shape),
                    value.size <= SMALL,
                )
            if small:
                inits.append(tensor)
            else:
                ins.append(helper.make_tensor_value_info(name, elem, dims))
        graph = helper.make_graph([node], "node", ins, [], initializer=inits)
        model = helper.make_model(
            graph, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version
        )
        try:
            inferred = self.onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001 - no shapes: the mappers that need them refuse
            return
        for value in inferred.graph.value_info:
            if value.type.HasField("tensor_type"):
                self.dtypes[value.name] = value.type.tensor_type.elem_type
                dims = value_dims(value)
                if dims is not None:
                    shapes[value.name] = tuple(d if isinstance(d, int) else None for d in dims)

    def _infer_piece(self, node, shapes: dict[str, tuple]) -> None:
        """A tensor read from a sequence: ONNX infers no shape through sequence types, so
        the piece's shape comes from ``split_piece`` (none where it refuses: the mapper
        says why)."""
        try:
            source, axis, start, end, squeezed = self.split_piece(node, shapes)
        except Refuse:
            return
        dims = list(shapes[source])
        dims[axis] = end - start
        if squeezed:
            del dims[axis]
        shapes[node.output[0]] = tuple(dims)
        self.dtypes[node.output[0]] = self.dtypes.get(source, 0)

    def split_piece(self, node, shapes) -> tuple[str, int, int, int, bool]:
        """(source, axis, start, end, squeezed) of the piece a ``SequenceAt`` node reads
        from a ``SplitToSequence`` at a constant position: a slice of the source (the
        sequence exists only as those slices, so nothing else may read it)."""
        made = self.producer.get(node.input[0])
        split = self.nodes[made] if made is not None else None
        if split is None or split.op_type != "SplitToSequence" or len(node.input) < 2:
            raise Refuse("a SequenceAt of a sequence that no SplitToSequence makes")
        source = split.input[0]
        dims = shapes.get(source)
        if source not in self.data or not dims or None in dims:
            raise Refuse(f"the shape of {source} is not known")
        attrs = {a.name: a.i for a in split.attribute}
        axis = attrs.get("axis", 0)
        if not -len(dims) <= axis < len(dims) or axis % len(dims) == 0:
            raise Refuse(f"splitting {source} along axis {axis} (the batch dim or none)")
        axis %= len(dims)
        size = dims[axis]
        sizes = self._split_sizes(split, size)
        position = self._constant_int(node.input[1], "its position")
        if not -len(sizes) <= position < len(sizes):
            raise Refuse(f"position {position} of a sequence of {len(sizes)} tensors")
        position %= len(sizes)
        start = sum(sizes[:position])
        squeezed = len(split.input) < 2 or not split.input[1]
        squeezed = squeezed and not attrs.get("keepdims", 1)
        return source, axis, start, start + sizes[position], squeezed

    def _split_sizes(self, split, size: int) -> list[int]:
        """The piece sizes of ``SplitToSequence``: ones without ``split``, pieces of a scalar
        split (the last one shorter), or the 1-D list, which must add up to ``size``."""
        if len(split.input) < 2 or not split.input[1]:
            return [1] * size
        name = split.input[1]
        if name in self.data or not self.is_constant(name):
            raise Refuse("a SplitToSequence whose split is computed from the data")
        a, b = self.pair(name)
        if not np.array_equal(a, b) or a.dtype.kind not in "iu" or a.ndim > 1:
            raise Refuse("a SplitToSequence split that is not constant integers")
        if a.ndim == 0:
            step = int(a)
            if step < 1:
                raise Refuse(f"a SplitToSequence split of {step}")
            return [min(step, size - k) for k in range(0, size, step)]
        sizes = [int(v) for v in a.tolist()]
        if any(v < 0 for v in sizes) or sum(sizes) != size:
            raise Refuse(f"a SplitToSequence split {sizes} of a dim of {size}")
        return sizes

    def _constant_int(self, name: str, what: str) -> int:
        if name in self.data or not self.is_constant(name):
            raise Refuse(f"{what} is computed from the data")
        a, b = self.pair(name)
        if a.size != 1 or a.dtype.kind not in "iu" or not np.array_equal(a, b):
            raise Refuse(f"{what} is not one constant integer")
        return int(a.reshape(()))

    def shape(self, name: str) -> tuple:
        """A data value's shape, ``N`` first; Refuse if unknown or the batch is not first."""
        if name in self.unbatched:
            raise Refuse(
                f"{name} {list(self.unbatched[name])} is a parameter's value without the batch "
                "dim: only an elementwise op with a batched value or an expand reads it"
            )
        raw = self.shapes.get(name)
        if raw is None:
            raise Refuse(f"ONNX shape inference gives no shape for {name}")
        if not raw:
            raise Refuse(f"{name} is a scalar, with no batch dim")
        first = raw[0]
        if self.batch is not None and first == self.batch:
            first = BATCH
        shown = [str(d) if d is not None else "?" for d in (first, *raw[1:])]
        if first is not BATCH:
            raise Refuse(f"{name} [{', '.join(shown)}] does not keep the batch dim first")
        if any(d is None or d is BATCH for d in raw[1:]):
            raise Refuse(f"{name} [{', '.join(shown)}] has a size that is unknown or the batch's")
        if any(not 0 < d <= MAX_INT for d in raw[1:]):
            raise Refuse(f"{name} [{', '.join(shown)}] has a size that is not in 1..{MAX_INT}")
        return (BATCH, *raw[1:])

    def pair(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.pairs:
            array = self.onnx.numpy_helper.to_array(self.inits[name])
            self.pairs[name] = (array, array)
        return self.pairs[name]

    def is_constant(self, name: str) -> bool:
        return name in self.pairs or (name in self.inits and name not in self.data)

    def _fold_node(self, i: int, runs: list[dict]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        node = self.nodes[i]
        if node.domain not in DEFAULT_DOMAINS or any(a.type in (5, 10) for a in node.attribute):
            return None  # other domains and control flow (subgraph attributes) are data
        names = [n for n in node.input if n]
        if node.op_type in ("Shape", "Size") and names and names[0] in self.data:
            return self._fold_shape(node, runs)
        if node.op_type == "CastLike" and len(names) == 2 and names[1] in self.data:
            if not self.is_constant(names[0]):
                return None
            target = np_dtype_of(self.onnx, self.dtypes.get(names[1], 1))
            a, b = self.pair(names[0])
            return [(a.astype(target), b.astype(target))]
        if any(not self.is_constant(n) for n in names):
            return None
        if node.op_type not in FOLDED:
            self.invalid(i, "computes a constant with an op this importer does not evaluate")
        pairs = [self.pair(n) for n in names]
        first = self._evaluate(i, [p[0] for p in pairs])
        if all(p[0] is p[1] for p in pairs):
            return [(r, r) for r in first]
        second = self._evaluate(i, [p[1] for p in pairs])
        return list(zip(first, second))

    def _fold_shape(self, node, runs: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        source = node.input[0]
        known = [run.get(source) for run in runs]
        if any(dims is None or None in dims for dims in known):
            raise Refuse(f"the shape of {source} is not known")
        first, second = known[0], known[-1]
        if node.op_type == "Size":
            return [(np.array(np.prod(first), np.int64), np.array(np.prod(second), np.int64))]
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(first))
        return [(np.array(first[start:end], np.int64), np.array(second[start:end], np.int64))]

    def _evaluate(self, i: int, args: list[np.ndarray]) -> list[np.ndarray]:
        node = self.nodes[i]
        feeds = {name: value for name, value in zip([n for n in node.input if n], args)}
        self._bound_constant(i, feeds)
        try:
            evaluator = self.onnx.reference.ReferenceEvaluator(node, opsets={"": self.opset})
            results = [np.asarray(r) for r in evaluator.run(None, feeds)]
        except Exception as exc:  # noqa: BLE001 - the reference runtime's error, one line
            self.invalid(i, f"cannot compute this constant: {one_line(exc)}")
        self.const_budget -= sum(r.nbytes for r in results)
        if self.const_budget < 0:
            self.invalid(i, "the constants computed so far exceed the importer's memory budget")
        return results

    def _bound_constant(self, i: int, feeds: dict[str, np.ndarray]) -> None:
        """Refuse, before it is computed, a constant larger than ``MAX_CONST_ELEMENTS`` (or
        than its largest input) or the remaining budget: its size comes from ONNX shape
        inference on the node alone, with the small inputs' values."""
        helper, node = self.onnx.helper, self.nodes[i]
        ins, inits = [], []
        for name, value in feeds.items():
            if value.size <= SMALL:
                inits.append(self.onnx.numpy_helper.from_array(value, name))
            else:
                ins.append(
                    helper.make_tensor_value_info(name, elem_of(self.onnx, value), value.shape)
                )
        graph = helper.make_graph([node], "node", ins, [], initializer=inits)
        model = helper.make_model(
            graph, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version
        )
        try:
            inferred = self.onnx.shape_inference.infer_shapes(model, data_prop=True)
        except Exception as exc:  # noqa: BLE001 - its inputs do not fit the op
            self.invalid(i, f"cannot compute this constant: {one_line(exc)}")
        found = {v.name: v for v in inferred.graph.value_info}
        limit = max([MAX_CONST_ELEMENTS, *(v.size for v in feeds.values())])
        total = 0
        for out in (name for name in node.output if name):
            dims = value_dims(found[out]) if out in found else None
            if dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
                self.invalid(
                    i, f"the size of the constant {out!r} is not known before computing it"
                )
            count = math.prod(dims)
            if count > limit:
                self.invalid(
                    i,
                    f"the constant {out!r} would hold {count} elements {dims} "
                    f"(at most {limit} are computed)",
                )
            elem = found[out].type.tensor_type.elem_type
            if elem not in NUMERIC:
                kind = type_name(self.onnx, elem)
                self.invalid(i, f"computes the constant {out!r} of {kind}, not numbers")
            total += count * itemsize(self.onnx, elem)
        if total > self.const_budget:
            self.invalid(i, f"its {total} bytes of constants exceed the importer's memory budget")

    def _track_weight_views(self, node) -> None:
        """Identity(initializer) (the TorchScript exporter's deduplication) and the
        Transpose of a 2-D initializer (a Linear's weight for MatMul) keep their source."""
        if not node.input or not node.output:
            return
        source = node.input[0]
        root = self.aliases.get(source, source)
        if root not in self.inits:
            return
        if node.op_type == "Identity":
            self.aliases[node.output[0]] = root
        elif node.op_type == "Transpose" and source in self.inits:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
            if len(self.inits[source].dims) == 2 and perm == [1, 0]:
                self.transposed[node.output[0]] = source
