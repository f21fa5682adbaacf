"""SPEC -> the user's ``torch.nn.Module``: ``package.module:factory``, ``path.py:Name``.

Both ``unroll import`` and ``unroll verify`` build the original network here, with the
same keyword arguments, so what is verified is what was imported. The SPEC names code the
user chose to run (as ``python -c`` would); nothing from it reaches generated code.
``predictions`` reduces what ``forward`` returns (a tensor, a tuple, a dict or a Hugging
Face ``ModelOutput``) to the one tensor the imported model returns as its prediction.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from unroller.importer.model import ImportFailure

#: Modules loaded from a file SPEC: their internal name -> the file's stem (for comments).
FILE_MODULES: dict[str, str] = {}


def class_name(cls) -> str:
    """``package.module.Class``; for a class from a file SPEC, ``file.Class``."""
    module = FILE_MODULES.get(cls.__module__, cls.__module__)
    return f"{module}.{cls.__qualname__}"


#: ``--kwargs`` bounds: the text's length, and how deep lists and objects nest (the
#: top-level object counts as 1). JSON nested thousands deep once ended in a RecursionError.
MAX_KWARGS_CHARS = 65536
MAX_KWARGS_DEPTH = 8
#: The largest integer ``--kwargs`` may hold (int64: what any size or count fits in).
MAX_KWARGS_INT = 2**63 - 1


def parse_kwargs(text: str | None) -> dict:
    """``--kwargs '{"num_classes": 10}'``: a JSON object of bounded size and depth whose
    keys are identifiers and whose values are strings, finite numbers, booleans, null, and
    lists and objects of those; ImportFailure (one line) otherwise."""
    if not text:
        return {}
    if len(text) > MAX_KWARGS_CHARS:
        raise ImportFailure(
            f"--kwargs: {len(text):,} characters, more than the limit of {MAX_KWARGS_CHARS:,}"
        )
    depth = _json_depth(text)
    if depth > MAX_KWARGS_DEPTH:
        raise ImportFailure(
            f"--kwargs: lists and objects nest {depth} deep, more than the limit of "
            f"{MAX_KWARGS_DEPTH}"
        )
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ImportFailure(f"--kwargs: not JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, NaN
        raise ImportFailure(f"--kwargs: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(value, dict):
        raise ImportFailure("--kwargs: expected a JSON object such as '{\"num_classes\": 10}'")
    for key in value:
        if not (key.isascii() and key.isidentifier()):
            raise ImportFailure(f"--kwargs: the key {key[:80]!r} is not a keyword-argument name")
    _check_json_value(value, "--kwargs")
    return value


def _no_constant(name: str):
    """JSON's NaN / Infinity are not numbers a factory can be given."""
    raise ValueError(f"{name} is not a finite number")


def _json_depth(text: str) -> int:
    """How deep ``[`` and ``{`` nest in ``text`` outside strings, without parsing it (the
    parser recurses once per level)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_json_value(value, where: str) -> None:
    """Finite floats and int64 integers only, anywhere in the (already depth-bounded) value."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_json_value(item, f"{where}.{key[:40]}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json_value(item, f"{where}[{index}]")
    elif isinstance(value, bool) or value is None or isinstance(value, str):
        return
    elif isinstance(value, int):
        if abs(value) > MAX_KWARGS_INT:
            raise ImportFailure(f"{where}: the integer is outside int64")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ImportFailure(f"{where}: {value} is not a finite number")


