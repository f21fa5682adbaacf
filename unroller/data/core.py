"""What a training run needs to know about a model and what a dataset gives it.

A ``Signature`` reads, from the model's graph, the shape of the one input, the target
(if any), the prediction and the loss op, and from the loss op the task: cross-entropy
is classification, a binary cross-entropy is segmentation, a regression loss against a
target is denoising and one against the model's own input (no target) is autoencoding; a
per-token cross-entropy (logits [N, C, L], target [N, L]) is language modelling.
Datasets are built for a signature (images at the model's size and channel count), and
``check`` says in one sentence why a dataset does not fit a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from unroller.compiler.graph import Graph, Value
from unroller.errors import ConfigError

LOSS_TASKS = {
    "cross_entropy": "classification",
    "nll_loss": "classification",
    "bce_loss": "segmentation",
    "bce_with_logits": "segmentation",
    "mse_loss": "denoising",
    "l1_loss": "denoising",
}


class DatasetError(ConfigError):
    """A dataset that cannot be built or does not fit the model (printed as is, exit 2)."""


@dataclass(frozen=True)
class Signature:
    """The parts of a model's interface a dataset must match (shapes without N)."""

    model: str
    input_name: str
    input_shape: tuple[int, ...]
    target_name: str | None
    target_shape: tuple[int, ...] | None
    target_dtype: str | None
    pred_shape: tuple[int, ...]
    loss_op: str
    task: str
    # language modelling: the input's dtype, the classes C of the loss's logits
    # [N, C, L], and the dim of the prediction (N counted) that holds them (None: unclear)
    input_dtype: str | None = None
    vocab: int | None = None
    pred_class_dim: int | None = 1

    @property
    def logits(self) -> bool:
        """Segmentation predictions are logits (``bce_with_logits``), not probabilities."""
        return self.loss_op == "bce_with_logits"

    def describe(self) -> str:
        target = (
            f", target {self.target_name}: {list(self.target_shape)}" if self.target_name else ""
        )
        return f"model '{self.model}' (input {self.input_name}: {list(self.input_shape)}{target})"


def signature(graph: Graph) -> Signature:
    """The signature of a model with one input, at most one target and one prediction."""
    inputs = graph.model_inputs
    targets = [v for v in graph.inputs if v.kind == "target"]
    if len(inputs) != 1 or len(targets) > 1 or len(graph.preds) != 1:
        raise DatasetError(
            f"training needs a model with one input, at most one target and one prediction; "
            f"'{graph.name}' has {len(inputs)} input(s), {len(targets)} target(s) and "
            f"{len(graph.preds)} prediction(s)"
        )
    loss_node = next(n for n in graph.nodes if n.output is graph.loss)
    loss_op = loss_node.op.name
    if loss_op not in LOSS_TASKS:
        raise DatasetError(f"no training task is known for the loss op '{loss_op}'")
    task = LOSS_TASKS[loss_op]
    if task == "denoising" and not targets:
        task = "autoencoding"
    (x,) = inputs
    target = targets[0] if targets else None
    vocab, class_dim = None, 1
    logits = loss_node.inputs[0]
    if task == "classification" and logits.type.rank == 3 and target and target.type.rank == 2:
        task = "language_modelling"
        vocab, class_dim = logits.type.shape[1], _class_dim(logits, graph.preds[0])
    return Signature(
        model=graph.name,
        input_name=x.name,
        input_shape=tuple(x.type.shape[1:]),
        target_name=target.name if target else None,
        target_shape=tuple(target.type.shape[1:]) if target else None,
        target_dtype=target.type.dtype if target else None,
        pred_shape=tuple(graph.preds[0].type.shape[1:]),
        loss_op=loss_op,
        task=task,
        input_dtype=x.type.dtype,
        vocab=vocab,
        pred_class_dim=class_dim,
    )


def _class_dim(logits: Value, pred: Value) -> int | None:
    """Which dim of a language model's prediction holds the scores of the loss's
    ``logits`` [N, C, L]: 1 for the logits themselves or a [N, C, L] prediction, 2 for
    a [N, L, C] one (the usual layout before the permute the loss needs); None when
    C == L and the prediction is neither the logits nor what they were permuted or
    transposed from."""
    if pred is logits:
        return 1
    classes, length = logits.type.shape[1:]
    shape = tuple(pred.type.shape[1:])
    producer = logits.producer
    moved = producer is not None and producer.op.name in ("permute", "transpose")
    if moved and producer.inputs[0] is pred and shape == (length, classes):
        return 2
    if classes == length:
        return None
    return {(classes, length): 1, (length, classes): 2}.get(shape)


@dataclass
class Split:
    """Inputs and targets of one split; ``targets`` is None for autoencoding."""

    inputs: Tensor
    targets: Tensor | None

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def reference(self) -> Tensor:
        """What predictions are scored against: the targets, or the inputs themselves."""
        return self.inputs if self.targets is None else self.targets

    def head(self, count: int | None) -> Split:
        if count is None:
            return self
        return Split(self.inputs[:count], None if self.targets is None else self.targets[:count])


@dataclass
class TaskData:
    """A dataset ready for training: both splits, the task, and an honest description."""

    name: str  # as given on the command line, e.g. "digits" or "sciml:/data/em"
    task: str
    synthetic: bool
    description: str  # one line; synthetic sets say so
    train: Split
    test: Split

    @property
    def title(self) -> str:
        return f"{self.name} (synthetic)" if self.synthetic else self.name


def check(sig: Signature, data_name: str, task: str, channels: int | None = None) -> None:
    """Fail unless a dataset of ``task`` (with ``channels`` input channels) fits the model."""
    if sig.task != task and not {sig.task, task} <= {"denoising", "autoencoding"}:
        raise DatasetError(
            f"dataset '{data_name}' is a {task} task, but {sig.describe()} is trained for "
            f"{sig.task} (its loss is {sig.loss_op})"
        )
    if len(sig.input_shape) != 3:
        raise DatasetError(
            f"dataset '{data_name}' gives images [C, H, W], but {sig.describe()} does not take images"
        )
    if channels is not None and sig.input_shape[0] != channels:
        raise DatasetError(
            f"dataset '{data_name}' gives {channels}-channel images, but {sig.describe()} "
            f"takes {sig.input_shape[0]}"
        )
    if task == "autoencoding" and sig.target_name is not None:
        raise DatasetError(
            f"dataset '{data_name}' has no targets (the model reconstructs its input), but "
            f"{sig.describe()} declares one"
        )
    if task in ("denoising", "segmentation"):
        want = (1, *sig.input_shape[1:])
        if sig.target_shape != want:
            raise DatasetError(
                f"dataset '{data_name}' gives targets {list(want)}, but {sig.describe()} "
                f"declares {list(sig.target_shape or ())}"
            )
    if task == "classification":
        if sig.target_shape != () or sig.target_dtype not in ("i64", "i32"):
            raise DatasetError(
                f"dataset '{data_name}' gives class indices [N], but {sig.describe()} "
                "does not declare an integer target of shape [N]"
            )
