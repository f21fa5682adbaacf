"""The cache never runs code it did not check.

One-shot ``unroller.unroll`` keeps generated modules in ``$UNROLLER_CACHE_DIR/generated``
and the native kernels in ``.../native``; both are code this process runs. Reproducers:

- a ``.pyc`` planted in the cache's ``__pycache__`` (valid for the entry's size and time
  stamp, so Python's importer would have run it) is never run: the checked text is
  compiled in memory; nor is a ``__pycache__`` written;
- a symbolic link in an entry's place is refused, its target untouched; a FIFO there (or
  where the byte code would be) is refused without hanging;
- a cache folder others can write to, or another user's, is refused in the words the
  native-kernel cache uses;
- the generated cache keeps its bound, least recently used evicted;
- ``unroll cache clean`` removes entries only; ``info`` shows where and how much;
- the native build is announced once, and can be done ahead of time.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
import threading
import traceback
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unroller import cache
from unroller.cli import app
from unroller.compress import native
from unroller.files import PathError
from unroller.materialize import digest, load_source

runner = CliRunner()
SOURCE = "x = 1\n\ndef where():\n    return 1 / 0\n"


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A cache of this test's own (``UNROLLER_CACHE_DIR``), with default bounds."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("UNROLLER_CACHE_DIR", str(folder))
    monkeypatch.delenv("UNROLLER_CACHE_MAX_ENTRIES", raising=False)
    monkeypatch.delenv("UNROLLER_CACHE_MAX_MB", raising=False)
    return folder


def _load(source: str = SOURCE, label: str = "m", name: str = "test_cache_mod"):
    """Load ``source`` the way ``unroller.unroll`` does: into the generated cache, under
    its digest (the folder is recognised as the cache)."""
    return load_source(
        source, cache.generated_dir(), f"{label}_{{digest}}.py", f"{name}_{{digest}}"
    )


def _entry(source: str = SOURCE, label: str = "m") -> Path:
    return cache.generated_dir() / f"{label}_{digest(source)}.py"


def _plant_pyc(entry: Path, marker: Path) -> Path:
    """A byte-code file that Python's importer would take for ``entry`` (its size and
    time stamp match), whose code writes ``marker``."""
    code = compile(f"open({str(marker)!r}, 'w').write('ran')\nx = 666\n", str(entry), "exec")
    info = entry.stat()
    data = importlib._bootstrap_external._code_to_timestamp_pyc(  # type: ignore[attr-defined]
        code, int(info.st_mtime), info.st_size
    )
    pyc = Path(importlib.util.cache_from_source(str(entry)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(data)
    return pyc


def _in_time(call, seconds: float = 20.0):
    """``call()``'s result or exception, or a failure if it blocks past ``seconds`` (the
    thread is a daemon: a hang fails the test instead of the run)."""
    box: dict = {}

    def target():
        try:
            box["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    return box


def test_a_planted_pyc_is_never_run(root, tmp_path):
    marker = tmp_path / "marker"
    first = _load(name="test_cache_first")
    pyc = _plant_pyc(first.path, marker)
    sys.modules.pop(first.module.__name__, None)
    again = _load(name="test_cache_again")
    assert again.module.x == 1 and not marker.exists()
    pyc.unlink()
    pyc.parent.rmdir()
    _load(name="test_cache_third")
    assert not (first.path.parent / "__pycache__").exists()  # none written either


def test_a_planted_pyc_is_not_run_by_unroll(root, tmp_path):
    """End to end: ``unroller.unroll`` into the default cache, a pyc planted for its
    entry, the next ``unroll`` in a fresh module name runs the checked text."""
    import torch

    import unroller

    marker = tmp_path / "marker"
    net, x, y = torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.randn(2, 4), torch.tensor([0, 2])
    step = unroller.unroll(net, x, y, name="cache_probe")
    assert step.source_path.parent == cache.generated_dir()
    _plant_pyc(step.source_path, marker)
    sys.modules.pop(f"unroller_unrolled_cache_probe_{digest(step.source)}", None)
    again = unroller.unroll(net, x, y, name="cache_probe")
    assert torch.isfinite(again(x, y)) and not marker.exists()


def test_tracebacks_and_getsource_show_the_text_that_ran(root):
    loaded = _load(name="test_cache_trace")
    loaded.path.write_text("# changed after the import\n" * 10, encoding="utf-8")
    assert inspect.getsource(loaded.module.where) == "def where():\n    return 1 / 0\n"
    with pytest.raises(ZeroDivisionError) as caught:
        loaded.module.where()
    text = "".join(traceback.format_exception(caught.value))
    assert str(loaded.path) in text and "return 1 / 0" in text


def test_a_symlinked_entry_is_not_followed(root, tmp_path):
    precious = tmp_path / "precious.py"
    precious.write_text("keep me\n", encoding="utf-8")
    cache.prepare(cache.generated_dir())
    _entry().symlink_to(precious)
    with pytest.raises(PathError, match="symbolic link") as caught:
        _load(name="test_cache_link")
    assert "\n" not in str(caught.value) and "unroller cache" in str(caught.value)
    assert precious.read_text(encoding="utf-8") == "keep me\n"
    assert _entry().is_symlink()


def test_a_fifo_entry_is_refused_without_hanging(root):
    cache.prepare(cache.generated_dir())
    os.mkfifo(_entry())
    box = _in_time(lambda: _load(name="test_cache_fifo"))
    assert isinstance(box.get("error"), PathError), box
    assert "named pipe (FIFO)" in str(box["error"]) and "\n" not in str(box["error"])


def test_a_fifo_where_byte_code_would_be_is_never_opened(root):
    first = _load(name="test_cache_fifo_pyc_first")
    pyc = Path(importlib.util.cache_from_source(str(first.path)))
    pyc.parent.mkdir()
    os.mkfifo(pyc)
    box = _in_time(lambda: _load(name="test_cache_fifo_pyc"))
    assert box["result"].module.x == 1


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_cache_folder_others_can_write_is_refused(root, mode):
    folder = cache.generated_dir()
    folder.mkdir(parents=True)
    folder.chmod(mode)
    with pytest.raises(PathError, match="writable by others or not ours") as caught:
        _load(name="test_cache_shared")
    assert str(caught.value) == f"cache folder {folder} is writable by others or not ours"
    assert list(folder.iterdir()) == []


def test_the_words_are_the_native_caches_words(root, monkeypatch):
    """Both caches refuse alike (one helper): the native kernels' folder too."""
    folder = cache.native_dir()
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    monkeypatch.setattr(native, "_build", lambda cxx, target: target.write_bytes(b"x"))
    if native.compiler() is None:
        pytest.skip("no C++ compiler: the native cache is never reached")
    with pytest.raises(OSError) as caught:
        native.build()
    assert str(caught.value) == f"cache folder {folder} is writable by others or not ours"


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs chown")
def test_another_users_cache_folder_is_refused(root):
    folder = cache.generated_dir()
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, 4242, 4242)
    with pytest.raises(PathError, match="writable by others or not ours"):
        _load(name="test_cache_theirs")


