"""Pipeline parallel training of a generated module: one process per stage.

A module generated with ``--pipeline K`` (``Options(pipeline=K)``) has, besides its
one-process step, one generator method per stage, ``_stage_k``: it runs the forward of
its statements and yields the values later stages read (the last stage: the loss), is
resumed with their gradients (the last stage: the seed), runs its statements' backward,
and returns the gradients of what it received. ``PipelineStage`` drives stage ``k`` of
one step: the batch is cut into micro-batches, run in a GPipe or 1F1B schedule, and the
boundary tensors and their gradients travel between processes over torch.distributed
(point to point, from the stage that makes a value to each stage that reads it). Where
the scheme's rules compress a boundary value (``PIPELINE_BOUNDARIES`` names the codec),
it and its gradient travel compressed; ``WireLog`` counts the bytes.

Micro-batch ``m`` of ``n_m`` samples is seeded with ``n_m / N``, so the gradients add up
to those of the batch's mean loss (as one process on the whole batch computes, up to the
order of summation, when the loss is a mean over samples and no layer mixes samples;
batch norm normalises each micro-batch, as on an IPU pipeline). Every process is handed
the whole batch and reads the inputs its stage needs. Each process builds the whole
model; only its stage's parameters get gradients (optimizers skip the others).

``run_local`` runs every stage in one process with the same wire (codec round trips and
byte counts, no torch.distributed): what the tests use to check the generated stages.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from unroller.compiler.dtypes import torch_dtype
from unroller.runtime.common import layers, stash_log

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class BoundaryValue:
    """One row of ``PIPELINE_BOUNDARIES``."""

    name: str
    source: int
    targets: tuple[int, ...]
    shape: tuple[int | str, ...]  # "N": the batch (a free parameter has none)
    dtype: str
    grad: bool
    codec: Any  # an unroller.compress compressor, or None for raw

    def full(self, rows: int) -> tuple[int, ...]:
        """The shape of one micro-batch's tensor of ``rows`` samples."""
        return tuple(rows if d == "N" else int(d) for d in self.shape)


def boundaries_of(model: torch.nn.Module) -> list[BoundaryValue]:
    """The boundary values a generated module declares (ValueError if it has no stages)."""
    rows = getattr(model, "PIPELINE_BOUNDARIES", None)
    if rows is None:
        raise ValueError(
            f"{type(model).__name__} has no pipeline stages: generate it with --pipeline K"
        )
    from unroller.compress import make

    found = []
    for name, source, targets, shape, dtype, grad, codec in rows:
        made = make(codec[0], **dict(codec[1])) if codec is not None else None
        found.append(BoundaryValue(name, source, tuple(targets), tuple(shape), dtype, grad, made))
    return found


