"""Optional native CPU kernels for ``quant``, ``dct`` and ``fewbit``, compiled on first use and
cached on disk.

Why: the pure-PyTorch fast path of ``quant`` makes several passes over each block (min/max,
subtract, divide, round, clamp, cast, pack), so its round trip runs well below a copy's
bandwidth. ``quant_kernels.cpp`` does quantise + pack and unpack + dequantise in one pass
per group, with results bit-identical to the PyTorch formulations (the tests compare them).
``dct_kernels.cpp`` pads, transforms, chops and quantises one plane at a time (int8 storage,
float32 work), and back; its results equal the PyTorch formulation's up to float rounding
(its products are not BLAS's: see that file and ``Dct``). ``fewbit_kernels.cpp`` codes and
packs ``fewbit``'s interval codes, and decodes them, bit-identically.

It is an accelerator, never a requirement: nothing here is needed for correctness, and
when the library cannot be had (no C++ compiler, a failed build, a platform whose byte
order or ``ctypes`` differ, ``UNROLLER_NATIVE=0``) ``library()`` returns None and the
callers run the PyTorch fast path. The source has no PyTorch headers (a plain shared
library called through ``ctypes``), so a build takes seconds, not the minute that
``torch.utils.cpp_extension`` needs, and it is done once per source, compiler and
machine type.

Cache: ``$UNROLLER_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/unroller``, else
``~/.cache/unroller``; the library lies in its ``native/`` folder under a name holding a
hash of the source, the compiler's identity and the flags, so an edited source or another
compiler builds anew and stale files are never loaded. The build writes to a temporary
name and renames it, so concurrent processes (test workers) never load a half-written
file. Compiler: ``$CXX`` if set, else the first of ``c++``, ``g++``, ``clang++`` found.
The folder must be ours and private (``files.private_folder_problem``: a library loaded
from it runs in this process), in the words the generated-code cache uses too.

The build is announced: a first compressed step on a new machine would otherwise sit
silent for up to a minute (44 s on an idle 2-core machine). One ``WARNING`` of the
``unroller.native`` logger says what is built, where it is kept and that it happens once
(Python prints it on standard error when logging is not configured; silence it with
``logging.getLogger("unroller.native").setLevel(logging.ERROR)``). Build ahead of time,
at install or image build: ``unroll cache build-native`` or
``python -m unroller.compress.native`` (``build()``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from unroller import cache as cache_rules
from unroller.files import private_folder_problem

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ABI_VERSION",
    "SOURCES",
    "build",
    "build_error",
    "cache_dir",
    "compiler",
    "enabled",
    "library",
]

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("native_common.h", "quant_kernels.cpp", "dct_kernels.cpp", "fewbit_kernels.cpp")
)
"""Everything the library is built from (the header first: it is included, not compiled)."""
ABI_VERSION = 5
"""What ``uq_abi_version()`` must return: a library of another version is not used."""
FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    # one IEEE operation per source operation: no fused multiply-add, no reassociation
    "-ffp-contract=off",
    "-fno-fast-math",
)
BUILD_TIMEOUT_S = 300

log = logging.getLogger("unroller.native")
"""Announces a build (see the module docstring)."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the CDLL or None once tried; "error": why not


def enabled() -> bool:  # unroller-lint: host-only (native path)
    """False when ``UNROLLER_NATIVE`` is ``0``, ``false``, ``no`` or ``off``: the native
    kernels are then never built or loaded."""
    return os.environ.get("UNROLLER_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:  # unroller-lint: host-only (native path)
    """Where built libraries are kept (see the module docstring)."""
    return cache_rules.native_dir()


def compiler() -> str | None:  # unroller-lint: host-only (native path)
    """The C++ compiler to build with, or None when there is none."""
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler_identity(cxx: str) -> str:  # unroller-lint: host-only (native path)
    """The compiler's path and ``--version`` text (part of the cache key)."""
    try:
        out = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx}\n{out}"


