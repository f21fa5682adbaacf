"""One command line for every preset: the suite by default, ``core`` and ``compress``.

``unroll bench ARGS``, ``make bench`` and the ``python -m benchmarks.X`` scripts all come
here, so each preset has one parser and one set of defaults whichever way it is called.
A first argument naming a preset picks it; anything else goes to the suite (the report
``make bench`` writes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _suite(argv: Sequence[str], prog: str) -> int:
    from unroller.bench import suite

    return suite.main(argv, prog)


def _core(argv: Sequence[str], prog: str) -> int:
    from unroller.bench import core

    return core.main(argv, prog)


def _compress(argv: Sequence[str], prog: str) -> int:
    from unroller.bench import compress

    return compress.main(argv, prog)


PRESETS: dict[str, Callable[[Sequence[str], str], int]] = {
    "core": _core,
    "compress": _compress,
}


def run(argv: Sequence[str], prog: str = "unroll bench") -> int:
    """Dispatch ``argv`` to its preset; ``prog`` is how the command was called (it goes
    into usage lines, error messages and the results' ``command``)."""
    argv = list(argv)
    if argv and argv[0] in PRESETS:
        return PRESETS[argv[0]](argv[1:], f"{prog} {argv[0]}")
    return _suite(argv, prog)