def test_eviction_keeps_the_bound_least_recently_used_first(root, monkeypatch):
    monkeypatch.setenv("UNROLLER_CACHE_MAX_ENTRIES", "3")
    sources = [f"x = {i}\n" for i in range(5)]
    for i, source in enumerate(sources[:3]):
        _load(source, name=f"test_cache_evict{i}")
        os.utime(_entry(source), ns=(10**18 + i, 10**18 + i))  # 0 oldest, 2 newest
    _load(sources[0], name="test_cache_evict_hit")  # a hit: 0 is now the most recent
    for i, source in enumerate(sources[3:], start=3):
        _load(source, name=f"test_cache_evict{i}")
    kept = {p.name for p in cache.generated_dir().iterdir()}
    assert kept == {_entry(s).name for s in (sources[0], sources[3], sources[4])}


def test_eviction_by_size(root, monkeypatch):
    monkeypatch.setenv("UNROLLER_CACHE_MAX_MB", "1")
    big = ["# " + str(i) * 600_000 + "\n" for i in range(3)]
    for i, source in enumerate(big):
        _load(source, name=f"test_cache_big{i}")
    assert [p.name for p in cache.generated_dir().iterdir()] == [_entry(big[2]).name]


def test_a_bad_bound_is_one_clear_error(root, monkeypatch):
    monkeypatch.setenv("UNROLLER_CACHE_MAX_ENTRIES", "lots")
    with pytest.raises(ValueError, match="UNROLLER_CACHE_MAX_ENTRIES='lots'"):
        _load(name="test_cache_badbound")


def test_cache_clean_removes_entries_only(root, tmp_path):
    first = _load(name="test_cache_clean")
    second = _load("y = 2\n", name="test_cache_clean2")
    folder = first.path.parent
    notes = folder / "notes.txt"
    notes.write_text("mine\n", encoding="utf-8")
    outside = tmp_path / "outside_0123456789abcdef0123.py"
    outside.write_text("not ours\n", encoding="utf-8")
    link = folder / f"l_{'a' * 20}.py"
    link.symlink_to(outside)
    pyc = Path(importlib.util.cache_from_source(str(first.path)))
    pyc.parent.mkdir()
    pyc.write_bytes(b"stale")
    result = runner.invoke(app, ["cache", "clean"])
    assert result.exit_code == 0, result.output
    assert not first.path.exists() and not second.path.exists() and not pyc.parent.exists()
    assert notes.read_text(encoding="utf-8") == "mine\n" and link.is_symlink()
    assert outside.read_text(encoding="utf-8") == "not ours\n"
    assert (
        "removed 3 files" in result.output and "a symbolic link, not a cache entry" in result.output
    )


def test_cache_info_says_where_and_how_much(root):
    _load(name="test_cache_info")
    result = runner.invoke(app, ["cache", "info"])
    assert result.exit_code == 0, result.output
    assert f"generated: {cache.generated_dir()}: 1 entries" in result.output
    assert "least recently used" in result.output


def test_cache_clean_refuses_a_shared_folder(root):
    folder = cache.generated_dir()
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    result = runner.invoke(app, ["cache", "clean"])
    assert result.exit_code == 2
    assert "writable by others or not ours" in result.output


@pytest.fixture
def fresh_native(monkeypatch):
    """native as in a new process, building nothing real: ``_build`` writes a stub."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    saved = dict(native._state)
    native._state.clear()
    built = []

    def fake_build(cxx, target):
        built.append(target)
        target.write_bytes(b"stub")

    monkeypatch.setattr(native, "_build", fake_build)
    yield built
    native._state.clear()
    native._state.update(saved)


def test_the_native_build_is_announced_once(root, fresh_native, caplog):
    caplog.set_level(logging.WARNING, logger="unroller.native")
    first = native.build()
    second = native.build()
    assert first == second and len(fresh_native) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "unroller.native"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "once" in lines[0] and str(cache.native_dir()) in lines[0]


def test_the_native_kernels_can_be_built_ahead(root, fresh_native):
    result = runner.invoke(app, ["cache", "build-native"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(".so") and len(fresh_native) == 1
    assert Path(result.output.strip().splitlines()[-1]).parent == cache.native_dir()
