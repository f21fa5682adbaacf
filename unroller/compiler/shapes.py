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

from unroller.compiler.dtypes import DTYPES, FLOAT_DTYPES, INT_DTYPES  # noqa: F401 (re-exported)

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


def _check_groups(op: str, in_channels: int, args: dict[str, Any]) -> None:
    """A grouped convolution splits both channel counts into ``groups`` equal parts."""
    groups = args["groups"]
    if in_channels % groups or args["out_channels"] % groups:
        raise ShapeError(
            f"{op}: in_channels ({in_channels}) and out_channels ({args['out_channels']}) "
            f"must both be divisible by groups ({groups})",
            arg="groups",
        )


def conv2d(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    c, h, w = _image(op, x)
    _check_groups(op, c, args)
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
    _check_groups(op, c, args)
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


def cast(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """A float tensor in another float dtype; ``source`` is the dtype its gradient goes back to."""
    (x,) = inputs
    _float(op, x)
    return ShapeResult(TensorType(args["dtype"], x.shape), {"source": x.dtype})


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


def broadcast(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """Elementwise a (op) b, broadcasting as torch (dims aligned from the right; a dim of
    size 1 or a missing leading dim stretches). The batch dim stays first: an operand
    with N has it first, and N aligns only with N, a 1 or a missing dim. Derived:
    ``a_shape``/``b_shape``, an operand's shape where it was broadcast (its gradient is
    summed down to it), else None."""
    a, b = inputs
    _float(op, a, 0)
    _float(op, b, 1)
    if a.dtype != b.dtype:
        raise ShapeError(f"{op} needs two tensors of the same dtype, got {a} and {b}", 1)
    rank = max(a.rank, b.rank)
    out: list[Dim] = []
    for i in range(rank):
        da = a.shape[i - rank + a.rank] if i - rank + a.rank >= 0 else 1
        db = b.shape[i - rank + b.rank] if i - rank + b.rank >= 0 else 1
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        else:
            if BATCH in (da, db):
                why = f"the batch dim N lines up with size {db if da == BATCH else da}"
                rule = "N only with N, 1 or a missing dim"
            else:
                why, rule = f"sizes {da} and {db}", "each pair must be equal or one of them 1"
            raise ShapeError(
                f"{op} cannot broadcast {a} and {b}: {why} at dim {i} "
                f"(dims line up from the right; {rule})",
                1,
            )
    if BATCH in out and out[0] != BATCH:
        raise ShapeError(f"{op}: broadcasting {a} and {b} would move the batch dim N", 1)
    shape = tuple(out)
    return ShapeResult(
        TensorType(a.dtype, shape),
        {
            "a_shape": None if a.shape == shape else a.shape,
            "b_shape": None if b.shape == shape else b.shape,
        },
    )


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


def cross_entropy_widened(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """As cross_entropy, the loss in the model's float dtype whatever the logits' float
    dtype: a mixed precision's loss on low-precision logits."""
    result = cross_entropy(op, inputs, args)
    return ShapeResult(TensorType(MODEL_FLOAT, ()), result.derived)


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


def padded_positions(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """ids i64[N, L] -> positions i64[N, L] (no gradient)."""
    (ids,) = inputs
    if ids.dtype != "i64" or ids.rank != 2:
        raise ShapeError(f"{op} needs token ids i64[N, L], got {ids}", 0)
    return ShapeResult(ids)


def padding_mask(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """A padding mask i64[N, S] (or bool) -> an additive score bias [N, 1, 1, S] in the
    model's float dtype, which broadcasts over heads and queries (no gradient)."""
    (mask,) = inputs
    if mask.dtype in FLOAT_DTYPES or mask.rank != 2:
        raise ShapeError(f"{op} needs a padding mask i64[N, S] (1 attends, 0 pads), got {mask}", 0)
    return ShapeResult(TensorType(MODEL_FLOAT, (mask.shape[0], 1, 1, mask.shape[1])))


def embedding_rows(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """Rows start .. start+length-1 of a table [num_embeddings, embedding_dim]: [length,
    embedding_dim] without the batch dim (a free parameter's form: it meets batched tensors
    in broadcasting add / mul), in the model's float dtype. The rows must all exist: a
    slice past the table's end is an error, not a shorter result."""
    n, start, length = args["num_embeddings"], args["start"], args["length"]
    if start + length > n:
        arg = "start" if start >= n else "length"
        raise ShapeError(
            f"{op}: rows {start} to {start + length - 1} (start={start}, length={length}) "
            f"are past the end of a table of num_embeddings={n} rows",
            arg=arg,
        )
    return ShapeResult(TensorType(MODEL_FLOAT, (length, args["embedding_dim"])))


def pair_loss(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    a, b = inputs
    _float(op, a, 0)
    _float(op, b, 1)
    if a.shape != b.shape:
        raise ShapeError(f"{op} needs two tensors of the same shape, got {a} and {b}", 1)
    if a.dtype != b.dtype:
        raise ShapeError(f"{op} needs two tensors of the same dtype, got {a} and {b}", 1)
    return ShapeResult(TensorType(a.dtype, ()))


def free_parameter(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """A free parameter: the given shape, no batch dim (the graph sets the model's float
    dtype); ``init="uniform"`` needs a positive ``bound``."""
    shape = args["shape"]  # () is a learned scalar
    if any(d < 1 for d in shape):
        raise ShapeError(f"{op}: shape {shape} needs positive dims", arg="shape")
    if args["init"] == "uniform" and args["bound"] <= 0:
        raise ShapeError(
            f'{op}: init="uniform" needs bound > 0 (the range is [-bound, bound])', arg="init"
        )
    return ShapeResult(TensorType("f32", tuple(shape)))


# ---------------------------------------------------------------- shape and tensor ops (v2)
#
# A value without the batch dim (a free parameter, [1, 1, E] or [E, F]) may enter expand
# and matmul, whose outputs put N first, and select (one element of it, gammas[i]); the
# other ops here need N first in their input,
# because a dim argument of theirs would otherwise mean a different dim than it says.


def _batched(op: str, t: TensorType, index: int = 0) -> None:
    if not t.shape or t.shape[0] != BATCH:
        raise ShapeError(
            f"{op} needs a tensor with the batch dim N first, got {t} (a value without the "
            "batch dim can be broadcast to one with expand)",
            index,
        )


def _dim(op: str, t: TensorType, dim: int, arg: str = "dim") -> int:
    """``dim`` counted from 0 (negative ones from the end); neither out of range nor N's."""
    if not -t.rank <= dim < t.rank:
        raise ShapeError(
            f"{op}: {arg} {dim} is out of range for {t} (dims -{t.rank} to {t.rank - 1})",
            arg=arg,
        )
    if dim % t.rank == 0:
        raise ShapeError(
            f"{op}: {arg} {dim} is the batch dim N of {t}, which stays where it is", arg=arg
        )
    return dim % t.rank


def expand(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """Tensor.expand: -1 keeps a dim, a dim of size 1 grows, new dims come first. The
    output has N first: a batched input keeps it (size[0] is N or -1), an input without
    it gets it from size[0] = N (its own first dim must be 1, or be a new dim)."""
    (x,) = inputs
    size = tuple(args["size"])
    new = len(size) - x.rank
    if new < 0:
        raise ShapeError(
            f"{op}: size {_show(size)} has {len(size)} dims, fewer than the input's {x}",
            arg="size",
        )
    if BATCH in size[1:]:
        raise ShapeError(f"{op}: N may appear only first in size {_show(size)}", arg="size")
    batched = bool(x.shape) and x.shape[0] == BATCH
    if batched and new:
        raise ShapeError(
            f"{op}: size {_show(size)} adds {new} dim(s) in front of the batch dim of {x}; "
            "N stays first",
            arg="size",
        )
    if not batched and size[0] != BATCH:
        raise ShapeError(
            f"{op}: the output needs the batch dim first: size[0] must be N for {x}, got "
            f"{_show(size)}",
            arg="size",
        )
    out: list[Dim] = []
    for i, want in enumerate(size):
        have = x.shape[i - new] if i >= new else None
        if have is None:  # a new leading dim
            if want == -1:
                raise ShapeError(
                    f"{op}: -1 in size {_show(size)} is at a new dim (dim {i}), which has no "
                    "size to keep",
                    arg="size",
                )
            out.append(want)
        elif want == -1 or want == have:
            out.append(have)
        elif have == 1:
            out.append(want)
        else:
            raise ShapeError(
                f"{op}: cannot expand dim {i - new} of {x} (size {have}) to {want}: only "
                "dims of size 1 grow",
                arg="size",
            )
    kernel_size = (-1, *size[1:]) if batched else size
    return ShapeResult(
        TensorType(x.dtype, tuple(out)), {"size": kernel_size, "input_shape": x.shape}
    )


def transpose(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _batched(op, x)
    d0, d1 = _dim(op, x, args["dim0"], "dim0"), _dim(op, x, args["dim1"], "dim1")
    shape = list(x.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return ShapeResult(TensorType(x.dtype, tuple(shape)), {"dim0": d0, "dim1": d1})


def permute(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    _batched(op, x)
    dims = tuple(args["dims"])
    if len(dims) != x.rank or not all(-x.rank <= d < x.rank for d in dims):
        raise ShapeError(
            f"{op}: dims {_show(dims)} is not a permutation of the {x.rank} dims of {x}",
            arg="dims",
        )
    dims = tuple(d % x.rank for d in dims)
    if sorted(dims) != list(range(x.rank)):
        raise ShapeError(
            f"{op}: dims {_show(args['dims'])} is not a permutation of the {x.rank} dims of {x} "
            "(a dim repeats)",
            arg="dims",
        )
    if dims[0] != 0:
        raise ShapeError(f"{op}: dims {_show(args['dims'])} must keep dim 0 (N) first", arg="dims")
    inverse = tuple(dims.index(i) for i in range(x.rank))
    shape = tuple(x.shape[d] for d in dims)
    return ShapeResult(TensorType(x.dtype, shape), {"dims": dims, "inverse": inverse})


def select(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    (x,) = inputs
    if x.rank and x.shape[0] != BATCH:  # a free parameter's element (gammas[i]): any dim
        if not -x.rank <= args["dim"] < x.rank:
            raise ShapeError(f"{op}: dim {args['dim']} is out of range for {x}", arg="dim")
        dim = args["dim"] % x.rank
    else:
        _batched(op, x)
        dim = _dim(op, x, args["dim"])
    n = x.shape[dim]
    index = args["index"]
    if not -n <= index < n:  # type: ignore[operator]
        raise ShapeError(
            f"{op}: index {index} is out of range for dim {dim} of {x} (size {n})", arg="index"
        )
    index %= n  # type: ignore[operator]
    shape = x.shape[:dim] + x.shape[dim + 1 :]
    kept = x.shape[1:] if x.shape[0] == BATCH else x.shape  # select_backward tells them apart
    return ShapeResult(
        TensorType(x.dtype, shape), {"dim": dim, "index": index, "input_shape": kept}
    )


def slice_dim(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """x[..., start:end:step] along dim; bounds past the dim are errors (not clamped)."""
    (x,) = inputs
    _batched(op, x)
    dim = _dim(op, x, args["dim"])
    n = x.shape[dim]
    start, end, step = args["start"], args["end"], args["step"]
    end = n if end is None else end
    for name, v in (("start", start), ("end", end)):
        if not -n <= v <= n:  # type: ignore[operator]
            raise ShapeError(
                f"{op}: {name} {v} is out of range for dim {dim} of {x} (size {n})", arg=name
            )
    start, end = start if start >= 0 else start + n, end if end >= 0 else end + n
    if start >= end:
        raise ShapeError(f"{op}: the slice {start}:{end} of dim {dim} of {x} is empty", arg="start")
    shape = list(x.shape)
    shape[dim] = -(-(end - start) // step)
    derived = {"dim": dim, "start": start, "end": end, "input_shape": x.shape[1:]}
    return ShapeResult(TensorType(x.dtype, tuple(shape)), derived)


def _broadcast(op: str, a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """torch's broadcasting of two shapes, N matching N or 1 (N may be any size)."""
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeError(
                f"{op}: batch dims [{', '.join(map(str, a))}] and [{', '.join(map(str, b))}] "
                f"do not broadcast ({x} against {y})",
                1,
            )
    return tuple(reversed(out))


def matmul(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """torch.matmul of matrices (2-D or more) with batch broadcasting; one of a, b may lack
    N (a free parameter, as x @ W), and the result has N first."""
    a, b = inputs
    _float(op, a, 0)
    for i, t in enumerate(inputs):
        if t.rank < 2:
            raise ShapeError(f"{op} needs matrices (2 dims or more), got {t}", i)
    if b.dtype != a.dtype:
        raise ShapeError(f"{op} needs two tensors of the same dtype, got {a} and {b}", 1)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(
            f"{op}: the inner dims differ: {a} @ {b} ({a.shape[-1]} against {b.shape[-2]})", 1
        )
    if BATCH in (a.shape[-1], *b.shape[-2:]) or (a.rank == 2 and BATCH in a.shape and b.rank > 2):
        raise ShapeError(
            f"{op}: {a} @ {b} would use the batch dim N as a matrix dim; N may be only a "
            "batch dim of either, or the rows of a 2-D a against a 2-D b",
            0 if BATCH in a.shape[-1:] else 1,
        )
    batch = _broadcast(op, a.shape[:-2], b.shape[:-2])
    shape = (*batch, a.shape[-2], b.shape[-1])
    if shape[0] != BATCH:
        which = "neither input has" if BATCH not in (*a.shape, *b.shape) else "it is not"
        raise ShapeError(
            f"{op}: the result {TensorType(a.dtype, shape)} must have the batch dim N first "
            f"({which} first in {a} @ {b})",
            0 if BATCH in a.shape else 1,
        )
    return ShapeResult(TensorType(a.dtype, shape), {"a_shape": a.shape, "b_shape": b.shape})


def softmax(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """softmax / log_softmax along a dim other than N's."""
    (x,) = inputs
    _float(op, x)
    _batched(op, x)
    _dim(op, x, args["dim"])
    return ShapeResult(x)


def reduce(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """sum / mean over dims other than N's (all of them leaves [N])."""
    (x,) = inputs
    _float(op, x)
    _batched(op, x)
    dims = tuple(_dim(op, x, d) for d in args["dim"])
    if len(set(dims)) != len(dims):
        raise ShapeError(f"{op}: dim {_show(args['dim'])} names a dim twice", arg="dim")
    if args["keepdim"]:
        shape = tuple(1 if i in dims else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in dims)
    derived = {"dim": tuple(sorted(dims)), "input_shape": x.shape[1:]}
    return ShapeResult(TensorType(x.dtype, shape), derived)


def pad(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """F.pad: (left, right) pairs from the last dim backwards, never reaching N's dim."""
    (x,) = inputs
    _float(op, x)
    _batched(op, x)
    widths = tuple(args["pad"])
    if len(widths) % 2 or len(widths) // 2 > x.rank - 1:
        raise ShapeError(
            f"{op}: pad {_show(widths)} needs an even length of at most {2 * (x.rank - 1)} "
            f"for {x} (pairs for the last dims; the batch dim is never padded)",
            arg="pad",
        )
    shape = list(x.shape)
    for i in range(len(widths) // 2):
        shape[-1 - i] += widths[2 * i] + widths[2 * i + 1]  # type: ignore[operator]
    return ShapeResult(TensorType(x.dtype, tuple(shape)), {"pad": widths})


def _show(values: tuple) -> str:
    """A tuple as written in a model file: (N, -1, 3)."""
    inner = ", ".join(map(str, values))
    return f"({inner},)" if len(values) == 1 else f"({inner})"


# ---------------------------------------------------------------- attention


def _attention_operand(op: str, t: TensorType, name: str, index: int) -> tuple[Dim, ...]:
    """One of q, k, v: float, [N, H, length, E]."""
    if t.rank != 4:
        raise ShapeError(f"{op} needs {name} as a 4-D tensor [N, H, L, E], got {t}", index)
    _float(op, t, index)
    return t.shape


def scaled_dot_product_attention(
    op: str, inputs: list[TensorType], args: dict[str, Any]
) -> ShapeResult:
    """q [N, H, L, E], k [N, H, S, E], v [N, H, S, Ev] -> [N, H, L, Ev]; one dtype (with
    ``enable_gqa`` k and v may have Hkv heads, H a multiple of Hkv). The row logsumexp
    [N, H, L] is kept for the backward (``lse_shape``), which remakes the probabilities
    from it. An optional fourth input ``bias`` is added to the scores (before the causal
    mask): [N or 1, H or 1, L, S], q's dtype (relative position bias, a padding mask)."""
    q, k, v, *bias = inputs
    _, heads, length, embed = _attention_operand(op, q, "q", 0)
    _, k_heads, k_length, k_embed = _attention_operand(op, k, "k", 1)
    _, v_heads, v_length, v_embed = _attention_operand(op, v, "v", 2)
    for index, t in ((1, k), (2, v)):
        if t.dtype != q.dtype:
            raise ShapeError(f"{op}: q is {q} but {'kv'[index - 1]} is {t}: one dtype", index)
    gqa = bool(args.get("enable_gqa"))
    if gqa and (k_heads < 1 or heads % k_heads):
        raise ShapeError(
            f"{op}: q's {heads} heads (dim 1) are not a multiple of k's {k_heads} "
            "(enable_gqa: each key/value head serves a group of query heads)",
            1,
        )
    if not gqa and k_heads != heads:
        raise ShapeError(
            f"{op}: k has {k_heads} heads (dim 1) but q has {heads} "
            "(fewer key/value heads need enable_gqa=true)",
            1,
        )
    if k_embed != embed:
        raise ShapeError(
            f"{op}: k's last dim is {k_embed} but q's is {embed} (q k^T needs them equal)", 1
        )
    if v_heads != k_heads:
        raise ShapeError(f"{op}: v has {v_heads} heads (dim 1) but k has {k_heads}", 2)
    if v_length != k_length:
        raise ShapeError(
            f"{op}: v has length {v_length} (dim 2) but k has {k_length}: one value per key", 2
        )
    if bias:
        _attention_bias(op, bias[0], q.dtype, heads, length, k_length)
    return ShapeResult(
        TensorType(q.dtype, (BATCH, heads, length, v_embed)),
        {"lse_shape": (BATCH, heads, length)},
    )


def _attention_bias(
    op: str, bias: TensorType, dtype: str, heads: Dim, length: Dim, keys: Dim, index: int = 3
) -> None:
    """An additive score bias broadcasts over samples and heads only: [N or 1, H or 1, L, S]."""
    want = f"[N or 1, {heads} or 1, {length}, {keys}]"
    if bias.rank != 4:
        raise ShapeError(f"{op} needs bias as a 4-D tensor {want}, got {bias}", index)
    if bias.dtype != dtype:
        raise ShapeError(
            f"{op}: bias is {bias} but {'q' if index == 3 else 'x'} is {dtype}: one dtype", index
        )
    samples, bias_heads, rows, cols = bias.shape
    if samples not in (BATCH, 1) or bias_heads not in (heads, 1) or (rows, cols) != (length, keys):
        raise ShapeError(f"{op}: bias is {bias}; expected {want}", index)


def relative_position_bias(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """A bias [1, heads, query_length, key_length] without the batch dim (it broadcasts over
    the samples where an attention adds it). The exact buckets (half of num_buckets, half
    again each way when bidirectional) must be at least one and fewer than max_distance,
    whose log scale covers the rest."""
    buckets = args["num_buckets"] // (2 if args["bidirectional"] else 1)
    exact = buckets // 2
    if exact < 1:
        raise ShapeError(
            f"{op}: num_buckets={args['num_buckets']} leaves no exact bucket "
            "(bidirectional needs at least 4, one way at least 2)",
            arg="num_buckets",
        )
    if args["max_distance"] <= exact:
        raise ShapeError(
            f"{op}: max_distance={args['max_distance']} must exceed the {exact} offsets with "
            "buckets of their own",
            arg="max_distance",
        )
    shape = (1, args["heads"], args["query_length"], args["key_length"])
    return ShapeResult(TensorType(MODEL_FLOAT, shape))


def rotary(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """x [N, H, L, D] -> the same; D even (its two halves turn as pairs)."""
    (x,) = inputs
    *_, embed = _attention_operand(op, x, "x", 0)
    if embed % 2:
        raise ShapeError(f"{op}: the last dim is {embed}; it must be even (its halves pair up)", 0)
    return ShapeResult(x)


def alibi(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """Scores x [N, H, L, S] -> the same: the bias is per head (dim 1) and key (dim 3)."""
    (x,) = inputs
    if x.rank != 4:
        raise ShapeError(f"{op} needs scores as a 4-D tensor [N, H, L, S], got {x}", 0)
    _float(op, x)
    return ShapeResult(x)


def multihead_attention(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """Self-attention on x [N, L, E] -> [N, L, E]: E divisible by num_heads. Derives
    ``embed_dim`` (the module's size), ``head_shape`` [N, H, L, E/H] (q, k, v kept for the
    backward) and ``lse_shape`` [N, H, L] (the row logsumexp it keeps beside them). An
    optional ``bias`` [N or 1, H or 1, L, L] is added to the scores (a key padding mask).
    Attention dropout is refused: it draws inside torch's SDPA from a random stream no kernel
    here can reproduce."""
    x, *bias = inputs
    if x.rank != 3:
        raise ShapeError(f"{op} needs a 3-D input [N, L, E], got {x}", 0)
    _float(op, x)
    _, length, embed = x.shape
    heads = args["num_heads"]
    if embed % heads:  # type: ignore[operator]
        raise ShapeError(
            f"{op}: embed_dim {embed} (the last dim of x) is not divisible by num_heads {heads}",
            arg="num_heads",
        )
    if args["dropout"] != 0.0:
        raise ShapeError(
            f"{op}: dropout={args['dropout']} is not supported (attention dropout draws inside "
            f"torch's scaled_dot_product_attention, a random stream the unrolled backward "
            f"cannot replay); use dropout=0.0",
            arg="dropout",
        )
    if bias:
        _attention_bias(op, bias[0], x.dtype, heads, length, length, index=1)
    return ShapeResult(
        x,
        {
            "embed_dim": embed,
            "head_shape": (BATCH, heads, length, embed // heads),  # type: ignore[operator]
            "lse_shape": (BATCH, heads, length),
        },
    )


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
    _check_groups(op, c, args)
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


# ---------------------------------------------------------------- recurrent layers


def moe(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """A mixture of experts keeps x's type; derived ``in_features`` (x's last dim) and
    ``index_shape`` [N, ..., top_k] (the chosen experts it keeps for the backward)."""
    (x,) = inputs
    _float(op, x)
    if x.rank < 2:
        raise ShapeError(f"{op} needs an input of at least 2 dims [N, ..., features], got {x}", 0)
    if args["top_k"] > args["num_experts"]:
        raise ShapeError(
            f"{op}: top_k={args['top_k']} chooses more experts than num_experts="
            f"{args['num_experts']}",
            arg="top_k",
        )
    return ShapeResult(
        x, {"in_features": x.shape[-1], "index_shape": (*x.shape[:-1], args["top_k"])}
    )


def recurrent(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """lstm / gru: x [N, L, E] -> [N, L, D * H]; after x the initial states given (h0, and
    the LSTM's c0), each [N, num_layers * D, H], batch first as every tensor here. Derives
    the module's ``input_size``, ``directions`` (D), ``initial_states`` (how many were
    given) and the kept tensors' shapes: ``gates_shape`` [N, S, L, 4H] and
    ``states_shape`` [N, S, L + 1, H] (S = num_layers * D)."""
    x, states = inputs[0], inputs[1:]
    most = 2 if op == "lstm" else 1
    names = ("h0", "c0")[:most]
    if len(states) > most:
        raise ShapeError(
            f"{op} takes x and at most {most} initial state(s) ({', '.join(names)}), got "
            f"{len(inputs)} tensors",
            most + 1,
        )
    if not args["batch_first"]:
        raise ShapeError(
            f"{op}: batch_first=false is not supported: every tensor of the language has the "
            "batch dim N first, so x is [N, L, E] (a torch module built with batch_first=False "
            "has the same weights: build it with batch_first=True)",
            arg="batch_first",
        )
    if x.rank != 3 or x.shape[0] != BATCH:
        raise ShapeError(f"{op} needs x as a 3-D tensor [N, L, E], got {x}", 0)
    _float(op, x)
    _, length, embed = x.shape
    hidden, directions = args["hidden_size"], 2 if args["bidirectional"] else 1
    stacks = args["num_layers"] * directions
    want = TensorType(x.dtype, (BATCH, stacks, hidden))
    for index, state in enumerate(states, 1):
        if state != want:
            raise ShapeError(
                f"{op}: {names[index - 1]} must be {want} ([N, num_layers * directions, "
                f"hidden_size], batch first), got {state}",
                index,
            )
    out = TensorType(x.dtype, (BATCH, length, directions * hidden))  # type: ignore[operator]
    return ShapeResult(
        out,
        {
            "input_size": embed,
            "directions": directions,
            "initial_states": len(states),
            "gates_shape": (BATCH, stacks, length, 4 * hidden),
            "states_shape": (BATCH, stacks, length + 1, hidden),  # type: ignore[operator]
        },
    )


def rule(name: str) -> Rule:
    """The rule a registry entry names: a function here, or ``module:function``."""
    if ":" in name:
        module, _, func = name.partition(":")
        return getattr(importlib.import_module(module), func)
    found = globals().get(name)
    if not callable(found) or name.startswith("_"):
        raise KeyError(f"no shape rule named {name!r} in unroller.compiler.shapes")
    return found
