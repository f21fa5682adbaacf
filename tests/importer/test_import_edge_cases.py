"""Review of ``unroll import`` / ``unroll verify``: concrete cases, one per finding.

Each ``xfail(strict=True)`` test is a real bug today (its reason says which and where);
when it is fixed the test passes, strict xfail turns that into a failure, and the marker
is removed. The plain tests document holes that were checked and are not there (hostile
names and strings cannot inject statements, keyword-like module names work, no_grad and
detach are refused rather than differentiated through).

The networks are tiny and written below; every capture after the first takes well under a
second (the first pays for torch.export's warm-up).
"""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from unroller.analysis.verify import verify_text
from unroller.api import graph_from_text
from unroller.cli import app
from unroller.compiler.parser import parse
from unroller.importer.api import import_network, model_name
from unroller.importer.emit import comment, literal
from unroller.importer.model import ImportFailure, Unmapped, parse_tensor_spec

runner = CliRunner()

NETS = '''
import sys

import torch
from torch import nn
import torch.nn.functional as F


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


class SliceInplace(nn.Module):
    """relu_ on a slice of h writes into h, which fc2 then reads."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        h[:, :4].relu_()
        return self.fc2(h)


class SetItem(nn.Module):
    """h[:, 0] = 0: an item assignment (select + fill_) into h."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        h[:, 0] = 0.0
        return self.fc2(h)


class ContiguousInplace(nn.Module):
    """contiguous() of a contiguous tensor is the tensor: export follows it (no bug)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        y = h.contiguous()
        y.relu_()
        return self.fc2(h + y)


class ClampAfter(nn.Module):
    """A weight constraint applied in forward, after use (max-norm / clipping style)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.fc.weight.clamp_(-0.1, 0.1)
        return y


class Frozen(nn.Module):
    """A frozen body (requires_grad=False) under a trained head: fine-tuning."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.body.requires_grad_(False)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.body(x))


class PadInf(nn.Module):
    """'same' max pooling written as a -inf pad."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1, 1, 1), value=float("-inf"))).flatten(1)


class DivBatch(nn.Module):
    """Divides by the (symbolic) batch size: a SymInt reaches an ATen mapper."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) / x.shape[0]


class ZerosBroadcast(nn.Module):
    """[N, 1] + zeros[N, 4] broadcasts to [N, 4]."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x) + torch.zeros(x.shape[0], 4)


class Squeezed(nn.Module):
    """A regression head returning [N] (squeeze of [N, 1])."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x).squeeze(1)


class Unit(nn.Module):
    def __init__(self, stride):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, stride=stride, padding=1)
        self.s = stride

    def forward(self, x):
        return self.conv(x) * self.s


class FloatIntShare(nn.Module):
    """Unit(1), Unit(2): stride (1, 2) and the scale factor (1.0, 2.0) compare equal."""

    def __init__(self):
        super().__init__()
        self.a = Unit(1)
        self.b = Unit(2)

    def forward(self, x):
        return self.b(self.a(x)).flatten(1)


class BiasUnit(nn.Module):
    def __init__(self, pad, bias):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=pad, bias=bias)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class BoolIntShare(nn.Module):
    """padding (1, 0) and bias (True, False) compare equal."""

    def __init__(self):
        super().__init__()
        self.a = BiasUnit(1, True)
        self.b = BiasUnit(0, False)

    def forward(self, x):
        return self.b(self.a(x)).flatten(1)


class XChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Linear(4, 4)
        self.y = nn.Linear(4, 4)

    def forward(self, inp):
        return torch.relu(self.y(self.x(inp)))


class ChildNamedX(nn.Module):
    """A repeated submodule with a child named x: the block's input is also x."""

    def __init__(self):
        super().__init__()
        self.a = XChild()
        self.b = XChild()
        self.head = nn.Linear(4, 3)

    def forward(self, inp):
        return self.head(self.b(self.a(inp)))


class LoRALinear(nn.Linear):
    """A LoRA adapter: its own weight through F.linear plus a low-rank update."""

    def __init__(self, n, rank=2):
        super().__init__(n, n)
        self.lora_A = nn.Linear(n, rank, bias=False)
        self.lora_B = nn.Linear(rank, n, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x))


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = LoRALinear(4)
        self.v = LoRALinear(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.v(torch.relu(self.q(x)))))


class ChildY(nn.Module):
    """A child named y: the default target's name."""

    def __init__(self):
        super().__init__()
        self.y = nn.Linear(4, 3)

    def forward(self, x):
        return self.y(x)


class MHAMask(nn.Module):
    """nn.MultiheadAttention with a boolean attn_mask, where True means NOT allowed."""

    def __init__(self, convention="torch"):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.convention = convention

    def forward(self, x):
        L = x.shape[1]
        ones = torch.ones(L, L, dtype=torch.bool)
        # "torch": the documented causal mask for nn.MultiheadAttention (True above the
        # diagonal = masked); "inverted": True on and below it, which masks the past
        mask = torch.triu(ones, 1) if self.convention == "torch" else torch.tril(ones)
        out, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(out[:, 0])


class NoGradGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        with torch.no_grad():
            g = torch.sigmoid(h)
        return self.fc2(h * g)


class DetachGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(h).detach())


class Words(nn.Module):
    """Children named like the language's keywords and the loss."""

    WORDS = ("model", "input", "target", "block", "true", "N", "loss")

    def __init__(self):
        super().__init__()
        for word in self.WORDS:
            setattr(self, word, nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for word in self.WORDS:
            x = torch.relu(getattr(self, word)(x))
        return self.head(x)
'''


