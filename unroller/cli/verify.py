"""``unroll verify``: does a model text compute what a ``torch.nn.Module`` computes?

The work is ``unroller.analysis.verify`` (it imports torch, so it is imported only when the command
runs); this module turns its report into output and an exit status: 0 every value
matches, 1 a mismatch (keys, shapes or numbers), 2 a user error (a broken model file, a
SPEC that does not load, a model text that is not ``prediction -> shape ops -> loss``).
With a low ``--precision`` the numbers are judged by the accuracy contract
(``unroller.analysis.verify_precision``) instead of float64 equality.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from unroller.cli.errors import fail, model_error
from unroller.cli.options import BatchOpt, KwargsOpt, ModelArg, with_options
from unroller.errors import ModelError

#: The generation options verify takes: the step they make is the one checked (on the
#: default platform, the one that runs on this machine's PyTorch).
VERIFY_OPTIONS = (
    "scheme",
    "precision",
    "compress_config",
    "opt_level",
    "recompute",
    "recompute_segments",
    "segment_pieces",
    "segment_piece_size",
    "segment_keep",
)

AgainstOpt = Annotated[
    str,
    typer.Option(
        "--against",
        help="The original network: package.module:Name or path/to/file.py:Name (a class, "
        "a factory or a module instance).",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seeds the weights, inputs and dropout.")]
ToleranceOpt = Annotated[
    float,
    typer.Option(
        "--tolerance",
        min=0.0,
        help="Largest relative error that passes (float64; with --precision fp32 only).",
    ),
]
DropoutOpt = Annotated[
    str,
    typer.Option(
        "--dropout",
        help="seeded: both sides draw dropout masks from --seed (exact when they draw in the "
        "same order); off: dropout p set to 0 on both sides, masks not checked.",
    ),
]


@with_options(*VERIFY_OPTIONS)
def verify(
    model: ModelArg,
    against: AgainstOpt,
    kwargs: KwargsOpt = None,
    batch_size: BatchOpt = 2,
    seed: SeedOpt = 0,
    tolerance: ToleranceOpt = 1e-10,
    dropout: DropoutOpt = "seeded",
    option_values: dict[str, Any] | None = None,
) -> None:
    """Check a model text against the torch.nn.Module it stands for, in float64.

    Builds the original and the generated module (gpu, nocompress, or as the generation
    options given make it: --recompute-segments, --segment-pieces, ...) with the same weights
    (state dicts loaded strict=True both ways), runs one training step on seeded inputs of
    the declared shapes, and compares the loss, every parameter's gradient, every buffer
    after the step and the evaluation-mode predictions, with a table per tensor. The loss
    the model text applies is replayed on the original's predictions.

    With a low --precision (bf16-mixed, fp16-mixed, bf16, fp16) the step cannot match
    float64, and the accuracy contract is checked instead: per tensor, the relative error
    ||x - ref|| / ||ref|| against the original in float64, ours (the generated step) at most
    2 x that of torch's own step in the precision (torch.autocast on the CPU for a mixed
    one, the module moved to the low dtype for a plain one) + 1e-3 (bf16) or 2.5e-4 (fp16);
    dropout off on every side.

    Example: unroll verify models/net.txt --against mynet.py:Net --kwargs '{"num_classes": 10}'

    Exit status 0: everything within --tolerance (or the contract); 1: a mismatch; 2: a
    user error.
    """
    import unroller.analysis.verify as verification
    from unroller.cli.target import make_options
    from unroller.compiler.options import Options
    from unroller.importer.model import ImportFailure
    from unroller.importer.source import parse_kwargs

    options = make_options(option_values or {})

    if dropout not in verification.DROPOUT_MODES:
        known = ", ".join(verification.DROPOUT_MODES)
        raise fail(f"unknown --dropout '{dropout}' (known: {known})")
    if options.precision != Options().precision and tolerance != verification.TOLERANCE:
        raise fail(
            f"--tolerance is the float64 check's bound; --precision {options.precision} is "
            "judged by its accuracy contract (ours <= 2 x torch's own error in that precision "
            "+ a floor): leave --tolerance out"
        )
    try:
        report = verification.verify(
            model,
            against,
            parse_kwargs(kwargs),
            batch_size,
            seed,
            tolerance,
            dropout,
            options=None if options == Options() else options,
        )
    except ModelError as exc:
        raise model_error(exc, model) from None
    except ImportFailure as exc:
        raise fail(exc.format()) from None
    typer.echo(report.render())
    raise typer.Exit(0 if report.ok else 1)


def register(app: typer.Typer) -> None:
    """Add verify to ``app``."""
    app.command()(verify)
