"""An ONNX file -> ``ImportedModel``: the ONNX twin of ``torch_frontend``.

Hostile files. The file is read like every input (``unroller.api.read_bounded``: a regular
file, at most ``MAX_FILE_BYTES``; external data only from regular files inside its folder),
checked with ``onnx.checker`` and ``_check_tensors`` (numbers only, exactly as many as the
shape says), then its local functions are inlined. A file that is not valid ONNX, or a node
whose attributes or constants are unusable (an inf or NaN, a string where a number belongs,
a constant that cannot be computed or would be too large), is one ``ImportFailure`` line
naming the file and the node; an operation the registry lacks is an ``Unmapped`` entry.

The graph inputs are checked against ``--input`` by position: the rank and every size after the batch must match; the
batch dim may be symbolic (``torch.onnx.export(..., dynamic_shapes=...)``) or fixed (an
export at one example batch), and is read as ``N`` either way.

Batch. With a symbolic batch, shape inference (ONNX's, node by node) and the constant folding
run twice, at batch ``B1`` and ``B2``: a size that is B1 in one run and B2 in the other is ``N``, one that
does not change is fixed, and anything else (``2 * N``) is refused where it matters. With a
fixed batch B, dim 0 of every value computed from the inputs is ``N`` (the mappers refuse
every operation that moves, merges or reduces dim 0), and a shape argument whose first
entry is B (``Reshape`` to ``[B, 512]``) means ``N``.

Constants. Nodes that read no input data (``Constant``, shape arithmetic, the zero bias the
dynamo exporter builds for a bias-free ``Conv`` with ``Shape``/``Expand``/``CastLike``) are
evaluated with ``onnx.reference`` and feed the mappers as arguments (reshape sizes, pads,
scales). Only ops whose cost is linear in their size (``FOLDED``) are evaluated, and each
result's size is known from shape inference before it is computed: at most
``MAX_CONST_ELEMENTS`` (or its largest input's size) and the file's memory budget. ``Shape`` of a data value is known from shape inference. A constant that reaches
an operator as a tensor operand is refused (no registry operator adds a constant tensor),
except a scalar factor (``scale``) and exact no-ops (``+ 0``, ``* 1``, a zero tensor built
from sizes that broadcasts nothing: a mask that masks nothing). An initializer the dynamo
exporter's record of the call (``pkg.torch.onnx.fx_node``) names a parameter (``%p_...``)
is data where an elementwise op, ``Concat`` or ``Expand`` reads it (a ``parameter``
statement: a class token, a position table), and so is a module's ``weight`` gathered at
constant ids (``embedding_rows``: position ids).

Weights. An initializer read in a weight slot (``Conv`` W/B, ``BatchNormalization``
scale/B/mean/var, ``Gemm`` B/C, the transposed weight of ``MatMul`` + ``Add``) is module
state: its name is its state-dict key and names the statement (``layer1.0.conv1.weight`` ->
``layer1.0.conv1``). A weight whose initializer carries no module path (``onnx::Conv_193``,
what BatchNorm folding leaves), that two operators share, or that is computed from other
initializers is refused with that reason. The TorchScript exporter deduplicates equal
initializers through ``Identity`` nodes: the Identity's output name is then the key, with
the source's values. ``BatchNormalization`` running statistics come from
``X.running_mean``/``X.running_var``; ``X.num_batches_tracked``, which ONNX does not carry,
is part of the returned state (shape ``()``, zero in ``onnx_state_dict``) so that the
imported module loads the original's state dict with strict=True.

Names. The dynamo exporter writes the module call stack on every node
(``pkg.torch.onnx.name_scopes`` / ``pkg.torch.onnx.class_hierarchy``): parameter-free
statements are named like ``torch_frontend`` names them (``layer1.0.relu``,
``layer1.0.add``), and the classes let ``emit`` recover blocks. Files from the TorchScript
exporter name nodes ``/layer1/layer1.0/Add``: the module path comes from that (no classes,
so no blocks); other files fall back to the node name.

Exporter settings that lose the network are refused, not approximated: a ``Conv`` into
which the exporter's optimizer folded a BatchNorm (onnxscript rule
``FuseBatchNormIntoConv``, the default of ``torch.onnx.export(dynamo=True)`` on a module in
eval mode) has no batch norm left to train; export with ``optimize=False``.

A leaf module whose call the exporter decomposed into many ONNX nodes (an
``nn.AdaptiveAvgPool2d`` that upsamples 1x1 to 7x7 becomes a ``GatherND`` chain) is one
statement when its class is in ``COLLAPSED``: the nodes are run (``onnx.reference``) on random
input and must agree with torch's operator up to the file's float rounding first, which
identifies these linear operators (another linear map differs by the size of the values).

The mapper (``_Mapper``) holds the walk's state; its parts live beside it: single-node
helpers and bounds (``onnx_nodes``), the view a mapper function gets (``onnx_view``),
shapes and constants (``onnx_shapes``) and collapsed module calls (``onnx_collapse``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from unroller.importer import onnx_aten, onnx_ops
from unroller.importer.aten_ops import Refuse
from unroller.importer.model import (
    ImportedModel,
    ImportFailure,
    Stmt,
    Tensor,
    Unmapped,
    valid_path,
)
from unroller.importer.onnx_collapse import _Collapse
from unroller.importer.onnx_nodes import (
    B1,
    B2,
    DEFAULT_DOMAINS,
    NUMERIC,
    PARAMETER_OPERAND,
    UNREADABLE,
    Poisoned,
    fx_call,
    fx_name,
    itemsize,
    merge_dim,
    node_where,
    numel,
    one_line,
    type_name,
    unnamed,
    unwritable,
    value_dims,
)
from unroller.importer.onnx_shapes import _Shapes
from unroller.importer.onnx_view import NodeView

#: All constants computed from one file hold at most this many bytes beyond twice its
#: initializers' bytes, so that no chain of nodes multiplies the file's size.
CONST_BUDGET_BYTES = 64 * 2**20
#: ONNX element type -> the model language's dtype.
DTYPES = {1: "f32", 11: "f64", 10: "f16", 16: "bf16", 7: "i64", 6: "i32"}
#: The most bytes read from an ONNX file (protobuf's own limit for one message).
MAX_FILE_BYTES = 2 * 2**30
#: The most bytes read from the external data files beside it, all together: the weights
#: are inlined before ``onnx.checker`` runs, and it checks no model past 2 GiB in all.
MAX_EXTERNAL_BYTES = 2 * 2**30


def _onnx():
    """The ``onnx`` package, or ImportFailure saying how to get it."""
    try:
        import onnx
        import onnx.inliner  # noqa: F401 - a submodule onnx does not import itself
        import onnx.reference  # noqa: F401
        import onnx.shape_inference  # noqa: F401
    except ImportError:
        raise ImportFailure(
            "importing an ONNX file needs the onnx package: pip install onnx"
        ) from None
    return onnx


# ---------------------------------------------------------------- loading, inputs


def load_model(path: Path):
    """The ONNX model at ``path``, local functions inlined; ImportFailure naming the file if
    it cannot be read (missing, not a regular file, too big, empty, not ONNX) or is not a
    valid model (``onnx.checker``, and the checks in ``_check_tensors``)."""
    onnx = _onnx()
    path = Path(path)
    data = _read(path, MAX_FILE_BYTES)
    if not data:
        raise ImportFailure(f"{path}: the file is empty, not an ONNX model")
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # noqa: BLE001 - any reader error: say it in one line
        raise ImportFailure(f"{path}: not an ONNX model: {one_line(exc)}") from None
    del data
    _check_tensors(onnx, model, path)
    _load_external_data(onnx, model, path)
    _check_model(onnx, model, path)
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception as exc:  # noqa: BLE001
            raise ImportFailure(f"{path}: cannot inline its functions: {one_line(exc)}") from None
    return model


def _check_model(onnx, model, path: Path) -> None:
    """``onnx.checker`` (not ``full_check``: shapes are inferred node by node later) on the
    model with its weights inline, so that the checker never opens a file itself: it
    refuses duplicate names, values assigned twice, cycles, attributes of the wrong type,
    data shorter than its shape. ONNX lets a graph input or output leave its shape out,
    which the checker refuses on the main graph: such a value gets an empty shape for the
    check only (no full check compares it with anything)."""
    values = (*model.graph.input, *model.graph.output)
    patched = [
        v.type.tensor_type
        for v in values
        if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
    ]
    for tensor_type in patched:
        tensor_type.shape.SetInParent()
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001 - ValidationError, or a proto past 2 GiB
        raise ImportFailure(f"{path}: not a valid ONNX model: {one_line(exc)}") from None
    finally:
        for tensor_type in patched:
            tensor_type.ClearField("shape")


def _read(path: Path, limit: int) -> bytes:
    """``read_bounded``'s bytes (a regular file, at most ``limit``); ImportFailure naming
    the file otherwise: a FIFO never blocks, /dev/zero is never read."""
    from unroller.files import PathError, read_bounded

    try:
        return read_bounded(path, limit)
    except FileNotFoundError:
        raise ImportFailure(f"{path}: no such file") from None
    except PathError as exc:
        raise ImportFailure(str(exc)) from None
    except OSError as exc:
        raise ImportFailure(f"cannot read {path}: {exc.strerror or exc}") from None


def _check_tensors(onnx, model, path: Path) -> None:
    """Every tensor in the file holds numbers, exactly as many as its shape says: a string
    or complex weight, or data shorter or longer than the shape, is refused here rather
    than failing (or allocating the shape's size) when a constant is read."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    for tensor in _get_all_tensors(model):
        what = f"{path}: the tensor {tensor.name!r}"
        if tensor.data_type not in NUMERIC:
            kind = type_name(onnx, tensor.data_type)
            raise ImportFailure(f"{what} holds {kind} data; tensors must hold numbers")
        if any(d < 0 for d in tensor.dims):
            raise ImportFailure(f"{what} has the negative shape {list(tensor.dims)}")
        count = numel(tensor)
        if uses_external_data(tensor):
            continue  # its bytes are counted when read (_load_external_data)
        if tensor.HasField("raw_data"):
            have, want = len(tensor.raw_data), count * itemsize(onnx, tensor.data_type)
        else:
            field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
            have, want = len(getattr(tensor, field)), count
        if have != want:
            raise ImportFailure(
                f"{what} of shape {list(tensor.dims)} holds {have} "
                f"{'bytes' if tensor.HasField('raw_data') else 'values'}, not {want}"
            )


def _load_external_data(onnx, model, path: Path) -> None:
    """Weights kept beside the file (``torch.onnx.export(..., external_data=True)``), read
    like the file itself: a relative location inside the file's folder, a regular file,
    at most ``MAX_EXTERNAL_BYTES`` in all, each tensor exactly its shape's size."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    folder = path.resolve().parent
    files: dict[Path, bytes] = {}
    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        what = f"{path}: the tensor {tensor.name!r}"
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        bad_name = not location or "\0" in location or Path(location).is_absolute()
        source = folder if bad_name else (folder / location).resolve()
        if bad_name or not source.is_relative_to(folder) or source == folder:
            raise ImportFailure(
                f"{what} keeps its data in {location!r}, which is not a file in {path}'s folder"
            )
        if source not in files:
            used = sum(len(b) for b in files.values())
            try:
                files[source] = _read(source, MAX_EXTERNAL_BYTES - used)
            except ImportFailure as exc:
                raise ImportFailure(f"{what}: {exc.message}") from None
        data = files[source]
        try:
            offset = int(info.get("offset", "0"))
            length = int(info["length"]) if "length" in info else len(data) - offset
        except ValueError:
            raise ImportFailure(
                f"{what}: its external data offset or length is not a number"
            ) from None
        want = numel(tensor) * itemsize(onnx, tensor.data_type)
        if offset < 0 or length != want or offset + length > len(data):
            raise ImportFailure(
                f"{what} of shape {list(tensor.dims)} needs {want} bytes; {location!r} has "
                f"{max(0, min(length, len(data) - offset))} at offset {offset}"
            )
        tensor.raw_data = data[offset : offset + length]
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def _opset(model, source: str) -> int:
    for entry in model.opset_import:
        if entry.domain in DEFAULT_DOMAINS:
            return int(entry.version)
    raise ImportFailure(f"{source}: the file imports no version of the default operator set")


def _spec_text(dims: list) -> str:
    shown = ["N" if i == 0 else ("?" if d is None else str(d)) for i, d in enumerate(dims)]
    return "[" + ", ".join(shown) + "]"


def check_inputs(graph_inputs: list, inputs: Sequence[Tensor], source: str) -> int | None:
    """Check ``--input`` against the file's inputs (by position); the fixed batch size the
    file was exported at, or None when its batch dim is symbolic."""
    if len(graph_inputs) != len(inputs):
        names = ", ".join(repr(v.name) for v in graph_inputs) or "none"
        raise ImportFailure(
            f"{source} takes {len(graph_inputs)} input(s) ({names}); "
            f"--input declares {len(inputs)}"
        )
    batches = set()
    for value, spec in zip(graph_inputs, inputs):
        if not value.type.HasField("tensor_type"):
            raise ImportFailure(f"{source}: the input {value.name!r} is not a tensor")
        _check_dtype(value, spec, source)
        dims = value_dims(value)
        if dims is None:
            batches.add(None)
            continue
        if len(dims) != 1 + len(spec.dims):
            raise ImportFailure(
                f'--input "{spec.name}: {spec.text()}": the ONNX input {value.name!r} has '
                f"{len(dims)} dims {_spec_text(dims)}"
            )
        for got, want in zip(dims[1:], spec.dims):
            if isinstance(got, int) and got != want:
                raise ImportFailure(
                    f'--input "{spec.name}: {spec.text()}": the ONNX input {value.name!r} is '
                    f"{_spec_text(dims)}"
                )
        batches.add(dims[0] if isinstance(dims[0], int) else None)
    if len(batches) > 1:
        raise ImportFailure(f"{source}: its inputs disagree on the batch dim ({batches})")
    return batches.pop() if batches else None


def _check_dtype(value, spec: Tensor, source: str) -> None:
    """Floats for floats, integers for integers (the width may differ: f32 file, f64 run)."""
    elem = value.type.tensor_type.elem_type
    name = DTYPES.get(elem)
    if name is None:
        raise ImportFailure(f"{source}: the input {value.name!r} has ONNX element type {elem}")
    if name.startswith("i") != spec.dtype.startswith("i"):
        raise ImportFailure(
            f'--input "{spec.name}: {spec.text()}": the ONNX input {value.name!r} is {name}'
        )


def declared_inputs(model, source: str) -> list[Tensor]:
    """The file's own inputs as Tensors (every size after the batch must be fixed)."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for k, value in enumerate(v for v in model.graph.input if v.name not in inits):
        dims = value_dims(value)
        dtype = DTYPES.get(value.type.tensor_type.elem_type)
        if dims is None or dtype is None or not all(isinstance(d, int) for d in dims[1:]):
            raise ImportFailure(
                f"{source}: the input {value.name!r} has no fixed shape after the batch dim; "
                "import it with --input first"
            )
        out.append(Tensor(f"x{k}", dtype, tuple(int(d) for d in dims[1:])))
    return out


# ---------------------------------------------------------------- the mapper


class _Mapper(_Collapse, _Shapes):
    """Reads the graph once: shapes, constants, then statements or unmapped records; the
    state lives here, shape inference and collapsed calls in the mixins."""

    def __init__(self, model, inputs: Sequence[Tensor], source: str, fallback: bool = True):
        self.onnx = _onnx()
        self.fallback = fallback  # an op only an ATen overload computes: ``onnx_aten``
        self.model = model
        self.graph = model.graph
        self.source = source
        self.opset = _opset(model, source)
        self.nodes = list(self.graph.node)
        self.inits = {t.name: t for t in self.graph.initializer}
        self.graph_inputs = [v for v in self.graph.input if v.name not in self.inits]
        self.inputs = list(inputs)
        self.batch = check_inputs(self.graph_inputs, self.inputs, source)
        if not self.graph.output:
            raise ImportFailure(f"{source}: the graph has no output")
        self.output = self.graph.output[0].name
        self.producer = {out: i for i, n in enumerate(self.nodes) for out in n.output if out}
        self.users: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in node.input:
                if name:
                    self.users.setdefault(name, []).append(i)
        self.where = [node_where(n) for n in self.nodes]
        self.live = self._live_nodes()
        self.leaves = self._leaf_paths()
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, int] = {}
        self.data: set[str] = {v.name for v in self.graph_inputs}
        self.pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.aliases: dict[str, str] = {}  # Identity(initializer) output -> initializer
        self.transposed: dict[str, str] = {}  # Transpose(2-D initializer) output -> it
        self.values: dict[str, str] = {v.name: t.name for v, t in zip(self.graph_inputs, inputs)}
        self.poisoned: set[str] = set()
        self.stmts: list[Stmt] = []
        self.names: set[str] = {t.name for t in self.inputs}
        self.reserved = {key.rpartition(".")[0] for key in self.inits}
        self.used: dict[str, str] = {}  # initializer (or alias) -> the statement owning it
        self.state: dict[str, tuple[str | None, tuple[int, ...]]] = {}
        self.absorbed: dict[int, str] = {}  # node -> the value its output is
        self.unmapped: list[Unmapped] = []
        self.classes: dict[str, str] = {}
        self.notes: list[str] = []
        self.groups: dict[int, str] = {}
        self.decomposed: dict[str, str] = {}  # group key -> the ATen op its nodes compute
        self.fx = [fx_call(n) for n in self.nodes]
        self.unbatched: dict[str, tuple[int, ...]] = {}  # values without the batch dim
        self.first_run: dict[str, tuple] = {}  # shapes at the first batch size
        self.parameters: set[str] = set()  # initializers read as tensor operands
        init_bytes = sum(len(t.raw_data) or 8 * numel(t) for t in self.graph.initializer)
        self.const_budget = CONST_BUDGET_BYTES + 2 * init_bytes

    # ---- structure

    def _live_nodes(self) -> set[int]:
        live: set[int] = set()
        todo = [self.output]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen or name not in self.producer:
                continue
            seen.add(name)
            i = self.producer[name]
            if i not in live:
                live.add(i)
                todo.extend(n for n in self.nodes[i].input if n)
        return live

    def _leaf_paths(self) -> set[str]:
        paths = {p for i in self.live for p in self.where[i].paths if p}
        return {p for p in paths if not any(q.startswith(p + ".") for q in paths)}

    def order(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i in self.live]

    def live_users(self, name: str) -> list[int]:
        return [j for j in self.users.get(name, []) if j in self.live]

    def is_data_node(self, i: int) -> bool:
        return any(out in self.data for out in self.nodes[i].output)

    # ---- the pass in graph order (shapes and constants: ``_Shapes``)

    def batches(self) -> tuple[int, ...]:
        return (self.batch,) if self.batch is not None else (B1, B2)

    def prepare(self) -> None:
        """One pass in graph order: a node that reads no input data is evaluated (its
        outputs are constants), any other is a data node whose output shapes ONNX shape
        inference gives from its inputs' shapes and its constant inputs' values."""
        runs: list[dict[str, tuple]] = [{} for _ in self.batches()]
        for run, batch in zip(runs, self.batches()):
            for value, spec in zip(self.graph_inputs, self.inputs):
                run[value.name] = (batch, *spec.dims)
                self.dtypes[value.name] = value.type.tensor_type.elem_type
        for i in self.order():
            node = self.nodes[i]
            self._check_known_inputs(i)
            if any(name in self.poisoned for name in node.input if name):
                self._poison(i)  # reported once, where it failed
                continue
            try:
                reads = self._reads_parameter(i, runs)
                results = None if reads else self._fold_node(i, runs)
            except Refuse as exc:
                self._fail(i, str(exc))
                continue
            except UNREADABLE as exc:  # a hostile attribute or value
                self.invalid(i, f"cannot read it: {one_line(exc)}")
            if results is None:
                self.data.update(out for out in node.output if out)
                for k, run in enumerate(runs):
                    self._infer_node(node, run, k)
                continue
            for out, result in zip(node.output, results):
                if out:
                    self.pairs[out] = result
            self._track_weight_views(node)
        self.first_run = runs[0]
        for name, dims in runs[0].items():
            other = runs[-1].get(name)
            if other is not None and len(other) == len(dims):
                self.shapes[name] = tuple(merge_dim(a, b) for a, b in zip(dims, other))

    def _reads_parameter(self, i: int, runs: list[dict]) -> bool:
        """Whether node ``i`` reads a module's parameter as data, which makes it a data node
        (not a constant to fold): an embedding looked up at constant ids (position ids),
        or an elementwise op, concatenation or expand of a parameter (a class token, a
        position table). The dynamo exporter's record of the ATen call says which
        initializers are parameters (``%p_...``) rather than buffers; without it such an
        initializer stays a constant (and is refused where it is an operand)."""
        node, call = self.nodes[i], self.fx[i]
        if node.domain not in DEFAULT_DOMAINS:
            return False
        if node.op_type == "Gather" and node.input:
            table = self.aliases.get(node.input[0], node.input[0])
            if call is None:  # no record: a module's 2-D ``weight`` looked up along dim 0
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                named = table.endswith(".weight") and table in self.inits
                return named and len(self.inits[table].dims) == 2 and axis == 0
            return call.target == "aten.embedding.default" and fx_name(table) in call.parameters()
        if call is None:
            return False
        params = call.parameters()
        prefix = PARAMETER_OPERAND.get(node.op_type)
        if prefix is None or not call.target.startswith(prefix):
            return False
        found = False
        for name in node.input:
            if name in self.inits and name not in self.data and fx_name(name) in params:
                self.data.add(name)
                self.parameters.add(name)
                self.dtypes[name] = self.inits[name].data_type
                for run in runs:
                    run[name] = tuple(int(d) for d in self.inits[name].dims)
                found = True
        return found

    def _check_known_inputs(self, i: int) -> None:
        """Every input is computed before it is read (``onnx.checker`` enforces this; kept
        so that a cycle is a clean error whatever let the file through)."""
        for name in self.nodes[i].input:
            known = name in self.data or name in self.pairs or name in self.inits
            if name and not known and name not in self.poisoned:
                self.invalid(i, f"reads {name!r}, which no earlier node computes (a cycle?)")

    # ---- naming

    def unique(self, base: str) -> str:
        base = base.strip(".") or "value"
        if not valid_path(base):
            base = re.sub(r"[^A-Za-z0-9_.]", "_", base)
            if not valid_path(base):
                base = "v_" + re.sub(r"[^A-Za-z0-9_]", "_", base)
        name, k = base, 0
        while name in self.names or name in self.reserved:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def functional_name(self, i: int) -> str:
        where = self.where[i]
        path = where.path
        if path and path in self.leaves:
            return path
        return f"{path}.{where.op}" if path else where.op

    def module_of(self, i: int) -> tuple[str, str]:
        where = self.where[i]
        if where.path:
            return where.path, where.cls
        return "", self.classes.get("", "")

    def record_classes(self, i: int) -> None:
        where = self.where[i]
        if len(where.classes) == len(where.paths):
            for path, cls in zip(where.paths, where.classes):
                self.classes.setdefault(path, cls)

    # ---- values

    def value_of(self, name: str) -> str:
        if name in self.values:
            return self.values[name]
        if name in self.parameters:
            return self._parameter(name)
        if name in self.poisoned:
            raise Poisoned(name)
        if name in self.data:
            raise Refuse(f"reads {name}, which could not be mapped")
        what = f"the initializer {name!r}" if name in self.inits else f"the constant {name}"
        raise Refuse(f"reads {what} as a tensor operand: no registry operator takes a constant")

    def _parameter(self, key: str) -> str:
        """A parameter read as data: a ``parameter`` statement named by its state-dict key
        (trainable, loaded from the file's initializer), emitted at its first read."""
        shape = tuple(self.init_shape(key))
        if not valid_path(key):
            raise Refuse(unnamed(key, "parameter"))
        if not shape:
            raise Refuse(
                f"the parameter {key} is a 0-d scalar, which a parameter statement cannot hold"
            )
        if key in self.used or key in self.names:
            raise Refuse(f"the initializer {key} is used by two operators (shared weights)")
        self.names.add(key)
        self.used[key] = key
        self.state[key] = (key, shape)
        owner = key.rpartition(".")[0]
        self.stmts.append(
            Stmt(key, "parameter", [], {"shape": shape, "init": "zeros"}, owner, shape)
        )
        self.values[key] = key
        self.unbatched[key] = shape
        return key

    # ---- the walk

    def run(self) -> str | None:
        """Map every live node; the prediction's value name (None if it failed)."""
        for i in self.order():
            self.record_classes(i)
        self.prepare()
        self.groups = self._collapsed_groups()
        last = {key: i for i, key in self.groups.items()}
        done: set[str] = set()
        for i in self.order():
            node = self.nodes[i]
            if not self.is_data_node(i):
                continue
            if any(out in self.poisoned for out in node.output):
                continue
            if i in self.absorbed:
                self.values[node.output[0]] = self.absorbed[i]
                continue
            if i in self.groups:
                key = self.groups[i]
                # a decomposed call at its last node: its inputs are all mapped by then
                ready = key not in self.decomposed or i == last[key]
                if key not in done and ready:
                    done.add(key)
                    self._collapse(key)
                continue
            self._map(i)
        return self._prediction()

    def _prediction(self) -> str | None:
        name = self.output
        if name in self.poisoned:
            return None
        if name not in self.data:
            raise ImportFailure(f"{self.source}: the output {name!r} does not depend on the input")
        try:
            self.shape(name)
            return self.value_of(name)
        except Refuse as exc:
            raise ImportFailure(f"{self.source}: the output {name!r}: {exc}") from None

    def _map(self, i: int) -> None:
        node = self.nodes[i]
        mapper = onnx_ops.MAPPERS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if mapper is None and self.fallback and node.domain in DEFAULT_DOMAINS:
            mapper = onnx_aten.opaque if node.op_type in onnx_aten.ATEN else None
        if mapper is None:
            domain = f"{node.domain}::" if node.domain not in DEFAULT_DOMAINS else ""
            self._fail(i, f"no registry operator computes {domain}{node.op_type}")
            return
        try:
            self._check_outputs(i)
            self._check_rules(i)
            result = mapper(NodeView(self, i))
        except Poisoned:
            self._poison(i)
            return
        except Refuse as exc:
            self._fail(i, str(exc))
            return
        except UNREADABLE as exc:  # an attribute or constant of the wrong kind or size
            self.invalid(i, f"cannot read its attributes or constant inputs: {one_line(exc)}")
        self.values[node.output[0]] = result

    def _check_outputs(self, i: int) -> None:
        node = self.nodes[i]
        for k, out in enumerate(node.output[1:], start=1):
            if out and (self.live_users(out) or out == self.output):
                raise Refuse(f"its output {k} ({out}) is used; only the first is mapped")

    def _check_rules(self, i: int) -> None:
        rules = self.where[i].rules
        if "BatchNorm" in rules:
            raise Refuse(
                f"the exporter's optimizer folded a BatchNorm into this node ({rules}): the "
                "file has no batch norm left to train; export with "
                "torch.onnx.export(..., optimize=False)"
            )

    def _poison(self, i: int) -> None:
        self.poisoned.update(out for out in self.nodes[i].output if out)

    def _fail(self, i: int, reason: str) -> None:
        self._poison(i)
        node = self.nodes[i]
        path, cls = self.module_of(i)
        label = f"onnx::{node.op_type} ({node.name})" if node.name else f"onnx::{node.op_type}"
        self.unmapped.append(Unmapped(label, path, cls, self.where[i].location, reason))

    # ---- what a NodeView asks for

    def add_stmt(self, i: int, op: str, args: list[str], layer: str | None, kwargs: dict) -> str:
        if layer is not None:
            if layer in self.names:
                raise Refuse(f"the module {layer} is called twice (shared weights)")
            self.names.add(layer)
            name, module_path = layer, layer
        else:
            name = self.unique(self.functional_name(i))
            module_path = self.where[i].path
        out = self.nodes[i].output[0]
        try:
            shape = self.unbatched[out] if out in self.unbatched else self.shape(out)
        except Refuse:
            shape = None
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        for key, value in kwargs.items():
            reason = unwritable(value)
            if reason:
                self.invalid(i, f"it computes {op} with {key}={value}: {reason}")
        self.stmts.append(Stmt(name, op, args, kwargs, module_path, shape))
        return name

    def claim(self, roles: dict[str, str]) -> str:
        """The module path that owns these initializers (leaf name -> value name), each
        registered as state under its name; Refuse with the reason when they cannot be."""
        owner = None
        for leaf, name in roles.items():
            key = self.weight_key(name, leaf)
            path, _, got = key.rpartition(".")
            if got != leaf or not path or not valid_path(path):
                raise Refuse(unnamed(key, leaf))
            if owner is not None and path != owner:
                raise Refuse(f"its tensors belong to different modules ({owner}, {path})")
            owner = path
        if owner is None:
            raise Refuse("no initializer names the layer")
        for name in roles.values():
            if name in self.used:
                raise Refuse(f"the initializer {name} is used by two operators (shared weights)")
        for name in roles.values():
            self.used[name] = owner
            self.state[name] = (self.aliases.get(name, name), tuple(self.init_shape(name)))
        return owner

    def weight_key(self, name: str, leaf: str) -> str:
        if name in self.data:
            raise Refuse(f"its {leaf} is computed from the input, not an initializer")
        if name in self.inits or name in self.aliases:
            return name
        producer = self.producer.get(name)
        made = f" by {self.nodes[producer].op_type}" if producer is not None else ""
        raise Refuse(f"its {leaf} ({name}) is computed{made}, not an initializer")

    def init_shape(self, name: str) -> list[int]:
        return [int(d) for d in self.inits[self.aliases.get(name, name)].dims]

    def init_array(self, name: str) -> np.ndarray:
        return self.pair(self.aliases.get(name, name))[0]


