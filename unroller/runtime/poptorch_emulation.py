"""A CPU EMULATION of the small part of PopTorch's API that generated IPU modules use.

This is not PopTorch and proves nothing about an IPU: no Poplar graph is compiled, no
SRAM is allocated, nothing is placed on a device. It runs the generated module with
ordinary PyTorch on the CPU so that the IPU code path (the whole training step inside
the module, the surrogate loss, the optimizer, device iterations, replication, gradient
accumulation, pipeline-stage placement) can be checked for correctness here:

- ``Options`` records every setting it is given (``settings``);
- ``trainingModel`` / ``inferenceModel`` run the module on the CPU, splitting each call's
  batch into device iterations, replicas and gradient-accumulation micro-batches as
  PopTorch does, reducing gradients across replicas and micro-batches (mean, PopTorch's
  default, or sum), one optimizer step per device iteration. Replicas run one after
  another on one copy of the weights and buffers (a real IPU keeps batch-norm running
  statistics per replica);
- ``Block`` / ``BeginBlock`` record which user id and IPU each part was placed on
  (``placements``), in order; ``copyWeightsToHost`` records that it was called.

What it cannot show: that PopTorch accepts the traced graph, memory use, speed.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

placements: list[tuple[str | None, int | None]] = []  # (user_id, ipu_id) in the order entered
EMULATION = True


class ReductionType(enum.Enum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class _TrainingOptions:
    def __init__(self, owner: Options):
        self._owner = owner

    def gradientAccumulation(self, n: int) -> Options:  # noqa: N802 - PopTorch's name
        self._owner.settings["gradientAccumulation"] = int(n)
        return self._owner

    def accumulationAndReplicationReductionType(self, kind: ReductionType) -> Options:  # noqa: N802
        self._owner.settings["reduction"] = kind
        return self._owner


class Options:
    """Records settings; the ones the emulation acts on are listed in the module docstring."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {
            "deviceIterations": 1,
            "replicationFactor": 1,
            "gradientAccumulation": 1,
            "randomSeed": None,
            "reduction": ReductionType.Mean,
        }
        self.Training = _TrainingOptions(self)

    def deviceIterations(self, n: int) -> Options:  # noqa: N802
        self.settings["deviceIterations"] = int(n)
        return self

    def replicationFactor(self, n: int) -> Options:  # noqa: N802
        self.settings["replicationFactor"] = int(n)
        return self

    def randomSeed(self, seed: int) -> Options:  # noqa: N802
        self.settings["randomSeed"] = int(seed)
        torch.manual_seed(int(seed))
        return self


class Block:
    """``with Block(user_id=..., ipu_id=k):`` records the placement and runs the body."""

    def __init__(self, user_id: str | None = None, ipu_id: int | None = None):
        self.user_id, self.ipu_id = user_id, ipu_id

    def __enter__(self) -> Block:
        placements.append((self.user_id, self.ipu_id))
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def BeginBlock(
    module: torch.nn.Module, user_id: str | None = None, ipu_id: int | None = None
):  # noqa: N802
    placements.append((user_id, ipu_id))
    return module


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    if reduction == "none":
        return x
    raise ValueError(f"identity_loss: reduction must be sum, mean or none, got {reduction!r}")


class optim:  # noqa: N801 - mirrors the poptorch.optim namespace
    class SGD(torch.optim.SGD):
        """poptorch.optim.SGD's common arguments, applied by torch.optim.SGD on the CPU."""

        def __init__(
            self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kw: Any
        ):
            super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def _split(batch: tuple[torch.Tensor, ...], parts: int) -> list[tuple[torch.Tensor, ...]]:
    n = batch[0].shape[0]
    if n % parts:
        raise ValueError(
            f"the batch of {n} does not split into {parts} equal parts (device iterations x "
            f"replicas x gradient accumulation), as PopTorch requires"
        )
    return [tuple(t.narrow(0, i * (n // parts), n // parts) for t in batch) for i in range(parts)]


class _Wrapped:
    def __init__(
        self, model: torch.nn.Module, options: Options | None, optimizer=None, training=True
    ):
        self.model = model
        self.options = options or Options()
        self.optimizer = optimizer
        self.training = training
        self.copies_to_host = 0

    def __call__(self, *batch: torch.Tensor):
        s = self.options.settings
        iterations, replicas, accum = s["deviceIterations"], s["replicationFactor"], 1
        if self.training:
            accum = s["gradientAccumulation"]
        outputs = []
        for step_batch in _split(batch, iterations):
            micro = _split(step_batch, replicas * accum)
            if not self.training:
                with torch.no_grad():
                    outputs.append([self.model(*m) for m in micro])
                continue
            self.optimizer.zero_grad(set_to_none=True)
            results = []
            for m in micro:
                out = self.model(*m)
                first = out[0] if isinstance(out, tuple) else out
                first.backward()
                results.append(
                    tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
                )
            if s["reduction"] is ReductionType.Mean:
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.div_(len(micro))
            self.optimizer.step()
            outputs.append(results)
        return _combine(outputs[-1])

    def copyWeightsToHost(self) -> None:  # noqa: N802
        self.copies_to_host += 1

    def destroy(self) -> None:
        return None


def _combine(results: list) -> Any:
    """The mean over the micro-batches of the last device iteration, output by output."""
    if isinstance(results[0], tuple):
        return tuple(torch.stack([r[i] for r in results]).mean(0) for i in range(len(results[0])))
    return torch.stack(results).mean(0)


def trainingModel(
    model: torch.nn.Module, options: Options | None = None, optimizer=None
) -> _Wrapped:  # noqa: N802
    if optimizer is None:
        optimizer = optim.SGD(model.parameters(), lr=0.01)
    return _Wrapped(model, options, optimizer, training=True)


def inferenceModel(
    model: torch.nn.Module, options: Options | None = None
) -> _Wrapped:  # noqa: N802
    return _Wrapped(model, options, training=False)
