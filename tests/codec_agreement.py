"""How two formulations of a compressor must agree.

Bit for bit (NaN payloads aside), except where one of them ran the native DCT kernel
(``unroller/compress/native/dct_kernels.cpp``): its products are not BLAS's, so it agrees
with the PyTorch formulations up to float rounding only. There the contract, checked by
``assert_dct_close``, is: codes within one of each other, the same non-finite scales and
finite ones within 1e-5 relative, the same NaN and inf positions after decompression, and
per (sample, channel) a difference no larger than the code and scale differences allow (the
inverse transform is an isometry times 2**e) plus float rounding.
"""

from __future__ import annotations

import torch

from unroller.compress import Compressor, Dct, base
from unroller.compress.dct import prescale_exponent


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and bits (NaN: same positions; payloads not compared)."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    ints = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0).view(ints), b.masked_fill(nan_b, 0).view(ints)
    )


def native_dct(c: Compressor, dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether ``c`` runs the native DCT kernel on a ``dtype`` input under the current
    formulation flags (int8 storage, float32 work, a CPU tensor with host shortcuts)."""
    if not isinstance(c, Dct) or c.params["storage"] != "int8" or dtype == torch.float64:
        return False
    if torch.device(device).type != "cpu" or base.IPU_SAFE or not base._HOST_SHORTCUTS:
        return False
    return base.native_library(torch.empty(0)) is not None


def assert_agree(
    c: Compressor,
    got: tuple[tuple[torch.Tensor, ...], torch.Tensor],
    want: tuple[tuple[torch.Tensor, ...], torch.Tensor],
    inexact: bool,
    what: object = "",
) -> None:
    """(packed, decompressed) pairs agree: bit for bit, or with ``inexact`` within the
    native DCT's contract."""
    (packed, y), (packed_want, y_want) = got, want
    assert len(packed) == len(packed_want), what
    if not inexact:
        for i, (p, q) in enumerate(zip(packed, packed_want)):
            assert same_bits(p, q), (what, c, "packed", i)
        assert same_bits(y, y_want), (what, c, "decompressed")
        return
    assert_dct_close(c, packed, y, packed_want, y_want, what)


def assert_dct_close(
    c: Dct,
    packed: tuple[torch.Tensor, ...],
    y: torch.Tensor,
    packed_want: tuple[torch.Tensor, ...],
    y_want: torch.Tensor,
    what: object = "",
) -> None:
    """The native DCT's contract (module docstring) between two int8 packed forms and their
    decompressions."""
    (q, s), (qw, sw) = packed, packed_want
    for a, b in ((q, qw), (s, sw), (y, y_want)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), what
    if y.numel() == 0:
        return
    assert int((q.int() - qw.int()).abs().max()) <= 1, (what, "codes differ by more than one")
    for bad in (torch.isnan, torch.isinf):
        assert torch.equal(bad(s), bad(sw)), (what, "scale", bad.__name__)
        assert torch.equal(bad(y), bad(y_want)), (what, "decompressed", bad.__name__)
    assert torch.equal(torch.isinf(y) & (y > 0), torch.isinf(y_want) & (y_want > 0)), what
    finite = torch.isfinite(sw)
    s64, sw64 = s.double(), sw.double()
    assert bool(((s64 - sw64).abs() <= 1e-5 * sw64.abs())[finite].all()), (what, "scale")
    n, ch = s.shape
    ok = torch.isfinite(y) & torch.isfinite(y_want)
    diff = torch.where(ok, y.double() - y_want.double(), 0.0).reshape(n, ch, -1).norm(dim=-1)
    size = torch.where(ok, y_want.double(), 0.0).reshape(n, ch, -1).norm(dim=-1)
    differing = (q != qw).reshape(n, ch, -1).sum(-1).double()
    codes = qw.double().reshape(n, ch, -1).norm(dim=-1)
    step = 2.0 ** prescale_exponent(c.params["block"])
    rounding = max(1e-5, 4 * torch.finfo(y.dtype).eps)
    bound = step * (s64 * differing.sqrt() + (s64 - sw64).abs() * codes)
    bound = bound + rounding * (size + step * s64 * codes) + torch.finfo(y.dtype).tiny
    assert bool((diff <= bound)[finite].all()), (what, "decompressed", (diff - bound).max())
