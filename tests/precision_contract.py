"""The accuracy contract of a low-precision step, as the tests check it: the criterion of
``unroll verify --precision`` (unroller.analysis.verify_precision), on tensors the tests
made themselves.

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

from unroller.analysis.verify_precision import FACTOR, FLOORS, NOISE_FRACTION


def _diff(a: Tensor, ref: Tensor) -> float:
    return float((a.detach().double() - ref.detach().double()).norm())


def violations(
    ours: Mapping[str, Tensor],
    peer: Mapping[str, Tensor],
    reference: Mapping[str, Tensor],
    low: str = "bf16",
) -> list[str]:
    """The tensors on which ``ours`` breaks the contract (empty: kept), each with its
    errors and bound, for the assertion message; ``low``: the low dtype (its floor)."""
    floor = FLOORS[low]
    norms = {k: float(r.detach().double().norm()) for k, r in reference.items()}
    largest = max(norms.values())
    bad = []
    for name, ref in reference.items():
        scale = norms[name] if norms[name] >= NOISE_FRACTION * largest else largest
        mine, theirs = _diff(ours[name], ref) / scale, _diff(peer[name], ref) / scale
        if mine > FACTOR * theirs + floor:
            bad.append(f"{name}: {mine:.2e} > {FACTOR} x {theirs:.2e} + {floor:.1e}")
    return bad
