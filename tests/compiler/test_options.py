"""``Options`` validates itself: every field round-trips through a generated file's header,
and every value or combination it cannot generate is refused on construction with one
message, naming the Python argument (``segment_pieces=``) for a library caller and the
flag as typed (``--segment-pieces``) on the command line. Hostile values (huge, negative,
a bool for a number, control characters) are refused in one printable line. No
randomness: the cases and the hostile pool are fixed lists.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unroller.cli import app
from unroller.compiler.options import FLAGS, OPTION_FIELDS, Options, check_field
from unroller.compiler.schemes import resolve
from unroller.errors import OptionError, OptionValueError

ROOT = Path(__file__).resolve().parents[2]
FANOUT = ROOT / "tests" / "models" / "fanout.txt"
runner = CliRunner()

#: Per field, a value other than its default, with the fields it needs to be valid.
VALID: dict[str, dict[str, object]] = {
    "platform": {"platform": "ipu"},
    "scheme": {"scheme": "dct-dense"},
    "compress_config": {"compress_config": "configs/c.toml"},
    "opt_level": {"opt_level": 0},
    "num_ipus": {"platform": "ipu", "num_ipus": 4},
    "stage_starts": {"platform": "ipu", "num_ipus": 2, "stage_starts": ("a", "b")},
    "resolution": {"resolution": 64},
    "recompute": {"recompute": True},
    "recompute_segments": {"recompute_segments": ("blocks", "layers.*")},
    "segment_pieces": {"recompute_segments": ("blocks",), "segment_pieces": 4096},
    "segment_piece_size": {"recompute_segments": ("u1",), "segment_piece_size": 2},
    "segment_keep": {"recompute_segments": ("blocks",), "segment_keep": ("matmuls", "u1.*")},
    "data_parallel": {"data_parallel": True, "bucket_bytes": 4096},
    "update_in_backward": {"update_in_backward": True},
    "shard": {"shard": True},
    "bucket_bytes": {"bucket_bytes": 1},
    "pipeline": {"pipeline": 8, "stage_starts": ("d",)},
    "precision": {"precision": "bf16-mixed"},
    "max_time_ratio": {"scheme": "auto", "max_time_ratio": 1.5},
}


def test_every_field_has_a_valid_case():
    assert set(VALID) == {f.name for f in OPTION_FIELDS}


@pytest.mark.parametrize("name", list(VALID))
def test_every_field_round_trips_through_the_header(name: str):
    options = Options(**VALID[name])  # type: ignore[arg-type]
    header = json.loads(json.dumps(options.as_dict()))
    assert header[name] == (
        list(getattr(options, name))
        if isinstance(getattr(options, name), tuple)
        else getattr(options, name)
    )
    assert Options.from_header(header) == options


def test_the_header_records_the_fields_in_their_order_and_extra_last():
    """The order of a header's keys is part of a generated file's bytes."""
    options = Options(
        platform="gpu",
        scheme="quant",
        compress_config="c.toml",
        opt_level=0,
        resolution=32,
        recompute=True,
        recompute_segments=("blocks",),
        segment_pieces=2,
        data_parallel=False,
        pipeline=1,
        extra={"future_key": 1},
    )
    assert list(options.as_dict()) == [
        "platform",
        "scheme",
        "compress_config",
        "opt_level",
        "resolution",
        "recompute",
        "recompute_segments",
        "segment_pieces",
        "future_key",
    ]
    assert Options().as_dict() == {"platform": "gpu", "scheme": "nocompress"}
    header = {"generator": "x", "source": "m.txt", "sha256": "0", **options.as_dict()}
    assert Options.from_header(header) == options


def test_every_constructor_path_validates():
    with pytest.raises(OptionValueError):
        dataclasses.replace(Options(), segment_pieces=0)
    with pytest.raises(OptionValueError) as caught:
        Options.from_header({"platform": "gpu", "scheme": "quant", "recompute": "yes"})
    assert caught.value.render("header") == "'recompute' = 'yes': not True or False"


def test_a_validated_options_cannot_be_changed_only_replaced():
    options = Options(segment_pieces=2, recompute_segments=("blocks",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.segment_pieces = 0  # type: ignore[misc]
    with pytest.raises(OptionError, match="segment_pieces=0"):
        dataclasses.replace(options, segment_pieces=0)
    assert dataclasses.replace(options, segment_pieces=3).segment_pieces == 3


def test_lists_are_taken_as_tuples():
    options = Options(recompute_segments=["blocks"])  # type: ignore[arg-type]
    assert options.recompute_segments == ("blocks",)
    assert options.as_dict()["recompute_segments"] == ["blocks"]


# ---- refused: one message, Python names the argument, the CLI the flag ------------------

#: (Python keyword arguments, command-line arguments or None, the Python message).
REFUSED = [
    (dict(platform="tpu"), ["--platform", "tpu"], "unknown platform 'tpu' (known: gpu, ipu)"),
    (dict(scheme="zip"), ["--scheme", "zip"], "unknown scheme 'zip' (known: "),
    (dict(opt_level=2), ["--opt-level", "2"], "opt_level=2: must be 0 or 1"),
    (dict(opt_level=True), None, "opt_level=True: must be 0 or 1"),
    (dict(num_ipus=3), ["--num-ipus", "3"], "num_ipus= must be one of 1, 2, 4, 8, 16"),
    (dict(pipeline=9), ["--pipeline", "9"], "pipeline= must be one of 1, 2, 3"),
    (dict(pipeline=-1), ["--pipeline", "-1"], "pipeline= must be one of 1, 2, 3"),
    (
        dict(segment_pieces=0),
        ["--segment-pieces", "0"],
        "segment_pieces=0: not a whole number from 1 to 4096",
    ),
    (
        dict(segment_pieces=10**30),
        ["--segment-pieces", str(10**30)],
        "segment_pieces=<an integer of 100 bits>: not a whole number from 1 to 4096",
    ),
    (
        dict(segment_pieces=True),
        None,
        "segment_pieces=True: not a whole number from 1 to 4096",
    ),
    (
        dict(segment_piece_size=-1),
        ["--segment-piece-size", "-1"],
        "segment_piece_size=-1: not a whole number from 0 to 4096",
    ),
    (
        dict(segment_piece_size=4097),
        ["--segment-piece-size", "4097"],
        "segment_piece_size=4097: not a whole number from 0 to 4096",
    ),
    (
        dict(recompute_segments=("blocks",), segment_pieces=2, segment_piece_size=2),
        ["--recompute-segments", "blocks", "--segment-pieces", "2", "--segment-piece-size", "2"],
        "segment_pieces= and segment_piece_size=: give one of them",
    ),
    (
        dict(segment_pieces=2),
        ["--segment-pieces", "2"],
        "segment_pieces= splits recomputed segments: give recompute_segments=",
    ),
    (
        dict(platform="ipu", recompute_segments=("blocks",), segment_piece_size=2),
        ["--platform", "ipu", "--recompute-segments", "blocks", "--segment-piece-size", "2"],
        "segment_piece_size= is not for platform='ipu'",
    ),
    (
        dict(recompute_segments=("blocks",), segment_pieces=2, data_parallel=True),
        ["--recompute-segments", "blocks", "--segment-pieces", "2", "--data-parallel"],
        "segment_pieces= and data_parallel= do not combine yet",
    ),
    (
        dict(recompute_segments=("a b",)),
        ["--recompute-segments", "a b"],
        "recompute_segments=: bad segment 'a b' (blocks, auto",
    ),
    (
        dict(recompute_segments=("a\x1b[2J\rb",)),
        ["--recompute-segments", "a\x1b[2J\rb"],
        "recompute_segments=: bad segment 'a\\x1b[2J\\rb'",
    ),
    (
        dict(recompute_segments=("auto", "blocks"), scheme="auto"),
        ["--recompute-segments", "auto,blocks", "--scheme", "auto"],
        "recompute_segments=: auto stands alone (the planner chooses)",
    ),
    (
        dict(recompute_segments=("auto",)),
        ["--recompute-segments", "auto"],
        "recompute_segments='auto' is the planner's choice: it needs scheme='auto'",
    ),
    (
        dict(platform="ipu", num_ipus=2, recompute_segments=("blocks",)),
        ["--platform", "ipu", "--num-ipus", "2", "--recompute-segments", "blocks"],
        "recompute_segments= does not combine with pipeline stages (num_ipus=2) yet",
    ),
    (
        dict(platform="ipu", pipeline=2),
        ["--platform", "ipu", "--pipeline", "2"],
        "pipeline= is not for platform='ipu'",
    ),
    (
        dict(pipeline=2, data_parallel=True),
        ["--pipeline", "2", "--data-parallel"],
        "pipeline= and data_parallel= do not combine yet",
    ),
    (
        dict(pipeline=2, shard=True),
        ["--pipeline", "2", "--shard"],
        "shard= and pipeline= do not combine yet: sharding inside a stage needs a mesh",
    ),
    (
        dict(stage_starts=("a",)),
        ["--stage-starts", "a"],
        "num_ipus= and stage_starts= are for platform='ipu' (or pipeline=)",
    ),
    (
        dict(platform="ipu", data_parallel=True),
        ["--platform", "ipu", "--data-parallel"],
        "data_parallel= is for platform='gpu'",
    ),
    (
        dict(max_time_ratio=1.5),
        ["--max-time-ratio", "1.5"],
        "max_time_ratio= limits the plan of scheme='auto'; scheme='nocompress' is not planned",
    ),
    (
        dict(scheme="auto", max_time_ratio=0.5),
        ["--scheme", "auto", "--max-time-ratio", "0.5"],
        "max_time_ratio=0.5: not a number from 1.0 to 100.0",
    ),
    (dict(scheme="auto", max_time_ratio=float("nan")), None, "max_time_ratio=nan: not a number"),
    (dict(scheme="auto", max_time_ratio=True), None, "max_time_ratio=True: not a number"),
    (dict(scheme="auto", max_time_ratio="2"), None, "max_time_ratio='2': not a number"),
    (
        dict(segment_keep=("matmuls",)),
        ["--segment-keep", "matmuls"],
        "segment_keep= keeps statements of recomputed segments: give recompute_segments=",
    ),
    (
        dict(scheme="auto", segment_keep=("matmuls",)),
        ["--scheme", "auto", "--segment-keep", "matmuls"],
        "segment_keep= is the planner's choice with scheme='auto'",
    ),
    (
        dict(recompute_segments=("blocks",), segment_keep=('a");import os;("',)),
        ["--recompute-segments", "blocks", "--segment-keep", 'a");import os;("'],
        "segment_keep=: bad name 'a\");import os;(\"' (matmuls, or node names",
    ),
    (dict(segment_keep="matmuls"), None, "segment_keep='matmuls': not a tuple of names"),
    (dict(stage_starts="ab"), None, "stage_starts='ab': not node names"),
    (dict(recompute_segments="blocks"), None, "recompute_segments='blocks': not a tuple"),
    (dict(recompute=1), None, "recompute=1: not True or False"),
    (dict(data_parallel="yes"), None, "data_parallel='yes': not True or False"),
    (dict(compress_config="a\0b"), None, "compress_config='a\\x00b': not a file name"),
    (dict(compress_config=""), None, "compress_config='': not a file name"),
    (dict(resolution=0), None, "resolution=0: not a whole number from 1 to 65536"),
    (dict(resolution=1.5), None, "resolution=1.5: not a whole number from 1 to 65536"),
    (dict(bucket_bytes=0), None, "bucket_bytes=0: not a whole number from 1 to"),
    (dict(bucket_bytes=2**41), None, "bucket_bytes=2199023255552: not a whole number"),
    (dict(extra=[]), None, "extra=[]: not a dict of header keys"),
]


def python_error(kwargs: dict[str, object]) -> OptionValueError:
    with pytest.raises(OptionValueError) as caught:
        Options(**kwargs)  # type: ignore[arg-type]
    return caught.value


@pytest.mark.parametrize("kwargs, args, message", REFUSED, ids=lambda v: repr(v)[:40])
def test_a_refusal_names_the_argument_in_python_and_the_flag_on_the_command_line(
    kwargs: dict[str, object], args: list[str] | None, message: str
):
    error = python_error(kwargs)
    assert isinstance(error, OptionError) and isinstance(error, ValueError)
    assert str(error).startswith(message), str(error)
    assert error.field in kwargs, error.field
    for style in ("python", "cli", "header"):
        text = error.render(style)
        assert text.isprintable() and len(text) < 300, text
    cli = error.render("cli")
    assert f"{error.field}=" not in cli and "=" not in cli.split(":")[0], cli
    if args is None:
        return
    result = runner.invoke(app, ["generate", str(FANOUT), *args])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"unroll: error: {cli}\n"
    assert FLAGS[error.field] in cli or "unknown" in cli


def test_the_resolution_is_refused_alike_by_the_commands_that_take_it(tmp_path: Path):
    message = "unroll: error: --resolution 0: not a whole number from 1 to 65536\n"
    for command in (["estimate"], ["plan"], ["train", "--out", str(tmp_path / "run")]):
        result = runner.invoke(app, [command[0], str(FANOUT), *command[1:], "--resolution", "0"])
        assert result.exit_code == 2 and result.stderr == message, (command, result.output)


HOSTILE = [
    -1,
    0,
    2,
    4097,
    -(2**63),
    2**64,
    10**5000,
    True,
    False,
    None,
    1.0,
    float("nan"),
    "",
    "gpu",
    "blocks",
    "a\x1b[2J\rb",
    "\0",
    "x" * 10000,
    ("blocks",),
    ("a\nb",),
    ("x" * 201,),
    ("ok",) * 1001,
    ["blocks"],
    {},
]


@pytest.mark.parametrize("name", [f.name for f in OPTION_FIELDS])
def test_hostile_values_are_taken_or_refused_in_one_printable_line(name: str):
    for value in HOSTILE:
        try:
            options = Options(**{name: value})  # type: ignore[arg-type]
        except OptionValueError as exc:
            assert exc.field in FLAGS or exc.field == "extra"
            for style in ("python", "cli", "header"):
                text = exc.render(style)
                assert text.isprintable() and len(text) < 400, (name, value, text)
            alone = check_field(name, value)
            assert alone is None or str(alone) == str(exc), (name, value)
        else:
            header = json.loads(json.dumps(options.as_dict()))
            assert Options.from_header(header) == options, (name, value)


# ---- a compression config's options ----------------------------------------------------


@pytest.mark.parametrize("size", [-1, 0, 1, 2, 4096, 4097, True, "2", 2.0])
def test_a_config_takes_the_segment_piece_sizes_options_take(size: object, tmp_path: Path):
    """``segment_piece_size`` in a config file (with recompute_segments) is accepted
    exactly where ``Options(segment_piece_size=...)`` is; the messages are the config's
    own, at the key (``FILE:LINE:COL``)."""
    path = tmp_path / "c.toml"
    literal = json.dumps(size) if not isinstance(size, bool) else str(size).lower()
    path.write_text(
        f'recompute_segments = "blocks"\nsegment_piece_size = {literal}\n'
        '[default]\ncompressor = "none"\n',
        encoding="utf-8",
    )
    try:
        resolve("nocompress", str(path))
        config_takes = True
    except Exception:  # noqa: BLE001 - a ConfigError at the key
        config_takes = False
    assert config_takes == (check_field("segment_piece_size", size) is None)
