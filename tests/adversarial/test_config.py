"""Hostile compression configs (``--compress-config FILE``).

Every problem in a config file is one ``ConfigError`` formatted like an error in a model
file: ``FILE:LINE:COL: error: message``, the source line, and a caret under the offending
key or value; the CLI prints it and exits 2, with no traceback and no output file. The
cases here are the ones a config has been seen to get wrong (an array of integers as
rules, non-UTF-8 bytes, the mask codec as a compressor, parameters of a million, TOML
syntax errors without a caret), hostile ``name`` globs that would otherwise reach the
generated code, and a seeded fuzz test over every field (``SLOW=1``: 3000 configs, else
200): a config is either refused with a well-formed error or it generates a module that
compiles and has the same shape as the one from a clean config.
"""

from __future__ import annotations

import ast
import contextlib
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import time_limit as shared_time_limit
from typer.testing import CliRunner

from unroller.api import compression_config, load_graph, render
from unroller.cli import app
from unroller.compiler.options import Options
from unroller.compiler.schemes import _Locator, load_config
from unroller.compress.dct import Dct
from unroller.errors import ConfigError

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny_resnet.txt"
UNROLL = Path(sys.executable).with_name("unroll")
HEAD = re.compile(r"(?P<file>.*):(?P<line>\d+):(?P<col>\d+): error: \S")


def write(tmp_path: Path, content: str | bytes, name: str = "bad.toml") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def check_format(message: str, path: Path, line: int | None = None, col: int | None = None):
    """The message is ``FILE:LINE:COL: error: ...``, the source line and a caret line whose
    caret sits under column COL; every line printable (nothing to drive a terminal)."""
    lines = message.split("\n")
    head = HEAD.match(lines[0])
    assert head and head["file"] == str(path), message
    if line is not None:
        assert (int(head["line"]), int(head["col"])) == (line, col), message
    assert len(lines) >= 3 and lines[1].startswith("    "), message
    caret = re.fullmatch(r"    ( *)\^~*", lines[2])
    assert caret and len(caret.group(1)) == int(head["col"]) - 1, message
    assert all(text.isprintable() for text in lines), ascii(message)
    return lines[0]


def error_at(tmp_path: Path, content: str | bytes, line: int, col: int, *words: str) -> str:
    path = write(tmp_path, content)
    message = refused(path)
    head = check_format(message, path, line, col)
    for word in words:
        assert word in head, message
    return message


def col_of(text: str, line: int, needle: str) -> int:
    return text.split("\n")[line - 1].index(needle) + 1


