"""The probe step's sampling noise and the per-parameter check built on it
(``unroller.analysis.probe``), and the built-in schemes' check with stepped-down tensors
(``plan.checked_scheme``)."""

from __future__ import annotations

import dataclasses
import math

import torch

from tests.train_models import BN_CANCEL
from unroller.analysis.plan import blame, checked_scheme
from unroller.analysis.probe import (
    AUTO_PARAM_ERROR,
    NOISE_SHARE,
    config_parameter_errors,
    parameters_over,
    run_probe,
    sampling_noise,
)
from unroller.analysis.probe import _splits as probe_splits
from unroller.api import graph_from_text
from unroller.compiler.schemes import resolve
from unroller.compiler.stash import plan_stash
from unroller.materialize import model_class

LINEAR = """
model lin {
    input x: f32[N, 3]
    target y: f32[N, 2]
    out = linear(x, out_features=2)
    loss = mse_loss(out, y)
    return loss, out
}
"""


def _linear_grads(model_cls, x, y):
    """Per sample gradient of the linear layer's weight, by hand (loss: mean over N and
    the 2 outputs of the squared error, so one sample's share is 2/(2N) (out - y) x^T)."""
    torch.manual_seed(0)
    model = model_cls()
    w, b = model.out.weight.detach(), model.out.bias.detach()
    out = x @ w.T + b
    return [(out[i] - y[i])[:, None] * x[i][None, :] for i in range(len(x))]


def test_sampling_noise_is_the_spread_of_half_batch_gradients():
    """For a loss that is a mean over samples, the noise is sqrt(mean over the splits of
    |g_A - g_B|^2 * (1/n) / (1/n_a + 1/n_b)), with g_A the gradient of half A alone,
    computed here from per-sample gradients by hand; identical samples have none."""
    graph = graph_from_text(LINEAR, "lin.txt")
    cls = model_class(graph, "lin", None)
    gen = torch.Generator().manual_seed(1)
    for n in (4, 5, 8):
        x, y = torch.randn(n, 3, generator=gen), torch.randn(n, 2, generator=gen)
        noise = sampling_noise(cls, [x, y])
        per_sample = _linear_grads(cls, x, y)
        total = 0.0
        splits = probe_splits(n, 0)
        assert len(splits) == 3 and all(len(a) + len(b) == n for a, b in splits)
        for a, b in splits:
            g_a = sum(per_sample[i] for i in a.tolist()) / len(a)
            g_b = sum(per_sample[i] for i in b.tolist()) / len(b)
            total += float((g_a - g_b).norm()) ** 2 * (1 / n) / (1 / len(a) + 1 / len(b))
        assert math.isclose(noise["out.weight"], math.sqrt(total / 3), rel_tol=1e-5)
    same = sampling_noise(cls, [x[:1].repeat(6, 1), y[:1].repeat(6, 1)])
    assert same["out.weight"] < 1e-6 and same["out.bias"] < 1e-6
    assert sampling_noise(cls, [x[:3], y[:3]]) == {}  # halves of one sample: none


def test_probe_carries_the_noise_and_splits_are_distinct():
    graph = graph_from_text(BN_CANCEL, "cancel.txt")
    probe = run_probe(graph)
    assert set(probe.noise) == set(probe.grads)
    assert all(v > 0 and math.isfinite(v) for v in probe.noise.values())
    assert run_probe(graph, batch_size=2).noise == {}
    halves = [frozenset(a.tolist()) for a, _ in probe_splits(4, 0)]
    assert len(set(halves)) == 3  # the three ways to split 4 samples in two pairs


def test_parameters_over_needs_both_a_large_error_and_one_over_the_noise():
    graph = graph_from_text(BN_CANCEL, "cancel.txt")
    probe = run_probe(graph)
    config = resolve("dct-dense")
    errors = config_parameter_errors(graph, config, probe)
    large = {n for n, e in errors.items() if e >= AUTO_PARAM_ERROR}
    assert large  # DCT on noise: some parameter gets at least half its norm wrong
    quiet = dataclasses.replace(probe, noise={})
    assert set(parameters_over(graph, config, quiet)) == large
    loud = dataclasses.replace(probe, noise={n: 1e9 for n in probe.grads})
    assert parameters_over(graph, config, loud) == {}
    zero = dataclasses.replace(probe, noise={n: 0.0 for n in probe.grads})
    assert set(parameters_over(graph, config, zero)) == large
    over = parameters_over(graph, config, probe)
    assert set(over) <= large
    for why in over.values():
        assert "sampling noise" in why and float(why.split(", ")[1].split("x")[0]) > NOISE_SHARE
    assert all(
        "over its sampling noise" in why for why in parameters_over(graph, config, zero).values()
    )


def test_blame_names_the_tensor_a_failing_parameter_reads_first():
    """A failing batch norm weight: its node's saved input, not everything downstream whose
    error reaches it through input gradients (unless asked for everything)."""
    graph = graph_from_text(BN_CANCEL, "cancel.txt")
    lossy = [
        s
        for s in plan_stash(graph, resolve("dct-dense")).entries
        if any(f.kind == "codec" for f in s.forms)
    ]
    from unroller.analysis.plan import _upstream_keys

    upstream = _upstream_keys(graph)
    assert blame(lossy, {"b1.weight"}, upstream) == {"r1"}
    wide = blame(lossy, {"b1.weight"}, upstream, direct=False)
    assert "r1" in wide and len(wide) > 1


def test_checked_scheme_steps_down_until_no_parameter_fails():
    """dct-dense on noise-like maps with the noise left out (every large error fails): the
    failing tensors go to 8-bit quant, then raw, until no parameter fails; the tensors not
    blamed keep DCT."""
    graph = graph_from_text(BN_CANCEL, "cancel.txt")
    probe = dataclasses.replace(run_probe(graph), noise={})
    checked = checked_scheme(graph, resolve("dct-dense"), probe)
    assert checked.config is not None and checked.stepped
    assert parameters_over(graph, checked.config, probe) == {}
    forms = {
        s.key: {f.codec.name for f in s.forms if f.kind == "codec"}
        for s in plan_stash(graph, checked.config).entries
    }
    for key in checked.stepped:
        assert forms[key] <= {"quant"}
    unchanged = resolve("dct-dense")
    assert checked.config.rules[: len(unchanged.rules)] == unchanged.rules
