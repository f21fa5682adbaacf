"""What the ONNX front end asks of single nodes and tensors: the bounds shape inference
and folding run under, where a node came from (module path, class, source line: the
exporter's metadata or the TorchScript node name), the dynamo exporter's record of the
ATen call, and readers of attributes and initializers. Leaf helpers, so that the mapper
and its pieces share one definition."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH, valid_path

#: The batch sizes shape inference and folding run at when the batch dim is symbolic.
B1, B2 = 5, 7


#: Initializers up to this many elements go to shape inference with their values (shape
#: arguments); larger ones (weights) with their shapes only, so inference copies no weights.
SMALL = 4096


#: A constant the importer computes may hold this many elements, or as many as the largest
#: constant it is computed from (a transposed or cast weight); shape arguments and biases are
#: far smaller. Checked on the shapes ONNX infers, before anything is allocated.
MAX_CONST_ELEMENTS = 2**20


#: The most elements the random input of a collapsed module's check may hold.
MAX_CHECK_ELEMENTS = 2**24


#: ONNX ops evaluated on constants: shape arithmetic, layout and elementwise ops, whose
#: cost is linear in their inputs and outputs (no convolution or matrix product, whose
#: cost a hostile file could make cubic in sizes it fits under the bounds above).
FOLDED = frozenset(
    """Abs Add And ArgMax ArgMin Cast CastLike Ceil Clip Concat Constant ConstantOfShape
    Cos CumSum Div Dropout Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements
    GatherND Greater GreaterOrEqual Identity IsInf IsNaN LeakyRelu Less LessOrEqual Log
    LogSoftmax Max Mean Min Mod Mul Neg Not OneHot Or Pad Pow Range Reciprocal ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum Relu Reshape Round ScatterElements ScatterND
    Shape Sigmoid Sign Sin Size Slice Softmax Split Sqrt Squeeze Sub Sum Tanh Tile Transpose
    Trilu Unsqueeze Where Xor""".split()
)


#: (op, attribute) pairs where an infinite value is meaningful (Clip before opset 11:
#: no bound on that side).
UNBOUNDED = {("Clip", "min"), ("Clip", "max")}


DEFAULT_DOMAINS = ("", "ai.onnx")


#: Element types a tensor in the file may hold: numbers and booleans (no strings, complex
#: numbers or the 4/8-bit float formats numpy cannot hold).
NUMERIC = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 16})


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def type_name(onnx, elem: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(elem)
    except ValueError:
        return f"element type {elem}"


def itemsize(onnx, elem: int) -> int:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)).itemsize


def value_dims(value_info) -> list[int | str | None] | None:
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


class NodeWhere:
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


def node_where(node) -> NodeWhere:
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
        return NodeWhere(paths or [""], classes, _short(op), location, rules)
    if scopes:  # a node the exporter made outside any module call (sym_size)
        return NodeWhere([""], [], _short(node.op_type), location, rules)
    if node.name.startswith("/"):
        return NodeWhere(_scopes_from_name(node.name), [], _short(node.op_type), location, rules)
    return NodeWhere([""], [], _short(node.name or node.op_type), location, rules)


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


class Poisoned(Refuse):
    """Reads a value that already failed: reported once, at its root."""


#: What a mapper raises on an attribute or constant of the wrong kind (a string where a
#: number belongs, an infinite index): the file's fault, reported as such in one line.
UNREADABLE = (ValueError, TypeError, OverflowError, ArithmeticError, IndexError, KeyError)


#: The largest integer magnitude the model language accepts in an argument or a dim.
MAX_INT = 2**31 - 1


def unwritable(value) -> str | None:
    """Why the model language cannot write a keyword value the file's numbers produced (an
    inf or NaN, an integer past ``MAX_INT``), or None: the file's error, not an importer's."""
    if isinstance(value, (tuple, list)):
        return next((r for r in map(unwritable, value) if r), None)
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"past {MAX_INT} in magnitude"
    return None


def non_finite(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(non_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


def unnamed(key: str, leaf: str) -> str:
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


def merge_dim(a: int | None, b: int | None):
    if a is None or b is None:
        return None
    if a == b:
        return a
    if (a, b) == (B1, B2):
        return BATCH
    return None


def numel(tensor) -> int:
    """Exact (a Python int: hostile dims must not wrap around in int64)."""
    return math.prod(int(d) for d in tensor.dims)


def np_dtype_of(onnx, elem: int):
    return onnx.helper.tensor_dtype_to_np_dtype(elem)


def elem_of(onnx, array: np.ndarray) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(array.dtype)


def attr_value(onnx, attribute) -> Any:
    value = onnx.helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    return value
