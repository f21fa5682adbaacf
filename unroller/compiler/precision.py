"""Precisions: which dtype each operator computes in, and the casts between them.

``--precision`` picks one of ``PRECISIONS``. A plain one (``fp32``, ``bf16``, ``fp16``) runs
every op in one dtype: the model's float inputs and its parameters are that dtype. A mixed
one (``bf16-mixed``, ``fp16-mixed``) follows torch.autocast's policy (its CUDA lists): the
parameters stay in the model's float dtype (float32 master weights) and each op runs in
the dtype its registry ``precision`` class says:

- ``lower`` (linear, matmul, convolutions, attention): the low dtype; float inputs are cast
  to it and the parameters are read through the step's cast cache (``L.cast``), so each
  weight is cast once per step and its gradient comes back to the float32 ``.grad``;
- ``fp32`` (softmax, log-softmax, the losses, layer and group norms, sums): the model's
  float dtype;
- ``input`` (batch norm): its float inputs' dtype, its float32 parameters read as they are
  (torch's batch norm kernels take a low-precision input with float32 weights and keep
  their statistics in float32);
- ``promote`` (everything else): the widest dtype of its float inputs and parameters, as
  torch's type promotion would give (float32 beside a float32 parameter).

Every cast is a ``cast`` statement the graph builder writes before the op that needs it
(``unroller.compiler.graph.ops``), one per value, dtype and block instance, so the stash plan, liveness,
recompute and the memory model see the casts as they see any op, and the backward of each
op stays in one dtype: a cast's backward casts the gradient back, as autograd's
``_to_copy`` does. The loss (an ``fp32`` op) is float32 and so is every ``.grad``.

Where this differs from torch.autocast on a CPU: the CPU lists keep layer norm, softmax and
the norms in the low dtype; the CUDA lists, followed here, keep them in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

from unroller.compiler.dtypes import FLOAT_DTYPES


@dataclass(frozen=True)
class Precision:
    """One ``--precision``: ``dtype`` is the parameters' and float inputs' dtype when the
    precision sets it (a plain low precision; None: the model's declared dtype), ``low`` the
    low dtype of a mixed precision (None: a plain one)."""

    name: str
    dtype: str | None
    low: str | None
    doc: str

    @property
    def mixed(self) -> bool:
        return self.low is not None


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", None, None, "every op in the model's float dtype (float32)"),
        Precision(
            "bf16-mixed",
            None,
            "bf16",
            "torch.autocast(dtype=torch.bfloat16)'s policy with every cast written out: float32 "
            "parameters, gradients and loss; matmuls, convolutions and attention in bfloat16; "
            "softmax, norms and losses in float32",
        ),
        Precision(
            "fp16-mixed",
            None,
            "f16",
            "as bf16-mixed in float16; a torch.amp.GradScaler (scaler=) keeps small gradients "
            "from underflowing",
        ),
        Precision("bf16", "bf16", None, "parameters, activations and gradients in bfloat16"),
        Precision("fp16", "f16", None, "parameters, activations and gradients in float16"),
    )
}
DEFAULT = "fp32"
NAMES: tuple[str, ...] = tuple(PRECISIONS)
#: The precision that computes what ``torch.autocast`` of a dtype (by its torch name) would.
AUTOCAST_MATCH = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed"}

# torch's type promotion among float dtypes: a wider one wins; bf16 with f16 gives f32
_RANK = {"bf16": 1, "f16": 1, "f32": 2, "f64": 3}


def get(name: str) -> Precision:
    """The precision called ``name`` (``NAMES`` lists them)."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; choose one of: {', '.join(NAMES)}") from None


def promoted(dtypes: list[str]) -> str | None:
    """The dtype torch's type promotion gives float tensors of these dtypes (None: none)."""
    floats = [d for d in dtypes if d in FLOAT_DTYPES]
    if not floats:
        return None
    widest = max(floats, key=lambda d: _RANK[d])
    if _RANK[widest] == 1 and len(set(floats)) > 1:
        return "f32"
    return widest


def compute_dtype(
    precision: Precision, op_class: str, inputs: list[str], model_dtype: str, has_params: bool
) -> str | None:
    """The dtype an op of registry class ``op_class`` runs in, given its inputs' dtypes, the
    model's float dtype (its parameters') and whether it has float parameters or buffers;
    None: no float tensor to cast (its inputs are integers and it holds no parameter)."""
    if not precision.mixed:
        return None
    assert precision.low is not None
    if op_class == "lower":
        return precision.low
    if op_class == "fp32":
        return model_dtype if any(d in FLOAT_DTYPES for d in inputs) or has_params else None
    if op_class == "input":
        return promoted(inputs)
    return promoted([*inputs, *([model_dtype] if has_params else [])])
