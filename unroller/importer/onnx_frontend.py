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
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from unroller.importer import onnx_ops
from unroller.importer.aten_ops import Refuse, pair
from unroller.importer.model import (
    BATCH,
    ImportedModel,
    ImportFailure,
    Stmt,
    Tensor,
    Unmapped,
    valid_path,
)

#: The batch sizes shape inference and folding run at when the batch dim is symbolic.
B1, B2 = 5, 7
#: Initializers up to this many elements go to shape inference with their values (shape
#: arguments); larger ones (weights) with their shapes only, so inference copies no weights.
SMALL = 4096
#: A constant the importer computes may hold this many elements, or as many as the largest
#: constant it is computed from (a transposed or cast weight); shape arguments and biases are
#: far smaller. Checked on the shapes ONNX infers, before anything is allocated.
MAX_CONST_ELEMENTS = 2**20
#: All constants computed from one file hold at most this many bytes beyond twice its
#: initializers' bytes, so that no chain of nodes multiplies the file's size.
CONST_BUDGET_BYTES = 64 * 2**20
#: The most elements the random input of a collapsed module's check may hold.
MAX_CHECK_ELEMENTS = 2**24
#: ONNX ops evaluated on constants: shape arithmetic, layout and elementwise ops, whose
#: cost is linear in their inputs and outputs (no convolution or matrix product, whose
#: cost a hostile file could make cubic in sizes it fits under the bounds above).
FOLDED = frozenset(
    """Abs Add And ArgMax ArgMin Cast CastLike Ceil Clip Concat Constant ConstantOfShape
    CumSum Div Dropout Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements
    GatherND Greater GreaterOrEqual Identity IsInf IsNaN LeakyRelu Less LessOrEqual Log
    LogSoftmax Max Mean Min Mod Mul Neg Not OneHot Or Pad Pow Range Reciprocal ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum Relu Reshape Round ScatterElements ScatterND
    Shape Sigmoid Sign Size Slice Softmax Split Sqrt Squeeze Sub Sum Tanh Tile Transpose
    Trilu Unsqueeze Where Xor""".split()
)
#: (op, attribute) pairs where an infinite value is meaningful (Clip before opset 11:
#: no bound on that side).
_UNBOUNDED = {("Clip", "min"), ("Clip", "max")}
#: ONNX element type -> the model language's dtype.
DTYPES = {1: "f32", 11: "f64", 10: "f16", 16: "bf16", 7: "i64", 6: "i32"}
_DEFAULT_DOMAINS = ("", "ai.onnx")
#: The most bytes read from an ONNX file (protobuf's own limit for one message).
MAX_FILE_BYTES = 2 * 2**30
#: The most bytes read from the external data files beside it, all together: the weights
#: are inlined before ``onnx.checker`` runs, and it checks no model past 2 GiB in all.
MAX_EXTERNAL_BYTES = 2 * 2**30
#: Element types a tensor in the file may hold: numbers and booleans (no strings, complex
#: numbers or the 4/8-bit float formats numpy cannot hold).
NUMERIC = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 16})


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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
        raise ImportFailure(f"{path}: not an ONNX model: {_one_line(exc)}") from None
    del data
    _check_tensors(onnx, model, path)
    _load_external_data(onnx, model, path)
    _check_model(onnx, model, path)
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception as exc:  # noqa: BLE001
            raise ImportFailure(f"{path}: cannot inline its functions: {_one_line(exc)}") from None
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
        raise ImportFailure(f"{path}: not a valid ONNX model: {_one_line(exc)}") from None
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
            kind = _type_name(onnx, tensor.data_type)
            raise ImportFailure(f"{what} holds {kind} data; tensors must hold numbers")
        if any(d < 0 for d in tensor.dims):
            raise ImportFailure(f"{what} has the negative shape {list(tensor.dims)}")
        count = _numel(tensor)
        if uses_external_data(tensor):
            continue  # its bytes are counted when read (_load_external_data)
        if tensor.HasField("raw_data"):
            have, want = len(tensor.raw_data), count * _itemsize(onnx, tensor.data_type)
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
        want = _numel(tensor) * _itemsize(onnx, tensor.data_type)
        if offset < 0 or length != want or offset + length > len(data):
            raise ImportFailure(
                f"{what} of shape {list(tensor.dims)} needs {want} bytes; {location!r} has "
                f"{max(0, min(length, len(data) - offset))} at offset {offset}"
            )
        tensor.raw_data = data[offset : offset + length]
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def _type_name(onnx, elem: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(elem)
    except ValueError:
        return f"element type {elem}"


def _itemsize(onnx, elem: int) -> int:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)).itemsize


