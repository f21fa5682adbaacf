"""The stash plan resolved for emission: per node, per saved tensor and per segment, once.

``stash.plan_stash`` decides forms tensor by tensor; laying out steps needs the answers
node by node (what a backward call reads, in which form, whether it restores it whole or
hands it over packed, whether it may overwrite it) and segment by segment (which
statements its recompute runs again, which inputs it restores). ``resolve`` works all of
that out before the first step is made, so the lowering passes read one structure and
never query the stash module, and the memory model reads the same answers.

A kernel may be handed a compressed form packed and decompress it a piece of the batch
at a time only where the step shrinks its backward working set (``lean``): that depends
on the platform, so the resolution does too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from unroller.compiler.graph import Graph, Node, Value
from unroller.compiler.platforms import Platform
from unroller.compiler.schemes import Codec, CompressionConfig
from unroller.compiler.stash import (
    Form,
    Segment,
    Stashed,
    StashPlan,
    always_there,
    changes_state,
    rerun_nodes,
    value_form,
    value_producers,
)

__all__ = [
    "Form",
    "NodeStash",
    "RAW",
    "RECOMPUTE",
    "Read",
    "ResolvedPlan",
    "Segment",
    "SegmentPlan",
    "Source",
    "Stashed",
    "resolve",
]
"""The stash plan's own types (a form, an entry, a segment) are the passes' too: they read
them from here, with the plan's answers."""

RAW = Form("raw")
RECOMPUTE = Form("recompute")


@dataclass(frozen=True)
class Read:
    """One saved tensor a backward call reads: the entry, its saved name, the form read."""

    stashed: Stashed
    entry: str
    form: Form


@dataclass(frozen=True)
class NodeStash:
    """What one node's steps keep and read, resolved."""

    node: Node
    reads: tuple[Read, ...]  # every saved tensor its backward reads, in plan order
    saved: dict[str, Read]  # saved entry -> the read its backward argument is
    kept_extras: frozenset[str]  # extra outputs of its forward kept for its backward
    consumable: bool  # its backward may overwrite the extras it consumes
    segment: Segment | None  # the recomputed segment it belongs to
    recompute_state: bool  # rerun by a segment through its registry recompute kernel


@dataclass(frozen=True)
class Source:
    """Where the backward finds a value it remakes (``--recompute``): a model input,
    something there anyway, a kept form, or its producer's recompute kernel."""

    kind: str  # "input", "there", "kept" or "remake"
    value: Value | None = None  # input: the input; there: the producer's output
    stashed: Stashed | None = None  # kept: the entry ...
    form: Form | None = None  # ... and its value form
    producer: Node | None = None  # remake: the node whose recompute kernel remakes it


@dataclass(frozen=True)
class SegmentPlan:
    """A recomputed segment, resolved: what its recompute runs and restores."""

    segment: Segment
    rerun: list[Node]  # its statements its own stash depends on, in order
    inputs: list[tuple[Stashed, Form | None]]  # inputs the rerun reads, in their value form
    remade: list[Stashed]  # its own stash as the recompute keeps it
    backward: list[Node]  # its nodes with a backward step, in backward order
    #: run in pieces: inputs restored once for the whole batch (read by rerun or backward)
    whole_batch: list[tuple[Stashed, Form]]


@dataclass
class ResolvedPlan:
    """The stash plan as the lowering passes read it."""

    plan: StashPlan
    lean: bool
    nodes: dict[int, NodeStash]  # node index -> its record
    segments: list[SegmentPlan]
    stashed: dict[str, Stashed]  # stash key -> its entry
    producers: dict[str, Node | None]  # value name -> its node (None: a model input)
    sources: dict[str, Source]  # value name -> where a remake finds it
    value_forms: dict[str, Form | None]  # stash key -> its value form
    in_pieces: set[tuple[str, Form]]  # forms handed over packed (``restored_in_pieces``)
    forward_entries: list[Stashed]  # what the forward keeps (the rest a recompute makes)

    @property
    def entries(self) -> list[Stashed]:
        return self.plan.entries

    @property
    def config(self) -> CompressionConfig:
        return self.plan.config

    def by_key(self) -> dict[str, Stashed]:
        return self.stashed

    def codecs(self) -> list[Codec]:
        return self.plan.codecs()

    def node(self, node: Node) -> NodeStash:
        return self.nodes[node.index]

    def segment_of(self, node: Node) -> SegmentPlan | None:
        found = self.nodes[node.index].segment
        return next(s for s in self.segments if s.segment is found) if found else None


