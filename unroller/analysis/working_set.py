"""What no compression removes: the bytes per sample of a step's working set alone.

Compression shrinks what the forward keeps for the backward (the stash). The rest of a
step's memory at any moment is its working set: the activations the forward is still
using, the gradients the backward is passing on, the restored tensors and the kernels'
buffers, and the parameters' ``.grad``. ``working_set_bound`` is the memory model
(``memory.simulate_graph``) of a plan's step with the stash counted as free: the bytes per
added sample of the most any statement holds beside the stash, between two batches. No
choice of forms for the same structure (``--recompute``, segments and pieces, the lossy
kernels' pieces) keeps less per sample than that, so it says how far compression alone can
go before another move (segments in pieces, which shrink the working set itself) is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from unroller.analysis.memory import Event, Simulation, simulate_graph
from unroller.compiler.graph import Graph
from unroller.compiler.schemes import CompressionConfig

__all__ = ["WorkingSetBound", "working_set_bound"]


@dataclass(frozen=True)
class WorkingSetBound:
    """The working set of one plan's step, per added sample."""

    per_sample: float  # bytes per added sample, the stash counted as free
    at: str  # the statement holding the most beside the stash, at the larger batch
    section: str  # "forward", "backward" or "recompute"
    plan_per_sample: float  # the same plan's predicted bytes per sample, stash included
    batches: tuple[int, int]


def _most(simulation: Simulation) -> tuple[int, Event]:
    """The most any statement holds beside the stash, and that statement."""
    return max(((e.during_bytes - e.stash_bytes, e) for e in simulation.events), key=itemgetter(0))


def working_set_bound(
    graph: Graph,
    config: CompressionConfig,
    batches: tuple[int, int] = (8, 16),
    platform: str = "gpu",
) -> WorkingSetBound:
    """The working set of ``config``'s step between ``batches`` (see the module's
    docstring), beside the plan's own predicted bytes per sample."""
    small, large = (simulate_graph(graph, config, b, platform) for b in batches)
    (low, _), (high, event) = _most(small), _most(large)
    span = batches[1] - batches[0]
    return WorkingSetBound(
        (high - low) / span,
        event.label,
        event.section,
        (large.peak_bytes - small.peak_bytes) / span,
        batches,
    )
