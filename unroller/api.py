"""The library entry points the CLI, the tests and the benchmarks share.

``load_graph`` reads and checks a model file; ``generate_source`` returns the text of
the generated module; ``compression_config`` resolves a scheme, a config file or the
planned ``auto`` scheme for a graph; ``load_model_class`` generates, writes and imports
(``unroller.materialize``). ``simulate`` predicts the memory of a model text under any
scheme, ``auto`` planned first. The file helpers (``unroller.files``), the text -> graph
step (``unroller.load``) and ``import_generated`` (``materialize.load_file``) are
re-exported, so a caller needs one import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unroller.compiler.codegen import render
from unroller.compiler.graph import Graph
from unroller.compiler.options import Options
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.schemes import CompressionConfig
from unroller.files import (  # noqa: F401  (re-exported: the library's file helpers)
    MAX_READ_BYTES,
    STALE_TEMP_SECONDS,
    TEMP_MARK,
    FileTooLarge,
    NotRegularFile,
    PathError,
    file_kind,
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
from unroller.load import (  # noqa: F401  (re-exported: model text -> graph)
    at_resolution,
    graph_from_text,
    load_graph,
    read_model_text,
)
from unroller.materialize import load_file as import_generated  # noqa: F401  (re-exported)
from unroller.materialize import materialize

if TYPE_CHECKING:
    from unroller.analysis.memory import Simulation


def compression_config(options: Options, graph: Graph | None = None) -> CompressionConfig:
    """The resolved compression config of ``options`` for ``graph``: a built-in scheme or a
    config file (``Options.compression``), or the ``auto`` scheme planned for the graph
    (``search.auto_config``: a probe step of the uncompressed module and the search). ``codegen.render``
    takes the result: generation stays a pure function of a graph and a config.

    With ``recompute``, the tensors whose remaking would raise the step's predicted peak
    or bytes per sample are kept instead (``recompute_guard.guard_recompute``: the memory
    model at a few batch sizes), so ``--recompute`` never makes a step keep more."""
    if graph is None and (options.planned or options.recompute):
        what = "the auto scheme" if options.planned else "--recompute"
        raise ValueError(f"{what} is planned per model: pass the graph")
    if options.planned:
        from unroller.analysis.search import auto_config

        config = options.with_flags(auto_config(graph, **_auto_moves(options)))
    else:
        config = options.compression(graph)
    if not config.recompute or graph is None:
        return config
    from unroller.analysis.recompute_guard import guard_recompute

    return guard_recompute(
        graph,
        config,
        options.platform,
        segment_pieces=options.segment_pieces,
        segment_piece_size=options.segment_piece_size,
    )


def _auto_moves(options: Options) -> dict[str, Any]:
    """What the ``auto`` search may choose under ``options``: segments unless the step is
    pipelined, pieces only where gradients accumulate in one process and the options do not
    split segments themselves, ``--recompute`` fixed on when asked for."""
    target = get_platform(options.platform)
    staged = options.num_ipus != 1 or options.pipeline != 1 or target.pipelined
    pieces = target.grads == "accumulate" and not options.data_parallel and not staged
    pieces = pieces and options.segment_pieces == 1 and not options.segment_piece_size
    return {
        "segments": None if staged else options.recompute_segments,
        "platform": options.platform,
        "recompute": True if options.recompute else None,
        "max_time_ratio": options.max_time_ratio,
        "pieces": pieces,
    }


def simulate(text: str, options: Options, batch_size: int, label: str = "<model>") -> Simulation:
    """``memory.simulate_graph`` of a model text under ``options`` (its scheme, resolution;
    the ``auto`` scheme planned for the graph)."""
    from unroller.analysis.memory import simulate_graph

    graph = graph_from_text(text, label, options.resolution, options.precision)
    return simulate_graph(
        graph,
        compression_config(options, graph),
        batch_size,
        options.platform,
        segment_pieces=options.segment_pieces,
        segment_piece_size=options.segment_piece_size,
        update_in_backward=options.update_in_backward,
    )


def render_graph(graph: Graph, label: str, options: Options | None = None) -> str:
    """``codegen.render`` of ``graph`` with the config ``options`` resolve to for it."""
    options = options or Options()
    return render(graph, label, options, compression_config(options, graph))


def generate_source(
    path: str | Path, options: Options | None = None, label: str | None = None
) -> str:
    """The generated module for the model file at ``path``."""
    options = options or Options()
    graph = load_graph(path, options.resolution, options.precision)
    return render_graph(graph, label or source_label(path), options)


def generate_from_text(source: str, options: Options | None = None, label: str = "<string>") -> str:
    options = options or Options()
    graph = graph_from_text(source, label, options.resolution, options.precision)
    return render_graph(graph, label, options)


def load_model_class(
    path: str | Path, options: Options | None = None, directory: Path | None = None
):
    """Generate, write to ``directory`` (a temp dir by default) as
    ``STEM_PLATFORM_SCHEME[_RESOLUTION].py`` and import; returns ``Model``."""
    options = options or Options()
    graph = load_graph(path, options.resolution, options.precision)
    suffix = f"_{options.resolution}" if options.resolution else ""
    return materialize(
        graph,
        source_label(path),
        options,
        compression_config(options, graph),
        folder=directory,
        file_name=f"{Path(path).stem}_{options.platform}_{options.scheme}{suffix}.py",
    ).Model