# -- the cases of the issue ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line, col, words",
    [
        ("rule = [1, 2]\n", 1, 9, ["each rule must be a table", "an integer"]),
        ('rule = "x"\n', 1, 8, ["[[rule]]", "a string"]),
        ('[rule]\ncompressor = "quant"\n', 1, 1, ["[[rule]]", "a table"]),
        ("default = 3\n", 1, 11, ["'default' must be a table"]),
        ('default = ["dct"]\n', 1, 11, ["'default' must be a table", "an array"]),
        ('[default]\ncompressor = "bits"\n', 2, 14, ["'bits'", "mask", "dct, quant, none"]),
        ('[[rule]]\ncompressor = "bits"\n', 2, 14, ["'bits'"]),
        ('[default]\ncompressor = "dct"\nblock = 1000000\n', 3, 9, ["'block'", "too large"]),
        ('[default]\ncompressor = "dct"\nkeep = 1000000\n', 3, 8, ["'keep'", "too large"]),
        ('[default]\ncompressor = "quant"\ngroup_size = -99999999\n', 3, 14, ["group_size"]),
        ('[default]\ncompressor = "dct"\nmin_size = 1000000\n', 3, 12, ["'min_size'"]),
        ('[default]\ncompressor = "dct"\nmin_size = -1\n', 3, 12, ["'min_size'"]),
        ('[default]\ncompressor = "dct"\nmin_size = "8"\n', 3, 12, ["'min_size'", "a string"]),
        ('[default]\ncompressor = "dct"\nmin_size = true\n', 3, 12, ["'min_size'"]),
        ('[[rule]]\nop = 3\ncompressor = "quant"\n', 2, 6, ["'op' must be a string"]),
        ('[[rule]]\nop = "conv3d"\ncompressor = "quant"\n', 2, 6, ["did you mean 'conv2d'"]),
        ('[[rule]]\nname = 3\ncompressor = "quant"\n', 2, 8, ["'name' must be a string"]),
        ('[[rule]]\nname = ""\ncompressor = "quant"\n', 2, 8, ["'name' is empty"]),
        ('[[rule]]\nname = ["a"]\ncompressor = "quant"\n', 2, 8, ["an array"]),
        ('masks = "yes"\n', 1, 9, ["'masks' must be true or false"]),
        ("mask = true\n", 1, 1, ["unknown key 'mask'", "did you mean 'masks'"]),
        ('[default]\ncompressor = "dct"\nkep = 2\n', 3, 1, ["'kep'", "did you mean 'keep'"]),
        ('[default]\ncompressor = "dctt"\n', 2, 14, ["did you mean 'dct'"]),
        ("[default]\ncompressor = 4\n", 2, 14, ["'compressor' must be a string"]),
        ("[default]\nkeep = 4\n", 1, 1, ["missing 'compressor'"]),
        ('[default]\ncompressor = "none"\nkeep = 2\n', 3, 1, ["takes no parameters"]),
        ('[default]\ncompressor = "none"\nmin_size = 2\n', 3, 1, ["takes no parameters"]),
        ('[default]\ncompressor = "dct"\nkeep = 9\n', 3, 8, ["'keep'", "<= block"]),
        ('[default]\ncompressor = "dct"\nkeep = 4.0\n', 3, 8, ["'keep'"]),
        ('[default]\ncompressor = "dct"\nkeep = nan\n', 3, 8, ["finite"]),
        ('[default]\ncompressor = "dct"\nkeep = inf\n', 3, 8, ["finite"]),
        ('[default]\ncompressor = "dct"\nkeep = -inf\n', 3, 8, ["finite"]),
        ('[default]\ncompressor = "dct"\nkeep = [1, 2]\n', 3, 8, ["an array"]),
        ('[default]\ncompressor = "dct"\nkeep = {a = 1}\n', 3, 8, ["a table"]),
        ('[default]\ncompressor = "dct"\nfold = 1979-05-27T07:32:00Z\n', 3, 8, ["date"]),
        ('[default]\ncompressor = "dct"\nstorage = 07:32:00\n', 3, 11, ["date"]),
        ('[default]\ncompressor = "dct"\nstorage = "in\\"t8"\n', 3, 11, ["not a parameter"]),
        ('[default]\ncompressor = "dct"\nstorage = "i\\nt8"\n', 3, 11, ["not a parameter"]),
        (f'[default]\ncompressor = "dct"\nstorage = "{"x" * 65}"\n', 3, 11, ["storage"]),
        ('[default]\ncompressor = "dct"\nstorage = "int4"\n', 3, 11, ["'storage'"]),
        ('[[rule]]\ncompressor = "quant"\n[rule.extra]\nx = 1\n', 3, 1, ["'extra'"]),
        ("# only a comment\n", 1, 1, ["sets nothing"]),
        ("", 1, 1, ["sets nothing"]),
        ("\n\n  \n", 1, 1, ["sets nothing"]),
    ],
)
def test_config_errors_point_at_the_key_or_value(tmp_path, text, line, col, words):
    error_at(tmp_path, text, line, col, *words)


@pytest.mark.parametrize(
    "text, line, col, words",
    [
        ("[default\n", 1, 9, ["invalid TOML", "table declaration"]),
        ("masks = true\n[default\n", 2, 9, ["invalid TOML"]),
        ("masks = tru\n", 1, 9, ["invalid TOML: invalid value"]),
        ('[[rule]]\nname = "a\\Nb"\ncompressor = "quant"\n', 2, 10, ["unescaped '\\'"]),
        ("masks = true\nmasks = false\n", 2, 1, ["cannot overwrite"]),
        ("masks = true\nmasks = false", 2, 1, ["cannot overwrite"]),
        ('[default]\ncompressor = "dct"\n[default]\n', 3, 1, ["cannot declare"]),
        ("rule = [1,\n", 1, 11, ["invalid TOML"]),
        ('masks = "a\x01b"\n', 1, 11, ["illegal character"]),
        ('masks = "a\tb\x1b[2J"\n', 1, 13, ["illegal character"]),
        ("masks = 1" + "9" * 5000 + "\n", 1, 9, ["invalid TOML"]),
        ("rule = " + "[" * 5000 + "]" * 5000 + "\n", 1, 8, ["nested too deeply"]),
    ],
)
def test_toml_syntax_errors_have_a_line_column_and_caret(tmp_path, text, line, col, words):
    error_at(tmp_path, text, line, col, *words)


