"""What ``unroller.unroll`` keeps in-process, and the state it leaves as it found it.

A second ``unroll`` of the same network (same classes, parameter names, shapes, dtypes,
``requires_grad``, module attributes, config) on a batch of the same signature with the same options costs
no re-trace: the generated ``Model`` class is kept here under a structural fingerprint of
the module, and only a new instance is made. That instance is built on the meta device and
then given the original's tensors, so no second copy of the parameters is ever allocated
(or initialised: no draw from torch's random state).

``preserved`` wraps an import: the module's train/eval flags, its buffers' values and
torch's CPU (and the module's CUDA devices') random state come back as they were.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Generated classes kept in-process (most recently used last).
MAX_BUILT = 32
#: Shape specialisations one step keeps (an LRU: a new sequence length evicts the oldest).
MAX_SHAPES = 8


@dataclass
class Built:
    """One generated specialisation: its class, model text, source and checked graph."""

    Model: type
    text: str
    source: str
    path: Path
    graph: Any


_BUILT: OrderedDict[Hashable, Built] = OrderedDict()


def lookup(key: Hashable) -> Built | None:
    built = _BUILT.get(key)
    if built is not None:
        _BUILT.move_to_end(key)
    return built


def remember(key: Hashable, built: Built) -> None:
    _BUILT[key] = built
    _BUILT.move_to_end(key)
    while len(_BUILT) > MAX_BUILT:
        _BUILT.popitem(last=False)


def tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors by key (parameters as the Parameter objects)."""
    return module.state_dict(keep_vars=True)


def snapshot(module: torch.nn.Module) -> tuple:
    """Which tensor objects the module holds, and how: compared at every step call, so
    a new ``nn.Parameter``, ``load_state_dict(assign=True)`` or a ``requires_grad`` flip is
    seen before the step reads a stale tensor. Cheap: attribute reads, no tensor data."""
    return tuple(
        (k, id(t), t.requires_grad, t.dtype, tuple(t.shape), t.device)
        for k, t in tensors(module).items()
    )


def structure(snap: tuple) -> tuple:
    """A snapshot less the objects' identities: what the generated code depends on."""
    return tuple((k, *rest) for k, _, *rest in snap)


#: Plain values a module's attributes may hold that its forward may read (eps, stride, p).
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, (*_PLAIN, torch.dtype, torch.Size))


#: How deep ``_setting`` reads nested containers (deeper: by identity, as a cycle would be)
_MAX_DEPTH = 4


def _setting(value: Any, depth: int = 0) -> Any:
    """What an attribute contributes to ``settings``: a plain value itself; a function, a
    builtin or a ``functools.partial`` by its qualified name (and the partial's plain
    arguments); an Enum by its repr; a tensor or a config (read through the Hugging Face
    fingerprint) nothing; a dict, list or tuple what its items contribute (an equal copy
    of one, as ``torch.export`` leaves a peft model's ``peft_config``, is the same setting);
    any other object its type and identity, so that a step is made again rather than
    reused wrongly (a cache miss, never a stale hit)."""
    if _plain(value):
        return value
    if depth < _MAX_DEPTH and isinstance(value, dict) and all(_plain(k) for k in value):
        return ("dict", tuple((k, _setting(v, depth + 1)) for k, v in value.items()))
    if depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_setting(v, depth + 1) for v in value))
    if isinstance(value, (torch.Tensor, torch.nn.Module)) or hasattr(value, "to_dict"):
        return None
    if isinstance(value, functools.partial):
        return ("partial", _setting(value.func), _setting(value.args), _setting(value.keywords))
    if isinstance(value, enum.Enum):
        return repr(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return (type(value).__qualname__, id(value))


def settings(module: torch.nn.Module) -> str:
    """Each submodule's attributes (a LayerNorm's eps, a convolution's stride and padding,
    a dropout's p, a custom module's ``self.scale`` or ``self.f = torch.tanh``; see
    ``_setting``): the traced code bakes them
    in, so two modules that differ only there must not share a generated class, and a
    step must notice when one changes. The train/eval flag is left out (the step follows
    it at every call), as are nn.Module's own underscored fields (hooks, registries)."""
    found = []
    for path, sub in module.named_modules():
        found.append(
            (
                path,
                [(k, _setting(v)) for k, v in vars(sub).items() if k[0] != "_" and k != "training"],
            )
        )
    return repr(found)  # a string: a nan compares equal to itself there


def fingerprint(module: torch.nn.Module) -> tuple:
    """The module's structure: its classes by path, state-dict keys with shape, dtype and
    ``requires_grad``, every submodule's plain attributes (``settings``) and a Hugging Face
    config's values (which steer ``forward``)."""
    classes = tuple((path, type(m)) for path, m in module.named_modules())
    config = getattr(module, "config", None)
    hf = None
    if config is not None and hasattr(config, "to_dict"):
        hf = repr(sorted(config.to_dict().items(), key=lambda kv: kv[0]))
    return classes, structure(snapshot(module)), settings(module), hf


def signature(inputs: dict[str, torch.Tensor], target: torch.Tensor | None) -> tuple:
    """A batch's names, dtypes and shapes after the batch dim (the batch size is symbolic
    in the generated code, so it is not part of it)."""
    items = [*inputs.items(), *([("<target>", target)] if target is not None else [])]
    return tuple((k, t.dtype, tuple(t.shape[1:])) for k, t in items)


def instantiate(Model: type, original: torch.nn.Module) -> torch.nn.Module:
    """A ``Model`` built on the meta device (no storage, no random draws) and given the
    original's tensors by state-dict key; a tensor left on meta (one the original does not
    hold) is an internal error."""
    with torch.device("meta"):
        model = Model()
    share(model, original)
    left = [k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise ValueError(f"unroll: the generated module has tensors the original lacks: {left[:4]}")
    return model


def share(model: torch.nn.Module, original: torch.nn.Module) -> None:
    """Every parameter and buffer of ``model`` becomes the original's tensor of the same
    state-dict key (the keys are the same: the import checked them; non-persistent buffers
    of the original, such as a rotary module's table, are not the model's)."""
    for key, tensor in tensors(original).items():
        path, _, leaf = key.rpartition(".")
        owner = model.get_submodule(path) if path else model
        if leaf in owner._parameters:
            owner._parameters[leaf] = tensor
        elif leaf in owner._buffers:
            owner._buffers[leaf] = tensor
        else:
            raise ValueError(f"unroll: the generated module has no tensor {key}")


@contextlib.contextmanager
def preserved(module: torch.nn.Module) -> Iterator[None]:
    """The module's modes, buffer values and torch's random state as they were, whatever
    the import (a traced forward in train mode, a diagnostic run) did to them."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, value in buffers:
                if b.shape == value.shape and not torch.equal(b, value):
                    b.copy_(value)