@pytest.fixture(scope="module")
def nets(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("review") / "review_nets.py"
    path.write_text(NETS)
    return str(path)


def exact_or_refused(spec: str, inputs: list[str], kwargs=None, **options) -> str:
    """'refused' (ImportFailure), or 'exact' after verify passes; a text that imports
    but does not verify fails the calling test (a silent mismatch)."""
    try:
        imported = import_network(spec, inputs, kwargs=kwargs, **options)
    except ImportFailure:
        return "refused"
    report = verify_text(imported.text, spec, kwargs)
    assert report.ok, f"imported silently but differs:\n{imported.text}\n{report.render()}"
    return "exact"


def imports_exactly(spec: str, inputs: list[str], kwargs=None, **options) -> str:
    """The imported text, after verify passes; ImportFailure propagates."""
    imported = import_network(spec, inputs, kwargs=kwargs, **options)
    report = verify_text(imported.text, spec, kwargs)
    assert report.ok, f"{imported.text}\n{report.render()}"
    return imported.text


def clear_failure(exc: ImportFailure) -> bool:
    return "internal error" not in exc.format()


# ------------------------------------------------------------------ 1. in place / dead nodes


@pytest.mark.parametrize("name", ["SliceInplace", "SetItem"])
def test_inplace_write_through_a_view_is_refused_or_exact(nets, name):
    exact_or_refused(f"{nets}:{name}", ["x: f32[N, 4]"])


def test_inplace_on_an_alias_that_is_the_tensor_itself_is_exact(nets):
    # checked, no hole: export rebinds h's proxy, so h and y both read the relu_
    assert exact_or_refused(f"{nets}:ContiguousInplace", ["x: f32[N, 4]"]) == "exact"


def test_dead_inplace_update_of_a_parameter_is_refused_or_exact(nets):
    exact_or_refused(f"{nets}:ClampAfter", ["x: f32[N, 4]"])


def test_frozen_parameters_are_refused_or_exact(nets):
    exact_or_refused(f"{nets}:Frozen", ["x: f32[N, 4]"])


@pytest.mark.parametrize("name", ["NoGradGate", "DetachGate"])
def test_no_grad_and_detach_are_refused_not_differentiated(nets, name):
    # checked, no hole: a gradient stop is refused, never mapped as the identity
    with pytest.raises(ImportFailure) as caught:
        import_network(f"{nets}:{name}", ["x: f32[N, 4]"])
    text = caught.value.format()
    assert "wrap_with_set_grad_enabled" in text or "aten.detach" in text


# ------------------------------------------------------------------ 2. error handling


def test_non_finite_keyword_value_is_a_one_line_error(nets, tmp_path):
    """The registry's pad takes finite values only: registry only, a one-line error and
    nothing written; with the fallback the very call (its -inf literal) runs as is."""
    out = tmp_path / "pad.txt"
    argv = ["import", f"{nets}:PadInf", "--input", "x: f32[N, 2, 5, 5]", "-o", str(out)]
    result = runner.invoke(app, [*argv, "--no-fallback"])
    assert result.exit_code == 2 and "unroll: error:" in result.output, result.exception
    assert not out.exists()
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "= aten(x, op=" in text and "-inf" in text, text


def test_a_crashing_mapper_is_reported_as_unmapped(nets):
    with pytest.raises(ImportFailure) as caught:
        import_network(f"{nets}:DivBatch", ["x: f32[N, 4]"])
    assert "aten.div" in caught.value.format()


def test_an_input_too_large_to_build_is_a_clear_error(nets):
    with pytest.raises(ImportFailure):
        import_network(f"{nets}:Tiny", ["x: f32[N, 2147483647, 2147483647]"])


def test_a_spec_file_that_exits_is_a_one_line_error(tmp_path):
    source = tmp_path / "script.py"
    source.write_text("import sys\nsys.exit('usage: python script.py DATA')\n")
    result = runner.invoke(app, ["import", f"{source}:Net", "--input", "x: f32[N, 4]"])
    assert result.exit_code == 2 and "unroll: error:" in result.output


def test_unmapped_report_cannot_forge_lines_or_escape_sequences():
    item = Unmapped(
        op="onnx::Evil\x1b[2J",
        module_path="a",
        module_class="Evil\nunroll: error: forged",
        reason="why\r",
    )
    text = ImportFailure("cannot import x.onnx", [item]).format()
    assert len(text.splitlines()) == 2, text
    assert not any(unicodedata.category(ch) == "Cc" for ch in text.replace("\n", ""))


# ------------------------------------------------------------------ 3. block recovery


@pytest.mark.parametrize("name", ["FloatIntShare", "BoolIntShare"])
def test_block_slots_of_different_types_stay_apart(nets, name):
    imports_exactly(f"{nets}:{name}", ["x: f32[N, 2, 8, 8]"])


def test_block_input_name_avoids_child_names(nets):
    imports_exactly(f"{nets}:ChildNamedX", ["inp: f32[N, 4]"])


def test_module_with_own_weight_and_children_lora(nets):
    imports_exactly(f"{nets}:LoRANet", ["x: f32[N, 4]"])


# ------------------------------------------------------------------ 4. names, loss, target


@pytest.mark.parametrize(
    "name, target", [("ChildY", None), ("Tiny", "fc: i64[N]"), ("Tiny", "loss: i64[N]")]
)
def test_target_names_never_collide(nets, name, target):
    try:
        imports_exactly(f"{nets}:{name}", ["x: f32[N, 4]"], target=target)
    except ImportFailure as exc:  # refusing is fine, with a message the user can act on
        assert clear_failure(exc), exc.format()


def test_input_named_like_a_module_says_so(nets):
    with pytest.raises(ImportFailure) as caught:
        import_network(f"{nets}:Tiny", ["fc: f32[N, 4]"])
    assert "shared weights" not in caught.value.format()


@pytest.mark.parametrize(
    "loss, target",
    [
        ("mse_loss", "y: i64[N, 3]"),
        ("bce_with_logits", "y: i64[N, 3]"),
        ("mse_loss", "y: f64[N, 3]"),
    ],
)
def test_float_loss_targets_are_checked_before_emitting(nets, loss, target):
    with pytest.raises(ImportFailure) as caught:
        import_network(f"{nets}:Tiny", ["x: f32[N, 4]"], target=target, loss=loss)
    assert clear_failure(caught.value) and "--target" in caught.value.format()


def test_predictions_of_shape_n_import(nets):
    imports_exactly(f"{nets}:Squeezed", ["x: f32[N, 4]"], loss="mse_loss")


def test_adding_broadcast_zeros_keeps_the_broadcast_shape(nets):
    exact_or_refused(f"{nets}:ZerosBroadcast", ["x: f32[N, 4]"])


def test_mha_boolean_causal_mask_in_torch_convention_imports(nets):
    text = imports_exactly(f"{nets}:MHAMask", ["x: f32[N, 5, 8]"], {"convention": "torch"})
    assert "is_causal=true" in text


def test_mha_inverted_boolean_mask_is_not_taken_for_causal(nets):
    exact_or_refused(f"{nets}:MHAMask", ["x: f32[N, 5, 8]"], {"convention": "inverted"})


# ------------------------------------------------------------------ 5. SPEC resolution


def test_module_spec_never_resolves_from_the_working_folder(nets, tmp_path, monkeypatch):
    """A dotted SPEC comes from the installed environment; local code is named as a file
    (tests/adversarial/test_import_verify.py: a planted package shadowing an installed one)."""
    (tmp_path / "review_cwd_net.py").write_text(Path(nets).read_text())
    monkeypatch.setattr(sys, "path", [str(tmp_path), "", *sys.path])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ImportFailure, match=r"not searched .*review_cwd_net\.py:NAME"):
        import_network("review_cwd_net:Tiny", ["x: f32[N, 4]"])
    imported = import_network("review_cwd_net.py:Tiny", ["x: f32[N, 4]"])
    assert "fc = linear(x, out_features=3)" in imported.text


