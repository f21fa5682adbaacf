"""The library entry points the CLI, the tests and the benchmarks share.

``load_graph`` reads and checks a model file; ``generate_source`` returns the text of
the generated module; ``write_atomic`` replaces an output file only once the new text
is complete, so a failed run never leaves a half-written file behind.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import ModuleType

from unroller.ast import ModelAST
from unroller.codegen import Options, render
from unroller.errors import ModelError
from unroller.graph import Graph, build_graph
from unroller.parser import parse


def source_label(path: str | Path) -> str:
    """How a generated file names its source: relative to the working directory if inside it."""
    resolved, cwd = Path(path).resolve(), Path.cwd().resolve()
    if resolved.is_relative_to(cwd):
        return resolved.relative_to(cwd).as_posix()
    return resolved.as_posix()


def read_model_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelError(f"no such model file: {path}") from None
    except UnicodeDecodeError as exc:
        raise ModelError(f"the model file is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ModelError(f"cannot read the model file: {exc.strerror}") from None


def at_resolution(model: ModelAST, resolution: int) -> ModelAST:
    """The model with every image-shaped input and target ([N, C, H, W]) resized to
    ``resolution`` rows (columns scaled to keep the aspect ratio), for running the big
    benchmark inputs smaller on a CPU. Shape checks then apply at the new size."""
    if resolution < 1:
        raise ModelError(f"the resolution must be positive, got {resolution}")
    decls = []
    for decl in model.decls:
        if len(decl.dims) == 4:
            h, w = decl.dims[2], decl.dims[3]
            new_w = max(1, round(w * resolution / h))
            decl = replace(decl, dims=(*decl.dims[:2], resolution, new_w))
        decls.append(decl)
    return replace(model, decls=decls)


def graph_from_text(
    source: str, filename: str = "<string>", resolution: int | None = None
) -> Graph:
    model = parse(source, filename)
    if resolution is not None:
        model = at_resolution(model, resolution)
    return build_graph(model)


def load_graph(path: str | Path, resolution: int | None = None) -> Graph:
    return graph_from_text(read_model_text(path), str(path), resolution)


def generate_source(
    path: str | Path, options: Options | None = None, label: str | None = None
) -> str:
    """The generated module for the model file at ``path``."""
    options = options or Options()
    graph = load_graph(path, options.resolution)
    return render(graph, label or source_label(path), options)


def generate_from_text(source: str, options: Options | None = None, label: str = "<string>") -> str:
    options = options or Options()
    return render(graph_from_text(source, label, options.resolution), label, options)


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Write ``text`` (UTF-8, ``\\n`` line ends) or bytes to ``path`` through a temporary
    file and a rename, so a reader or a crash never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def import_generated(path: str | Path, name: str | None = None) -> ModuleType:
    """Import a generated module from a file path (tests and benchmarks use this)."""
    path = Path(path)
    name = name or f"unroller_generated_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_model_class(
    path: str | Path, options: Options | None = None, directory: Path | None = None
):
    """Generate, write to ``directory`` (a temp dir by default) and import; returns ``Model``."""
    text = generate_source(path, options)
    directory = Path(directory or tempfile.mkdtemp(prefix="unroller-"))
    options = options or Options()
    suffix = f"_{options.resolution}" if options.resolution else ""
    out = directory / f"{Path(path).stem}_{options.platform}_{options.scheme}{suffix}.py"
    write_atomic(out, text)
    return import_generated(out).Model
