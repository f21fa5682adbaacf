"""The importer's exact fallback: an ATen op no registry operator computes becomes one
``aten`` statement (the op run as is, its backward that call's vector-Jacobian product),
and the network still equals torch.autograd in float64 (1e-10, loss and every gradient).
``--no-fallback`` refuses as before; hostile ``op=`` / ``call=`` texts are refused at
their line and column; the ipu platform refuses the statement; Phi-3's full-width rotary
(an empty pass-through slice) imports."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from unroller.analysis.verify import verify_text
from unroller.cli import app
from unroller.errors import ModelError
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

runner = CliRunner()


class Ops(nn.Module):
    """addcmul, exp, cumsum, repeat_interleave, linalg_vector_norm, index with a constant
    index tensor, argmax on a path without gradient (gather's index), max.dim, unbind."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 4)
        self.head = nn.Linear(4 + 4 + 4 + 3 + 4 + 4, 5)

    def forward(self, x):
        h = self.fc(x)  # [N, 4, 4]
        s = torch.addcmul(h, h, h.transpose(1, 2), value=0.5)
        c = torch.cumsum(torch.exp(0.1 * s), dim=1)
        r = h.repeat_interleave(2, dim=1).mean(1)
        n = torch.linalg.vector_norm(h, dim=-1)
        i = h[:, torch.tensor([2, 0, 1])].sum(-1)
        picked = torch.gather(h, 2, h.argmax(dim=-1, keepdim=True)).squeeze(-1)
        m, _ = h.max(dim=1)
        u = torch.unbind(h, dim=1)
        feat = torch.cat([c.mean(1), r + u[1], n, i, picked, m + u[3]], dim=1)
        return self.head(feat)


class Noisy(nn.Module):
    """Noise added in training (randn_like); ``seeded`` draws it as the generated kernel
    does (torch's stream re-seeded by one draw of it), the reference to compare with."""

    seeded = False

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.seeded:
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed.item()))
                noise = torch.randn_like(h)
        else:
            noise = torch.randn_like(h)
        return self.head(torch.tanh(h + 0.1 * noise * h))


def _import(module, spec, fallback=True):
    return import_network(spec, ["x: f32[N, 4, 6]"], built=module, fallback=fallback)


def test_unmapped_ops_import_as_aten_statements_and_verify_exactly():
    imported = _import(Ops(), "ops")
    text = imported.text
    for op in (
        "aten.addcmul.default",
        "aten.exp.default",
        "aten.cumsum.default",
        "aten.repeat_interleave.self_int",
        "aten.linalg_vector_norm.default",
        "aten.index.Tensor",
        "aten.argmax.default",
        "aten.max.dim",
        "aten.unbind.int",
    ):
        assert f'op="{op}"' in text, text
        assert "# opaque: " in text
    assert "tensor((2, 0, 1), 'int64')" in text
    assert "output=0" in text and "output=3" in text
    report = verify_text(text, Ops)
    assert report.ok, report.problems or report.table()
    assert any(row.name.startswith("grad fc.weight") for row in report.rows)


def test_random_op_draws_from_a_kept_seed_and_matches_the_same_draws():
    imported = _import(Noisy(), "noisy")
    assert 'op="aten.randn_like.default"' in imported.text

    def reference():
        module = Noisy()
        module.seeded = True
        return module

    report = verify_text(imported.text, reference)
    # the training step: the loss and every gradient with the same draws (predict() draws
    # again, from wherever torch's stream then is, as the original's forward does)
    trained = [row for row in report.rows if not row.name.startswith("predictions")]
    assert len(trained) == 5 and all(row.ok for row in trained), report.table()


def test_no_fallback_refuses_as_before():
    with pytest.raises(ImportFailure, match="no registry operator computes it") as caught:
        _import(Ops(), "ops", fallback=False)
    assert "aten.addcmul" in caught.value.format()


