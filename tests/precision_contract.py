"""The accuracy contract of a mixed-precision step, as the tests check it.

Against a float64 reference, each tensor (the loss, every parameter gradient) of our step
has a relative error of at most ``SLACK`` times that of autograd under torch.autocast on
the same network, plus ``FLOOR`` (a quarter of bfloat16's epsilon 2^-8, so that a tensor
both get almost exactly right does not fail on its last bits). A gradient that is zero in
exact arithmetic (BERT's key bias: it shifts every score of a row alike) is noise on both
sides: below ``NOISE`` of the largest reference norm, errors are measured against that
largest norm instead of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

SLACK, FLOOR, NOISE = 2.0, 2**-10, 1e-6


def _diff(a: Tensor, ref: Tensor) -> float:
    return float((a.detach().double() - ref.detach().double()).norm())


def violations(
    ours: Mapping[str, Tensor], peer: Mapping[str, Tensor], reference: Mapping[str, Tensor]
) -> list[str]:
    """The tensors on which ``ours`` breaks the contract (empty: kept), each with its
    errors and bound, for the assertion message."""
    norms = {k: float(r.detach().double().norm()) for k, r in reference.items()}
    largest = max(norms.values())
    bad = []
    for name, ref in reference.items():
        scale = norms[name] if norms[name] >= NOISE * largest else largest
        mine, theirs = _diff(ours[name], ref) / scale, _diff(peer[name], ref) / scale
        if mine > SLACK * theirs + FLOOR:
            bad.append(f"{name}: {mine:.2e} > {SLACK} x {theirs:.2e} + {FLOOR:.1e}")
    return bad
