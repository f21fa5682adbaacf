"""Does a change to the compiler change any emitted text?

    python -m benchmarks.emitted_corpus --write build/corpus.json
    python -m benchmarks.emitted_corpus --check build/corpus.json

Renders every model file (benchmarks/models/ and tests/models/) for both platforms, every
built-in scheme and the option combinations that take other paths through the compiler
(recompute, segments, segments in pieces, data parallel, pipeline stages over processes,
two IPUs), unformatted (``render(..., readable=False)``: black would hide nothing that
differs before it), and records the SHA-256 of each module, or of the one-line refusal
where the combination is refused. ``--check`` compares with a recorded corpus and lists
every target whose text (or refusal) changed: a restructuring of the compiler should list
none. Complements ``benchmarks.equivalence``, which runs the modules of two revisions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from unroller.api import compression_config, load_graph
from unroller.compiler.codegen import render
from unroller.compiler.options import Options
from unroller.errors import ConfigError, ModelError

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIRS = (ROOT / "benchmarks" / "models", ROOT / "tests" / "models")
SCHEMES = ("nocompress", "dct-first", "dct-dense", "quant")


def variants() -> list[tuple[str, Options]]:
    """(label, options) for every combination rendered per model."""
    found: list[tuple[str, Options]] = []
    for platform in ("gpu", "ipu"):
        for scheme in SCHEMES:
            found.append((f"{platform}/{scheme}", Options(platform=platform, scheme=scheme)))
    extra = {
        "gpu/dct-dense+recompute": Options(scheme="dct-dense", recompute=True),
        "gpu/nocompress+blocks": Options(recompute_segments=("blocks",)),
        "gpu/dct-dense+blocks": Options(scheme="dct-dense", recompute_segments=("blocks",)),
        "gpu/quant+blocks+pieces": Options(
            scheme="quant", recompute_segments=("blocks",), segment_piece_size=2
        ),
        "gpu/nocompress+blocks+pieces2": Options(recompute_segments=("blocks",), segment_pieces=2),
        "gpu/dct-dense+dp": Options(scheme="dct-dense", data_parallel=True, bucket_bytes=4096),
        "gpu/dct-dense+pipeline2": Options(scheme="dct-dense", pipeline=2),
        "ipu/dct-dense+2ipus": Options(platform="ipu", scheme="dct-dense", num_ipus=2),
        "ipu/nocompress+blocks": Options(platform="ipu", recompute_segments=("blocks",)),
    }
    found.extend(extra.items())
    return found


def models() -> list[Path]:
    return sorted(p for d in MODEL_DIRS for p in d.glob("*.txt"))


def _digest(model: str) -> dict[str, str]:
    """Every variant's digest for one model file (one worker task)."""
    path = Path(model)
    graph = load_graph(path)
    found: dict[str, str] = {}
    for label, options in variants():
        try:
            config = compression_config(options, graph)
            text = render(graph, path.name, options, config, readable=False)
        except (ConfigError, ModelError) as exc:
            found[label] = "refused " + hashlib.sha256(str(exc).encode()).hexdigest()
            continue
        found[label] = hashlib.sha256(text.encode()).hexdigest()
    return found


def corpus(workers: int) -> dict[str, str]:
    paths = models()
    with ProcessPoolExecutor(workers) as pool:
        digests = list(pool.map(_digest, [str(p) for p in paths]))
    return {
        f"{p.relative_to(ROOT)}:{label}": digest
        for p, found in zip(paths, digests)
        for label, digest in found.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, help="record the corpus's digests here")
    action.add_argument("--check", type=Path, help="compare with a recorded corpus")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    found = corpus(args.workers)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        refused = sum(v.startswith("refused") for v in found.values())
        print(f"{len(found)} targets recorded in {args.write} ({refused} refused)")
        return 0
    recorded = json.loads(args.check.read_text())
    changed = sorted(k for k in recorded.keys() | found.keys() if recorded.get(k) != found.get(k))
    for key in changed:
        print(f"changed: {key}")
    print(f"{len(found)} targets, {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