def test_not_utf8_points_at_the_first_bad_byte(tmp_path):
    message = error_at(
        tmp_path, b'[default]\ncompressor = "dct"\nkeep = \xff2\n', 3, 8, "not UTF-8", "ff"
    )
    assert "\ufffd" in message.split("\n")[1]
    # columns count characters, not bytes: the e-acute before the bad byte is one column
    error_at(tmp_path, "# café ".encode() + b"\xc3\x28\nmasks = true\n", 1, 8, "not UTF-8")
    error_at(tmp_path, b"masks = true\n\n# \xed\xa0\x80 (a surrogate)\n", 3, 3, "not UTF-8")


def test_a_byte_order_mark_and_crlf_line_ends_are_accepted(tmp_path):
    good = write(
        tmp_path, b'\xef\xbb\xbf[default]\r\ncompressor = "quant"\r\nbits = 4\r\n', "a.toml"
    )
    config = load_config(good)
    assert config.default is not None and config.default.kwargs["bits"] == 4
    # columns do not count the mark
    error_at(tmp_path, b"\xef\xbb\xbf[default]\r\ncompressor = 'dct'\r\nkep = 2\r\n", 3, 1, "'kep'")
    error_at(tmp_path, b"\xef\xbb\xbfmasks = 3\r\n", 1, 9, "'masks'")


def test_files_that_are_not_small_regular_files(tmp_path):
    missing = tmp_path / "missing.toml"
    assert refused(missing) == f"{missing}: error: no such compression config file"
    assert refused(tmp_path).startswith(f"{tmp_path}: error: ")
    assert "directory" in refused(tmp_path)
    big = write(tmp_path, "# " + "x" * (1 << 20) + "\nmasks = true\n", "big.toml")
    assert refused(big).startswith(f"{big}: error: the compression config is ")
    assert "at most" in refused(big)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with time_limit(10, "blocked on a FIFO"):
        message = refused(fifo)
    assert message.startswith(f"{fifo}: error: not a regular file"), message


def test_dotted_quoted_and_inline_keys_are_located(tmp_path):
    error_at(tmp_path, 'default.compressor = "dct"\ndefault.keep = 99\n', 2, 16, "'keep'")
    error_at(tmp_path, 'default . compressor = "dct"\n default . "kep" = 2\n', 2, 12, "'kep'")
    error_at(tmp_path, "[default]\n\"compressor\" = 'dct'\n'kep' = 2\n", 3, 1, "'kep'")
    error_at(tmp_path, '[ "default" ]  # x\ncompressor = "dct"\n"keep" = 99\n', 3, 10, "'keep'")
    error_at(tmp_path, "default = {compressor = 'dct', keep = 99}\n", 1, 39, "'keep'")
    error_at(
        tmp_path, 'rule = [{op = "conv2d", compressor = "quant", bits = 3}]\n', 1, 54, "'bits'"
    )
    text = (
        'rule = [  # a comment with "quotes", = signs and [[rule]]\n'
        '  { compressor = "quant", bits = 4 },\n'
        "  # keep = 99\n"
        "  { compressor = 'dct', keep = 9 },\n"
        "]\n"
    )
    error_at(tmp_path, text, 4, col_of(text, 4, "9 }"), "'keep'")
    error_at(tmp_path, 'rule = [{compressor = "quant"}, 5]\n', 1, 33, "an integer")
    error_at(tmp_path, 'rule = [{compressor = "quant"}, {op = "conv2d"}]\n', 1, 33, "missing")