def _opset(model, source: str) -> int:
    for entry in model.opset_import:
        if entry.domain in _DEFAULT_DOMAINS:
            return int(entry.version)
    raise ImportFailure(f"{source}: the file imports no version of the default operator set")


def _dims(value_info) -> list[int | str | None] | None:
    """A value's declared dims: ints, symbolic names, None where unnamed; None if no shape."""
    tensor = value_info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            out.append(int(dim.dim_value))
        else:
            out.append(dim.dim_param or None)
    return out


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
        dims = _dims(value)
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
        dims = _dims(value)
        dtype = DTYPES.get(value.type.tensor_type.elem_type)
        if dims is None or dtype is None or not all(isinstance(d, int) for d in dims[1:]):
            raise ImportFailure(
                f"{source}: the input {value.name!r} has no fixed shape after the batch dim; "
                "import it with --input first"
            )
        out.append(Tensor(f"x{k}", dtype, tuple(int(d) for d in dims[1:])))
    return out


# ---------------------------------------------------------------- node metadata


class _Where:
    """Where a node came from: module paths outermost first ('' the root), their classes
    (when the exporter recorded them), the short name of the op it computes, and the source
    line, and the onnxscript rewrite rules applied to it."""

    def __init__(self, paths: list[str], classes: list[str], op: str, location: str, rules: str):
        self.paths = paths
        self.classes = classes
        self.op = op
        self.location = location
        self.rules = rules

    @property
    def path(self) -> str:
        return self.paths[-1] if self.paths else ""

    @property
    def cls(self) -> str:
        return self.classes[-1] if self.classes and len(self.classes) == len(self.paths) else ""


#: One quoted name, as the exporter's repr() of a list of strings writes it (no escapes:
#: a name that needs one is not a module path anyway).
_QUOTED = r"'[^'\\]*'|\"[^\"\\]*\""
_NAME_LIST = re.compile(rf"\s*[\[(]\s*(?:(?:{_QUOTED})\s*(?:,\s*(?:{_QUOTED})\s*)*,?\s*)?[\])]\s*")
#: Metadata longer than this is not a list of module paths the exporter wrote.
MAX_METADATA_CHARS = 65536


def _literal_list(text: str | None) -> list[str]:
    """``"['', 'layer1']"`` -> ['', 'layer1']; [] for anything else. A regular expression,
    not ``ast.literal_eval``: hostile metadata (deeply nested, or megabytes long) must cost
    linear time and no recursion."""
    if not text or len(text) > MAX_METADATA_CHARS or not _NAME_LIST.fullmatch(text):
        return []
    return [item[1:-1] for item in re.findall(_QUOTED, text)]


def _short(name: str) -> str:
    """A statement-name part from an op name: ``aten.add.Tensor`` -> ``add``, ``Relu`` ->
    ``relu``, ``GlobalAveragePool`` -> ``global_average_pool``."""
    if name.startswith("aten."):
        name = name.split(".")[1]
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    name = re.sub(r"[^a-z0-9_]", "_", name).strip("_")
    return name if name and not name[0].isdigit() else f"op_{name}"


