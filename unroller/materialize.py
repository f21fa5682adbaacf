"""A graph made into a running module: rendered, written to a file, imported.

Generated code runs as a module imported from a file (tracebacks then point at real
lines, and another process, a data-parallel rank or a benchmark worker, can import the
same file). Every place that turns a graph into a ``Model`` class goes through here, so
the three steps are done one way everywhere:

- **render**: ``codegen.render`` under a resolved compression config (the caller
  resolves ``auto``: ``unroller.api.compression_config``; built-in schemes and config
  files resolve here through ``Options.compression``);
- **write**: ``files.write_atomic`` (a temporary file beside the target, then a rename),
  so a half-written file never replaces a good one; a file that already holds exactly
  the text is left alone (a content-addressed cache, a run folder resumed);
- **import**: ``load_file``, the one place that imports generated code
  (``tests/compiler/test_materialize.py`` checks that no other module of the package or the
  benchmarks does). The code run is compiled in memory from the very text rendered (or,
  for ``load_file``, read once from a regular file): no byte code is read from or written
  to ``__pycache__`` beside it, so a ``.pyc`` planted there never runs in place of the
  checked source, and the file can change after the check without effect. ``linecache``
  gets that text, so tracebacks and ``inspect.getsource`` show what ran.

The cache. A folder that is one-shot ``unroller.unroll``'s cache (``cache=True``, or the
folder ``unroller.cache.generated_dir()`` names) gets its rules: it must be ours and
private (``files.private_folder_problem``), its entries are regular files only (a link,
FIFO or folder in an entry's place is refused, never followed or opened blocking), a hit
is marked recently used and each new entry evicts the least recently used beyond the
bounds (``unroller.cache.evict``).

File layout. ``folder`` is where the file goes (None: a temporary folder, removed again
right after the import when ``keep_file`` is False); ``file_name`` its name, in which
``{digest}`` stands for the first 20 hex digits of the source's SHA-256 (one-shot
``unroller.unroll``'s cache: ``LABEL_{digest}.py``, so each distinct source has its own
file). The callers' names: ``api.load_model_class`` ``STEM_PLATFORM_SCHEME[_RES].py``,
the benchmark registry ``NAME_PLATFORM_SCHEME_RES.py``, verify and the planner
``verified_model.py`` in a temporary folder, ``unroll train`` the run folder's
``generated_model.py``, ``unroll accuracy`` ``init/generated_model.py``, the scaling
benchmark ``VARIANT_SCHEME.py``. ``module_name`` (also with ``{digest}``) is the name in
``sys.modules``; ``keep_module=False`` takes it out again after the import (the class
keeps what it needs), for callers that build many modules in one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import linecache
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType
from typing import TYPE_CHECKING, Any

from unroller import cache as cache_rules
from unroller.compiler.codegen import read_header, render
from unroller.compiler.options import Options
from unroller.files import PathError, read_bounded, write_atomic

if TYPE_CHECKING:
    from unroller.compiler.graph import Graph
    from unroller.compiler.schemes import CompressionConfig

DIGEST_CHARS = 20  # how much of the source's SHA-256 ``{digest}`` stands for


@dataclass(frozen=True)
class Loaded:
    """A generated module as imported: the module object, the file it was imported from
    (gone again when it was written to a temporary folder not kept) and its source."""

    module: ModuleType
    path: Path
    source: str

    @property
    def Model(self) -> type:  # noqa: N802 - the generated class's own name
        return self.module.Model

    @property
    def header(self) -> dict[str, Any] | None:
        """The metadata the generated file records (``codegen.read_header``)."""
        return read_header(self.source)


def digest(source: str) -> str:
    """The first ``DIGEST_CHARS`` hex digits of the source's SHA-256."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def materialize(
    graph: Graph,
    label: str,
    options: Options | None = None,
    config: CompressionConfig | None = None,
    *,
    folder: str | Path | None = None,
    file_name: str = "generated_model.py",
    module_name: str | None = None,
    readable: bool = True,
    keep_file: bool = True,
    keep_module: bool = True,
    follow_links: bool = True,
    cache: bool | None = None,
) -> Loaded:
    """``graph`` rendered under ``options`` and ``config`` (None: ``options.compression``,
    which refuses the planned ``auto`` scheme: resolve it first), written and imported
    (see the module docstring for ``folder``, ``file_name``, ``module_name`` and the
    ``keep_`` flags). ``readable=False`` skips black: for modules that are run, never
    read. ``cache``: ``folder`` is the one-shot cache (None: when it is
    ``unroller.cache.generated_dir()``)."""
    options = options or Options()
    config = config if config is not None else options.compression(graph)
    source = render(graph, label, options, config, readable=readable)
    return load_source(
        source,
        folder,
        file_name,
        module_name,
        keep_file=keep_file,
        keep_module=keep_module,
        follow_links=follow_links,
        cache=cache,
    )


