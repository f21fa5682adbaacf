"""Recurrent layers: ``lstm`` and ``gru`` (unroller/runtime/recurrent.py).

The kernels against torch.nn.LSTM / torch.nn.GRU differentiated by torch.autograd, in
float64: 1 and 2 layers, bidirectional, batch_first true and false on the torch side (the
kernels are batch first, as the language), with and without the initial states, bias=False;
every gradient (input, h0 / c0, each parameter) within 1e-10 of autograd's, judged against
the largest entry of its own reference gradient. tests/runtime/test_kernels.py runs the opinfo rows
(tests/opinfo.py) beside these: every ``needs`` pattern, float32, the ipu rules.

Then models in the language, generated for gpu and ipu (PopTorch emulated on the CPU)
against the same network in torch.nn, a quant generation whose gradient error is bounded,
and the errors a bad call gets.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import import_zoo
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import Tensor, nn

from unroller.api import generate_from_text, graph_from_text
from unroller.compiler.options import Options
from unroller.errors import ModelError
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure
from unroller.runtime import ipu_device
from unroller.runtime import recurrent as R

F64 = torch.float64
TOL = 1e-10


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: torch's intra-op threads would only contend on busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _max_rel(ours: Tensor, ref: Tensor) -> float:
    """Largest error relative to the largest entry of the reference (an entry that is zero
    in exact arithmetic is judged against the gradient's scale, not against itself)."""
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _run(cls, layers: int, bidirectional: bool, bias: bool, batch_first: bool, given: int):
    """(kernel gradients, autograd gradients, forward errors) for one configuration."""
    torch.manual_seed(layers * 100 + 10 * bidirectional + 3 * bias + given)
    module = cls(5, 4, layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
    module = module.double()
    directions = 2 if bidirectional else 1
    x = torch.randn(3, 6, 5, dtype=F64, requires_grad=True)  # [N, L, E], as the language
    states = [
        torch.randn(3, layers * directions, 4, dtype=F64, requires_grad=True) for _ in range(given)
    ]
    hx = [s.transpose(0, 1) for s in states]  # torch's [S, N, H]
    if cls is nn.LSTM and len(hx) == 1:  # torch takes both: c0 zeros, as the kernel's
        hx.append(torch.zeros_like(hx[0]))
    hx_arg = None if not hx else (tuple(hx) if cls is nn.LSTM else hx[0])
    y = module(x if batch_first else x.transpose(0, 1), hx_arg)[0]
    y = y if batch_first else y.transpose(0, 1)
    g = torch.randn_like(y)
    leaves = [x, *states, *module.parameters()]
    refs = torch.autograd.grad(y, leaves, g)
    forward, backward = (R.lstm, R.lstm_backward) if cls is nn.LSTM else (R.gru, R.gru_backward)
    with torch.no_grad():
        out, *kept = forward(x, *states, module, num_layers=layers, bidirectional=bidirectional)
        grads = backward(
            g, x, module, *kept, num_layers=layers, bidirectional=bidirectional,
            initial_states=given,
        )  # fmt: skip
    return out, y, grads, refs


CONFIGS = [
    (cls, layers, bi, bias, batch_first, given)
    for cls in (nn.LSTM, nn.GRU)
    for layers, bi, bias, batch_first in product(
        (1, 2), (False, True), (True, False), (True, False)
    )
    for given in range(3 if cls is nn.LSTM else 2)
    if bias or given == (2 if cls is nn.LSTM else 1)  # bias=False: once, with every state
]


@pytest.mark.parametrize(
    "cls,layers,bi,bias,batch_first,given",
    CONFIGS,
    ids=[
        f"{c.__name__}-l{n}-{'bi' if b else 'uni'}-{'bias' if s else 'nobias'}"
        f"-{'bf' if f else 'tf'}-states{k}"
        for c, n, b, s, f, k in CONFIGS
    ],
)
def test_kernels_match_autograd(cls, layers, bi, bias, batch_first, given):
    out, y, grads, refs = _run(cls, layers, bi, bias, batch_first, given)
    assert _max_rel(out, y.detach()) <= 1e-12
    ours = [t for t in grads if t is not None]
    assert len(ours) == len(refs)  # x, the states given, every parameter; nothing else
    names = ["x", *(f"state{i}" for i in range(given))]
    names += [n for n, _ in (nn.LSTM if cls is nn.LSTM else nn.GRU)(1, 1).named_parameters()]
    for i, (a, b) in enumerate(zip(ours, refs)):
        assert a.shape == b.shape, i
        assert _max_rel(a, b) <= TOL, (i, _max_rel(a, b))


def test_kernel_parameter_slots_follow_the_registry():
    """The backward returns (x, states..., then one slot per registry parameter), None where
    the layer has no such parameter: the generated code unpacks it by the registry."""
    from unroller.compiler.registry import load_registry

    ops = load_registry()
    for name, cls in (("lstm", nn.LSTM), ("gru", nn.GRU)):
        module = cls(3, 2, 2, bidirectional=True).double()
        x = torch.randn(2, 4, 3, dtype=F64)
        forward = getattr(R, name)
        backward = getattr(R, f"{name}_backward")
        out, *kept = forward(x, module, num_layers=2, bidirectional=True)
        grads = backward(
            torch.ones_like(out), x, module, *kept, num_layers=2, bidirectional=True,
            initial_states=0,
        )  # fmt: skip
        params = [p.name for p in ops[name].params]
        assert len(grads) == 1 + len(params)
        present = dict(module.named_parameters())
        for slot, grad in zip(params, grads[1:]):
            assert (grad is not None) == (slot in present), slot
            if grad is not None:
                assert grad.shape == present[slot].shape, slot


# ---------------------------------------------------------------- models in the language

SEQUENCE = """\
model sequence {
    input x: f32[N, 7, 5]
    input h: f32[N, 4, 6]
    input c: f32[N, 4, 6]
    target y: i64[N]
    rnn = lstm(x, h, c, hidden_size=6, num_layers=2, bidirectional=true)
    gru1 = gru(rnn, hidden_size=4, bias=false)
    last = select(gru1, dim=1, index=-1)
    head = linear(last, out_features=3)
    loss = cross_entropy(head, y)
    return loss, head
}
"""


class Sequence(nn.Module):
    """SEQUENCE in torch.nn: a 2-layer bidirectional LSTM from given states, a bias-free GRU
    from zeros, a linear head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(5, 6, 2, batch_first=True, bidirectional=True)
        self.gru1 = nn.GRU(12, 4, bias=False, batch_first=True)
        self.head = nn.Linear(4, 3)

    def logits(self, x: Tensor, h: Tensor, c: Tensor) -> Tensor:
        out, _ = self.rnn(x, (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()))
        return self.head(self.gru1(out)[0][:, -1])

    def forward(self, x: Tensor, h: Tensor, c: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.logits(x, h, c), y)


def _batch(step: int, batch: int = 5) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 7, 5, generator=gen, dtype=F64)
    h = torch.randn(batch, 4, 6, generator=gen, dtype=F64) * 0.5
    c = torch.randn(batch, 4, 6, generator=gen, dtype=F64) * 0.5
    return x, h, c, torch.randint(0, 3, (batch,), generator=gen)


def _reference() -> nn.Module:
    torch.manual_seed(0)
    return Sequence().double()


def _errors(got: dict[str, Tensor | None], ref: nn.Module) -> dict[str, float]:
    out = {}
    for name, p in ref.named_parameters():
        assert got[name] is not None, f"{name}: no gradient"
        out[name] = _max_rel(got[name], p.grad)
    return out


def test_gpu_model_matches_torch_nn(build):
    """Two steps (gradients accumulate), then predict(); state-dict names are torch's."""
    ref = _reference()
    gen = build(SEQUENCE, Options()).Model().double()
    assert list(gen.state_dict()) == list(ref.state_dict())
    gen.load_state_dict(ref.state_dict())
    for step in range(2):
        batch = _batch(step)
        ref_loss = ref(*batch)
        ref_loss.backward()
        assert rel_err(gen(*batch), ref_loss) <= TOL
    errors = _errors({n: p.grad for n, p in gen.named_parameters()}, ref)
    assert max(errors.values()) <= TOL, errors
    x, h, c, _ = _batch(9)
    with torch.no_grad():
        assert rel_err(gen.predict(x, h, c), ref.logits(x, h, c)) <= TOL


@pytest.fixture
def emulation():
    ipu_device.use_emulation()
    yield
    ipu_device.use_emulation(False)


def test_ipu_model_matches_torch_nn(build, emulation):
    """The ipu module (PopTorch emulated on the CPU) hands its unrolled gradients over
    through the surrogate loss; they equal autograd's on the torch.nn twin."""
    ref = _reference()
    ipu = build(SEQUENCE, Options(platform="ipu")).Model().double()
    ipu.load_state_dict(ref.state_dict())
    batch = _batch(0)
    surrogate, loss = ipu(*batch)
    surrogate.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= TOL
    errors = _errors({n: p.grad for n, p in ipu.named_parameters()}, ref)
    assert max(errors.values()) <= TOL, errors


DEEP = """\
model deep {
    input x: f32[N, 5, 3]
    target y: i64[N]
    rnn = RNN(x, hidden_size=4, num_layers=6, bidirectional=true)
    last = select(rnn, dim=1, index=-1)
    head = linear(last, out_features=3)
    loss = cross_entropy(head, y)
    return loss, head
}
"""


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_a_stack_deeper_than_the_listed_layers_matches_torch_nn(build, cls, platform):
    """num_layers = 6, more than the registry lists parameter rows for by default (4): the
    loader makes the rows of layers 4 and 5 (registry.LayerParams), the kernels fill their
    slots, and every gradient equals autograd's on torch.nn's 6-layer module in float64."""
    name = "lstm" if cls is nn.LSTM else "gru"
    if platform == "ipu":
        ipu_device.use_emulation()
    try:
        gen = build(DEEP.replace("RNN", name), Options(platform=platform)).Model().double()
    finally:
        if platform == "ipu":
            ipu_device.use_emulation(False)
    torch.manual_seed(1)
    rnn = cls(3, 4, 6, batch_first=True, bidirectional=True).double()
    head = nn.Linear(8, 3).double()
    state = {f"rnn.{k}": v for k, v in rnn.state_dict().items()}
    state |= {f"head.{k}": v for k, v in head.state_dict().items()}
    assert list(gen.state_dict()) == list(state)
    gen.load_state_dict(state)
    gen_x = torch.Generator().manual_seed(2)
    x = torch.randn(4, 5, 3, generator=gen_x, dtype=F64)
    y = torch.randint(0, 3, (4,), generator=gen_x)
    ref_loss = F.cross_entropy(head(rnn(x)[0][:, -1]), y)
    ref_loss.backward()
    if platform == "ipu":
        ipu_device.use_emulation()
        try:
            surrogate, loss = gen(x, y)
            surrogate.backward()
        finally:
            ipu_device.use_emulation(False)
    else:
        loss = gen(x, y)
    assert rel_err(loss, ref_loss) <= TOL
    refs = dict(rnn.named_parameters(prefix="rnn")) | dict(head.named_parameters(prefix="head"))
    errors = _errors({n: p.grad for n, p in gen.named_parameters()}, _Named(refs))
    assert max(errors.values()) <= TOL, errors


class _Named:
    """The reference parameters by name, as ``_errors`` reads a module's."""

    def __init__(self, params: dict[str, Tensor]) -> None:
        self.params = params

    def named_parameters(self):
        return self.params.items()


def test_quant_keeps_gates_and_states_compressed_with_a_bounded_error(build):
    """Under quant the kept gates, states and the GRU's input (the LSTM's output) are 8-bit
    codes; the model input x stays raw. The gradients then differ from autograd's by the
    codec's error carried through time: 0.5% to 1.4% of each gradient's largest entry over
    five batches, asserted below 5%, and above 1e-6 (the codec did act)."""
    ref = _reference()
    gen = build(SEQUENCE, Options(scheme="quant")).Model().double()
    gen.load_state_dict(ref.state_dict())
    batch = _batch(0)
    gen(*batch)
    ref(*batch).backward()
    kept = {r["tensor"]: r["compressor"] for r in gen.stash_report()["rows"]}
    assert kept["x"] == "raw", kept
    for key in ("rnn:gates", "rnn:hiddens", "rnn:cells", "gru1:gates", "gru1:hiddens", "rnn"):
        assert "Quant(" in kept[key], (key, kept)
    errors = _errors({n: p.grad for n, p in gen.named_parameters()}, ref)
    assert max(errors.values()) <= 0.05, errors
    recurrent = [e for name, e in errors.items() if not name.startswith("head.")]
    assert min(recurrent) > 1e-6, errors  # the codec did act on what the layers keep


# ---------------------------------------------------------------- errors


def _source(line: str) -> str:
    return (
        "model m {\n    input x: f32[N, 7, 5]\n    input h: f32[N, 2, 4]\n"
        f"    target y: f32[N, 56]\n    {line}\n    f = flatten(o)\n"
        "    loss = mse_loss(f, y)\n    return loss\n}\n"
    )


ERRORS = [
    (
        "batch-first-false",
        "o = lstm(x, hidden_size=4, batch_first=false)",
        "lstm: batch_first=false is not supported: every tensor of the language has the batch "
        "dim N first",
    ),
    (
        "gru-two-states",
        "o = gru(x, h, h, hidden_size=4)",
        "gru takes x and at most 1 initial state(s) (h0), got 3 tensors",
    ),
    (
        "h0-shape",
        "o = lstm(x, h, hidden_size=4)",
        "lstm: h0 must be f32[N, 1, 4] ([N, num_layers * directions, hidden_size], batch "
        "first), got f32[N, 2, 4]",
    ),
    (
        "no-layers",
        "o = gru(x, hidden_size=4, num_layers=0)",
        "num_layers",
    ),
]


@pytest.mark.parametrize("label,line,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_calls_are_located_errors(label, line, message):
    with pytest.raises(ModelError) as caught:
        graph_from_text(_source(line), "m.txt")
    assert message in str(caught.value)


def test_a_valid_call_builds():
    graph = graph_from_text(_source("o = lstm(x, h, hidden_size=4, bidirectional=true)"), "m.txt")
    assert graph is not None


# ---------------------------------------------------------------- import


ZOO = str(Path(__file__).parents[1] / "import_zoo.py")
IMPORTED = {
    "lstm_classifier": ("ids: i64[N, 12]", "rnn = lstm(embed, hidden_size=12, num_layers=2)"),
    "bigru_classifier": (
        "x: f32[N, 10, 6]",
        "rnn = gru(tanh, hidden_size=8, bias=false, bidirectional=true)",
    ),
}


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_imported_zoo_model_runs_under_quant_with_a_bounded_error(name):
    """The zoo's recurrent classifiers import as one statement each (their exact verify is
    in tests/importer/test_import_torch.py); generated with quant, a step's gradients stay within
    5% of the original's largest entry (measured: below 1%)."""
    spec_input, statement = IMPORTED[name]
    text = import_network(f"{ZOO}:{name}", [spec_input]).text
    assert statement in text, text
    source = generate_from_text(text, Options(scheme="quant"), label=name)
    namespace: dict = {}
    exec(compile(source, f"{name}_quant.py", "exec"), namespace)  # noqa: S102 - our own output
    torch.manual_seed(0)
    original = getattr(import_zoo, name)().double()
    model = namespace["Model"]().double()
    model.load_state_dict(original.state_dict())
    gen = torch.Generator().manual_seed(3)
    if spec_input.startswith("ids"):
        x = torch.randint(0, 32, (4, 12), generator=gen)
    else:
        x = torch.randn(4, 10, 6, generator=gen, dtype=F64)
    y = torch.randint(0, 4, (4,), generator=gen)
    loss = model(x, y)
    F.cross_entropy(original(x), y).backward()
    assert torch.isfinite(loss)
    kept = {r["tensor"]: r["compressor"] for r in model.stash_report()["rows"]}
    assert "Quant(" in kept["rnn:gates"] and "Quant(" in kept["rnn:hiddens"], kept
    got = dict(model.named_parameters())
    errors = {n: _max_rel(got[n].grad, p.grad) for n, p in original.named_parameters()}
    assert max(errors.values()) <= 0.05, errors
    assert max(errors.values()) > 1e-6, errors


class _Refused(nn.Module):
    """One recurrent module in a form the import refuses, on x [N, 6, 4]."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        kwargs: dict = {"batch_first": True}
        if form == "proj":
            kwargs["proj_size"] = 2
        if form == "dropout":
            kwargs.update(num_layers=2, dropout=0.3)
        self.rnn = nn.LSTM(4, 3, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        if (
            self.form == "c_n"
        ):  # h_n[-1] imports (tests/importer/test_import_rnn_state_mha_bart.py); c_n does not
            return self.rnn(x)[1][1][-1]
        if self.form == "hx":
            h = torch.ones(1, x.shape[0], 3)
            return self.rnn(x, (h, h))[0].flatten(1)
        return self.rnn(x)[0].flatten(1)


@pytest.mark.parametrize(
    "form,message",
    [
        ("proj", "proj_size > 0"),
        ("dropout", "use dropout=0, or one nn.LSTM per layer with nn.Dropout between them"),
        ("c_n", "reads the final cell state c_n of nn.LSTM"),
        ("hx", "only its default (zeros, hx=None) imports"),
    ],
)
def test_unsupported_forms_are_refused_with_the_fix(tmp_path, form, message):
    module = _Refused(form)
    with pytest.raises(ImportFailure) as caught:
        import_network("refused", ["x: f32[N, 6, 4]"], built=module)
    assert message in caught.value.format(), caught.value.format()
