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
    ceil = args.get("ceil_mode", False)
    size = tuple(
        _pool_size(n, k, s, p, ceil)
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
    logits, target = inputs
    _float(op, logits, 0)
    _rank(op, logits, 2, "of logits [N, C]", 0)
    if target.dtype != "i64" or target.shape != (BATCH,):
        raise ShapeError(f"{op} needs class indices i64[N] as its target, got {target}", 1)
    return ShapeResult(TensorType(logits.dtype, ()))


def pair_loss(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    a, b = inputs
    _float(op, a, 0)
    _float(op, b, 1)
    if a.shape != b.shape:
        raise ShapeError(f"{op} needs two tensors of the same shape, got {a} and {b}", 1)
    if a.dtype != b.dtype:
        raise ShapeError(f"{op} needs two tensors of the same dtype, got {a} and {b}", 1)
    return ShapeResult(TensorType(a.dtype, ()))


# ---------------------------------------------------------------- normalisation and 1-D ops (v2)


def _pool_size(n: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """torch's pooling output size (dilation 1): floor or ceil of (n + 2p - k) / s, plus 1;
    in ceil mode the last window must start inside the input or the left padding."""
    span = n + 2 * p - k
    if span < 0:
        return span // s + 1  # below 1: the caller reports it
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def _sequence(op: str, t: TensorType) -> tuple[int, int]:
    _rank(op, t, 3, "[N, C, L]")
    _float(op, t)
    _, c, length = t.shape
    return c, length  # type: ignore[return-value]


def _length_positive(op: str, out: int, length: int) -> None:
    if out < 1:
        raise ShapeError(
            f"{op} output length would be {out} (below 1) for input length {length}: "
            f"the input is too short for this kernel, stride and padding"
        )


def layernorm(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """normalized_shape must be the input's trailing dims, never reaching the batch dim;
    mean and rstd are [N, leading dims, 1, ...] as aten::native_layer_norm makes them."""
    (x,) = inputs
    _float(op, x)
    shape = tuple(args["normalized_shape"])
    if len(shape) >= x.rank:
        raise ShapeError(
            f"{op}: normalized_shape {shape} has {len(shape)} dims but the input {x} has only "
            f"{x.rank - 1} besides the batch dim, which is never normalised",
            arg="normalized_shape",
        )
    if tuple(x.shape[x.rank - len(shape) :]) != shape:
        trailing = tuple(x.shape[x.rank - len(shape) :])
        raise ShapeError(
            f"{op}: normalized_shape {shape} must equal the input's trailing dims {trailing} "
            f"(input {x})",
            arg="normalized_shape",
        )
    stat = (*x.shape[: x.rank - len(shape)], *(1 for _ in shape))
    return ShapeResult(x, {"stat_shape": stat})


def groupnorm(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """x is [N, C, ...]; num_groups must divide C; mean and rstd are [N, num_groups]."""
    (x,) = inputs
    _float(op, x)
    if x.rank < 2:
        raise ShapeError(f"{op} needs an input of at least 2 dims [N, C, ...], got {x}", 0)
    c, groups = x.shape[1], args["num_groups"]
    if c % groups:  # type: ignore[operator]
        raise ShapeError(
            f"{op}: num_groups ({groups}) must divide the number of channels ({c})",
            arg="num_groups",
        )
    return ShapeResult(x, {"num_channels": c, "stat_shape": (BATCH, groups)})


def batchnorm1d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    if x.rank not in (2, 3):
        raise ShapeError(f"{op} needs a 2-D input [N, C] or a 3-D input [N, C, L], got {x}", 0)
    _float(op, x)
    return ShapeResult(x, {"num_features": x.shape[1]})


def conv1d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, length = _sequence(op, x)
    groups = args["groups"]
    if c % groups or args["out_channels"] % groups:
        raise ShapeError(
            f"{op}: in_channels ({c}) and out_channels ({args['out_channels']}) must both be "
            f"divisible by groups ({groups})",
            arg="groups",
        )
    k, s, p, d = (args[a] for a in ("kernel_size", "stride", "padding", "dilation"))
    out = (length + 2 * p - d * (k - 1) - 1) // s + 1
    _length_positive(op, out, length)
    return ShapeResult(
        TensorType(x.dtype, (BATCH, args["out_channels"], out)),
        {"in_channels": c, "input_length": length},
    )


def pool1d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, length = _sequence(op, x)
    k, s, p = args["kernel_size"], args["stride"], args["padding"]
    if 2 * p > k:
        raise ShapeError(
            f"{op}: padding {p} must be at most half the kernel size {k}", arg="padding"
        )
    out = _pool_size(length, k, s, p, args.get("ceil_mode", False))
    _length_positive(op, out, length)
    return ShapeResult(TensorType(x.dtype, (BATCH, c, out)), {"input_length": length})


def adaptive_pool1d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, length = _sequence(op, x)
    return ShapeResult(
        TensorType(x.dtype, (BATCH, c, args["output_size"])), {"input_length": length}
    )


def rule(name: str) -> Rule:
    """The rule a registry entry names: a function here, or ``module:function``."""
    if ":" in name:
        module, _, func = name.partition(":")
        return getattr(importlib.import_module(module), func)
    found = globals().get(name)
    if not callable(found) or name.startswith("_"):
        raise KeyError(f"no shape rule named {name!r} in unroller.shapes")
    return found
