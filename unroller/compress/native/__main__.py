"""``python -m unroller.compress.native``: build the native codec kernels now (at install
or image build time), so no training step waits for them; prints the library's path.
Exit 1 when they cannot be built (why, on standard error), 2 when ``UNROLLER_NATIVE``
turns them off."""

from __future__ import annotations

import logging
import sys

from unroller.compress import native


def main() -> int:
    """Build (or find) the library; the status says how it went."""
    logging.basicConfig(format="%(message)s")
    if not native.enabled():
        print("unroller: UNROLLER_NATIVE turns the native kernels off", file=sys.stderr)
        return 2
    try:
        path = native.build()
    except OSError as exc:
        print(f"unroller: the native kernels cannot be built: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
