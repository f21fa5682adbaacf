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
  (``placements``), in order; ``copyWeightsToHost`` records that it was called;
- half precision as PopTorch's optimizers do it: ``optim.SGD(loss_scaling=S)`` scales the
  loss by S before the gradients are computed (``(S * loss).backward()``) and divides the
  gradients by S before they update the optimizer state; gradients are accumulated over
  micro-batches in ``accum_type`` and the velocity kept in ``velocity_accum_type`` (float32,
  PopTorch's defaults), whatever the weights' dtype. A half model (``Module.half()``) keeps
  float16 weights: each update is computed in float32 and rounded once into the weight (the
  IPU rounds as its floating-point settings say, stochastically when asked). With a static
  loss scaling nothing checks for overflow and no step is skipped (unlike
  ``torch.amp.GradScaler``): an inf or NaN gradient reaches the weights;
  ``opts.Precision.enableFloatingPointExceptions(True)`` makes the call raise RuntimeError
  instead, here when a gradient or output of the call is not finite (the IPU traps at the
  first floating-point exception, an overflow among them).

What it cannot show: that PopTorch accepts the traced graph, memory use, speed, the IPU's
float16 arithmetic (its rounding modes, saturation or NaN on overflow).
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


class _PrecisionOptions:
    def __init__(self, owner: Options):
        self._owner = owner

    def enableFloatingPointExceptions(self, enabled: bool) -> Options:  # noqa: N802
        if not isinstance(enabled, bool):
            raise ValueError("enableFloatingPointExceptions needs to be set to a bool")
        self._owner.settings["floatingPointExceptions"] = enabled
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
            "floatingPointExceptions": False,
        }
        self.Training = _TrainingOptions(self)
        self.Precision = _PrecisionOptions(self)

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


_ACCUM_TYPES = (torch.float16, torch.float32)


def _wide(dtype: torch.dtype, weight: torch.dtype) -> torch.dtype:
    """The dtype a state kept in ``dtype`` has beside a weight of dtype ``weight``: never
    narrower than the weight (the project's float64 checks keep float64 throughout; the IPU
    has no float64)."""
    return torch.promote_types(dtype, weight)


