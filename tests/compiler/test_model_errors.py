"""Errors in model files: exact location, a message naming the problem, and the CLI contract.

Every case is a whole model file with one mistake. In process (``graph_from_text``) each
must raise a ``ModelError`` formatted as ``FILE:LINE:COL: error: ...`` at the exact place,
with the source line and a caret under the offending text. Through the CLI
(``unroll generate bad.txt -o out.py`` in a subprocess) each must exit 2 with no
traceback, print the caret, and write nothing, leaving an existing good output file
byte-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from unroller.api import generate_from_text, graph_from_text
from unroller.errors import ModelError

UNROLL = Path(sys.executable).with_name("unroll")
FILE = "bad.txt"

HEAD = """\
model m {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
"""
# A valid ending: every case below is HEAD + its own lines (from line 4) + TAIL.
TAIL = """\
    f_ = flatten(x)
    l_ = linear(f_, out_features=10)
    loss_ = cross_entropy(l_, y)
    return loss_
}
"""

BLOCK = """\
    block b(v, c, k=3) {
        h = conv2d(v, out_channels=c, kernel_size=k, padding=1)
        r = relu(h)
        return r
    }
"""


@dataclass(frozen=True)
class Case:
    id: str
    source: str
    line: int
    token: str  # the text the caret must point at, on that line
    words: tuple[str, ...]  # what the message must say
    nth: int = 0  # which occurrence of token on the line

    @property
    def col(self) -> int:
        text = self.source.splitlines()[self.line - 1]
        index = -1
        for _ in range(self.nth + 1):
            index = text.index(self.token, index + 1)
        return index + 1

    @property
    def prefix(self) -> str:
        return f"{FILE}:{self.line}:{self.col}: error: "


def stmts(*lines: str, tail: str = TAIL, head: str = HEAD) -> str:
    return head + "".join(f"    {line}\n" for line in lines) + tail


def whole(*lines: str) -> str:
    """A model whose body (from line 4) is exactly ``lines``, ending with '}'."""
    return stmts(*lines, tail="}\n")


CASES = [
    Case(
        "syntax",
        stmts("a = relu(x y)"),
        4,
        "y",
        ("unexpected name 'y'", "expected", "','", "')'"),
    ),
    Case(
        "syntax-unterminated-call",
        stmts("a = relu(x"),
        5,
        "f_",
        ("unexpected name 'f_'", "expected"),
    ),
    Case(
        "unknown-op",
        stmts("a = reluu(x)"),
        4,
        "reluu",
        ("unknown operator 'reluu'", "did you mean 'relu'"),
    ),
    Case(
        "unknown-arg",
        stmts("a = conv2d(x, out_channels=4, kernel_size=3, strid=2)"),
        4,
        "strid",
        ("conv2d has no argument 'strid'", "did you mean 'stride'"),
    ),
    Case(
        "missing-arg",
        stmts("a = conv2d(x, out_channels=4)"),
        4,
        "conv2d",
        ("conv2d needs the argument 'kernel_size'",),
    ),
    Case(
        "ill-typed-string-for-int",
        stmts('a = conv2d(x, out_channels=4, kernel_size="3")'),
        4,
        '"3"',
        ("'kernel_size' must be an integer or a pair", "got '3'"),
    ),
    Case(
        "ill-typed-int-for-bool",
        stmts("a = conv2d(x, out_channels=4, kernel_size=3, bias=1)"),
        4,
        "1",
        ("'bias' must be true or false", "got 1"),
    ),
    Case(
        "out-of-range-stride",
        stmts("a = conv2d(x, out_channels=4, kernel_size=3, stride=0)"),
        4,
        "0)",
        ("'stride'", ">= 1", "got 0"),
    ),
    Case(
        "too-many-positional-to-op",
        stmts("a = relu(x, x)"),
        4,
        "x",
        ("relu takes 1 tensor argument", "got 2"),
        nth=1,
    ),
    Case(
        "undefined-name",
        stmts("a = relu(xx)"),
        4,
        "xx",
        ("undefined name 'xx'", "did you mean 'x'"),
    ),
    Case(
        "reassigned-name",
        stmts("a = relu(x)", "a = tanh(x)"),
        5,
        "a",
        ("'a' is already defined", "line 4", "assigned once"),
    ),
    Case(
        "reassigned-input",
        stmts("x = relu(x)"),
        4,
        "x",
        ("'x' is already defined", "line 2"),
    ),
    Case(
        "reassigned-inside-block",
        HEAD
        + BLOCK.replace("r = relu(h)", "h = relu(h)").replace("return r", "return h")
        + "    o = b(x, c=4)\n"
        + TAIL,
        6,
        "h",
        ("'o.h' is already defined", "line 5"),
    ),
    Case(
        "add-shape-mismatch",
        stmts("a = conv2d(x, out_channels=4, kernel_size=3)", "s = add(a, x)"),
        5,
        "x",
        ("add", "f32[N, 4, 6, 6]", "f32[N, 3, 8, 8]"),
    ),
    Case(
        "conv-output-below-1",
        stmts("a = conv2d(x, out_channels=4, kernel_size=9)"),
        4,
        "conv2d",
        ("conv2d", "below 1", "0x0", "8x8"),
    ),
    Case(
        "concat-mismatch",
        stmts("a = conv2d(x, out_channels=4, kernel_size=3)", "c = concat(a, x)"),
        5,
        "x",
        ("concat", "f32[N, 3, 8, 8]", "f32[N, 4, 6, 6]", "dim 1"),
    ),
    Case(
        "block-too-many-positional",
        HEAD + BLOCK + "    o = b(x, x, x, x)\n" + TAIL,
        9,
        "x",
        ("block 'b' takes at most 3", "got 4"),
        nth=3,
    ),
    Case(
        "block-unknown-keyword",
        HEAD + BLOCK + "    o = b(x, c=4, kk=3)\n" + TAIL,
        9,
        "kk",
        ("block 'b' has no parameter 'kk'", "did you mean 'k'"),
    ),
    Case(
        "block-missing-param",
        HEAD + BLOCK + "    o = b(x)\n" + TAIL,
        9,
        "b",
        ("block 'b' needs a value for parameter 'c'",),
    ),
    Case(
        "recursion",
        HEAD + BLOCK.replace("r = relu(h)", "r = b(h, c=c)") + "    o = b(x, c=4)\n" + TAIL,
        6,
        "b",
        ("recursive block call", "b -> b"),
    ),
    Case(
        "mutual-recursion",
        HEAD
        + "    block p(v) {\n        r = q(v)\n        return r\n    }\n"
        + "    block q(v) {\n        r = p(v)\n        return r\n    }\n"
        + "    o = q(x)\n"
        + TAIL,
        5,
        "q",
        ("recursive block call", "q -> p -> q"),
    ),
    Case(
        "return-non-scalar",
        whole("a = relu(x)", "return a"),
        5,
        "a",
        ("scalar loss", "'a' is f32[N, 3, 8, 8]"),
    ),
    Case(
        "return-scalar-not-from-loss",
        whole(
            "f = flatten(x)",
            "l = linear(f, out_features=10)",
            "loss = cross_entropy(l, y)",
            "s = relu(loss)",
            "return s",
        ),
        8,
        "s",
        ("'s' is a scalar but not produced by a loss op",),
    ),
    Case(
        "unknown-dtype",
        stmts(head="model m {\n    input x: f23[N, 3, 8, 8]\n    target y: i64[N]\n"),
        2,
        "f23",
        ("unknown dtype 'f23'", "f32", "did you mean 'f32'"),
    ),
    Case(
        "first-dim-not-N",
        stmts(head="model m {\n    input x: f32[4, 3, 8, 8]\n    target y: i64[N]\n"),
        2,
        "4",
        ("the first dim must be N", "got '4'"),
    ),
    Case(
        "prediction-is-a-target",
        whole(
            "f = flatten(x)",
            "l = linear(f, out_features=10)",
            "loss = cross_entropy(l, y)",
            "return loss, l, y",
        ),
        7,
        "y",
        ("prediction 'y' depends on target 'y'", "predict()"),
    ),
    Case(
        "prediction-depends-on-target",
        stmts(
            "f = flatten(x)",
            "l = linear(f, out_features=4)",
            "d = add(l, t)",
            "loss = mse_loss(l, t)",
            "return loss, d",
            head="model m {\n    input x: f32[N, 3, 8, 8]\n    target t: f32[N, 4]\n",
            tail="}\n",
        ),
        8,
        "d",
        ("prediction 'd' depends on target 't'",),
    ),
    Case(
        "value-as-keyword-constant",
        stmts("a = conv2d(x, out_channels=x, kernel_size=3)"),
        4,
        "x",
        ("'x' is a tensor value", "keyword arguments take constants"),
        nth=1,
    ),
    Case(
        "constant-param-as-value",
        HEAD + BLOCK.replace("r = relu(h)", "r = relu(c)") + "    o = b(x, c=4)\n" + TAIL,
        6,
        "c",
        ("'c' is a constant block parameter", "not a value"),
    ),
    Case(
        "keyword-given-twice",
        stmts("a = linear(x, out_features=3, out_features=4)"),
        4,
        "out_features",
        ("keyword argument 'out_features' given twice",),
        nth=1,
    ),
    Case(
        "block-named-like-an-op",
        HEAD + BLOCK.replace("block b(", "block relu(") + TAIL,
        4,
        "relu",
        ("block 'relu' has the name of an operator",),
    ),
]
BY_ID = {case.id: case for case in CASES}


def error_text(source: str) -> str:
    with pytest.raises(ModelError) as info:
        graph_from_text(source, FILE)
    return info.value.format(FILE, source)


def check_caret(text: str, case: Case) -> None:
    """The message line, then the source line, then a caret under the token."""
    lines = text.splitlines()
    assert lines[0].startswith(case.prefix), (lines[0], case.prefix)
    source_line = case.source.splitlines()[case.line - 1]
    assert lines[1] == "    " + source_line
    caret = lines[2]
    assert caret.startswith("    " + " " * (case.col - 1) + "^"), caret
    assert set(caret.strip()) <= {"^", "~"}


def test_case_sources_are_valid_apart_from_the_mistake():
    """The scaffolding itself is a valid model, so each case tests only its mistake."""
    graph = graph_from_text(stmts(), FILE)
    assert graph.loss.name == "loss_"
    block_ok = graph_from_text(HEAD + BLOCK + "    o = b(x, c=4)\n" + TAIL, FILE)
    assert block_ok.node("o.h").op.name == "conv2d"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_error_location_and_message(case: Case):
    text = error_text(case.source)
    check_caret(text, case)
    message = (
        text.splitlines()[0]
        + "\n"
        + "\n".join(line for line in text.splitlines() if line.startswith("  note:"))
    )
    for words in case.words:
        assert words in message, (words, message)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_error_also_stops_generation(case: Case):
    """The generator (which also runs the codegen-time checks) refuses every case."""
    with pytest.raises(ModelError) as info:
        generate_from_text(case.source, label=FILE)
    assert info.value.format(FILE, case.source).startswith(case.prefix)


def test_shape_mismatch_names_op_and_both_shapes_in_order():
    text = error_text(stmts("a = conv2d(x, out_channels=4, kernel_size=3)", "s = mul(x, a)"))
    first = text.splitlines()[0]
    assert "mul" in first
    assert first.index("f32[N, 3, 8, 8]") < first.index("f32[N, 4, 6, 6]")


def test_block_error_names_the_inlined_path():
    """A shape error inside a block says which call it came from (the prefixed name)."""
    source = HEAD + BLOCK + "    o = b(y, c=4)\n" + TAIL
    text = error_text(source)
    assert text.startswith(f"{FILE}:5:")
    assert "o.h: conv2d needs a 4-D input" in text and "i64[N]" in text


def test_unused_input_is_a_warning_not_an_error():
    source = stmts(head=HEAD + "    input z: f32[N, 2]\n")
    graph = graph_from_text(source, FILE)
    texts = [w.format(FILE, source) for w in graph.warnings]
    assert any(t.startswith(f"{FILE}:4:11: warning: input 'z' is never used") for t in texts)
    generate_from_text(source, label=FILE)  # generation still succeeds


def test_huge_upsample_scale_is_a_model_error():
    source = stmts("a = upsample(x, scale_factor=1e308)")
    with pytest.raises(ModelError):
        graph_from_text(source, FILE)


# ---- through the CLI, in a subprocess -----------------------------------------------------


def unroll(*args: str, cwd: Path, real: bool = True) -> subprocess.CompletedProcess:
    """The ``unroll`` command in ``cwd``: the installed script in its own process, or (``real``
    False) the same Typer app in this one, ~20x faster, where an escaping exception is
    re-raised (it would be a traceback in the real process)."""
    if not real:
        return _unroll_in_process(args, cwd)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [str(UNROLL), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=120
    )


def _unroll_in_process(args: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess:
    from typer.testing import CliRunner

    from unroller.cli import app

    before = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(before)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def good_output() -> str:
    """A good generated file (the text an earlier successful run left in out.py)."""
    return generate_from_text(stmts(), label=FILE)


def assert_cli_error(result: subprocess.CompletedProcess, case: Case) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{FILE}:"))
    check_caret("\n".join(lines[start:]), case)


# Every error class through the command, no output file before: a few in the real process
# (exit status and stderr as a shell sees them), the rest through the same app in process.
REAL_PROCESS = ("syntax", "add-shape-mismatch", "prediction-depends-on-target")
SWEEP = [
    "syntax",
    "unknown-op",
    "unknown-arg",
    "missing-arg",
    "ill-typed-string-for-int",
    "undefined-name",
    "reassigned-name",
    "add-shape-mismatch",
    "conv-output-below-1",
    "concat-mismatch",
    "block-too-many-positional",
    "block-unknown-keyword",
    "recursion",
    "return-non-scalar",
    "return-scalar-not-from-loss",
    "unknown-dtype",
    "prediction-depends-on-target",
]


@pytest.mark.parametrize("case_id", SWEEP)
def test_cli_error_exits_2_and_writes_nothing(tmp_path: Path, case_id: str):
    case = BY_ID[case_id]
    (tmp_path / FILE).write_text(case.source, encoding="utf-8")
    real = case_id in REAL_PROCESS
    result = unroll("generate", FILE, "--platform", "gpu", "-o", "out.py", cwd=tmp_path, real=real)
    assert_cli_error(result, case)
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]  # no out.py, no temp file


@pytest.mark.parametrize("case_id", ["syntax", "add-shape-mismatch", "block-missing-param"])
def test_cli_error_leaves_existing_output_byte_identical(
    tmp_path: Path, case_id: str, good_output: str
):
    case = BY_ID[case_id]
    (tmp_path / FILE).write_text(case.source, encoding="utf-8")
    out = tmp_path / "out.py"
    out.write_text(good_output, encoding="utf-8")
    before = out.read_bytes()
    stat = out.stat()
    result = unroll("generate", FILE, "-o", "out.py", "--force", cwd=tmp_path)
    assert_cli_error(result, case)
    assert out.read_bytes() == before
    assert out.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE, "out.py"]


def test_cli_warning_for_unused_input_still_generates(tmp_path: Path):
    (tmp_path / FILE).write_text(stmts(head=HEAD + "    input z: f32[N, 2]\n"), encoding="utf-8")
    result = unroll("generate", FILE, "-o", "out.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    index = lines.index(f"{FILE}:4:11: warning: input 'z' is never used")
    assert lines[index + 1] == "        input z: f32[N, 2]"
    assert lines[index + 2] == "    " + " " * 10 + "^"
    assert (tmp_path / "out.py").is_file()


def test_cli_missing_model_file(tmp_path: Path):
    result = unroll("generate", "nope.txt", "-o", "out.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "nope.txt" in result.stderr and "error:" in result.stderr
    assert list(tmp_path.iterdir()) == []
