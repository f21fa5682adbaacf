"""One native kernel source built alone, as another machine's compiler would build it: for
one instruction-set level (no per-ISA clones), or without its vector-shuffle steps (what a
compiler without ``__builtin_shufflevector`` runs). The kernel tests compare such builds
with the library, bit for bit."""

from __future__ import annotations

import ctypes
import platform
import subprocess
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
    the compiler's default target), with the line ``#define <drop_define> 1`` removed."""
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
    flags = [*native_module.FLAGS] + ([f"-march={march}"] if march else [])
    subprocess.run(
        [native_module.compiler(), *flags, str(folder / source), "-o", str(target)],
        check=True,
        capture_output=True,
    )
    return ctypes.CDLL(str(target))


def variants(folder: Path, source: str, shuffle_define: str) -> list[ctypes.CDLL]:
    """Baseline x86-64, the compiler's default without shuffles, and AVX2 where this CPU
    can run it."""
    built = [
        build_variant(folder / "baseline", source, "x86-64"),
        build_variant(folder / "scalar", source, None, shuffle_define),
    ]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # else it cannot run
        built.append(build_variant(folder / "avx2", source, "x86-64-v3"))
    return built
