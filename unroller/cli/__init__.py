"""The ``unroll`` command line: the typer app, and ``main`` (the console script).

Each command group lives in its own module and adds itself with ``register(app)``;
options that several commands take are built once from ``Options``'s fields in
``options``, error output in ``errors``. ``app`` and ``main`` are here, where the groups
meet; a command module needs neither.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

# Before torch loads: the profiler (kernel working memory in the memory model, measured
# peaks) would print two "USDT: ... profiler_start / profiler_stop" lines per profiled
# call on stderr, hundreds in one `unroll plan`.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import typer  # noqa: E402

from unroller import __version__, crash
from unroller.cli import (
    bench,
    cache,
    check,
    estimate,
    generate,
    imports,
    inspect,
    plan,
    train,
    verify,
)
from unroller.cli.errors import internal_errors, path_errors

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Generate PyTorch training code with an unrolled backward pass.\n\n"
    "Example: unroll generate models/quick.txt --platform gpu -o generated/gpu/quick/nocompress.py"
    " --mkdir",
    rich_markup_mode=None,
    pretty_exceptions_enable=False,  # an internal error is one line (errors.internal_errors)
)

# The order of --help's command list: generate, diff, check, graph, lint, ops, bench, train,
# accuracy, import, weights, verify, plan, estimate, cache.
for group in (generate, check, inspect, bench, train, imports, verify, plan, estimate, cache):
    group.register(app)
# An OSError naming a user path that escapes a command (a name too long, a link loop) is
# one `unroll: error:` line, whichever command and whichever path it was; any other
# exception (a bug) is one `unroll: internal error:` line and a log file, unless --debug.
for command_info in app.registered_commands:
    command_info.callback = internal_errors(path_errors(command_info.callback))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"unroller {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="An internal error (a bug) shows its full traceback instead of one line "
            f"and a log file (also: {crash.DEBUG_ENV}=1).",
        ),
    ] = False,
) -> None:
    """unroll: PyTorch code with an unrolled backward pass, for activation compression."""
    crash.set_debug(debug)


def main() -> None:
    """The ``unroll`` console script (pyproject.toml: ``unroller.cli:main``). An exception
    that escapes outside any command (while parsing the command line) is one line too."""
    try:
        app()
    except Exception as exc:
        if crash.debugging():
            raise
        sys.exit(crash.report(exc, " ".join(["unroll", *sys.argv[1:]])))


__all__ = ["app", "main"]
