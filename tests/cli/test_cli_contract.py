"""The command line's contract, for every option combination: a module, or one refusal.

``unroll generate`` over a fixed product of its options either writes a module (exit 0)
or refuses in one diagnostic (exit 2): one ``unroll: error:`` line, or a model-file
``FILE:LINE:COL: error:`` line with its source line and caret. Never a traceback, never a
framed (box-drawing) one. An exception no command expects (a bug) is one ``unroll:
internal error:`` line naming the exception, ``--debug`` and a log file that holds the
traceback, exit 70; ``--debug`` or ``UNROLL_DEBUG=1`` let the traceback through. The
refusals of options that do not combine name the options as they are typed.
"""

from __future__ import annotations

import itertools
import re
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import unroller.cli as cli
from unroller import crash
from unroller.bench import cli as bench_cli
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.errors import OptionError

ROOT = Path(__file__).resolve().parents[2]
FANOUT = ROOT / "tests" / "models" / "fanout.txt"  # small, with two instances of a block
QUICK = ROOT / "benchmarks" / "models" / "quick.txt"

runner = CliRunner()

DIAGNOSTIC = re.compile(r"^\S[^:\n]*:\d+:\d+: error: \S")
FILE_ERROR = re.compile(r"^\S[^:\n]*: error: \S")  # a file as a whole: FILE: error: ...
INTERNAL = re.compile(
    r"^unroll: internal error: (?P<what>.+) \(a bug in unroller; rerun with --debug for the "
    r"traceback, or see (?P<log>.+)\)$"
)
FRAME = frozenset("│╭╮╰╯─┃━┏┓┗┛")  # rich's traceback frame


@pytest.fixture(autouse=True)
def _private_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Crash logs in this test's folder; neither --debug nor UNROLL_DEBUG left over."""
    logs = tmp_path / "tmp"
    logs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(logs))
    monkeypatch.delenv(crash.DEBUG_ENV, raising=False)
    crash.set_debug(False)
    return logs


def one_refusal(stderr: str) -> None:
    """One ``unroll: error:`` or ``FILE: error:`` line, or ``FILE:LINE:COL: error:`` with
    the quoted source line, its caret and an optional note."""
    lines = stderr.splitlines()
    assert lines, "a refusal says why"
    if lines[0].startswith("unroll: error: ") or FILE_ERROR.match(lines[0]):
        assert len(lines) == 1, stderr
        return
    assert DIAGNOSTIC.match(lines[0]), stderr
    assert 3 <= len(lines) <= 4 and lines[2].lstrip().startswith("^"), stderr
    assert len(lines) == 3 or lines[3].startswith("  note: "), stderr