def test_the_right_rule_and_the_right_table_are_located(tmp_path):
    text = (
        "# [default]\n"
        "# keep = 1\n"
        '[[rule]]\ncompressor = "quant"\nbits = 4\n'
        "[[rule]]\n"
        'name = """layer1.*"""\n'
        "compressor = 'quant'\n"
        "bits = 4\n"
        "[[rule]]\n"
        "compressor = 'quant'\n"
        "bits = 3  # [[rule]] bits = 4\n"
        "[default]\n"
        'compressor = "dct"\n'
        "keep = 3\n"
    )
    error_at(tmp_path, text, 12, 8, "'bits'")
    text = (
        '[[rule]]\ncompressor = "quant"\n'
        "[[rule]]\nop = 'relu'\ncompressor = 'quant'\n[rule.sub]\nx = 1\n"
    )
    error_at(tmp_path, text, 6, 1, "'sub'")
    text = '[default]\ncompressor = "dct"\n\n[[rule]]\ncompressor = "dct"\n'
    config = load_config(write(tmp_path, text))
    assert config.rules[0].line == 5


def test_multiline_strings_do_not_confuse_the_locator():
    text = (
        "a = '''\n[[rule]]\nkeep = 1'''\n"
        'b = """x \\""" [default] \\\\"""\n'
        'c = """""quoted"""""\n'
        "[[rule]]\n"
        'name = """\n  x = 1\n"""\n'
        "d = { e = [1, [2, {f = 'g'}]], 'h.i' = 1979-05-27 07:32:00 }\n"
        "[[rule]]\n"
        'j = "end"\n'
    )
    data = tomllib.loads(text)
    where = _Locator(text)
    leaves = {
        ("a",): data["a"],
        ("b",): data["b"],
        ("c",): data["c"],
        ("rule", 0, "name"): data["rule"][0]["name"],
        ("rule", 0, "d", "e", 1, 1, "f"): "g",
        ("rule", 0, "d", "h.i"): data["rule"][0]["d"]["h.i"],
        ("rule", 1, "j"): "end",
    }
    for path, value in leaves.items():
        start, length = where.values[path]
        assert tomllib.loads(f"x = {text[start:start + length]}")["x"] == value, path
    assert where.key(("rule", 1)).line == 11
    assert where.key(("rule", 0, "d", "h.i")) == where.loc(text.index("'h.i'"), 5)
    assert where.key(("rule", 5, "nothing")) == where.key(("rule",))
    assert where.key(("nothing",)) == where.value(("nothing",)) == where.loc(0)


@pytest.mark.parametrize(
    "text",
    ["a = '''abc", 'a = """abc', "a = 'abc", 'a = "abc\\', "a = [1, {b = 2", "[a", "a = {b = [}"],
)
def test_the_locator_stops_on_text_it_does_not_understand(text):
    where = _Locator(text)  # load_config never scans such text, but the scan must still end
    assert not where.complete
    assert where.key(("a", "b")).line == 1


def test_too_many_rules(tmp_path):
    rule = '[[rule]]\ncompressor = "quant"\n'
    error_at(tmp_path, rule * 1001, 2001, 1, "too many rules: 1001 (at most 1000)")
    assert len(load_config(write(tmp_path, rule * 1000, "ok.toml")).rules) == 1000


def test_a_compressor_valueerror_points_at_its_parameter(tmp_path, monkeypatch):
    """The compressors bound their parameters (ValueError naming the parameter); the error
    lands on that parameter's value, wherever it is."""

    def check_params(cls, params):
        if params["block"] > 16:
            raise ValueError(f"Dct: bad value {params['block']} for parameter 'block'")

    monkeypatch.setattr(Dct, "check_params", classmethod(check_params))
    text = '[default]\ncompressor = "dct"\nkeep = 2\n\n  block   =   4096  # tiles\n'
    error_at(tmp_path, text, 5, 15, "'block'", "4096")
    text = 'rule = [{ compressor = "dct", block = 64 }]\n'
    error_at(tmp_path, text, 1, col_of(text, 1, "64"), "'block'")


# -- hostile name globs ----------------------------------------------------------------------

