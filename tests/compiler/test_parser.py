"""Tests of unroller.compiler.parser: the grammar, the AST it builds, and its error messages."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import SLOW
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unroller.compiler import parser as parser_module
from unroller.compiler.ast import Block, Call, Const, Loc, ModelAST, Ref, TensorDecl, TupleExpr
from unroller.compiler.graph import build_graph
from unroller.compiler.parser import parse, parse_file
from unroller.errors import ModelError

SPEC_EXAMPLE = """\
# A '#' starts a comment that runs to the end of the line.
model tiny_resnet {
    input x: f32[N, 3, 32, 32]      # N is the batch dimension, always first
    target y: i64[N]                # a target feeds only losses; predict() does not take it

    block basic(x, planes, stride=1) {
        conv1 = conv2d(x, out_channels=planes, kernel_size=3, stride=stride, padding=1, bias=false)
        bn1 = batchnorm2d(conv1)
        r1 = relu(bn1)
        conv2 = conv2d(r1, out_channels=planes, kernel_size=3, padding=1, bias=false)
        bn2 = batchnorm2d(conv2)
        s = add(bn2, x)
        out = relu(s)
        return out
    }

    conv1 = conv2d(x, out_channels=16, kernel_size=3, padding=1, bias=false)
    bn1 = batchnorm2d(conv1)
    r = relu(bn1)
    layer1.0 = basic(r, planes=16)
    layer1.1 = basic(layer1.0, planes=16)
    pool = adaptive_avgpool2d(layer1.1, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=10)
    loss = cross_entropy(fc, y)
    return loss, fc                  # the loss first (a scalar), then the predictions
}
"""

# Lark's internal names must never reach a user.
INTERNAL = re.compile(
    r"__ANON|\$END|\bRPAR\b|\bLPAR\b|\bRBRACE\b|\bLBRACE\b|\bLSQB\b|\bRSQB\b|\bCOMMA\b"
    r"|\bEQUAL\b|\bCOLON\b|\bNAME\b|\bINT\b|\bFLOAT\b|\bSTRING\b|\bMODEL\b|\bRETURN\b"
    r"|Token\(|Tree\(|<END-OF-FILE>"
)


def text_at(source: str, loc: Loc) -> str:
    """The source text a Loc underlines."""
    line = source.split("\n")[loc.line - 1]
    return line[loc.col - 1 : loc.col - 1 + loc.length]


def at(source: str, line: int, needle: str, nth: int = 1) -> Loc:
    """The Loc of the nth occurrence of ``needle`` on a line (counted independently of
    the parser, to check its columns)."""
    text = source.split("\n")[line - 1]
    col = -1
    for _ in range(nth):
        col = text.index(needle, col + 1)
    return Loc(line, col + 1, len(needle))


# Keyword values below are parsed from line 2 of ``one_stmt``'s model, at this column.
VALUE_COL = len("  y = op(x, k=") + 1


def one_stmt(kwargs: str) -> Call:
    """Parse ``y = op(x, <kwargs>)`` in a minimal model and return the statement."""
    model = parse(f"model m {{\n  y = op(x, {kwargs})\n  return y\n}}\n")
    (stmt,) = model.stmts
    return stmt


def kw_value(text: str):
    """The parsed keyword value written as ``text``."""
    (kwarg,) = one_stmt(f"k={text}").kwargs
    return kwarg.value


# --------------------------------------------------------------------------------------
# The spec's example
# --------------------------------------------------------------------------------------


def test_spec_example_ast():
    model = parse(SPEC_EXAMPLE, filename="tiny.model")
    assert isinstance(model, ModelAST)
    assert model.name == "tiny_resnet"
    src = SPEC_EXAMPLE
    assert model.loc == at(src, 2, "tiny_resnet") == Loc(2, 7, 11)
    assert model.filename == "tiny.model"
    assert model.source == SPEC_EXAMPLE

    x, y = model.decls
    assert x == TensorDecl(
        kind="input",
        name="x",
        dtype="f32",
        dims=("N", 3, 32, 32),
        loc=Loc(3, 11, 1),
        dtype_loc=Loc(3, 14, 3),
        dims_loc=(Loc(3, 18, 1), Loc(3, 21, 1), Loc(3, 24, 2), Loc(3, 28, 2)),
    )
    assert x.dims_loc == (
        at(src, 3, "N"),
        at(src, 3, "3", 2),  # the first "3" and "32" are in "f32"
        at(src, 3, "32", 2),
        at(src, 3, "32", 3),
    )
    assert (y.kind, y.name, y.dtype, y.dims) == ("target", "y", "i64", ("N",))
    assert y.dims_loc == (at(src, 4, "N"),)

    (basic,) = model.blocks
    assert isinstance(basic, Block)
    assert basic.name == "basic"
    assert basic.loc == at(src, 6, "basic")
    assert [(p.name, p.default) for p in basic.params[:2]] == [("x", None), ("planes", None)]
    stride = basic.params[2]
    assert stride.name == "stride" and stride.loc == at(src, 6, "stride")
    assert stride.default == Const(1, at(src, 6, "1"))
    assert [c.target for c in basic.body] == ["conv1", "bn1", "r1", "conv2", "bn2", "s", "out"]
    conv1 = basic.body[0]
    assert conv1.op == "conv2d" and conv1.op_loc == at(src, 7, "conv2d")
    assert conv1.args == (Ref("x", at(src, 7, "x")),)
    kwargs = {k.name: k.value for k in conv1.kwargs}
    assert kwargs["out_channels"] == Ref("planes", at(src, 7, "planes"))
    assert kwargs["stride"] == Ref("stride", at(src, 7, "stride", 2))
    assert kwargs["kernel_size"] == Const(3, at(src, 7, "3"))
    assert kwargs["bias"] == Const(False, at(src, 7, "false"))
    assert basic.body[5].args == (
        Ref("bn2", at(src, 12, "bn2")),
        Ref("x", at(src, 12, "x")),
    )
    assert basic.ret == Ref("out", at(src, 14, "out"))

    assert [(c.target, c.op) for c in model.stmts] == [
        ("conv1", "conv2d"),
        ("bn1", "batchnorm2d"),
        ("r", "relu"),
        ("layer1.0", "basic"),
        ("layer1.1", "basic"),
        ("pool", "adaptive_avgpool2d"),
        ("flat", "flatten"),
        ("fc", "linear"),
        ("loss", "cross_entropy"),
    ]
    first = model.stmts[0]
    assert [(k.name, k.value.value) for k in first.kwargs] == [
        ("out_channels", 16),
        ("kernel_size", 3),
        ("padding", 1),
        ("bias", False),
    ]
    assert first.kwargs[0].loc == at(src, 17, "out_channels")
    layer11 = model.stmts[4]
    assert layer11.loc == at(src, 21, "layer1.1")
    assert layer11.args == (Ref("layer1.0", at(src, 21, "layer1.0")),)
    assert layer11.kwargs[0].value == Const(16, at(src, 21, "16"))
    assert model.ret.loc == at(src, 26, "return")
    assert model.ret.values == (
        Ref("loss", at(src, 26, "loss")),
        Ref("fc", at(src, 26, "fc")),
    )


def test_every_loc_underlines_its_text():
    model = parse(SPEC_EXAMPLE)
    assert text_at(SPEC_EXAMPLE, model.loc) == "tiny_resnet"
    for decl in model.decls:
        assert text_at(SPEC_EXAMPLE, decl.loc) == decl.name
        assert text_at(SPEC_EXAMPLE, decl.dtype_loc) == decl.dtype
        assert [text_at(SPEC_EXAMPLE, d) for d in decl.dims_loc] == [str(d) for d in decl.dims]
    calls = list(model.stmts) + [c for b in model.blocks for c in b.body]
    for call in calls:
        assert text_at(SPEC_EXAMPLE, call.loc) == call.target
        assert text_at(SPEC_EXAMPLE, call.op_loc) == call.op
        for arg in call.args:
            assert text_at(SPEC_EXAMPLE, arg.loc) == arg.name
        for kwarg in call.kwargs:
            assert text_at(SPEC_EXAMPLE, kwarg.loc) == kwarg.name
    for ref in model.ret.values:
        assert text_at(SPEC_EXAMPLE, ref.loc) == ref.name
    assert text_at(SPEC_EXAMPLE, model.ret.loc) == "return"


def test_model_files_in_the_repository_parse():
    folder = Path(__file__).parents[1] / "models"
    files = sorted(folder.glob("*.txt"))
    if not files:
        pytest.skip("no model files")
    for path in files:
        model = parse_file(path)
        assert model.filename == str(path)
        assert model.ret.values


# --------------------------------------------------------------------------------------
# Literals
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("0", 0),
        ("3", 3),
        ("-1", -1),
        ("+2", 2),
        ("9223372036854775807", 2**63 - 1),  # the largest: integers fit in 64 bits
        ("-0009223372036854775807", -(2**63 - 1)),
    ],
)
def test_ints(text, value):
    const = kw_value(text)
    assert isinstance(const, Const)
    assert type(const.value) is int and const.value == value
    assert const.loc == Loc(2, VALUE_COL, len(text))


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e-5", 1e-5),
        ("0.1", 0.1),
        (".5", 0.5),
        ("2.", 2.0),
        ("-0.25", -0.25),
        ("1E3", 1000.0),
        ("+1.5e+2", 150.0),
        ("-.5", -0.5),
        ("3.e2", 300.0),
        ("0.0", 0.0),
    ],
)
def test_floats(text, value):
    const = kw_value(text)
    assert type(const.value) is float and const.value == value
    assert const.loc == Loc(2, VALUE_COL, len(text))


def test_booleans():
    stmt = one_stmt("a=true, b=false")
    assert [k.value for k in stmt.kwargs] == [
        Const(True, Loc(2, VALUE_COL, 4)),
        Const(False, Loc(2, VALUE_COL + len("true, b="), 5)),
    ]
    assert all(type(k.value.value) is bool for k in stmt.kwargs)


@pytest.mark.parametrize(
    "text, value",
    [
        (r'"nearest"', "nearest"),
        (r'""', ""),
        (r'"say \"hi\""', 'say "hi"'),
        (r'"back\\slash"', "back\\slash"),
        (r'"a\nb"', "a\nb"),
        (r'"a\tb"', "a\tb"),
        (r'"a\rb"', "a\rb"),
        (r'"caf\u00e9"', "café"),
        (r'"\x41\x62"', "Ab"),
        (r'"\U0001F600"', "\U0001f600"),
        (r'"\N{GREEK SMALL LETTER ALPHA}"', "α"),
        (r'"\101\0"', "A\0"),
        (r'"it\'s"', "it's"),
        (r'"\a\b\f\v"', "\a\b\f\v"),
        ('"raw é and # not a comment"', "raw é and # not a comment"),
    ],
)
def test_strings(text, value):
    const = kw_value(text)
    assert const.value == value
    assert const.loc == Loc(2, VALUE_COL, len(text))


def test_tuples():
    assert kw_value("(3, 5)") == Const((3, 5), Loc(2, VALUE_COL, 6))
    assert kw_value("(3,)") == Const((3,), Loc(2, VALUE_COL, 4))
    assert kw_value("()") == Const((), Loc(2, VALUE_COL, 2))
    assert kw_value("( )").value == ()
    assert kw_value("(1, 2,)").value == (1, 2)
    assert kw_value('((1, 2), (3,), (), 4.5, "s", true)').value == (
        (1, 2),
        (3,),
        (),
        4.5,
        "s",
        True,
    )
    assert kw_value("(((-1,),),)").value == (((-1,),),)
    spread = kw_value("(1,\n    2)")  # a tuple may span lines
    assert spread.value == (1, 2) and spread.loc.line == 2


def test_references_in_keyword_values():
    assert kw_value("planes") == Ref("planes", Loc(2, VALUE_COL, 6))
    value = kw_value("(stride, (1, pad), 2)")
    col = VALUE_COL
    assert isinstance(value, TupleExpr)
    assert value.loc == Loc(2, col, 21)
    stride, inner, two = value.items
    assert stride == Ref("stride", Loc(2, col + 1, 6))
    assert isinstance(inner, TupleExpr)
    assert inner.loc == Loc(2, col + 9, 8)
    assert inner.items == (Const(1, Loc(2, col + 10, 1)), Ref("pad", Loc(2, col + 13, 3)))
    assert two == Const(2, Loc(2, col + 19, 1))
    # A tuple of constants only is folded into a Const, even when nested in a TupleExpr.
    mixed = kw_value("((1, 2), k)")
    assert isinstance(mixed, TupleExpr)
    assert mixed.items[0] == Const((1, 2), Loc(2, VALUE_COL + 1, 6))


# --------------------------------------------------------------------------------------
# Names, comments, blocks
# --------------------------------------------------------------------------------------


def test_dotted_names():
    model = parse(
        "model m {\n"
        "  layer1.0.conv1 = conv2d(x, out_channels=4, kernel_size=1)\n"
        "  shortcut.1 = relu(layer1.0.conv1)\n"
        "  a.b_c.10.d = add(shortcut.1, layer1.0.conv1)\n"
        "  return a.b_c.10.d, shortcut.1\n"
        "}\n"
    )
    assert [s.target for s in model.stmts] == ["layer1.0.conv1", "shortcut.1", "a.b_c.10.d"]
    assert model.stmts[0].loc == Loc(2, 3, 14)
    assert model.stmts[2].args == (
        Ref("shortcut.1", Loc(4, 20, 10)),
        Ref("layer1.0.conv1", Loc(4, 32, 14)),
    )
    assert model.ret.values[1].loc == Loc(5, 22, 10)
    assert [r.name for r in model.ret.values] == ["a.b_c.10.d", "shortcut.1"]


def test_comments_and_whitespace_everywhere():
    source = (
        "# leading comment\n"
        "model # after model\n"
        " m # after the name\n"
        "{ # after the brace\n"
        "input # c\n x # c\n : # c\n f32 # c\n [ # c\n N # c\n , # c\n 3 # c\n ] # c\n"
        "block # c\n b # c\n ( # c\n v # c\n , # c\n k # c\n = # c\n 2 # c\n ) # c\n { # c\n"
        "  o = f(v, k=k) return # c\n o # c\n } # c\n"
        "y # c\n = # c\n g # c\n ( # c\n x # c\n , # c\n p # c\n = # c\n ( # c\n 1 # c\n , # c\n"
        " ) # c\n ) # c\n"
        "\t\r\n"
        "return # c\n y # c\n , # c\n x # c\n"
        "} # trailing comment without a newline"
    )
    model = parse(source)
    assert model.name == "m"
    assert model.decls[0].dims == ("N", 3)
    assert model.blocks[0].params[1].default.value == 2
    assert model.stmts[0].kwargs[0].value.value == (1,)
    assert [r.name for r in model.ret.values] == ["y", "x"]


def test_statements_need_no_newlines():
    model = parse("model m{input x:f32[N,2] a=f(x)b=g(a,k=-1)return b}")
    assert [s.target for s in model.stmts] == ["a", "b"]
    assert model.stmts[1].kwargs[0].value.value == -1


def test_blocks_with_defaults_and_references():
    source = (
        "model m {\n"
        "  input x: f32[N, 8]\n"
        '  block down(v, planes, stride=2, pad=(1, 1), mode="x", k=planes) {\n'
        "    c = conv2d(v, out_channels=planes, kernel_size=(stride, 3), padding=pad)\n"
        "    return c\n"
        "  }\n"
        "  block empty() { return q }\n"
        "  block late(a=1, b) { r = f(b, a=a) return r }\n"
        "  d.0 = down(x, planes=4)\n"
        "  return d.0\n"
        "}\n"
    )
    model = parse(source)
    src = source
    down, empty, late = model.blocks
    assert [p.name for p in down.params] == ["v", "planes", "stride", "pad", "mode", "k"]
    defaults = [p.default for p in down.params]
    assert defaults[:2] == [None, None]
    assert defaults[2] == Const(2, at(src, 3, "2"))
    assert defaults[3] == Const((1, 1), at(src, 3, "(1, 1)"))
    assert defaults[4] == Const("x", at(src, 3, '"x"'))
    assert defaults[5] == Ref("planes", at(src, 3, "planes", 2))
    ks = down.body[0].kwargs[1].value
    assert ks == TupleExpr(
        (Ref("stride", at(src, 4, "stride")), Const(3, at(src, 4, "3"))),
        at(src, 4, "(stride, 3)"),
    )
    assert empty.params == () and empty.body == ()
    assert empty.ret == Ref("q", at(src, 7, "q"))
    # A parameter without a default after one with a default is allowed.
    assert [(p.name, p.default is None) for p in late.params] == [("a", False), ("b", True)]


def test_keyword_like_names():
    source = (
        "model model2 {\n"
        "  input inputs: f32[N, 2]\n"
        "  target targets: f32[N, 2]\n"
        "  input = relu(inputs)\n"
        "  target.x = relu(input)\n"
        "  block.0 = relu(target.x)\n"
        "  return.1 = relu(block.0)\n"
        "  model = f(input, model=input, input=target, block=return, return=1)\n"
        "  blocks = f(model)\n"
        "  true_ = f(blocks)\n"
        "  false = f(true_)\n"
        "  true = f(false, x=true, y=false)\n"
        "  returns = mse_loss(true, targets)\n"
        "  return returns, model, input, block.0\n"
        "}\n"
    )
    model = parse(source)
    assert model.name == "model2"
    assert [d.name for d in model.decls] == ["inputs", "targets"]
    assert [s.target for s in model.stmts] == [
        "input",
        "target.x",
        "block.0",
        "return.1",
        "model",
        "blocks",
        "true_",
        "false",
        "true",
        "returns",
    ]
    kw = model.stmts[4].kwargs
    assert [(k.name, k.value) for k in kw] == [
        ("model", Ref("input", at(source, 8, "input", 2))),
        ("input", Ref("target", at(source, 8, "target"))),
        ("block", Ref("return", at(source, 8, "return"))),
        ("return", Const(1, at(source, 8, "1"))),
    ]
    assert [k.loc for k in kw] == [
        at(source, 8, "model", 2),
        at(source, 8, "input", 3),
        at(source, 8, "block"),
        at(source, 8, "return", 2),
    ]
    assert model.stmts[8].args == (Ref("false", at(source, 12, "false")),)
    assert [k.value.value for k in model.stmts[8].kwargs] == [True, False]
    assert [r.name for r in model.ret.values] == ["returns", "model", "input", "block.0"]


def test_python_keywords_are_value_names():
    model = parse(
        "model m {\n"
        "  input class: f32[N, 1]\n"
        "  lambda = relu(class)\n"
        "  def = f(lambda, if=1, None=2)\n"
        "  block for(in) { return in }\n"
        "  return def\n"
        "}\n"
    )
    assert model.decls[0].name == "class"
    assert [(s.target, [a.name for a in s.args]) for s in model.stmts] == [
        ("lambda", ["class"]),
        ("def", ["lambda"]),
    ]
    assert [k.name for k in model.stmts[1].kwargs] == ["if", "None"]
    assert model.blocks[0].name == "for"


def test_all_dtypes():
    for dtype in ("f32", "f16", "bf16", "f64", "i64", "i32"):
        model = parse(f"model m {{ input x: {dtype}[N, 4, +5] return x }}")
        assert model.decls[0].dtype == dtype
        assert model.decls[0].dims == ("N", 4, 5)


def test_crlf_and_tabs():
    model = parse('model m {\r\n\tx = f(a, s="t")\r\n\treturn x\r\n}\r\n')
    assert model.stmts[0].loc == Loc(2, 2, 1)
    assert model.stmts[0].kwargs[0].value.value == "t"


def test_parse_file(tmp_path):
    path = tmp_path / "tiny.model"
    path.write_text(SPEC_EXAMPLE, encoding="utf-8")
    model = parse_file(path)
    assert model.filename == str(path)
    assert model.source == SPEC_EXAMPLE
    assert model.name == "tiny_resnet"
    bom = tmp_path / "bom.model"
    bom.write_bytes(b"\xef\xbb\xbf" + SPEC_EXAMPLE.encode())
    assert parse_file(str(bom)).source == SPEC_EXAMPLE
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"model m {\n  x = f(\xff)\n  return x\n}\n")
    with pytest.raises(ModelError) as info:
        parse_file(bad)
    assert "not valid UTF-8" in info.value.message
    assert info.value.loc == Loc(2, 9, 1)


def test_grammar_is_loaded_once():
    assert parser_module._lark() is parser_module._lark()
    parse(SPEC_EXAMPLE)
    assert parser_module._lark.cache_info().currsize == 1


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


def error_of(source: str) -> ModelError:
    """The parser's error; for a number where a value name goes (`relu(3)`), the graph
    builder's, since value names may start with a number (`0.weight`)."""
    with pytest.raises(ModelError) as info:
        build_graph(parse(source))
    error = info.value
    assert not INTERNAL.search(error.message), error.message
    assert not INTERNAL.search(error.hint or ""), error.hint
    assert error.loc is not None
    return error


