"""`make generate`: regenerate every checked-in file under generated/.

One file per benchmark model, platform and scheme, at
generated/<platform>/<model>/<scheme>.py. `unroll check generated` (run by `make test`)
fails when any of them differs from what the generator emits now.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from unroller.api import generate_source, load_graph, write_atomic
from unroller.codegen import PLATFORMS, SCHEMES, Options
from unroller.errors import ModelError

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"
TEST_MODELS = ROOT / "tests" / "models"
GENERATED = ROOT / "generated"
MULTI_IPU = (2, 4)
MULTI_IPU_SCHEMES = ("nocompress", "dct-dense")


def targets() -> list[tuple[Path, Options, Path]]:
    """(model file, options, output path) for every file that belongs under generated/.

    Benchmark models: every scheme on gpu and ipu, and 2 and 4 IPUs (pipelined) for
    nocompress and dct-dense under generated/multiipu/. Test models: the ipu code for
    nocompress and dct-dense under generated/ipu/tests/.
    """
    found = []
    for model in sorted(MODELS.glob("*.txt")):
        for platform in PLATFORMS:
            for scheme in SCHEMES:
                out = GENERATED / platform / model.stem / f"{scheme}.py"
                found.append((model, Options(platform=platform, scheme=scheme), out))
        for num_ipus in MULTI_IPU:
            for scheme in MULTI_IPU_SCHEMES:
                out = GENERATED / "multiipu" / model.stem / f"{scheme}-{num_ipus}ipu.py"
                options = Options(platform="ipu", scheme=scheme, num_ipus=num_ipus)
                found.append((model, options, out))
    for model in sorted(TEST_MODELS.glob("*.txt")):
        if not ipu_can_run(model):
            continue
        for scheme in MULTI_IPU_SCHEMES:
            out = GENERATED / "ipu" / "tests" / model.stem / f"{scheme}.py"
            found.append((model, Options(platform="ipu", scheme=scheme), out))
    return found


def ipu_can_run(model: Path) -> bool:
    """False for models the ipu platform refuses (e.g. dilated convolutions)."""
    from unroller.codegen import Emitter

    try:
        Emitter(load_graph(model), platform="ipu")
    except ModelError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)
    expected = set()
    for model, options, out in targets():
        expected.add(out)
        label = model.relative_to(ROOT).as_posix()
        text = generate_source(model, options, label=label)
        if not out.exists() or out.read_text(encoding="utf-8") != text:
            write_atomic(out, text)
            print(f"wrote {out.relative_to(ROOT)}")
    for stale in sorted(GENERATED.rglob("*.py")):
        if stale not in expected:
            stale.unlink()
            print(f"removed {stale.relative_to(ROOT)} (no longer generated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