def test_cli_lists_opaque_statements_and_no_fallback_refuses(tmp_path):
    source = tmp_path / "net.py"
    source.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 3)\n\n"
        "    def forward(self, x):\n        return self.fc(torch.exp(x))\n"
    )
    spec = f"{source}:Net"
    out = tmp_path / "net.txt"
    result = runner.invoke(app, ["import", spec, "--input", "x: f32[N, 4]", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "opaque: exp = aten(aten.exp.default)" in result.output
    assert 'aten(x, op="aten.exp.default", call="t0")' in out.read_text()
    refused = runner.invoke(
        app, ["import", spec, "--input", "x: f32[N, 4]", "--no-fallback", "-o", str(out), "--force"]
    )
    assert refused.exit_code == 2 and "aten.exp" in refused.output


MODEL = """model m {{
    input x: f32[N, 4]
    target y: f32[N, 4]
    e = aten(x, op={op}, call={call})
    loss = mse_loss(e, y)
    return loss, e
}}
"""


@pytest.mark.parametrize(
    "op, call, what",
    [
        ('"os.system"', '"t0"', "not an ATen overload"),
        ('"aten.exp.default; import os"', '"t0"', "not an ATen overload"),
        ('"aten.ex\\u00e9p.default"', '"t0"', "not an ATen overload"),
        ('"aten.nosuchop.default"', '"t0"', "no such operator"),
        ('"aten.exp.default"', "\"__import__('os')\"", "call"),
        ('"aten.exp.default"', '"t0.__class__"', "call"),
        ('"aten.exp.default"', '"t1"', "tensor input"),
    ],
)
def test_hostile_op_or_call_text_is_refused_at_its_line(tmp_path, op, call, what):
    from unroller.api import generate_from_text

    text = MODEL.format(op=op, call=call)
    with pytest.raises(ModelError) as caught:
        generate_from_text(text, label="m.txt")
    message = caught.value.format("m.txt", text)
    assert what in message, message
    assert message.startswith("m.txt:4:") and ": error:" in message, message


def test_ipu_refuses_an_aten_statement_with_its_reason(tmp_path):
    from unroller.api import generate_from_text
    from unroller.compiler.options import Options

    text = MODEL.format(op='"aten.exp.default"', call='"t0"')
    assert "K.aten(x, " in generate_from_text(text)
    with pytest.raises(ModelError, match="not supported on the ipu platform"):
        generate_from_text(text, Options(platform="ipu"))


def test_quant_scheme_runs_within_the_compressors_error():
    import copy

    import unroller

    module = Ops()
    reference = copy.deepcopy(module)
    x, y = torch.randn(8, 4, 6), torch.randint(0, 5, (8,))
    step = unroller.unroll(module, (x,), y, scheme="quant")
    loss = step(x, y)
    want = nn.functional.cross_entropy(reference(x), y)
    want.backward()
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    for (name, got), ref in zip(module.named_parameters(), reference.parameters()):
        error = float((got.grad - ref.grad).norm() / ref.grad.norm())
        assert error <= 0.05, (name, error)


def test_phi3_full_width_rotary_imports_and_verifies():
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        config = transformers.Phi3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
            use_cache=False,
            attn_implementation="sdpa",
        )
        return transformers.Phi3ForCausalLM(config)

    imported = import_network("phi3", ["ids: i64[N, 8]"], "y: i64[N, 8]", built=build())
    assert "rotary(" in imported.text
    report = verify_text(imported.text, build)
    assert report.ok, report.problems or report.table()


class Float32Inside(nn.Module):
    """What Gemma2's eager attention does: a softmax computed in float32 whatever the
    input's dtype (``dtype=torch.float32``, which the registry's softmax does not take),
    cast back after."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        p = torch.softmax(h @ h.transpose(1, 2), dim=-1, dtype=torch.float32).to(h.dtype)
        return self.head(p @ h)


def test_a_registry_refusal_falls_back_to_the_exact_call():
    """The softmax mapper refuses ``dtype=``; the fallback runs that very call instead (its
    float result in the step's float dtype, as the original's cast back makes it), listed
    as opaque; without the fallback the mapper's reason is the one given."""
    imported = _import(Float32Inside(), "inside")
    assert 'op="aten.softmax.int"' in imported.text and "torch.float32" in imported.text
    assert "refused it" in imported.text  # the "# opaque:" note says why
    report = verify_text(imported.text, Float32Inside)
    assert report.ok, report.problems or report.table()
    with pytest.raises(ImportFailure, match="softmax with a dtype"):
        _import(Float32Inside(), "inside", fallback=False)


def test_an_opaque_float_result_takes_the_steps_float_dtype():
    from unroller.runtime import opaque

    x = torch.randn(2, 3, dtype=torch.float64)
    out = opaque.run("aten.softmax.int", "t0, -1, dtype=torch.float32", [x])
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.softmax(x, -1, dtype=torch.float32).double())
    index = opaque.run("aten.argmax.default", "t0, -1", [x])
    assert index.dtype == torch.int64


def test_an_overload_name_with_capitals_resolves():
    """Falcon's ``aten.numpy_T.default`` (the ``.T`` of a 2-d weight)."""
    from unroller.runtime import opaque

    w = torch.randn(3, 4)
    assert torch.equal(opaque.run("aten.numpy_T.default", "t0", [w]), w.T)


class BatchSizedConstant(nn.Module):
    """A constant whose shape holds the batch size (a per-sample ``full`` built from
    ``x.shape[0]``) read by an op the registry lacks: the fallback must not bake the
    capture's batch size into the text."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        steps = torch.full((x.shape[0], 4, 4), 0.5).cumsum(dim=1)
        return torch.hypot(h, steps)


def test_a_constant_holding_the_batch_size_is_refused_not_baked_in():
    with pytest.raises(ImportFailure, match="a constant whose shape holds the batch size"):
        _import(BatchSizedConstant(), "sized")
