"""Nothing user-supplied reaches generated code except as a validated identifier or a repr.

The emitter is tested on its own here, behind the config and model-file validators: it is
fed hostile compression configs that no loader would accept, hostile source paths and
model texts whose comments and strings try to end a comment or a docstring. The emitted
module must have exactly the AST of a clean generation (only the module docstring's text
may differ, and it must read back as the hostile string), so nothing the template did not
put there can appear.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from unroller.api import generate_source, graph_from_text, render_graph
from unroller.compiler import codegen, safe
from unroller.compiler.codegen import read_header, render
from unroller.compiler.options import Options
from unroller.compiler.schemes import CompressionConfig, Rule, make_codec

TESTS = Path(__file__).resolve().parent.parent
TINY = TESTS / "models" / "tiny_resnet.txt"

HOSTILE = [
    'zz"""\nimport os; os.system(\'touch PWNED\')\nr"""',
    "zz'''\nimport os\n'''",
    "zz\\N",
    "zz\\x",
    "zz\\u12",
    "zz\\",
    'zz"',
    "zz\r__import__('os')",
    "zz\u2028x = 1",
    "zz\x00\x0c\x0b\x1b[2J",
    "zz\udcff",
    "zz {{ 7 * 7 }} {% raw %}",
    "zz" + '"' * 50 + "\\" * 51,
    "zz" + "é€😀" * 20,
]


def _shape(text: str) -> str:
    """The module's AST with the module docstring's text blanked."""
    tree = ast.parse(text)
    first = tree.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    first.value.value = "<docstring>"
    return ast.dump(tree)


def _docstring(text: str) -> str:
    return ast.get_docstring(ast.parse(text), clean=False)


def _config(*names: str) -> CompressionConfig:
    """Rules whose globs match no node (so the plan is the same), one per name."""
    quant = make_codec("quant", {"bits": 4})
    return CompressionConfig(
        default=make_codec("quant", {"bits": 8}),
        rules=[Rule(quant, op="conv2d", name=name) for name in names],
    )


@pytest.fixture(scope="module")
def graph():
    return graph_from_text(TINY.read_text(), "tiny.txt")


@pytest.fixture(scope="module")
def clean(graph):
    return render(graph, "tiny.txt", Options(), _config(*["nomatch"] * len(HOSTILE)))


def test_hostile_rule_globs_only_change_the_docstring_text(graph, clean):
    text = render(graph, "tiny.txt", Options(), _config(*HOSTILE))
    assert _shape(text) == _shape(clean)
    for name in HOSTILE:
        assert repr(name) in _docstring(text)  # read back exactly, as a repr


@pytest.mark.parametrize("num_ipus", [1, 2])
def test_hostile_rules_on_the_ipu_templates(graph, num_ipus):
    options = Options(platform="ipu", num_ipus=num_ipus)
    text = render(graph, "tiny.txt", options, _config(*HOSTILE))
    plain = render(graph, "tiny.txt", options, _config(*["nomatch"] * len(HOSTILE)))
    assert _shape(text) == _shape(plain)


@pytest.mark.parametrize("path_name", HOSTILE[:4], ids=range(4))
def test_hostile_source_paths(graph, clean, path_name):
    text = render(graph, path_name, Options(), _config("nomatch"))
    assert _shape(text) == _shape(clean)
    assert path_name in _docstring(text)
    assert read_header(text)["source"] == path_name  # the header's JSON keeps it exactly


def test_hostile_file_names_on_disk(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text(TINY.read_text())
    evil = tmp_path / 'a"""\nimport os\n\\N.txt'
    evil.write_text(TINY.read_text())
    clean_text = generate_source(plain, Options(scheme="dct-dense"))
    evil_text = generate_source(evil, Options(scheme="dct-dense"))
    assert _shape(evil_text) == _shape(clean_text)


def test_model_comments_and_layout_never_reach_code(graph):
    source = TINY.read_text()
    hostile = "\n".join(
        line + '  # """\\N\rimport os; os.system("x") \'\'\'' if "=" in line else line
        for line in source.splitlines()
    )
    # a statement over several lines, with a comment inside the call
    hostile = hostile.replace("r = relu(bn1)", 'r = relu(\n    # """ import os\n    bn1  # \\\n)')
    text = render_graph(graph_from_text(hostile, "tiny.txt"), "tiny.txt", Options())
    assert _shape(text) == _shape(render_graph(graph, "tiny.txt", Options()))
    assert "import os" not in text


def test_the_template_refuses_unvetted_text(graph, monkeypatch):
    def raw_layers(graph):
        return [("comment", "'key'", "K.Conv()")]  # plain str, not safe.Code

    monkeypatch.setattr(codegen, "layer_lines", raw_layers)
    with pytest.raises(safe.UnsafeText, match="unvetted text"):
        render_graph(graph, "tiny.txt", Options())


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -float("inf"), object(), {1: 2}, b"x", 1j, {1}]
)
def test_literals_are_type_checked(value):
    with pytest.raises(safe.UnsafeText):
        safe.literal(value)
    with pytest.raises(safe.UnsafeText):
        safe.literal((1, [2, value]))


@pytest.mark.parametrize(
    "name", ["", "1x", "a.b", "class", "None", "a b", "é", "x\n", "x;import os", "__import__('os')"]
)
def test_identifiers_are_checked(name):
    with pytest.raises(safe.UnsafeText):
        safe.identifier(name)


def _nasty_strings(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("\"'\\\n\r\t\x00\x0b\x0c\x1b\x85 #{}%Nxu0a") + [
        "\u2028",
        "\u2029",
        "\udcff",
        "é",
        "😀",
        '"""',
        "'''",
        "\\N{",
    ]
    return ["".join(rng.choices(alphabet, k=rng.randint(0, 40))) for _ in range(count)]


def test_doc_text_reads_back_exactly_inside_a_docstring():
    for text in _nasty_strings(1, 2000):
        module = f'"""start {safe.doc_text(text)} end"""\nx = 1\n'
        tree = ast.parse(module)
        assert len(tree.body) == 2
        assert ast.get_docstring(tree, clean=False) == f"start {text} end"


def test_comment_text_stays_on_one_line():
    for text in _nasty_strings(2, 2000):
        module = f"x = 1  # {safe.comment_text(text)}\ny = 2\n"
        tree = ast.parse(module)
        assert [type(s) for s in tree.body] == [ast.Assign, ast.Assign]
        assert len(module.splitlines()) == 2
