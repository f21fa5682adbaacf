"""Model text -> checked graph: the first step of everything that starts from a text.

Generation, verify, the importer's self-check, the memory model's callers and the planner's
callers all read a model text the same way: parsed, image inputs optionally resized
(``at_resolution``, to run the big benchmark inputs smaller on a CPU), built and checked as
a graph. This module is that one way; ``unroller.api`` re-exports it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from unroller.compiler.ast import ModelAST
from unroller.compiler.graph import Graph, build_graph
from unroller.compiler.parser import parse, read_source
from unroller.errors import ModelError


def read_model_text(path: str | Path) -> str:
    """The model file's text (``parser.read_source``: a bounded regular file, UTF-8, a bad
    byte reported at its line and column)."""
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
    source: str, filename: str = "<string>", resolution: int | None = None, precision: str = "fp32"
) -> Graph:
    """The checked graph of a model text (``filename`` labels its errors), with image
    inputs resized to ``resolution`` rows when given (``at_resolution``), built for
    ``precision`` (a mixed one writes its casts: ``unroller.compiler.precision``)."""
    model = parse(source, filename)
    if resolution is not None:
        model = at_resolution(model, resolution)
    return build_graph(model, precision=precision)


def load_graph(path: str | Path, resolution: int | None = None, precision: str = "fp32") -> Graph:
    """``graph_from_text`` of the model file at ``path``."""
    return graph_from_text(read_model_text(path), str(path), resolution, precision)
