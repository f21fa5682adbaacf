"""Shape and dtype rules, one function per family of operators.

A rule gets the op's name, its input tensor types and its validated arguments, and
returns the output type plus ``derived`` values (``in_channels``, ``input_hw``, ...)
that registry expressions and kernel arguments may use. Shapes carry the batch dim as
the symbol ``"N"``; a loss is a scalar (shape ``()``). The registry names the rule of
each op; an out-of-tree op may name ``"package.module:function"``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unroller.dtypes import DTYPES, FLOAT_DTYPES, INT_DTYPES  # noqa: F401 (re-exported)

BATCH = "N"
#: The dtype a rule gives an output that is floating point whatever its inputs are (an
#: embedding of integer ids): the graph makes it the model's float dtype.
MODEL_FLOAT = "float"

#: The largest size of any dim of any tensor, and the largest integer argument.
MAX_DIM = 2**31 - 1
#: The most elements one sample of any tensor, or one parameter or buffer, may have
#: (64 GiB in f32: more than any accelerator holds with room for the backward pass).
MAX_ELEMENTS = 2**34

Dim = int | str


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self, batch: int) -> int:
        return math.prod(batch if d == BATCH else d for d in self.shape)


@dataclass
class ShapeResult:
    type: TensorType
    derived: dict[str, Any] = field(default_factory=dict)


class ShapeError(Exception):
    """A shape or dtype problem; ``input_index`` says which positional input to point at."""

    def __init__(self, message: str, input_index: int | None = None, arg: str | None = None):
        super().__init__(message)
        self.message = message
        self.input_index = input_index
        self.arg = arg


Rule = Callable[[str, list[TensorType], dict[str, Any]], ShapeResult]


def size_problem(shape: tuple[Dim, ...]) -> str | None:
    """Why a shape (the batch dim counted as 1) is too large to allocate, or None."""
    for d in shape:
        if d != BATCH and not 1 <= d <= MAX_DIM:  # type: ignore[operator]
            return f"dim {d} is out of range (a dim is 1 to {MAX_DIM:,})"
    numel = math.prod(1 if d == BATCH else d for d in shape)  # type: ignore[misc]
    if numel > MAX_ELEMENTS:
        per = " per sample" if BATCH in shape else ""
        return f"{numel:,} elements{per}, more than the limit of {MAX_ELEMENTS:,} (2**34)"
    return None


def _float(op: str, t: TensorType, index: int = 0) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{op} needs a floating-point tensor, got {t}", index)


def _rank(op: str, t: TensorType, rank: int, what: str, index: int = 0) -> None:
    if t.rank != rank:
        raise ShapeError(f"{op} needs a {rank}-D input {what}, got {t}", index)


def _image(op: str, t: TensorType) -> tuple[int, int, int]:
    _rank(op, t, 4, "[N, C, H, W]")
    _float(op, t)
    _, c, h, w = t.shape
    return c, h, w  # type: ignore[return-value]


def _positive(
    op: str,
    out: tuple[int, int],
    inp: tuple[int, int],
    why: str = "the input is too small for this kernel, stride and padding",
    arg: str | None = None,
) -> None:
    if min(out) < 1:
        raise ShapeError(
            f"{op} output size would be {out[0]}x{out[1]} (below 1) for input size "
            f"{inp[0]}x{inp[1]}: {why}",
            arg=arg,
        )


def conv2d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, h, w = _image(op, x)
    groups = args["groups"]
    if c % groups or args["out_channels"] % groups:
        raise ShapeError(
            f"{op}: in_channels ({c}) and out_channels ({args['out_channels']}) must both be "
            f"divisible by groups ({groups})",
            arg="groups",
        )
    size = tuple(
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, s, p, d in zip(
            (h, w), args["kernel_size"], args["stride"], args["padding"], args["dilation"]
        )
    )
    _positive(op, size, (h, w))
    return ShapeResult(
        TensorType(x.dtype, (BATCH, args["out_channels"], *size)),
        {"in_channels": c, "input_hw": (h, w)},
    )


def conv_transpose2d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, h, w = _image(op, x)
    groups = args["groups"]
    if c % groups or args["out_channels"] % groups:
        raise ShapeError(
            f"{op}: in_channels ({c}) and out_channels ({args['out_channels']}) must both be "
            f"divisible by groups ({groups})",
            arg="groups",
        )
    for op_, s, d in zip(args["output_padding"], args["stride"], args["dilation"]):
        if op_ >= max(s, d):
            raise ShapeError(
                f"{op}: output_padding {args['output_padding']} must be smaller than stride "
                f"or dilation, per dim",
                arg="output_padding",
            )
    size = tuple(
        (n - 1) * s - 2 * p + d * (k - 1) + op_ + 1
        for n, k, s, p, op_, d in zip(
            (h, w),
            args["kernel_size"],
            args["stride"],
            args["padding"],
            args["output_padding"],
            args["dilation"],
        )
    )
    _positive(op, size, (h, w))
    return ShapeResult(
        TensorType(x.dtype, (BATCH, args["out_channels"], *size)),
        {"in_channels": c, "input_hw": (h, w)},
    )


def linear(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _float(op, x)
    if x.rank < 2:
        raise ShapeError(f"{op} needs an input of at least 2 dims [N, ..., features], got {x}", 0)
    return ShapeResult(
        TensorType(x.dtype, (*x.shape[:-1], args["out_features"])), {"in_features": x.shape[-1]}
    )


def batchnorm2d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, _, _ = _image(op, x)
    return ShapeResult(x, {"num_features": c})


def same_float(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _float(op, x)
    return ShapeResult(x)


def pool2d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _, h, w = _image(op, x)
    for k, p in zip(args["kernel_size"], args["padding"]):
        if 2 * p > k:
            raise ShapeError(
                f"{op}: padding {args['padding']} must be at most half the kernel size "
                f"{args['kernel_size']}",
                arg="padding",
            )
    size = tuple(
        (n + 2 * p - k) // s + 1
        for n, k, s, p in zip((h, w), args["kernel_size"], args["stride"], args["padding"])
    )
    _positive(op, size, (h, w))
    return ShapeResult(TensorType(x.dtype, (*x.shape[:2], *size)), {"input_hw": (h, w)})


def adaptive_pool2d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _, h, w = _image(op, x)
    return ShapeResult(
        TensorType(x.dtype, (*x.shape[:2], *args["output_size"])), {"input_hw": (h, w)}
    )


def upsample(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _, h, w = _image(op, x)
    scaled = [n * s for n, s in zip((h, w), args["scale_factor"])]
    if not all(math.isfinite(v) and v < 2**31 for v in scaled):
        raise ShapeError(
            f"{op}: scale_factor {args['scale_factor']} makes the output too large",
            arg="scale_factor",
        )
    size = tuple(int(math.floor(v)) for v in scaled)
    _positive(op, size, (h, w), "the scale factor is too small", arg="scale_factor")
    return ShapeResult(TensorType(x.dtype, (*x.shape[:2], *size)), {"input_hw": (h, w)})


def same_pair(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    a, b = inputs
    _float(op, a, 0)
    if a != b:
        raise ShapeError(f"{op} needs two tensors of the same shape and dtype, got {a} and {b}", 1)
    return ShapeResult(a)


def concat(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    first = inputs[0]
    dim = args["dim"]
    if not -first.rank <= dim < first.rank:
        raise ShapeError(f"{op}: dim {dim} is out of range for {first}", arg="dim")
    dim %= first.rank
    if dim == 0:
        raise ShapeError(f"{op}: cannot concatenate along the batch dim (dim 0)", arg="dim")
    for i, t in enumerate(inputs[1:], start=1):
        same_rest = t.rank == first.rank and all(
            a == b for j, (a, b) in enumerate(zip(t.shape, first.shape)) if j != dim
        )
        if t.dtype != first.dtype or not same_rest:
            raise ShapeError(
                f"{op}: input {i} is {t} but input 0 is {first}; all dims except dim {dim} "
                f"and the dtype must match",
                i,
            )
    sizes = tuple(t.shape[dim] for t in inputs)
    shape = list(first.shape)
    shape[dim] = sum(sizes)  # type: ignore[arg-type]
    return ShapeResult(TensorType(first.dtype, tuple(shape)), {"dim": dim, "sizes": sizes})


def flatten(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    start = args["start_dim"]
    if not -x.rank <= start < x.rank:
        raise ShapeError(f"{op}: start_dim {start} is out of range for {x}", arg="start_dim")
    start %= x.rank
    if start == 0:
        raise ShapeError(
            f"{op}: start_dim must be at least 1 (the batch dim stays)", arg="start_dim"
        )
    shape = (*x.shape[:start], math.prod(x.shape[start:]))  # type: ignore[arg-type]
    return ShapeResult(TensorType(x.dtype, shape), {"input_shape": tuple(x.shape[1:])})


def reshape(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    dims = list(args["shape"])
    total = math.prod(x.shape[1:])  # type: ignore[arg-type]
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise ShapeError(
            f"{op}: shape {tuple(dims)} may hold positive dims and at most one -1", arg="shape"
        )
    known = math.prod(d for d in dims if d != -1)
    if -1 in dims:
        if total % known:
            raise ShapeError(
                f"{op}: cannot reshape {x} to [N, {', '.join(map(str, dims))}]: "
                f"{total} elements per sample are not divisible by {known}",
                arg="shape",
            )
        dims[dims.index(-1)] = total // known
    elif known != total:
        raise ShapeError(
            f"{op}: cannot reshape {x} ({total} elements per sample) to "
            f"[N, {', '.join(map(str, dims))}] ({known} elements)",
            arg="shape",
        )
    return ShapeResult(TensorType(x.dtype, (BATCH, *dims)), {"input_shape": tuple(x.shape[1:])})


def cross_entropy(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """Scores [N, C] with class indices i64[N], or [N, C, d1, ...] with i64[N, d1, ...] (per
    pixel, per token: the classes are dim 1, as torch); the mean is a scalar. Derives
    num_classes (C)."""
    scores, target = inputs
    what = "of log-probabilities" if op == "nll_loss" else "of logits"
    _float(op, scores, 0)
    if scores.rank < 2:
        raise ShapeError(f"{op} needs an input {what} [N, C] or [N, C, d1, ...], got {scores}", 0)
    want = (BATCH, *scores.shape[2:])
    if target.dtype != "i64" or target.shape != want:
        expected = f"i64[{', '.join(map(str, want))}]"
        extra = "" if scores.rank == 2 else f" (the dims of {scores} without C, dim 1)"
        raise ShapeError(
            f"{op} needs class indices {expected} as its target{extra}, got {target}", 1
        )
    return ShapeResult(TensorType(scores.dtype, ()), {"num_classes": scores.shape[1]})


def nll_loss(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """As cross_entropy: log-probabilities [N, C, d1, ...], class indices i64[N, d1, ...]."""
    return cross_entropy(op, inputs, args)


def hardtanh(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """same_float, with min_val <= max_val (F.hardtanh refuses the reverse)."""
    if args["min_val"] > args["max_val"]:
        raise ShapeError(
            f"{op}: max_val ({args['max_val']}) must not be less than min_val ({args['min_val']})",
            arg="max_val",
        )
    return same_float(op, inputs, args)


def embedding(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """ids i64[N, ...] -> [N, ..., embedding_dim] in the model's float dtype; padding_idx, if
    given, must index a row (torch.nn.Embedding allows -num_embeddings .. num_embeddings-1)."""
    (ids,) = inputs
    if ids.dtype != "i64":
        raise ShapeError(f"{op} needs integer ids i64[N, ...], got {ids}", 0)
    n, pad = args["num_embeddings"], args["padding_idx"]
    if pad is not None and not -n <= pad < n:
        raise ShapeError(
            f"{op}: padding_idx {pad} is out of range for num_embeddings={n} "
            f"(it must be in [{-n}, {n - 1}])",
            arg="padding_idx",
        )
    return ShapeResult(TensorType(MODEL_FLOAT, (*ids.shape, args["embedding_dim"])))


def pair_loss(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    a, b = inputs
    _float(op, a, 0)
    _float(op, b, 1)
    if a.shape != b.shape:
        raise ShapeError(f"{op} needs two tensors of the same shape, got {a} and {b}", 1)
    if a.dtype != b.dtype:
        raise ShapeError(f"{op} needs two tensors of the same dtype, got {a} and {b}", 1)
    return ShapeResult(TensorType(a.dtype, ()))


def rule(name: str) -> Rule:
    """The rule a registry entry names: a function here, or ``module:function``."""
    if ":" in name:
        module, _, func = name.partition(":")
        return getattr(importlib.import_module(module), func)
    found = globals().get(name)
    if not callable(found) or name.startswith("_"):
        raise KeyError(f"no shape rule named {name!r} in unroller.shapes")
    return found
