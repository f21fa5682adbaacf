"""``import_network``: SPEC -> checked model text (what ``unroll import`` writes).

The text is checked before anyone sees it: it must parse and build as a graph, and the
state-dict keys and shapes of the module it generates must be the original's (for an ONNX
file: the initializers that carry a module path), so ``load_state_dict`` works with
``strict=True`` both ways.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unroller.importer.emit import emit_text, snake
from unroller.importer.loss import add_loss
from unroller.importer.model import (
    DTYPES,
    MAX_INPUT_DIMS,
    MAX_SPEC_CHARS,
    ImportedModel,
    ImportFailure,
    Tensor,
    check_elements,
    parse_tensor_spec,
)
from unroller.importer.source import build_module, is_onnx, parse_kwargs, user_code

if TYPE_CHECKING:
    import torch

    from unroller.compiler.graph import Graph

#: The most --input declarations a network may have.
MAX_INPUTS = 64


@dataclass
class Imported:
    text: str
    model: ImportedModel
    state: dict[str, tuple[int, ...]]  # the original's state-dict keys and shapes
    graph: Graph | None = None  # the text's checked graph (``check_text`` built it)


def model_name(spec: str, name: str | None) -> str:
    """``--name``, else the factory's or file's name in snake case."""
    if name is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ImportFailure(f"--name {name!r}: expected an identifier")
        return name
    base = Path(spec).stem if is_onnx(spec) else spec.rpartition(":")[2].rpartition(".")[2]
    return snake(base) or "imported"


def import_network(
    spec: str,
    inputs: Sequence[str | Tensor],
    target: str | Tensor | None = None,
    loss: str = "cross_entropy",
    kwargs: str | dict | None = None,
    name: str | None = None,
    built=None,
    fallback: bool = True,
) -> Imported:
    """The model text for the network SPEC names (see ``unroll import --help``), with its
    checked graph; ``built``: the torch.nn module itself (``unroller.unroll``), SPEC then
    only its label. ``inputs`` and ``target``: ``NAME: DTYPE[N, ...]`` as written on the
    command line, or the declarations themselves (``module_import`` reads them off example
    tensors), checked alike. ``fallback``: an ATen node (or an ONNX op one ATen overload
    computes) no registry operator computes becomes an ``aten`` statement (named in the
    text's notes); False refuses it."""
    if not inputs:
        raise ImportFailure('give the network\'s inputs: --input "x: f32[N, 3, 224, 224]"')
    if len(inputs) > MAX_INPUTS:
        raise ImportFailure(f"{len(inputs)} --input options, more than the limit of {MAX_INPUTS}")
    tensors = [declared(item) for item in inputs]
    check_elements(tensors)
    if len({t.name for t in tensors}) != len(tensors):
        raise ImportFailure("two --input declarations have the same name")
    target_spec = declared(target, "--target") if target else None
    label = model_name(spec, name)
    module = None  # the torch.nn original, to diagnose a text that does not build
    if is_onnx(spec):
        from unroller.importer.onnx_frontend import import_onnx

        if kwargs if isinstance(kwargs, dict) else parse_kwargs(kwargs):
            raise ImportFailure("--kwargs: an ONNX file is not built by a factory")
        model, state = import_onnx(Path(spec), tensors, label, spec, fallback=fallback)
    else:
        from unroller.importer.torch_frontend import import_torch

        options = kwargs if isinstance(kwargs, dict) else parse_kwargs(kwargs)
        with user_code(spec, "importing, building or capturing it"):
            module = built if built is not None else build_module(spec, options)
            model = import_torch(module, tensors, label, spec, fallback=fallback)
            state = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    add_loss(model, loss, target_spec)
    taken = {s.name for s in model.stmts}
    clash = [t.name for t in tensors if t.name in taken]
    if clash:
        raise ImportFailure(
            f"--input {clash[0]!r}: also the name of a statement of the network (a module "
            "path); choose another input name"
        )
    model.notes.insert(0, f"imported from {spec} by unroll import")
    try:
        text = emit_checked(model, spec)
        graph = check_text(text, state, spec)
    except ImportFailure:
        if module is not None:  # the network or its declared inputs at fault: say so
            from unroller.importer.torch_frontend import diagnose

            with user_code(spec, "running it on example inputs"):
                diagnose(module, tensors, f"SPEC {spec!r}")
        raise
    return Imported(text, model, state, graph)


def declared(item: str | Tensor, what: str = "--input") -> Tensor:
    """A declared input or target: ``parse_tensor_spec`` of a command line's text, or a
    declaration made from an example tensor, held to the same bounds (in the same words,
    about the text it stands for)."""
    if isinstance(item, str):
        return parse_tensor_spec(item, what)
    text = f"{item.name}: {item.text()}"
    if len(text) > MAX_SPEC_CHARS:
        raise ImportFailure(
            f"{what}: {len(text):,} characters, more than the limit of {MAX_SPEC_CHARS:,}"
        )
    if item.dtype not in DTYPES or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item.name):
        raise ImportFailure(f"{what} {text!r}: expected NAME: DTYPE[N, d1, ...]")
    if any(d <= 0 or d > 2**31 for d in item.dims):
        raise ImportFailure(f"{what} {text!r}: dims after N must be positive integers")
    if len(item.dims) > MAX_INPUT_DIMS:
        raise ImportFailure(
            f"{what} {item.name!r}: {len(item.dims)} dims after N, more than the limit of "
            f"{MAX_INPUT_DIMS}"
        )
    check_elements([item], what)
    return item


