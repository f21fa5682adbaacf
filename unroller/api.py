"""The library entry points the CLI, the tests and the benchmarks share.

``load_graph`` reads and checks a model file; ``generate_source`` returns the text of
the generated module; ``compression_config`` resolves a scheme, a config file or the
planned ``auto`` scheme for a graph (which is why this layer sits above the planner).

The file helpers (``read_bounded``, ``write_atomic``, ``output_target``, ``stale_temps``,
``import_generated``, ...) live in ``unroller.files``, below everything that verify, the
planner, the estimate and the memory model import, and are re-exported here for callers.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from unroller.ast import ModelAST
from unroller.codegen import Options, render
from unroller.errors import ModelError
from unroller.files import (  # noqa: F401  (re-exported: the library's file helpers)
    MAX_READ_BYTES,
    STALE_TEMP_SECONDS,
    TEMP_MARK,
    FileTooLarge,
    NotRegularFile,
    PathError,
    file_kind,
    import_generated,
    output_target,
    read_bounded,
    read_limited,
    size_text,
    source_label,
    stale_temps,
    temp_path,
    unlinked_target,
    write_atomic,
)
from unroller.graph import Graph, build_graph
from unroller.parser import parse
from unroller.schemes import CompressionConfig


def read_model_text(path: str | Path) -> str:
    """The model file's text (``parser.read_source``: a bounded regular file, UTF-8, a bad
    byte reported at its line and column)."""
    from unroller.parser import read_source

    return read_source(path)


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


def compression_config(options: Options, graph: Graph | None = None) -> CompressionConfig:
    """The resolved compression config of ``options`` for ``graph``: a built-in scheme or a
    config file (``Options.compression``), or the ``auto`` scheme planned for the graph
    (``plan.auto_config``: one probe step of the uncompressed module). Resolving happens
    here, in the library layer, so that ``codegen.render`` stays a pure function and the
    code generator never imports the planner (which imports verify, which generates)."""
    if not options.planned:
        return options.compression(graph)
    if graph is None:
        raise ValueError("the auto scheme is planned per model: pass the graph")
    from unroller.plan import auto_config

    return options.with_flags(auto_config(graph, segments=options.recompute_segments))


def render_graph(graph: Graph, label: str, options: Options | None = None) -> str:
    """``codegen.render`` of ``graph`` with the config ``options`` resolve to for it."""
    options = options or Options()
    return render(graph, label, options, compression_config(options, graph))


def generate_source(
    path: str | Path, options: Options | None = None, label: str | None = None
) -> str:
    """The generated module for the model file at ``path``."""
    options = options or Options()
    graph = load_graph(path, options.resolution)
    return render_graph(graph, label or source_label(path), options)


def generate_from_text(source: str, options: Options | None = None, label: str = "<string>") -> str:
    options = options or Options()
    return render_graph(graph_from_text(source, label, options.resolution), label, options)


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
