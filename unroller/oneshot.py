"""``unroller.unroll``: a torch.nn module in, its unrolled (and compressed) training step out.

For a training loop that already exists: the module is imported (``unroll import``),
generated with the scheme asked for (``unroll generate``), the generated source cached on
disk under its content hash, and its ``Model`` built to share the original's parameter and
buffer tensors. Calling it runs one training step, forward and unrolled backward, and
returns the loss with every gradient in the original's ``.grad``: an optimizer over the
original's parameters trains both.

    step = unroller.unroll(net, (x,), y, scheme="quant")
    opt = torch.optim.AdamW(net.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss = step(x, y)
        opt.step()

``unroller.analysis.verify`` checks the same import against the original, one float64 step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from unroller.compiler.options import Options
from unroller.importer.api import module_import, module_label, module_text
from unroller.materialize import materialize


def cache_dir() -> Path:
    """Where generated sources are kept: ``$UNROLLER_CACHE_DIR/generated``, else
    ``$XDG_CACHE_HOME/unroller/generated``, else ``~/.cache/unroller/generated``."""
    env = os.environ.get("UNROLLER_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "generated"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "unroller" / "generated"


#: The model text of a module on example inputs, as ``unroll import`` writes it.
import_text = module_text


class Unrolled(torch.nn.Module):
    """The generated ``Model`` of a module, sharing its tensors: ``step(*inputs, target)``
    runs one training step and returns the loss; ``predict(*inputs)`` evaluates. ``source``
    is the generated code and ``source_path`` the cached file; ``text`` the model text."""

    def __init__(self, model: torch.nn.Module, text: str, source: str, path: Path):
        super().__init__()
        self.model = model
        self.text = text
        self.source = source
        self.source_path = path

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args)

    def predict(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model.predict(*inputs)

    def stash_report(self) -> dict:
        return self.model.stash_report()


def unroll(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "cross_entropy",
    scheme: str = "nocompress",
    options: Options | None = None,
    name: str | None = None,
    directory: str | Path | None = None,
) -> Unrolled:
    """``module``'s training step, generated with ``scheme`` (or ``options``), sharing its
    parameters and buffers (see the module docstring). ``inputs``/``target``: an example
    batch (only shapes and dtypes are read). The source is cached in ``directory`` (default
    ``cache_dir()``) under the hash of its text, so a second call with the same network
    and options imports the same file."""
    from unroller.api import compression_config, graph_from_text

    imported = module_import(module, inputs, target, loss, name)
    options = options or Options(scheme=scheme)
    label = module_label(module, name)
    graph = imported.graph
    if graph is None or options.resolution is not None:  # inputs resized: another graph
        graph = graph_from_text(imported.text, f"{label}.txt", options.resolution)
    loaded = materialize(
        graph,
        f"{label}.txt",
        options,
        compression_config(options, graph),
        folder=Path(directory) if directory is not None else cache_dir(),
        file_name=f"{label}_{{digest}}.py",
        module_name=f"unroller_unrolled_{label}_{{digest}}",
    )
    model = loaded.Model()
    _share(model, module)
    model.train(module.training)
    return Unrolled(model, imported.text, loaded.source, loaded.path)


def _share(model: torch.nn.Module, original: torch.nn.Module) -> None:
    """Every parameter and buffer of ``model`` becomes the original's tensor of the same
    state-dict key (the keys are the same: the import checked them; non-persistent buffers
    of the original, such as a rotary module's table, are not the model's)."""
    for key, tensor in original.state_dict(keep_vars=True).items():
        path, _, leaf = key.rpartition(".")
        owner = model.get_submodule(path) if path else model
        if leaf in owner._parameters:
            owner._parameters[leaf] = tensor
        elif leaf in owner._buffers:
            owner._buffers[leaf] = tensor
        else:
            raise ValueError(f"unroll: the generated module has no tensor {key}")


def verify(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "cross_entropy",
    name: str | None = None,
    **kwargs: Any,
):
    """One float64 step of the imported module against ``module`` (``unroll verify``): the
    report (``.ok``, ``.table()``). ``module`` itself is left as it is (a copy is stepped).
    ``unroller.analysis.verify.verify_module``, where ``unroller.analysis.verify(...)`` calls it."""
    from unroller.analysis.verify import verify_module

    return verify_module(module, inputs, target, loss=loss, name=name, **kwargs)