def _location(trace: str) -> str:
    """The innermost frame of a stack trace outside torch itself, else the innermost."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace or "")
    if not frames:
        return ""
    own = [f for f in frames if "/torch/" not in f[0] and "site-packages" not in f[0]]
    file, line = (own or frames)[-1]
    return f"{file}:{line}"


def _scopes_from_name(name: str) -> list[str]:
    """``/layer2/layer2.0/downsample/downsample.0/Conv`` (TorchScript exporter) -> module
    paths ['', 'layer2', 'layer2.0', 'layer2.0.downsample', 'layer2.0.downsample.0']: a part
    that extends the previous part (``downsample.0``) names a child of that module."""
    parts = [p for p in name.split("/")[1:-1] if p]
    paths, current, previous = [""], "", ""
    for part in parts:
        if previous and part.startswith(previous + "."):
            current += part[len(previous) :]
        else:
            current = f"{current}.{part}" if current else part
        previous = part
        if not valid_path(current):
            break
        paths.append(current)
    return paths


def node_where(node) -> _Where:
    props = {p.key: p.value for p in node.metadata_props}
    scopes = _literal_list(props.get("pkg.torch.onnx.name_scopes"))
    hierarchy = _literal_list(props.get("pkg.torch.onnx.class_hierarchy"))
    location = _location(props.get("pkg.torch.onnx.stack_trace", ""))
    rules = props.get("pkg.onnxscript.rewriter.rule_name", "")
    if scopes and scopes[0] == "":
        paths = [p for p in scopes[:-1] if p == "" or valid_path(p)]
        classes = hierarchy[:-1] if len(hierarchy) == len(scopes) else []
        classes = classes if len(classes) == len(paths) else []
        op = hierarchy[-1] if len(hierarchy) == len(scopes) else node.op_type
        return _Where(paths or [""], classes, _short(op), location, rules)
    if scopes:  # a node the exporter made outside any module call (sym_size)
        return _Where([""], [], _short(node.op_type), location, rules)
    if node.name.startswith("/"):
        return _Where(_scopes_from_name(node.name), [], _short(node.op_type), location, rules)
    return _Where([""], [], _short(node.name or node.op_type), location, rules)


class FxCall:
    """The ATen call the dynamo exporter records on a node (``pkg.torch.onnx.fx_node``):
    its output name, target and arguments as written (``%name`` for a value; ``%p_...`` a
    parameter, ``%b_...`` a buffer). Read as text only, in linear time."""

    def __init__(self, name: str, target: str, args: list[str], kwargs: dict[str, str]):
        self.name = name
        self.target = target
        self.args = args
        self.kwargs = kwargs

    def parameters(self) -> set[str]:
        return {a[1:] for a in self.args if a.startswith("%p_")}


def _split_top(text: str) -> list[str]:
    """``a, [b, c], d`` -> ['a', '[b, c]', 'd']: commas outside brackets."""
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:k].strip())
            start = k + 1
    last = text[start:].strip()
    return [*parts, last] if last else parts


def fx_call(node) -> FxCall | None:
    """The node's recorded ATen call, or None (another exporter, or text not of that form).
    Parsed with ``str.find``: hostile metadata costs linear time."""
    text = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
    if not text or len(text) > MAX_METADATA_CHARS or not text.startswith("%"):
        return None
    text = text.strip()
    head, tail = "call_function[target=torch.ops.", "](args = ("
    middle, end = "), kwargs = {", "})"
    at = text.find(head)
    close = text.find(tail, at)
    split = text.rfind(middle)
    if at < 0 or close < 0 or split < close or not text.endswith(end):
        return None
    name = text[1 : text.find(" ")]
    target = text[at + len(head) : close]
    args = _split_top(text[close + len(tail) : split])
    pairs = (item.partition(":") for item in _split_top(text[split + len(middle) : -len(end)]))
    return FxCall(name, target, args, {k.strip(): v.strip() for k, _, v in pairs})


def fx_name(key: str) -> str:
    """The name torch.export gives the parameter ``key`` (``vit.embeddings.cls_token`` ->
    ``p_vit_embeddings_cls_token``)."""
    return "p_" + re.sub(r"[^0-9a-z_]", "_", key.lower())


#: ONNX op -> the ATen op it computes when the exporter wrote it for that op: a node that
#: reads a parameter as a tensor operand (a class token, a position table, a layer scale).
PARAMETER_OPERAND = {
    "Add": "aten.add.",
    "Sub": "aten.sub.",
    "Mul": "aten.mul.",
    "Div": "aten.div.",
    "Concat": "aten.cat.",
    "Expand": "aten.expand.",
}


# ---------------------------------------------------------------- the mapper


class _Poisoned(Refuse):
    """Reads a value that already failed: reported once, at its root."""


#: What a mapper raises on an attribute or constant of the wrong kind (a string where a
#: number belongs, an infinite index): the file's fault, reported as such in one line.
_UNREADABLE = (ValueError, TypeError, OverflowError, ArithmeticError, IndexError, KeyError)


#: The largest integer magnitude the model language accepts in an argument or a dim.
MAX_INT = 2**31 - 1


def _unwritable(value) -> str | None:
    """Why the model language cannot write a keyword value the file's numbers produced (an
    inf or NaN, an integer past ``MAX_INT``), or None: the file's error, not an importer's."""
    if isinstance(value, (tuple, list)):
        return next((r for r in map(_unwritable, value) if r), None)
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"past {MAX_INT} in magnitude"
    return None


def _non_finite(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_non_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


class _Mapper:
    """Reads the graph once: shapes, constants, then statements or unmapped records."""

    def __init__(self, model, inputs: Sequence[Tensor], source: str):
        self.onnx = _onnx()
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
        init_bytes = sum(len(t.raw_data) or 8 * _numel(t) for t in self.graph.initializer)
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

    # ---- shapes and constants, node by node, at one or two batch sizes

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
            except _UNREADABLE as exc:  # a hostile attribute or value
                self.invalid(i, f"cannot read it: {_one_line(exc)}")
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
                self.shapes[name] = tuple(_merge_dim(a, b) for a, b in zip(dims, other))

    def _reads_parameter(self, i: int, runs: list[dict]) -> bool:
        """Whether node ``i`` reads a module's parameter as data, which makes it a data node
        (not a constant to fold): an embedding looked up at constant ids (position ids),
        or an elementwise op, concatenation or expand of a parameter (a class token, a
        position table). The dynamo exporter's record of the ATen call says which
        initializers are parameters (``%p_...``) rather than buffers; without it such an
        initializer stays a constant (and is refused where it is an operand)."""
        node, call = self.nodes[i], self.fx[i]
        if node.domain not in _DEFAULT_DOMAINS:
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

    def invalid(self, i: int, reason: str) -> NoReturn:
        """Stop at a node the file got wrong (not an operation the registry lacks): one
        line naming the file and the node."""
        node = self.nodes[i]
        label = f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node #{i}"
        raise ImportFailure(f"{self.source}: {label}: {reason}")

    def _infer_node(self, node, shapes: dict[str, tuple], which: int) -> None:
        """ONNX shape inference of one data node into ``shapes`` (run ``which``)."""
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
                small = _numel(tensor) <= SMALL
            else:
                value = self.pairs[name][which]
                tensor = (
                    self.onnx.numpy_helper.from_array(value, name) if value.size <= SMALL else None
                )
                elem, dims, small = _elem(self.onnx, value), list(value.shape), value.size <= SMALL
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
                dims = _dims(value)
                if dims is not None:
                    shapes[value.name] = tuple(d if isinstance(d, int) else None for d in dims)

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

    # ---- constants (onnx.reference, at one or two batch sizes)

    def pair(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.pairs:
            array = self.onnx.numpy_helper.to_array(self.inits[name])
            self.pairs[name] = (array, array)
        return self.pairs[name]

    def is_constant(self, name: str) -> bool:
        return name in self.pairs or (name in self.inits and name not in self.data)

    def _fold_node(self, i: int, runs: list[dict]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        node = self.nodes[i]
        if node.domain not in _DEFAULT_DOMAINS or any(a.type in (5, 10) for a in node.attribute):
            return None  # other domains and control flow (subgraph attributes) are data
        names = [n for n in node.input if n]
        if node.op_type in ("Shape", "Size") and names and names[0] in self.data:
            return self._fold_shape(node, runs)
        if node.op_type == "CastLike" and len(names) == 2 and names[1] in self.data:
            if not self.is_constant(names[0]):
                return None
            target = _np_dtype(self.onnx, self.dtypes.get(names[1], 1))
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
            self.invalid(i, f"cannot compute this constant: {_one_line(exc)}")
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
                    helper.make_tensor_value_info(name, _elem(self.onnx, value), value.shape)
                )
        graph = helper.make_graph([node], "node", ins, [], initializer=inits)
        model = helper.make_model(
            graph, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version
        )
        try:
            inferred = self.onnx.shape_inference.infer_shapes(model, data_prop=True)
        except Exception as exc:  # noqa: BLE001 - its inputs do not fit the op
            self.invalid(i, f"cannot compute this constant: {_one_line(exc)}")
        found = {v.name: v for v in inferred.graph.value_info}
        limit = max([MAX_CONST_ELEMENTS, *(v.size for v in feeds.values())])
        total = 0
        for out in (name for name in node.output if name):
            dims = _dims(found[out]) if out in found else None
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
                kind = _type_name(self.onnx, elem)
                self.invalid(i, f"computes the constant {out!r} of {kind}, not numbers")
            total += count * _itemsize(self.onnx, elem)
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
            raise _Poisoned(name)
        if name in self.data:
            raise Refuse(f"reads {name}, which could not be mapped")
        what = f"the initializer {name!r}" if name in self.inits else f"the constant {name}"
        raise Refuse(f"reads {what} as a tensor operand: no registry operator takes a constant")

    def _parameter(self, key: str) -> str:
        """A parameter read as data: a ``parameter`` statement named by its state-dict key
        (trainable, loaded from the file's initializer), emitted at its first read."""
        shape = tuple(self.init_shape(key))
        if not valid_path(key):
            raise Refuse(_unnamed(key, "parameter"))
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
        mapper = onnx_ops.MAPPERS.get(node.op_type) if node.domain in _DEFAULT_DOMAINS else None
        if mapper is None:
            domain = f"{node.domain}::" if node.domain not in _DEFAULT_DOMAINS else ""
            self._fail(i, f"no registry operator computes {domain}{node.op_type}")
            return
        try:
            self._check_outputs(i)
            self._check_rules(i)
            result = mapper(NodeView(self, i))
        except _Poisoned:
            self._poison(i)
            return
        except Refuse as exc:
            self._fail(i, str(exc))
            return
        except _UNREADABLE as exc:  # an attribute or constant of the wrong kind or size
            self.invalid(i, f"cannot read its attributes or constant inputs: {_one_line(exc)}")
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
            reason = _unwritable(value)
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
                raise Refuse(_unnamed(key, leaf))
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

    # ---- collapsed module calls

    def _collapsed_groups(self) -> dict[int, str]:
        """Data nodes of one call of a leaf module in COLLAPSED: one input, one output."""
        members: dict[str, list[int]] = {}
        for i in self.order():
            where = self.where[i]
            if where.cls in COLLAPSED and where.path in self.leaves:
                if self.is_data_node(i):
                    members.setdefault(where.path, []).append(i)
        groups = {}
        for path, nodes in members.items():
            if self._group_ends(nodes) is not None:
                groups.update({i: path for i in nodes})
        calls: dict[str, list[int]] = {}
        for i in self.order():
            call = self.fx[i]
            op = call.target if call is not None else ""
            if op in DECOMPOSED and self.is_data_node(i) and i not in groups:
                key = f"{self.where[i].path}#{call.name}"
                self.decomposed[key] = op
                calls.setdefault(key, []).append(i)
        for key, nodes in calls.items():
            groups.update({i: key for i in nodes})
        return groups

    def _group_ends(self, nodes: list[int]) -> tuple[str, str] | None:
        inside = {out for i in nodes for out in self.nodes[i].output if out}
        external = []
        for i in nodes:
            for name in self.nodes[i].input:
                if name and name in self.data and name not in inside and name not in external:
                    external.append(name)
        escaping = [  # read outside by a data node (Shape and CastLike read no values)
            out
            for out in inside
            if out == self.output
            or any(j not in nodes and self.is_data_node(j) for j in self.live_users(out))
        ]
        if len(external) != 1 or len(escaping) != 1:
            return None
        return external[0], escaping[0]

    def _collapse(self, path: str) -> None:
        nodes = [i for i in self.order() if self.groups.get(i) == path]
        if path in self.decomposed:
            self._recompose(path, nodes)
            return
        x, out = self._group_ends(nodes)
        cls = self.where[nodes[0]].cls
        try:
            name = COLLAPSED[cls](self, path, nodes, x, out)
        except _Poisoned:
            for i in nodes:
                self._poison(i)
            return
        except Refuse as exc:
            self._fail(nodes[0], f"{cls} as exported: {exc}")
            for i in nodes:
                self._poison(i)
            return
        self.values[out] = name

    def _recompose(self, key: str, nodes: list[int]) -> None:
        """The nodes the exporter decomposed one ATen call into, as one statement (see
        ``DECOMPOSED``), or one unmapped entry saying why not."""
        op = self.decomposed[key]
        inside = {out for i in nodes for out in self.nodes[i].output if out}
        escaping = [
            out
            for out in inside
            if out == self.output
            or any(j not in nodes and self.is_data_node(j) for j in self.live_users(out))
        ]
        try:
            if len(escaping) != 1:
                raise Refuse(f"its nodes have {len(escaping)} outputs read elsewhere, not one")
            external = []
            for i in nodes:
                for name in self.nodes[i].input:
                    if name in self.data and name not in inside and name not in external:
                        external.append(name)
            for name in external:
                self.value_of(name)  # a failed input: reported once, at its root
            name = DECOMPOSED[op](self, nodes, external, escaping[0])
        except _Poisoned:
            for i in nodes:
                self._poison(i)
            return
        except Refuse as exc:
            self._fail(nodes[-1], f"{op} as exported: {exc}")
            for i in nodes:
                self._poison(i)
            return
        self.values[escaping[0]] = name

    def check_linear(self, nodes: list[int], x: str, out: str, reference: Callable) -> None:
        """The nodes compute ``reference`` (a linear map, run in float64) on random input,
        up to the rounding of the file's element type: a different linear map (other
        windows, other weights) differs by the size of the values, not by a rounding."""
        self.check_nodes(nodes, [x], out, reference, "torch's module")

    def check_nodes(
        self,
        nodes: list[int],
        xs: list[str],
        out: str,
        reference: Callable,
        what: str,
        products: bool = False,
    ) -> None:
        """The nodes, run by ``onnx.reference`` on random inputs ``xs``, compute what
        ``reference`` (torch, in float64) computes on them, up to the file's rounding;
        ``products``: the nodes may multiply matrices (attention), each bounded in cost."""
        import torch

        helper = self.onnx.helper
        elem = self.dtypes.get(xs[0], 1)
        batch = self.batch or B1
        shapes = [[batch if d is BATCH else d for d in self.shape(x)] for x in xs]
        inside = {o for i in nodes for o in self.nodes[i].output}
        self._bound_check(nodes, [*xs, *inside], products)
        consts = {}
        for i in nodes:
            for name in self.nodes[i].input:
                if name and name not in xs and name not in inside:
                    if name not in self.pairs and name not in self.inits:
                        raise Refuse(f"reads {name}, which is not a constant")
                    consts[name] = self.pair(name)[0]
        ins = [helper.make_tensor_value_info(x, elem, shape) for x, shape in zip(xs, shapes)]
        ins += [
            helper.make_tensor_value_info(n, _elem(self.onnx, v), v.shape)
            for n, v in consts.items()
        ]
        outs = [helper.make_tensor_value_info(out, elem, None)]
        graph = helper.make_graph([self.nodes[i] for i in nodes], "check", ins, outs)
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        rng = np.random.default_rng(0)
        samples = [rng.standard_normal(s).astype(_np_dtype(self.onnx, elem)) for s in shapes]
        try:
            evaluator = self.onnx.reference.ReferenceEvaluator(model)
            got = evaluator.run(None, {**dict(zip(xs, samples)), **consts})[0]
            got = np.asarray(got, np.float64)
        except Exception as exc:  # noqa: BLE001
            raise Refuse(f"cannot evaluate the nodes to check them: {_one_line(exc)}") from None
        want = reference(*(torch.from_numpy(a.astype(np.float64)) for a in samples)).numpy()
        tolerance = 1e-12 if elem == 11 else 1e-5
        scale = float(np.abs(want).max()) or 1.0
        if got.shape != want.shape or not np.allclose(
            got, want, rtol=tolerance, atol=tolerance * scale
        ):
            raise Refuse(f"its nodes do not compute what {what} computes")

    def _check_dims(self, name: str) -> tuple | None:
        if name in self.first_run:
            return self.first_run[name]
        return self.pair(name)[0].shape if self.is_constant(name) else None

    def _bound_check(self, nodes: list[int], values: list[str], products: bool = False) -> None:
        """The check runs only cheap ops on values of known, bounded size (the file's
        metadata chose these nodes: it must not make the check a memory or time bomb);
        with ``products`` also MatMul, at most ``MAX_CHECK_ELEMENTS`` multiplications of
        a row by a column each."""
        for i in nodes:
            op = self.nodes[i].op_type
            if op == "MatMul" and products:
                a, b = (self._check_dims(n) for n in self.nodes[i].input[:2])
                if not a or not b or None in a or None in b:
                    raise Refuse(f"the shapes of {self.nodes[i].input[0]} are not known")
                if math.prod(a) * b[-1] > MAX_CHECK_ELEMENTS:
                    raise Refuse("a matrix product in the check would cost too much")
            elif op not in FOLDED:
                raise Refuse(f"it computes {op}, which the check does not run")
        for name in values:
            dims = self.first_run.get(name)
            if dims is None or any(d is None for d in dims):
                raise Refuse(f"the shape of {name} is not known")
            count = math.prod(int(d) for d in dims)
            if count > MAX_CHECK_ELEMENTS:
                raise Refuse(f"{name} would hold {count} elements in the check")

    def add_group_stmt(self, path: str, op: str, args: list[str], kwargs: dict, out: str) -> str:
        if path in self.names or not valid_path(path):
            raise Refuse(f"the module {path} is called twice or has an unusable name")
        self.names.add(path)
        self.stmts.append(Stmt(path, op, args, kwargs, path, self.shape(out)))
        return path


def _unnamed(key: str, leaf: str) -> str:
    text = (
        f"its {leaf} is the initializer {key!r}, which names no module's {leaf} (expected a "
        f"state-dict key like 'conv1.{leaf}')"
    )
    if key.startswith("onnx::"):
        text += (
            ": the TorchScript exporter folded a BatchNorm or a transpose into it; export with "
            "do_constant_folding=False and training=torch.onnx.TrainingMode.PRESERVE, or with "
            "dynamo=True, optimize=False"
        )
    return text


def _merge_dim(a: int | None, b: int | None):
    if a is None or b is None:
        return None
    if a == b:
        return a
    if (a, b) == (B1, B2):
        return BATCH
    return None


def _numel(tensor) -> int:
    """Exact (a Python int: hostile dims must not wrap around in int64)."""
    return math.prod(int(d) for d in tensor.dims)


def _np_dtype(onnx, elem: int):
    return onnx.helper.tensor_dtype_to_np_dtype(elem)


def _elem(onnx, array: np.ndarray) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(array.dtype)


def _attr_value(onnx, attribute) -> Any:
    value = onnx.helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    return value


# ---------------------------------------------------------------- the view mappers get


class NodeView:
    """What an ``onnx_ops`` mapper sees of one node (see that module's docstring)."""

    def __init__(self, mapper: _Mapper, index: int):
        self.m = mapper
        self.index = index
        self.node = mapper.nodes[index]
        self.op = self.node.op_type
        self.opset = mapper.opset
        self.attrs = {a.name: _attr_value(mapper.onnx, a) for a in self.node.attribute}

    def attr(self, name: str, default=None):
        """An attribute's value; an infinite or NaN float is the file's error (the model
        language has no literal for it), except where ONNX gives it a meaning."""
        value = self.attrs.get(name, default)
        if name in self.attrs and _non_finite(value) and (self.op, name) not in _UNBOUNDED:
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


# ---------------------------------------------------------------- collapsed modules


def _adaptive_avg_pool(mapper: _Mapper, path: str, nodes: list[int], x: str, out: str) -> str:
    import torch.nn.functional as F

    shape_in, shape_out = mapper.shape(x), mapper.shape(out)
    rank = len(shape_in)
    if rank not in (3, 4) or len(shape_out) != rank or shape_out[:2] != shape_in[:2]:
        raise Refuse(f"adaptive pooling of {list(shape_in)} to {list(shape_out)}")
    size = tuple(int(d) for d in shape_out[2:])
    if rank == 4:
        mapper.check_linear(nodes, x, out, lambda t: F.adaptive_avg_pool2d(t, size))
        op, output_size = "adaptive_avgpool2d", pair(size)
    else:
        mapper.check_linear(nodes, x, out, lambda t: F.adaptive_avg_pool1d(t, size))
        op, output_size = "adaptive_avgpool1d", size[0]
    args = [mapper.value_of(x)]
    return mapper.add_group_stmt(path, op, args, {"output_size": output_size}, out)


#: Leaf module classes mapped as one statement whatever the exporter decomposed them into:
#: qualified class name -> builder (linear maps only: ``check_linear`` proves them).
COLLAPSED: dict[str, Callable] = {
    "torch.nn.modules.pooling.AdaptiveAvgPool2d": _adaptive_avg_pool,
    "torch.nn.modules.pooling.AdaptiveAvgPool1d": _adaptive_avg_pool,
}


def _fx_bool(text: str | None) -> bool:
    if text in (None, "False"):
        return False
    if text == "True":
        return True
    raise Refuse(f"a flag written {text!r}, not True or False")


def _attention(mapper: _Mapper, nodes: list[int], external: list[str], out: str) -> str:
    """``F.scaled_dot_product_attention(q, k, v, mask, scale=s)`` as the dynamo exporter
    decomposes it (q and k scaled by sqrt(s), MatMul, the mask added, Softmax, rows of NaN
    zeroed, MatMul by v). The recorded call names q, k, v and the scale; the nodes must
    compute torch's attention with no mask or with the causal one (a mask built from
    sizes that masks nothing, as Hugging Face models pass without an attention mask), on
    random q, k, v with the file's constants: any other mask, scale or wiring differs by
    far more than a rounding and is refused."""
    import torch.nn.functional as F

    call = mapper.fx[nodes[-1]]
    args = call.args
    if len(args) < 3 or not all(a.startswith("%") for a in args[:3]):
        raise Refuse("its recorded call does not name q, k and v")
    q, k, v = (a[1:] for a in args[:3])
    if sorted(external) != sorted({q, k, v}):
        raise Refuse(f"its nodes read {external}, not the recorded q, k, v ({q}, {k}, {v})")
    extra = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:]))
    extra.update(call.kwargs)
    if float(extra.get("dropout_p", "0.0")) != 0.0:
        raise Refuse("attention dropout in the file (export in eval mode)")
    if _fx_bool(extra.get("enable_gqa")):
        raise Refuse("grouped-query attention (enable_gqa) is not read from ONNX files yet")
    causal = _fx_bool(extra.get("is_causal"))
    scale = float(extra["scale"]) if "scale" in extra else None
    shapes = [mapper.shape(name) for name in (q, k, v)]
    if any(len(s) != 4 for s in shapes) or shapes[0][1] != shapes[1][1]:
        raise Refuse(f"attention of q, k, v {[list(s) for s in shapes]}: expected [N, H, L, E]")
    tries = [True] if causal else ([False, True] if "attn_mask" in extra else [False])
    reason = None
    for mask in tries:
        try:
            mapper.check_nodes(
                nodes,
                [q, k, v],
                out,
                lambda a, b, c, m=mask: F.scaled_dot_product_attention(
                    a, b, c, is_causal=m, scale=scale
                ),
                "torch's attention without a mask" if not mask else "causal attention",
                products=True,
            )
        except Refuse as exc:
            reason = exc
            continue
        where = mapper.where[nodes[-1]]
        name = mapper.unique(mapper.functional_name(nodes[-1]))
        kwargs: dict[str, Any] = {"is_causal": True} if mask else {}
        if scale is not None:
            kwargs["scale"] = scale
        mapper.names.add(name)
        values = [mapper.value_of(n) for n in (q, k, v)]
        mapper.stmts.append(
            Stmt(
                name, "scaled_dot_product_attention", values, kwargs, where.path, mapper.shape(out)
            )
        )
        return name
    if "attn_mask" in extra and len(tries) > 1:
        raise Refuse(
            f"its attention mask masks more than the causal mask ({reason}): only a mask "
            "that masks nothing or the causal one is imported"
        )
    raise Refuse(str(reason))


#: ATen calls the dynamo exporter decomposes into many ONNX nodes, read back as one
#: statement: recorded target -> builder (it checks the nodes compute the call).
DECOMPOSED: dict[str, Callable] = {
    "aten.scaled_dot_product_attention.default": _attention,
}


# ---------------------------------------------------------------- entry points


def _mapped(model, inputs: Sequence[Tensor], source: str) -> tuple[_Mapper, str]:
    mapper = _Mapper(model, inputs, source)
    prediction = mapper.run()
    if mapper.unmapped:
        raise ImportFailure(f"cannot import {source}", mapper.unmapped)
    assert prediction is not None
    return mapper, prediction


def import_onnx(
    path: Path, inputs: Sequence[Tensor], name: str, source: str
) -> tuple[ImportedModel, dict[str, tuple[int, ...]]]:
    """The ONNX network as an ImportedModel (no loss yet) and the state the imported module
    must hold ({state-dict key: shape}); ImportFailure lists every unmapped node."""
    mapper, prediction = _mapped(load_model(path), inputs, source)
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
