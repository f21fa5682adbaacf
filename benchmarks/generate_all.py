"""`make generate`: regenerate every checked-in file under generated/.

One file per benchmark model, platform and scheme, at
generated/<platform>/<model>/<scheme>.py. `unroll check generated` (run by `make test`)
fails when any of them differs from what the generator emits now.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from unroller.api import generate_source, write_atomic
from unroller.codegen import PLATFORMS, SCHEMES, Options

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"
GENERATED = ROOT / "generated"


def targets() -> list[tuple[Path, Options, Path]]:
    """(model file, options, output path) for every file that belongs under generated/."""
    found = []
    for model in sorted(MODELS.glob("*.txt")):
        for platform in PLATFORMS:
            for scheme in SCHEMES:
                out = GENERATED / platform / model.stem / f"{scheme}.py"
                found.append((model, Options(platform=platform, scheme=scheme), out))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)
    for model, options, out in targets():
        label = model.relative_to(ROOT).as_posix()
        text = generate_source(model, options, label=label)
        if not out.exists() or out.read_text(encoding="utf-8") != text:
            write_atomic(out, text)
            print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