def schedule(kind: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The order stage ``stage`` runs forwards ("F", m) and backwards ("B", m) of ``micro``
    micro-batches. GPipe: every forward, then every backward. 1F1B: ``stages - stage - 1``
    forwards to fill the pipe, then one forward and one backward in turn, then the rest of
    the backwards, so at most ``stages - stage`` micro-batches keep activations at once."""
    if kind == "gpipe":
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    if kind != "1f1b":
        raise ValueError(f"unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")
    warm = min(stages - stage - 1, micro)
    order = [("F", m) for m in range(warm)]
    for i in range(micro - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", m) for m in range(micro - warm, micro)]


@dataclass
class WireLog:
    """Bytes put on the wire by this process in the last step, per boundary value."""

    forward: dict[str, int] = field(default_factory=dict)  # activations
    backward: dict[str, int] = field(default_factory=dict)  # their gradients
    raw_forward: dict[str, int] = field(default_factory=dict)  # what raw tensors would take
    raw_backward: dict[str, int] = field(default_factory=dict)

    def add(self, direction: str, name: str, sent: int, raw: int) -> None:
        sent_log, raw_log = (
            (self.forward, self.raw_forward)
            if direction == "F"
            else (self.backward, self.raw_backward)
        )
        sent_log[name] = sent_log.get(name, 0) + sent
        raw_log[name] = raw_log.get(name, 0) + raw

    def totals(self) -> dict[str, int]:
        return {
            "forward_bytes": sum(self.forward.values()),
            "backward_bytes": sum(self.backward.values()),
            "raw_forward_bytes": sum(self.raw_forward.values()),
            "raw_backward_bytes": sum(self.raw_backward.values()),
        }


def _nbytes(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Wire:
    """Packs a boundary tensor for the wire (its codec's packed form, or the tensor) and
    unpacks what arrives; the packed layout for a shape is known in advance (compressors
    store a data-independent layout), so only the tensors travel."""

    def __init__(self, gradients: bool = True) -> None:
        self.gradients = gradients  # False: gradients travel raw
        self._layouts: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = {}

    def codec(self, b: BoundaryValue, direction: str) -> Any:
        return b.codec if direction == "F" or self.gradients else None

    def pack(self, b: BoundaryValue, t: Tensor, direction: str) -> tuple[Tensor, ...]:
        codec = self.codec(b, direction)
        t = t.detach()  # a free parameter is handed over as it is
        if codec is None:
            return (t.contiguous(),)
        return tuple(p.contiguous() for p in codec.compress(t))

    def layout(
        self, b: BoundaryValue, direction: str, rows: int, dtype: torch.dtype, device: torch.device
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        codec = self.codec(b, direction)
        key = (b.name, codec, rows, dtype, device)
        if key not in self._layouts:
            if codec is None:
                self._layouts[key] = [(b.full(rows), dtype)]
            else:
                probe = torch.zeros(b.full(rows), dtype=dtype, device=device)
                self._layouts[key] = [(tuple(p.shape), p.dtype) for p in codec.compress(probe)]
        return self._layouts[key]

    def unpack(
        self, b: BoundaryValue, packed: tuple[Tensor, ...], dtype: torch.dtype, direction: str
    ) -> Tensor:
        codec = self.codec(b, direction)
        if codec is None:
            return packed[0]
        return codec.decompress(packed, b.full(1)[1:], dtype)


def _tag(micro: int, index: int, direction: str, part: int, boundaries: int) -> int:
    return ((micro * boundaries + index) * 2 + (direction == "B")) * 16 + part


class PipelineStage:
    """Stage ``stage`` of a generated module's pipeline in this process.

    ``ranks[k]``: the rank of stage k's process (default: rank k of ``group``).
    ``step(*inputs)`` runs one training step: every micro-batch's forward and backward of
    this stage, in ``schedule_kind`` order, sending and receiving boundary tensors;
    gradients accumulate in this stage's parameters' ``.grad``. Returns the loss (the mean
    over the batch) on the last stage, None on the others."""

    def __init__(
        self,
        model: torch.nn.Module,
        stage: int,
        micro_batches: int = 4,
        schedule_kind: str = "1f1b",
        group: Any = None,
        ranks: list[int] | None = None,
        compress_gradients: bool = True,
    ):
        self.model = model
        self.stages = int(model.PIPELINE_STAGES)
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} of a {self.stages}-stage pipeline")
        if schedule_kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule_kind!r} (known: {', '.join(SCHEDULES)})")
        self.stage = stage
        self.micro_batches = micro_batches
        self.schedule_kind = schedule_kind
        self.group = group
        self.ranks = ranks if ranks is not None else list(range(self.stages))
        self.boundaries = boundaries_of(model)
        self.wire = Wire(compress_gradients)
        self.log = WireLog()
        self.input_positions = tuple(model.PIPELINE_INPUTS[stage])
        self.received = [b for b in self.boundaries if stage in b.targets]
        self.sent = [b for b in self.boundaries if b.source == stage]
        self.last = stage == self.stages - 1
        self.stash_logs: list[Any] = []

    # -- point to point ----------------------------------------------------------------

    def _send(self, pending: list, b: BoundaryValue, t: Tensor, to: int, m: int, d: str) -> None:
        index = self.boundaries.index(b)
        packed = self.wire.pack(b, t, d)
        self.log.add(d, b.name, _nbytes(packed), t.numel() * t.element_size())
        for part, p in enumerate(packed):
            tag = _tag(m, index, d, part, len(self.boundaries))
            pending.append((dist.isend(p, self.ranks[to], group=self.group, tag=tag), p))

    def _recv(self, b: BoundaryValue, source: int, m: int, d: str, rows: int) -> Tensor:
        index = self.boundaries.index(b)
        dtype = self._dtype(b)
        device = _device(self.model)
        parts = []
        for part, (shape, pdtype) in enumerate(self.wire.layout(b, d, rows, dtype, device)):
            buffer = torch.empty(shape, dtype=pdtype, device=device)
            tag = _tag(m, index, d, part, len(self.boundaries))
            dist.recv(buffer, self.ranks[source], group=self.group, tag=tag)
            parts.append(buffer)
        return self.wire.unpack(b, tuple(parts), dtype, d)

    def _dtype(self, b: BoundaryValue) -> torch.dtype:
        return _float_dtype(self.model) if b.dtype.startswith("f") else torch_dtype(b.dtype)

    # -- one step ----------------------------------------------------------------------

    def step(self, *inputs: Tensor) -> Tensor | None:
        """One training step of this stage over the whole batch ``inputs``."""
        names = _input_names(self.model)
        if len(inputs) != len(names):
            raise TypeError(f"the step takes {len(names)} inputs ({', '.join(names)})")
        chunks, rows = _micro_batches(inputs, self.micro_batches)
        total = sum(rows)
        self.log = WireLog()
        self.stash_logs = [stash_log() for _ in rows]
        handles = layers(self.model)
        method = getattr(self.model, f"_stage_{self.stage}")
        running: dict[int, Iterator] = {}
        pending: list = []
        loss = None
        for kind, m in schedule(self.schedule_kind, self.stage, self.stages, len(rows)):
            if kind == "F":
                args = [chunks[i][m] for i in self.input_positions]
                args += [self._recv(b, b.source, m, "F", rows[m]) for b in self.received]
                running[m] = method(handles, self.stash_logs[m], *args)
                handed = next(running[m])
                if self.last:
                    part = handed[0].detach() * (rows[m] / total)
                    loss = part if loss is None else loss + part
                    continue
                for b, t in zip(self.sent, handed):
                    for target in b.targets:
                        self._send(pending, b, t, target, m, "F")
                continue
            grads: list[Tensor | None]
            if self.last:
                grads = [_seed(self.model, rows[m] / total)]
            else:  # from each reader stage, the latest first, as one process sums them
                grads = [
                    (
                        _summed([self._recv(b, t, m, "B", rows[m]) for t in reversed(b.targets)])
                        if b.grad
                        else None
                    )
                    for b in self.sent
                ]
            back = _resume(running.pop(m), tuple(grads))
            for b, g in zip(self.received, back):
                if not b.grad:
                    continue
                if g is None:  # no gradient flows to it here: the sender still waits for one
                    g = torch.zeros(
                        b.full(rows[m]), dtype=self._dtype(b), device=_device(self.model)
                    )
                self._send(pending, b, g, b.source, m, "B")
        for work, _ in pending:
            work.wait()
        return loss


def _micro_batches(inputs: tuple[Tensor, ...], count: int) -> tuple[list, list[int]]:
    """Each input cut into ``count`` micro-batches along the batch, and their sizes."""
    chunks = [torch.tensor_split(t, count) for t in inputs]
    rows = [c.shape[0] for c in chunks[0]]
    if min(rows) == 0:
        raise ValueError(f"a batch of {sum(rows)} cannot make {count} micro-batches")
    return chunks, rows


def _seed(model: torch.nn.Module, share: float) -> Tensor:
    """The loss gradient a micro-batch's backward starts from: its share of the batch."""
    return torch.full((), share, dtype=_float_dtype(model), device=_device(model))


def _summed(grads: list[Tensor]) -> Tensor | None:
    """The gradients one value received from several stages, added in the order given."""
    total = None
    for g in grads:
        total = g if total is None else total.add_(g)
    return total


def _device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in (its floating parameters'): boundary tensors of a
    float type travel in it."""
    found = (p.dtype for p in model.parameters() if p.is_floating_point())
    return next(found, torch.get_default_dtype())


def _resume(generator: Iterator, grads: tuple) -> tuple:
    """Resume a stage generator with its gradients; what it returns."""
    try:
        generator.send(grads)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a pipeline stage yielded twice")


def _input_names(model: torch.nn.Module) -> list[str]:
    """The model inputs of the step, in order (the generated forward's parameters)."""
    return list(inspect.signature(model.forward).parameters)


def run_local(
    model: torch.nn.Module,
    *inputs: Tensor,
    micro_batches: int = 4,
    compress_gradients: bool = True,
) -> tuple[Tensor, WireLog]:
    """Every stage of the pipeline in this process, micro-batch after micro-batch, with
    the wire's codec round trips: (the loss, the bytes that would travel). For tests and
    for measuring what a scheme puts on the wire without starting processes."""
    stages = int(model.PIPELINE_STAGES)
    boundaries = boundaries_of(model)
    wire, log = Wire(compress_gradients), WireLog()
    chunks, sizes = _micro_batches(inputs, micro_batches)
    total = sum(sizes)
    handles = layers(model)
    loss = None
    for m, rows in enumerate(sizes):
        arrived: dict[str, Tensor] = {}
        running = []
        for k in range(stages):
            args = [chunks[i][m] for i in model.PIPELINE_INPUTS[k]]
            args += [arrived[b.name] for b in boundaries if k in b.targets]
            generator = getattr(model, f"_stage_{k}")(handles, stash_log(), *args)
            handed = next(generator)
            running.append(generator)
            if k == stages - 1:
                part = handed[0].detach() * (rows / total)
                loss = part if loss is None else loss + part
            for b, t in zip([b for b in boundaries if b.source == k], handed):
                arrived[b.name] = _through(wire, log, b, t, "F", len(b.targets))
        back: dict[str, list[Tensor]] = {}
        for k in reversed(range(stages)):
            sent = [b for b in boundaries if b.source == k]
            if k == stages - 1:
                grads: list[Tensor | None] = [_seed(model, rows / total)]
            else:
                grads = [_summed(back.pop(b.name, [])) if b.grad else None for b in sent]
            returned = _resume(running[k], tuple(grads))
            for b, g in zip([b for b in boundaries if k in b.targets], returned):
                if b.grad:
                    if g is None:
                        g = torch.zeros(
                            b.full(rows), dtype=_float_dtype(model), device=_device(model)
                        )
                    back.setdefault(b.name, []).append(_through(wire, log, b, g, "B", 1))
    assert loss is not None
    return loss, log


def _through(wire: Wire, log: WireLog, b: BoundaryValue, t: Tensor, d: str, copies: int) -> Tensor:
    """``t`` as the receiving stage gets it (``copies``: one message per reader stage)."""
    packed = wire.pack(b, t, d)
    for _ in range(copies):
        log.add(d, b.name, _nbytes(packed), t.numel() * t.element_size())
    return wire.unpack(b, tuple(p.clone() for p in packed), t.dtype, d)
