"""Evaluation metrics per task, computed over a whole test set.

Each metric is a plain function of tensors (tested on hand-made cases), and a
``MetricSet`` accumulates the sums those functions need batch by batch, so a test set
is scored exactly as if it were one batch: accuracy counts correct samples, MSE sums
squared errors, IoU sums the intersection and the union over every pixel. PSNR is
computed from the test set's MSE (``10 log10(range^2 / MSE)``, range 1 for images in
[0, 1]), not averaged per image, so it and the MSE always agree; a set's PSNR is
reported as at most ``PSNR_MAX`` = 100 dB (MSE <= 1e-10 of the range squared), so a
perfect reconstruction stays a finite number in the JSON files. Bits per character is
the cross entropy summed over every scored token of the set, divided by their number
and by ln 2 (so it is the set's mean, not a mean of per-batch means); targets equal to
``IGNORE_INDEX`` (torch's default ``ignore_index``) are not scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor

PSNR_MAX = 100.0
IGNORE_INDEX = -100
TASKS = ("classification", "denoising", "segmentation", "autoencoding", "language_modelling")

# The metric each task is judged by (all are "higher is better" except bits per
# character, where lower is better) and the metrics it reports.
PRIMARY = {
    "classification": "accuracy",
    "denoising": "psnr",
    "segmentation": "iou",
    "autoencoding": "psnr",
    "language_modelling": "bpc",
}
REPORTED = {
    "classification": ("accuracy", "loss"),
    "denoising": ("psnr", "mse"),
    "segmentation": ("iou", "pixel_accuracy", "loss"),
    "autoencoding": ("psnr", "mse"),
    "language_modelling": ("bpc", "char_accuracy", "loss"),
}
UNITS = {
    "accuracy": "%",
    "pixel_accuracy": "%",
    "iou": "",
    "psnr": "dB",
    "mse": "",
    "loss": "",
    "bpc": "bits",
    "char_accuracy": "%",
}
LABELS = {
    "accuracy": "test accuracy (%)",
    "pixel_accuracy": "test pixel accuracy (%)",
    "iou": "test IoU",
    "psnr": "test PSNR (dB)",
    "mse": "test MSE",
    "loss": "test loss",
    "bpc": "test bits per character (lower is better)",
    "char_accuracy": "test next-character accuracy (%)",
}


def accuracy(logits: Tensor, target: Tensor) -> float:
    """Percentage of rows whose largest logit is the target class."""
    return 100.0 * (logits.argmax(dim=-1) == target).double().mean().item()


def mse(pred: Tensor, target: Tensor) -> float:
    return F.mse_loss(pred.double(), target.double()).item()


def psnr(mean_squared_error: float, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB; infinite for a perfect reconstruction."""
    if mean_squared_error <= 0.0:
        return math.inf
    return 10.0 * math.log10(data_range**2 / mean_squared_error)


def iou(pred_mask: Tensor, true_mask: Tensor) -> float:
    """Intersection over union of two boolean masks; 1.0 when both are empty."""
    pred_mask, true_mask = pred_mask.bool(), true_mask.bool()
    union = (pred_mask | true_mask).sum().item()
    if union == 0:
        return 1.0
    return (pred_mask & true_mask).sum().item() / union


def pixel_accuracy(pred_mask: Tensor, true_mask: Tensor) -> float:
    """Percentage of pixels where two boolean masks agree."""
    return 100.0 * (pred_mask.bool() == true_mask.bool()).double().mean().item()


def bits_per_char(logits: Tensor, target: Tensor, class_dim: int = 1) -> float:
    """Mean cross entropy in bits of the next-character ``target`` [N, L] under
    ``logits`` (scores in dim ``class_dim``, e.g. [N, C, L] or [N, L, C]), over every
    target that is not ``IGNORE_INDEX``."""
    nats, count = _token_nats(logits.double(), target, class_dim)
    return nats / count / math.log(2.0)


def _token_nats(logits: Tensor, target: Tensor, class_dim: int) -> tuple[float, int]:
    """The summed cross entropy (nats) and the number of scored targets."""
    logits = logits.movedim(class_dim, 1)
    total = F.cross_entropy(logits, target, reduction="sum", ignore_index=IGNORE_INDEX)
    return total.item(), int((target != IGNORE_INDEX).sum().item())


@dataclass
class MetricSet:
    """Accumulates one task's metrics over batches of (prediction, target).

    ``logits``: for segmentation, whether predictions are logits (``bce_with_logits``
    models) rather than probabilities; the mask is ``prediction > 0`` or ``> 0.5``.
    ``class_dim``: for language modelling, the dim of the prediction that holds the
    scores (1 for [N, C, L], 2 for [N, L, C]).
    """

    task: str
    logits: bool = False
    data_range: float = 1.0
    class_dim: int = 1
    sums: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r} (known: {', '.join(TASKS)})")

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def update(self, pred: Tensor, target: Tensor) -> None:
        pred, target = pred.detach().double(), target.detach()
        if self.task == "classification":
            self._add("samples", target.shape[0])
            self._add("correct", (pred.argmax(dim=-1) == target).sum().item())
            self._add("loss_sum", F.cross_entropy(pred, target, reduction="sum").item())
        elif self.task == "language_modelling":
            nats, count = _token_nats(pred, target, self.class_dim)
            hits = (pred.argmax(dim=self.class_dim) == target) & (target != IGNORE_INDEX)
            self._add("tokens", count)
            self._add("nats", nats)
            self._add("correct", hits.sum().item())
        elif self.task in ("denoising", "autoencoding"):
            self._add("elements", target.numel())
            self._add("sq_err", ((pred - target.double()) ** 2).sum().item())
        else:  # segmentation
            truth = target > 0.5
            predicted = pred > (0.0 if self.logits else 0.5)
            self._add("elements", target.numel())
            self._add("agree", (predicted == truth).sum().item())
            self._add("inter", (predicted & truth).sum().item())
            self._add("union", (predicted | truth).sum().item())
            if self.logits:
                loss = F.binary_cross_entropy_with_logits(pred, target.double(), reduction="sum")
            else:
                loss = F.binary_cross_entropy(pred.clamp(0, 1), target.double(), reduction="sum")
            self._add("loss_sum", loss.item())

    def result(self) -> dict[str, float]:
        s = self.sums
        if self.task == "classification":
            return {
                "accuracy": 100.0 * s["correct"] / s["samples"],
                "loss": s["loss_sum"] / s["samples"],
            }
        if self.task == "language_modelling":
            return {
                "bpc": s["nats"] / s["tokens"] / math.log(2.0),
                "char_accuracy": 100.0 * s["correct"] / s["tokens"],
                "loss": s["nats"] / s["tokens"],
            }
        if self.task in ("denoising", "autoencoding"):
            err = s["sq_err"] / s["elements"]
            return {"psnr": min(psnr(err, self.data_range), PSNR_MAX), "mse": err}
        return {
            "iou": 1.0 if s["union"] == 0 else s["inter"] / s["union"],
            "pixel_accuracy": 100.0 * s["agree"] / s["elements"],
            "loss": s["loss_sum"] / s["elements"],
        }
