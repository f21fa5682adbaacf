"""One command line for every preset: the suite by default, ``core``, ``compress``, ``scaling``.

``unroll bench ARGS``, ``make bench`` and the ``python -m benchmarks.X`` scripts all come
here, so each preset has one parser and one set of defaults whichever way it is called.
A first argument naming a preset picks it; a command line with ``--pipeline`` or
``--data-parallel`` goes to ``scaling`` (``unroll bench --pipeline 2``); anything else goes
to the suite (the report ``make bench`` writes).
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


def _scaling(argv: Sequence[str], prog: str) -> int:
    from unroller.bench import scaling

    return scaling.main(argv, prog)


def _wants_scaling(argv: Sequence[str]) -> bool:
    """``--pipeline``/``--data-parallel`` (the suite has neither): the scaling preset. Read
    here, without importing it (it loads torch.distributed)."""
    flags = ("--pipeline", "--data-parallel")
    return any(a in flags or a.startswith(tuple(f"{f}=" for f in flags)) for a in argv)


PRESETS: dict[str, Callable[[Sequence[str], str], int]] = {
    "core": _core,
    "compress": _compress,
    "scaling": _scaling,
}


def run(argv: Sequence[str], prog: str = "unroll bench") -> int:
    """Dispatch ``argv`` to its preset; ``prog`` is how the command was called (it goes
    into usage lines, error messages and the results' ``command``)."""
    argv = list(argv)
    if argv and argv[0] in PRESETS:
        return PRESETS[argv[0]](argv[1:], f"{prog} {argv[0]}")
    if _wants_scaling(argv):
        return _scaling(argv, prog)
    return _suite(argv, prog)