class optim:  # noqa: N801 - mirrors the poptorch.optim namespace
    class SGD(torch.optim.SGD):
        """poptorch.optim.SGD, emulated: lr, momentum, dampening, weight_decay, nesterov as
        torch.optim.SGD computes them, with PopTorch's ``loss_scaling`` (the loss is scaled
        by it before the gradients are computed, the gradients divided by it before the
        update), ``accum_type`` (micro-batch gradients summed in it) and
        ``velocity_accum_type`` (the velocity kept in it), PopTorch's separate-tensor
        variant; the update is computed in the wider of the velocity's and the weight's
        dtype and rounded once into the weight. Arguments PopTorch has and this does not
        emulate (``use_combined_accum=True``, ``velocity_scaling``, ``max_grad_norm``) are
        refused."""

        def __init__(
            self,
            params,
            lr: float,
            momentum: float = 0.0,
            dampening: float = 0.0,
            weight_decay: float = 0.0,
            nesterov: bool = False,
            loss_scaling: float | None = None,
            accum_type: torch.dtype | None = None,
            velocity_accum_type: torch.dtype | None = None,
            use_combined_accum: bool | None = None,
            **not_emulated: Any,
        ):
            if use_combined_accum or not_emulated:
                given = sorted(not_emulated) + (["use_combined_accum"] * bool(use_combined_accum))
                raise ValueError(f"poptorch emulation: optim.SGD does not emulate {given}")
            super().__init__(
                params,
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
            )
            self.loss_scaling = 1.0 if loss_scaling is None else float(loss_scaling)
            self.accum_type = torch.float32 if accum_type is None else accum_type
            self.velocity_accum_type = (
                torch.float32 if velocity_accum_type is None else velocity_accum_type
            )
            if self.accum_type not in _ACCUM_TYPES or self.velocity_accum_type not in _ACCUM_TYPES:
                raise ValueError("Accumulation types must be either torch.float32 or torch.float16")
            if not self.loss_scaling > 0:
                raise ValueError(f"loss_scaling must be positive, got {loss_scaling!r}")

        @torch.no_grad()
        def step(self, closure=None):
            """The update from each parameter's ``.grad`` (the scaled gradient)."""
            if closure is not None:
                raise ValueError("poptorch emulation: optim.SGD.step takes no closure")
            grads = {
                p: p.grad for g in self.param_groups for p in g["params"] if p.grad is not None
            }
            self.apply(grads)

        @torch.no_grad()
        def apply(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
            """Update each parameter from its scaled gradient (``grads[p]``, in any float
            dtype: the accumulator's), as PopTorch's separate-tensor SGD: unscale, add the
            weight decay, update the velocity, step the weight."""
            for group in self.param_groups:
                lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
                decay, nesterov = group["weight_decay"], group["nesterov"]
                for p in group["params"]:
                    if p not in grads:
                        continue
                    wide = _wide(self.velocity_accum_type, p.dtype)
                    grad = grads[p].to(wide)
                    if self.loss_scaling != 1.0:
                        grad = grad / self.loss_scaling
                    weight = p.to(wide)
                    step = grad.add(weight, alpha=decay) if decay else grad
                    if momentum:
                        state = self.state[p]
                        velocity = state.get("momentum_buffer")
                        if velocity is None:
                            velocity = state["momentum_buffer"] = step.clone()
                        else:
                            velocity.mul_(momentum).add_(step, alpha=1 - dampening)
                        step = step.add(velocity, alpha=momentum) if nesterov else velocity
                    p.copy_(weight.add(step, alpha=-lr))


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
            outputs.append(self._step(micro, s["reduction"], s["floatingPointExceptions"]))
        return _combine(outputs[-1])

    def _step(self, micro: list, reduction: ReductionType, fp_exceptions: bool) -> list:
        """One optimizer step over the micro-batches of one device iteration: the loss
        scaled by the optimizer's ``loss_scaling``, each micro-batch's gradients summed in
        its ``accum_type``, reduced, and handed to the optimizer; each parameter's ``.grad``
        is left holding what it got (still scaled), in the parameter's dtype."""
        optimizer = self.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scale = getattr(optimizer, "loss_scaling", 1.0)
        accum = getattr(optimizer, "accum_type", None)
        optimizer.zero_grad(set_to_none=True)
        sums: dict[torch.Tensor, torch.Tensor] = {}
        results = []
        for m in micro:
            out = self.model(*m)
            first = out[0] if isinstance(out, tuple) else out
            (first * scale if scale != 1.0 else first).backward()
            for p in params:
                if p.grad is not None:
                    grad = p.grad if accum is None else p.grad.to(_wide(accum, p.dtype))
                    sums[p] = sums[p] + grad if p in sums else grad
                    p.grad = None
            results.append(
                tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
            )
        if reduction is ReductionType.Mean:
            sums = {p: grad / len(micro) for p, grad in sums.items()}
        if fp_exceptions:
            _raise_on_non_finite(sums, results)
        for p, grad in sums.items():  # left in .grad to look at, in the parameter's dtype
            p.grad = grad.to(p.dtype)
        if isinstance(optimizer, optim.SGD):
            optimizer.apply(sums)
        else:  # a torch.optim optimizer: PopTorch runs its own version of it
            optimizer.step()
        return results

    def copyWeightsToHost(self) -> None:  # noqa: N802
        self.copies_to_host += 1

    def destroy(self) -> None:
        return None


def _raise_on_non_finite(grads: dict, results: list) -> None:
    """enableFloatingPointExceptions(True): the IPU raises at the first operation that
    overflows or is invalid; emulated, more coarsely, by a look at what the call made."""
    tensors = [*grads.values()]
    for r in results:
        tensors += [o for o in r if o.is_floating_point()] if isinstance(r, tuple) else [r]
    if any(not bool(torch.isfinite(t).all()) for t in tensors):
        raise RuntimeError(
            "poptorch emulation: floating point exception (a gradient or output of the step "
            "is inf or NaN; Options.Precision.enableFloatingPointExceptions is on)"
        )


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
