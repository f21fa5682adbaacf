"""Hostile model text: each case is a clean ``ModelError`` at the exact place, never a crash.

Reproducers for what used to escape the front end: a ``RecursionError`` from 1,000 nested
block calls or 400 nested 1-tuples, a ``ValueError`` from a 5,000-digit integer, a
non-UTF-8 file reported without a line and column, a leading byte-order mark refused,
sizes, strides and dims beyond int64 (or beyond what any machine holds) and floats such
as ``negative_slope=1e308`` accepted and failing at run time, an ``i32`` target for
cross_entropy accepted and failing in torch. Also: NaN and infinity, control and
bidirectional characters, mixed float dtypes, oversized tensors and parameters, too many
operator calls, and model files that are directories, FIFOs or too large.

Each case asserts the message and the exact ``LINE:COL``; a few go through the real
``unroll generate FILE -o OUT`` (exit 2, ``FILE:LINE:COL: error:``, no traceback, no
output file).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from unroller.api import graph_from_text
from unroller.compiler.graph import MAX_BLOCK_DEPTH, MAX_NODES
from unroller.compiler.parser import (
    MAX_SOURCE_BYTES,
    MAX_TUPLE_DEPTH,
    parse,
    parse_file,
    read_source,
)
from unroller.errors import ModelError

UNROLL = Path(sys.executable).with_name("unroll")
FILE = "bad.txt"

HEAD = """\
model m {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
"""
TAIL = """\
    f_ = flatten(x)
    l_ = linear(f_, out_features=10)
    loss_ = cross_entropy(l_, y)
    return loss_
}
"""


def stmts(*lines: str, head: str = HEAD, tail: str = TAIL) -> str:
    """HEAD, then ``lines`` from line 4, then a valid ending."""
    return head + "".join(f"    {line}\n" for line in lines) + tail


def vector(*lines: str, x: str = "f32[N, 4]", y: str = "f32[N, 4]") -> str:
    """A model on vectors: ``lines`` from line 4, the last ones return the loss."""
    head = f"model m {{\n    input x: {x}\n    target y: {y}\n"
    return head + "".join(f"    {line}\n" for line in lines) + "}\n"


@dataclass(frozen=True)
class Case:
    id: str
    source: str
    line: int
    col: int
    words: tuple[str, ...]


def error(source: str) -> ModelError:
    with pytest.raises(ModelError) as info:
        graph_from_text(source, FILE)
    return info.value


def col_of(source: str, line: int, needle: str, nth: int = 0) -> int:
    text = source.split("\n")[line - 1]
    index = -1
    for _ in range(nth + 1):
        index = text.index(needle, index + 1)
    return index + 1


# ---- the cases ------------------------------------------------------------------------

DEEP_BLOCKS = (
    HEAD
    + "    block b0(v) {\n        o = relu(v)\n        return o\n    }\n"
    + "".join(
        f"    block b{i}(v) {{\n        o = b{i - 1}(v)\n        return o\n    }}\n"
        for i in range(1, 1000)
    )
    + "    z = b999(x)\n"
    + TAIL
)
# The call that goes one level too deep: the one in the body of the MAX_BLOCK_DEPTH-th block
# being inlined (b999 is the first), on the second line of its four-line definition.
_DEEP_BLOCK = 999 - MAX_BLOCK_DEPTH + 1
_DEEP_LINE = 4 + 4 * _DEEP_BLOCK + 1

MUTUAL = (
    HEAD
    + "    block a(v) {\n        o = c(v)\n        return o\n    }\n"
    + "    block c(v) {\n        o = a(v)\n        return o\n    }\n"
    + "    z = a(x)\n"
    + TAIL
)

WIDE_BLOCKS = (
    HEAD
    + "    block w0(v) {\n        o = relu(v)\n        return o\n    }\n"
    + "".join(
        f"    block w{i}(v) {{\n        p = w{i - 1}(v)\n        q = w{i - 1}(p)\n"
        f"        return q\n    }}\n"
        for i in range(1, 20)
    )
    + "    z = w19(x)\n"
    + TAIL
)

TUPLES = stmts("a = conv2d(x, out_channels=4, kernel_size=" + "(" * 400 + "3" + ",)" * 400 + ")")
PARENS = stmts("a = conv2d(x, out_channels=4, kernel_size=" + "(" * 400 + "3" + ")" * 400 + ")")
HUGE_INT = "9" * 5000

CASES = [
    Case(
        "1000-nested-block-calls",
        DEEP_BLOCKS,
        _DEEP_LINE,
        13,
        (
            f"block calls nested more than {MAX_BLOCK_DEPTH} deep",
            "b999 -> b998",
            f"-> b{_DEEP_BLOCK - 1})",
        ),
    ),
    Case(
        "recursion-between-blocks",
        MUTUAL,
        9,
        13,
        ("recursive block call (a -> c -> a)",),
    ),
    Case(
        "exponential-inlining",
        WIDE_BLOCKS,
        # w0's relu is reached through the first p of each level; node MAX_NODES + 1 is
        # the relu of some w0 call: line 5 (w0's body).
        5,
        13,
        (f"more than {MAX_NODES:,} operator calls once blocks are inlined", "z.p.p.p"),
    ),
    Case(
        "400-nested-1-tuples",
        TUPLES,
        4,
        col_of(TUPLES, 4, "((") + MAX_TUPLE_DEPTH,
        (f"tuples nested more than {MAX_TUPLE_DEPTH} deep",),
    ),
    Case(
        "400-nested-parentheses",
        PARENS,
        4,
        col_of(PARENS, 4, "(("),
        ("parentheses around a single value",),
    ),
    Case(
        "5000-digit-integer",
        stmts(f"a = conv2d(x, out_channels={HUGE_INT}, kernel_size=3)"),
        4,
        32,
        ("integer 999999999999...(5000 digits) is too large", "must fit in 64 bits"),
    ),
    Case(
        "5000-digit-dim",
        stmts(head=HEAD.replace("8, 8]", f"8, {HUGE_INT}]")),
        2,
        27,
        ("integer 999999999999...(5000 digits) is too large",),
    ),
    Case(
        "leading-zeros-are-not-digits-to-convert",
        stmts("a = conv2d(x, out_channels=4, kernel_size=" + "0" * 5000 + "1, stride=0)"),
        4,
        col_of(
            stmts("a = conv2d(x, out_channels=4, kernel_size=" + "0" * 5000 + "1, stride=0)"),
            4,
            "0)",
        ),
        ("'stride' must be an integer or a pair (h, w) >= 1, got 0",),
    ),
    Case(
        "integer-beyond-int64",
        stmts(f"a = conv2d(x, out_channels={2**63}, kernel_size=3)"),
        4,
        32,
        ("integer 9223372036854775808 is too large",),
    ),
    Case(
        "negative-integer-beyond-int64",
        stmts(f"a = reshape(x, shape=({-(2**63)}, -1))"),
        4,
        27,
        ("integer -9223372036854775808 is too large",),
    ),
    Case(
        "channels-beyond-int32",
        stmts(f"a = conv2d(x, out_channels={2**31}, kernel_size=3)"),
        4,
        32,
        ("'out_channels' must be an integer", "at most 2,147,483,647", "got 2147483648"),
    ),
    Case(
        "stride-beyond-int32",
        stmts(f"a = conv2d(x, out_channels=4, kernel_size=3, stride=(1, {2**40}))"),
        4,
        57,
        ("'stride' must be an integer or a pair", "at most 2,147,483,647"),
    ),
    Case(
        "reshape-dim-beyond-int32",
        stmts(f"a = reshape(x, shape=({2**33}, -1))"),
        4,
        26,
        ("'shape' must be a tuple of integers", "at most 2,147,483,647"),
    ),
    Case(
        "concat-dim-beyond-int32",
        stmts(f"a = concat(x, x, dim={2**40})"),
        4,
        26,
        ("'dim' must be an integer", "at most 2,147,483,647"),
    ),
    Case(
        "declared-dim-beyond-int32",
        stmts(head=HEAD.replace("8, 8]", f"8, {2**31}]")),
        2,
        27,
        ("dim 2147483648 is too large (a dim is at most 2,147,483,647)",),
    ),
    Case(
        "declared-tensor-too-large",
        stmts(head=HEAD.replace("[N, 3, 8, 8]", "[N, 8, 65536, 65536]")),
        2,
        11,
        ("input 'x' is too large", "34,359,738,368 elements per sample", "17,179,869,184"),
    ),
    Case(
        "padding-makes-a-huge-output",
        stmts("a = conv2d(x, out_channels=64, kernel_size=1, padding=1000000)"),
        4,
        9,
        ("a: the output of conv2d would be f32[N, 64, 2000008, 2000008]", "elements per sample"),
    ),
    Case(
        "linear-weight-too-large",
        stmts("f = flatten(x)", "a = linear(f, out_features=2147483647)"),
        5,
        9,
        ("a: linear's weight would be [2147483647, 192]", "more than the limit"),
    ),
    Case(
        "adaptive-pool-output-too-large",
        stmts("a = adaptive_avgpool2d(x, output_size=(2147483647, 2147483647))"),
        4,
        9,
        ("the output of adaptive_avgpool2d would be", "elements per sample"),
    ),
    Case(
        "negative-slope-1e308",
        stmts("a = leaky_relu(x, negative_slope=1e308)"),
        4,
        38,
        ("'negative_slope' must be a number <= 1000.0, got 1e+308",),
    ),
    Case(
        "negative-slope-below-range",
        stmts("a = leaky_relu(x, negative_slope=-1e5)"),
        4,
        38,
        ("'negative_slope' must be a number >= -1000.0",),
    ),
    Case(
        "eps-too-large",
        stmts("a = batchnorm2d(x, eps=1e30)"),
        4,
        28,
        ("'eps' must be a number <= 1.0",),
    ),
    Case(
        "eps-negative",
        stmts("a = batchnorm2d(x, eps=-1e-5)"),
        4,
        28,
        ("'eps' must be a number >= 0.0",),
    ),
    Case(
        "momentum-above-1",
        stmts("a = batchnorm2d(x, momentum=1.5)"),
        4,
        33,
        ("'momentum' must be a number <= 1.0",),
    ),
    Case(
        "dropout-p-above-1",
        stmts("a = dropout(x, p=1.0000001)"),
        4,
        22,
        ("'p' must be a number <= 1.0",),
    ),
    Case(
        "dropout-p-negative",
        stmts("a = dropout(x, p=-0.1)"),
        4,
        22,
        ("'p' must be a number >= 0.0",),
    ),
    Case(
        "float-literal-overflows",
        stmts("a = leaky_relu(x, negative_slope=1e400)"),
        4,
        38,
        ("number '1e400' is too large for a float",),
    ),
    Case(
        "float-literal-underflows",
        stmts("a = batchnorm2d(x, eps=1e-400)"),
        4,
        28,
        ("number '1e-400' is too small for a float (it would round to 0)",),
    ),
    Case(
        "nan-literal",
        stmts("a = leaky_relu(x, negative_slope=nan)"),
        4,
        38,
        ("undefined constant 'nan'", "no NaN or infinity literal"),
    ),
    Case(
        "inf-literal",
        stmts("a = upsample(x, scale_factor=inf)"),
        4,
        34,
        ("undefined constant 'inf'", "no NaN or infinity literal"),
    ),
    Case(
        "upsample-scale-1e308",
        stmts("a = upsample(x, scale_factor=1e308)"),
        4,
        34,
        ("'scale_factor' must be a number or a pair (h, w)", "at most 3.4e+38"),
    ),
    Case(
        "upsample-scale-1e-300",
        stmts("a = upsample(x, scale_factor=(0.5, 1e-300))"),
        4,
        21,
        ("upsample output size would be 4x0 (below 1)", "the scale factor is too small"),
    ),
    Case(
        "i32-target-for-cross-entropy",
        stmts(head=HEAD.replace("i64[N]", "i32[N]")),
        6,
        31,
        ("loss_: cross_entropy needs class indices i64[N] as its target, got i32[N]",),
    ),
    Case(
        "float-target-for-cross-entropy",
        stmts(head=HEAD.replace("i64[N]", "f32[N]")),
        6,
        31,
        ("cross_entropy needs class indices i64[N] as its target, got f32[N]",),
    ),
    Case(
        "integer-target-for-mse",
        vector(
            "a = linear(x, out_features=4)", "loss = mse_loss(a, y)", "return loss", y="i64[N, 4]"
        ),
        5,
        24,
        ("loss: mse_loss needs a floating-point tensor, got i64[N, 4]",),
    ),
    Case(
        "integer-target-for-bce",
        vector(
            "a = linear(x, out_features=4)",
            "p = sigmoid(a)",
            "loss = bce_loss(p, y)",
            "return loss",
            y="i32[N, 4]",
        ),
        6,
        24,
        ("loss: bce_loss needs a floating-point tensor, got i32[N, 4]",),
    ),
    Case(
        "mixed-float-dtypes",
        vector(
            "a = linear(x, out_features=4)", "loss = mse_loss(a, y)", "return loss", y="f64[N, 4]"
        ),
        3,
        15,
        ("target 'y' is f64 but input 'x' (line 2) is f32", "the same dtype"),
    ),
    Case(
        "nul-in-a-string",
        stmts('a = gelu(x, approximate="no\x00ne")'),
        4,
        32,
        ("control character U+0000 is not allowed in a model file",),
    ),
    Case(
        "escape-sequence-in-a-comment",
        stmts("a = relu(x)  # \x1b[2J\x1b[31mred"),
        4,
        20,
        ("control character U+001B is not allowed",),
    ),
    Case(
        "bidi-override-in-a-comment",
        stmts("a = relu(x)  # \u202eevil"),
        4,
        20,
        ("bidirectional control character U+202E",),
    ),
    Case(
        "line-separator",
        stmts("a = relu(x)\u2028b = relu(x)"),
        4,
        16,
        ("line or paragraph separator U+2028",),
    ),
    Case(
        "lone-surrogate",
        stmts('a = gelu(x, approximate="\udc80")'),
        4,
        30,
        ("lone surrogate U+DC80",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hostile_text_is_a_located_model_error(case: Case):
    exc = error(case.source)
    text = exc.format(FILE, case.source)
    first = text.splitlines()[0]
    assert first.startswith(f"{FILE}:{case.line}:{case.col}: error: "), first[:300]
    message = first + "\n" + "\n".join(line for line in text.splitlines() if "note:" in line)
    for words in case.words:
        assert words in message, (words, message[:500])


def test_i32_target_note_points_at_the_declaration():
    exc = error(stmts(head=HEAD.replace("i64[N]", "i32[N]")))
    assert exc.hint == "target 'y' is declared i32[N] at line 3"


def test_limits_are_not_hit_by_what_is_allowed():
    """At the limits themselves, models still build."""
    depth_ok = (
        HEAD
        + "    block b0(v) {\n        o = relu(v)\n        return o\n    }\n"
        + "".join(
            f"    block b{i}(v) {{\n        o = b{i - 1}(v)\n        return o\n    }}\n"
            for i in range(1, MAX_BLOCK_DEPTH)
        )
        + f"    z = b{MAX_BLOCK_DEPTH - 1}(x)\n"
        + TAIL
    )
    assert graph_from_text(depth_ok, FILE).node(f"z{'.o' * MAX_BLOCK_DEPTH}").op.name == "relu"
    nested = "(" * MAX_TUPLE_DEPTH + "3" + ",)" * MAX_TUPLE_DEPTH
    value = parse(stmts(f"a = conv2d(x, out_channels=4, kernel_size={nested})"), FILE)
    value = value.stmts[0].kwargs[1].value.value
    for _ in range(MAX_TUPLE_DEPTH):
        assert isinstance(value, tuple) and len(value) == 1
        value = value[0]
    assert value == 3
    graph = graph_from_text(
        stmts(
            "a = leaky_relu(x, negative_slope=-1000.0)",
            "b = leaky_relu(a, negative_slope=1000)",
            "c = batchnorm2d(b, eps=1, momentum=0)",
            "d = dropout(c, p=1)",
        ),
        FILE,
    )
    assert graph.node("d").args["p"] == 1.0
    assert parse(stmts(f"a = reshape(x, shape=({2**63 - 1}, -1))"), FILE)


def test_a_long_chain_of_losses_needs_no_recursion():
    """3,000 adds of losses: the 'is it a loss' walk is a loop, not a recursion."""
    lines = ["l0 = mse_loss(a, y)"]
    lines += [f"l{i} = add(l{i - 1}, l0)" for i in range(1, 3000)]
    source = vector("a = linear(x, out_features=4)", *lines, "return l2999")
    graph = graph_from_text(source, FILE)
    assert graph.loss.name == "l2999"


def test_parameters_in_total_are_bounded():
    """Each weight (4800 x 2,000,000) under the limit, the two together over it."""
    lines = ["f = flatten(x)"] + [f"a{i} = linear(f, out_features=2000000)" for i in range(2)]
    source = stmts(*lines, head=HEAD.replace("[N, 3, 8, 8]", "[N, 3, 40, 40]"))
    exc = error(source)
    assert exc.format(FILE, source).startswith(f"{FILE}:6:10: error: a1: the model's parameters")
    assert "more than the limit of 17,179,869,184 (2**34)" in exc.message


# ---- bytes and files -----------------------------------------------------------------------


def test_non_utf8_byte_is_located(tmp_path: Path):
    path = tmp_path / FILE
    text = stmts("a = relu(x)  # café ☕ then a bad byte: ")
    data = text.encode("utf-8")
    line4 = text.split("\n")[3]
    at = data.index(b"then a bad byte: ") + len(b"then a bad byte: ")
    path.write_bytes(data[:at] + b"\xff" + data[at:])
    with pytest.raises(ModelError) as info:
        parse_file(path)
    exc = info.value
    assert exc.loc is not None and (exc.loc.line, exc.loc.col) == (4, len(line4) + 1)
    assert exc.message == "the file is not valid UTF-8 (byte 0xff)"
    formatted = exc.format(str(path), "")
    assert formatted.startswith(f"{path}:4:{len(line4) + 1}: error: ")


def test_non_utf8_after_a_bom_counts_columns_without_it(tmp_path: Path):
    path = tmp_path / FILE
    path.write_bytes(b"\xef\xbb\xbfmo\xc3del m {}")
    with pytest.raises(ModelError) as info:
        read_source(path)
    assert (info.value.loc.line, info.value.loc.col) == (1, 3)
    assert "byte 0xc3" in info.value.message


def test_truncated_multibyte_character_at_the_end(tmp_path: Path):
    path = tmp_path / FILE
    path.write_bytes(stmts().encode() + b"\n# \xe2\x98")
    with pytest.raises(ModelError) as info:
        read_source(path)
    assert (info.value.loc.line, info.value.loc.col) == (10, 3)


def test_leading_bom_is_ignored(tmp_path: Path):
    source = stmts()
    assert parse("\ufeff" + source, FILE).source == source
    path = tmp_path / FILE
    path.write_bytes(b"\xef\xbb\xbf" + source.encode())
    assert parse_file(path).source == source
    # columns on line 1 count from after the mark
    exc = error("\ufeffmodel 1m {}")
    assert (exc.loc.line, exc.loc.col) == (1, 7)
    # a second mark (not leading) is an ordinary unexpected character
    assert (error("\ufeff\ufeffmodel m {}").loc.col) == 1


def test_model_file_that_is_a_directory(tmp_path: Path):
    with pytest.raises(ModelError, match="the model file is a directory, not a regular file"):
        parse_file(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_model_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path):
    fifo = tmp_path / "model.txt"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=r"is a named pipe \(FIFO\), not a regular file"):
        read_source(fifo)  # would block forever if it were opened for reading


def test_model_file_that_is_a_device():
    with pytest.raises(ModelError, match="the model file is a device, not a regular file"):
        read_source("/dev/zero")  # would never end if it were read


def test_model_file_that_is_too_large(tmp_path: Path):
    path = tmp_path / FILE
    with open(path, "wb") as handle:
        handle.write(stmts().encode())
        handle.truncate(MAX_SOURCE_BYTES + 1)  # sparse: nothing is really written
    with pytest.raises(ModelError, match=r"too large \(1,048,577 bytes; the limit is 1 MiB\)"):
        read_source(path)


def test_model_text_that_is_too_large():
    source = stmts() + "#" * (MAX_SOURCE_BYTES - len(stmts()) + 10)
    exc = error(source)
    assert "the model text is too large" in exc.message
    # where the limit falls: in the comment on line 9, after the model's 8 lines
    assert (exc.loc.line, exc.loc.col) == (9, MAX_SOURCE_BYTES - len(stmts()) + 1)


def test_missing_model_file(tmp_path: Path):
    with pytest.raises(ModelError, match="no such model file"):
        read_source(tmp_path / "nope.txt")


# ---- through the CLI -------------------------------------------------------------------------


def _bad_byte_file() -> tuple[bytes, int, int]:
    """A model with the byte 0xff inside a comment on line 4, and where it is."""
    text = stmts("a = relu(x)  # naïve: ")
    before = "    a = relu(x)  # naïve: "
    data = text.encode().replace(before.encode(), before.encode() + b"\xff")
    return data, 4, len(before) + 1


def _unroll(folder: Path) -> subprocess.Popen:
    """`unroll generate bad.txt -o out.py` in ``folder``, started (not waited for)."""
    return subprocess.Popen(
        [str(UNROLL), "generate", FILE, "-o", "out.py"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


CLI_CASES = ["1000-nested-block-calls", "5000-digit-integer", "i32-target-for-cross-entropy"]
BY_ID = {case.id: case for case in CASES}


def test_cli_reports_each_case_and_writes_nothing(tmp_path: Path):
    """`unroll generate FILE -o OUT`: exit 2, FILE:LINE:COL, no traceback, no OUT. The
    processes run side by side (each one pays for importing torch)."""
    expected: dict[str, tuple[int, int]] = {}
    for case_id in CLI_CASES:
        (tmp_path / case_id).mkdir()
        (tmp_path / case_id / FILE).write_text(BY_ID[case_id].source, encoding="utf-8")
        expected[case_id] = (BY_ID[case_id].line, BY_ID[case_id].col)
    data, line, col = _bad_byte_file()
    (tmp_path / "not-utf8").mkdir()
    (tmp_path / "not-utf8" / FILE).write_bytes(data)
    expected["not-utf8"] = (line, col)
    (tmp_path / "bom").mkdir()
    (tmp_path / "bom" / FILE).write_bytes(b"\xef\xbb\xbf" + stmts().encode())
    runs = {name: _unroll(tmp_path / name) for name in [*expected, "bom"]}
    for name, (line, col) in expected.items():
        stdout, stderr = runs[name].communicate(timeout=300)
        assert runs[name].returncode == 2, (name, stderr[-2000:])
        assert "Traceback" not in stderr
        assert stdout == ""
        lines = stderr.splitlines()
        assert lines[0].startswith(f"{FILE}:{line}:{col}: error: "), lines[0][:300]
        if name != "not-utf8":  # (the caret needs the text, which is not UTF-8 there)
            assert lines[2].lstrip().startswith("^")  # under the source line
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [FILE]
    _, stderr = runs["bom"].communicate(timeout=300)
    assert runs["bom"].returncode == 0, stderr  # a leading byte-order mark is ignored
    assert "Traceback" not in stderr and (tmp_path / "bom" / "out.py").is_file()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_cli_model_file_that_is_a_fifo(tmp_path: Path):
    os.mkfifo(tmp_path / FILE)
    process = _unroll(tmp_path)
    try:
        _, stderr = process.communicate(timeout=12)
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == 2 and "Traceback" not in stderr
    assert stderr.startswith(f"{FILE}: error: the model file is a named pipe (FIFO)"), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]


def test_the_quoted_source_line_is_printable_and_windowed():
    """No terminal escape reaches the user's screen; a 5,000-digit literal is not printed
    whole; the caret stays under its column."""
    from unroller.compiler.ast import Loc
    from unroller.errors import format_diagnostic

    text = format_diagnostic("error", "bad", Loc(1, 3, 1), "f.txt", "a\x1b= b")
    assert text.splitlines()[1:] == ["    a?= b", "      ^"]
    long = "x = " + "1" * 5000 + " + y"
    text = format_diagnostic("error", "big", Loc(1, 5006, 1), "f.txt", long)
    shown, caret = text.splitlines()[1:]
    assert len(shown) < 120 and shown.startswith("    ...")
    assert shown[caret.index("^")] == "+"