def resolve(graph: Graph, plan: StashPlan, platform: Platform) -> ResolvedPlan:
    """Every answer the lowering needs from ``plan`` on ``platform``."""
    pieced = any(s.in_pieces for s in plan.segments)
    lean = platform.piece_bytes > 0 and (plan.config.lossy or pieced)
    in_pieces = {
        (s.key, form)
        for s in plan.entries
        for form in s.forms
        if _restored_in_pieces(s, form, lean)
    }
    segment_of = {n.index: s for s in plan.segments for n in s.nodes}
    nodes = {n.index: _node_stash(n, plan, in_pieces, segment_of.get(n.index)) for n in graph.nodes}
    by_key = plan.by_key()
    producers = value_producers(graph)
    return ResolvedPlan(
        plan=plan,
        lean=lean,
        nodes=nodes,
        segments=[_segment_plan(s, by_key, nodes) for s in plan.segments],
        stashed=by_key,
        producers=producers,
        sources=_sources(graph, producers, by_key),
        value_forms={key: value_form(s) for key, s in by_key.items()},
        in_pieces=in_pieces,
        forward_entries=[  # the rest: a segment's recompute makes them
            e if e.segment is None else dataclasses.replace(e, forms=e.segment_keeps)
            for e in plan.entries
            if e.segment is None or e.segment_keeps
        ],
    )


def _restored_in_pieces(stashed: Stashed, form: Form, lean: bool) -> bool:
    """Is a compressed form read only as the first saved entry of backward kernels that
    run in pieces? Then it is handed over packed (``K.restore_in_pieces``) and each
    kernel decompresses one piece of the batch at a time."""
    if not lean or form.kind != "codec":
        return False
    readers = [(n, saved) for n, saved, f in stashed.readers if f == form]
    return bool(readers) and all(
        n.op.backward_pieces and saved.entry == n.op.saved[0] for n, saved in readers
    )


def _node_stash(
    node: Node, plan: StashPlan, in_pieces: set[tuple[str, Form]], segment: Segment | None
) -> NodeStash:
    reads = tuple(Read(s, entry, form) for s, entry, form in plan.reads_of(node))
    saved: dict[str, Read] = {}
    for read in reads:
        saved.setdefault(read.entry, read)
    return NodeStash(
        node=node,
        reads=reads,
        saved=saved,
        kept_extras=frozenset(a.entry for a in node.saved if a.kind == "extra"),
        consumable=_consumable(node, saved, in_pieces),
        segment=segment,
        recompute_state=changes_state(node),
    )


def _consumable(node: Node, saved: dict[str, Read], in_pieces: set[tuple[str, Form]]) -> bool:
    """May the backward overwrite its saved extras named in ``backward_consumes``? Each
    must reach it as a tensor this code owns and nothing else reads: kept raw (the
    forward's own output), or restored into a new tensor from a compressed form; never
    a packed form restored piece by piece, and never one a segment's recompute reads."""
    consumed = node.op.backward_consumes
    if not consumed:
        return False
    for arg in node.saved:
        if arg.entry not in consumed:
            continue
        if arg.kind != "extra":
            return False  # the kernel returned no such extra (None) with these arguments
        found = saved.get(arg.entry)
        if found is None:
            return False
        stashed, form = found.stashed, found.form
        if stashed.segment_readers or any(n is not node for n, _, _ in stashed.readers):
            return False
        if form.kind == "recompute" or (stashed.key, form) in in_pieces:
            return False
    return True


def _sources(
    graph: Graph, producers: dict[str, Node | None], by_key: dict[str, Stashed]
) -> dict[str, Source]:
    """Per value, where a remake finds it (``plan_recompute`` planned the chains)."""
    inputs = {v.name: v for v in graph.inputs}
    found: dict[str, Source] = {}
    for name, producer in producers.items():
        if producer is None:
            found[name] = Source("input", value=inputs[name])
        elif always_there(producers, name):
            found[name] = Source("there", value=producer.output)
        else:
            stashed = by_key.get(name)
            form = value_form(stashed) if stashed is not None else None
            if form is not None:
                found[name] = Source("kept", stashed=stashed, form=form)
            else:
                found[name] = Source("remake", producer=producer)
    return found


def _segment_plan(
    segment: Segment, by_key: dict[str, Stashed], nodes: dict[int, NodeStash]
) -> SegmentPlan:
    rerun = rerun_nodes(segment, [by_key[key].producer for key in segment.internal])
    read = {v.name for n in rerun for v in n.inputs}
    inputs = [(by_key[name], value_form(by_key[name])) for name in segment.inputs if name in read]
    backward = [n for n in reversed(segment.nodes) if n.needs_backward]
    whole_batch: list[tuple[Stashed, Form]] = []
    if segment.in_pieces:
        read |= {r.stashed.key for n in backward for r in nodes[n.index].reads}
        for name in segment.inputs:
            stashed = by_key[name]
            form = value_form(stashed)
            if name in read and form is not None and form.kind != "raw":
                whole_batch.append((stashed, form))
    return SegmentPlan(
        segment=segment,
        rerun=rerun,
        inputs=inputs,
        remade=[_remade_part(by_key[key]) for key in segment.internal],
        backward=backward,
        whole_batch=whole_batch,
    )


def _remade_part(stashed: Stashed) -> Stashed:
    """A segment's own saved tensor as its recompute keeps it: the forms the forward does
    not keep already (``Stashed.segment_keeps``)."""
    if not stashed.segment_keeps:
        return stashed
    forms = [f for f in stashed.forms if f not in stashed.segment_keeps]
    return dataclasses.replace(stashed, forms=forms)
