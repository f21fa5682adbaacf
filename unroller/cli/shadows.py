"""What ``import`` would load instead of a checked ``.py`` file, for ``unroll check``.

A checked module is only worth checking if importing it runs it. Python's path finder
prefers, beside ``a.py``: a package folder ``a/`` with an ``__init__`` of any importable
kind (even an empty ``__init__.py``), and an extension module (``a.so``,
``a.cpython-311-x86_64-linux-gnu.so``); and it runs ``__pycache__/a.TAG.pyc`` instead of
the source whenever that cache's header matches the source (modification time and size,
or a source hash; an "unchecked" hash-based cache is never compared at all), which anyone
can forge. So check reports: such a package or extension module; a cache this Python
would use whose code differs from what the source compiles to (a cache import would
ignore, or one equal to the source's code, is fine: Python writes those itself); a cache
for another Python, which this one cannot compile for; and byte code or extension
modules outside ``__pycache__``, which are modules of their own that unroller never
writes. Reading a cache unmarshals it, as ``import`` itself would.
"""

from __future__ import annotations

import _imp
import importlib.machinery
import importlib.util
import marshal
import os
import sys
from pathlib import Path

from unroller.api import read_bounded

BYTECODE_SUFFIXES = tuple(importlib.machinery.BYTECODE_SUFFIXES)  # ('.pyc',)
EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
INIT_NAMES = tuple(f"__init__{suffix}" for suffix in importlib.machinery.all_suffixes())


def importable_kind(name: str) -> str | None:
    """'byte code' or 'an extension module' for a file import can load that is not a
    ``.py`` file, else None."""
    if name.endswith(BYTECODE_SUFFIXES):
        return "byte code"
    if name.endswith(EXTENSION_SUFFIXES):
        return "an extension module"
    return None


def shadow_problem(path: Path) -> str | None:
    """Why ``import`` would not run the checked ``path`` (a ``.py`` file), or None."""
    stem = path.name[: -len(".py")]
    package = path.with_name(stem)
    if package.is_dir():
        for init in INIT_NAMES:
            if (package / init).exists():
                return (
                    f"shadowed: {package}/ is a package ({init}), which import loads "
                    f"instead of {path.name}"
                )
    for suffix in EXTENSION_SUFFIXES:
        if path.with_name(stem + suffix).exists():
            return (
                f"shadowed: {path.with_name(stem + suffix)} is an extension module, which "
                f"import loads instead of {path.name}"
            )
    caches = path.parent / "__pycache__"
    try:
        names = sorted(os.listdir(caches)) if caches.is_dir() else []
    except OSError:
        names = []
    for name in names:
        if name.startswith(f"{stem}.") and name.endswith(BYTECODE_SUFFIXES):
            problem = cache_problem(caches / name, path)
            if problem:
                return problem
    return None


def cache_problem(cache: Path, source: Path) -> str | None:
    """Why the byte-code cache ``cache`` of ``source`` could run other code, or None."""
    parts = cache.name[len(source.stem) + 1 : -len(".pyc")].split(".")
    if parts[0] != sys.implementation.cache_tag:
        return (
            f"{cache} is byte code for another Python ({parts[0]}), which this one cannot "
            f"compare with {source.name}: delete it"
        )
    optimize = {"": 0, "opt-1": 1, "opt-2": 2}.get(".".join(parts[1:]))
    try:
        data, text = read_bounded(cache), read_bounded(source)
    except OSError as exc:
        return f"{cache}: cannot read it to compare with {source.name} ({exc})"
    if optimize is None or not _used_by_import(data, text, source):
        return None  # import ignores it and compiles the source
    try:
        code = marshal.loads(data[16:])
        expected = compile(text, str(source), "exec", dont_inherit=True, optimize=optimize)
    except (ValueError, EOFError, TypeError, SyntaxError):
        code, expected = None, True
    if code != expected:
        return (
            f"shadowed: {cache} is byte code that differs from {source.name}, and import "
            f"runs it instead of the source: delete it"
        )
    return None


def _used_by_import(data: bytes, text: bytes, source: Path) -> bool:
    """Whether import would load this cache rather than compile ``source``: the right
    magic number and valid flags, and a header that matches the source (or an unchecked
    hash-based cache, which is never compared)."""
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(data[4:8], "little")
    if flags & ~0b11:
        return False
    if flags & 0b1:  # hash-based
        checked = (flags & 0b10 and _imp.check_hash_based_pycs != "never") or (
            _imp.check_hash_based_pycs == "always"
        )
        return not checked or data[8:16] == importlib.util.source_hash(text)
    info = os.stat(source)
    mtime = (int(info.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
    size = (info.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    return data[8:12] == mtime and data[12:16] == size
