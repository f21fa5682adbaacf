"""Awkward names and strings: model text reaches generated code only as valid identifiers
or repr() literals.

Value names that are Python keywords (``lambda``, ``class``, ``def``, ``None``...), that
clash with names the generated module uses (``self``, ``torch``, ``K``, ``P``, ``Model``,
``grad_x`` next to ``x``, ``x_2``, ``_``...) or with ``nn.Module`` attributes
(``forward``, ``training``, ``double``, ``predict``), and dotted names whose mangled forms
collide (``a.b`` and ``a_b``) must still give a module that imports, trains in float64 to
1e-10 of a hand-written torch.nn equivalent, and has the torch.nn state-dict keys.
"""

from __future__ import annotations

import ast
import inspect
import io
import keyword
import tokenize

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import Tensor, nn

from unroller.api import generate_from_text, graph_from_text

TOL = 1e-10

NAMES_MODEL = """\
model class {
    input lambda: f32[N, 3, 6, 6]
    input x: f32[N, 4, 6, 6]
    target def: i64[N]

    block blk(in, c, None=1) {
        is = conv2d(in, out_channels=c, kernel_size=3, padding=None, bias=false)
        torch = batchnorm2d(is)
        K = relu(torch)
        return K
    }

    block outer(v) {
        sub.0 = blk(v, c=4)
        sub.1 = blk(sub.0, c=4, None=1)
        return sub.1
    }

    forward = conv2d(lambda, out_channels=4, kernel_size=3, padding=1)
    training = batchnorm2d(forward)
    self = relu(training)
    class = conv2d(self, out_channels=4, kernel_size=1, bias=false)
    grad_x = add(class, x)
    x_2 = tanh(grad_x)
    torch = sigmoid(x_2)
    layer1.0 = outer(torch)
    K = relu(layer1.0)
    P = mul(K, x_2)
    a.b = conv2d(P, out_channels=4, kernel_size=1)
    a_b = conv2d(a.b, out_channels=4, kernel_size=1)
    predict = conv2d(a_b, out_channels=4, kernel_size=1)
    _ = add(predict, P)
    Model = maxpool2d(_, kernel_size=2)
    None = flatten(Model)
    double = linear(None, out_features=5)
    super = cross_entropy(double, def)
    return super, double, x_2
}
"""

# (path, constructor) in the order the model defines them: the state-dict layout.
LAYERS = [
    ("forward", lambda: nn.Conv2d(3, 4, 3, padding=1)),
    ("training", lambda: nn.BatchNorm2d(4)),
    ("class", lambda: nn.Conv2d(4, 4, 1, bias=False)),
    ("layer1.0.sub.0.is", lambda: nn.Conv2d(4, 4, 3, padding=1, bias=False)),
    ("layer1.0.sub.0.torch", lambda: nn.BatchNorm2d(4)),
    ("layer1.0.sub.1.is", lambda: nn.Conv2d(4, 4, 3, padding=1, bias=False)),
    ("layer1.0.sub.1.torch", lambda: nn.BatchNorm2d(4)),
    ("a.b", lambda: nn.Conv2d(4, 4, 1)),
    ("a_b", lambda: nn.Conv2d(4, 4, 1)),
    ("predict", lambda: nn.Conv2d(4, 4, 1)),
    ("double", lambda: nn.Linear(36, 5)),
]