def _key(cxx: str, source: bytes) -> str:  # unroller-lint: host-only (native path)
    """Hash of everything the built library depends on."""
    h = hashlib.sha256()
    for part in (
        source,
        _compiler_identity(cxx).encode(),
        " ".join(FLAGS).encode(),
        f"{sys.platform} {platform.machine()} {ABI_VERSION}".encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _check_dir(path: Path) -> None:  # unroller-lint: host-only (native path)
    """OSError unless ``path`` is a folder of ours that others cannot write into (a
    library loaded from it runs in this process): ``files.private_folder_problem``."""
    problem = private_folder_problem(path)
    if problem is not None:
        raise OSError(problem)


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:  # unroller-lint: host-only (native path)
    """Hold an exclusive lock on ``folder/.lock`` (where ``fcntl`` exists), so that processes
    starting together build once and the others wait for that build instead of compiling
    the same source again. Without ``fcntl`` each builds; the rename keeps that safe."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if fcntl is None:
        yield
        return
    with open(folder / ".lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _build(cxx: str, target: Path) -> None:  # unroller-lint: host-only (native path)
    """Compile the source into ``target`` (atomically: a temporary file, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_dir(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cxx, *FLAGS, *(str(p) for p in SOURCES if p.suffix == ".cpp"), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise OSError(f"{Path(cxx).name} failed: {result.stderr.strip()[-800:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:  # unroller-lint: host-only (native path)
    """Argument and result types of the entry points (pointers passed as integers)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.uq_abi_version.restype = i32
    lib.uq_abi_version.argtypes = []
    for name in ("uq_encode_f32", "uq_encode_f64"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [p, p, i64, i64, i64, i32, p, p, p, i32]
    for name in ("uq_decode_f32", "uq_decode_f64"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [p, p, p, i64, i64, i64, i32, p, i32]
    lib.ud_compress_f32.restype = i32
    lib.ud_compress_f32.argtypes = [p, i64, i64, i64, i64, i64, i32, p, p, p, p, i32]
    lib.ud_decompress_f32.restype = i32
    lib.ud_decompress_f32.argtypes = [p, p, i64, i64, i64, i64, i64, i32, p, p, p, i32]
    for name in ("ufb_encode_f32", "ufb_encode_f64"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [p, i64, i64, p, i32, i32, i32, p, p, i32]
    for name in ("ufb_decode_f32", "ufb_decode_f64"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [p, p, i64, i64, i32, i32, p, p, i32]
    lib.uq_set_generic.restype = None
    lib.uq_set_generic.argtypes = [i32]
    lib.ufb_set_generic.restype = None
    lib.ufb_set_generic.argtypes = [i32]


def build() -> Path:  # unroller-lint: host-only (native path)
    """The library file, built now unless it already is (``unroll cache build-native``,
    ``python -m unroller.compress.native``: ahead of time, so no training step waits for
    it); OSError says why it cannot be."""
    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
        raise OSError("the native kernels expect a little-endian 64-bit platform")
    cxx = compiler()
    if cxx is None:
        raise OSError("no C++ compiler found (set CXX, or install g++ or clang++)")
    source = b"\0".join(p.read_bytes() for p in SOURCES)
    target = cache_dir() / f"kernels-{_key(cxx, source)}.so"
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_dir(target.parent)
    if not _is_file(target):
        with _build_lock(target.parent):  # one build at a time (test workers start together)
            if not _is_file(target):
                _announce(cxx, target)
                _build(cxx, target)
    _check_dir(target.parent)
    if not _is_file(target):
        raise OSError(f"{target} is not a regular file")
    return target


def _announce(cxx: str, target: Path) -> None:  # unroller-lint: host-only (native path)
    """One line before a build: what, where it is kept, that it happens once (a silent
    minute on a first compressed step looks like a hang)."""
    log.warning(
        "unroller: building the native codec kernels with %s, once per machine and "
        "compiler (up to a minute); kept in %s (build ahead: unroll cache build-native)",
        Path(cxx).name,
        target.parent,
    )


def _is_file(path: Path) -> bool:  # unroller-lint: host-only (native path)
    """Whether ``path`` is a regular file itself (a link is not: it is never loaded)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _load() -> ctypes.CDLL:  # unroller-lint: host-only (native path)
    """Build if needed, then load and check the library; OSError says why not."""
    target = build()
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    version = lib.uq_abi_version()
    if version != ABI_VERSION:
        raise OSError(f"{target} has ABI version {version}, expected {ABI_VERSION}")
    return lib


def library() -> ctypes.CDLL | None:  # unroller-lint: host-only (native path)
    """The loaded kernels, building them on first use; None when they cannot be had (why:
    ``build_error()``) or ``enabled()`` is False. Tried once per process, ``UNROLLER_NATIVE``
    read then too: every codec call on the CPU asks, and an environment lookup per call was
    a tenth of a small codec call's time."""
    state = _state.get("lib", _state)
    if state is not _state:
        return state  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            if not enabled():
                _state["lib"] = None
                _state["error"] = "UNROLLER_NATIVE turns the native kernels off"
                return None
            try:
                _state["lib"] = _load()
            except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                _state["lib"] = None
                _state["error"] = f"{type(exc).__name__}: {exc}"
    return _state["lib"]  # type: ignore[return-value]


def build_error() -> str | None:  # unroller-lint: host-only (native path)
    """Why ``library()`` returned None (after it was called), else None."""
    return _state.get("error")  # type: ignore[return-value]