# (source, line, col, length, phrases the message must contain)
SYNTAX_ERRORS = [
    pytest.param(
        "model m {\n  x = relu(a, )\n  return x\n}\n",
        2,
        15,
        1,
        ["unexpected ')'", "expected a value name or a keyword argument"],
        id="rpar-after-comma",
    ),
    pytest.param(
        "model m {\n  x = relu(a\n}\n",
        3,
        1,
        1,
        ["unexpected '}'", "expected ',', ')' or '='"],
        id="unclosed-call",
    ),
    pytest.param(
        "model m {\n  x = relu(a)\n  return x\n",
        3,
        11,
        1,
        ["unexpected end of file (expected '}')"],
        id="eof-missing-brace",
    ),
    pytest.param(
        "model m {\n  x = relu()\n",
        2,
        13,
        1,
        ["unexpected end of file (expected '}')"],
        id="eof-after-statement",
    ),
    pytest.param(
        "model m { return x,\n# trailing comment\n",
        1,
        20,
        1,
        ["unexpected end of file (expected a value name)"],
        id="eof-in-return",
    ),
    pytest.param("", 1, 1, 1, ["unexpected end of file (expected 'model')"], id="empty-file"),
    pytest.param(
        "model m {\n  x == relu(a)\n}\n",
        2,
        6,
        1,
        ["unexpected '=' (expected an operator or block name)"],
        id="double-equals",
    ),
    pytest.param(
        "model m {\n  x = relu(3)\n  return x\n}\n",
        2,
        12,
        1,
        ["unexpected number '3'", "expected a value name, a keyword argument or ')'"],
        id="number-as-positional",
    ),
    pytest.param(
        "modle m { return x }",
        1,
        1,
        5,
        ["unexpected name 'modle' (expected 'model')"],
        id="misspelt-model",
    ),
    pytest.param(
        "model { return x }",
        1,
        7,
        1,
        ["unexpected '{' (expected the model's name)"],
        id="model-without-name",
    ),
    pytest.param(
        "model m { input x f32[N] return x }",
        1,
        19,
        3,
        ["unexpected name 'f32' (expected ':')"],
        id="decl-missing-colon",
    ),
    pytest.param(
        "model m { input : f32[N] return x }",
        1,
        17,
        1,
        ["unexpected ':' (expected the input's name)"],
        id="decl-missing-name",
    ),
    pytest.param(
        "model m { target y: [N] return x }",
        1,
        21,
        1,
        ["unexpected '['", "expected a dtype (f32, f16, bf16, f64, i64, i32 or bool)"],
        id="decl-missing-dtype",
    ),
    pytest.param(
        "model m { input x: f32 [N, 3 return x }",
        1,
        30,
        6,
        ["unexpected 'return' (expected ',' or ']')"],
        id="dims-unclosed",
    ),
    pytest.param(
        'model m { input x: f32[N, "3"] return x }',
        1,
        27,
        3,
        ['unexpected string "3"', "expected N or a positive integer"],
        id="dims-string",
    ),
    pytest.param(
        "model m { x = f(a, s=) return x }",
        1,
        22,
        1,
        ["unexpected ')'", "expected a value (a number, a string, true, false, a tuple"],
        id="missing-keyword-value",
    ),
    pytest.param(
        "model m { x = f(a, s=[1]) return x }",
        1,
        22,
        1,
        ["unexpected '['", "expected a value ("],
        id="list-value",
    ),
    pytest.param(
        "model m { x = f(a, s=(1, ) return x }",
        1,
        28,
        6,
        ["unexpected 'return' (expected ',' or ')')"],
        id="unclosed-tuple",
    ),
    pytest.param(
        "model m { x = f(a, s=(,)) return x }",
        1,
        23,
        1,
        ["unexpected ','", "expected a value (", "or ')'"],
        id="comma-only-tuple",
    ),
    pytest.param(
        "model m { block (x) { return x } return x }",
        1,
        17,
        1,
        ["unexpected '(' (expected the block's name)"],
        id="block-without-name",
    ),
    pytest.param(
        "model m { block b(x, 3) { return x } return x }",
        1,
        22,
        1,
        ["unexpected number '3' (expected a parameter name)"],
        id="number-as-parameter",
    ),
    pytest.param(
        "model m { x = f(a) return }",
        1,
        27,
        1,
        ["unexpected '}' (expected a value name)"],
        id="empty-return",
    ),
    pytest.param(
        "model m { x = f(a) = }",
        1,
        20,
        1,
        ["unexpected '='", "expected a statement, 'input', 'target', 'block', 'return' or '}'"],
        id="stray-equals",
    ),
    pytest.param(
        "model m {\n  x = f(a) @ return x }",
        2,
        12,
        1,
        ["unexpected character '@'", "expected a statement"],
        id="unexpected-character",
    ),
    pytest.param(
        "model m {\n  x = f(a); return x }",
        2,
        11,
        1,
        ["unexpected character ';'", "or '}'"],
        id="semicolon",
    ),
    pytest.param(
        "model m {\n  x.y. = f(a) return x }",
        2,
        6,
        1,
        ["unexpected character '.' (expected '=')"],
        id="dangling-dot",
    ),
    pytest.param(
        'model m {\n  x = f(a, s="abc)\n  return x\n}\n',
        2,
        14,
        5,
        ["unterminated string", "same line"],
        id="unterminated-string",
    ),
    pytest.param(
        'model m {\n  x = f(a, s="ab\ncd")\n  return x\n}\n',
        2,
        14,
        3,
        ["unterminated string"],
        id="newline-in-string",
    ),
    pytest.param(
        'model m { x = f(a, s="ab\\"\n) return x }',
        1,
        22,
        5,
        ["unterminated string"],
        id="escaped-closing-quote",
    ),
    pytest.param(
        "model m {\n  retrun x\n}\n",
        2,
        10,
        1,
        ["unexpected name 'x' (expected '=')"],
        id="misspelt-return",
    ),
    pytest.param(
        "model m { return x } garbage",
        1,
        22,
        7,
        ["unexpected name 'garbage' (expected end of file)"],
        id="text-after-model",
    ),
]


