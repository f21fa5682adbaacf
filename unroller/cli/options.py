"""Every option two or more commands take, declared once.

The options of the generator are the fields of ``unroller.compiler.options.Options``: their flags
and help texts are the fields' metadata, and ``with_options`` adds the ones a command
takes to its parameters, so no command restates them; ``unroller.cli.target`` turns
their values into ``Options``, which refuses what it cannot generate (the message naming
the flags as typed). Other shared options are the aliases below. Platforms and schemes
are Enums built from ``unroller.compiler.platforms.PLATFORMS`` and ``unroller.compiler.schemes.SCHEMES``:
--help lists their choices, and adding a platform or scheme there adds it here.

An unknown choice is refused with the message users know (``unroll: error: unknown
platform 'tpu' (known: gpu, ipu)``, status 2) rather than click's generic one: the
parsers below do the refusing, with ``Options``'s own check.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from unroller.cli.errors import fail
from unroller.compiler.options import FLAGS, OPTION_FIELDS, check_field
from unroller.compiler.platforms import PlatformName
from unroller.compiler.precision import NAMES as PRECISION_NAMES
from unroller.compiler.schemes import SCHEMES

#: The scheme names as an Enum, for typer options (``Scheme("dct-dense")``).
Scheme = Enum("Scheme", {name.upper().replace("-", "_"): name for name in SCHEMES}, type=str)

#: Where checked-in generated files live (``unroll check``, ``unroll diff``).
GENERATED = Path("generated")


def value_of(choice: Enum | str) -> str:
    """The plain name behind a choice (what Options, headers and messages hold)."""
    return str(getattr(choice, "value", choice))


def _choice_parser(enum: type[Enum], name: str) -> Callable[[object], str]:
    """A typer parser that checks a name as ``Options`` does (field ``name``), or refuses
    it (status 2).

    It returns the plain name, not the member: typer releases differ in what follows a
    parser (older ones map the name to the member themselves, and would turn a member
    into None), so commands read every choice through ``value_of``."""

    def parse(value: object) -> str:
        text = value_of(value)
        problem = check_field(name, text)
        if problem is not None:
            raise fail(problem.render("cli"))
        return text

    return parse


parse_platform = _choice_parser(PlatformName, "platform")
parse_scheme = _choice_parser(Scheme, "scheme")

#: The precision names as an Enum, for typer options (``PrecisionName("bf16-mixed")``).
PrecisionName = Enum(
    "PrecisionName", {n.upper().replace("-", "_"): n for n in PRECISION_NAMES}, type=str
)
parse_precision = _choice_parser(PrecisionName, "precision")


def _metavar(enum: type[Enum]) -> str:
    """``[a|b|c]``: the choices, shown in --help by every typer release (older ones would
    show the parser's name)."""
    return "[" + "|".join(value_of(member) for member in enum) + "]"


ModelArg = Annotated[Path, typer.Argument(help="The model file (.txt).")]

# ---- the generator's options: the fields of Options -----------------------------------

FIELDS = {f.name: f for f in OPTION_FIELDS}

#: What the command line reads for each field (its type, and for a choice the parser
#: and the choices shown); a field not here is not on the command line.
CLI_TYPES: dict[str, tuple[Any, dict[str, Any]]] = {
    "platform": (PlatformName, {"parser": parse_platform, "metavar": _metavar(PlatformName)}),
    "scheme": (Scheme, {"parser": parse_scheme, "metavar": _metavar(Scheme)}),
    "precision": (PrecisionName, {"parser": parse_precision, "metavar": _metavar(PrecisionName)}),
    "compress_config": (Path | None, {}),
    "opt_level": (int, {}),
    "num_ipus": (int, {}),
    "stage_starts": (str | None, {}),
    "resolution": (int | None, {}),
    "recompute": (bool, {}),
    "recompute_segments": (str | None, {}),
    "segment_pieces": (int, {}),
    "segment_piece_size": (int, {}),
    "segment_keep": (str | None, {}),
    "max_time_ratio": (float, {}),
    "data_parallel": (bool, {}),
    "update_in_backward": (bool, {}),
    "shard": (bool, {}),
    "pipeline": (int, {}),
}

#: The defaults of --platform and --scheme where a command does not say otherwise.
DEFAULT_PLATFORM = PlatformName(FIELDS["platform"].default)
DEFAULT_SCHEME = Scheme(FIELDS["scheme"].default)
DEFAULT_PRECISION = PrecisionName(FIELDS["precision"].default)

#: Each field's default as the command line gives it (a list field: no text).
CLI_DEFAULTS: dict[str, Any] = {
    name: {
        "platform": DEFAULT_PLATFORM,
        "scheme": DEFAULT_SCHEME,
        "precision": DEFAULT_PRECISION,
    }.get(name, None if isinstance(FIELDS[name].default, tuple) else FIELDS[name].default)
    for name in CLI_TYPES
}


def field_option(name: str, **overrides: Any) -> Any:
    """The typer option of field ``name`` of ``Options``: its flag, short flag, help text
    and metavar from the field's metadata, its type and parser from ``CLI_TYPES``."""
    meta = FIELDS[name].metadata
    kind, settings = CLI_TYPES[name]
    settings = {"help": meta["help"], **settings, **overrides}
    if meta["metavar"] and "metavar" not in settings:
        settings["metavar"] = meta["metavar"]
    flags = [FLAGS[name], *([meta["short"]] if meta["short"] else [])]
    return Annotated[kind, typer.Option(*flags, **settings)]


PlatformOpt = field_option("platform")
SchemeOpt = field_option("scheme")
SchemesOpt = Annotated[
    list[Scheme] | None,
    typer.Option(
        "--scheme",
        parser=parse_scheme,
        metavar=_metavar(Scheme),
        help="A scheme; give two to compare schemes.",
    ),
]
PrecisionOpt = field_option("precision")
PrecisionsOpt = Annotated[
    list[PrecisionName] | None,
    typer.Option(
        "--precision",
        parser=parse_precision,
        metavar=_metavar(PrecisionName),
        help="A precision; give two to compare precisions.",
    ),
]
ConfigOpt = field_option("compress_config")
RecomputeOpt = field_option("recompute")
UpdateInBackwardOpt = field_option("update_in_backward")
RecomputeSegmentsOpt = field_option("recompute_segments")
SegmentPieceSizeOpt = field_option("segment_piece_size")
ResolutionOpt = field_option("resolution")

#: The target and compression options of the commands that generate or show a module.
TARGET_OPTIONS = (
    "platform",
    "scheme",
    "precision",
    "compress_config",
    "opt_level",
    "num_ipus",
    "stage_starts",
    "recompute",
    "recompute_segments",
    "segment_pieces",
    "segment_piece_size",
    "segment_keep",
    "max_time_ratio",
)
"""What generate, diff and graph take (generate also --data-parallel and --pipeline)."""


def with_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of the ``Options`` fields ``names``, declared by the
    fields (``field_option``) and placed where the command has its ``option_values``
    parameter; the command receives their values as that one dict, by field name, for
    ``unroller.cli.target.make_options``."""

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        params = list(signature.parameters.values())
        at = [p.name for p in params].index("option_values")
        added = [
            inspect.Parameter(
                name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=CLI_DEFAULTS[name],
                annotation=field_option(name),
            )
            for name in names
        ]
        params[at : at + 1] = added

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names if name in kwargs}
            return command(*args, option_values=values, **kwargs)

        run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


def parse_segments(text: str | None) -> tuple[str, ...]:
    """``--recompute-segments blocks|auto|GLOB[,GLOB...]`` as patterns (``Options`` checks
    them)."""
    if text is None:
        return ()
    return tuple(dict.fromkeys(part.strip() for part in text.split(",")))


# ---- training (train, accuracy) --------------------------------------------------------

DatasetOpt = Annotated[
    str,
    typer.Option(
        "--dataset",
        "-d",
        help="digits (real, from scikit-learn), denoise / clouds / optics (synthetic), "
        "pysource (real: this Python's standard library sources, for a character "
        "language model), or sciml:PATH (SciML-Bench data on disk).",
    ),
]
EpochsOpt = Annotated[int, typer.Option("--epochs", help="Epochs to train.", min=1)]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Samples per step.", min=1)]
LrOpt = Annotated[float, typer.Option("--lr", help="Peak learning rate.")]
# The names are unroller.training.loop.OPTIMIZERS (tests/cli/test_cli_layout.py checks): not imported,
# because importing training imports torch, which would slow every `unroll` command.
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="sgd or adam.")]
MomentumOpt = Annotated[float, typer.Option("--momentum", help="SGD momentum.")]
DecayOpt = Annotated[float, typer.Option("--weight-decay", help="L2 weight decay.")]
ScheduleOpt = Annotated[
    str, typer.Option("--schedule", help="cosine (lr to lr/100 over the epochs) or constant.")
]
DataSeedOpt = Annotated[
    int,
    typer.Option("--data-seed", help="Seed of the synthetic datasets (not digits or pysource)."),
]
TrainSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--train-size",
        help="K training samples: the first K of digits / sciml, K generated for synthetic "
        "sets, K evenly spaced windows of pysource.",
    ),
]
TestSizeOpt = Annotated[
    int | None, typer.Option("--test-size", help="K test samples (as --train-size).")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or auto.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or epoch lines.")]

#: The factory's keyword arguments (``unroll import``, ``unroll verify``).
KwargsOpt = Annotated[
    str | None,
    typer.Option(
        "--kwargs",
        help="Keyword arguments for the factory or class, as JSON: '{\"num_classes\": 10}'.",
    ),
]
