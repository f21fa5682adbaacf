"""`python -m benchmarks.codec_ab --old REV`: the native codecs of this checkout against
those of another revision, in one process, on the inputs of docs/compressors.md.

Why one process: on a shared VM the speed drifts between runs by more than a kernel change
moves it, so the two libraries take turns, configuration by configuration and run by run,
each timed by ``bench_codec`` against ``torch.clone`` of the same tensor (one thread).

The older kernels are read from ``git show REV:unroller/compress/native/<file>`` into a
temporary folder and built like this checkout's (cached by their hash). Entry points the
older library lacks are stubbed, so its ABI check passes; it only runs what both have.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unroller.bench.codec_bench import activation_tensor, bench_codec
from unroller.compress import native

ROOT = Path(__file__).resolve().parent.parent
STUBS = {"ufb_set_generic": '\nextern "C" void ufb_set_generic(int) {}\n'}
"""Entry points added since older revisions: a no-op, so that ``native._declare`` passes."""


def old_library(rev: str, folder: Path) -> Any:
    """The native library built from revision ``rev``'s kernel sources."""
    paths = []
    for path in native.SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        text = subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        paths.append(folder / path.name)
        paths[-1].write_text(text)
    fewbit = folder / "fewbit_kernels.cpp"
    for name, stub in STUBS.items():
        if fewbit.exists() and name not in fewbit.read_text():
            fewbit.write_text(fewbit.read_text() + stub)
    abi = 0
    for path in paths:
        for line in path.read_text().splitlines():
            if "uq_abi_version()" in line and "return" in line:
                abi = int(line.split("return")[1].split(";")[0])
    saved = (native.SOURCES, native.ABI_VERSION)
    native.SOURCES, native.ABI_VERSION = tuple(paths), abi
    try:
        return native._load()
    finally:
        native.SOURCES, native.ABI_VERSION = saved


def inputs() -> dict[str, torch.Tensor]:
    """The map of the codec bench and two token tensors (layer-normed, through nn.Linear)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        torch.manual_seed(0)
        tok = nn.Linear(768, 768)(F.layer_norm(torch.randn(32, 256, 768, generator=g), (768,)))
    return {"map": activation_tensor((16, 64, 64, 64), 0), "tokens": tok}


CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("map", "dct", {}),
    ("map", "dct", {"fold": True}),
    ("map", "fewbit", {"bits": 3}),
    ("tokens", "fewbit", {"bits": 3}),
    ("tokens", "quant", {"bits": 8}),
    ("tokens", "quant", {"bits": 4}),
    ("map", "quant", {"bits": 8}),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codec_ab", description=__doc__)
    parser.add_argument("--old", required=True, help="git revision of the older kernels")
    parser.add_argument("--runs", type=int, default=3, help="turns of each library")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per turn")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    new = native.library()
    if new is None:
        print(f"no native kernels: {native.build_error()}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        old = old_library(args.old, Path(tmp))
    tensors = inputs()
    rows: dict[tuple[str, str, str, str], list[str]] = {}
    for _ in range(args.runs):
        for kind, name, params in CONFIGS:
            for tag, lib in (("old", old), ("new", new)):
                native._state["lib"] = lib
                r = bench_codec(kind, name, params, tensors[kind], 2, args.rounds, compiled=False)
                t = r["time_ms"]
                rows.setdefault((kind, name, str(params), tag), []).append(
                    f"{r['ratio_to_clone']['median']:.2f} ({t['compress']['median']:.2f} + "
                    f"{t['decompress']['median']:.2f} ms; clone {t['clone']['median']:.2f})"
                )
    native._state["lib"] = new
    print(f"| input | codec | params | {args.old} | this checkout |")
    print("| --- | --- | --- | --- | --- |")
    for kind, name, params in CONFIGS:
        cells = [" / ".join(rows[(kind, name, str(params), tag)]) for tag in ("old", "new")]
        print(f"| {kind} | `{name}` | {params} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
