"""The torch.compile'd peers and the per-step memory timeline.

Fast: the compiled peers' plumbing on a tiny conv net with a cheap backend
(aot_eager_decomp_partition: AOTAutograd and its min-cut partitioner, which reads the
activation memory budget, without inductor's code generation), and the timeline of
ours and autograd on the quick benchmark at 8x8. Under SLOW=1: inductor on the quick
benchmark, gradients against plain autograd, stash and peak per budget.
"""

from __future__ import annotations

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler_start/stop lines on stderr

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from unroller.bench import measure, models, peers, plots, timeline  # noqa: E402
from unroller.bench.reference import BENCHMARKS  # noqa: E402
from unroller.compiler.options import Options  # noqa: E402

CPU = torch.device("cpu")
CHEAP = "aot_eager_decomp_partition"


class TinyNet(nn.Module):
    """conv-bn-relu twice, pooled, linear: activations the partitioner can recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.body(x)
        return nn.functional.cross_entropy(out, y), out


def tiny_batch(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 4, (n,), generator=g)]


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters()}


def assert_close_grads(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def test_compiled_peers_names_and_notes():
    found = peers.compiled_peers(TinyNet(), backend=CHEAP)  # nothing compiles yet
    assert [m.name for m in found] == ["compiled", "compiled-budget-0.5", "compiled-budget-0.1"]
    assert all(m.kind == "compiled" and m.compiles for m in found)
    assert all(m.backward_mark == peers.BACKWARD_MARK for m in found)
    assert {"compiled", "compiled-budget-B"} <= peers.METHODS.keys() & peers.STASH_METHODS.keys()


@pytest.mark.slow
def test_budget_peer_compiles_once_saves_less_and_matches_autograd():
    """One compilation (cheap backend): gradients as autograd's, a smaller stash, no
    recompilation at other batch sizes, and a profiler peak."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = TinyNet()
    plain = peers.autograd(ref)
    budget = peers.compiled_budget(ref, 0.1, backend=CHEAP)
    batch = tiny_batch(4)
    plain.step(batch)
    expected = grads(ref)
    budget.step(batch)  # compiles
    assert_close_grads(grads(ref), expected)
    graphs = counters["stats"]["unique_graphs"]
    for n in (6, 8, 3):
        budget.step(tiny_batch(n))
    assert counters["stats"]["unique_graphs"] == graphs  # the batch dimension is dynamic
    saved, eager = budget.stash(batch), plain.stash(batch)
    assert saved["stored_bytes"] < 0.5 * eager["stored_bytes"]
    assert saved["raw_bytes"] == saved["stored_bytes"] and saved["rows"] is None
    peak = measure.peak_step(budget, batch, CPU)
    assert peak["step_peak_bytes"] > 0 and peak["live_at_backward_bytes"] is not None


def test_downsample_keeps_the_peak_and_the_ends():
    points = [(i / 9999, (i * 7919) % 10007) for i in range(10000)]
    kept = downsample_checked(points, 500)
    assert max(n for _, n in kept) == max(n for _, n in points)
    assert kept[0] == points[0] and kept[-1] == points[-1]
    assert timeline.downsample(points[:100], 500) == points[:100]


def downsample_checked(points: list, max_points: int) -> list:
    kept = timeline.downsample(points, max_points)
    assert len(kept) <= max_points
    assert [t for t, _ in kept] == sorted(t for t, _ in kept)
    return kept


@pytest.fixture(scope="module")
def quick_methods(tmp_path_factory) -> tuple[list[peers.Method], list[torch.Tensor]]:
    """Ours (nocompress) and autograd on the quick benchmark at 8x8, batch 2."""
    bench = BENCHMARKS["quick"]
    ref = models.build_reference(bench, 8, 0, CPU)
    options = Options(platform="gpu", scheme="nocompress", resolution=8)
    model = models.build_ours(bench, options, ref, CPU, tmp_path_factory.mktemp("quick"))
    batch = models.batch_on(bench, 2, 8, 0, CPU)
    return [peers.ours_gpu("nocompress", model), peers.autograd(ref)], batch


def test_timeline_peak_is_the_step_peak_and_the_plot_is_written(quick_methods, tmp_path: Path):
    methods, batch = quick_methods
    found = {}
    for m in methods:
        m.stash(batch)  # warm; ours: finds its backward mark, as the suite's stash phase does
        found[m.name] = rec = timeline.record(m, batch, max_points=200)
        peak = measure.peak_step(m, batch, CPU)
        assert max(rec["bytes"]) == rec["peak_bytes"] == peak["step_peak_bytes"]
        assert rec["live_at_backward_bytes"] == peak["live_at_backward_bytes"]
        assert len(rec["time"]) == len(rec["bytes"]) <= 200
        assert 0.0 <= rec["time"][0] <= rec["time"][-1] <= 1.0
        assert 0.0 < rec["backward_start"] < 1.0 and rec["backward_mark"]
    path = plots.timeline(found, tmp_path / "timeline.png", "quick, batch 2 @ 8")
    assert path.stat().st_size > 10_000


@pytest.mark.slow
def test_inductor_peers_on_quick_match_autograd_and_save_less():
    """inductor (minutes on a CPU): each compiled peer's gradients against plain
    autograd's (float32), its stash shrinking with the budget, a profiler peak, and no
    recompilation at another batch size."""
    from torch._dynamo.utils import counters

    bench = BENCHMARKS["quick"]
    ref = models.build_reference(bench, 16, 0, CPU)
    batch = models.batch_on(bench, 4, 16, 0, CPU)
    plain = peers.autograd(ref)
    plain.step(batch)
    expected = grads(ref)
    stored = {}
    for m in peers.compiled_peers(ref):
        m.step(batch)
        assert_close_grads(grads(ref), expected, rtol=1e-3, atol=1e-4)
        graphs = counters["stats"]["unique_graphs"]
        m.step(models.batch_on(bench, 6, 16, 0, CPU))
        assert counters["stats"]["unique_graphs"] == graphs
        stored[m.name] = m.stash(batch)["stored_bytes"]
        assert measure.peak_step(m, batch, CPU)["step_peak_bytes"] > 0
    assert stored["compiled-budget-0.1"] < stored["compiled-budget-0.5"] < stored["compiled"]
