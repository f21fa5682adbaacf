"""The base class of every reference: ``forward(*inputs, *targets) -> (loss, *preds)``.

A reference is the plain ``torch.nn`` equivalent of a model file. Tests compare the
generated module against it (same state-dict keys, same loss and gradients) and the
harness times it under autograd, so it must be the model file's maths and nothing else.
Subclasses write their forward pass once, as ``preds(inputs, run)``, calling each stage
through ``run(fn, *tensors)``: plain calls for ``forward`` and ``predict``, and
``torch.utils.checkpoint`` for ``forward_checkpointed`` (the checkpoint peer), so the
three can never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# A stage runner: ``run(fn, *tensors)`` calls ``fn(*tensors)``, plainly or checkpointed.
StageRunner = Callable[..., Tensor]


def run_plain(fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
    return fn(*args)


class Reference(nn.Module):
    """``forward(*inputs, *targets) -> (loss, *preds)``.

    Subclasses define ``preds(inputs, run)``, ``criterion(preds, inputs, targets)`` and,
    to be checkpointed, ``segments()``.
    """

    n_inputs: int = 1

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def criterion(
        self, preds: tuple[Tensor, ...], inputs: Sequence[Tensor], targets: Sequence[Tensor]
    ) -> Tensor:
        raise NotImplementedError

    def segments(self) -> dict[str, list[nn.Module]]:
        """The checkpointed stages in order: name -> the modules holding its parameters.

        Parameters outside every stage (the head of a ResNet or U-Net) run plainly.
        """
        raise NotImplementedError(f"{type(self).__name__} declares no stages")

    def _compute(self, args: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        inputs, targets = args[: self.n_inputs], args[self.n_inputs :]
        preds = self.preds(inputs, run)
        return (self.criterion(preds, inputs, targets), *preds)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return self._compute(args, run_plain)

    def forward_checkpointed(self, *args: Tensor) -> tuple[Tensor, ...]:
        """``forward`` with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
        around every stage of ``segments()``: each stage keeps only its inputs, and its
        forward runs again during backward. Same loss, predictions and gradients.

        The recomputation would update the batch-norm running statistics a second time;
        it restores every buffer afterwards, so they too end as after ``forward``.
        """
        return self._compute(args, self._run_checkpointed)

    def _run_checkpointed(self, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        calls = 0

        def stage(*tensors: Tensor) -> Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward pass
                return fn(*tensors)
            saved = [b.clone() for b in self.buffers()]
            try:  # the recomputation in backward (it may stop early by raising)
                return fn(*tensors)
            finally:
                with torch.no_grad():
                    for buf, old in zip(self.buffers(), saved):
                        buf.copy_(old)

        return checkpoint(stage, *args, use_reentrant=False)

    @torch.no_grad()
    def predict(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The predictions in evaluation mode (running statistics, no dropout), no
        gradients: what the generated module's ``predict`` gives."""
        was_training = self.training
        self.eval()
        try:
            return self.preds(inputs, run_plain)
        finally:
            self.train(was_training)