@pytest.mark.parametrize("source, line, col, length, phrases", SYNTAX_ERRORS)
def test_syntax_errors(source, line, col, length, phrases):
    error = error_of(source)
    assert (error.loc.line, error.loc.col, error.loc.length) == (line, col, length)
    for phrase in phrases:
        assert phrase in error.message


def test_misspelt_keyword_hints():
    assert error_of("modle m { return x }").hint == "did you mean 'model'?"
    assert error_of("model m {\n  retrun x\n}\n").hint == (
        "did you mean 'return' instead of 'retrun'?"
    )
    assert error_of("model m {\n  Input x: f32[N]\n  return x\n}").hint == (
        "did you mean 'input' instead of 'Input'?"
    )
    assert "key=value" in error_of("model m { x = relu(1) return x }").hint


# (source, line, col, length, phrases the message must contain)
SEMANTIC_ERRORS = [
    pytest.param(
        "model m {\n  input x: f8[N, 3]\n  return x\n}\n",
        2,
        12,
        2,
        ["unknown dtype 'f8' (expected one of f32, f16, bf16, f64, i64, i32, bool)"],
        id="unknown-dtype",
    ),
    pytest.param(
        "model m { input x: F32[N] return x }",
        1,
        20,
        3,
        ["unknown dtype 'F32'"],
        id="uppercase-dtype",
    ),
    pytest.param(
        "model m { input x: f32[3, 4] return x }",
        1,
        24,
        1,
        ["the first dim must be N", "got '3'"],
        id="first-dim-not-n",
    ),
    pytest.param(
        "model m { input x: f32[B, 4] return x }",
        1,
        24,
        1,
        ["the first dim must be N"],
        id="first-dim-other-name",
    ),
    pytest.param(
        "model m { input x: f32[] return x }",
        1,
        23,
        1,
        ["the first dim must be N", "empty"],
        id="no-dims",
    ),
    pytest.param(
        "model m { input x: f32[N, 0] return x }",
        1,
        27,
        1,
        ["a dim must be a positive integer, got '0'"],
        id="zero-dim",
    ),
    pytest.param(
        "model m {\n  input x: f32[N, 3,\n   -2] return x }",
        3,
        4,
        2,
        ["a dim must be a positive integer, got '-2'"],
        id="negative-dim",
    ),
    pytest.param(
        "model m { input x: f32[N, 3.5] return x }",
        1,
        27,
        3,
        ["a dim must be a positive integer, got '3.5'"],
        id="float-dim",
    ),
    pytest.param(
        "model m { input x: f32[N, C] return x }",
        1,
        27,
        1,
        ["a dim must be a positive integer, got 'C'"],
        id="named-dim",
    ),
    pytest.param(
        "model m { input x: f32[N, N] return x }",
        1,
        27,
        1,
        ["only the first dim is N"],
        id="second-n",
    ),
    pytest.param(
        "model m {\n  block b(x, s, x=1) { return x }\n  return x\n}\n",
        2,
        17,
        1,
        ["duplicate parameter 'x' in block 'b'", "line 2, column 11"],
        id="duplicate-parameter",
    ),
    pytest.param(
        "model m {\n  return x\n  return y\n}\n",
        3,
        3,
        6,
        ["more than one 'return' in model 'm'", "line 2"],
        id="two-returns",
    ),
    pytest.param(
        "model m {\n  return x\n  y.0 = f(x)\n}\n",
        3,
        3,
        3,
        ["a statement after 'return' in model 'm'", "must come last"],
        id="statement-after-return",
    ),
    pytest.param(
        "model m {\n  return x\n  input z: f32[N]\n}\n",
        3,
        3,
        5,
        ["a declaration after 'return'"],
        id="declaration-after-return",
    ),
    pytest.param(
        "model m {\n  return x\n  block b(v) { return v }\n}\n",
        3,
        3,
        5,
        ["a block after 'return'"],
        id="block-after-return",
    ),
    pytest.param(
        "model m {\n  x = f(a)\n}\n",
        3,
        1,
        1,
        ["model 'm' has no 'return'", "return LOSS[, PRED...]"],
        id="missing-return",
    ),
    pytest.param(
        "model m {\n  block b(v) {\n    w = f(v)\n  }\n  return x\n}\n",
        4,
        3,
        1,
        ["block 'b' has no 'return'", "return VALUE"],
        id="block-missing-return",
    ),
    pytest.param(
        "model m { block b(v) { return v w = f(v) } return x }",
        1,
        33,
        1,
        ["a statement after 'return' in block 'b'"],
        id="block-statement-after-return",
    ),
    pytest.param(
        "model m { block b(v) { w = f(v) return w, v } return x }",
        1,
        43,
        1,
        ["a block returns exactly one value", "returns 2"],
        id="block-two-values",
    ),
    pytest.param(
        "model m { block b(v) { input q: f32[N] return v } return x }",
        1,
        24,
        5,
        ["'input' declarations belong in the model, not in block 'b'"],
        id="declaration-in-block",
    ),
    pytest.param(
        "model m { block b(v) { block c(u) { return u } return v } return x }",
        1,
        24,
        5,
        ["blocks cannot be nested"],
        id="nested-block",
    ),
    pytest.param(
        "model a { return x }\n\nmodel b { return y }\n",
        3,
        1,
        5,
        ["only one model per file", "model 'a'", "line 1"],
        id="second-model",
    ),
    pytest.param(
        "model m { x = f(a, s=1, b) return x }",
        1,
        25,
        1,
        ["positional argument 'b' after keyword arguments"],
        id="positional-after-keyword",
    ),
    pytest.param(
        "model m { x = f(a, s=1, s=2) return x }",
        1,
        25,
        1,
        ["keyword argument 's' given twice"],
        id="duplicate-keyword",
    ),
    pytest.param(
        "model m { x = f(a, s=(1)) return x }",
        1,
        22,
        3,
        ["parentheses around a single value", "(v,)"],
        id="parenthesised-value",
    ),
    pytest.param(
        "model m { x = f(a, s=b.c) return x }",
        1,
        22,
        3,
        ["a keyword value is a constant or a block parameter", "'b.c'"],
        id="dotted-keyword-value",
    ),
    pytest.param(
        "model m { x = f(a, s=1e999) return x }",
        1,
        22,
        5,
        ["too large"],
        id="float-overflow",
    ),
    pytest.param(
        "model m { x = f(layer.01) return x }",
        1,
        23,
        2,
        ["invalid value name 'layer.01'", "leading zeros"],
        id="leading-zero-part",
    ),
    pytest.param(
        "model m { x.0ab = f(a) return x }",
        1,
        13,
        3,
        ["invalid value name 'x.0ab'", "a name or an integer"],
        id="bad-part",
    ),
    pytest.param(
        "model m.n { return x }",
        1,
        7,
        3,
        ["the model's name must be a plain name", "'m.n'"],
        id="dotted-model-name",
    ),
    pytest.param(
        "model m { x = nn.relu(a) return x }",
        1,
        15,
        7,
        ["an operator or block name must be a plain name"],
        id="dotted-op",
    ),
    pytest.param(
        "model m { x = f(a, k.v=1) return x }",
        1,
        20,
        3,
        ["a keyword argument's name must be a plain name"],
        id="dotted-keyword",
    ),
    pytest.param(
        "model m { input x.y: f32[N] return x }",
        1,
        17,
        3,
        ["the input's name must be a plain name"],
        id="dotted-input",
    ),
    pytest.param(
        "model m { block b(p.q) { return p } return x }",
        1,
        19,
        3,
        ["a parameter name must be a plain name"],
        id="dotted-parameter",
    ),
    pytest.param(
        'model m {\n  x = f(a, s="ab\\qc")\n  return x\n}\n',
        2,
        17,
        2,
        ["unknown escape '\\q' in string"],
        id="unknown-escape",
    ),
    pytest.param(
        'model m { x = f(a, s="\\u12") return x }',
        1,
        23,
        2,
        ["bad escape '\\u'", "4 hex digits"],
        id="short-unicode-escape",
    ),
    pytest.param(
        'model m { x = f(a, s="\\xZZ") return x }',
        1,
        23,
        2,
        ["bad escape '\\x'", "2 hex digits"],
        id="bad-hex-escape",
    ),
    pytest.param(
        'model m { x = f(a, s="\\U00110000") return x }',
        1,
        23,
        10,
        ["not a Unicode character"],
        id="out-of-range-escape",
    ),
    pytest.param(
        'model m { x = f(a, s="\\ud800") return x }',
        1,
        23,
        6,
        ["surrogate"],
        id="surrogate-escape",
    ),
    pytest.param(
        'model m { x = f(a, s="\\N{NO SUCH THING}") return x }',
        1,
        23,
        17,
        ["unknown character name 'NO SUCH THING'"],
        id="unknown-character-name",
    ),
    pytest.param(
        'model m { x = f(a, s="\\Nx") return x }',
        1,
        23,
        2,
        ["bad escape '\\N'"],
        id="bad-named-escape",
    ),
]


