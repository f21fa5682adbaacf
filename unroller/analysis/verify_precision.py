"""``verify --precision``: the accuracy contract of a low-precision step.

A step generated for a low ``--precision`` (``bf16-mixed``, ``fp16-mixed``, ``bf16``,
``fp16``; ``unroller.compiler.precision``) rounds where the float64 original does not, so it
can never meet the float64 check's 1e-10. What it promises instead is to be as accurate as
what torch gives for the same precision. ``unroller.analysis.verify`` runs three steps on the
same weights and the same seeded inputs:

- the reference: the original in float64 under autograd, as the float64 check steps it
  (casts lifted, Hugging Face norms as their float64 twins, eager experts);
- the peer: the original as torch runs it in that precision, under autograd. A mixed
  precision: its float32 parameters and float inputs under
  ``torch.autocast(device_type="cpu", dtype=low)`` (the backward outside it, as a training
  loop runs it); a plain one: the module moved ``.to(low)``, its float inputs cast;
- ours: the generated step for the precision (float32 parameters for a mixed one).

Per tensor (the loss, every parameter's gradient, every buffer after the step, the
evaluation-mode predictions) the error of a side is ``||x - ref|| / ||ref||`` (float64
norms over the whole tensor), and ours passes when

    ours <= FACTOR * peer + floor,   FACTOR = 2, floor = FLOORS[low dtype]

(1e-3 for bfloat16, whose unit roundoff 2**-8 is ~3.9e-3; 2.5e-4 for float16, 2**-11 ~
4.9e-4). The floor keeps a tensor that the peer happens to get almost exactly (a loss, a
bias gradient summed in float32) from failing on ours' own first rounding. A tensor whose
reference norm is 0 is measured by absolute norms, ``||x - ref||``. A gradient whose
reference norm is at most ``NOISE_FRACTION`` of the step's largest gradient norm is
measured against that largest norm: one that is zero in exact arithmetic (a key bias under
softmax, a bias before batch norm) is only rounding noise in float64, and any gradient that
small is below what the low dtype resolves beside the large ones, so its own relative
error would compare one side's noise with the other's. An
integer tensor must equal the reference. When the peer's value is not finite (float16
overflows where the reference does not) the bound is infinite: ours must then be finite.
When the reference itself is beyond the low dtype's range (a float16 gradient of 1e7, with
no GradScaler to scale it down) and the peer overflows, ours need not be finite either:
no step computing in that dtype can hold it.

Where the peer's policy differs from ours: torch.autocast on a CPU runs layer norm,
softmax and other norms in the low dtype, the generated mixed step (which follows the CUDA
lists) in float32, so on such models the peer is the less accurate side.

This module measures and reports; ``unroller.analysis.verify`` builds and steps the three
sides.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unroller.analysis.report import value_table
from unroller.compiler.precision import DEFAULT, Precision
from unroller.compiler.precision import get as get_precision

if TYPE_CHECKING:
    import torch

    from unroller.compiler.options import Options

#: ours <= FACTOR * peer + FLOORS[low dtype], per tensor (see the module docstring)
FACTOR = 2.0
FLOORS = {"bf16": 1e-3, "f16": 2.5e-4}
#: A gradient whose float64 reference norm is at most this fraction of the step's largest
#: gradient norm is measured against the largest norm (zero in exact arithmetic, or below
#: what the low dtype resolves beside it).
NOISE_FRACTION = 1e-6
_TORCH_NAMES = {"bf16": "bfloat16", "f16": "float16"}


def contract_precision(options: Options | None) -> Precision | None:
    """The low precision ``options`` ask for, or None for the float64 check (no options,
    or ``fp32``)."""
    if options is None or options.precision == DEFAULT:
        return None
    return get_precision(options.precision)


def low_name(precision: Precision) -> str:
    """The precision's low dtype in the model language (``bf16``, ``f16``)."""
    low = precision.low or precision.dtype
    assert low in FLOORS, precision
    return low


def low_dtype(precision: Precision) -> torch.dtype:
    import torch

    return getattr(torch, _TORCH_NAMES[low_name(precision)])


def floor(precision: Precision) -> float:
    return FLOORS[low_name(precision)]


def peer_text(precision: Precision) -> str:
    """What the peer is, in words (the report's notes and column)."""
    name = _TORCH_NAMES[low_name(precision)]
    if precision.mixed:
        return f"the original in float32 under torch.autocast('cpu', dtype=torch.{name})"
    return f"the original moved to torch.{name}"


def criterion(precision: Precision) -> str:
    """The contract in one line, as the report's first note prints it."""
    return (
        f"accuracy contract for --precision {precision.name}: per tensor, error = "
        f"||x - ref|| / ||ref|| against the original in float64 (reference 0: absolute "
        f"norms); ours (the generated {precision.name} step) passes when ours <= "
        f"{FACTOR:g} x peer + {floor(precision):g}, the peer being {peer_text(precision)} "
        "(autograd); dropout off on every side"
    )


