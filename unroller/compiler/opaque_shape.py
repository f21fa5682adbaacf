"""The ``aten`` operator's shape rule: the op itself, run on meta tensors.

No rule written by hand can know what an arbitrary ATen overload returns, so the rule
asks the op: it runs the call (``unroller.runtime.opaque.run``) on meta tensors of the
inputs' shapes twice, with two batch sizes, and reads the batch dim off what changed (it
must be the first dim, as everywhere in the language). The op name and the call text are
validated here, at graph-build time, so a model text naming anything else is a
``FILE:LINE:COL`` error before any code is generated.
"""

from __future__ import annotations

from typing import Any

from unroller.compiler.dtypes import is_float, torch_dtype
from unroller.compiler.shapes import BATCH, MODEL_FLOAT, ShapeError, ShapeResult, TensorType

#: two batch sizes unlikely to equal a model's other dims
_BATCHES = (7919, 7907)
_NAMES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}
_NAMES.update({"int64": "i64", "int32": "i32", "bool": "bool"})


def _meta(inputs: list[TensorType], batch: int) -> list[Any]:
    import torch

    return [
        torch.empty(
            tuple(batch if d == BATCH else d for d in t.shape),
            dtype=torch_dtype(t.dtype),
            device="meta",
        )
        for t in inputs
    ]


def _result(op: str, args: dict[str, Any], inputs: list[TensorType], batch: int) -> Any:
    import torch

    from unroller.runtime.opaque import CallError, run

    try:
        out = run(args["op"], args["call"], _meta(inputs, batch), args.get("output"))
    except CallError as exc:
        raise ShapeError(f"{op}: {exc}", arg="call") from None
    except Exception as exc:  # noqa: BLE001 - the op refused these arguments: say how
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ShapeError(f"{op}: {args['op']} refused the call: {text[:200]}", arg="call") from None
    if not isinstance(out, torch.Tensor):
        raise ShapeError(
            f"{op}: {args['op']} returns {type(out).__name__}, not a tensor: pick one element "
            "of a tuple result with output=I",
            arg="output",
        )
    return out


def aten(op: str, inputs: list[TensorType], args: dict[str, Any]) -> ShapeResult:
    """The output type of ``torch.ops.aten.NAME.OVERLOAD`` on these inputs; derived
    ``random``: the op draws from torch's random stream (its seed is kept)."""
    from unroller.runtime.opaque import CallError, is_random, references, resolve

    try:
        resolve(args["op"])
    except CallError as exc:
        raise ShapeError(f"{op}: {exc}", arg="op") from None
    try:
        read = references(args["call"])
    except CallError as exc:
        raise ShapeError(f"{op}: {exc}", arg="call") from None
    if read != set(range(len(inputs))):
        raise ShapeError(
            f"{op}: the call reads t{sorted(read)} but the statement gives {len(inputs)} "
            "tensor input(s): each of t0..t{len-1} read, no other",
            arg="call",
        )
    first, second = (_result(op, args, inputs, b) for b in _BATCHES)
    shape: list[Any] = []
    for i, (a, b) in enumerate(zip(first.shape, second.shape)):
        if a == b:
            shape.append(int(a))
        elif i == 0 and (a, b) == _BATCHES:
            shape.append(BATCH)
        else:
            raise ShapeError(
                f"{op}: {args['op']} makes dim {i} from the batch size: only dim 0 may be N",
                arg="call",
            )
    name = str(first.dtype).removeprefix("torch.")
    if name not in _NAMES:
        raise ShapeError(f"{op}: {args['op']} returns a {name} tensor, not a model dtype")
    dtype = _NAMES[name]
    if is_float(dtype) and not any(is_float(t.dtype) for t in inputs):
        dtype = MODEL_FLOAT
    return ShapeResult(TensorType(dtype, tuple(shape)), {"random": is_random(args["op"])})