@pytest.mark.parametrize("source, line, col, length, phrases", SEMANTIC_ERRORS)
def test_semantic_errors(source, line, col, length, phrases):
    error = error_of(source)
    assert (error.loc.line, error.loc.col, error.loc.length) == (line, col, length)
    for phrase in phrases:
        assert phrase in error.message


def test_unknown_dtype_hint():
    assert error_of("model m { input x: f23[N] return x }").hint == "did you mean 'f32'?"
    assert error_of("model m { input x: q[N] return x }").hint is None


def test_error_format_points_at_the_token():
    source = "model m {\n  x = relu(a, )\n  return x\n}\n"
    text = error_of(source).format("net.model", source)
    assert text.splitlines() == [
        "net.model:2:15: error: unexpected ')' (expected a value name or a keyword argument)",
        "      x = relu(a, )",
        "                  ^",
    ]


# --------------------------------------------------------------------------------------
# Property: random valid models parse and round-trip their values
# --------------------------------------------------------------------------------------

KEYWORDS = ["model", "input", "target", "block", "return", "true", "false", "lambda", "class"]
idents = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True),
    st.sampled_from(KEYWORDS),
)
# Block-parameter references: any identifier but the two boolean literals.
param_refs = idents.filter(lambda name: name not in ("true", "false"))
parts = st.one_of(idents, st.integers(0, 20).map(str))
value_names = st.builds(
    lambda first, rest: ".".join([first, *rest]), idents, st.lists(parts, max_size=3)
)