HOSTILE_NAMES = [
    "'''a\"\"\"b'''",  # triple quotes of the other kind
    '"a\\"\\"\\"b"',  # escaped triple quotes
    "'a\\\\b'",  # backslashes (literal string: kept as is)
    '"a\\\\b"',
    "'\\N{BEL}'",  # \N escape text
    "'\\x00'",
    '"a\\nb"',  # a newline
    '"a\\rb"',
    '"""layer1.*\n"""',  # a newline from a multi-line string
    '"a\\u0000b"',  # NUL
    '"a\\u2028b"',  # unicode line and paragraph separators
    '"a\\u2029b"',
    '"a\\u0085b"',  # NEL
    '"a\\u202eb"',  # right-to-left override
    '"a\u2028b"',  # the same characters written raw into the file
    '"a\u202eb"',
    '"a\u200bb"',
    '"a\u00a0b"',
    '"\ud7ff"',  # unassigned
    '"a\\u001b[2Jb"',  # a terminal escape
    '"a\\tb"',
    '"a b"',
    '"a\'b"',
    "'a\"b'",
    '"{__import__}"',
    '"a#b"',
    '"a/b"',
    '"a$b"',
    '"é*"',
    '"ｌａｙｅｒ"',  # fullwidth letters: not ASCII
    f'"{"a" * 201}"',
]


@pytest.mark.parametrize("value", HOSTILE_NAMES)
def test_hostile_name_globs_are_refused(tmp_path, value):
    text = f'[[rule]]\nname = {value}\ncompressor = "quant"\n'
    message = error_at(tmp_path, text, 2, 8, "'name'")
    assert "\n" not in message.split("\n")[0]


@pytest.mark.parametrize("glob", ["layer1.*", "layer[0-9].?", "[!l]*", "a-b_c.0", "*" * 200])
def test_plain_globs_are_accepted(tmp_path, glob):
    config = load_config(write(tmp_path, f'[[rule]]\nname = "{glob}"\ncompressor = "quant"\n'))
    assert config.rules[0].name == glob