def load_source(
    source: str,
    folder: str | Path | None,
    file_name: str = "generated_model.py",
    module_name: str | None = None,
    *,
    keep_file: bool = True,
    keep_module: bool = True,
    follow_links: bool = True,
    cache: bool | None = None,
) -> Loaded:
    """A generated ``source`` already rendered (a caller that compares or hashes the text
    first: ``unroll train``, ``unroll accuracy``), written into ``folder`` and imported, as
    ``materialize`` does. The module runs ``source`` itself, compiled in memory; the file
    is for tracebacks and other processes."""
    fill = digest(source) if "{digest}" in file_name + (module_name or "") else ""
    file_name = file_name.replace("{digest}", fill)
    module_name = module_name.replace("{digest}", fill) if module_name else None
    temporary = folder is None
    where = Path(tempfile.mkdtemp(prefix="unroller-")) if temporary else Path(folder)
    cached = not temporary and (cache if cache is not None else cache_rules.is_generated_dir(where))
    try:
        if cached:
            cache_rules.prepare(where)
        path = _write_entry(where / file_name, source, cached, follow_links)
        module = run_source(source, path, module_name, keep_module=keep_module)
    finally:
        if temporary and not keep_file:
            shutil.rmtree(where, ignore_errors=True)
    return Loaded(module, path, source)


def _write_entry(path: Path, source: str, cached: bool, follow_links: bool) -> Path:
    """``write_source``, with the cache's rules when ``cached``: links never followed, a
    hit marked recently used, old entries evicted past the bounds; a refusal says it is
    the cache's file."""
    if not cached:
        return write_source(path, source, follow_links=follow_links)
    try:
        written = write_source(path, source, follow_links=False, touch=True)
    except PathError as exc:
        raise PathError(
            f"unroller cache: {exc}; only regular files it wrote belong there (remove it)"
        ) from exc
    cache_rules.evict(written.parent, keep=written)
    return written


def write_source(
    path: str | Path, source: str, *, follow_links: bool = True, touch: bool = False
) -> Path:
    """Write ``source`` to ``path`` atomically unless the file holds exactly that text
    already (then it is left as it is, its time stamp too, unless ``touch``: a cache hit
    marked recently used); returns the file. ``follow_links=False``: a link at ``path`` is
    refused (``files.write_atomic``), never read through."""
    path = Path(path)
    if _holds(path, source.encode("utf-8"), follow_links):
        if touch:
            cache_rules.touch(path)
        return path
    return write_atomic(path, source, follow_links=follow_links)


def _holds(path: Path, data: bytes, follow_links: bool) -> bool:
    """Whether ``path`` is a regular file holding exactly ``data`` (a FIFO or device is
    never opened blocking or read: ``read_bounded``)."""
    try:
        return read_bounded(path, follow_links=follow_links) == data
    except OSError:
        return False


def load_file(
    path: str | Path,
    module_name: str | None = None,
    *,
    keep_module: bool = True,
    follow_links: bool = True,
) -> ModuleType:
    """Import the generated module in the file at ``path`` (written by this process or
    another: a data-parallel rank, a benchmark's parent process, an earlier run) as
    ``module_name`` (default: one derived from the resolved path). The one place the
    package imports generated code from a file: the file is read once (a regular file of
    bounded size; ``follow_links=False`` refuses a link) and that text is what runs."""
    path = Path(path)
    name = module_name or f"unroller_generated_{abs(hash(path.resolve()))}"
    source = read_bounded(path, follow_links=follow_links).decode("utf-8")
    return run_source(source, path, name, keep_module=keep_module)


def run_source(
    source: str, path: Path, module_name: str | None = None, *, keep_module: bool = True
) -> ModuleType:
    """A fresh module ``module_name`` running ``source`` compiled in memory, its
    ``__file__`` ``path`` (tracebacks and ``inspect`` point there and, through
    ``linecache``, show ``source`` whatever the file holds later). Registered in
    ``sys.modules`` while it runs (a class pickled or a dataclass made at import needs
    that) and after, unless ``keep_module`` is False. No byte code is read or written:
    what runs is ``source``, nothing planted beside it."""
    name = module_name or f"unroller_generated_{abs(hash(path.resolve()))}"
    filename = str(path)
    code: CodeType = compile(source, filename, "exec", dont_inherit=True)
    module = ModuleType(name)
    module.__file__ = filename
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=filename)
    module.__spec__.has_location = True
    if keep_module:
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - the checked, generated source
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if not keep_module:
            sys.modules.pop(name, None)
    return module


def model_class(
    graph: Graph,
    label: str,
    config: CompressionConfig | None = None,
    *,
    options: Options | None = None,
) -> type:
    """The gpu ``Model`` of ``graph``, uncompressed or under ``config`` (and ``options``:
    recompute, segments, pieces), unformatted, from a temporary folder removed right after
    the import, and out of ``sys.modules`` again: the module verify and the planner step
    (run, never read)."""
    options = options or Options(platform="gpu", scheme="nocompress")
    if options.precision != graph.precision:  # the graph holds the precision's casts
        options = dataclasses.replace(options, precision=graph.precision)
    loaded = materialize(
        graph,
        label,
        options,
        config,
        file_name="verified_model.py",
        module_name=f"unroller_verify_{abs(hash(label))}_{{digest}}",
        readable=False,
        keep_file=False,
        keep_module=False,
    )
    return loaded.Model


#: Builds the ``Model`` class of a graph under a config (None: uncompressed), labelled: the
#: shape of ``model_class``, which the planner takes as a parameter.
ModelBuilder = Callable[["Graph", str, "CompressionConfig | None"], type]
