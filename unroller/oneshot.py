"""``unroller.unroll``: a torch.nn module in, its unrolled (and compressed) training step out.

For a training loop that already exists: the module is imported (``unroll import``),
generated with the scheme asked for (``unroll generate``), the generated source cached on
disk under its content hash, and its ``Model`` built to share the original's parameter and
buffer tensors. Calling it runs one training step, forward and unrolled backward, and
returns the loss with every gradient in the original's ``.grad``: an optimizer over the
original's parameters trains both.

    step = unroller.unroll(net, (x,), y, scheme="quant")
    for x, y in batches:
        opt.zero_grad()
        loss = step(x, y)
        opt.step()

    step = unroller.unroll(hf_model, batch)        # batch = dict(input_ids=..., labels=...)
    out = step(**batch)                            # the model's own loss: out.loss, out.logits

    step = unroller.unroll(net, (x,), y, optimizer=opt)  # the optimizer steps in the backward
    for x, y in batches:
        loss = step(x, y)                          # parameters updated, no .grad left

With ``optimizer=`` (``unroller.runtime.in_backward``) each parameter is updated as soon
as its gradient is final and the gradient freed, so the whole network's gradients are
never alive at once; the result is ``loss.backward(); opt.step(); opt.zero_grad()``'s,
and ``accumulate=k`` updates in every k-th step's backward.

The step follows the module as a drop-in would: its train/eval mode (and each batch norm's
own flag: a frozen-BN fine-tune, the model in train mode with its batch norms in eval, gets
eval-mode batch norm's gradient), ``torch.no_grad``, parameters replaced or frozen after
``unroll`` (seen at the next call), other sequence lengths (a specialisation generated on
demand, kept per shape). ``unroller.analysis.verify`` checks the same import against the
original, one float64 step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unroller import stepcache
from unroller.cache import generated_dir
from unroller.compiler.options import Options, from_keywords
from unroller.compiler.precision import AUTOCAST_MATCH
from unroller.importer.api import module_import, module_label, module_text, python_words
from unroller.materialize import materialize
from unroller.parallel.adopted import (
    adopt,
    adopted_precision,
    plain_view,
    shard_module,
    user_units,
)
from unroller.parallel.shard import ShardError, policy_for, sharder_of, step_guard
from unroller.runtime.common import keep_predictions
from unroller.runtime.in_backward import UPDATER_ATTR, InBackward, InBackwardError


def cache_dir() -> Path:
    """Where generated sources are kept: ``$UNROLLER_CACHE_DIR/generated``, else
    ``$XDG_CACHE_HOME/unroller/generated``, else ``~/.cache/unroller/generated``
    (``unroller.cache``, which also bounds it and says how to clean it)."""
    return generated_dir()


#: The model text of a module on example inputs, as ``unroll import`` writes it.
import_text = module_text


@dataclass(frozen=True)
class _How:
    """What every specialisation of one step is generated with."""

    loss: str
    options: Options
    name: str | None
    directory: Path | None
    keywords: bool  # inputs named by a dict (they reach forward by keyword)
    names: tuple[str, ...]  # the first import's input names, for positional calls
    plan: Any = None  # hf_batch.BatchPlan of a keyword batch with labels
    logits: bool = True  # a keyword batch's step hands out its logits (StepOutput.logits)


@dataclass
class _Spec:
    """One specialisation held by a step: the generated class and an instance sharing
    the original's tensors (``shared``: the snapshot it shares); ``norms``: the instance's
    batch-norm layers by module path, whose train/eval flags follow the original's."""

    built: stepcache.Built
    model: torch.nn.Module
    shared: tuple
    norms: tuple[tuple[str, torch.nn.Module], ...] = ()

    def follow_modes(self, original: torch.nn.Module) -> None:
        """Each batch-norm layer of the instance takes the train/eval flag of the original's
        module at its path (the state-dict keys are the same, so the paths are), so that a
        layer in eval mode normalises with its running statistics and has eval-mode batch
        norm's backward (the kernels read the flag), as in ``module.eval()`` or a frozen-BN
        fine-tune (the model in train mode, its batch norms in eval)."""
        for path, layer in self.norms:
            source = _module_at(original, path)
            if source is not None:
                layer.training = source.training


