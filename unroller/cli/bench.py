"""``unroll bench``: a thin door to the benchmark harness, ``unroller.bench``.

The harness parses its own arguments, so every argument (``--help`` included) is passed
through untouched. It is imported only when the command runs: it pulls in torch and the
reference models, which no other command needs.
"""

from __future__ import annotations

import typer

from unroller.cli.errors import fail

#: Lets every option reach the harness instead of being parsed (and refused) here.
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def bench(ctx: typer.Context) -> None:
    """Benchmark the generated step against autograd and its peers (what make bench runs).

    Every argument goes to the harness (unroller.bench); `unroll bench --help` lists them.

    Example: unroll bench --benchmark resnet34 --scheme dct-dense --memory-budget 2GiB
    """
    try:
        from unroller.bench import main as run_bench
    except ImportError as exc:
        raise fail(f"the benchmark harness (unroller.bench) cannot be imported: {exc}") from None
    raise typer.Exit(run_bench(list(ctx.args)))


def register(app: typer.Typer) -> None:
    """Add bench to ``app``, with its arguments passed through."""
    app.command(add_help_option=False, context_settings=PASS_THROUGH)(bench)
