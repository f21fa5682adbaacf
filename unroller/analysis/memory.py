"""The memory model of one generated training step: bytes live over the step, peak, floor.

The generated step is explicit code, so its memory can be read off the step program the
code generator emits (``unroller.compiler.lower.Lowering.training_steps``: every statement, what it
writes, and after which step each variable is released) without running it; what each
variable is comes from its structured key (``Lowering.key_of``) and the resolved stash plan
(``Lowering.plan``), which step belongs to which op from the lowering's step observer. Every variable gets its
bytes from the graph's shapes at a batch size: activations and gradients from their value's
type, packed forms from the compressor's ``stored_bytes``, restored ones from the logical
type. Views allocate nothing and keep their base alive (forward ops marked ``view`` in the
registry; gradients of ``grad_aliases`` ops share the output gradient's storage).
Parameter gradients are copied into ``.grad`` the first time (``K.accumulate``) and stay.

Figures are the step's own allocations, as the benchmark's CPU measure counts them
(``unroller.bench.measure.peak_step``: ``step_peak_bytes``): parameters, buffers and the
batch are resident before the step and not counted.

- **peak**: the most bytes live at once, where a statement's outputs are counted while
  its inputs are still alive, plus a kernel's working memory (registry ``workspace``).
- **floor**: what no schedule of the same statements and stored forms can go under: the
  most, over the statements, of the stash still held then (the stored forms kept for
  backward), plus that statement's working set (the tensors it reads and makes, restored
  ones included, and its kernel's working memory), plus the parameter gradients made so
  far (``.grad`` outlives the step). Everything else live at a moment is memory a better
  schedule could free: the generated code's peak over its floor says how much that is.

Segment recompute is read off the same program: a recomputed segment's inputs are kept from
the forward (in their stored form) until its backward begins; there its recompute steps
(section ``recompute``) restore them, run its forward statements again (with their kernels'
forward working memory) and make its own stash, which counts as stash from then until its
backward steps free it.

A segment run in pieces (``--segment-pieces K``) is two loops in the program, its forward
and its recompute and backward: each body, one piece's steps, is walked once with every
batch-sized tensor (and kernel working memory) at the largest piece's batch, ceil(N / K);
the pieces of the whole-batch tensors it reads are views, and those tensors stay live until
the loop ends.

This module starts from a graph and a resolved config (``simulate_graph``); a model text
under ``Options`` is ``unroller.api.simulate``, above the planner that imports this module
(the ``auto`` scheme is planned before it is simulated).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from unroller.compiler.dtypes import DTYPE_BYTES, FLOAT_DTYPES, torch_dtype
from unroller.compiler.graph import Graph, Node
from unroller.compiler.ir import (
    ACCUMULATORS,
    RECOMPUTE_SECTION,
    AddTo,
    Assign,
    Attr,
    CallExpr,
    Const,
    Do,
    Layer,
    Step,
    TupleExpr,
    Var,
    called_name,
    walk,
)
from unroller.compiler.lower import Lowering
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.registry import Workspace
from unroller.compiler.schemes import Codec, CompressionConfig
from unroller.compiler.stash import Form, Stashed, plan_stash
from unroller.runtime.attention import largest_tile
from unroller.runtime.gpu import piece_samples

__all__ = ["Simulation", "Event", "simulate_graph", "Workspace"]


#: Kernels that copy a reordered operand (a view with its dims reordered: registry
#: ``reorders``) into a contiguous tensor first, a copy of its bytes beside everything else,
#: whatever the machine, are marked in the registry (``workspace.contiguous_input``,
#: ``workspace.contiguous_grad``), as are the kernels' measured working memory
#: (``workspace``: backward, pieces, forward; ``unroller.compiler.registry.Workspace``).


@dataclass(frozen=True)
class Event:
    """Bytes live after one step of the program (and at most during it)."""

    index: int
    section: str  # "forward", "backward" or "recompute" (a segment's forward again)
    label: str  # the model statement or "keep X as ...", "restore X: ..."
    live_bytes: int  # after the step's releases
    during_bytes: int  # the most during the step (outputs made while inputs still live)
    stash_bytes: int  # of live_bytes: packed forms and raw tensors kept for backward


@dataclass
class Simulation:
    """What the memory model predicts for one step at one batch size."""

    batch_size: int
    events: list[Event]
    peak_bytes: int
    peak_at: str  # the label of the step where the peak is reached
    peak_stash: tuple[str, ...]  # saved tensors (keys) held at the peak
    stash_bytes: int  # stored bytes kept for backward, at their most (end of forward)
    stash_raw_bytes: int  # the same tensors as the forward made them
    largest_step_bytes: int  # the largest working set of a single step
    largest_step: str
    param_grad_bytes: int
    floor_bytes: int  # max over statements: stash held + its working set + .grad so far

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "peak_bytes": self.peak_bytes,
            "peak_at": self.peak_at,
            "floor_bytes": self.floor_bytes,
            "stash_bytes": self.stash_bytes,
            "stash_raw_bytes": self.stash_raw_bytes,
            "largest_step_bytes": self.largest_step_bytes,
            "largest_step": self.largest_step,
            "param_grad_bytes": self.param_grad_bytes,
        }


class _Sizes:
    """Bytes of every variable of the step program, from its structured key."""

    def __init__(self, lowering: Lowering, batch: int, kernel_scale: float = 1.0):
        self.key_of, self.batch = lowering.key_of, batch
        self.kernel_scale = kernel_scale  # multiplies the registry's workspace entries
        graph = lowering.graph
        self.node_named = {n.name: n for n in graph.nodes}
        self.values = {v.name: v for v in graph.inputs}
        self.values.update({n.output.name: n.output for n in graph.nodes})
        plan = lowering.plan
        self.stashed = plan.by_key()
        self.value_forms = plan.value_forms
        self.forms = {(s.key, str(f)): (s, f) for s in plan.entries for f in s.forms}
        self.in_pieces: set[str] = set()  # restored variables a kernel decompresses by piece

    def tensor(self, t, dtype: str | None = None) -> int:
        return t.numel(self.batch) * DTYPE_BYTES[dtype or t.dtype]

    def of(self, name: str, node: Node | None) -> int:
        key = self.key_of.get(name)
        return 0 if key is None else self.of_key(key, node)

    def of_key(self, key: tuple[str, ...], node: Node | None) -> int:
        kind = key[0]
        if kind == "piece":  # one piece's tensor (made in a loop body, at the piece's batch)
            return self.of_key(key[1:], node)
        if kind in ("value", "grad", "recomputed"):
            return self.tensor(self.values[key[1]].type)
        if kind == "partial":
            return self.tensor(self.values[key[1]].type)
        if kind == "extra":
            node_named = self.node_named[key[1]]
            extra = next(e for e in node_named.extras if e.name == key[2])
            return self.tensor(extra.type)
        if kind == "pgrad":
            param = next((p for p in (node.params if node else []) if p.name == key[1]), None)
            return param.nbytes() if param is not None else 0
        if kind in ("packed", "restored"):
            stashed, form = self.forms[(key[1], key[3])]
            return (
                packed_bytes(stashed, form, self.batch)
                if kind == "packed"
                else (restored_bytes(stashed, form, self.batch))
            )
        return 0


def packed_bytes(stashed: Stashed, form: Form, batch: int) -> int:
    """Stored bytes of one form of a saved tensor at ``batch``."""
    if form.kind == "raw":
        return stashed.raw_bytes(batch)
    t = form.type or stashed.type
    shape = tuple(batch if d == "N" else d for d in t.shape)
    dtype = "bool" if form.kind == "mask" else t.dtype
    return form.codec.instance().stored_bytes(shape, torch_dtype(dtype))


def restored_bytes(stashed: Stashed, form: Form, batch: int) -> int:
    t = form.type or stashed.type
    return t.numel(batch) * DTYPE_BYTES["bool" if form.kind == "mask" else t.dtype]


def codec_transients(codec: Codec, shape: tuple[int, ...], dtype: str) -> tuple[float, float]:
    """Working memory of one compress and one decompress call beyond what each returns, as
    a multiple of the raw tensor's bytes: measured once per codec, sample shape and the
    codecs' CPU path (``compress.base.cpu_path_state``: the native kernels allocate nothing
    beyond what they return, the PyTorch formulation does; a test that switches the native
    kernels off, or a process whose kernels are still being built, must not leave its
    figure to every later prediction) on a batch-2 tensor of random normal values (the
    profiler's CPU allocation events), so that fusing or rewriting a codec shows up in the
    model without editing it. The least of ``TRANSIENT_TRIES`` calls each: the profiler
    records every thread of the process, and one left running by a caller (a data loader,
    a process group) must not pass for the codec's."""
    from unroller.compress.base import cpu_path_state

    return _codec_transients(codec, shape, dtype, cpu_path_state())


@functools.cache
def _codec_transients(
    codec: Codec, shape: tuple[int, ...], dtype: str, state: tuple
) -> tuple[float, float]:
    instance = codec.instance()
    x = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    x = x.to(torch_dtype(dtype)) if dtype != "bool" else x > 0
    raw = x.numel() * x.element_size()
    packed_box: list = []
    compress = min(
        _transient(lambda: packed_box.append(instance.compress(x))) for _ in range(TRANSIENT_TRIES)
    )
    packed = packed_box[0]
    decompress = min(
        _transient(lambda: instance.decompress(packed, shape, x.dtype))
        for _ in range(TRANSIENT_TRIES)
    )
    return compress / raw, decompress / raw


TRANSIENT_TRIES = 3


def _transient(call) -> int:
    """The most bytes a call holds beyond what it still holds when it returns."""
    from torch.profiler import ProfilerActivity, profile

    from unroller.analysis.allocations import allocation_trace

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = call()
    del kept
    allocs, _ = allocation_trace(prof)
    running = peak = 0
    for _, size in allocs:
        running += size
        peak = max(peak, running)
    return max(0, peak - max(running, 0))


class _Heap:
    """Storages with reference counts: a view shares its base's storage."""

    def __init__(self) -> None:
        self.storage_of: dict[str, int] = {}
        self.size: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.stash: dict[int, str] = {}  # storage -> the saved tensor's key
        self.live = 0
        self.stash_live = 0
        self._next = 0

    def new(self, nbytes: int) -> int:
        self._next += 1
        self.size[self._next], self.refs[self._next] = nbytes, 0
        self.live += nbytes
        return self._next

    def bind(self, name: str, storage: int) -> None:
        self.refs[storage] += 1
        self.unbind(name)
        self.storage_of[name] = storage

    def unbind(self, name: str) -> None:
        old = self.storage_of.pop(name, None)
        if old is None:
            return
        self.refs[old] -= 1
        if self.refs[old] == 0:
            self.live -= self.size[old]
            if old in self.stash:
                del self.stash[old]
                self.stash_live -= self.size[old]
            del self.size[old], self.refs[old]

    def unmark_stash(self, storage: int) -> None:
        """The storage holds a saved tensor no more (a kernel consumed it, see
        ``backward_consumes``): live still, as whatever was written into it."""
        if self.stash.pop(storage, None) is not None:
            self.stash_live -= self.size[storage]

    def mark_stash(self, name: str, key: str) -> None:
        storage = self.storage_of.get(name)
        if storage is not None and storage not in self.stash:
            self.stash[storage] = key
            self.stash_live += self.size[storage]


def _var_args(expr: CallExpr) -> list[str]:
    return [a.name for a in expr.args if isinstance(a, Var)]


def simulate_graph(
    graph: Graph,
    config: CompressionConfig,
    batch_size: int,
    platform: str = "gpu",
    kernel_scale: float = 1.0,
    segment_pieces: int = 1,
    segment_piece_size: int = 0,
    update_in_backward: bool = False,
) -> Simulation:
    """The memory model of the step the code generator emits for ``graph`` and ``config``
    (``segment_pieces``: the recomputed segments in that many pieces of the batch;
    ``segment_piece_size``: in pieces of at most that many samples instead;
    ``update_in_backward``: the step of ``--update-in-backward`` with an optimizer attached,
    each ``.grad`` freed at its update, which holds ``UPDATE_BUFFERS`` parameter-sized
    buffers while it runs).

    ``kernel_scale`` multiplies the kernels' working memory (the registry's ``workspace``:
    measured on one CPU, where another CPU's oneDNN may pick another algorithm with other
    scratch buffers); 0 and 2 bracket what another machine can measure. Codec transients are measured on the running machine already.
    """
    plan = plan_stash(graph, config, segment_pieces, segment_piece_size)
    made: dict[int, Node] = {}  # id(step) -> the node it runs, remakes or differentiates

    def observe(step: Step, node: Node) -> None:
        made[id(step)] = node

    lowering = Lowering(
        graph,
        plan,
        get_platform(platform),
        observer=observe,
        update_in_backward=update_in_backward,
    )
    steps = lowering.training_steps()
    return _run(steps, made, lowering, batch_size, kernel_scale)


def _run(
    steps: list[Step],
    made: dict[int, Node],
    lowering: Lowering,
    batch: int,
    kernel_scale: float = 1.0,
) -> Simulation:
    plan = lowering.plan
    sizes = _Sizes(lowering, batch, kernel_scale)
    heap = _Heap()
    inputs = {lowering.var(v).name for v in lowering.graph.inputs}
    raw_kept = [s for s in plan.entries if s.forms == [Form("raw")]]
    # kept raw by the forward, or made raw by a segment's recompute (only then stash)
    stash_names = {lowering.raw_var(s.key).name: s.key for s in raw_kept if s.segment is None}
    remade_names = {lowering.raw_var(s.key).name: s.key for s in raw_kept if s.segment}
    first_grad: set[str] = set()
    events: list[Event] = []
    peak, peak_at, peak_stash = 0, "", ()
    largest, largest_at = 0, ""
    stash_most = 0
    param_grads = 0
    floor = 0
    at = {id(step): i for i, step in enumerate(steps)}
    loop_end: dict[int, int] = {}  # a pieces loop's header index -> its last step's index
    piece_batch: dict[int, int] = {}  # step index in a loop body -> the largest piece's batch
    for loop in lowering.piece_loops:
        start, end, segment = at[id(loop.header)], at[id(loop.last)], loop.segment
        loop_end[start] = end
        for k in range(start + 1, end + 1):
            piece_batch[k] = (
                min(batch, segment.piece_size)
                if segment.piece_size
                else -(-batch // segment.pieces)
            )
    deferred: dict[int, list[str]] = {}  # releases held until a loop's end
    cast_bytes = _cast_cache_bytes(lowering.graph)
    for i, step in enumerate(steps):
        node = made.get(id(step))
        during = heap.live
        step_working = 0
        sizes.batch = piece_batch.get(i, batch)
        if i in loop_end:  # the loop header: views of the whole-batch tensors, kept to its end
            _bind_pieces(step, heap)
            if _piece_count(lowering, step, batch) > 1:
                body = [(s, made.get(id(s))) for s in steps[i + 1 : loop_end[i] + 1]]
                param_grads += _grads_before_the_second_piece(body, heap, first_grad)
            deferred[loop_end[i]] = list(step.release)
            events.append(
                Event(i, step.section, step.comment, heap.live, heap.live, heap.stash_live)
            )
            continue
        for statement in step.statements:
            param_grads += _cast_layers(statement, heap, cast_bytes)
            reads = Step(step.section, [statement]).reads()
            touched = {  # storages this statement reads or makes, with their bytes
                heap.storage_of[n]: heap.size[heap.storage_of[n]]
                for n in reads
                if n in heap.storage_of
            }
            added, transient = _statement(statement, step, node, heap, sizes, inputs, first_grad)
            param_grads += added
            during = max(during, heap.live + transient)
            for name in _targets(statement):
                if name in heap.storage_of:
                    touched[heap.storage_of[name]] = heap.size[heap.storage_of[name]]
            working = sum(b for k, b in touched.items() if k not in heap.stash) + transient
            step_working = max(step_working, working)
            floor = max(floor, heap.stash_live + working + param_grads)
        if step.section in ("forward", RECOMPUTE_SECTION):
            raw_names = stash_names if step.section == "forward" else remade_names
            for name in _targets_of(step):
                if name in raw_names:
                    heap.mark_stash(name, raw_names[name])
                key = lowering.key_of.get(name, ("",))
                if key[0] == "packed":
                    heap.mark_stash(name, key[1])
        stash_during, stash_ids = heap.stash_live, dict(heap.stash)
        for name in [*step.release, *deferred.pop(i, [])]:
            heap.unbind(name)
        if step_working > largest:
            largest, largest_at = step_working, step.comment
        if during > peak:
            peak, peak_at, peak_stash = during, step.comment, tuple(stash_ids.values())
        stash_most = max(stash_most, stash_during)
        events.append(Event(i, step.section, step.comment, heap.live, during, heap.stash_live))
    raw_total = sum(s.raw_bytes(batch) for s in plan.entries if s.producer >= 0)
    return Simulation(
        batch_size=batch,
        events=events,
        peak_bytes=peak,
        peak_at=peak_at,
        peak_stash=tuple(dict.fromkeys(peak_stash)),
        stash_bytes=stash_most,
        stash_raw_bytes=raw_total,
        largest_step_bytes=largest,
        largest_step=largest_at,
        param_grad_bytes=param_grads,
        floor_bytes=floor,
    )


def _cast_cache_bytes(graph: Graph) -> dict[tuple[str, str], int]:
    """A mixed precision's cast cache (``L.cast``): per (layer, dtype) a ``lower`` op reads
    its weights in, the bytes of its float parameters and buffers in that dtype."""
    found: dict[tuple[str, str], int] = {}
    for node in graph.nodes:
        if node.cast_params:
            tensors = [t for t in (*node.params, *node.buffers) if t.present]
            elements = sum(math.prod(t.shape) for t in tensors if t.dtype in FLOAT_DTYPES)
            found[(node.layer, node.cast_params)] = elements * DTYPE_BYTES[node.cast_params]
    return found


def _cast_layers(statement: Any, heap: _Heap, cast_bytes: dict[tuple[str, str], int]) -> int:
    """The cast copies of weights a statement makes first (``L.cast``): held to the step's
    end, like a parameter gradient, so counted with them (their bytes returned)."""
    added = 0
    for layer in _layers_in(statement):
        name = f"cast cache:{layer.path}:{layer.dtype}"
        if layer.dtype and name not in heap.storage_of:
            size = cast_bytes.get((layer.path, layer.dtype), 0)
            heap.bind(name, heap.new(size))
            added += size
    return added


def _layers_in(statement: Any) -> list[Layer]:
    """Every layer handle a statement's expression names."""
    value = getattr(statement, "value", None)
    return [] if value is None else [e for e in walk(value) if isinstance(e, Layer)]


def _piece_count(lowering: Lowering, header: Step, batch: int) -> int:
    """How many pieces the loop of ``header`` runs at ``batch``."""
    segment = next(loop.segment for loop in lowering.piece_loops if loop.header is header)
    if segment.piece_size:
        return -(-batch // segment.piece_size)
    return min(segment.pieces, batch)


def _grads_before_the_second_piece(
    body: list[tuple[Step, Node | None]], heap: _Heap, first_grad: set[str]
) -> int:
    """The parameter gradients a pieces loop's body makes the first time (``.grad``, made
    by the first piece and kept): from the second piece on they are there at every
    statement of the body, so the body is walked as the second piece sees it, with them
    made at the loop's start (a piece after the first is never smaller than the second:
    the walk is the largest piece's). Returns their bytes; the statements then find them
    made (``first_grad``)."""
    return sum(
        _new_grads(_grad_params(statement, node), node, heap, first_grad)
        for step, node in body
        if node is not None
        for statement in step.statements
    )


def _bind_pieces(header: Step, heap: _Heap) -> None:
    """A pieces loop's header (``a_piece, b_slot = zip(a.tensor_split(K), ...)``): each
    target is a view of its whole-batch tensor (or packed form), sharing its storage."""
    assign = header.statements[0]
    assert isinstance(assign, Assign) and isinstance(assign.value, CallExpr)
    for target, split in zip(assign.targets, assign.value.args):
        assert target is not None and isinstance(split, CallExpr)
        # ``a.split(P)`` / ``a.tensor_split(K)``, or ``K.packed_split(a_quant, size=P)``
        whole = split.func.var if isinstance(split.func, Attr) else split.args[0]
        source = whole.name if isinstance(whole, Var) else ""
        storage = heap.storage_of.get(source)
        heap.bind(target.name, storage if storage is not None else heap.new(0))


def _targets(statement: Any) -> list[str]:
    if isinstance(statement, Assign):
        return [t.name for t in statement.targets if t is not None]
    if isinstance(statement, AddTo):
        return [statement.total.name]
    return []


def _targets_of(step: Step) -> list[str]:
    return [name for s in step.statements for name in _targets(s)]


def _statement(
    statement: Any,
    step: Step,
    node: Node | None,
    heap: _Heap,
    sizes: _Sizes,
    inputs: set[str],
    first_grad: set[str],
) -> tuple[int, int]:
    """Apply one statement to the heap: (parameter-gradient bytes it adds, bytes it holds
    only while it runs)."""
    if isinstance(statement, AddTo):
        if statement.into_part and statement.part.name in heap.storage_of:
            heap.bind(statement.total.name, heap.storage_of[statement.part.name])
        elif not statement.in_place:
            heap.bind(statement.total.name, heap.new(sizes.of(statement.total.name, node)))
        return 0, 0
    if isinstance(statement, Do):
        func = called_name(statement.value)
        if func == UPDATE_CALL:
            return _updated(statement.value, heap, first_grad)
        if func not in ACCUMULATORS or node is None:
            return 0, 0
        added = 0
        for attr, value in statement.value.kwargs:
            param = next((p for p in node.params if p.name == attr), None)
            key = node.ties.get(attr, param.key) if param is not None else None
            if param is not None and param.trainable and key not in first_grad:
                first_grad.add(key)  # a tied parameter has one .grad
                grad = heap.storage_of.get(value.name) if isinstance(value, Var) else None
                if func == "K.accumulate_fresh" and grad is not None:
                    heap.bind(f".grad:{key}", grad)  # the gradient itself: lives on
                else:
                    heap.bind(f".grad:{key}", heap.new(param.nbytes()))  # a copy: lives on
                added += param.nbytes()
        return added, 0
    if not isinstance(statement, Assign):
        return 0, 0
    func = called_name(statement.value)
    targets = [t.name for t in statement.targets if t is not None]
    added = _grads_in_kernel(statement, node, heap, first_grad)
    transient = _transient_of(statement, step, node, sizes, func, targets)
    shared = _aliased_storage(statement, step, node, heap, func)
    overwritten = _overwritten_storage(statement, step, node, heap, sizes, func)
    if func == "K.restore_in_pieces":
        sizes.in_pieces.update(targets)
    for position, target in enumerate(statement.targets):
        if target is None or target.name in inputs:
            continue
        if shared is not None:
            heap.bind(target.name, shared)
        elif position == 0 and overwritten is not None:
            heap.bind(target.name, overwritten)
        else:
            heap.bind(target.name, heap.new(sizes.of(target.name, node)))
    return added, transient


def _grads_in_kernel(
    statement: Assign, node: Node | None, heap: _Heap, first_grad: set[str]
) -> int:
    """A backward kernel called with ``accumulate=True`` adds its parameter gradients into
    ``.grad`` itself: the first time a parameter's ``.grad`` is made (it lives past the
    step), later calls add in place. Returns the parameter-gradient bytes made."""
    if node is None:
        return 0
    return _new_grads(_grad_params(statement, node), node, heap, first_grad)


def _grad_params(statement: Any, node: Node) -> list:
    """The parameters of ``node`` whose ``.grad`` ``statement`` adds to: all present ones for
    a kernel called with ``accumulate=True``, the named ones for ``K.accumulate``."""
    value = getattr(statement, "value", None)
    if not isinstance(value, CallExpr):
        return []
    kwargs = dict(value.kwargs)
    accumulate = kwargs.get("accumulate")
    if isinstance(statement, Assign) and isinstance(accumulate, Const) and accumulate.value is True:
        return [p for p in node.params if p.present]
    if isinstance(statement, Do) and called_name(value) in ACCUMULATORS:
        return [p for p in node.params if p.name in kwargs]
    return []


def _new_grads(params: list, node: Node, heap: _Heap, first_grad: set[str]) -> int:
    """Make the ``.grad`` of each trainable one of ``params`` that has none yet (a tied
    parameter has one ``.grad``); its bytes."""
    added = 0
    for param in params:
        key = node.ties.get(param.name, param.key)
        if param.trainable and key not in first_grad:
            first_grad.add(key)
            heap.bind(f".grad:{key}", heap.new(param.nbytes()))
            added += param.nbytes()
    return added


UPDATE_CALL = "K.update_params"
UPDATE_BUFFERS = 2
"""Parameter-sized buffers an optimizer's update holds while it runs, of the largest
parameter it updates: AdamW's single-tensor step (the CPU default) makes two for its
denominator, one parameter at a time (measured: a step of three 512 x 512 layers); plain
SGD makes none, SGD with momentum or weight decay one, Adam with weight decay three, and a
``foreach`` step (the CUDA default) these for all the parameters of the call at once."""


def _updated(call: CallExpr, heap: _Heap, first_grad: set[str]) -> tuple[int, int]:
    """``K.update_params(L, names)``: each named ``.grad`` freed (minus its bytes from the
    parameter gradients held) and its name forgotten, so that a later step's first
    gradient makes it again; while the update runs, those gradients (freed after the
    optimizer's step) and its buffers."""
    freed = largest = 0
    names = call.args[1].items if isinstance(call.args[1], TupleExpr) else ()
    for name in names:
        key = name.name
        storage = heap.storage_of.get(f".grad:{key}")
        if storage is None:
            continue
        size = heap.size[storage]
        largest = max(largest, size)
        heap.unbind(f".grad:{key}")
        first_grad.discard(key)
        freed += size
    return -freed, freed + UPDATE_BUFFERS * largest


def _transient_of(
    statement: Assign, step: Step, node: Node | None, sizes: _Sizes, func: str, targets: list
) -> int:
    """Working memory of a codec call or a kernel (registry ``workspace``)."""
    if func.endswith((".compress", ".decompress")) and targets:
        key = sizes.key_of.get(targets[0], ("",))
        if key[0] == "value" and key[1] in sizes.stashed:  # a segment's input, restored
            stashed = sizes.stashed[key[1]]
            found = sizes.value_forms[key[1]]
            if found is None or found.kind == "raw":
                return 0
            form = found
        elif key[0] not in ("packed", "restored"):
            return 0
        else:
            stashed, form = sizes.forms[(key[1], key[3])]
        t = form.type or stashed.type
        dtype = "bool" if form.kind == "mask" else t.dtype
        sample = tuple(d for d in t.shape[1:])
        nbytes = t.numel(sizes.batch) * DTYPE_BYTES[dtype]
        ratios = codec_transients(form.codec, sample, dtype)
        if func.endswith(".compress"):
            mask = nbytes if form.kind == "mask" and form.mask_kernel else 0
            return mask + int(ratios[0] * nbytes)
        return int(ratios[1] * nbytes)
    if node is None or not node.inputs:
        return 0
    kwargs = dict(statement.value.kwargs) if isinstance(statement.value, CallExpr) else {}
    if step.section == "backward" and func.endswith("_backward"):
        piece = _piece(statement, node, sizes)
        args = _var_args(statement.value) if isinstance(statement.value, CallExpr) else []
        packed = len(args) > 1 and args[1] in sizes.in_pieces  # x restored by the kernel
        if _consumed_arg(statement.value, node, kwargs) is not None:
            phases: tuple[Workspace, ...] = ()  # worked out in the consumed extra's storage
            piece = 1.0
        elif piece < 1.0 and node.op.workspace.pieces is not None:
            phases = (node.op.workspace.pieces,)
        else:
            phases, piece = node.op.workspace.backward, 1.0
        found = max((_workspace(w, node, sizes, piece) for w in phases), default=0)
        if "add_into" in kwargs and piece >= 1.0:  # whole: the gradient, then added
            found += sizes.tensor(node.inputs[0].type)
        if node.op.workspace.contiguous_grad and _gradient_reordered(node):
            found += sizes.tensor(node.output.type)
        if packed:
            restored = min((w.restored for w in phases), default=1.0)
            found += _restore_transient(args[1], sizes, piece, restored)
        return found
    if step.section in ("forward", RECOMPUTE_SECTION) and func.endswith(f".{node.op.name}"):
        phases = node.op.workspace.forward
        found = max((_workspace(w, node, sizes) for w in phases), default=0)
        inner = _classes_innermost(node.inputs[0])
        if node.op.workspace.contiguous_input and _reordered(node.inputs[0]) and not inner:
            found += sizes.tensor(node.inputs[0].type)
        return found
    return 0


def _reordered(value: Any) -> bool:
    """Is the tensor a view with its dims reordered (a permute's or transpose's output)?"""
    return value.producer is not None and value.producer.op.reorders


def _classes_innermost(value: Any) -> bool:
    """Is the value a permute of a tensor made in place of its own (an op's output, not a
    view) that brings that tensor's last dim to dim 1, the classes of a token head's
    [N, L, C] seen as [N, C, L]? cross_entropy then keeps the layout (no copy), and its
    gradient, made in the log-probabilities' storage, permutes back contiguous."""
    producer = value.producer
    if producer is None or producer.op.name != "permute" or not producer.inputs:
        return False
    source = producer.inputs[0].producer
    dims = tuple(producer.args.get("dims", ()))
    moved = dims[:1] + dims[2:] + dims[1:2]  # dim 1 back to the end: the source's order?
    return (
        source is not None
        and not source.op.view
        and len(dims) > 2
        and moved == tuple(range(len(dims)))
    )


def _gradient_reordered(node: Node) -> bool:
    """Does the node's output gradient arrive as a reordered view: the output's one reader
    a permute or transpose, whose backward hands back its own gradient permuted? Not when
    it comes back contiguous: from a cross entropy over the classes-innermost permute,
    which makes the logits' gradient in that layout."""
    readers = node.output.consumers
    if len(readers) != 1 or not readers[0][0].op.reorders:
        return False
    view = readers[0][0].output
    losses = [n for n, _ in view.consumers]
    kept_layout = (
        len(losses) == 1 and losses[0].op.name == "cross_entropy" and _classes_innermost(view)
    )
    return not kept_layout


def _piece(statement: Assign, node: Node, sizes: _Sizes) -> float:
    """The batch fraction one call of a backward kernel handles: that of a piece when it is
    called with ``piece_bytes`` and splits the batch (``piece_samples``), else 1."""
    kwargs = dict(statement.value.kwargs) if isinstance(statement.value, CallExpr) else {}
    if "piece_bytes" not in kwargs or sizes.batch < 2 or not node.inputs:
        return 1.0
    sample = max(
        sizes.tensor(node.inputs[0].type) // sizes.batch,
        sizes.tensor(node.output.type) // sizes.batch,
    )
    weight = next((p.nbytes() for p in node.params if p.name == "weight"), 0)
    step = piece_samples(sizes.batch, sample, int(kwargs["piece_bytes"].value), weight)
    return step / sizes.batch if step < sizes.batch else 1.0


def _restore_transient(name: str, sizes: _Sizes, piece: float, restored: float) -> int:
    """What a kernel holds while it decompresses a piece of an input it was handed packed
    (``RestoredInPieces``): the piece itself (``restored`` times its bytes: none where the
    kernel's own workspace is that piece) and the codec's transient."""
    key = sizes.key_of[name]
    stashed, form = sizes.forms[(key[1], key[3])]
    t = form.type or stashed.type
    nbytes = piece * t.numel(sizes.batch) * DTYPE_BYTES[t.dtype]
    ratio = codec_transients(form.codec, tuple(t.shape[1:]), t.dtype)[1]
    return int((restored + ratio) * nbytes)


def _overwritten_storage(
    statement: Assign, step: Step, node: Node | None, heap: _Heap, sizes: _Sizes, func: str
) -> int | None:
    """Where a backward kernel writes its first input gradient when that is no new tensor:
    the total it adds into (``add_into``, registry ``backward_add_into``), or the output
    gradient with ``in_place`` (registry ``backward_in_place``): always for a kernel that
    does not run in pieces (relu), only when it splits the batch for one that does (batch
    norm and convolutions run whole with aten's kernels, into a new tensor); or the saved
    extra it consumes (``consume``, registry ``backward_consumes``: cross entropy's
    log_probs)."""
    if node is None or step.section != "backward" or not func.endswith("_backward"):
        return None
    kwargs = dict(statement.value.kwargs) if isinstance(statement.value, CallExpr) else {}
    into = kwargs.get("add_into")
    if isinstance(into, Var):
        return heap.storage_of.get(into.name)
    consumed = _consumed_arg(statement.value, node, kwargs)
    if consumed is not None:  # from now on the gradient's, no longer stash
        storage = heap.storage_of.get(consumed)
        if storage is not None:
            heap.unmark_stash(storage)
        return storage
    if "in_place" not in kwargs or not kwargs["in_place"].value:
        return None
    if node.op.backward_pieces and _piece(statement, node, sizes) >= 1.0:
        return None
    args = _var_args(statement.value)
    return heap.storage_of.get(args[0]) if args else None


def _consumed_arg(call: Any, node: Node, kwargs: dict) -> str | None:
    """The variable a backward kernel called with ``consume`` writes its first input's
    gradient into: its first saved entry named in ``backward_consumes`` (the call's
    arguments are the output gradient, then one per saved entry)."""
    flag = kwargs.get("consume")
    if not isinstance(call, CallExpr) or not isinstance(flag, Const) or not flag.value:
        return None
    for position, arg in enumerate(node.saved):
        if arg.entry in node.op.backward_consumes:
            found = call.args[1 + position]
            return found.name if isinstance(found, Var) else None
    return None


def _workspace(work: Workspace, node: Node, sizes: _Sizes, piece: float = 1.0) -> int:
    """Bytes of one kernel's working memory; ``piece``: the batch fraction it runs on."""
    weight = next((p.nbytes() for p in node.params if p.name == "weight"), 0)
    extra = 0
    if work.extra is not None:
        name, factor = work.extra
        found = next((e for e in node.extras if e.name == name), None)
        extra = int(factor * sizes.tensor(found.type)) if found is not None else 0
    tiles = work.tiles * _score_tile(node, sizes) if work.tiles else 0.0
    return int(
        sizes.kernel_scale
        * (
            piece * work.input * sizes.tensor(node.inputs[0].type)
            + piece * work.output * sizes.tensor(node.output.type)
            + work.weight * weight
            + work.fixed
            + extra
            + tiles
        )
    )


def _score_tile(node: Node, sizes: _Sizes) -> int:
    """Bytes of the largest score tile an attention node's kernels hold at this batch: the
    blocks of ``unroller.runtime.attention``, from q [N, H, L, E] and k [N, H, S, E] (the
    inputs of scaled_dot_product_attention, the extras of multihead_attention)."""
    types = {e.name: e.type for e in node.extras}
    types.update(zip(node.input_names, (v.type for v in node.inputs)))
    q, k = types["q"], types["k"]
    _, heads, length, _ = q.shape
    return largest_tile(
        sizes.batch,
        int(heads),
        int(length),
        int(k.shape[2]),
        DTYPE_BYTES[q.dtype],
        bool(node.args.get("is_causal", False)),
    )


def _aliased_storage(
    statement: Assign, step: Step, node: Node | None, heap: _Heap, func: str
) -> int | None:
    """The storage the statement's outputs share, for views (None: they allocate)."""
    if isinstance(statement.value, Var):  # another name for a tensor (written over in place)
        return heap.storage_of.get(statement.value.name)
    if func == "K.restore_in_pieces":  # handed over packed: holds the packed form
        packed = _var_args(statement.value)
        return heap.storage_of.get(packed[0]) if packed else None
    if node is None or not isinstance(statement.value, CallExpr):
        return None
    args = _var_args(statement.value)
    if node.op.view and not func.endswith("_backward"):  # a forward or recompute step
        base = heap.storage_of.get(args[0]) if args else None
        return base if base is not None else heap.new(0)
    if step.section == "backward" and node.op.grad_aliases and func.endswith("_backward"):
        return heap.storage_of.get(args[0]) if args else None
    return None