def assert_contract(result, out: Path) -> None:
    """Exit 0 with a module written, or exit 2 with one refusal; no traceback at all."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output and not FRAME & set(result.output), result.output
    if result.exit_code == 0:
        compile(out.read_text(encoding="utf-8"), str(out), "exec")
    else:
        assert result.exit_code == 2, result.output
        one_refusal(result.stderr)
        assert not out.exists()


# ---- (1) the option matrix -------------------------------------------------------------

#: Where the module runs: mostly what each platform takes, and a few that it does not.
TARGETS = (
    ["--platform", "gpu"],
    ["--platform", "gpu", "--data-parallel"],
    ["--platform", "gpu", "--pipeline", "2"],
    ["--platform", "ipu"],
    ["--platform", "ipu", "--num-ipus", "2"],
    ["--platform", "ipu", "--data-parallel"],
    ["--platform", "gpu", "--num-ipus", "2"],
)
SCHEMES = (["--scheme", "nocompress"], ["--scheme", "quant"], ["--scheme", "dct-dense"])
RECOMPUTE = ([], ["--recompute"])
SEGMENTS = (
    [],
    ["--recompute-segments", "blocks"],
    ["--recompute-segments", "u1", "--segment-pieces", "2"],
    ["--recompute-segments", "blocks", "--segment-piece-size", "2"],
    ["--segment-pieces", "2"],  # pieces of nothing
)
DIMENSIONS = (TARGETS, SEGMENTS, SCHEMES, RECOMPUTE)

ALL = list(itertools.product(*DIMENSIONS))
#: Every 11th combination (11 is prime to every dimension's size; each value of each
#: option comes up, ``test_the_matrix_covers_every_value``): a fixed list of 20, and
#: three that generate which the stride passes by.
STRIDE = 11
MATRIX = [sum(case, []) for case in ALL[::STRIDE]] + [
    ["--platform", "gpu", "--pipeline", "2", "--scheme", "quant", "--recompute"],
    ["--recompute-segments", "u1", "--segment-pieces", "2", "--scheme", "quant", "--recompute"],
    ["--platform", "ipu", "--num-ipus", "2", "--scheme", "dct-dense"],
]


@pytest.mark.parametrize("args", MATRIX, ids=" ".join)
def test_every_combination_is_a_module_or_one_refusal(args: list[str], tmp_path: Path):
    out = tmp_path / "m.py"
    result = runner.invoke(app, ["generate", str(FANOUT), *args, "-o", str(out)])
    assert_contract(result, out)


def test_the_matrix_covers_every_value():
    for i, dimension in enumerate(DIMENSIONS):
        assert {tuple(case[i]) for case in ALL[::STRIDE]} == set(map(tuple, dimension))


# ---- (3) what does not combine names its options ---------------------------------------

SEGMENTS_CONFIG = 'recompute_segments = "blocks"\n[default]\ncompressor = "none"\n'


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["--recompute-segments", "blocks", "--segment-pieces", "2", "--platform", "ipu"],
            ["--segment-pieces", "--platform ipu"],
        ),
        (
            ["--recompute-segments", "blocks", "--segment-pieces", "2", "--data-parallel"],
            ["--segment-pieces", "--data-parallel"],
        ),
        (
            ["--recompute-segments", "blocks", "--platform", "ipu", "--num-ipus", "2"],
            ["--recompute-segments", "--num-ipus 2"],
        ),
        (["--recompute-segments", "blocks", "--pipeline", "2"], ["--recompute-segments"]),
        (["--segment-pieces", "2"], ["--segment-pieces", "--recompute-segments"]),
        (["--pipeline", "2", "--platform", "ipu"], ["--pipeline", "--platform ipu"]),
        (["--pipeline", "2", "--data-parallel"], ["--pipeline", "--data-parallel"]),
        (["--data-parallel", "--platform", "ipu"], ["--data-parallel", "--platform gpu"]),
        (
            ["--recompute-segments", "blocks", "--segment-piece-size", "2", "--platform", "ipu"],
            ["--segment-piece-size", "--platform ipu"],
        ),
        (["--platform", "ipu", "--num-ipus", "2", "--stage-starts", "bogus"], ["--stage-starts"]),
        (["--pipeline", "2", "--stage-starts", "e,f"], ["--stage-starts", "--pipeline 2"]),
        (["--recompute-segments", "nope"], ["recompute segment 'nope'"]),
    ],
)
def test_a_refused_combination_names_its_options(args: list[str], named: list[str], tmp_path):
    out = tmp_path / "m.py"
    result = runner.invoke(app, ["generate", str(FANOUT), *args, "-o", str(out)])
    assert_contract(result, out)
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(("unroll: error: ", f"{FANOUT}: error: "))
    for flag in named:
        assert flag in result.stderr, (flag, result.stderr)


@pytest.mark.parametrize(
    "extra, args, named",
    [
        (
            "segment_piece_size = 2\n",
            ["--platform", "ipu"],
            ["segment_piece_size", "--platform ipu"],
        ),
        (
            "segment_piece_size = 2\n",
            ["--data-parallel"],
            ["segment_piece_size", "--data-parallel"],
        ),
        ("", ["--platform", "ipu", "--num-ipus", "2"], ["recompute_segments", "--num-ipus 2"]),
        ("", ["--pipeline", "2"], ["recompute_segments", "--pipeline 2"]),
    ],
)
def test_a_config_the_options_contradict_names_the_segment_and_the_options(
    extra: str, args: list[str], named: list[str], tmp_path: Path
):
    """Segments asked for by a compression config reach the generator, which refuses at
    the segment's block call (``u1 = unit(...)``), naming the config key and the option."""
    path = config(tmp_path, SEGMENTS_CONFIG.replace("[default]", extra + "[default]", 1))
    out = tmp_path / "m.py"
    cmd = ["generate", str(FANOUT), "--compress-config", path, *args, "-o", str(out)]
    result = runner.invoke(app, cmd)
    assert_contract(result, out)
    assert result.exit_code == 2 and re.match(
        rf"^{re.escape(str(FANOUT))}:20:5: error: ", result.stderr
    )
    assert "segment 'u1'" in result.stderr and "u1 = unit(a, ch=4)" in result.stderr
    for word in [*named, "--compress-config"]:
        assert word in result.stderr, (word, result.stderr)


def test_a_refusal_escapes_what_the_user_typed(tmp_path: Path):
    out = tmp_path / "m.py"
    starts = "bo\x1b[2Jgus\rx"
    args = ["--platform", "ipu", "--num-ipus", "2", "--stage-starts", starts, "-o", str(out)]
    result = runner.invoke(app, ["generate", str(FANOUT), *args])
    assert_contract(result, out)
    assert result.exit_code == 2 and "\x1b" not in result.stderr and "\r" not in result.stderr
    assert "--stage-starts names unknown node 'bo\\x1b[2Jgus\\x0dx'" in result.stderr


def test_recompute_under_pipeline_names_both_options_and_the_statement(tmp_path: Path):
    out = tmp_path / "m.py"
    result = runner.invoke(
        app, ["generate", str(QUICK), "--recompute", "--pipeline", "2", "-o", str(out)]
    )
    assert_contract(result, out)
    first = result.stderr.splitlines()[0]
    assert result.exit_code == 2 and DIAGNOSTIC.match(first), result.stderr
    assert "(--recompute)" in first and "--pipeline 2" in first and "'r'" in first


