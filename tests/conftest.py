"""Shared fixtures: generating and importing modules from model files."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import hypothesis
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from unroller.api import import_generated, write_atomic  # noqa: E402
from unroller.compiler.options import Options  # noqa: E402

if TYPE_CHECKING:  # torch is imported where it is used: xdist's controller never needs it
    import torch

SLOW = os.environ.get("SLOW") == "1"


def _test_cache_dir() -> Path:
    """The cache of the tests' native kernel builds and one-shot sources, never the user's:
    ``$UNROLLER_TEST_CACHE_DIR``, else ``unroller-tests-UID`` in the temp folder. It is kept
    between runs (a build costs 20-50 s of CPU; its file is named by the hash of the source,
    compiler and flags, and a one-shot source by the hash of its text, so nothing stale is
    loaded). Only a folder of ours that others cannot write is used: else a fresh one."""
    chosen = os.environ.get("UNROLLER_TEST_CACHE_DIR")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"unroller-tests-{uid}"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.lstat()
        if folder.is_symlink() or info.st_uid != uid or info.st_mode & 0o022:
            raise PermissionError(folder)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="unroller-tests-"))
    return folder


# Set at import, before anything builds: xdist workers and the subprocesses tests start
# inherit both (a worker imports this file too and takes the same folder).
os.environ["UNROLLER_CACHE_DIR"] = os.environ["UNROLLER_TEST_CACHE_DIR"] = str(_test_cache_dir())

# Property tests draw the same examples on every machine and every run (derandomized, no
# example database): a failure in CI is one anybody reproduces with the same command.
# HYPOTHESIS_PROFILE=explore draws fresh random examples, for hunting new failures by hand;
# what it finds becomes an @example.
hypothesis.settings.register_profile("derandomized", derandomize=True, database=None)
hypothesis.settings.register_profile("explore", derandomize=False, database=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one thread per xdist worker: `make test` runs as many workers as cores, and
        # torch's own threads on top would oversubscribe them (float64 depthwise convs)
        import torch

        torch.set_num_threads(1)
    config.addinivalue_line(
        "markers", "slow: end-to-end runs of the benchmark scripts; only with SLOW=1"
    )


def pytest_collection_finish():
    """What collection imported (torch, the test modules, their parameters) lives until the
    end: out of the garbage collector's sight (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """At the end of each test module (its fixtures finalized), what is still alive (modules
    imported, caches) is collected once and frozen out of the collector's sight: a full
    collection (the collector's own, or the one before each memory measurement) then scans
    what the tests since made, not the million and more objects a worker holds by the end
    (0.5-1 s a scan; in one `make test` on a busy 2-core machine the two workers spent 150 s
    in full collections, 40 s with the freeze). Nothing is frozen while it is garbage, and nothing a
    test makes is frozen before its module ends."""
    result = yield
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()
    return result


def pytest_collection_modifyitems(config, items):
    """`make test` stays within its time budget: slow tests run under `make test-slow`."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow: run with SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def fast_subset(values, fast) -> list:
    """pytest params for ``values`` (tuples for several arguments), every one not in
    ``fast`` marked slow: make test keeps a representative corner of a matrix within its
    time budget, and ``make test-slow`` (SLOW=1) runs all of it."""
    fast = set(fast)
    return [
        pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=() if v in fast else SLOW_MARK)
        for v in values
    ]


SLOW_MARK = pytest.mark.slow

_IMPORTED: dict[str, str] = {}


def imported_text(spec: str, inputs, target=None, kwargs: dict | None = None, **options) -> str:
    """``import_network(spec, inputs, target, kwargs=kwargs, **options).text``, imported once
    per test process for the same arguments: a torch.export of a Hugging Face model costs
    1-3 s, and parametrized tests that check the same text another way (verify seeded and
    with dropout off, another platform) share it. Only for imports that read nothing but
    their arguments (no environment a test patches)."""
    from unroller.importer.api import import_network

    key = repr((spec, list(inputs), target, kwargs, sorted(options.items())))
    if key not in _IMPORTED:
        _IMPORTED[key] = import_network(spec, inputs, target, kwargs=kwargs, **options).text
    return _IMPORTED[key]


@contextlib.contextmanager
def time_limit(seconds: int, error: BaseException):
    """Raise ``error`` inside the block once it has run ``seconds``: a test that could
    block (a FIFO, a device, a runaway input) fails instead of hanging the suite."""

    def expired(signum, frame):
        raise error

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny): the measure the 1e-10 bound is stated in."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def fast_format(text: str, mode=None) -> str:
    """Stands in for black.format_str (monkeypatched onto ``codegen.black``) where a test
    generates many modules and reads none: the text unchanged, once it compiles."""
    compile(text, "<generated>", "exec")
    return text


