"""The ``unroll`` command line: the typer app, and ``main`` (the console script).

Each command group lives in its own module and adds itself with ``register(app)``;
options that several commands take are declared once in ``options``, error output in
``errors``. No submodule imports this package's ``__init__``, so there is no import
cycle: ``app`` and ``main`` exist only here.
"""

from __future__ import annotations

from typing import Annotated

import typer

from unroller import __version__
from unroller.cli import bench, check, estimate, generate, imports, inspect, plan, train, verify
from unroller.cli.errors import path_errors

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Generate PyTorch training code with an unrolled backward pass.\n\n"
    "Example: unroll generate models/quick.txt --platform gpu -o generated/gpu/quick/nocompress.py"
    " --mkdir",
    rich_markup_mode=None,
)

# The order of --help's command list: generate, diff, check, graph, lint, ops, bench, train,
# accuracy, import, weights, verify, plan, estimate.
for group in (generate, check, inspect, bench, train, imports, verify, plan, estimate):
    group.register(app)
# An OSError naming a user path that escapes a command (a name too long, a link loop) is
# one `unroll: error:` line, whichever command and whichever path it was.
for command_info in app.registered_commands:
    command_info.callback = path_errors(command_info.callback)


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
) -> None:
    """unroll: PyTorch code with an unrolled backward pass, for activation compression."""


def main() -> None:
    """The ``unroll`` console script (pyproject.toml: ``unroller.cli:main``)."""
    app()


__all__ = ["app", "main"]
