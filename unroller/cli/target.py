"""From the target options of a command line to the generator's ``Options``.

``Options`` refuses what it cannot generate (asking each ``Platform`` in
``unroller.compiler.platforms`` what it takes, never testing its name); here its refusal becomes
one ``unroll: error:`` line naming the flags as typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unroller.api import source_label
from unroller.cli.errors import config_error, fail
from unroller.cli.options import CLI_DEFAULTS, parse_segments, value_of
from unroller.compiler.options import OPTION_FIELDS, Options, check_field
from unroller.compiler.platforms import PLATFORMS
from unroller.errors import ConfigError, OptionValueError

#: Every stage count some platform accepts: what a generated file's header may record.
ALL_STAGE_COUNTS: tuple[int, ...] = tuple(
    sorted({n for p in PLATFORMS.values() for n in p.stage_counts})
)


def stage_starts_of(text: str | None) -> tuple[str, ...]:
    """``--stage-starts a,b`` as node names."""
    return tuple(s.strip() for s in text.split(",")) if text else ()


def _config_label(path: Path | None) -> str | None:
    return source_label(path) if path else None


#: From what the command line gives for a field to the field's value (others: as given).
FROM_CLI = {
    "platform": value_of,
    "scheme": value_of,
    "precision": value_of,
    "compress_config": _config_label,
    "stage_starts": stage_starts_of,
    "recompute_segments": parse_segments,
    "segment_keep": parse_segments,
}


def options_of(values: dict[str, Any]) -> Options:
    """``Options`` from command-line values by field name (``with_options``), or the
    refusal naming the flags as typed (status 2)."""
    fields = {name: FROM_CLI.get(name, _same)(value) for name, value in values.items()}
    try:
        return Options(**fields)
    except OptionValueError as exc:
        raise fail(exc.render("cli")) from None


def _same(value: Any) -> Any:
    return value


def checked(name: str, value: Any) -> Any:
    """``value`` of a command that takes field ``name`` of ``Options`` without making
    ``Options`` (plan, estimate, train), refused as ``Options`` refuses it (status 2)."""
    problem = check_field(name, value)
    if problem is not None:
        raise fail(problem.render("cli"))
    return value


def make_options(values: Any = None, *positional: Any, **changed: Any) -> Options:
    """Generator options from command-line values by field name (the command's
    ``option_values``, with ``changed`` ones; or, for a script, the values in the fields'
    order: ``make_options("gpu", "quant", path)``), refused (status 2) naming the flags;
    the compression config is read and checked now, before anything is written."""
    if not isinstance(values, dict):
        positional, values = (values, *positional), {}
    names = [f.name for f in OPTION_FIELDS]
    changed = {**dict(zip(names, positional)), **changed}
    options = options_of({**CLI_DEFAULTS, **values, **changed})
    try:
        if options.scheme != "auto" or options.compress_config is not None:
            options.compression()  # reads and checks the config file now
    except ConfigError as exc:
        raise config_error(exc) from None
    return options
