"""The loss an imported network trains with (``--loss``), and its default target.

The network's forward returns predictions; the model text adds the loss statement.
``cross_entropy`` and ``nll_loss`` take class scores in dim 1 as torch does; when the
target matches the predictions without their last dim (``[N, L, C]`` logits of a language
model against ``[N, L]`` next tokens), the class dim is last, and a ``permute`` moving it
to dim 1 is written before the loss, as a user of torch writes
``F.cross_entropy(logits.transpose(1, 2), y)``.
"""

from __future__ import annotations

from unroller.importer.model import BATCH, ImportedModel, ImportFailure, Stmt, Tensor

#: --loss choices: loss op -> (what the predictions are, target dtype).
LOSSES = {
    "cross_entropy": "class scores (logits)",
    "nll_loss": "log-probabilities",
    "mse_loss": "values",
    "l1_loss": "values",
    "bce_with_logits": "logits",
    "bce_loss": "probabilities",
}
_CLASS_LOSSES = ("cross_entropy", "nll_loss")


def default_target(loss: str, pred_shape: tuple, float_dtype: str = "f32") -> Tensor:
    """The target when none is declared. Class losses: ``y: i64[N]`` for ``[N, C]`` scores;
    per position ``[N, L]`` for ``[N, L, C]`` scores, the classes last, as a sequence model
    (a language model, a tagger) makes them: a target ``[N, C]`` there would be a silently
    different loss (a class per row of the vocabulary); per pixel ``[N, H, W]`` for
    ``[N, C, H, W]`` (classes in dim 1, as a convolutional net makes them). ``[N, C, L]``
    scores of a 1-d convolution are the one case this reads otherwise: declare the target
    (``--target "y: i64[N, L]"``). Other losses: like the predictions."""
    dims = tuple(int(d) for d in pred_shape[1:])
    if loss in _CLASS_LOSSES:
        return Tensor("y", "i64", dims[:-1] if len(dims) == 2 else dims[1:])
    return Tensor("y", float_dtype, dims)


def add_loss(model: ImportedModel, loss: str, target: Tensor | None) -> None:
    """Append the loss statement (and a permute for class-last scores) to ``model``."""
    if loss not in LOSSES:
        raise ImportFailure(f"--loss {loss!r}: expected one of {', '.join(LOSSES)}")
    pred = model.predictions[0]
    shape = model.producer()[pred].shape if pred in model.producer() else None
    if shape is None or shape[0] != BATCH:
        raise ImportFailure(f"the predictions {pred} have no known [N, ...] shape")
    floats = [t.dtype for t in model.inputs if t.dtype not in ("i64", "i32")]
    target = target or default_target(loss, shape, floats[0] if floats else "f32")
    taken = {t.name for t in model.inputs} | {s.name for s in model.stmts}
    if target.name in taken or target.name in ("loss",):
        raise ImportFailure(
            f"--target {target.name!r}: already the name of an input or a statement of the "
            'network; choose another (e.g. --target "label: ...")'
        )
    if loss not in _CLASS_LOSSES:
        if target.dtype in ("i64", "i32"):
            raise ImportFailure(
                f"--target for {loss}: values are a float dtype, not {target.dtype}"
            )
        if floats and target.dtype != floats[0]:
            raise ImportFailure(
                f"--target {target.text()}: the inputs are {floats[0]}; one float dtype for all"
            )
    dims = tuple(int(d) for d in shape[1:])
    scores = pred
    if loss in _CLASS_LOSSES:
        if target.dtype not in ("i64",):
            raise ImportFailure(f"--target for {loss}: class indices are i64, not {target.dtype}")
        if tuple(target.dims) == dims[1:]:
            pass
        elif len(dims) >= 2 and tuple(target.dims) == dims[:-1]:
            order = (0, len(dims), *range(1, len(dims)))
            # a module index ("2" in an nn.Sequential) is a name, "2_classes_first" is not
            base = f"{pred}_classes_first" if not pred[:1].isdigit() else f"classes_first_{pred}"
            scores = _fresh(model, base, {target.name})
            model.stmts.append(
                Stmt(scores, "permute", [pred], {"dims": order}, "", (BATCH, dims[-1], *dims[:-1]))
            )
        else:
            raise ImportFailure(
                f"--target {target.text()}: {loss} of predictions [N, {', '.join(map(str, dims))}]"
                " takes class indices of shape [N, "
                + ", ".join(map(str, dims[1:]))
                + "] (classes in dim 1) or [N, "
                + ", ".join(map(str, dims[:-1]))
                + "] (classes last)"
            )
    elif tuple(target.dims) != dims:
        raise ImportFailure(
            f"--target {target.text()}: {loss} needs the predictions' shape "
            f"[N, {', '.join(map(str, dims))}]"
        )
    name = _fresh(model, "loss", {target.name})
    model.stmts.append(Stmt(name, loss, [scores, target.name], {}, "", ()))
    model.targets = [target]
    model.loss = name


def _fresh(model: ImportedModel, base: str, also: set[str] = frozenset()) -> str:
    taken = {s.name for s in model.stmts} | {t.name for t in model.inputs} | set(also)
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name
