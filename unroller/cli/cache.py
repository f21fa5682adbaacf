"""``unroll cache``: where the cache lies and what it holds, emptying it, and building the
native kernels ahead of time.

The cache (``unroller.cache``) holds one-shot ``unroller.unroll``'s generated modules and
the native codec kernels, code this process runs; both are rebuilt on demand, so
cleaning loses only time. ``clean`` removes entries only: regular files with an entry's
name (and their stale byte code or temporary files), never through a link, never
another file that happens to lie there.
"""

from __future__ import annotations

from typing import Annotated

import typer

from unroller import cache as cache_rules
from unroller.cli.errors import fail, internal_errors, path_errors
from unroller.files import PathError

cache_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="The cache of generated modules and native kernels: info, clean, build-native.",
)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def info() -> None:
    """Where the cache lies, how many entries it holds and their size, and its bounds."""
    try:
        max_entries, max_bytes = cache_rules.limits()
    except ValueError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"root: {cache_rules.root()}")
    for label, folder, pattern, bound in (
        ("generated", cache_rules.generated_dir(), cache_rules.ENTRY, True),
        ("native", cache_rules.native_dir(), cache_rules.LIBRARY, False),
    ):
        count, size, problem = cache_rules.usage(folder, pattern)
        line = f"{label}: {folder}: {count} entries, {_mib(size)}"
        if bound:
            line += f" (at most {max_entries} entries, {_mib(max_bytes)}; least recently used go)"
        typer.echo(line)
        if problem:
            typer.echo(f"  refused: {problem}")


def clean(
    native: Annotated[
        bool,
        typer.Option("--native", help="Also remove the built native kernels (rebuilt on use)."),
    ] = False,
) -> None:
    """Remove the cached generated modules (and with --native the built kernels): entries
    only, never through a link, never a file that is not an entry."""
    targets = [(cache_rules.generated_dir(), cache_rules.ENTRY)]
    if native:
        targets.append((cache_rules.native_dir(), cache_rules.LIBRARY))
    for folder, pattern in targets:
        try:
            done = cache_rules.clean(folder, pattern)
        except PathError as exc:
            raise fail(str(exc)) from None
        typer.echo(f"{folder}: removed {done.removed} files, {_mib(done.freed)}")
        for line in done.left or []:
            typer.echo(f"  left {line}")


def build_native() -> None:
    """Build the native codec kernels now (at install or image build time), so that no
    training step waits for them; prints the library's path."""
    from unroller.compress import native

    if not native.enabled():
        raise fail("UNROLLER_NATIVE turns the native kernels off")
    try:
        path = native.build()
    except OSError as exc:
        raise fail(f"the native kernels cannot be built: {exc}", code=1) from None
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """``unroll cache info|clean|build-native`` (each wrapped as the top-level commands
    are: one line for a path error or a bug)."""
    for command, name in ((info, "info"), (clean, "clean"), (build_native, "build-native")):
        cache_app.command(name)(internal_errors(path_errors(command)))
    app.add_typer(cache_app, name="cache")


__all__ = ["build_native", "clean", "info", "register"]
