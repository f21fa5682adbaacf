"""The probe step and the per-parameter check of lossy forms against it.

One uncompressed step on a batch (``run_probe``) shows what the forward keeps for backward
and every parameter's exact gradient; a plan's (or a built-in scheme's) module, run on the
same weights and batch, shows what its lossy forms do to each gradient. A parameter fails
the check (``parameters_over``) when both hold:

- its gradient's relative error is at least ``AUTO_PARAM_ERROR`` (1 is what a zero gradient
  scores), and
- the error is larger than ``NOISE_SHARE`` times the gradient's sampling noise at the
  probe's batch, the distance a gradient of other samples would be from it
  (``Probe.noise``): compression then moves the gradient further than the batch's own
  sampling does, which no longer looks like training at a somewhat smaller batch.

The second condition is the reason a plan may keep an error that is large relative to a
gradient that is itself mostly noise: a batch norm's weight gradient at initialisation,
sum(g * x_hat) over nearly uncorrelated factors, whose exact value is small beside its
spread over batches (the compressed-training argument of ActNN, Chen et al. 2021: what
matters is the variance compression adds against the variance SGD already has). Errors of
independent samples add like sampling noise does, so the ratio of the two does not depend
on the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unroller.analysis.inputs import make_inputs
from unroller.compiler.graph import Graph
from unroller.compiler.schemes import CompressionConfig
from unroller.materialize import ModelBuilder
from unroller.materialize import model_class as materialized_class
from unroller.runtime.common import observe_stash

__all__ = [
    "AUTO_PARAM_ERROR",
    "NOISE_SHARE",
    "NOISE_SPLITS",
    "PROBE_BATCH",
    "Probe",
    "config_parameter_errors",
    "parameters_over",
    "planned_step",
    "run_probe",
]

#: no parameter whose gradient error on the probe step, under the plan, is at or above
#: this (1 is what a zero gradient scores; half of it leaves room for other batches) ...
AUTO_PARAM_ERROR = 0.5
#: ... unless the error is at most this many times the gradient's sampling noise at the
#: probe's batch: the compressed gradient is then no further from the exact one than the
#: exact gradient of half the batch is, in expectation (its distance is the noise too)
NOISE_SHARE = 1.0
NOISE_SPLITS = 3  # splits of the probe batch into halves the sampling noise is averaged over
NOISE_MIN_BATCH = 4  # halves of fewer than 2 samples say little (and break batch norms)
NEGLIGIBLE = 1e-5  # a parameter gradient this small against all of them is not checked
PROBE_BATCH = 4


@dataclass
class Probe:
    """What one uncompressed step on a batch shows: the saved tensors as the forward made
    them, the parameter gradients, and their sampling noise."""

    inputs: list[torch.Tensor]
    state: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    source: str  # where the batch came from, for the report
    #: per parameter, the norm of its gradient's sampling noise at this batch
    #: (``sampling_noise``); empty where the batch is too small to split
    noise: dict[str, float] = field(default_factory=dict)


def _capture(found: dict[str, torch.Tensor]):
    """A stash observer (``runtime.common.observe_stash``) recording a copy of every tensor
    the generated step keeps for backward, by full name, as the forward made it."""

    def on_stash(key: str, tensor: torch.Tensor) -> None:
        found[key] = tensor.detach().clone()

    return on_stash


def run_probe(
    graph: Graph,
    batch: Sequence[torch.Tensor] | None = None,
    batch_size: int = PROBE_BATCH,
    seed: int = 0,
    state: dict[str, torch.Tensor] | None = None,
    label: str = "<model>",
    build: ModelBuilder = materialized_class,
) -> Probe:
    """One float32 step of the uncompressed module: seeded initial weights (or ``state``),
    on ``batch`` or seeded synthetic inputs of the declared shapes; ``build`` makes the
    module's class (``materialize.model_class``; a test or a caller with its own module
    passes its own)."""
    source = "the batch given"
    if batch is None:
        batch = [
            t.float() if t.is_floating_point() else t for t in make_inputs(graph, batch_size, seed)
        ]
        source = f"seeded synthetic inputs (batch {batch_size}, seed {seed})"
    model_class = build(graph, label, None)
    tensors: dict[str, torch.Tensor] = {}
    with observe_stash(_capture(tensors)):
        model, grads = _exact_step(model_class, batch, seed, state)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    noise = sampling_noise(model_class, batch, seed, state)
    return Probe(list(batch), weights, tensors, grads, source, noise)


def _exact_step(
    model_class: type,
    batch: Sequence[torch.Tensor],
    seed: int,
    state: dict[str, torch.Tensor] | None,
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = model_class()
    if state is not None:
        model.load_state_dict(state, strict=True)
    model.train()
    model(*batch)
    grads = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return model, grads


def sampling_noise(
    model_class: type,
    batch: Sequence[torch.Tensor],
    seed: int = 0,
    state: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Per parameter, the norm of its gradient's sampling noise at this batch of n samples:
    over ``NOISE_SPLITS`` seeded splits of the batch into halves A and B (n_a + n_b = n),
    the root mean square of |g_A - g_B| * sqrt((1/n) / (1/n_a + 1/n_b)) (for independent
    samples E|g_A - g_B|^2 = var * (1/n_a + 1/n_b), and the whole batch's gradient has
    var / n). Empty when the batch has fewer than ``NOISE_MIN_BATCH`` samples or an input
    has no batch dimension first of that size."""
    n = batch[0].shape[0] if batch and batch[0].dim() else 0
    if n < NOISE_MIN_BATCH or any(t.dim() == 0 or t.shape[0] != n for t in batch):
        return {}
    total: dict[str, float] = {}
    splits = _splits(n, seed)
    for a, b in splits:
        _, grads_a = _exact_step(model_class, [t[a] for t in batch], seed, state)
        _, grads_b = _exact_step(model_class, [t[b] for t in batch], seed, state)
        scale = math.sqrt((1 / n) / (1 / len(a) + 1 / len(b)))
        for name in grads_a.keys() & grads_b.keys():
            diff = float(torch.linalg.vector_norm((grads_a[name] - grads_b[name]).double()))
            total[name] = total.get(name, 0.0) + (diff * scale) ** 2
    return {name: math.sqrt(v / len(splits)) for name, v in total.items()}


