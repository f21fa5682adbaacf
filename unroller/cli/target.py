"""From the target options of a command line to the generator's ``Options``.

What a platform allows (pipelining, stage counts) is asked of its ``Platform`` in
``unroller.platforms``; nothing here tests a platform's name, so a new platform needs no
change in the CLI.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from unroller.api import source_label
from unroller.cli.errors import config_error, fail
from unroller.cli.options import parse_segments, value_of
from unroller.codegen import PROCESS_STAGES
from unroller.errors import ConfigError
from unroller.options import Options
from unroller.platforms import PLATFORMS, platform

#: Every stage count some platform accepts: what a generated file's header may record.
ALL_STAGE_COUNTS: tuple[int, ...] = tuple(
    sorted({n for p in PLATFORMS.values() for n in p.stage_counts})
)


def pipelined_names() -> list[str]:
    """The platforms that split a step into pipeline stages."""
    return [p.name for p in PLATFORMS.values() if p.pipelined]


def stage_starts_of(text: str | None) -> tuple[str, ...]:
    """``--stage-starts a,b`` as node names."""
    return tuple(s.strip() for s in text.split(",")) if text else ()


def make_options(
    platform_name: Enum | str,
    scheme: Enum | str,
    compress_config: Path | None = None,
    opt_level: int = 1,
    num_ipus: int = 1,
    stage_starts: str | None = None,
    recompute: bool = False,
    data_parallel: bool = False,
    pipeline: int = 1,
    recompute_segments: str | None = None,
    segment_pieces: int = 1,
    segment_piece_size: int = 0,
) -> Options:
    """Generator options from command-line values, refused (status 2) with the option to
    blame; the compression config is read and checked now, before anything is written."""
    try:
        target = platform(value_of(platform_name))
    except ValueError as exc:
        raise fail(str(exc)) from None
    starts = stage_starts_of(stage_starts)
    if pipeline != 1:
        if not target.process_stages:
            raise fail(f"--pipeline is not for --platform {target.name}")
        if pipeline not in PROCESS_STAGES:
            raise fail(f"--pipeline must be one of 1, {', '.join(map(str, PROCESS_STAGES))}")
        if data_parallel:
            raise fail("--pipeline and --data-parallel do not combine yet")
    elif not target.pipelined and (num_ipus != 1 or starts):
        raise fail(
            f"--num-ipus and --stage-starts are for --platform {' or '.join(pipelined_names())}"
            " (or --pipeline)"
        )
    if num_ipus not in target.stage_counts:
        raise fail(f"--num-ipus must be one of {', '.join(map(str, target.stage_counts))}")
    options = Options(
        platform=target.name,
        scheme=value_of(scheme),
        compress_config=source_label(compress_config) if compress_config else None,
        opt_level=opt_level,
        num_ipus=num_ipus,
        stage_starts=starts,
        recompute=recompute,
        recompute_segments=parse_segments(recompute_segments),
        segment_pieces=segment_pieces,
        segment_piece_size=segment_piece_size,
        data_parallel=data_parallel,
        pipeline=pipeline,
    )
    if options.recompute_segments and (num_ipus != 1 or pipeline != 1):
        stages = f"--num-ipus {num_ipus}" if num_ipus != 1 else f"--pipeline {pipeline}"
        raise fail(f"--recompute-segments does not combine with pipeline stages ({stages}) yet")
    if segment_pieces != 1 and segment_piece_size:
        raise fail("--segment-pieces and --segment-piece-size: give one of them")
    if segment_pieces != 1 or segment_piece_size:
        flag = "--segment-piece-size" if segment_piece_size else "--segment-pieces"
        if not options.recompute_segments:
            raise fail(f"{flag} splits recomputed segments: give --recompute-segments")
        if target.grads != "accumulate" or target.pipelined:
            raise fail(f"{flag} is not for --platform {target.name}")
        if data_parallel:
            raise fail(f"{flag} and --data-parallel do not combine yet")
    if data_parallel and target.pipelined:
        raise fail("--data-parallel is for --platform gpu")
    try:
        if options.scheme != "auto" or options.compress_config is not None:
            options.compression()  # reads and checks the config file now
    except ConfigError as exc:
        raise config_error(exc) from None
    return options