# ---------------------------------------------------------------- entry points


def _mapped(
    model, inputs: Sequence[Tensor], source: str, fallback: bool = True
) -> tuple[_Mapper, str]:
    mapper = _Mapper(model, inputs, source, fallback)
    prediction = mapper.run()
    if mapper.unmapped:
        raise ImportFailure(f"cannot import {source}", mapper.unmapped)
    assert prediction is not None
    return mapper, prediction


def import_onnx(
    path: Path, inputs: Sequence[Tensor], name: str, source: str, fallback: bool = True
) -> tuple[ImportedModel, dict[str, tuple[int, ...]]]:
    """The ONNX network as an ImportedModel (no loss yet) and the state the imported module
    must hold ({state-dict key: shape}); ImportFailure lists every unmapped node.
    ``fallback``: an op only an ATen overload computes becomes an ``aten`` statement
    (``onnx_aten``); False leaves it unmapped."""
    mapper, prediction = _mapped(load_model(path), inputs, source, fallback)
    model = mapper.model
    notes = [f"read from ONNX (opset {mapper.opset}, written by {_producer(model)})"]
    if len(model.graph.output) > 1:
        others = ", ".join(o.name for o in model.graph.output[1:])
        notes.append(f"the prediction is the file's first output; not imported: {others}")
    if mapper.batch is not None:
        notes.append(f"the file fixes the batch at {mapper.batch}: read as N")
    if any(source is None for source, _ in mapper.state.values()):
        notes.append("num_batches_tracked is not in ONNX files: it starts at 0")
    notes += mapper.notes
    imported = ImportedModel(
        name=name,
        source=source,
        inputs=list(inputs),
        targets=[],
        stmts=mapper.stmts,
        predictions=[prediction],
        classes=mapper.classes,
        notes=notes,
    )
    state = {key: shape for key, (_, shape) in mapper.state.items()}
    return imported, state


def _producer(model) -> str:
    name = " ".join(p for p in (model.producer_name, model.producer_version) if p)
    return name or "an unknown producer"


def onnx_state_dict(path: Path, inputs: Sequence[Tensor] | None = None) -> dict[str, Any]:
    """The file's weights under the imported module's state-dict keys (num_batches_tracked
    zeros included), loadable with strict=True into the module ``unroll import`` generates
    from it. ``inputs`` default to the file's own input shapes."""
    import torch

    source = str(path)
    model = load_model(Path(path))
    if inputs is None:
        inputs = declared_inputs(model, source)
    mapper, _ = _mapped(model, inputs, source)
    out: dict[str, Any] = {}
    for key, (init, shape) in mapper.state.items():
        if init is None:
            out[key] = torch.zeros(shape, dtype=torch.int64)
        else:
            out[key] = torch.from_numpy(np.array(mapper.init_array(init), copy=True))
    return out
