"""``--recompute`` never makes a step keep more: what it would remake at a cost, it keeps.

``--recompute`` remakes cheap ops' outputs in the backward from tensors kept anyway
(``unroller.compiler.stash.plan_recompute``), so the stash only shrinks. The step's peak
need not: a remade chain holds its restored inputs and every output of the chain at once,
in the backward, where the gradients are alive too. On ResNet-34 under dct-dense the stem's
chain (restore conv1, remake bn1, then relu, the residual add and its relu) runs next to the
first stage's gradients and raised the predicted bytes per sample from 755 KiB to 1353 KiB,
past what dct-dense alone keeps.

``guard_recompute`` reads the memory model of the step (``unroller.analysis.memory``) at
``GUARD_BATCHES`` with and without ``recompute``; while the step with it predicts a higher
peak at some batch, or more bytes per added sample between two of them, the tensors remade
by the run of recompute steps at (or last before) that peak are added to the config's
``recompute_keep``: kept as the scheme says, not remade. When no remade tensor can be blamed,
nothing is remade (``recompute_keep = ["*"]``). The result is an ordinary config: the
generated file's stash table shows which tensors are remade, and a config file can name
``recompute_keep`` itself.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from unroller.analysis.memory import Simulation, simulate_graph
from unroller.compiler.graph import Graph
from unroller.compiler.schemes import CompressionConfig
from unroller.compiler.stash import RECOMPUTE, plan_stash

__all__ = ["GUARD_BATCHES", "guard_recompute", "worse_at"]

GUARD_BATCHES: tuple[int, ...] = (4, 8, 16, 32, 128)
"""The batch sizes the guard compares peaks at, and bytes per added sample between: the
benchmark's pairs (4 -> 8, 8 -> 16, 16 -> 32) and a large batch, where the bytes per sample
decide the peak."""
MAX_ROUNDS = 16
_REMAKE = re.compile(r"recompute (\S+) = ")
_RESTORE_OR_REMAKE = ("recompute ", "restore ")
_READS = re.compile(r"[A-Za-z_][\w.]*")


def guard_recompute(
    graph: Graph,
    config: CompressionConfig,
    platform: str = "gpu",
    segment_pieces: int = 1,
    segment_piece_size: int = 0,
    batches: Sequence[int] = GUARD_BATCHES,
) -> CompressionConfig:
    """``config`` with ``recompute_keep`` extended so that the step with ``recompute`` is
    predicted to peak no higher than the same step without it at every batch of
    ``batches``, and to keep no more per added sample between them (see the module's
    docstring); ``config`` itself when it does not recompute or already holds. One process
    guards a model and config once (``GUARDS_KEPT``)."""
    if not config.recompute:
        return config
    types = tuple(str(v.type) for v in graph.inputs)
    key = (graph.source, graph.float_dtype, graph.precision, types, repr(config), platform)
    key += (segment_pieces, segment_piece_size, tuple(batches))
    if key not in _GUARDED:
        while len(_GUARDED) >= GUARDS_KEPT:
            del _GUARDED[next(iter(_GUARDED))]
        _GUARDED[key] = _guard(graph, config, platform, segment_pieces, segment_piece_size, batches)
    return dataclasses.replace(_GUARDED[key])


GUARDS_KEPT = 64
_GUARDED: dict[tuple, CompressionConfig] = {}


def _guard(
    graph: Graph,
    config: CompressionConfig,
    platform: str,
    pieces: int,
    piece_size: int,
    batches: Sequence[int],
) -> CompressionConfig:
    def simulate(cfg: CompressionConfig, batch: int) -> Simulation:
        return simulate_graph(
            graph, cfg, batch, platform, segment_pieces=pieces, segment_piece_size=piece_size
        )

    plain = dataclasses.replace(config, recompute=False, recompute_keep=())
    base = [simulate(plain, batch) for batch in batches]
    keep = list(config.recompute_keep)
    for _ in range(MAX_ROUNDS):
        found = dataclasses.replace(config, recompute_keep=tuple(keep))
        sims: list[Simulation] = []
        at = None
        for batch in batches:  # up to the first batch where it is worse
            sims.append(simulate(found, batch))
            at = worse_at(sims, base)
            if at is not None:
                break
        if at is None:
            return found
        remade = _remade_keys(graph, found, pieces, piece_size)
        blamed = [k for k in _remade_near_peak(sims[at]) if k in remade and k not in keep]
        if not blamed:
            break
        keep += dict.fromkeys(blamed)
    return dataclasses.replace(config, recompute_keep=("*",))


def worse_at(sims: Sequence[Simulation], base: Sequence[Simulation]) -> int | None:
    """The index of the first simulation whose peak is above ``base``'s at the same batch,
    or whose bytes per added sample since the one before are above ``base``'s; None when
    none is."""
    for i, (got, ref) in enumerate(zip(sims, base)):
        if got.peak_bytes > ref.peak_bytes:
            return i
        if i and got.peak_bytes - sims[i - 1].peak_bytes > ref.peak_bytes - base[i - 1].peak_bytes:
            return i
    return None


def _remade_keys(graph: Graph, config: CompressionConfig, pieces: int, piece_size: int) -> set[str]:
    plan = plan_stash(graph, config, pieces, piece_size)
    return {e.key for e in plan.entries if RECOMPUTE in e.forms}


def _remade_near_peak(sim: Simulation) -> list[str]:
    """The names remade around the peak: by the run of restore and recompute steps the
    peak falls in; else those the peak's step reads, and those the last run of recompute
    steps before it remakes."""
    events = sim.events
    peak = next(
        (i for i, e in enumerate(events) if max(e.live_bytes, e.during_bytes) >= sim.peak_bytes),
        len(events) - 1,
    )

    def in_run(i: int) -> bool:
        return events[i].label.startswith(_RESTORE_OR_REMAKE)

    def remade_in(start: int, end: int) -> list[str]:
        while start > 0 and in_run(start - 1):
            start -= 1
        while end + 1 < len(events) and in_run(end + 1):
            end += 1
        found = (_REMAKE.match(e.label) for e in events[start : end + 1])
        return [m.group(1) for m in found if m]

    if in_run(peak):
        names = remade_in(peak, peak)
        if names:
            return names
    names = _READS.findall(events[peak].label.partition("(")[2])
    before = peak - 1
    while before >= 0 and not (in_run(before) and _REMAKE.match(events[before].label)):
        before -= 1
    return names + (remade_in(before, before) if before >= 0 else [])