def _module_at(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The submodule of ``root`` at dotted ``path`` (read through ``_modules``), or None."""
    module: Any = root
    for part in path.split("."):
        module = module._modules.get(part) if isinstance(module, torch.nn.Module) else None
        if module is None:
            return None
    return module


def _norm_layers(model: torch.nn.Module) -> tuple[tuple[str, torch.nn.Module], ...]:
    """The generated instance's layers that follow a train/eval flag: batch norm's, by the
    running statistics they hold."""
    return tuple(
        (path, layer)
        for path, layer in model.named_modules(remove_duplicate=False)
        if path and "running_mean" in layer._buffers
    )


class StepOutput:
    """What ``step(**batch)`` returns: ``.loss`` (the model's own loss, the step's) and
    ``.logits``, the predictions the step's own forward made (in train mode with dropout
    drawn and batch statistics, as the original's output holds them; in eval mode or
    under ``no_grad`` the evaluation forward's). ``to_output()`` gives the model's output
    class (``CausalLMOutput``...)."""

    def __init__(self, loss, logits, output_class=None):
        self.loss = loss
        self.logits = logits
        self._output_class = output_class

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.to_tuple()[key]
        if key not in ("loss", "logits"):
            raise KeyError(key)
        return getattr(self, key)

    def keys(self):
        return ("loss", "logits")

    def to_tuple(self) -> tuple:
        return (self.loss, self.logits)

    def to_output(self):
        cls = self._output_class
        return cls(loss=self.loss, logits=self.logits) if cls is not None else self


class Unrolled(torch.nn.Module):
    """The generated ``Model`` of a module, sharing its tensors: ``step(*inputs, target)``
    runs one training step and returns the loss; ``step(**batch)`` (a Hugging Face batch
    with ``labels``) returns a ``StepOutput``; ``predict(*inputs)`` evaluates. ``model``,
    ``source``, ``source_path`` and ``text`` are those of the last specialisation used."""

    def __init__(
        self,
        original: torch.nn.Module,
        how: _How,
        key: tuple,
        spec: _Spec,
        updater: InBackward | None = None,
    ):
        super().__init__()
        object.__setattr__(self, "_original", original)  # not a submodule: no second state
        object.__setattr__(self, "_updater", updater)  # the optimizer in the backward
        if updater is not None:
            object.__setattr__(spec.model, UPDATER_ATTR, updater)
        self._how = how
        self._specs: OrderedDict[tuple, _Spec] = OrderedDict({key: spec})
        self._last = spec
        self._snap = stepcache.snapshot(original)
        self._settings = stepcache.settings(original)

    # -- what the last specialisation is -----------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self._last.model

    @property
    def text(self) -> str:
        return self._last.built.text

    @property
    def source(self) -> str:
        return self._last.built.source

    @property
    def source_path(self) -> Path:
        return self._last.built.path

    def stash_report(self) -> dict:
        return self.model.stash_report()

    @property
    def optimizer_in_backward(self) -> InBackward | None:
        """The updater of ``unroll(..., optimizer=)`` (its ``updates`` counts the optimizer
        steps taken in backwards), or None."""
        return self._updater

    def predict(self, *inputs: torch.Tensor) -> torch.Tensor:
        spec = self._spec_for(self._named(inputs), None, "train")
        if self._how.options.shard:
            return self._sharded_predictions(spec, self._named(inputs))
        return spec.model.predict(*inputs)

    # -- the step ----------------------------------------------------------------------

    def forward(self, *args: Any, scaler: Any = None, **batch: Any):
        """A training step on ``args`` (the inputs, then the target) or a keyword batch;
        ``scaler``: a ``torch.amp.GradScaler`` seeding the backward of a mixed-precision
        step (``precision="fp16-mixed"`` or ``"bf16-mixed"``)."""
        how = self._under_autocast(args or tuple(batch.values()))
        if scaler is not None and not how.options.precision.endswith("-mixed"):
            raise TypeError(
                "step(..., scaler=): a GradScaler seeds a mixed-precision step; unroll with "
                "precision='fp16-mixed' (or 'bf16-mixed')"
            )
        if args and batch:
            raise TypeError(
                "step(...): pass the inputs and target positionally, or a batch by keyword"
            )
        if batch:
            if self._how.plan is None:
                raise TypeError(
                    "step(**batch): this step was unrolled on positional inputs; call "
                    "step(*inputs, target), or unroll on the keyword batch"
                )
            inputs, target = self._how.plan.split(self._original, batch)
        else:
            if len(args) != len(self._how.names) + 1:
                raise TypeError(
                    f"step(*inputs, target): {len(self._how.names)} inputs and the target, "
                    f"got {len(args)} arguments"
                )
            inputs, target = self._named(args[:-1]), args[-1]
        # predictions are held through the backward only where the call returns them
        keep = bool(batch) and how.logits
        loss, logits = self._run(inputs, target, scaler, how, keep)
        if not batch:
            return loss
        return StepOutput(loss, logits, self._how.plan.output)

    def _named(self, values: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self._how.names, values))

    def _under_autocast(self, values: Sequence[Any]) -> _How:
        """How this call's step is generated: as unrolled, or, for a step unrolled in fp32
        and called under ``torch.autocast`` of bfloat16 or float16, with the mixed precision
        that computes what that autocast would (``precision="bf16-mixed"``), every cast
        written out; any other autocast is left to the step to refuse."""
        how = self._how
        if how.options.precision != "fp32":
            return how
        devices = {"cpu"} | {v.device.type for v in values if isinstance(v, torch.Tensor)}
        for device in sorted(devices):
            if torch.is_autocast_enabled(device):
                dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
                matching = AUTOCAST_MATCH.get(dtype)
                if matching is None:
                    return how
                return dataclasses.replace(
                    how, options=dataclasses.replace(how.options, precision=matching)
                )
        return how

    def _run(
        self,
        inputs: dict,
        target,
        scaler: Any = None,
        how: _How | None = None,
        keep: bool = True,
    ):
        """The loss (a training step, or a forward only where no gradient is asked) and the
        predictions (None from a training step where ``keep`` is False: nothing holds them
        through its backward); ``how``: this call's generation (``_under_autocast``)."""
        how = how or self._how
        values = list(inputs.values())
        training = self._original.training
        if training:
            _refuse_quiet_dropouts(self._original)
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return self._forward_only(inputs, target, training, how)
        spec = self._spec_for(inputs, target, "train" if training else "eval", how)
        return self._step_with_predictions(spec, values, target, scaler, keep)

    @staticmethod
    def _step_with_predictions(
        spec: _Spec, values: list, target, scaler: Any = None, keep: bool = True
    ):
        """The training step's loss, and its predictions as its own forward made them
        (dropout drawn, batch statistics: what the original's output holds in train mode),
        or None unless ``keep``: a prediction handed out is held until the step returns,
        through its whole backward (a causal LM's logits: vocabulary x tokens per sample)."""
        extra = {"scaler": scaler} if scaler is not None else {}
        guard: Any = contextlib.nullcontext()
        if sharder_of(spec.model) is not None:
            guard = step_guard()  # a rank gone: one clear error
        with guard:
            if not keep:
                return spec.model(*values, target, **extra), None
            with keep_predictions() as kept:
                loss = spec.model(*values, target, **extra)
        return loss, kept[spec.built.graph.preds[0].name]

    def _forward_only(self, inputs: dict, target, training: bool, how: _How):
        """Under ``no_grad``/``inference_mode``: the loss without any ``.grad`` written. In
        eval mode (or a text without dropout or batch norm) ``predict`` and the text's loss
        replayed on it; in train mode with either, the training step itself, the gradients
        it writes put back as they were (dropout draws, batch norm's statistics update,
        as the original's forward does)."""
        from unroller.analysis.verify import loss_plan, replay_loss

        spec = self._spec_for(inputs, target, "train", how)
        if self._how.options.shard:
            return self._sharded_forward_only(spec, inputs, target)
        if training and _train_only(spec.built.graph):
            paused = self._updater.paused() if self._updater else contextlib.nullcontext()
            with torch.inference_mode(False), torch.no_grad(), paused:
                params = [p for p in self._original.parameters()]
                grads = [p.grad for p in params]
                for p in params:
                    p.grad = None
                try:
                    return self._step_with_predictions(spec, list(inputs.values()), target)
                finally:
                    for p, g in zip(params, grads):
                        p.grad = g
        with torch.no_grad():
            out = spec.model.predict(*inputs.values())
        prediction = out[0] if isinstance(out, (tuple, list)) else out
        loss = replay_loss(loss_plan(spec.built.graph), prediction, target)
        return loss, prediction

    def _sharded_forward_only(self, spec: _Spec, inputs: dict, target):
        """A sharded module's loss without gradients: its own forward under FSDP2 (each
        unit gathered by its hooks, dropout drawn as the module's mode says), the text's
        loss replayed on the prediction, then every unit released again."""
        from unroller.analysis.verify import loss_plan, replay_loss

        prediction = self._sharded_predictions(spec, inputs)
        loss = replay_loss(loss_plan(spec.built.graph), prediction, target)
        return loss, prediction

    def _sharded_predictions(self, spec: _Spec, inputs: dict) -> torch.Tensor:
        from unroller.importer.source import Predictions

        with torch.no_grad(), step_guard():
            try:
                return Predictions(self._original, self._how.names)(*inputs.values())
            finally:
                sharder_of(spec.model).settle()

    # -- specialisations -----------------------------------------------------------------

    def _spec_for(self, inputs: dict, target, mode: str, how: _How | None = None) -> _Spec:
        """The specialisation for this batch's shapes and the mode, made on demand (LRU of
        ``stepcache.MAX_SHAPES``), after following changes to the module (``_follow``)."""
        self._follow()
        how = how or self._how
        key = (stepcache.signature(inputs, target), mode, how.options.precision)
        spec = self._specs.get(key)
        if spec is None:
            spec = _make_spec(self._original, how, inputs, target, mode)
            if self._how.options.shard:  # the same units, gathered through the module's
                adopt(spec.model, self._original, check=False)
            self._specs[key] = spec
            while len(self._specs) > stepcache.MAX_SHAPES:
                self._specs.popitem(last=False)
        self._specs.move_to_end(key)
        if spec.shared != self._snap:
            stepcache.share(spec.model, self._original)
            spec.shared = self._snap
        spec.follow_modes(self._original)
        if self._updater is not None:
            object.__setattr__(spec.model, UPDATER_ATTR, self._updater)
        self._last = spec
        return spec

    def _follow(self) -> None:
        """New tensor objects are shared again by state-dict key; a changed structure
        (``requires_grad`` flipped, a dtype or shape changed) or a changed attribute (a
        dropout's p, a LayerNorm's eps: ``stepcache.settings``) drops every specialisation,
        so the next is generated from the module as it is now: never a stale tensor."""
        settings = stepcache.settings(self._original)
        if settings != self._settings:
            self._specs.clear()
            self._settings = settings
        snap = stepcache.snapshot(self._original)
        if snap == self._snap:
            return
        if stepcache.structure(snap) != stepcache.structure(self._snap):
            self._specs.clear()
        self._snap = snap


def _refuse_quiet_dropouts(original) -> None:
    """Dropout follows the whole module's train/eval flag (batch norm follows each
    layer's): a dropout module put in eval mode alone while the module trains would still
    draw in the step, so it is refused here, with the fix, rather than trained silently."""
    from unroller.analysis.verify import module_dropouts, probability_attr

    quiet = [(path, sub) for path, sub in module_dropouts(original) if not sub.training]
    if quiet:
        shown = ", ".join(path or "(root)" for path, _ in quiet[:3])
        shown += f" (+{len(quiet) - 3} more)" if len(quiet) > 3 else ""
        attr = probability_attr(quiet[0][1])
        raise ValueError(
            f"step: {shown} in eval mode while the module trains: the step's dropout follows "
            "the whole module's train/eval flag; set such a module's probability to 0 "
            f"instead (module.{attr} = 0.0: followed at the next call)"
        )


def _train_only(graph) -> bool:
    """Whether the text computes otherwise in train mode: dropout drawing a mask, batch norm."""
    from unroller.analysis.verify import text_dropouts

    return bool(text_dropouts(graph)) or any(n.op.name.startswith("batchnorm") for n in graph.nodes)


def _make_spec(original, how: _How, inputs: dict, target, mode: str) -> _Spec:
    """A specialisation: the generated class from the in-process cache, else imported and
    generated (``_build``); an instance on the meta device given the original's tensors."""
    key = (
        stepcache.fingerprint(original),
        stepcache.signature(inputs, target),
        how.loss,
        repr(how.options),
        how.name,
        str(how.directory),
        mode,
    )
    built = stepcache.lookup(key)
    if built is None:
        # the import captures in train mode, so the eval text starts from the train one's
        trained = stepcache.lookup((*key[:-1], "train")) if mode == "eval" else None
        with stepcache.preserved(original), plain_view(original):
            built = _build(
                original, how, inputs, target, mode, None if trained is None else trained.text
            )
        stepcache.remember(key, built)
    model = stepcache.instantiate(built.Model, original)
    model.train()
    spec = _Spec(built, model, stepcache.snapshot(original), _norm_layers(model))
    spec.follow_modes(original)
    return spec


def _build(
    original, how: _How, inputs: dict, target, mode: str, text: str | None = None
) -> stepcache.Built:
    """Import at these shapes (unless ``text``, this import's text, is given) and generate.
    ``mode`` "eval": the text with every dropout probability 0 (what eval mode computes);
    batch norm needs no other text, its kernels follow each layer's train/eval flag
    (``_Spec.follow_modes``)."""
    from unroller.analysis.verify import dropout_off
    from unroller.api import compression_config, graph_from_text
    from unroller.compiler.graph import build_graph
    from unroller.compiler.parser import parse

    label = module_label(original, how.name)
    graph = None
    if text is None:
        batch = inputs if how.keywords else tuple(inputs.values())
        imported = python_words(module_import, original, batch, target, how.loss, how.name)
        graph, text = imported.graph, imported.text
    precision = how.options.precision
    if mode == "eval":
        graph = build_graph(dropout_off(parse(text, f"{label}.txt")), precision=precision)
    elif graph is None or how.options.resolution is not None or graph.precision != precision:
        # inputs resized, or a precision's casts: another graph
        graph = graph_from_text(text, f"{label}.txt", how.options.resolution, precision)
    loaded = materialize(
        graph,
        f"{label}.txt",
        how.options,
        compression_config(how.options, graph),
        folder=how.directory if how.directory is not None else cache_dir(),
        file_name=f"{label}_{{digest}}.py",
        module_name=f"unroller_unrolled_{label}_{{digest}}",
        cache=True,  # a folder given by the caller is a cache of code run too
    )
    return stepcache.Built(loaded.Model, text, loaded.source, loaded.path, graph)


#: Command-line words in the importer's messages -> the Python arguments they stand for.
def unroll(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str | None = None,
    scheme: str = "nocompress",
    options: Options | None = None,
    name: str | None = None,
    directory: str | Path | None = None,
    logits: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    accumulate: int = 1,
    clip_grad_value: float | None = None,
    clip_grad_norm: float | None = None,
    shard: Any = None,
    **settings: Any,
) -> Unrolled:
    """``module``'s training step, generated with ``scheme`` (or ``options``), sharing its
    parameters and buffers (see the module docstring). ``inputs``/``target``: an example
    batch (only shapes and dtypes are read); or ``inputs`` a Hugging Face keyword batch
    with ``labels`` (no ``target``), whose loss is the model's own (``hf_batch``). The
    source is cached in ``directory`` (default ``cache_dir()``) under the hash of its text,
    and the generated class in-process, so a second call with the same network and
    options costs no import. ``loss`` defaults to ``cross_entropy`` (or the model's).
    ``settings``: any generation option by its ``Options`` field name
    (``recompute_segments="blocks"``, ``segment_pieces=2``, ``recompute=True``, ...),
    validated as the command line validates its flags. ``logits=False``: ``step(**batch)``
    returns ``.logits`` None, and the step holds no prediction through its backward (what a
    training loop that reads the loss alone wants: a causal LM's logits are vocabulary x
    tokens per sample); a positional call, which returns the loss alone, never holds one.

    ``optimizer``: a ``torch.optim`` optimizer over the module's parameters, stepped in the
    backward (``unroller.runtime.in_backward``): each parameter updated once its gradient
    is final, the gradient freed; ``accumulate``: steps (micro-batches) per update;
    ``clip_grad_value``: each gradient clamped to that value before its update;
    ``clip_grad_norm`` (global-norm clipping) is refused with ``optimizer=``: it needs every
    gradient before the first update.

    ``shard``: True (a 1-D mesh over the default process group) or a ``DeviceMesh``, on
    every rank: the step is generated with ``--shard`` and ``module`` wrapped with FSDP2's
    ``fully_shard`` (each of the step's units, then the whole:
    ``unroller.parallel.adopted.shard_module``; ``precision="bf16"`` with its
    ``MixedPrecisionPolicy``), so its parameters are the shards, which an optimizer over
    ``module.parameters()`` made after this call steps; each rank passes its own share of
    every batch. A module the user already wrapped with ``fully_shard`` is taken as it is
    (``shard`` left out; ``optimizer=`` over its shards allowed). ``no_grad`` calls and
    ``predict`` run the module's own FSDP2 forward; other shapes get their own step."""
    from unroller.importer.hf_batch import batch_plan

    if clip_grad_norm is not None:
        raise InBackwardError(
            "unroll: clip_grad_norm= scales every gradient by the norm of all of them, which "
            "is known only once the whole backward has run, after the updates in it; use "
            "clip_grad_value= (each gradient clamped alone before its update), or leave "
            "optimizer= out and clip before opt.step() as usual"
        )
    if optimizer is None and (accumulate != 1 or clip_grad_value is not None):
        raise InBackwardError(
            "unroll: accumulate= and clip_grad_value= are for the optimizer in the backward: "
            "give optimizer= (without it, accumulate gradients in .grad as usual)"
        )
    module = _peft_base(module)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    plan = None
    if isinstance(inputs, Mapping) and "labels" in inputs:
        if target is not None:
            raise ValueError("unroll: a batch with 'labels' is its own target; leave target out")
        plan = batch_plan(module, inputs["labels"])
        if loss is not None and loss != plan.loss:
            raise ValueError(
                f"unroll: loss={loss!r}, but {type(module).__name__} computes {plan.loss}"
            )
        named, target = plan.split(module, inputs)
        loss = plan.loss
    elif isinstance(inputs, Mapping):
        named = dict(inputs)
    else:
        named = {f"x{i}": t for i, t in enumerate(inputs)}
    adopted = bool(user_units(module))
    if adopted and shard is False:
        raise ShardError(
            "unroll: shard=False, but the module is sharded (fully_shard): its step must "
            "gather its parameters; leave shard= out"
        )
    if adopted:  # the user's fully_shard: the step gathers through their modules
        precision = adopted_precision(module, options, settings)
        if options is not None:
            options = dataclasses.replace(options, shard=True, precision=precision)
        else:
            settings.update(shard=True, precision=precision)
    elif shard is not None and shard is not False:
        if optimizer is not None:
            raise InBackwardError(
                "unroll: optimizer= with shard=: the optimizer must hold the shards, which "
                "exist once unroll returns; unroll with update_in_backward=True, make the "
                "optimizer then over module.parameters() and attach it with "
                "unroller.runtime.in_backward.attach(step.model, optimizer)"
            )
        if options is not None:
            options = dataclasses.replace(options, shard=True)
        else:
            settings["shard"] = True
    updater = None
    if optimizer is not None:
        updater = InBackward(module, optimizer, accumulate, clip_grad_value)
        if options is not None:
            options = dataclasses.replace(options, update_in_backward=True)
        else:
            settings["update_in_backward"] = True
    how = _How(
        loss or "cross_entropy",
        from_keywords(options, scheme, settings),
        name,
        Path(directory) if directory is not None else None,
        isinstance(inputs, Mapping),
        tuple(named),
        plan,
        logits,
    )
    if updater is not None and how.options.precision == "fp16-mixed":
        raise InBackwardError(
            "unroll: optimizer= with precision='fp16-mixed': a GradScaler's step checks every "
            "gradient for infs before any update; use 'bf16-mixed', or step as usual"
        )
    spec = _make_spec(module, how, named, target, "train")  # the eval variant on demand
    key = (stepcache.signature(named, target), "train", how.options.precision)
    mesh = None if shard is None or shard is True else shard
    if how.options.shard and not adopted:  # shard=: fully_shard as the user would
        policy = policy_for(how.options.precision)
        shard_module(module, spec.model.SHARD_UNITS, mesh, policy)
        stepcache.share(spec.model, module)
        spec.shared = stepcache.snapshot(module)
    unrolled = Unrolled(module, how, key, spec, updater)
    if how.options.shard:
        adopt(spec.model, module, mesh)
    return unrolled


def _peft_base(module: torch.nn.Module) -> torch.nn.Module:
    """The model a peft adapter wrapper (``PeftModel``: LoRA, IA3, ...) runs: its adapters
    are layers injected into that model in place, so its parameters (frozen base, trainable
    adapters) are the wrapper's own tensors and its forward is the wrapper's; unrolled, the
    step writes the same ``.grad``. Prompt learning (virtual tokens the wrapper prepends) is
    refused with the reason."""
    get_base = getattr(module, "get_base_model", None)
    if not callable(get_base) or not hasattr(module, "peft_config"):
        return module
    if getattr(module, "active_peft_config", None) is not None and getattr(
        module.active_peft_config, "is_prompt_learning", False
    ):
        raise ValueError(
            "unroll: a peft prompt-learning model prepends virtual tokens in its wrapper's "
            "forward, which is not imported; adapters injected into the layers (LoRA, IA3, "
            "...) are"
        )
    return get_base()


def verify(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str | None = None,
    name: str | None = None,
    scheme: str = "nocompress",
    options: Options | None = None,
    **kwargs: Any,
):
    """One float64 step of the imported module against ``module`` (``unroll verify``): the
    report (``.ok``, ``.table()``). ``module`` itself is left as it is (a copy is stepped).
    ``unroller.analysis.verify.verify_module``, where ``unroller.analysis.verify(...)`` calls it.
    Generation options are keywords as for ``unroll`` (``recompute_segments="blocks"``,
    ``segment_pieces=2``): the step checked is the one they make; the other keywords are
    verify's (``batch_size``, ``seed``, ``tolerance``, ``dropout``)."""
    from unroller.analysis.verify import verify_module

    return verify_module(
        module, inputs, target, loss=loss, name=name, scheme=scheme, options=options, **kwargs
    )
