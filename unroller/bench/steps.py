"""One training step of the generated module and of its reference under autograd.

Every preset times and profiles exactly these two steps, so "a step" means the same
thing in every report: gradients reset to None, forward, backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from torch import Tensor, nn
from torch.profiler import record_function

from unroller.bench.profiling import BACKWARD_MARK


def step_ours(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    """The generated module's step: its forward runs the unrolled backward too."""
    model.zero_grad(set_to_none=True)
    return model(*batch)


def backward(loss: Tensor, mark: bool) -> None:
    """``loss.backward()``; with ``mark``, inside the profiler marker ``BACKWARD_MARK``."""
    with record_function(BACKWARD_MARK) if mark else contextlib.nullcontext():
        loss.backward()


def step_autograd(
    ref: nn.Module,
    batch: Sequence[Tensor],
    mark: bool = False,
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> Tensor:
    """The reference's step: ``loss = ref(*batch)[0]; loss.backward()``; the forward in
    ``context()`` (``torch.autocast`` under a mixed precision), the backward after it."""
    ref.zero_grad(set_to_none=True)
    with context():
        loss = ref(*batch)[0]
    backward(loss, mark)
    return loss