@contextlib.contextmanager
def _on_path(folder: str):
    """``folder`` first on sys.path while the user's code is imported."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass


@contextlib.contextmanager
def _without_working_folder():
    """sys.path without the working folder's implicit entries while a dotted SPEC is
    imported: ``pkg.module:F`` must resolve from the installed environment, never from a
    ``./pkg/`` planted where the command happens to run. Dropped: relative entries ('' from
    ``python -c``, '.'), which name whatever folder the command runs in, and a first entry
    naming the working folder (``python -m`` puts it there). Absolute entries that site
    files or PYTHONPATH add stay, even where they name the working folder: an editable
    install of the project the command runs in is installed. Local code is named as a
    file: ``path/file.py:F``."""
    here = os.path.realpath(os.getcwd())
    saved = list(sys.path)
    sys.path[:] = [
        entry
        for index, entry in enumerate(saved)
        if os.path.isabs(entry) and not (index == 0 and _names_folder(entry, here))
    ]
    try:
        yield
    finally:
        sys.path[:] = saved


def _names_folder(entry: str, folder: str) -> bool:
    """Whether the sys.path ``entry`` is ``folder``."""
    try:
        return os.path.realpath(entry) == folder
    except (OSError, ValueError):
        return False


def _import_installed(spec: str, location: str):
    """The module ``location`` from the installed environment, or ImportFailure with a hint
    when the working folder holds a file or package of that name."""
    try:
        with _without_working_folder():
            return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        top = location.partition(".")[0]
        local = Path(f"{top}.py").is_file() or Path(top, "__init__.py").is_file()
        hint = (
            f"; the working folder is not searched (give a file instead: "
            f"{location.replace('.', '/')}.py:NAME)"
            if local
            else ""
        )
        raise ImportFailure(f"SPEC {spec!r}: cannot import {location}: {exc!r}{hint}") from None
    except (Exception, SystemExit) as exc:
        raise ImportFailure(f"SPEC {spec!r}: cannot import {location}: {exc!r}") from None


@contextlib.contextmanager
def user_code(spec: str, doing: str):
    """Runs the user's network code (its import, factory, forward): a ``SystemExit``
    (``sys.exit`` in ``forward``) or another exception outside ``Exception`` it raises
    becomes an ImportFailure naming it, so the command fails (exit 2) instead of exiting 0
    or printing a traceback. KeyboardInterrupt stays an interrupt; ``os._exit`` ends the
    process where it is called and cannot be caught."""
    try:
        yield
    except SystemExit as exc:
        raise ImportFailure(
            f"SPEC {spec!r}: the network's code called sys.exit({exc.code!r}) while {doing}; "
            "stopped, nothing written"
        ) from None
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - GeneratorExit or a user BaseException
        raise ImportFailure(
            f"SPEC {spec!r}: the network's code raised {type(exc).__name__} while {doing}; "
            "stopped, nothing written"
        ) from None


def is_onnx(spec: str) -> bool:
    return spec.lower().endswith(".onnx")


def load_object(spec: str):
    """The object SPEC names (a class, a factory function, or a module instance)."""
    location, sep, attr = spec.rpartition(":")
    if not sep or not location or not attr:
        raise ImportFailure(
            f"SPEC {spec!r}: expected package.module:Name, path/to/file.py:Name or file.onnx"
        )
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ImportFailure(f"SPEC {spec!r}: {location} is not a file")
        name = f"unroller_import_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportFailure(f"SPEC {spec!r}: cannot load {location}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        FILE_MODULES[name] = path.stem
        try:
            with _on_path(str(path.resolve().parent)):  # its sibling files import
                module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # the user's file failed: say so
            raise ImportFailure(f"SPEC {spec!r}: running {location} failed: {exc!r}") from None
    else:
        module = _import_installed(spec, location)
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ImportFailure(f"SPEC {spec!r}: {location} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def build_module(spec: str, kwargs: dict | None = None):
    """The network SPEC names, built with ``kwargs``, in train mode, float32 on the CPU."""
    import torch

    target = load_object(spec)
    if isinstance(target, torch.nn.Module):
        if kwargs:
            raise ImportFailure(f"SPEC {spec!r} is a module instance: --kwargs cannot apply")
        module = copy.deepcopy(target)  # verify converts it to float64: never the user's

    elif callable(target):
        try:
            module = target(**(kwargs or {}))
        except (Exception, SystemExit) as exc:
            raise ImportFailure(f"SPEC {spec!r}: building it failed: {exc!r}") from None
    else:
        raise ImportFailure(f"SPEC {spec!r} is not a class, factory or torch.nn.Module")
    if not isinstance(module, torch.nn.Module):
        raise ImportFailure(f"SPEC {spec!r} built a {type(module).__name__}, not a torch.nn.Module")
    return module.train()


def predictions(output):
    """The prediction tensor in what ``forward`` returned: the tensor itself, the first
    element of a tuple or list, ``logits`` (or the first tensor) of a dict or ModelOutput."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "keys"):
        if "logits" in output:
            return output["logits"]
        for value in output.values():
            if isinstance(value, torch.Tensor):
                return value
    if isinstance(output, (tuple, list)) and output:
        return predictions(output[0])
    raise ImportFailure(f"forward returned {type(output).__name__}: expected a tensor")


def input_keywords(module, names: Sequence[str]) -> list[str | None]:
    """How each declared input reaches ``module.forward``: by keyword where its name is one
    of forward's parameters (``decoder_input_ids``, ``attention_mask``), else positionally
    (None), in order. A positional input may not land on a parameter another input names."""
    import inspect

    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return [None] * len(names)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = [p for p in signature.parameters.values() if p.kind in kinds]
    known = {p.name for p in params}
    keywords = [name if name in known else None for name in names]
    slots = [p.name for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    filled = slots[: keywords.count(None)]
    clash = [name for name in filled if name in keywords]
    if clash:
        raise ImportFailure(
            f"--input {clash[0]!r} names a parameter of forward that an input declared before "
            "it already fills by position: name every input after forward's parameters, or "
            "none of them"
        )
    return keywords


def call_with_inputs(module, names: Sequence[str] | None, values: Sequence):
    """``module(...)`` with the declared inputs, each by keyword or position
    (``input_keywords``); all positional when ``names`` is None."""
    if names is None:
        return module(*values)
    keywords = input_keywords(module, names)
    args = [v for k, v in zip(keywords, values) if k is None]
    kwargs = {k: v for k, v in zip(keywords, values) if k is not None}
    return module(*args, **kwargs)


@contextlib.contextmanager
def _without_cache(module):
    """``config.use_cache`` off while the capture runs a Hugging Face model (every causal
    LM's default is on): the key/value cache is an output only generation reads, written in
    place, and the predictions are the same without it, so the step is captured without."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in module.modules())}
    caching = [c for c in configs.values() if getattr(c, "use_cache", None) is True]
    for config in caching:
        config.use_cache = False
    try:
        yield
    finally:
        for config in caching:
            config.use_cache = True


class Predictions:
    """Wraps a module so that ``forward`` returns the prediction tensor only (what export
    captures), taking the declared inputs positionally and passing each to the module by
    keyword or position (``call_with_inputs``); built lazily so this module imports without
    torch."""

    def __new__(cls, inner, names: Sequence[str] | None = None):
        import torch

        class _Predictions(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                with _without_cache(self.inner):
                    return predictions(call_with_inputs(self.inner, names, args))

        return _Predictions(inner)


#: The prefix the wrapper puts before every parameter and module path.
WRAPPER_PREFIX = "inner."
