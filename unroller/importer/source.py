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
import os
import sys
from pathlib import Path

from unroller.importer.model import ImportFailure

#: Modules loaded from a file SPEC: their internal name -> the file's stem (for comments).
FILE_MODULES: dict[str, str] = {}


def class_name(cls) -> str:
    """``package.module.Class``; for a class from a file SPEC, ``file.Class``."""
    module = FILE_MODULES.get(cls.__module__, cls.__module__)
    return f"{module}.{cls.__qualname__}"


def parse_kwargs(text: str | None) -> dict:
    """``--kwargs '{"num_classes": 10}'``: a JSON object, or ImportFailure."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ImportFailure(f"--kwargs: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ImportFailure("--kwargs: expected a JSON object such as '{\"num_classes\": 10}'")
    return value


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
        try:
            with _on_path(os.getcwd()):  # `unroll import mynet:Net` beside mynet.py
                module = importlib.import_module(location)
        except (Exception, SystemExit) as exc:
            raise ImportFailure(f"SPEC {spec!r}: cannot import {location}: {exc!r}") from None
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


class Predictions:
    """Wraps a module so that ``forward`` returns the prediction tensor only (what export
    captures); built lazily so this module imports without torch."""

    def __new__(cls, inner):
        import torch

        class _Predictions(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                return predictions(self.inner(*args))

        return _Predictions(inner)


#: The prefix the wrapper puts before every parameter and module path.
WRAPPER_PREFIX = "inner."
