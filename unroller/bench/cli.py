"""One command line for every preset: the suite by default, ``core``, ``compress``,
``scaling``, ``lora_llama``.

``unroll bench ARGS``, ``make bench`` and the ``python -m benchmarks.X`` scripts all come
here, so each preset has one parser and one set of defaults whichever way it is called.
A first argument naming a preset picks it; a command line with ``--pipeline`` or
``--data-parallel`` goes to ``scaling`` (``unroll bench --pipeline 2``); anything else goes
to the suite (the report ``make bench`` writes).

An exception that escapes a preset (a bug, not a bad argument: those exit 2) is one
``internal error`` line on standard error naming a log file with its traceback, exit
status 70 (``unroller.crash``); ``UNROLL_DEBUG=1`` (or ``unroll --debug bench``) lets it
through. Ctrl-C stays a ``KeyboardInterrupt``.
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


def _lora(argv: Sequence[str], prog: str) -> int:
    from unroller.bench import lora

    return lora.main(argv, prog)


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
    "lora_llama": _lora,
}


def run(argv: Sequence[str], prog: str = "unroll bench") -> int:
    """Dispatch ``argv`` to its preset; ``prog`` is how the command was called (it goes
    into usage lines, error messages and the results' ``command``). An internal error is
    one line and a log file, status ``crash.INTERNAL_ERROR``."""
    from unroller import crash

    argv = list(argv)
    try:
        return _dispatch(argv, prog)
    except Exception as exc:
        if crash.debugging():
            raise
        unroll = prog.split()[0] == "unroll"
        rerun = "--debug (unroll --debug bench ...)" if unroll else f"{crash.DEBUG_ENV}=1"
        return crash.report(exc, " ".join([prog, *argv]), "unroll" if unroll else prog, rerun)


def _dispatch(argv: list[str], prog: str) -> int:
    """The preset ``argv`` names, run."""
    if argv and argv[0] in PRESETS:
        return PRESETS[argv[0]](argv[1:], f"{prog} {argv[0]}")
    if _wants_scaling(argv):
        return _scaling(argv, prog)
    return _suite(argv, prog)