def test_the_library_refuses_options_by_their_arguments():
    """Callers that skip the CLI get the same refusals when they make ``Options``, naming
    the keyword arguments they typed, as an ``OptionError`` (a ``ValueError`` too) that
    names the field; rendered for the command line, the same message names the flags."""
    cases = [
        (dict(platform="ipu", pipeline=2), "pipeline= is not for platform='ipu'"),
        (dict(num_ipus=2), "num_ipus= and stage_starts= are for platform='ipu'"),
        (dict(stage_starts=("b",)), "num_ipus= and stage_starts= are for platform='ipu'"),
        (dict(platform="ipu", data_parallel=True), "data_parallel= is for platform='gpu'"),
        (
            dict(segment_pieces=2, segment_piece_size=2),
            "segment_pieces= and segment_piece_size=: give one of them",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(OptionError, match=re.escape(message)) as caught:
            Options(**kwargs)
        assert isinstance(caught.value, ValueError) and caught.value.field in kwargs
        flags = caught.value.render("cli")
        assert all(f"--{name.replace('_', '-')}" in flags for name in kwargs), flags


# ---- (2) an internal error -------------------------------------------------------------


def boom(*args, **kwargs):
    raise KeyError(1234)


def internal_line(result) -> tuple[str, Path]:
    """The one line of an internal error: what it names, and its log file."""
    assert result.exit_code == crash.INTERNAL_ERROR, result.output
    assert "Traceback" not in result.output and not FRAME & set(result.output), result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].isprintable(), lines[0]
    found = INTERNAL.match(lines[0])
    assert found, lines[0]
    return found["what"], Path(found["log"])


def test_an_internal_error_is_one_line_and_a_log(tmp_path: Path, monkeypatch, _private_logs):
    import unroller.compiler.codegen

    monkeypatch.setattr(unroller.compiler.codegen, "render_training", boom)
    out = tmp_path / "m.py"
    result = runner.invoke(app, ["generate", str(FANOUT), "-o", str(out)])
    what, log = internal_line(result)
    assert what == "KeyError: 1234"
    assert log.parent == _private_logs and log.is_file()
    text = log.read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in text and "KeyError: 1234" in text
    assert "render_training" in text and "unroll generate" in text
    assert not out.exists()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_lets_the_traceback_through(how: str, monkeypatch, _private_logs):
    import unroller.compiler.codegen

    monkeypatch.setattr(unroller.compiler.codegen, "render_training", boom)
    args = ["generate", str(FANOUT)]
    if how == "flag":
        args = ["--debug", *args]
    else:
        monkeypatch.setenv(crash.DEBUG_ENV, "1")
    result = runner.invoke(app, args)
    assert isinstance(result.exception, KeyError) and result.exception.args == (1234,)
    assert "internal error" not in result.stderr and not list(_private_logs.iterdir())
    with pytest.raises(KeyError):
        runner.invoke(app, args, catch_exceptions=False)
    monkeypatch.delenv(crash.DEBUG_ENV, raising=False)
    again = runner.invoke(app, ["generate", str(FANOUT)])  # --debug does not stick
    internal_line(again)


def test_the_line_and_the_log_path_escape_control_characters(tmp_path: Path, monkeypatch):
    hostile = tmp_path / "t\x1b[2Jmp\nfake: line"
    hostile.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(hostile))

    def raising(*args, **kwargs):
        raise RuntimeError("bad \x1b[31mname\r\nunroll: error: forged\x07")

    monkeypatch.setattr("unroller.cli.generate.generate_source", raising)
    result = runner.invoke(app, ["generate", str(FANOUT)])
    what, _ = internal_line(result)
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert what == "RuntimeError: bad \\x1b[31mname\\x0d\\x0aunroll: error: forged\\x07"
    logs = list(hostile.iterdir())
    assert len(logs) == 1 and "forged" in logs[0].read_text(encoding="utf-8")


def test_an_error_outside_any_command_is_one_line(monkeypatch, capsys, _private_logs):
    monkeypatch.setattr(cli, "app", boom)
    monkeypatch.setattr("sys.argv", ["unroll", "generate", "x.txt"])
    with pytest.raises(SystemExit) as caught:
        cli.main()
    assert caught.value.code == crash.INTERNAL_ERROR
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and INTERNAL.match(line.rstrip("\n")), line
    assert len(list(_private_logs.iterdir())) == 1


def test_an_internal_error_in_the_benchmark_harness(monkeypatch, capsys, _private_logs):
    monkeypatch.setattr(bench_cli, "_dispatch", boom)
    result = runner.invoke(app, ["bench", "--benchmark", "quick"])
    assert result.exit_code == crash.INTERNAL_ERROR, result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("unroll: internal error: KeyError: 1234 ")
    assert "unroll --debug bench" in line
    assert bench_cli.run([], "python -m benchmarks.run") == crash.INTERNAL_ERROR
    line = capsys.readouterr().err
    assert line.startswith("python -m benchmarks.run: internal error: KeyError: 1234 ")
    assert "UNROLL_DEBUG=1" in line and len(list(_private_logs.iterdir())) == 2


def test_ctrl_c_in_the_benchmark_harness_stays_an_interrupt(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli, "_dispatch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench_cli.run([])
