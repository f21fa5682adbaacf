"""``unroller.unroll`` as a drop-in for the module.

- ``step(**batch)`` with a Hugging Face batch computes the model's own loss: a causal LM's
  shifted labels with -100 prompt tokens, a sequence classifier's cross-entropy (MSE for
  one label), T5's labels with its decoder inputs made from them; loss, logits and every
  gradient equal autograd's on the original (float64, 1e-10);
- another sequence length through the same step: a specialisation made on demand, kept;
- train/eval, ``no_grad``/``inference_mode`` follow torch; ``unroll``/``verify`` leave the
  module's mode, its tensors and torch's random state as they were;
- tensors replaced or frozen after ``unroll`` are followed at the next call;
- a second ``unroll`` of the same network costs no import and no second copy of the
  parameters;
- an ``[N, L, C]`` output's default target is per position; verify's table says which loss
  it replayed; errors name Python arguments.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

import unroller
from unroller import oneshot, stepcache
from unroller.analysis.verify import attention_dropout_as_generated
from unroller.importer.model import ImportFailure

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _twin(net):
    """The float64 reference: Hugging Face's RMSNorm casts to float32 inside, compared as
    what it computes without that cast (as verify does)."""
    from unroller.importer.hf_norms import swap_float64_twins

    twin = copy.deepcopy(net)
    swap_float64_twins(twin)
    return twin


def _grads_equal(net, twin, tol=1e-10):
    """Every gradient to ``tol`` relative; one that is zero in exact arithmetic (BERT's key
    bias: it shifts every score of a row alike) passes as noise on both sides below 1e-13
    of the largest gradient, as verify's rule."""
    theirs = dict(twin.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in twin.parameters() if p.grad is not None)
    for name, p in net.named_parameters():
        if p.requires_grad:
            ref = theirs[name].grad
            if float(ref.abs().max()) < 1e-13 * scale:
                assert float((p.grad - ref).abs().max()) < 1e-13 * scale, name
            else:
                assert rel_err(p.grad, ref) <= tol, name