def test_file_spec_can_import_its_siblings(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "review_blocks.py").write_text(
        "from torch import nn\n\nclass Block(nn.Linear):\n    pass\n"
    )
    (folder / "net.py").write_text(
        "from torch import nn\nfrom review_blocks import Block\n\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = Block(4, 3)\n\n    def forward(self, x):\n        return self.fc(x)\n"
    )
    imported = import_network(f"{folder / 'net.py'}:Net", ["x: f32[N, 4]"])
    assert "fc = linear(x" in imported.text


def test_kwargs_with_an_onnx_spec_are_refused(tmp_path):
    with pytest.raises(ImportFailure, match="--kwargs"):
        import_network(str(tmp_path / "missing.onnx"), ["x: f32[N, 4]"], kwargs='{"a": 1}')


# ------------------------------------------------------------------ 6. verify


class Branch(nn.Module):
    """fc2's contribution is scaled by 1e-15: its gradient is ~1e-15 of fc1's, and exact."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc1(x) + self.fc2(x) * 1e-15


BRANCH_TEXT = """model branch {{
    input x: f32[N, 4]
    target y: i64[N]
    fc1 = linear(x, out_features=3)
    fc2 = linear(x, out_features=3)
    small = scale(fc2, factor={factor})
    out = add(fc1, small)
    loss = cross_entropy(out, y)
    return loss, out
}}
"""


def test_verify_passes_the_true_small_branch():
    assert verify_text(BRANCH_TEXT.format(factor="1e-15"), Branch).ok


def test_verify_does_not_pass_a_wrong_small_gradient_as_noise():
    report = verify_text(BRANCH_TEXT.format(factor="0.0"), Branch)
    assert not report.ok, report.render()


class FailsInEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if not self.training:
            raise RuntimeError("this network has no eval mode")
        return self.fc(x)


TINY_TEXT = """model tiny {
    input x: f32[N, 4]
    target y: i64[N]
    fc = linear(x, out_features=3)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""


def test_verify_reports_an_eval_forward_that_fails():
    report = verify_text(TINY_TEXT, FailsInEval)  # a FAIL row saying so, not a traceback
    assert not report.ok
    assert any("eval forward failed" in row.note for row in report.failed)


def test_verify_leaves_a_named_module_instance_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "review_instance_mod.py").write_text(
        "from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = nn.Linear(4, 3)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n\nnet = Net()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "review_instance_mod", raising=False)
    assert verify_text(TINY_TEXT, "review_instance_mod:net").ok
    import review_instance_mod

    assert review_instance_mod.net.fc.weight.dtype == torch.float32


# ------------------------------------------------------------------ 7. injection (no holes)

HOSTILE = [
    "\n}\nmodel pwned {",
    "a\r\nb = relu(fc)",
    "a\u2028b = relu(fc)",
    "a\u2029b",
    "a\x85b",
    "a\x1cb\x1db\x1eb",
    "a\x0bb\x0cb",
    "\u202e}\u2066gnp.exe",
    "\x1b[2J\x00\x7f\ud800",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_comment_keeps_hostile_text_inside_the_comment(hostile):
    text = (
        "model m {\n    input x: f32[N, 4]\n    target y: i64[N]\n"
        f"    fc = linear(x, out_features=3)  # {comment(hostile)}\n"
        f"# {comment(hostile)}\n"
        "    loss = cross_entropy(fc, y)\n    return loss, fc\n}\n"
    )
    graph = graph_from_text(text)
    assert [node.name for node in graph.nodes] == ["fc", "loss"]


@pytest.mark.parametrize(
    "value", ['tanh", p=1, q="', "a\\\\", '\\"', '"); model x {', "\\u0041", "tanh\\"]
)
def test_literal_strings_parse_back_to_themselves(value):
    text = (
        "model m {\n    input x: f32[N, 4]\n    target y: i64[N]\n"
        f"    fc = gelu(x, approximate={literal(value)})\n"
        "    loss = cross_entropy(fc, y)\n    return loss, fc\n}\n"
    )
    ast = parse(text)
    (kwarg,) = ast.stmts[0].kwargs
    assert kwarg.name == "approximate" and kwarg.value.value == value
    assert [stmt.target for stmt in ast.stmts] == ["fc", "loss"]


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "a\nb", "\x1b"])
def test_literal_refuses_what_it_cannot_write(value):
    with pytest.raises(ValueError):
        literal(value)


@pytest.mark.parametrize("name", ["x {", "a b", "m}\nmodel n", "ü", "x.y", ""])
def test_hostile_model_names_are_refused(name):
    with pytest.raises(ImportFailure):
        model_name("pkg:Net", name)


@pytest.mark.parametrize(
    "spec", ["x}: f32[N, 4]", "x: f32[N, 4]\ninput z: f32[N, 4]", "x.y: f32[N]", "x: f32[N, 0]"]
)
def test_hostile_input_specs_are_refused(spec):
    with pytest.raises(ImportFailure):
        parse_tensor_spec(spec)


def test_keyword_like_module_names_import_exactly(nets):
    assert exact_or_refused(f"{nets}:Words", ["x: f32[N, 4]"]) == "exact"