def _splits(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to ``NOISE_SPLITS`` distinct splits of ``range(n)`` into halves (seeded)."""
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[frozenset[int]] = set()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(20 * NOISE_SPLITS):
        order = torch.randperm(n, generator=generator)
        a, b = order[: n // 2].sort().values, order[n // 2 :].sort().values
        key = frozenset(a.tolist())
        if key in seen or frozenset(b.tolist()) in seen:
            continue
        seen.add(key)
        found.append((a, b))
        if len(found) == NOISE_SPLITS:
            break
    return found


def planned_step(
    graph: Graph,
    config: CompressionConfig,
    probe: Probe,
    label: str,
    planned: type | None = None,
    build: ModelBuilder = materialized_class,
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """One step of the module generated under ``config`` on the probe's batch and weights:
    per parameter with a gradient on both sides, (name, its gradient, the probe's
    uncompressed one); ``planned``: the module's class, when the caller has it already,
    else ``build`` makes it."""
    model = (planned or build(graph, label, config))()
    model.load_state_dict(probe.state, strict=True)
    model.train()
    model(*probe.inputs)
    return [
        (name, p.grad, probe.grads[name])
        for name, p in model.named_parameters()
        if p.grad is not None and probe.grads.get(name) is not None
    ]


def _errors(
    graph: Graph,
    config: CompressionConfig,
    probe: Probe,
    label: str,
    build: ModelBuilder,
) -> dict[str, tuple[float, float]]:
    """Per parameter checked: (relative error of its gradient, absolute error)."""
    grad_norm = math.sqrt(
        sum(float(torch.linalg.vector_norm(g.double())) ** 2 for g in probe.grads.values())
    )
    floor = NEGLIGIBLE * grad_norm
    found = {}
    for name, got, ref in planned_step(graph, config, probe, label, build=build):
        norm = float(torch.linalg.vector_norm(ref.double()))
        if norm > floor:
            error = float(torch.linalg.vector_norm((got - ref).double()))
            found[name] = (error / norm, error)
    return found


def config_parameter_errors(
    graph: Graph,
    config: CompressionConfig,
    probe: Probe,
    label: str = "<model>",
    build: ModelBuilder = materialized_class,
) -> dict[str, float]:
    """Per parameter, the relative error of its gradient in one step of the module
    generated under ``config`` against the probe's uncompressed step (same weights, same
    batch). A parameter whose exact gradient is at most ``NEGLIGIBLE`` of all gradients
    together is left out: at float32 rounding (a convolution's bias right before a batch
    norm, exactly 0 in exact arithmetic), any change is a large relative error and means
    nothing."""
    return {name: rel for name, (rel, _) in _errors(graph, config, probe, label, build).items()}


def parameters_over(
    graph: Graph,
    config: CompressionConfig,
    probe: Probe,
    limit: float = AUTO_PARAM_ERROR,
    label: str = "<model>",
    build: ModelBuilder = materialized_class,
) -> dict[str, str]:
    """The parameters that fail the check under ``config`` (see the module's docstring),
    each with why: relative error at or over ``limit`` and, where the probe knows the
    sampling noise, more than ``NOISE_SHARE`` times it."""
    over = {}
    for name, (rel, error) in _errors(graph, config, probe, label, build).items():
        if rel < limit:
            continue
        noise = probe.noise.get(name)
        if noise is None:
            over[name] = f"gradient error {rel:.2f}"
        elif error > NOISE_SHARE * noise:
            times = f"{error / noise:.2f}x" if noise > 0 else "over"
            over[name] = f"gradient error {rel:.2f}, {times} its sampling noise"
    return over