class NamesReference(nn.Module):
    """NAMES_MODEL by hand. Children are placed in ``_modules`` directly because
    ``forward``, ``training``, ``double`` and ``class`` cannot be set as attributes."""

    def __init__(self) -> None:
        super().__init__()
        for path, make in LAYERS:
            node: nn.Module = self
            *parents, leaf = path.split(".")
            for part in parents:
                if part not in node._modules:
                    node._modules[part] = nn.Module()
                node = node._modules[part]
            node._modules[leaf] = make()

    def layer(self, path: str) -> nn.Module:
        node: nn.Module = self
        for part in path.split("."):
            node = node._modules[part]
        return node

    def preds(self, lam: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        m = self.layer
        self_ = F.relu(m("training")(m("forward")(lam)))
        x_2 = torch.tanh(m("class")(self_) + x)
        h = torch.sigmoid(x_2)
        for i in (0, 1):
            h = F.relu(m(f"layer1.0.sub.{i}.torch")(m(f"layer1.0.sub.{i}.is")(h)))
        p = F.relu(h) * x_2
        predict = m("predict")(m("a_b")(m("a.b")(p)))
        pooled = F.max_pool2d(predict + p, 2)
        double = m("double")(torch.flatten(pooled, 1))
        return double, x_2

    def forward(self, lam: Tensor, x: Tensor, target: Tensor) -> Tensor:
        double, _ = self.preds(lam, x)
        return F.cross_entropy(double, target)

    def set_eval(self) -> None:
        # Not self.eval(): a child named "training" makes the root's train()/eval() raise.
        for module in list(self.modules())[1:]:
            module.eval()


def batch(seed: int, n: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lam = torch.randn(n, 3, 6, 6, generator=gen, dtype=torch.float64)
    x = torch.randn(n, 4, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (n,), generator=gen)
    return lam, x, y


@pytest.fixture(scope="module")
def names_source() -> str:
    return generate_from_text(NAMES_MODEL, label="names.txt")


def test_names_generate_valid_python(names_source: str):
    tree = ast.parse(names_source)
    compile(tree, "names.py", "exec")
    model_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    methods = {f.name: f for f in model_cls.body if isinstance(f, ast.FunctionDef)}
    assert set(methods) == {"__init__", "forward", "_step", "predict", "stash_report"}
    for name in ("forward", "predict"):
        args = [a.arg for a in methods[name].args.args]
        assert args[0] == "self" and len(set(args)) == len(args)
        assert not any(keyword.iskeyword(a) for a in args)
    assert len(methods["forward"].args.args) == 4  # self, lambda, x, def
    assert len(methods["_step"].args.args) == 6  # self, L, stash, lambda, x, def
    assert len(methods["predict"].args.args) == 3  # self, lambda, x
    # The module-level names the body relies on are never rebound by model values.
    for func in methods.values():
        stored = {
            n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        assert not stored & {"self", "torch", "K", "Model", "super", "None"}, stored
        assigned_p = [
            n
            for n in ast.walk(func)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "P" for t in n.targets)
        ]
        assert len(assigned_p) <= 1  # only `P = K.tensors(self)`


def test_mangled_names_are_distinct(names_source: str):
    """Every model value gets its own identifier, whatever the dots and clashes."""
    graph = graph_from_text(NAMES_MODEL, "names.txt")
    assert graph.node("a.b") is not graph.node("a_b")
    tree = ast.parse(names_source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    forward = next(  # the training step's body (forward only checks and dispatches)
        f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_step"
    )

    def kernel_targets(function: ast.FunctionDef) -> list[str]:
        targets: list[str] = []
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                is_kernel = isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "K"
                if (
                    is_kernel
                    and func.attr not in ("layers", "stash_log")
                    and "_backward" not in func.attr
                ):
                    first = node.targets[0]
                    name = first.elts[0] if isinstance(first, ast.Tuple) else first
                    targets.append(name.id)
        assert len(set(targets)) == len(targets), (function.name, targets)
        return targets

    # each node's output has one identifier: in forward, or in the forward function of
    # its block, called once per instance
    count = len(kernel_targets(forward))
    for node in ast.walk(forward):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in functions:
            count += len(kernel_targets(functions[node.func.id]))
    assert count == len(graph.nodes)


def test_names_state_dict_keys(build):
    module = build(NAMES_MODEL)
    gen = module.Model()
    ref = NamesReference()
    keys = list(gen.state_dict())
    assert keys == list(ref.state_dict())
    for key in (
        "forward.weight",
        "forward.bias",
        "training.weight",
        "training.running_mean",
        "training.num_batches_tracked",
        "class.weight",
        "layer1.0.sub.1.is.weight",
        "layer1.0.sub.0.torch.running_var",
        "a.b.weight",
        "a_b.weight",
        "predict.weight",
        "double.weight",
    ):
        assert key in keys, key
    # The methods are still the methods, though children share their names.
    assert inspect.ismethod(gen.forward) and inspect.ismethod(gen.predict)
    assert inspect.ismethod(gen.double)
    assert gen.training is True


def test_names_train_step_matches_torch_nn(build):
    torch.manual_seed(0)
    ref = NamesReference().double()
    gen = build(NAMES_MODEL).Model().double()
    result = gen.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for step in range(2):  # gradients accumulate, running statistics move twice
        lam, x, y = batch(step)
        ref_loss = ref(lam, x, y)
        ref_loss.backward()
        loss = gen(lam, x, y)
        assert loss.dim() == 0 and loss.dtype == torch.float64
        assert rel_err(loss, ref_loss) <= TOL, step
    ref_params = dict(ref.named_parameters())
    gen_params = dict(gen.named_parameters())
    assert sorted(gen_params) == sorted(ref_params)
    for name, param in gen_params.items():
        assert param.grad is not None, name
        assert rel_err(param.grad, ref_params[name].grad) <= TOL, name
    ref_buffers = dict(ref.named_buffers())
    for name, buf in gen.named_buffers():
        if buf.is_floating_point():
            assert rel_err(buf, ref_buffers[name]) <= TOL, name
        else:
            assert torch.equal(buf, ref_buffers[name]), name
            assert int(buf) == 2, name

    # predict(): evaluation mode, the predictions as the return line lists them.
    lam, x, _ = batch(7)
    ref.set_eval()
    with torch.no_grad():
        want = ref.preds(lam, x)
    got = gen.predict(lam, x)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL

    # And back: the generated state dict loads into the torch.nn tree.
    again = NamesReference().double()
    result = again.load_state_dict(gen.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in gen.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_keyword_statement_targets(build):
    """``input``, ``target``, ``block``, ``return`` and ``model`` as value names."""
    source = """\
model model {
    input input: f32[N, 4]
    target target: f32[N, 3]
    block block(block, model=3) {
        return = linear(block, out_features=model)
        return return
    }
    model = block(input)
    block.0 = relu(model)
    input.1 = mse_loss(block.0, target)
    return input.1, block.0
}
"""
    torch.manual_seed(0)
    gen = build(source).Model().double()
    assert list(gen.state_dict()) == ["model.return.weight", "model.return.bias"]
    ref = nn.Linear(4, 3).double()
    ref.load_state_dict({k.split(".")[-1]: v for k, v in gen.state_dict().items()})
    inp = torch.randn(5, 4, dtype=torch.float64)
    tgt = torch.randn(5, 3, dtype=torch.float64)
    ref_loss = F.mse_loss(F.relu(ref(inp)), tgt)
    ref_loss.backward()
    loss = gen(inp, tgt)
    assert rel_err(loss, ref_loss) <= TOL
    assert rel_err(gen.state_dict()["model.return.weight"], ref.weight) == 0
    params = dict(gen.named_parameters())
    assert rel_err(params["model.return.weight"].grad, ref.weight.grad) <= TOL
    assert rel_err(params["model.return.bias"].grad, ref.bias.grad) <= TOL
    assert rel_err(gen.predict(inp), F.relu(ref(inp))) <= TOL


# ---- strings ------------------------------------------------------------------------------

# A block keyword value is the one place a string from the model file reaches the
# generated file: the comment showing the inlined call, `# [block] o = tag(x, s='...')`.
NASTY = 'ZQX"""\'\\ \n#x\r\t\u2028\x00}{end'
NASTY_LITERAL = r'"ZQX\"\"\"\'\\ \n#x\r\t\u2028\x00}{end"'  # the same string in model syntax

STRING_MODEL = """\
model strings {
    input x: f32[N, 4]
    target y: f32[N, 3]
    block tag(v, s="DFLT \\"\\"\\" \\\\ \\n", mode="none") {
        h = linear(v, out_features=3)
        g = gelu(h, approximate=mode)
        return g
    }
    o = tag(x, s=@NASTY@, mode="tanh")
    p = tag(x)
    loss = mse_loss(o, y)
    return loss, o, p
}
""".replace("@NASTY@", NASTY_LITERAL)


def test_string_model_literal_decodes_to_nasty():
    graph = graph_from_text(STRING_MODEL, "strings.txt")
    texts = [b.text for node in graph.nodes for b in node.blocks]
    assert any(repr(NASTY) in t for t in texts)


def test_strings_reach_generated_code_only_as_repr_literals(build):
    text = generate_from_text(STRING_MODEL, label="strings.txt")
    ast.parse(text)
    # Nothing raw: the control and separator characters never appear in the file...
    for ch in ("\r", "\u2028", "\x00", "\t"):
        assert ch not in text, repr(ch)
    # ...and every line mentioning the marker is a comment holding the repr literal.
    lines = [line for line in text.splitlines() if "ZQX" in line]
    assert lines, "the block call should be shown in a comment"
    for line in lines:
        assert line.lstrip().startswith("# "), line
        assert repr(NASTY) in line, line
    # The default string is shown nowhere (it was not given in the call).
    assert "DFLT" not in text
    # Tokenizing finds the strings only inside comments: no code token carries them.
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.COMMENT:
            assert "ZQX" not in tok.string
    # The chosen mode reaches the kernels as a literal, and the module still runs.
    assert "approximate='tanh'" in text.replace('"', "'")
    gen = build(STRING_MODEL).Model().double()
    loss = gen(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "label",
    ['we"""ird\\name\n.txt', "dir/'quote'.txt", "uni\u2028code\x00.txt", "tab\there.txt"],
)
def test_odd_source_labels_keep_the_file_valid(label: str):
    """The recorded source path is not model text, but it must not break the file either."""
    text = generate_from_text(NAMES_MODEL, label=label)
    tree = ast.parse(text)
    assert ast.get_docstring(tree) is not None
    header = text.splitlines()[0]
    assert header.startswith("# unroller: ")
    from unroller.compiler.codegen import read_header

    assert read_header(text)["source"] == label
    for ch in ("\n", "\x00", "\u2028"):
        if ch in label:
            assert label not in text


# ---- value names whose first part is a number (a root nn.Sequential's `0.weight`)

INDEXED = """
model seq {
    input x: f32[N, 4]
    target y: i64[N]
    block mlp(x, w) {
        0 = linear(x, out_features=w)
        1 = relu(0)
        2 = linear(1, out_features=w)
        return 2
    }
    0 = linear(x, out_features=8)
    1 = relu(0)
    2.0 = mlp(1, w=8)
    3 = linear(2.0, out_features=3)
    loss = cross_entropy(3, y)
    return loss, 3
}
"""


def test_names_may_start_with_a_number_like_a_root_sequential(tmp_path):
    import torch
    from torch import nn

    from unroller.api import generate_from_text, import_generated, write_atomic

    path = tmp_path / "seq.py"
    write_atomic(path, generate_from_text(INDEXED))
    model = import_generated(path).Model().double()
    reference = nn.Sequential(
        nn.Linear(4, 8),
        nn.ReLU(),
        nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))),
        nn.Linear(8, 3),
    ).double()
    model.load_state_dict(reference.state_dict(), strict=True)
    reference.load_state_dict(model.state_dict(), strict=True)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    assert torch.allclose(model(x, y), loss, rtol=1e-12, atol=0)
    for key, p in reference.named_parameters():
        assert torch.allclose(dict(model.named_parameters())[key].grad, p.grad, rtol=1e-10)


@pytest.mark.parametrize(
    "stmt, message",
    [
        ("01 = relu(x)", "'01' (an integer part has no leading zeros)"),
        ("0.01 = relu(x)", "'01' (an integer part has no leading zeros)"),
        ("y2 = relu(3)", "unexpected number '3' (expected a value name"),
        ("y2 = relu(0)", "unexpected number '0'"),
    ],
)
def test_numeric_names_are_checked(stmt, message):
    from unroller.api import graph_from_text
    from unroller.errors import ModelError

    text = f"model m {{\n    input x: f32[N, 4]\n    {stmt}\n    return x\n}}\n"
    with pytest.raises(ModelError) as info:
        graph_from_text(text)
    assert message in info.value.message
