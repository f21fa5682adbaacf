"""Every option two or more commands take, declared once.

Commands annotate their parameters with these aliases, so a name, a short flag, a help
text or a set of choices is changed in one place. Platforms and schemes are Enums built
from ``unroller.platforms.PLATFORMS`` and ``unroller.schemes.SCHEMES``: --help lists
their choices, and adding a platform or scheme there adds it here.

An unknown choice is refused with the message users know (``unroll: error: unknown
platform 'tpu' (known: gpu, ipu)``, status 2) rather than click's generic one: the
parsers below do the refusing.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from unroller.cli.errors import fail
from unroller.platforms import PLATFORMS, PlatformName
from unroller.schemes import SCHEMES

#: The scheme names as an Enum, for typer options (``Scheme("dct-dense")``).
Scheme = Enum("Scheme", {name.upper().replace("-", "_"): name for name in SCHEMES}, type=str)

#: The defaults of --platform and --scheme where a command does not say otherwise.
DEFAULT_PLATFORM = PlatformName("gpu")
DEFAULT_SCHEME = Scheme("nocompress")

#: Where checked-in generated files live (``unroll check``, ``unroll diff``).
GENERATED = Path("generated")


def value_of(choice: Enum | str) -> str:
    """The plain name behind a choice (what Options, headers and messages hold)."""
    return str(getattr(choice, "value", choice))


def _choice_parser(enum: type[Enum], noun: str) -> Callable[[object], str]:
    """A typer parser that checks a name against ``enum``, or refuses it (status 2).

    It returns the plain name, not the member: typer releases differ in what follows a
    parser (older ones map the name to the member themselves, and would turn a member
    into None), so commands read every choice through ``value_of``."""

    def parse(value: object) -> str:
        try:
            return value_of(enum(value))
        except ValueError:
            known = ", ".join(value_of(member) for member in enum)
            raise fail(f"unknown {noun} '{value}' (known: {known})") from None

    return parse


parse_platform = _choice_parser(PlatformName, "platform")
parse_scheme = _choice_parser(Scheme, "scheme")


def _metavar(enum: type[Enum]) -> str:
    """``[a|b|c]``: the choices, shown in --help by every typer release (older ones would
    show the parser's name)."""
    return "[" + "|".join(value_of(member) for member in enum) + "]"


def _platforms_help() -> str:
    return "; ".join(f"{p.name}: {p.summary}" for p in PLATFORMS.values()) + "."


def _stages_help() -> str:
    """Which platforms pipeline, and the stage counts each accepts."""
    pipelined = [p for p in PLATFORMS.values() if p.pipelined]
    counts = "; ".join(f"{p.name}: {', '.join(map(str, p.stage_counts))}" for p in pipelined)
    return f"Pipeline stages, one per device ({counts})."


# ---- the model and its target (generate, diff, graph, lint, train, accuracy) -----------

ModelArg = Annotated[Path, typer.Argument(help="The model file (.txt).")]
PlatformOpt = Annotated[
    PlatformName,
    typer.Option(
        "--platform",
        "-p",
        parser=parse_platform,
        metavar=_metavar(PlatformName),
        help=_platforms_help(),
    ),
]
NumIpusOpt = Annotated[int, typer.Option("--num-ipus", help=_stages_help())]
StagesOpt = Annotated[
    str | None,
    typer.Option(
        "--stage-starts",
        help="Pipelined platforms: comma-separated first node of each stage after the first "
        "(default: balance parameter + stashed bytes).",
    ),
]

# ---- compression (generate, diff, graph, train) ----------------------------------------

SchemeOpt = Annotated[
    Scheme,
    typer.Option(
        "--scheme", parser=parse_scheme, metavar=_metavar(Scheme), help="Compression scheme."
    ),
]
SchemesOpt = Annotated[
    list[Scheme] | None,
    typer.Option(
        "--scheme",
        parser=parse_scheme,
        metavar=_metavar(Scheme),
        help="A scheme; give two to compare schemes.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--compress-config", help="TOML file with a default and rules (replaces the scheme's)."
    ),
]
OptLevelOpt = Annotated[
    int, typer.Option("--opt-level", min=0, max=1, help="0: no compression and no masks.")
]

RecomputeOpt = Annotated[
    bool,
    typer.Option(
        "--recompute",
        help="Remake the outputs of cheap ops (activations, pooling, resampling, concat, batch "
        "norm) in the backward from what is kept anyway, instead of keeping them.",
    ),
]

SEGMENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.*?[]!-")
"""What a segment pattern may hold: a block instance name or glob (as a config's globs)."""


def parse_segments(text: str | None) -> tuple[str, ...]:
    """``--recompute-segments blocks|auto|GLOB[,GLOB...]`` as patterns, or refused (status 2)."""
    if text is None:
        return ()
    found = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    for part in found:
        if not part or len(part) > 200 or not set(part) <= SEGMENT_CHARS:
            shown = part if set(part) <= SEGMENT_CHARS else ascii(part)
            raise fail(
                f"--recompute-segments: bad segment '{shown[:60]}' (blocks, auto, or block "
                "instance names / globs of letters, digits and _ . * ? [ ] ! -, "
                "comma-separated)"
            )
    if "auto" in found and len(found) > 1:
        raise fail("--recompute-segments: auto stands alone (the planner chooses)")
    return found


RecomputeSegmentsOpt = Annotated[
    str | None,
    typer.Option(
        "--recompute-segments",
        metavar="blocks|auto|NAMES",
        help="Segment recompute: these top-level block instances keep only their inputs "
        "from the forward (compressed as the scheme compresses them) and run their forward "
        "again when their backward begins. 'blocks': every one that can be; NAMES: "
        "comma-separated instance names or globs ('layers.*'); 'auto': the planner chooses "
        "(--scheme auto, unroll plan).",
    ),
]

MAX_SEGMENT_PIECES = 4096
"""The most pieces ``--segment-pieces`` takes (a piece of one sample at batch 4096)."""

SegmentPiecesOpt = Annotated[
    int,
    typer.Option(
        "--segment-pieces",
        min=1,
        max=MAX_SEGMENT_PIECES,
        metavar="K",
        help="With --recompute-segments: each recomputed segment runs its recompute and "
        "backward in K pieces of the batch, one at a time, so that their working memory is "
        "a piece's (segments holding an op that couples the batch, batch norm, stay whole; "
        "unroll graph says which). 1: whole.",
    ),
]
SegmentPieceSizeOpt = Annotated[
    int,
    typer.Option(
        "--segment-piece-size",
        min=0,
        max=MAX_SEGMENT_PIECES,
        metavar="P",
        help="With --recompute-segments, instead of --segment-pieces: pieces of at most P "
        "samples, whatever the batch, so that a segment's working memory is the same at "
        "every batch size (what each extra sample costs is then its kept inputs and "
        "gradients). 0: by --segment-pieces.",
    ),
]

DataParallelOpt = Annotated[
    bool,
    typer.Option(
        "--data-parallel",
        help="gpu: all-reduce gradient buckets during the backward (unroller.distributed); "
        "the file still trains in one process.",
    ),
]

PipelineOpt = Annotated[
    int,
    typer.Option(
        "--pipeline",
        help="gpu: also emit one generator per pipeline stage, for that many processes "
        "(unroller.pipeline_parallel; stages split by --stage-starts or balanced); the file "
        "still trains in one process. 1: none.",
    ),
]

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
# The names are unroller.training.OPTIMIZERS (tests/test_cli_layout.py checks): not imported,
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
ResolutionOpt = Annotated[
    int | None,
    typer.Option(
        "--resolution",
        help="Rewrite the model's image inputs and targets to R rows (as unroll bench).",
    ),
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
