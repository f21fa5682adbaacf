"""What ``--precision`` changes in a benchmark run: ours is generated with it, and every
peer runs the way a user would run the same model in that precision.

- ``fp32`` (the default): everything as before, float32.
- ``bf16-mixed`` / ``fp16-mixed``: ours is generated with ``Options(precision=...)``
  (torch.autocast's CUDA policy written out as casts: float32 parameters and ``.grad``,
  matmuls, convolutions and attention in the low dtype, a float32 loss). Each peer runs
  its forward under ``torch.autocast(device_type, dtype)`` and its ``loss.backward()``
  after the context, as the PyTorch AMP recipe has it; the checkpointed peers recompute
  under the autocast state their forward recorded (``torch.utils.checkpoint`` does that).
  On the CPU that is the CPU's autocast policy (layer norm and softmax in the low dtype
  too), which is what a user running there gets. No ``GradScaler`` on either side: its
  scale and unscale cost the same for both, and a benchmark's random batch does not
  underflow.
- ``bf16`` / ``fp16``: ours is generated in that dtype; the reference is cast to it
  (``module.to(dtype)``) and so are the batch's floating inputs, for every method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from unroller.compiler.precision import DEFAULT, NAMES, get

_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16}

#: the --precision flag's help
HELP = (
    f"{' | '.join(NAMES)}: ours generated with it (Options.precision); the peers run as a user "
    "would in it: under torch.autocast(dtype) for a mixed precision (the forward; the "
    "backward after it), cast to the dtype for a plain one (default: fp32)"
)


def parse(text: str) -> str:
    """``text`` if it names a precision, else ValueError naming the known ones."""
    get(text)  # ValueError: unknown precision 'x'; choose one of: ...
    return text


@dataclass(frozen=True)
class PeerPrecision:
    """How the peers (and the batch) follow a precision: ``autocast``, the dtype their
    forward runs under torch.autocast in (a mixed precision), ``dtype``, the dtype the
    reference and the batch's floating inputs are cast to (a plain low one)."""

    name: str
    autocast: torch.dtype | None = None
    dtype: torch.dtype | None = None

    @property
    def is_default(self) -> bool:
        return self.autocast is None and self.dtype is None

    def forward_context(self, device: torch.device | str) -> AbstractContextManager:
        """The context a peer's forward runs in: torch.autocast for a mixed precision."""
        if self.autocast is None:
            return contextlib.nullcontext()
        kind = device.type if isinstance(device, torch.device) else str(device)
        return torch.autocast(device_type=kind, dtype=self.autocast)

    def contexts(self, device: torch.device | str) -> Callable[[], AbstractContextManager]:
        """A factory of ``forward_context(device)`` (a fresh context per step)."""
        return lambda: self.forward_context(device)

    def module(self, ref: nn.Module) -> nn.Module:
        """The reference in this precision: cast to a plain low dtype; else unchanged."""
        return ref if self.dtype is None else ref.to(self.dtype)

    def batch(self, batch: Sequence[Tensor]) -> list[Tensor]:
        """The batch in this precision: floating inputs cast to a plain low dtype."""
        if self.dtype is None:
            return list(batch)
        return [t.to(self.dtype) if t.is_floating_point() else t for t in batch]

    def peer_label(self, device: torch.device | str = "cpu") -> str:
        """How the results name what the peers run under (empty for fp32)."""
        kind = device.type if isinstance(device, torch.device) else str(device)
        if self.autocast is not None:
            return f"torch.autocast({kind}, {str(self.autocast).removeprefix('torch.')})"
        if self.dtype is not None:
            return f"module.to({str(self.dtype).removeprefix('torch.')})"
        return ""


def of(name: str = DEFAULT) -> PeerPrecision:
    """The peers' side of precision ``name`` (``unroller.compiler.precision.NAMES``)."""
    found = get(name)
    if found.mixed:
        assert found.low is not None
        return PeerPrecision(name, autocast=_TORCH[found.low])
    if found.dtype is not None:
        return PeerPrecision(name, dtype=_TORCH[found.dtype])
    return PeerPrecision(name)


def cpu_capability() -> str:
    """torch's CPU capability (``AVX2``, ``AVX512``, ...), or ``unknown``."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def about(name: str, device: torch.device | str = "cpu") -> str | None:
    """One line for a results file on what ``--precision name`` ran (None for fp32)."""
    found, peers = get(name), of(name)
    if peers.is_default:
        return None
    kind = device.type if isinstance(device, torch.device) else str(device)
    line = f"precision {name}: ours {found.doc}; the peers "
    if peers.autocast is not None:
        line += (
            f"run their forward under {peers.peer_label(kind)} and loss.backward() after it "
            "(the PyTorch AMP recipe; no GradScaler on either side)"
        )
        if kind == "cpu":
            line += (
                "; on the CPU autocast follows torch's CPU policy (layer norm and softmax in "
                "the low dtype too), ours the CUDA one. CPU step times, not GPU ones: a CPU "
                "without native bf16/fp16 arithmetic (torch's CPU capability here: "
                f"{cpu_capability()}) runs low-precision kernels slower than float32 ones, "
                "so the time ratios say little about a GPU; the bytes carry over"
            )
    else:
        line += f"are the reference cast with {peers.peer_label(kind)}, the batch's floats too"
    return line