# Whitespace between tokens: optional (maybe nothing) or required (at least one blank).
comment = st.from_regex(r"#[ -~]{0,12}", fullmatch=True).map(lambda c: f" {c}\n")
blank = st.sampled_from([" ", "\n", "\t", "  \n  ", "\r\n"])
required_ws = st.lists(st.one_of(blank, comment), min_size=1, max_size=2).map("".join)
optional_ws = st.one_of(st.just(""), required_ws)


def escape(text: str, forms: list[int]) -> str:
    """A double-quoted literal for ``text``, choosing an escape form for each character."""
    out = []
    for ch, form in zip(text, forms):
        code = ord(ch)
        simple = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
        if form == 0 and ch not in simple and ch.isprintable():
            out.append(ch)
        elif form == 1 and code < 0x100:
            out.append(f"\\x{code:02x}")
        elif form == 2 and code < 0x10000:
            out.append(f"\\u{code:04X}")
        elif form == 3:
            out.append(f"\\U{code:08x}")
        elif ch in simple:
            out.append(simple[ch])
        else:
            out.append(f"\\U{code:08X}")
    return '"' + "".join(out) + '"'


@st.composite
def strings(draw):
    text = draw(st.text(st.characters(exclude_categories=("Cs",)), max_size=8))
    forms = draw(st.lists(st.integers(0, 4), min_size=len(text), max_size=len(text)))
    return escape(text, forms), text


