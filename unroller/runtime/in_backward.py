"""The optimizer step inside the unrolled backward.

A module generated with ``--update-in-backward`` (``Options(update_in_backward=True)``)
calls ``K.update_params(L, names)`` right after the backward run in which the gradients of
``names`` (state-dict names) became final. With an ``InBackward`` attached (``attach``),
that call updates those parameters with the user's own ``torch.optim`` optimizer and frees
their gradients, so the step never holds the gradients of the whole network; without one
it does nothing and the file trains as usual (gradients in ``.grad``).

Exactly ``loss.backward(); opt.step(); opt.zero_grad()``: the optimizer is the user's
instance, stepped on a part of its parameters at a time (each param group's list narrowed
to the parameters just finished, then restored), so its per-parameter state (momentum,
Adam's moments and step count) is the state it keeps anyway, its ``state_dict()`` is the
one a plain loop saves, and an LR scheduler changing ``param_groups`` between steps acts as
it does there. What per-parameter updates cannot do is refused: a closure optimizer
(LBFGS re-evaluates the whole loss), a ``GradScaler`` (its step checks every gradient for
infs before any update), global-norm clipping (it needs every gradient before the first
update: ``clip_grad_value`` clips each gradient alone, exactly as
``torch.nn.utils.clip_grad_value_`` before ``opt.step()``).

``accumulate=k``: gradients add up over k steps (micro-batches) as usual, and the k-th
step's backward updates and frees them. Parameters of the network that the optimizer does
not hold keep their gradients in ``.grad``; frozen ones have none. An optimizer's step
hooks run once per update call, not once per step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from unroller.parallel.shard import sharder_of

UPDATER_ATTR = "optimizer_in_backward"
"""The attribute of the generated Model that holds its ``InBackward``."""
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


class InBackwardError(ValueError):
    """An optimizer, a setting or a step that the update in the backward cannot run."""


@dataclass
class InBackward:
    """Updates a model's parameters with ``optimizer`` as their gradients become final."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    accumulate: int = 1
    clip_grad_value: float | None = None
    micro: int = 0  # steps begun since the last update
    enabled: bool = True
    updates: int = 0  # update calls that stepped the optimizer, in all
    _names: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer, self.model, self.accumulate, self.clip_grad_value)

    @property
    def updating(self) -> bool:
        """Whether this step's backward updates (the last micro-batch of k)."""
        return self.enabled and self.micro >= self.accumulate

    def begin(self, scaler: Any = None) -> None:
        """A step starts: one more micro-batch; the parameters by name, as they are now."""
        if not self.enabled:
            return
        if scaler is not None:
            raise InBackwardError(
                "an optimizer in the backward cannot take a GradScaler: its step checks "
                "every gradient for infs before any update; train in bf16-mixed, or detach "
                "the optimizer (unroller.runtime.in_backward.detach) and step as usual"
            )
        self.micro += 1
        sharder = sharder_of(self.model)
        if sharder is not None:  # the shards, which the optimizer holds, hold the gradients
            self._names = dict(sharder.sharded)
        else:
            self._names = dict(self.model.named_parameters(remove_duplicate=False))

    def end(self) -> None:
        """A step ended (or failed): after an updating step the count starts again."""
        if self.updating:
            self.micro = 0
        self._names = {}

    def update(self, names: tuple[str, ...]) -> None:
        """The gradients of ``names`` are final: in the updating step, step the optimizer
        on those of its parameters that have one, and free them."""
        if not self.updating:
            return
        held = _held(self.optimizer)
        seen: set[int] = set()
        params = []
        for name in names:
            p = self._names.get(name)
            if p is None or id(p) in seen or id(p) not in held or p.grad is None:
                continue
            seen.add(id(p))
            params.append(p)
        if not params:
            return
        if self.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        step_on(self.optimizer, params)
        for p in params:
            p.grad = None
        self.updates += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No update while inside (a step run only for its loss, its gradients put back)."""
        was = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = was


def step_on(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """``optimizer.step()`` on ``params`` alone: each group's list narrowed to those of
    ``params`` it holds (the group's hyperparameters as they are now), then restored."""
    wanted = {id(p) for p in params}
    groups = optimizer.param_groups
    kept = [group["params"] for group in groups]
    try:
        for group, all_params in zip(groups, kept):
            group["params"] = [p for p in all_params if id(p) in wanted]
        optimizer.step()
    finally:
        for group, all_params in zip(groups, kept):
            group["params"] = all_params


def _held(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def check_optimizer(
    optimizer: Any, model: torch.nn.Module, accumulate: int = 1, clip: float | None = None
) -> None:
    """Refuse what cannot step in the backward: not a ``torch.optim.Optimizer``, a closure
    optimizer, parameters the model does not have, a bad ``accumulate`` or clip value."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InBackwardError(
            f"optimizer: a torch.optim.Optimizer is needed, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, CLOSURE_OPTIMIZERS) or _needs_closure(optimizer):
        raise InBackwardError(
            f"optimizer: {type(optimizer).__name__}.step needs a closure that evaluates the "
            "whole loss again; it cannot step one part of the network in the backward"
        )
    mine = {id(p) for p in model.parameters()}
    foreign = [
        i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if id(p) not in mine
    ]
    if foreign:
        raise InBackwardError(
            f"optimizer: {len(foreign)} of its parameters (in param group "
            f"{foreign[0]}) are not the network's; an optimizer in the backward steps the "
            "network's own parameters only"
        )
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise InBackwardError(f"accumulate={accumulate!r}: a whole number of steps, 1 or more")
    if clip is not None and (isinstance(clip, bool) or not clip > 0):
        raise InBackwardError(f"clip_grad_value={clip!r}: a positive number")


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """A ``step`` whose closure has no default (it must be given)."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulate: int = 1,
    clip_grad_value: float | None = None,
) -> InBackward:
    """Make ``model`` (a generated Model, built with ``--update-in-backward``) step
    ``optimizer`` in its backward (see the module docstring); returns the updater."""
    if not getattr(model, "UPDATES_IN_BACKWARD", False):
        raise InBackwardError(
            f"{type(model).__name__} was not generated with --update-in-backward "
            "(Options(update_in_backward=True)): its backward has no update calls"
        )
    updater = InBackward(model, optimizer, accumulate, clip_grad_value)
    object.__setattr__(model, UPDATER_ATTR, updater)  # not a submodule, not state
    return updater


def detach(model: torch.nn.Module) -> None:
    """No optimizer in ``model``'s backward any more: gradients stay in ``.grad``."""
    model.__dict__.pop(UPDATER_ATTR, None)


def updater_of(model: torch.nn.Module) -> InBackward | None:
    return model.__dict__.get(UPDATER_ATTR)