def gradients_of(source) -> dict[str, torch.Tensor | None]:
    """``{name: gradient or None}`` of a module's parameters, or of a mapping whose values
    are parameters (their ``.grad``), gradients or None."""
    import torch

    if isinstance(source, torch.nn.Module):
        return {name: p.grad for name, p in source.named_parameters()}
    return {
        name: value.grad if isinstance(value, torch.nn.Parameter) else value
        for name, value in source.items()
    }


def grad_errors(got, want, floor: float = 1e-9) -> dict[str, float]:
    """Each parameter's ||got - want|| / ||want||, by name, of the parameters whose ``want``
    gradient is not None (``got``, ``want``: as ``gradients_of`` takes). The same
    parameters, with a gradient in both or in neither, and the same shapes, are asserted
    first. ``floor``: a parameter whose exact gradient is below ``floor`` times the
    largest one's norm (a zero in exact arithmetic, left as rounding noise) is measured
    against that instead of its own norm."""
    g, w = gradients_of(got), gradients_of(want)
    assert set(g) == set(w), ("parameters differ", sorted(set(g) ^ set(w)))
    unlike = sorted(n for n in w if (g[n] is None) != (w[n] is None))
    assert not unlike, f"a gradient where the reference has none, or none where it has: {unlike}"
    present = {n: t.detach().double() for n, t in w.items() if t is not None}
    assert present, "no parameter has a gradient to compare"
    largest = max(float(t.norm()) for t in present.values())
    errors = {}
    for name, b in present.items():
        a = g[name].detach().double()
        assert a.shape == b.shape, (name, tuple(a.shape), tuple(b.shape))
        scale = max(float(b.norm()), floor * largest, 1e-300)
        errors[name] = float((a - b).norm()) / scale
    return errors


def assert_grads_close(got, want, bound: float, floor: float = 1e-9) -> dict[str, float]:
    """Every parameter's gradient within ``bound`` relative of ``want``'s (``grad_errors``),
    the worst parameter named when one is not. ``bound`` is below 1: a zero gradient is
    1 off, a sign-flipped one 2, so neither passes, however small the parameter. Returns
    the errors by name."""
    assert 0 <= bound < 1, f"a bound of {bound} passes a zero gradient"
    errors = grad_errors(got, want, floor)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= bound, (
        f"{worst}: gradient error {errors[worst]:.3g} > {bound:g} "
        f"({sum(e > bound for e in errors.values())} of {len(errors)} parameters over)"
    )
    return errors


def generated_text(
    model: str | Path,
    options: Options | None = None,
    label: str | None = None,
    readable: bool = False,
) -> str:
    """The module ``generate_source`` (a path) or ``generate_from_text`` (a text, labelled
    ``label``, default ``<string>``) generates under ``options`` but, unless
    ``readable=True``, not laid out by black (``render(readable=False)``): for a test that
    runs the module and never reads it (black is most of a render's time)."""
    from unroller.api import compression_config, graph_from_text, load_graph, render, source_label

    options = options or Options()
    if isinstance(model, Path):
        graph, label = load_graph(model, options.resolution), label or source_label(model)
    else:
        label = label or "<string>"
        graph = graph_from_text(model, label, options.resolution)
    return render(graph, label, options, compression_config(options, graph), readable=readable)


@pytest.fixture
def build(tmp_path):
    """build(path_or_text, scheme=...) -> generated module, imported from a temp file. The
    module is rendered as ``generate_source`` / ``generate_from_text`` render it but, unless
    ``readable=True``, not laid out by black (``render(readable=False)``, as verify's and
    the planner's modules are): black is most of a render's time, and a test that only runs
    the module does not read it (the golden files, the CLI and the generate tests check the
    formatted text). A test that reads the module's text passes ``readable=True``."""
    counter = {"n": 0}

    def _build(model: str | Path, options: Options | None = None, readable: bool = False, **kwargs):
        options = options or Options(**kwargs)
        text = generated_text(model, options, readable=readable)
        counter["n"] += 1
        out = tmp_path / f"gen_{counter['n']}.py"
        write_atomic(out, text)
        return import_generated(out, f"gen_{tmp_path.name}_{counter['n']}")

    return _build