def float_text(number: float, form: int) -> str:
    if form == 0:
        return repr(number)
    if form == 1:
        return f"{number:.6e}".replace("e", "E")
    return f"{number:+.3f}"


@st.composite
def floats(draw):
    number = draw(st.floats(allow_nan=False, allow_infinity=False, width=64))
    form = draw(st.integers(0, 2))
    text = float_text(number, form)
    if "." not in text and "e" not in text.lower():
        text += ".0"
    return text, float(text)


def ints():
    return st.integers(-(10**12), 10**12).flatmap(
        lambda n: st.sampled_from([str(n), f"+{n}" if n >= 0 else str(n)]).map(lambda t: (t, n))
    )


scalars = st.one_of(
    ints(),
    floats(),
    strings(),
    st.booleans().map(lambda b: ("true" if b else "false", b)),
)


def tuple_of(children):
    def render(items, trailing):
        texts = [t for t, _ in items]
        values = tuple(v for _, v in items)
        if not items:
            return "()", ()
        if len(items) == 1:
            return f"({texts[0]},)", values
        return "(" + ", ".join(texts) + ("," if trailing else "") + ")", values

    return st.builds(render, st.lists(children, max_size=3), st.booleans())


values = st.recursive(scalars, tuple_of, max_leaves=6)