# -- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, line, col",
    [
        (b"rule = [1, 2]\n", 1, 9),
        (b'[default]\ncompressor = "bits"\n', 2, 14),
        (b'[default]\ncompressor = "dct"\nkeep = \xff\n', 3, 8),
        (b"masks = true\n[default\n", 2, 9),
    ],
)
def test_cli_generate_prints_the_error_and_exits_2(tmp_path, monkeypatch, content, line, col):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, content)
    result = CliRunner().invoke(
        app, ["generate", str(MODEL), "--compress-config", "bad.toml", "-o", "out.py"]
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    check_format(result.stderr.rstrip("\n"), Path("bad.toml"), line, col)
    assert not (tmp_path / "out.py").exists()
    assert path.read_bytes() == content


def test_cli_train_refuses_a_bad_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, 'rule = [{compressor = "dct", block = 1000000}]\n')
    result = CliRunner().invoke(
        app, ["train", str(MODEL), "--compress-config", "bad.toml", "--out", "run"]
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = result.stderr.rstrip("\n")
    assert not message.startswith("unroll: error: ")  # the same format as generate's
    head = check_format(message, (tmp_path / "bad.toml").resolve(), 1, 38)
    assert "'block'" in head
    assert not (tmp_path / "run").exists()


def test_installed_unroll_exits_2_without_a_traceback(tmp_path):
    write(tmp_path, b"# \xc3\x28\nrule = [1, 2]\n")
    result = subprocess.run(
        [str(UNROLL), "generate", str(MODEL), "--compress-config", "bad.toml", "-o", "x.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    check_format(result.stderr.rstrip("\n"), Path("bad.toml"), 1, 3)
    assert not (tmp_path / "x.py").exists()


# -- fuzz ------------------------------------------------------------------------------------

FUZZ_CASES = 3000 if os.environ.get("SLOW") == "1" else 200
CLEAN = """\
masks = true
[default]
compressor = "dct"
keep = 2
min_size = 8
[[rule]]
op = "batchnorm2d"
compressor = "quant"
bits = 4
[[rule]]
name = "layer1.*"
compressor = "none"
"""
CLEAN_INLINE = """\
masks = true
default = {compressor = "dct", keep = 2, min_size = 8}
rule = [
  {op = "batchnorm2d", compressor = "quant", bits = 4},  # comment
  {name = "layer1.*", compressor = "none"},
]
"""

STRINGS = [
    "dct", "quant", "none", "bits", "int8", "bf16", "f16", "f32", "conv2d", "relu",
    "batchnorm2d", "linear", "layer1.*", "layer1.?.conv1", "[!l]*", "*", "", "a" * 300,
    "'''", '"""', "\\", "\\N", "\n", "\r\n", "\x00", "\u2028", "\u2029", "\x1b[2J", "\t",
    "{x}", "%s", "é", "\ud7ff", "\U0001f600", "layer1.*\nimport os", "a\"b'c", "x" * 65,
]  # fmt: skip
KEYS = [
    "masks", "default", "rule", "compressor", "op", "name", "min_size", "keep", "block",
    "storage", "fold", "bits", "group_size", "stochastic", "kep", "mask", "Compressor",
    "", "a.b", "a b", "\n", "é", '"',
]  # fmt: skip


def toml_string(text: str, rng: random.Random) -> str:
    """``text`` as a TOML string of a random kind (a literal string if it can be one)."""
    literal_ok = all(c >= " " and c not in "'\x7f" for c in text)
    if literal_ok and rng.random() < 0.3:
        return f"'{text}'"
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c < " " or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        elif 0xD800 <= ord(c) <= 0xDFFF:
            out.append("?")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def toml_key(key: str, rng: random.Random) -> str:
    if key and re.fullmatch(r"[A-Za-z0-9_-]+", key) and rng.random() < 0.8:
        return key
    return toml_string(key, rng)


def random_value(rng: random.Random, depth: int = 0) -> str:
    """TOML text for a random value of any TOML type."""
    kind = rng.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return rng.choice(["true", "false"])
    if kind == 1:
        return str(rng.choice([0, 1, 2, 3, 4, 8, 9, 16, -1, 65536, 65537, 10**6, 2**63 - 1]))
    if kind == 2:
        return rng.choice(["nan", "inf", "-inf", "+nan", "0.5", "-0.0", "1e308", "4.0", "1e-300"])
    if kind == 3:
        return rng.choice(["0x10", "0o17", "0b101", "1_000", "-9223372036854775808"])
    if kind in (4, 5, 6):
        return toml_string(rng.choice(STRINGS), rng)
    if kind == 7:
        return rng.choice(["1979-05-27T07:32:00Z", "1979-05-27", "07:32:00", "1979-05-27 07:32"])
    if kind == 8:
        return "'''\n" + rng.choice(["layer1.*", "a\nb", '"""', "x\\y"]) + "'''"
    if kind == 9:
        items = [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
        return "[" + ", ".join(items) + "]"
    pairs = [
        f"{toml_key(rng.choice(KEYS), rng)} = {random_value(rng, depth + 1)}"
        for _ in range(rng.randrange(3))
    ]
    return "{" + ", ".join(pairs) + "}"


PAIR = re.compile(r"""(?P<key>[A-Za-z_]+) = (?P<value>"[^"\n]*"|[^,}\n]+)""")


def mutate(rng: random.Random) -> bytes:
    """A random variation of a clean config (tables or inline tables): values, keys and
    structure changed, then maybe raw bytes flipped, inserted or deleted."""
    text = rng.choice([CLEAN, CLEAN_INLINE])
    for _ in range(rng.randrange(1, 4)):
        pairs = list(PAIR.finditer(text))
        lines = text.split("\n")
        i = rng.randrange(len(lines))
        action = rng.randrange(9)
        if action <= 3 and pairs:
            pair = rng.choice(pairs)
            start, end = pair.span("value") if action < 3 else pair.span("key")
            new = random_value(rng) if action < 3 else toml_key(rng.choice(KEYS), rng)
            text = text[:start] + new + text[end:]
            continue
        if action == 4:
            lines.insert(i, f"{toml_key(rng.choice(KEYS), rng)} = {random_value(rng)}")
        elif action == 5:
            del lines[i]
        elif action == 6:
            header = ["[[rule]]", "[rule]", "[default]", "[rule.x]", "[masks]", "rule = [1, 2]"]
            lines.insert(i, rng.choice(header))
        elif action == 7:
            lines.insert(i, lines[rng.randrange(len(lines))])
        else:
            lines.insert(i, "# " + rng.choice(STRINGS).replace("\n", " "))
        text = "\n".join(lines)
    data = bytearray(text.encode("utf-8", "surrogatepass"))
    if rng.random() < 0.25:
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data) + 1)
            choice = rng.randrange(3)
            if choice == 0 and at < len(data):
                data[at] = rng.randrange(256)
            elif choice == 1:
                data.insert(at, rng.choice(b"\"'\\[]{}=#.\n\x00\xff\xc3\xe2 "))
            elif at < len(data):
                del data[at]
    return bytes(data)


@contextlib.contextmanager
def time_limit(seconds: int, message: str):
    """Fail (rather than hang) if the block runs longer than ``seconds``."""
    with shared_time_limit(seconds, pytest.fail.Exception(message, pytrace=False)):
        yield


def module_shape(source: str) -> list[str]:
    """The module compiles; its top-level statements by kind (the run of codec constants,
    ``CODEC_X = C.make(...)`` with literal arguments, as one item), and the methods of
    its one class."""
    compile(source, "<generated>", "exec")
    shape: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            (target,) = node.targets
            assert isinstance(target, ast.Name) and re.fullmatch(r"CODEC_[A-Z0-9_]+", target.id)
            call = node.value
            assert isinstance(call, ast.Call) and ast.unparse(call.func) == "C.make"
            assert all(isinstance(a, ast.Constant) for a in call.args)
            assert all(isinstance(k.value, ast.Constant) for k in call.keywords)
            if shape[-1] != "codecs":
                shape.append("codecs")
        elif isinstance(node, ast.FunctionDef):
            # block functions: their number depends on which instances compress alike
            assert re.fullmatch(r"\w+_(forward|backward|predict)(_v\d+)?", node.name)
            if shape[-1] != "block functions":
                shape.append("block functions")
        elif isinstance(node, ast.ClassDef):
            methods = [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
            shape.append(f"class {node.name}: {', '.join(methods)}")
        else:
            shape.append(type(node).__name__)
    return shape


def unformatted(graph, options: Options) -> str:
    """``render_graph``'s module without black's layout (``module_shape`` reads its syntax
    tree, which black keeps)."""
    return render(
        graph, "tiny_resnet.txt", options, compression_config(options, graph), readable=False
    )


def test_fuzzed_configs_are_refused_cleanly_or_generate_valid_code(tmp_path):
    graph = load_graph(MODEL)
    clean_path = write(tmp_path, CLEAN, "clean.toml")
    clean = module_shape(unformatted(graph, Options(compress_config=str(clean_path))))
    rng = random.Random(20240531)
    generated: dict[tuple, list[str]] = {}  # configs that differ only in text share a module
    outcomes = {"refused": 0, "accepted": 0}
    glob = re.compile(r"[A-Za-z0-9_.*?\[\]!-]{1,200}")
    for case in range(FUZZ_CASES):
        data = mutate(rng)
        path = write(tmp_path, data, f"fuzz{case % 7}.toml")
        try:  # TOML that tomllib reads, the locator understands to the end
            text = data.decode("utf-8-sig").replace("\r\n", "\n")
            tomllib.loads(text)
        except (ValueError, RecursionError):
            pass
        else:
            assert _Locator(text).complete, data
        try:
            with time_limit(10, f"case {case} hangs: {data!r}"):
                config = load_config(path)
        except ConfigError as exc:
            message = str(exc)
            head = check_format(message, path)
            line = int(HEAD.match(head)["line"])
            assert 1 <= line <= max(1, data.count(b"\n") + 1), (data, message)
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # anything else is a bug
            raise AssertionError(f"case {case}: {type(exc).__name__}: {exc}\n{data!r}") from exc
        outcomes["accepted"] += 1
        for rule in config.rules:
            assert rule.name is None or glob.fullmatch(rule.name), (data, rule)
        for codec in [config.default, *(rule.codec for rule in config.rules)]:
            for value in dict(codec.params if codec else ()).values():
                assert value is None or type(value) in (bool, int, str), (data, codec)
        key = (
            config.default,
            tuple((r.codec, r.op, r.name) for r in config.rules),
            config.masks,
        )
        if key not in generated:
            source = unformatted(graph, Options(compress_config=str(path)))
            generated[key] = module_shape(source)
        assert generated[key] == clean, (data, generated[key])
    # the generator explores both sides: neither outcome may be (nearly) absent
    assert outcomes["refused"] >= FUZZ_CASES // 4 and outcomes["accepted"] >= FUZZ_CASES // 20


def test_a_bad_value_that_names_another_parameter_points_at_its_own_key(tmp_path):
    path = write(tmp_path, '[default]\ncompressor = "dct"\nstorage = "keep"\nkeep = 4\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    check_format(str(info.value), path, 3, 11)
