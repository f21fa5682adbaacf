"""The optimizer step inside the unrolled backward (``--update-in-backward``,
``unroller.runtime.in_backward``, ``unroller.unroll(..., optimizer=)``).

- Where: ``K.update_params`` follows the run in which each trainable parameter's gradient
  became final, every parameter once per step (a tied parameter once, by its tie's key), a
  segment in pieces after its loop; without the option nothing of it is emitted.
- What: float64, five steps with an LR scheduler changing ``param_groups`` between them,
  SGD (momentum, nesterov, weight decay, maximize), Adam (amsgrad, weight decay) and AdamW
  give the parameters and optimizer state of ``step(); opt.step(); opt.zero_grad()`` to
  1e-12 (bit for bit here), no ``.grad`` left; a checkpoint taken after three steps and
  loaded into a new model and optimizer goes on as the uninterrupted run; ``accumulate=k``
  equals k backwards then a step; frozen parameters and parameters the optimizer does not
  hold are left as a plain step leaves them.
- Memory: the memory model frees each ``.grad`` at its update, and the measured peak of a
  step whose gradients outweigh its activations drops by about the gradients.
- Refused, with the reason: not an optimizer, a closure optimizer, parameters the network
  does not have, bad ``accumulate``/``clip_grad_value``, a GradScaler, compile, a module
  generated without the option, the option where the step cannot update.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import ROOT
from typer.testing import CliRunner

import unroller
from unroller.analysis.memory import simulate_graph
from unroller.api import graph_from_text
from unroller.bench.profiling import profile_step
from unroller.cli import app
from unroller.compiler.options import Options, OptionValueError
from unroller.runtime.in_backward import InBackwardError, attach, detach, step_on

GPT_TINY = ROOT / "benchmarks/models/gpt_tiny.txt"
TIED = """model tied_head {
    input ids: i64[N, 6]
    target y: i64[N, 6]
    emb = embedding(ids, num_embeddings=10, embedding_dim=8)
    h = layernorm(emb, normalized_shape=8)
    proj = linear(h, out_features=8)
    head = linear(proj, out_features=10, bias=false, tied_weight="emb.weight")
    logits = permute(head, dims=(0, 2, 1))
    loss = cross_entropy(logits, y)
    return loss, head
}
"""
#: a network whose parameter gradients outweigh its activations at a small batch
WIDE = """model wide {
    input x: f32[N, 512]
    target y: i64[N]
    h1 = linear(x, out_features=512)
    a1 = relu(h1)
    h2 = linear(a1, out_features=512)
    a2 = relu(h2)
    h3 = linear(a2, out_features=512)
    out = linear(h3, out_features=10)
    loss = cross_entropy(out, y)
    return loss
}
"""
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True
    ),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
}


def _batch(seed: int, batch: int = 3, seq: int = 64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g), torch.randint(
        0, 128, (batch, seq), generator=g
    )


def _pair(build, model, **options):
    """(module updating in its backward, the plain module), float64, the same weights."""
    torch.manual_seed(0)
    plain = build(model, Options(**options)).Model().double()
    updating = build(model, Options(update_in_backward=True, **options)).Model().double()
    updating.load_state_dict(plain.state_dict())
    return updating, plain


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float((p - q).detach().abs().max() / q.detach().abs().max().clamp_min(1e-30))
        for p, q in zip(a.parameters(), b.parameters())
    )


def _states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][k][name]))
        for k, entry in sa["state"].items()
        for name, v in entry.items()
    )


def _updated_names(source: str) -> list[str]:
    calls = re.findall(r"K\.update_params\(\s*L,\s*\(([^)]*)\)", source)
    return [name for call in calls for name in re.findall(r'"([^"]+)"', call)]


# --- where the updates go --------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,options",
    [
        (GPT_TINY, {}),
        (GPT_TINY, {"scheme": "quant", "recompute_segments": ("blocks",), "segment_piece_size": 1}),
        (TIED, {}),
    ],
)
def test_every_trainable_parameter_is_updated_once_after_its_last_gradient(model, options):
    """Every trainable parameter is named by exactly one update call (a tied one by the key it
    is tied to; that each call follows the last gradient added is what the exact runs below
    show); without the option no update is emitted."""
    from conftest import generated_text

    source = generated_text(model, Options(update_in_backward=True, **options), readable=True)
    names = _updated_names(source)
    text = model.read_text() if hasattr(model, "read_text") else model
    graph = graph_from_text(text, "m.txt")
    trainable = {
        node.ties.get(p.name, p.key)
        for node in graph.nodes
        for p in node.params
        if p.present and p.trainable
    }
    assert sorted(names) == sorted(trainable)
    assert "update_params" not in generated_text(model, Options(**options), readable=True)


def test_a_segment_in_pieces_is_updated_after_its_loop(build):
    """In pieces the block's gradients add up over the pieces: its update follows the loop
    (at the loop's indentation), never inside it."""
    from conftest import generated_text

    options = Options(update_in_backward=True, recompute_segments=("blocks",), segment_piece_size=1)
    lines = generated_text(GPT_TINY, options, readable=True).splitlines()
    loop = next(
        i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("for ") and "zip(" in "".join(lines[i : i + 3])
    )
    depth = len(lines[loop]) - len(lines[loop].lstrip())
    after = next(i for i in range(loop + 1, len(lines)) if "K.update_params" in lines[i])
    body = [line for line in lines[loop + 1 : after] if line.strip()]
    assert len(lines[after]) - len(lines[after].lstrip()) == depth
    assert any(len(line) - len(line.lstrip()) == depth for line in body)  # the loop ended


# --- what the updates compute ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pieces", [False, True])
def test_five_steps_with_a_scheduler_equal_step_then_opt_step(build, name, pieces):
    """gpt_tiny in float64: five steps of the module updating in its backward equal five of
    the plain module followed by ``opt.step(); opt.zero_grad()``, an LR scheduler stepping
    between them; no gradient is left, and the optimizers' state dicts are equal."""
    options = {"recompute_segments": ("blocks",), "segment_piece_size": 1} if pieces else {}
    updating, plain = _pair(build, GPT_TINY, **options)
    opt, ref_opt = OPTIMIZERS[name](updating.parameters()), OPTIMIZERS[name](plain.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    updater = attach(updating, opt)
    for i in range(5):
        ids, y = _batch(i)
        updating(ids, y)
        sched.step()
        plain(ids, y)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        assert all(p.grad is None for p in updating.parameters())
    assert _max_diff(updating, plain) <= 1e-12
    assert _states_equal(opt, ref_opt)
    assert updater.updates >= 5 * 4


def test_a_tied_head_is_updated_once_after_both_uses(build):
    """The head tied to the embedding: one tensor, whose gradient adds the head's use and then
    the embedding's; updated once, after both, as ``opt.step()`` after the plain step."""
    updating, plain = _pair(build, TIED)
    opt, ref_opt = OPTIMIZERS["adam"](updating.parameters()), OPTIMIZERS["adam"](plain.parameters())
    attach(updating, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids, y = torch.randint(0, 10, (4, 6), generator=g), torch.randint(
            0, 10, (4, 6), generator=g
        )
        updating(ids, y)
        plain(ids, y)
        ref_opt.step()
        ref_opt.zero_grad()
    assert updating.head.weight is updating.emb.weight
    assert _max_diff(updating, plain) <= 1e-12
    assert _states_equal(opt, ref_opt)


def test_a_checkpoint_resumes_as_the_uninterrupted_run(build):
    """Three steps, then the model's and optimizer's state dicts loaded into a new model and
    a new optimizer, two more steps: the same parameters as five steps in one run."""
    updating, whole = _pair(build, GPT_TINY)
    opt = OPTIMIZERS["adam"](updating.parameters())
    whole_opt = OPTIMIZERS["adam"](whole.parameters())
    attach(updating, opt)
    for i in range(5):
        whole(*_batch(i))
        whole_opt.step()
        whole_opt.zero_grad()
    for i in range(3):
        updating(*_batch(i))
    saved_model, saved_opt = copy.deepcopy(updating.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = type(updating)().double()
    resumed.load_state_dict(saved_model)
    resumed_opt = OPTIMIZERS["adam"](resumed.parameters())
    resumed_opt.load_state_dict(saved_opt)
    attach(resumed, resumed_opt)
    for i in range(3, 5):
        resumed(*_batch(i))
    assert _max_diff(resumed, whole) <= 1e-12


def test_accumulation_updates_in_the_kth_backward_as_k_backwards_then_a_step():
    """``unroll(..., optimizer=, accumulate=2)`` on a torch.nn network against torch.autograd:
    the first micro-batch leaves its gradients in ``.grad``, the second's backward updates
    with their sum and frees them; six steps equal three of autograd's accumulations."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    ).double()
    ref = copy.deepcopy(net)
    x = torch.randn(5, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (5,))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    step = unroller.unroll(net, (x,), y, optimizer=opt, accumulate=2)
    for i in range(6):
        step(x * (i + 1), y)
        torch.nn.functional.cross_entropy(ref(x * (i + 1)), y).backward()
        if i % 2 == 0:
            assert all(p.grad is not None for p in net.parameters())
            assert _max_diff(net, ref) == 0.0  # nothing updated yet
        else:
            ref_opt.step()
            ref_opt.zero_grad()
            assert all(p.grad is None for p in net.parameters())
    assert _max_diff(net, ref) <= 1e-12
    assert step.optimizer_in_backward.updates == 3 * 2  # two layers, three updating steps


def test_frozen_and_unheld_parameters_are_left_as_a_plain_step_leaves_them():
    """A frozen layer gets no gradient and no update; a layer the optimizer does not hold
    keeps its gradient in ``.grad``, unchanged by the step; the rest are updated."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
    ).double()
    net[0].requires_grad_(False)
    before = copy.deepcopy(net)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    opt = torch.optim.SGD(net[3].parameters(), lr=0.1)
    step = unroller.unroll(net, (x,), y, optimizer=opt, clip_grad_value=0.01)
    step(x, y)
    torch.nn.functional.cross_entropy(before(x), y).backward()
    assert net[0].weight.grad is None and torch.equal(net[0].weight, before[0].weight)
    assert torch.equal(net[2].weight, before[2].weight)
    assert torch.allclose(net[2].weight.grad, before[2].weight.grad, rtol=1e-12, atol=0)
    assert net[3].weight.grad is None
    clipped = before[3].weight.grad.clamp(-0.01, 0.01)
    assert torch.allclose(net[3].weight, before[3].weight - 0.1 * clipped, rtol=1e-12, atol=0)


def test_step_on_narrows_the_groups_and_restores_them():
    """``step_on`` steps only the parameters given, with each group's hyperparameters, and
    gives every group its own parameter list back (the same list object)."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    lists = [g["params"] for g in opt.param_groups]
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    step_on(opt, [b])
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.full((2,), 0.5))
    assert all(g["params"] is lst for g, lst in zip(opt.param_groups, lists))


# --- memory -----------------------------------------------------------------------------------


def test_the_gradients_are_never_all_alive(build):
    """A network whose gradients outweigh its activations (three 512 x 512 layers, batch 2),
    AdamW (a step already taken, so its state exists): the measured peak of the updating step
    is at least half the gradients under the plain step's with ``opt.step()`` after it, and
    the memory model predicts it (each ``.grad`` freed at its update, AdamW's buffers while
    it runs) within 10%; the model's plain step holds every gradient at once."""
    graph = graph_from_text(WIDE, "wide.txt")
    grads = sum(p.nbytes() for n in graph.nodes for p in n.params if p.present)
    config = Options().compression()
    plain_model = simulate_graph(graph, config, 2).peak_bytes
    updating_model = simulate_graph(graph, config, 2, update_in_backward=True).peak_bytes
    assert plain_model >= grads
    measured = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = build(WIDE, Options(update_in_backward=flag)).Model()
        opt = torch.optim.AdamW(model.parameters())
        if flag:
            attach(model, opt)
        x, y = torch.randn(2, 512), torch.randint(0, 10, (2,))

        def step(model=model, opt=opt, flag=flag, x=x, y=y):
            loss = model(x, y)
            if not flag:
                opt.step()
                opt.zero_grad()
            return loss

        step()
        measured[flag] = profile_step(step, "")["peak_bytes"]
    assert measured[True] <= measured[False] - grads / 2
    assert updating_model == pytest.approx(measured[True], rel=0.1)


# --- refused ----------------------------------------------------------------------------------


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3))


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda net: object(), "torch.optim.Optimizer"),
        (lambda net: torch.optim.LBFGS(net.parameters()), "closure"),
        (lambda net: torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), "not the network"),
    ],
)
def test_optimizers_that_cannot_step_in_the_backward_are_refused(make, words):
    net = _net()
    x, y = torch.randn(2, 4), torch.randint(0, 3, (2,))
    with pytest.raises(InBackwardError, match=words):
        unroller.unroll(net, (x,), y, optimizer=make(net))


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"accumulate": 0}, "accumulate"),
        ({"accumulate": True}, "accumulate"),
        ({"clip_grad_value": -1.0}, "clip_grad_value"),
        ({"clip_grad_norm": 1.0}, "whole backward"),
        ({"precision": "fp16-mixed"}, "GradScaler"),
    ],
)
def test_settings_that_cannot_run_are_refused(settings, words):
    net = _net()
    x, y = torch.randn(2, 4), torch.randint(0, 3, (2,))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(InBackwardError, match=words):
        unroller.unroll(net, (x,), y, optimizer=opt, **settings)