# ---------------------------------------------------------------------------- the peer


def peer_module(module: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """A copy of ``module`` (float32) as the peer steps it: as it is for a mixed precision,
    moved to the low dtype for a plain one."""
    import copy

    peer = copy.deepcopy(module)
    return peer if precision.mixed else peer.to(low_dtype(precision))


def peer_context(precision: Precision) -> Any:
    """The context the peer's forward runs in: torch.autocast on the CPU for a mixed
    precision, nothing for a plain one."""
    import torch

    if precision.mixed:
        return torch.autocast(device_type="cpu", dtype=low_dtype(precision))
    return contextlib.nullcontext()


def side_inputs(tensors: list[torch.Tensor], precision: Precision) -> list[torch.Tensor]:
    """The float64 seeded ``tensors`` as the peer and ours take them: float32 for a mixed
    precision (autocast casts inside), the low dtype for a plain one; integers as they are."""
    import torch

    dtype = torch.float32 if precision.mixed else low_dtype(precision)
    return [t.to(dtype) if t.is_floating_point() else t for t in tensors]


# ---------------------------------------------------------------------------- rows


@dataclass
class ContractRow:
    """One compared tensor: ours' and the peer's errors against the reference, the bound."""

    name: str
    shape: tuple[int, ...]
    ref_max: float  # max |ref| (finite exactly when the reference is)
    ref_norm: float  # ||ref||
    ours: float  # error of the generated step
    peer: float  # error of the peer
    bound: float  # FACTOR * peer + floor
    ok: bool
    note: str = ""

    @property
    def rel(self) -> float:
        """Ours' error (the float64 report's ``rel``)."""
        return self.ours


def as_contract_row(row: Any) -> ContractRow:
    """A row of the float64 check (a shape or key mismatch, a forward that failed) as a
    contract row: failed, nothing measured."""
    if isinstance(row, ContractRow):
        return row
    nan = float("nan")
    return ContractRow(row.name, tuple(row.shape), nan, nan, nan, nan, nan, False, row.note)


def _norms(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||x - ref||, ||ref||) in float64."""
    import torch

    a, b = x.detach().double(), ref.detach().double()
    return float(torch.linalg.vector_norm(a - b)), float(torch.linalg.vector_norm(b))


def _error(x: torch.Tensor, ref: torch.Tensor, scale: float | None) -> float:
    """``||x - ref|| / ||ref||``; against ``scale`` when the reference is zero or noise
    below NOISE_FRACTION of it (a gradient), absolute when it is 0 and there is no scale."""
    diff, norm = _norms(x, ref)
    if scale and norm <= NOISE_FRACTION * scale:
        return diff / scale
    return diff / norm if norm > 0 else diff


def _largest(precision: Precision) -> float:
    """The largest finite value of the precision's low dtype (inf for a plain one)."""
    import torch

    from unroller.compiler.dtypes import torch_dtype

    low = precision.low or precision.dtype
    return float(torch.finfo(torch_dtype(low)).max) if low else math.inf


def contract_row(
    name: str,
    ours: torch.Tensor,
    peer: torch.Tensor,
    ref: torch.Tensor,
    precision: Precision,
    scale: float | None = None,
    note: str = "",
) -> ContractRow:
    """The row of one tensor; ``scale``: the step's largest gradient norm (gradients)."""
    shape = tuple(ref.shape)
    nan = float("nan")
    for side, tensor in (("here", ours), ("in the peer", peer)):
        if tuple(tensor.shape) != shape:
            why = f"shape {list(tensor.shape)} {side}, {list(shape)} in the original"
            return ContractRow(name, shape, nan, nan, nan, nan, nan, False, _join(note, why))
    _, ref_norm = _norms(ref, ref)
    ref_max = float(ref.detach().double().abs().max()) if ref.numel() else 0.0
    if not ref.is_floating_point():
        ours_err, peer_err = (float(not bool((t == ref).all())) for t in (ours, peer))
        ok = ours_err == 0.0
        return ContractRow(name, shape, ref_max, ref_norm, ours_err, peer_err, 0.0, ok, note)
    if scale and ref_norm <= NOISE_FRACTION * scale:
        why = "zero in exact arithmetic or below the low dtype's resolution"
        note = _join(note, f"{why}: errors against the largest gradient's norm, {scale:.3e}")
    elif ref_norm == 0.0:
        note = _join(note, "reference 0: absolute norms")
    ours_err, peer_err = _error(ours, ref, scale), _error(peer, ref, scale)
    beyond = ref_max > _largest(precision)
    if math.isfinite(peer_err):
        bound = FACTOR * peer_err + floor(precision)
    elif beyond:
        bound = math.inf
        why = "beyond the low dtype's range (the peer overflows too; a GradScaler is for this)"
        note = _join(note, f"the reference is {why}: ours need not be finite")
    else:
        bound = math.inf
        note = _join(note, "the peer's value is not finite: ours need only be finite")
    ok = (math.isfinite(ours_err) or beyond) and ours_err <= bound
    return ContractRow(name, shape, ref_max, ref_norm, ours_err, peer_err, bound, ok, note)


class PeerComparer:
    """``compare(name, got, ref, tolerance, note)`` of the float64 check, with the peer's
    tensor of the same name looked up: gradients (``grad KEY``), buffers (``buffer KEY``)
    and whatever ``add`` put in (the loss, the predictions)."""

    def __init__(self, peer: torch.nn.Module, precision: Precision, scale: float):
        self.precision, self.scale = precision, scale
        self.tensors: dict[str, Any] = {
            f"buffer {k}": v for k, v in peer.state_dict(keep_vars=True).items()
        }
        for key, param in peer.named_parameters(remove_duplicate=False):
            self.tensors[f"grad {key}"] = param.grad

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor

    def __call__(
        self, name: str, got: torch.Tensor, ref: torch.Tensor, _tolerance: Any = None, note=""
    ) -> ContractRow:
        import torch

        peer = self.tensors.get(name)
        if peer is None:  # a gradient the peer's backward did not reach: zeros
            note = _join(note, "no gradient in the peer")
            peer = torch.zeros_like(ref)
        scale = self.scale if name.startswith("grad ") else None
        return contract_row(name, got, peer.detach(), ref, self.precision, scale, note)


def largest_norm(tensors: Iterable[torch.Tensor | None]) -> float:
    """The largest float64 norm among ``tensors`` (None skipped; 0 without any)."""
    import torch

    norms = [float(torch.linalg.vector_norm(t.detach().double())) for t in tensors if t is not None]
    return max(norms, default=0.0)


def largest_gradient_norm(module: torch.nn.Module) -> float:
    """The largest float64 norm among ``module``'s parameter gradients (0 without any)."""
    return largest_norm(p.grad for p in module.parameters())


# ---------------------------------------------------------------------------- the report


@dataclass
class ContractReport:
    """What ``verify`` found under a low precision: ``VerifyReport``'s interface (``ok``,
    ``failed``, ``table``, ``summary``, ``render``) with contract rows."""

    model: str
    against: str
    precision: Precision
    rows: list[ContractRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def floor(self) -> float:
        return floor(self.precision)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.rows) and all(row.ok for row in self.rows)

    @property
    def failed(self) -> list[ContractRow]:
        return [row for row in self.rows if not row.ok]

    def table(self) -> str:
        """The rows as a fixed-width table (empty when nothing was compared)."""
        if not self.rows:
            return ""
        head = ("name", "shape", "||ref||", "ours", "peer", "bound", "")
        body = [
            (
                row.name,
                "[" + ", ".join(map(str, row.shape)) + "]",
                f"{row.ref_norm:.3e}",
                f"{row.ours:.3e}",
                f"{row.peer:.3e}",
                f"{row.bound:.3e}",
                ("PASS" if row.ok else "FAIL") + (f"  ({row.note})" if row.note else ""),
            )
            for row in self.rows
        ]
        return value_table(head, body)

    def summary(self) -> str:
        """One line: ok or FAIL, how many values, the tightest or the failing ones."""
        rule = f"ours <= {FACTOR:g} x peer + {self.floor:g}"
        if self.problems:
            return f"FAIL: {len(self.problems)} mismatch(es) before any step could be compared"
        if not self.rows:
            return "FAIL: nothing was compared"
        if self.ok:
            tight = max(self.rows, key=lambda row: row.ours / row.bound if row.bound else 0.0)
            return (
                f"ok: {len(self.rows)} values within the {self.precision.name} accuracy "
                f"contract ({rule}; closest: {tight.name}, {tight.ours:.1e} against "
                f"{tight.bound:.1e})"
            )
        names = [row.name for row in self.failed]
        shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
        return (
            f"FAIL: {len(names)} of {len(self.rows)} values outside the "
            f"{self.precision.name} accuracy contract ({rule}): {shown}"
        )

    def render(self) -> str:
        """The criterion, notes, problems, the table and the summary: what ``unroll
        verify --precision`` prints."""
        parts = [f"verify {self.model} against {self.against}"]
        parts += [f"note: {note}" for note in self.notes]
        parts += [f"mismatch: {problem}" for problem in self.problems]
        if self.rows:
            parts.append(self.table())
        parts.append(self.summary())
        return "\n".join(parts)


def _join(*parts: str) -> str:
    return "; ".join(part for part in parts if part)