@st.composite
def models(draw):
    """(source text, expected statements, expected return names) of a random valid model."""

    def req() -> str:
        return draw(required_ws)

    def opt() -> str:
        return draw(optional_ws)

    stmts = []
    text = opt() + "model" + req() + draw(idents) + opt() + "{"
    for _ in range(draw(st.integers(1, 4))):
        target = draw(value_names)
        op = draw(idents)
        args = draw(st.lists(value_names, max_size=3))
        keys = draw(st.lists(idents, max_size=3, unique=True))
        kwargs = [
            (key, draw(st.one_of(values, param_refs.map(lambda r: (r, Ref))))) for key in keys
        ]
        pieces = [opt() + a + opt() for a in args]
        pieces += [opt() + k + opt() + "=" + opt() + t + opt() for k, (t, _) in kwargs]
        text += opt() + target + opt() + "=" + opt() + op + opt() + "(" + ",".join(pieces) + ")"
        stmts.append((target, op, args, [(k, t, v) for k, (t, v) in kwargs]))
    rets = draw(st.lists(value_names, min_size=1, max_size=3))
    text += req() + "return" + req() + ",".join(opt() + r + opt() for r in rets) + "}" + opt()
    return text, stmts, rets


# make test draws 80 models; SLOW=1 (make test-slow) 300
@settings(
    max_examples=300 if SLOW else 80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(models())
def test_random_models_round_trip(case):
    source, stmts, rets = case
    model = parse(source)
    assert [r.name for r in model.ret.values] == rets
    assert len(model.stmts) == len(stmts)
    for call, (target, op, args, kwargs) in zip(model.stmts, stmts):
        assert call.target == target and call.op == op
        assert [a.name for a in call.args] == args
        assert text_at(source, call.loc) == target
        assert text_at(source, call.op_loc) == op
        assert [text_at(source, a.loc) for a in call.args] == args
        assert [k.name for k in call.kwargs] == [k for k, _, _ in kwargs]
        for kwarg, (key, text, value) in zip(call.kwargs, kwargs):
            assert text_at(source, kwarg.loc) == key
            if value is Ref:
                assert kwarg.value == Ref(text, kwarg.value.loc)
                assert text_at(source, kwarg.value.loc) == text
            else:
                assert isinstance(kwarg.value, Const)
                assert same_value(kwarg.value.value, value)
                assert text_at(source, kwarg.value.loc) == text


def same_value(got, want) -> bool:
    """Equal, with types: ints stay ints, bools stay bools, -0.0 keeps its sign."""
    if type(got) is not type(want):
        return False
    if isinstance(want, tuple):
        return len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want))
    if isinstance(want, float):
        return got == want and math.copysign(1, got) == math.copysign(1, want)
    return got == want


@st.composite
def mutated_examples(draw):
    """The spec's example with a few characters deleted, replaced or inserted."""
    text = SPEC_EXAMPLE
    alphabet = st.sampled_from(list('(){}[],=:."#\\\n -+.1aNx_') + ["return", "block", "é", "@"])
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 3))
        text = text[:pos] + draw(st.one_of(st.just(""), alphabet)) + text[pos + cut :]
    return text


@settings(max_examples=1000 if SLOW else 200, deadline=None)
@given(mutated_examples())
def test_any_text_parses_or_raises_a_located_model_error(source):
    try:
        parse(source)
    except ModelError as error:
        assert not INTERNAL.search(error.message), error.message
        assert error.loc is not None
        lines = source.split("\n")
        assert 1 <= error.loc.line <= len(lines)
        assert 1 <= error.loc.col <= len(lines[error.loc.line - 1]) + 1
        assert error.loc.length >= 1
        error.format("fuzz.model", source)