def _reserved() -> set[str]:
    """Names a block may not take: the registry's operators and the language's words."""
    from unroller.compiler.registry import load_registry

    return set(load_registry()) | {"model", "input", "target", "block", "return", "N"}


def emit_checked(model: ImportedModel, spec: str) -> str:
    """The model's text; a value the language cannot write is an importer gap."""
    try:
        return emit_text(model, reserved=_reserved())
    except ValueError as exc:
        raise ImportFailure(f"internal error: cannot write the text of {spec}: {exc}") from None


def check_text(text: str, state: dict[str, tuple[int, ...]], spec: str) -> Graph:
    """The emitted text builds, and its tensors are the original's state dict; the graph
    it builds (so a caller generating from it builds it once)."""
    from unroller.errors import ModelError
    from unroller.load import graph_from_text

    try:
        graph = graph_from_text(text, "<imported>")
    except ModelError as exc:
        line = text.splitlines()[exc.loc.line - 1] if exc.loc else ""
        if re.search(r": argument '\w+' must be ", exc.message):  # a module's value, out of range
            name, _, rest = line.strip().partition(" = ")
            module = rest.rpartition("# ")[2].split(" [")[0] if "# " in rest else ""
            where = f"{name} ({module})" if module else name
            raise ImportFailure(
                f"{spec}: the network's {where} has a setting the language does not take: "
                f"{exc.message}; change it in the network"
            ) from None
        raise ImportFailure(
            f"internal error: the text imported from {spec} does not build: {exc.message} "
            f"(at: {line.strip()})"
        ) from None
    ours = {}
    for node in graph.nodes:
        for tensor in (*node.params, *node.buffers):
            if tensor.present:
                ours[tensor.key] = tuple(tensor.shape)
    if not state:
        return graph
    missing = sorted(set(state) - set(ours))
    extra = sorted(set(ours) - set(state))
    wrong = sorted(k for k in set(ours) & set(state) if tuple(ours[k]) != tuple(state[k]))
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:8])}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:8])}")
        if wrong:
            parts.append(
                "shape " + ", ".join(f"{k} {list(ours[k])} vs {list(state[k])}" for k in wrong[:8])
            )
        raise ImportFailure(
            f"internal error: the imported state dict differs from {spec}'s: " + "; ".join(parts)
        )
    return graph


#: The model-text dtype of an example tensor's dtype (by ``torch.dtype`` name).
_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "bool": "bool",
}


def _declaration(name: str, t: Any) -> Tensor:
    """The declaration ``name: f32[N, 3, 32, 32]`` of an example batch ``t``."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise ValueError(f"{name}: expected a tensor with a batch dimension, got {t!r:.60}")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not one a model input can have")
    return Tensor(name, _DTYPES[dtype], tuple(int(d) for d in t.shape[1:]))


def module_label(module: torch.nn.Module, name: str | None) -> str:
    """``name``, else the module's class in snake case (``LlamaForCausalLM`` ->
    ``llama_for_causal_lm``)."""
    if name is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"name {name!r}: expected an identifier")
        return name
    return snake(type(module).__name__)


def module_import(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
    target: torch.Tensor | None = None,
    loss: str = "cross_entropy",
    name: str | None = None,
) -> Imported:
    """The import of a built ``module`` on example ``inputs`` (and ``target``), as ``unroll
    import`` makes it: its model text and checked graph, for ``unroller.unroll`` and
    ``unroller.analysis.verify``. The inputs are named x0, x1, ... (or by the keys of a dict, each
    reaching ``forward`` by keyword where it names a parameter: ``{"input_ids": ...,
    "decoder_input_ids": ...}``) and the target y."""
    import torch

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, Mapping):
        for key in inputs:
            if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"input name {key!r}: expected an identifier")
        specs = [_declaration(key, t) for key, t in inputs.items()]
    else:
        specs = [_declaration(f"x{i}", t) for i, t in enumerate(inputs)]
    label = module_label(module, name)
    target_spec = _declaration("y", target) if target is not None else None
    return import_network(label, specs, target_spec, loss, name=label, built=module)


def module_text(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
    target: torch.Tensor | None = None,
    loss: str = "cross_entropy",
    name: str | None = None,
) -> str:
    """The model text of ``module_import``, as ``unroll import`` writes it."""
    return module_import(module, inputs, target, loss, name).text


_PYTHON_WORDS = (
    ("--input", "inputs"),
    ("--target", "target"),
    ("--loss", "loss"),
    ("--name", "name"),
    ("--kwargs", "kwargs"),
)


def python_words(function, *args, **kwargs):
    """``function(*args, **kwargs)`` with an ImportFailure's command-line flags named as
    the Python arguments of ``unroll``/``verify`` (``--target`` -> ``target``)."""
    try:
        return function(*args, **kwargs)
    except ImportFailure as exc:
        message = str(exc)
        for flag, word in _PYTHON_WORDS:
            message = re.sub(rf"{flag}(?![\w-])", word, message)
        raise ImportFailure(message) from None
