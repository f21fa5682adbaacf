"""The accuracy contract of a low-precision step, as the tests check it: the rows of
``unroll verify --precision`` (``unroller.analysis.verify_precision.contract_row``), on
tensors the tests made themselves.

Against a float64 reference, each tensor (the loss, every parameter gradient) of our step
has a relative error of at most ``FACTOR`` times that of torch's own step in the precision
(autograd under torch.autocast, or on the module moved to the low dtype), plus the low
dtype's floor (so that a tensor both get almost exactly right does not fail on its last
bits). A gradient that is zero in exact arithmetic (BERT's key bias: it shifts every score
of a row alike) is noise on both sides: below ``NOISE_FRACTION`` of the largest reference
norm, errors are measured against that largest norm instead of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from unroller.analysis.verify_precision import contract_row, largest_norm
from unroller.compiler.precision import get as get_precision

#: The plain precision of each low dtype: its floor is the contract's
_OF_LOW = {"bf16": "bf16", "f16": "fp16"}


def violations(
    ours: Mapping[str, Tensor],
    peer: Mapping[str, Tensor],
    reference: Mapping[str, Tensor],
    low: str = "bf16",
) -> list[str]:
    """The tensors on which ``ours`` breaks the contract (empty: kept), each with its
    errors and bound, for the assertion message; ``low``: the low dtype (its floor)."""
    precision = get_precision(_OF_LOW[low])
    scale = largest_norm(reference.values())
    rows = (
        contract_row(name, ours[name], peer[name], ref, precision, scale)
        for name, ref in reference.items()
    )
    return [f"{r.name}: {r.ours:.2e} > {r.bound:.2e} ({r.peer:.2e} peer)" for r in rows if not r.ok]
