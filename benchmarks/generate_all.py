"""`make generate`: write the golden generated files; `--all`: every benchmark module too.

The golden set, checked in under generated/ and verified by `unroll check generated`
(which `make test` runs), is what catches a regression in the emitted code while staying
small enough to check in seconds:

* `quick` (benchmarks/models/quick.txt, a small ResNet) for every platform and scheme,
  and pipelined over 2 IPUs for nocompress and dct-dense;
* `all_ops` (tests/models/all_ops.txt: every operator, non-default arguments) and
  `fanout` (tests/models/fanout.txt: values with many consumers, repeated blocks,
  dropout p=0) on gpu and ipu for nocompress and dct-dense;
* `resnet34` on gpu for nocompress and dct-dense: the showcase a reviewer reads.

`--all` writes one module per benchmark model, platform and scheme (and 2 and 4 IPUs)
under build/generated/ (not checked in) for reading or running by hand; the benchmark
harness generates what it measures itself, in temporary directories.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from unroller.api import generate_source, write_atomic
from unroller.compiler.options import Options
from unroller.compiler.platforms import PLATFORMS
from unroller.compiler.schemes import SCHEMES

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"
TEST_MODELS = ROOT / "tests" / "models"
GENERATED = ROOT / "generated"
EVERYTHING = ROOT / "build" / "generated"
PIPELINE_SCHEMES = ("nocompress", "dct-dense")

Target = tuple[Path, Options, Path]


def targets() -> list[Target]:
    """(model file, options, output path) for every golden file under generated/."""
    quick = MODELS / "quick.txt"
    found = [
        (quick, Options(platform=p, scheme=s), GENERATED / p / "quick" / f"{s}.py")
        for p in PLATFORMS
        for s in SCHEMES
        if s != "auto"  # planned from a probe step's floats: not a byte-exact golden file
    ]
    for scheme in PIPELINE_SCHEMES:
        out = GENERATED / "multiipu" / "quick" / f"{scheme}-2ipu.py"
        found.append((quick, Options(platform="ipu", scheme=scheme, num_ipus=2), out))
    for stem in ("all_ops", "fanout"):
        for platform in PLATFORMS:
            for scheme in PIPELINE_SCHEMES:
                out = GENERATED / platform / stem / f"{scheme}.py"
                found.append((TEST_MODELS / f"{stem}.txt", Options(platform, scheme), out))
    for scheme in PIPELINE_SCHEMES:
        out = GENERATED / "gpu" / "resnet34" / f"{scheme}.py"
        found.append((MODELS / "resnet34.txt", Options(scheme=scheme), out))
    # spec v2: a vision transformer on both platforms, a language model with quant's
    # per-token codes and few-bit gelu derivatives
    for platform, scheme in (("gpu", "nocompress"), ("gpu", "quant"), ("ipu", "nocompress")):
        out = GENERATED / platform / "vit_tiny" / f"{scheme}.py"
        found.append((MODELS / "vit_tiny.txt", Options(platform, scheme), out))
    out = GENERATED / "gpu" / "gpt_tiny" / "quant.py"
    found.append((MODELS / "gpt_tiny.txt", Options(scheme="quant"), out))
    return found


def every_target(root: Path = EVERYTHING) -> list[Target]:
    """Every benchmark model for every platform and scheme, and 2 and 4 IPUs pipelined."""
    found = []
    for model in sorted(MODELS.glob("*.txt")):
        for platform in PLATFORMS:
            for scheme in SCHEMES:
                out = root / platform / model.stem / f"{scheme}.py"
                found.append((model, Options(platform=platform, scheme=scheme), out))
        for num_ipus in (2, 4):
            for scheme in PIPELINE_SCHEMES:
                out = root / "multiipu" / model.stem / f"{scheme}-{num_ipus}ipu.py"
                found.append((model, Options("ipu", scheme, num_ipus=num_ipus), out))
    return found


def write(found: list[Target], root: Path) -> None:
    """Write each target that differs; remove files under ``root`` no target names."""
    expected = set()
    for model, options, out in found:
        expected.add(out)
        label = model.relative_to(ROOT).as_posix()
        text = generate_source(model, options, label=label)
        if not out.exists() or out.read_text(encoding="utf-8") != text:
            write_atomic(out, text)
            print(f"wrote {out.relative_to(ROOT)}")
    for stale in sorted(root.rglob("*.py")):
        if stale not in expected:
            stale.unlink()
            print(f"removed {stale.relative_to(ROOT)} (no longer generated)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--all",
        action="store_true",
        help=f"also write every benchmark module under {EVERYTHING.relative_to(ROOT)}/",
    )
    args = parser.parse_args(argv)
    write(targets(), GENERATED)
    if args.all:
        write(every_target(), EVERYTHING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