def test_accumulate_without_an_optimizer_is_refused():
    net = _net()
    with pytest.raises(InBackwardError, match="optimizer="):
        unroller.unroll(net, (torch.randn(2, 4),), torch.randint(0, 3, (2,)), accumulate=2)


def test_a_module_without_update_calls_a_scaler_and_compile_are_refused(build):
    """attach() to a module generated without the option; a GradScaler handed to the step;
    compile=True: each a clear error, and nothing updated."""
    plain = build(GPT_TINY).Model()
    with pytest.raises(InBackwardError, match="--update-in-backward"):
        attach(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    model = build(GPT_TINY, Options(update_in_backward=True)).Model()
    before = copy.deepcopy(model.state_dict())
    attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.compile_step = True
    with pytest.raises(RuntimeError, match="compile"):
        model(*_batch(0))
    model.compile_step = False
    detach(model)
    model(*_batch(0))  # detached: a plain step, gradients in .grad
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("flag", ["update_in_backward", "shard"])
@pytest.mark.parametrize(
    "fields,words",
    [
        ({"platform": "ipu"}, "not for"),
        ({"data_parallel": True}, "do not combine"),
        ({"pipeline": 2}, "do not combine"),
    ],
)
def test_the_option_is_refused_where_the_step_cannot_update(flag, fields, words):
    """``--update-in-backward`` and ``--shard`` (whose reduce-scatters sit where the updates
    do) on a platform that collects gradients, with replicated data parallel, with
    pipeline stages: refused, naming the flags."""
    with pytest.raises(OptionValueError, match=words):
        Options(**{flag: True}, **fields)


def test_the_command_line_refuses_it_with_data_parallel(tmp_path):
    result = CliRunner().invoke(
        app,
        ["generate", str(GPT_TINY), "--update-in-backward", "--data-parallel", "-o", "-"],
    )
    assert result.exit_code == 2
    assert "--update-in-backward" in result.output and "--data-parallel" in result.output
    assert "Traceback" not in result.output
