"""One native kernel source built alone, as another machine's compiler would build it: for
one instruction-set level (no per-ISA clones), or without its vector-shuffle steps (what a
compiler without ``__builtin_shufflevector`` runs). The kernel tests compare such builds
with the library, bit for bit."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from unroller.compress import native as native_module

x86_only = pytest.mark.skipif(
    not (native_module.compiler() and platform.machine() == "x86_64"),
    reason="x86-64 instruction-set levels",
)


def build_variant(
    folder: Path, source: str, march: str | None, drop_define: str | None = None
) -> ctypes.CDLL:
    """``source`` (a file of ``compress/native``) built into ``folder`` for ``march`` (None:
    the compiler's default target), with the line ``#define <drop_define> 1`` removed. A
    build (5-6 s of compiling) is kept in the tests' cache folder (``UNROLLER_CACHE_DIR``,
    which tests/conftest.py points at ``UNROLLER_TEST_CACHE_DIR``) under the hash of the
    texts, compiler and flags it was built from, so a later run loads it instead."""
    folder.mkdir(parents=True)
    here = native_module.SOURCES[0].parent
    header = (here / "native_common.h").read_text()
    start = header.index("#define UQ_CLONES \\")
    end = header.index("#else", start)
    (folder / "native_common.h").write_text(header[:start] + "#define UQ_CLONES\n" + header[end:])
    text = (here / source).read_text()
    if drop_define is not None:
        line = f"#define {drop_define} 1"
        assert line in text
        text = text.replace(line, "")
    (folder / source).write_text(text)
    target = folder / "kernels.so"
    cxx = native_module.compiler()
    flags = [*native_module.FLAGS] + ([f"-march={march}"] if march else [])
    key = hashlib.sha256(
        "\0".join(
            [
                (folder / "native_common.h").read_text(),
                text,
                native_module._compiler_identity(cxx),
                *flags,
            ]
        ).encode()
    ).hexdigest()[:32]
    kept = _variant_cache() / f"{Path(source).stem}-{key}.so"
    if kept.is_file():
        return ctypes.CDLL(str(kept))
    subprocess.run(
        [cxx, *flags, str(folder / source), "-o", str(target)], check=True, capture_output=True
    )
    with contextlib.suppress(OSError):  # no cache: the build in ``folder`` serves this run
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        shutil.copyfile(target, partial)
        os.replace(partial, kept)  # whole or absent, for another worker loading it
    return ctypes.CDLL(str(target))


def _variant_cache() -> Path:
    return Path(os.environ.get("UNROLLER_CACHE_DIR", tempfile.gettempdir())) / "native-variants"


def variants(folder: Path, source: str, shuffle_define: str) -> list[ctypes.CDLL]:
    """Baseline x86-64 and the compiler's default without shuffles; AVX2 where this CPU can
    run it and the library does not run that level already. On an AVX2 CPU (not AVX-512)
    the library calls its ``arch=x86-64-v3`` clone, the AVX2 build's code, which the tests
    compare with the library bit for bit: the AVX2 build there runs only with SLOW=1."""
    built = [
        build_variant(folder / "baseline", source, "x86-64"),
        build_variant(folder / "scalar", source, None, shuffle_define),
    ]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" or (capability == "AVX2" and os.environ.get("SLOW") == "1"):
        built.append(build_variant(folder / "avx2", source, "x86-64-v3"))
    return built