def _causal_loss(logits, labels):
    """``ForCausalLMLoss`` in float64 (it upcasts to float32, which rounds in float64)."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))


def _lm_batch(n=4, length=16):
    ids = torch.randint(0, 64, (n, length))
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt: no loss on it
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def test_causal_lm_batch_is_the_models_own_loss(tmp_path):
    torch.manual_seed(0)
    net = _llama().double()
    twin = _twin(net)
    batch = _lm_batch()
    step = unroller.unroll(net, batch, directory=tmp_path)
    out = step(**batch)
    ref = twin(**batch)
    assert rel_err(out.loss, ref.loss) <= 1e-6  # Hugging Face's own, computed in float32
    want = _causal_loss(ref.logits, batch["labels"])
    want.backward()
    assert rel_err(out.loss, want) <= 1e-10
    assert rel_err(out.logits, ref.logits) <= 1e-10
    _grads_equal(net, twin)
    assert isinstance(out.to_output(), transformers.modeling_outputs.CausalLMOutputWithPast)
    assert out["loss"] is out.loss
    assert torch.is_tensor(step(batch["input_ids"], batch["attention_mask"], out_target(batch)))


def out_target(batch):
    return F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]


def test_another_sequence_length_through_the_same_step(tmp_path):
    torch.manual_seed(0)
    net = _llama().double()
    twin = _twin(net)
    step = unroller.unroll(net, _lm_batch(), directory=tmp_path)
    batch = _lm_batch(n=3, length=11)
    out = step(**batch)
    want = _causal_loss(twin(**batch).logits, batch["labels"])
    want.backward()
    assert rel_err(out.loss, want) <= 1e-10
    _grads_equal(net, twin)
    assert len(step._specs) == 2


def test_the_shapes_a_step_keeps_are_bounded(tmp_path, monkeypatch):
    """Least recently used shapes are dropped past ``stepcache.MAX_SHAPES`` (a small
    network, so each new shape's import is quick)."""
    monkeypatch.setattr(stepcache, "MAX_SHAPES", 2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    step = unroller.unroll(
        net, torch.randn(2, 5, 8), torch.randint(0, 4, (2, 5)), directory=tmp_path
    )
    for length in (3, 4, 6):
        step(torch.randn(2, length, 8), torch.randint(0, 4, (2, length)))
    assert len(step._specs) == 2


def _bert_classifier(layers: int, **config_kwargs):
    """(config, a float64 BERT sequence classifier of 3 labels built after seed 0, its copy,
    a batch of 4 x 12 tokens with its labels)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
        **config_kwargs,
    )
    net = transformers.BertForSequenceClassification(config).double()
    twin = copy.deepcopy(net)
    ids = torch.randint(0, 64, (4, 12))
    batch = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 2, 1, 2])
    )
    return config, net, twin, batch


def test_sequence_classifier_batch(tmp_path):
    config, net, twin, batch = _bert_classifier(
        2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    step = unroller.unroll(net, batch, directory=tmp_path)
    out = step(**batch)
    ref = twin(**batch)
    ref.loss.backward()
    assert rel_err(out.loss, ref.loss) <= 1e-10 and rel_err(out.logits, ref.logits) <= 1e-10
    _grads_equal(net, twin)
    assert net.config.problem_type is None  # unroll decides as the model does, writes nothing
    config.num_labels = 1
    torch.manual_seed(1)
    reg = transformers.BertForSequenceClassification(config).double()
    twin = copy.deepcopy(reg)
    batch["labels"] = torch.randn(4, dtype=torch.float64)
    out = unroller.unroll(reg, batch, directory=tmp_path)(**batch)
    ref = twin(**batch)
    ref.loss.backward()
    assert rel_err(out.loss, ref.loss) <= 1e-10  # MSE
    _grads_equal(reg, twin)


def test_train_mode_logits_are_the_training_forwards(tmp_path):
    """At BERT's default dropout (0.1) in train mode, ``.logits`` are the predictions the
    step's own forward made (its dropout draws), not an evaluation forward's: equal to the
    original's train-mode logits under the same seed, with the loss and every gradient.
    The hidden dropouts draw from torch's stream as the original's do; attention dropout's
    mask comes from a generator the stream seeds (the generated kernel keeps only its
    seed), which the reference draws the same way (as verify does)."""
    _, net, twin, batch = _bert_classifier(1)
    step = unroller.unroll(net, batch, directory=tmp_path)
    torch.manual_seed(7)
    out = step(**batch)
    torch.manual_seed(7)
    with attention_dropout_as_generated("seeded"):
        ref = twin(**batch)
    ref.loss.backward()
    assert rel_err(out.loss, ref.loss) <= 1e-10 and rel_err(out.logits, ref.logits) <= 1e-10
    _grads_equal(net, twin)
    with torch.no_grad():
        evaluated = twin.eval()(**batch).logits
    assert rel_err(out.logits, evaluated) > 1e-3  # the dropout draws are in them


def test_t5_labels(tmp_path):
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "tests"))
    from import_zoo import hf_t5

    torch.manual_seed(0)
    net = hf_t5().double()
    twin = _twin(net)
    labels = torch.randint(0, 64, (2, 8))
    labels[:, -2:] = -100
    batch = dict(input_ids=torch.randint(0, 64, (2, 12)), labels=labels)
    step = unroller.unroll(net, batch, directory=tmp_path)
    out = step(**batch)
    ref = twin(**batch)
    ref.loss.backward()
    assert rel_err(out.loss, ref.loss) <= 1e-10 and rel_err(out.logits, ref.logits) <= 1e-10
    _grads_equal(net, twin)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _xy(n=5):
    return torch.randn(n, 6, dtype=torch.float64), torch.randint(0, 3, (n,))


def test_eval_mode_and_no_grad_follow_the_module(tmp_path):
    torch.manual_seed(0)
    net = Net().double()
    x, y = _xy()
    step = unroller.unroll(net, x, y, directory=tmp_path)
    net.eval()
    with torch.no_grad():
        loss = step(x, y)
    assert rel_err(loss, F.cross_entropy(net(x), y)) <= 1e-10
    assert all(p.grad is None for p in net.parameters())
    twin = copy.deepcopy(net)
    stats = {k: v.clone() for k, v in net.bn.state_dict().items()}
    loss = step(x, y)  # eval mode: no dropout, batch norm on its running statistics
    want = F.cross_entropy(twin(x), y)
    want.backward()
    assert rel_err(loss, want) <= 1e-10
    _grads_equal(net, twin)
    for k, v in net.bn.state_dict().items():
        assert torch.equal(v, stats[k]), k  # nothing updated, num_batches_tracked included
    net.zero_grad(set_to_none=True)
    net.train()
    before = net.bn.running_mean.clone()
    with torch.inference_mode():
        step(x, y)  # train mode: batch statistics, running stats updated as torch does
    assert all(p.grad is None for p in net.parameters())
    assert not torch.equal(before, net.bn.running_mean)
    loss = step(x, y)  # after inference_mode, training works
    assert torch.isfinite(loss) and net.fc1.weight.grad is not None


def test_eval_mode_gradient_is_the_eval_gradient(tmp_path):
    torch.manual_seed(0)
    net = Mlp().double()
    twin = copy.deepcopy(net).eval()
    x, y = _xy()
    step = unroller.unroll(net, x, y, directory=tmp_path)
    net.eval()
    loss = step(x, y)  # no dropout
    want = F.cross_entropy(twin(x), y)
    want.backward()
    assert rel_err(loss, want) <= 1e-10
    _grads_equal(net, twin)


def test_unroll_and_verify_leave_the_module_and_the_rng_alone(tmp_path):
    torch.manual_seed(0)
    net = Net().double().eval()
    x, y = _xy()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    unroller.unroll(net, x, y, directory=tmp_path)
    assert oneshot.verify(net, x, y).ok
    assert torch.equal(rng, torch.get_rng_state())
    assert not net.training and not net.bn.training
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_replaced_and_frozen_parameters_are_followed(tmp_path):
    torch.manual_seed(0)
    net = Mlp().double()
    net.drop.p = 0.0
    x, y = _xy()
    step = unroller.unroll(net, x, y, directory=tmp_path)
    net.fc1.weight = nn.Parameter(torch.randn(8, 6, dtype=torch.float64))  # a new object
    twin = copy.deepcopy(net)
    step(x, y)
    F.cross_entropy(twin(x), y).backward()
    _grads_equal(net, twin)
    fresh = {k: torch.randn_like(v) for k, v in net.state_dict().items()}
    net.load_state_dict(fresh, assign=True)
    net.fc2.requires_grad_(False)  # a flip: generated again, fc2 frozen
    twin = copy.deepcopy(net)
    loss = step(x, y)
    want = F.cross_entropy(twin(x), y)
    want.backward()
    assert rel_err(loss, want) <= 1e-10
    assert net.fc2.weight.grad is None
    _grads_equal(net, twin)
    net.fc2 = nn.Linear(8, 3).double()  # a swapped submodule
    twin = copy.deepcopy(net)
    net.zero_grad()
    step(x, y)
    F.cross_entropy(twin(x), y).backward()
    _grads_equal(net, twin)


def test_a_second_unroll_is_cached_and_allocates_no_parameters(tmp_path, monkeypatch):
    torch.manual_seed(0)
    net = _llama()
    batch = _lm_batch()
    first = time.perf_counter()
    unroller.unroll(net, batch, directory=tmp_path)
    first = time.perf_counter() - first
    made = []
    real = nn.Parameter.__new__

    def spy(cls, data=None, requires_grad=True):
        if data is not None:
            made.append(data.device.type)
        return real(cls, data, requires_grad)

    monkeypatch.setattr(nn.Parameter, "__new__", spy)
    rng = torch.get_rng_state()
    again = time.perf_counter()
    step = unroller.unroll(net, batch, directory=tmp_path)
    again = time.perf_counter() - again
    assert again < 0.5 * first and again < 1.0, (first, again)
    assert "cpu" not in made  # built on meta, given the original's tensors
    assert torch.equal(rng, torch.get_rng_state())
    assert step.model.lm_head.weight is net.lm_head.weight


def test_default_target_is_per_position(tmp_path):
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            return self.head(self.emb(x))

    from unroller.importer.loss import default_target

    assert default_target("cross_entropy", ("N", 16, 5)).dims == (16,)
    assert default_target("cross_entropy", ("N", 5, 8, 8)).dims == (8, 8)
    assert default_target("cross_entropy", ("N", 5)).dims == ()
    net = Tagger().double()
    text = oneshot.import_text(net, torch.randint(0, 20, (2, 7)))
    assert "target y: i64[N, 7]" in text
    report = oneshot.verify(net, torch.randint(0, 20, (2, 7)))
    loss_row = next(row for row in report.rows if row.name == "loss")
    assert "replayed: head -> permute" in loss_row.note and "cross_entropy" in report.table()


def test_errors_name_python_arguments(tmp_path):
    net = Mlp()
    x = torch.randn(2, 6)
    with pytest.raises(ImportFailure) as info:
        unroller.unroll(net, x, torch.randn(2, 3), directory=tmp_path)
    assert "--" not in str(info.value) and "target" in str(info.value)
    with pytest.raises(ValueError, match="no 'labels'"):
        step = unroller.unroll(_llama(), _lm_batch(), directory=tmp_path)
        step(input_ids=torch.randint(0, 64, (2, 16)))


@pytest.mark.parametrize(
    "change",
    [
        lambda net: setattr(net[1], "eps", 0.5),  # LayerNorm
        lambda net: setattr(net[2], "negative_slope", 0.3),  # LeakyReLU
        lambda net: setattr(net, "scale", 2.0),  # a plain attribute a forward may read
    ],
)
def test_modules_differing_only_in_an_attribute_do_not_share_a_step(tmp_path, change):
    """The traced code bakes attributes in (eps, a slope): a second unroll of a network
    whose structure is the same but an attribute differs gets its own step, exact against
    autograd, never the first network's code."""

    class Scaled(nn.Sequential):
        scale = 1.0

        def forward(self, x):
            return super().forward(x) * self.scale

    def net():
        torch.manual_seed(0)
        return Scaled(nn.Linear(8, 8), nn.LayerNorm(8), nn.LeakyReLU(0.1), nn.Linear(8, 3))

    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    unroller.unroll(net(), x, directory=tmp_path)(x, y)
    other = net()
    change(other)
    twin = copy.deepcopy(other)
    loss = unroller.unroll(other, x, directory=tmp_path)(x, y)
    ref = F.cross_entropy(twin(x), y)
    assert torch.equal(loss.detach(), ref.detach())
    ref.backward()
    _grads_equal(other, twin)


def test_an_attribute_changed_after_unroll_is_followed(tmp_path):
    """A dropout's p set to 0 (or any attribute the trace baked in) after ``unroll``: the
    next call regenerates, exact against autograd, never the stale text."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = unroller.unroll(net, x, directory=tmp_path)
    step(x, y)
    net[1].p = 0.0
    twin = copy.deepcopy(net)
    net.zero_grad()
    loss = step(x, y)
    ref = F.cross_entropy(twin(x), y)
    assert torch.equal(loss.detach(), ref.detach())
    ref.backward()
    _grads_equal(net, twin)


def test_a_dropout_in_eval_mode_alone_is_refused_while_the_module_trains(tmp_path):
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = unroller.unroll(net, x, directory=tmp_path)
    net[1].eval()
    with pytest.raises(ValueError, match=r"1 in eval mode while the module trains.*p = 0\.0"):
        step(x, y)
    assert all(p.grad is None for p in net.parameters())
    net.eval()  # the whole module in eval: followed (no dropout), not refused
    with torch.no_grad():
        step(x, y)


def test_modules_holding_different_functions_do_not_share_a_step(tmp_path):
    """An attribute holding a function (``self.f = torch.tanh``) is part of the step's key:
    the same structure with ``torch.sigmoid`` is its own step, exact."""

    class Act(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.fc = nn.Linear(8, 3)
            self.f = f

        def forward(self, x):
            return self.f(self.fc(x))

    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    for f in (torch.tanh, torch.sigmoid):
        torch.manual_seed(0)
        net = Act(f)
        twin = copy.deepcopy(net)
        loss = unroller.unroll(net, x, directory=tmp_path)(x, y)
        assert torch.equal(loss.detach(), F.cross_entropy(twin(x), y).detach()), f.__name__


class _TwoBlocks(nn.Module):
    """Two residual blocks (each a segment with ``recompute_segments="blocks"``), the first
    fed by the raw input, and a head."""

    def __init__(self):
        super().__init__()
        self.b1 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.b2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = x + self.b1(x)
        return self.head(x + self.b2(x))


def test_generation_options_are_keywords_of_unroll(tmp_path):
    """``unroll(..., recompute_segments="blocks", segment_pieces=2)``: the options of the
    command line by their Python names; the step recomputes segments in pieces (its header
    says so) and stays exact, the first segment fed by the raw input."""
    torch.manual_seed(0)
    net = _TwoBlocks()
    twin = copy.deepcopy(net)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    step = unroller.unroll(
        net, x, directory=tmp_path, recompute_segments="blocks", segment_pieces=2
    )
    assert '"recompute_segments": ["blocks"]' in step.source
    assert '"segment_pieces": 2' in step.source
    loss = step(x, y)
    ref = F.cross_entropy(twin(x), y)
    assert torch.allclose(loss.detach(), ref.detach(), rtol=1e-6, atol=0)
    ref.backward()
    for (name, a), (_, b) in zip(net.named_parameters(), twin.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_option_keywords_are_validated_and_named_as_in_python(tmp_path):
    from unroller.errors import OptionValueError

    net, x = _TwoBlocks(), torch.randn(4, 8)
    with pytest.raises(OptionValueError, match="segment_pieces=0"):
        unroller.unroll(net, x, directory=tmp_path, segment_pieces=0)
    with pytest.raises(TypeError, match="recompute_segmnts.*recompute_segments"):
        unroller.unroll(net, x, directory=tmp_path, recompute_segmnts="blocks")
    with pytest.raises(ValueError, match="not both"):
        unroller.unroll(net, x, directory=tmp_path, scheme="quant", options=oneshot.Options())


def test_verify_takes_the_generation_options_and_checks_that_step():
    """``unroller.verify(..., recompute_segments="blocks", segment_pieces=2)`` checks the
    step those options make (float64, 1e-10) and says which; a lossy scheme fails it."""
    torch.manual_seed(0)
    net, x = _TwoBlocks(), torch.randn(4, 8)
    report = unroller.verify(net, x, recompute_segments="blocks", segment_pieces=2, batch_size=6)
    assert report.ok, report.problems or report.table()
    assert any("recompute_segments=('blocks',), segment_pieces=2" in n for n in report.notes)
    assert not unroller.verify(net, x, scheme="quant").ok
