"""A keyword batch as a Hugging Face model takes it, as the model text's inputs and target.

``model(**batch)`` with ``labels`` computes the model's own loss; ``unroller.unroll`` must
compute the same one, so the batch is split here into the inputs the network reads and
the target the text's loss reads, transformed the way the model's ``forward`` transforms
``labels`` before its loss (``transformers.loss.loss_utils`` and each ``forward``):

- a causal LM (``*ForCausalLM``, ``*LMHeadModel``) predicts token t+1 at t:
  ``ForCausalLMLoss`` pads the labels with -100 and shifts them left, so the target is
  ``labels[:, 1:]`` with -100 last, cross-entropy over the non-ignored positions of the
  unshifted logits (the same mean as ``logits[:, :-1]`` against ``labels[:, 1:]``);
- an encoder-decoder (T5, BART) with no ``decoder_input_ids`` takes them from
  ``prepare_decoder_input_ids_from_labels``; the target is the labels, unshifted;
- a sequence classifier: cross-entropy over class indices, MSE when ``num_labels == 1``
  (``problem_type`` "regression"), BCE with logits for "multi_label_classification",
  as ``ForSequenceClassificationLoss`` decides, without writing ``config.problem_type``
  as the model's own first call does;
- token classification and masked LM: per-position cross-entropy, -100 ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The label value every Hugging Face loss ignores (prompt and padding tokens).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class BatchPlan:
    """How a keyword batch becomes the step's inputs and target for one model."""

    kind: str  # causal, seq2seq, per_position, classes, regression, multi_label
    loss: str  # the model text's loss op
    output: Any = None  # the model's output class (ModelOutput), when known

    def split(self, module, batch: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """``(inputs, target)``: the batch's tensors less ``labels`` (in the batch's order,
        None values left out; an encoder-decoder's ``decoder_input_ids`` made from the labels
        when absent) and the target the text's loss reads."""
        import torch

        if "labels" not in batch or batch["labels"] is None:
            raise ValueError(
                f"step(**batch): no 'labels' in the batch (keys: {', '.join(batch)}): the "
                "step trains, so it needs the labels the model's loss reads"
            )
        labels = batch["labels"]
        skip = {"labels", "shift_labels", "return_dict", "use_cache"}
        inputs = {k: v for k, v in batch.items() if k not in skip and v is not None}
        for key, value in inputs.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"step(**batch): {key} is a {type(value).__name__}, not a tensor")
        if self.kind == "seq2seq" and "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = module.prepare_decoder_input_ids_from_labels(
                labels=labels
            )
        return inputs, self.target(module, labels, batch.get("shift_labels"))

    def target(self, module, labels, shift_labels=None):
        """The labels as the text's target (see the module docstring)."""
        import torch.nn.functional as F

        if self.kind == "causal":
            if shift_labels is not None:
                return shift_labels
            return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        if self.kind == "classes":
            return labels.reshape(-1)
        if self.kind in ("regression", "multi_label"):
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
            labels = labels.to(dtype) if dtype is not None else labels
            return (
                labels.reshape(-1, 1) if self.kind == "regression" and labels.dim() == 1 else labels
            )
        return labels


def batch_plan(module, labels=None) -> BatchPlan:
    """The plan for ``module`` (a ``transformers`` model: by its class and config), or
    ValueError naming what is not known (then pass ``inputs`` and ``target`` instead)."""
    name = type(module).__name__
    config = getattr(module, "config", None)
    output = _output_class(module)
    if getattr(config, "output_router_logits", False) and name.endswith("ForCausalLM"):
        raise ValueError(
            f"unroll: {name}'s own loss adds its routers' load-balancing loss "
            "(config.output_router_logits=True), which the step does not compute: set "
            "config.output_router_logits = False, or pass inputs=(...) and target= with loss="
        )
    if config is not None and getattr(config, "is_encoder_decoder", False):
        if hasattr(module, "prepare_decoder_input_ids_from_labels"):
            return BatchPlan("seq2seq", "cross_entropy", output)
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return BatchPlan("causal", "cross_entropy", output)
    if name.endswith(("ForTokenClassification", "ForMaskedLM")):
        return BatchPlan("per_position", "cross_entropy", output)
    if name.endswith("ForSequenceClassification") and config is not None:
        problem = config.problem_type
        if problem is None:
            integer = labels is None or not labels.is_floating_point()
            problem = (
                "regression"
                if config.num_labels == 1
                else "single_label_classification" if integer else "multi_label_classification"
            )
        kinds = {
            "regression": ("regression", "mse_loss"),
            "single_label_classification": ("classes", "cross_entropy"),
            "multi_label_classification": ("multi_label", "bce_with_logits"),
        }
        if problem in kinds:
            return BatchPlan(*kinds[problem], output)
    raise ValueError(
        f"unroll: a keyword batch with labels is known for Hugging Face causal LMs, "
        f"encoder-decoders, sequence and token classifiers; {name} is not one: pass "
        "inputs=(...) and target= with loss= instead"
    )


def _output_class(module):
    """The ``ModelOutput`` class the model's ``forward`` is annotated to return, or None."""
    import typing

    try:
        hint = typing.get_type_hints(type(module).forward).get("return")
    except Exception:  # noqa: BLE001 - annotations that do not resolve: no output class
        return None
    for arg in (*typing.get_args(hint), hint):
        if (
            isinstance(arg, type)
            and hasattr(arg, "to_tuple")
            and "logits" in getattr(arg, "__dataclass_fields__", {})
        ):
            return arg
    return None
