"""Instances that differ only in literal numbers share one block function (outline.py).

A depthwise conv's ``groups`` or the shape a saved tensor is restored to becomes a
parameter of the shared function, passed by keyword at each call; what each instance
computes is unchanged (the exactness tests of test_outline.py and test_models_v2.py run
these modules), so here: how many functions, how long the modules, and what each call
passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from unroller.api import generate_from_text, generate_source
from unroller.compiler.options import Options

ROOT = Path(__file__).resolve().parents[2]
MOBILENET = ROOT / "benchmarks/models/mobilenet_v2.txt"
RESNET_DCT = ROOT / "generated/gpu/resnet34/dct-dense.py"


def block_functions(source: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(source)
    return {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}


def calls_of(source: str, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
    ]


class _Literals(ast.NodeTransformer):
    """A function with its name, docstring and every number (not bool) blanked."""

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) in (int, float):
            return ast.Constant(value="#")
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        self.generic_visit(node)
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        return ast.FunctionDef(name="f", args=node.args, body=body, decorator_list=[], returns=None)


def differing_only_in_literals(source: str) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    pairs = []
    for name, function in block_functions(source).items():
        text = ast.dump(_Literals().visit(function))
        if text in seen:
            pairs.append((seen[text], name))
        seen.setdefault(text, name)
    return pairs


@pytest.mark.parametrize(
    "path", sorted(ROOT.glob("generated/**/*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_two_functions_of_a_golden_differ_only_in_literals(path):
    assert differing_only_in_literals(path.read_text()) == []


def test_the_check_sees_functions_that_differ_only_in_a_number():
    source = "def a(x):\n    return f(x, (2, 2))\n\n\ndef b(x):\n    return f(x, (4, 4))\n"
    assert differing_only_in_literals(source) == [("a", "b")]
    assert differing_only_in_literals(source.replace("(4, 4)", "(4, 4), True")) == []


def test_resnet34_dct_dense_restores_shapes_passed_by_each_call():
    source = RESNET_DCT.read_text()
    functions = block_functions(source)
    backward = [n for n in functions if n.startswith("basic_backward")]
    assert len(backward) == 3  # layer4.2 and layer4.1 keep other forms than the rest
    assert len(source.splitlines()) <= 1010  # 1,476 with a function per feature-map size
    shapes = {}
    for call in calls_of(source, "basic_backward_v3"):
        where = ast.literal_eval(call.args[0].args[0])
        (shape,) = [ast.literal_eval(k.value) for k in call.keywords if k.arg == "shape"]
        shapes[where] = shape
    assert shapes["layer3.5"] == (256, 8, 8)
    assert shapes["layer2.1"] == (128, 16, 16)
    assert shapes["layer1.0"] == (64, 32, 32)
    assert "shape" in [a.arg for a in functions["basic_backward_v3"].args.args]


def where(call: ast.Call) -> str:
    """The instance a block function is called for: ``L.within("features.3")`` or, with
    the stash log too, ``*K.within("features.3", L, stash)``."""
    scope = call.args[0]
    scope = scope.value if isinstance(scope, ast.Starred) else scope
    return ast.literal_eval(scope.args[0])


def keywords(call: ast.Call, name: str) -> list:
    return [ast.literal_eval(k.value) for k in call.keywords if k.arg == name]


@pytest.mark.parametrize("scheme, most", [("nocompress", 1300), ("quant", 1300)])
def test_mobilenet_v2_shares_a_function_per_block_kind(scheme, most):
    source = generate_source(MOBILENET, Options(scheme=scheme))
    functions = block_functions(source)
    # ir1, ir and ir_res: ir's stride is passed by each call, also where it is the default
    for section in ("forward", "backward", "predict"):
        names = [n for n in functions if f"_{section}" in n]
        assert len(names) == 3, (section, names)
    assert len(source.splitlines()) <= most  # 2,484 and 3,443 with one per channel count
    groups = {where(c): keywords(c, "groups") for c in calls_of(source, "ir_res_forward")}
    assert groups["features.3"] == [144] and groups["features.16"] == [960]
    stride = {where(c): keywords(c, "stride") for c in calls_of(source, "ir_forward")}
    assert stride["features.2"] == [(2, 2)] and stride["features.17"] == [(1, 1)]
    assert "stride" in [a.arg for a in functions["ir_forward"].args.args]
    assert keywords(calls_of(source, "ir_res_forward")[0], "stride") == []  # never passed


def test_a_default_left_out_by_some_instances_becomes_a_parameter():
    text = """
model strided {
    input x: f32[N, 4, 8, 8]
    target y: i64[N]
    block cb(x, s) {
        c = conv2d(x, out_channels=4, kernel_size=3, stride=s, padding=1, bias=false)
        r = relu(c)
        return r
    }
    b1 = cb(x, s=1)
    b2 = cb(b1, s=2)
    p = adaptive_avgpool2d(b2, output_size=1)
    f = flatten(p)
    out = linear(f, out_features=3)
    loss = cross_entropy(out, y)
    return loss, out
}
"""
    source = generate_from_text(text, Options())
    functions = block_functions(source)
    # (training: b2 keeps what b1 hands on, so their forms differ; predict keeps nothing)
    assert [n for n in functions if n.startswith("cb_predict")] == ["cb_predict"]
    assert {where(c): keywords(c, "stride") for c in calls_of(source, "cb_predict")} == {
        "b1": [(1, 1)],
        "b2": [(2, 2)],
    }
    assert "stride=stride" in ast.unparse(functions["cb_predict"])
    # one instance: the default stays left out, as in code without blocks
    alone = text.replace("    b2 = cb(b1, s=2)\n", "").replace("(b2,", "(b1,")
    single = generate_from_text(alone, Options())
    assert "stride=(1, 1)" not in single and "stride=stride" not in single
    assert 'K.conv2d(x, L["c"], padding=(1, 1))' in single


def test_a_literal_the_same_at_every_call_stays_in_the_function():
    text = """
model two {
    input x: f32[N, 4, 8, 8]
    target y: i64[N]
    block cb(x, ch) {
        c = conv2d(x, out_channels=ch, kernel_size=3, padding=1, bias=false)
        r = relu(c)
        return r
    }
    b1 = cb(x, ch=4)
    b2 = cb(b1, ch=4)
    b3 = cb(b2, ch=6)
    p = adaptive_avgpool2d(b3, output_size=1)
    f = flatten(p)
    out = linear(f, out_features=3)
    loss = cross_entropy(out, y)
    return loss, out
}
"""
    source = generate_from_text(text, Options())
    functions = block_functions(source)
    forward = [f for n, f in functions.items() if n.startswith("cb_forward")]
    assert forward and differing_only_in_literals(source) == []
    for function in forward:  # the same everywhere: no parameter
        assert "padding=(1, 1)" in ast.unparse(function)
        assert [a.arg for a in function.args.args if a.arg == "padding"] == []
