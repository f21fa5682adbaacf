"""The stash plan: in what form each tensor saved for backward is kept.

For every backward step and every runtime tensor it reads, the reader asks for one
form: ``raw``; ``mask`` (a lossless 1-bit mask, where the registry says the backward
only needs one); or a compressor chosen by the compression config (for activations).
Per tensor, the forms of all its readers are merged: if any reader needs it raw, it
is kept raw and every reader reads the raw tensor (compressing it too would only cost
memory and accuracy); otherwise each distinct mask and compressor form is stored
once, however many readers share it.

Every tensor kept raw carries the reason (``Stashed.why``), which ``unroll graph``'s stash
table prints: not an activation, a codec that does not fit the tensor (dct needs a 4-D map
[N, C, H, W]; a token tensor [N, L, E] stays raw under the dct schemes, by design: those
schemes are about image maps, and a config file can add quant rules for the rest), the
scheme compresses nothing, dct-first's one tensor was another.

Where the registry offers a few-bit derivative code for an activation's input
(``derivative``) and the config turns ``derivatives`` on (the quant scheme), that input is
kept as the code (``fewbit``) instead of the scheme's codec: 3 bits instead of 8.

Segment recompute (``recompute_segments`` in the config): a top-level block instance
chosen as a segment keeps only its inputs from the forward pass (each in its value form:
the scheme's codec for it, or raw), and its own stash (``Stashed.segment``) is made again
when its backward begins, by its forward statements re-run from those inputs
(``plan_segments``). Selective segment recompute (``segment_keep``): the statements it names
inside a segment (the matrix products, say) are not run again; the forward keeps what they
make in the scheme's forms, and the recompute starts from that as from an input, remaking
only the cheap statements between them (layer norms, activations, residual sums).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from unroller.analysis.flops import forward_flops
from unroller.analysis.report import SavedTensor, saved_tensors
from unroller.compiler.dtypes import DTYPE_BYTES, is_float, torch_dtype
from unroller.compiler.graph import BlockCall, Graph, Node, Value
from unroller.compiler.registry import eval_expr
from unroller.compiler.schemes import MAP, ROWS, Codec, CompressionConfig, make_codec
from unroller.compiler.shapes import TensorType
from unroller.errors import ModelError

BITS = Codec("bits")
MAX_RECOMPUTE_OPS = 6
"""The most ops the backward runs to remake one kept tensor (``plan_recompute``): a chain
like a U-Net's concat(upsample(relu(bn(c))), relu(bn(s))) is 6."""


@dataclass(frozen=True)
class Form:
    """One stored form of a saved tensor."""

    kind: str  # "raw", "mask" or "codec"
    codec: Codec | None = None  # the compressor (bits for masks)
    mask_kernel: str | None = None  # turns the tensor into the bool mask
    mask_node: str | None = None  # whose backward arguments the mask kernel takes
    type: TensorType | None = None  # the logical tensor stored (the mask's shape for masks)
    why: str = field(default="", compare=False, repr=False)  # raw: why it is not compressed

    def label(self) -> str:
        if self.kind in ("raw", "recompute"):
            return self.kind
        if self.kind == "mask":
            return "bits"
        assert self.codec is not None
        return self.codec.label()


@dataclass
class Stashed:
    """A runtime tensor read by one or more backward steps."""

    key: str  # value name, or "node:extra"
    type: TensorType
    producer: int  # index of the node whose forward step makes it (-1: a model input)
    readers: list[tuple[Node, SavedTensor, Form]] = field(default_factory=list)
    forms: list[Form] = field(default_factory=list)
    layout: str = MAP  # MAP or ROWS (what a 4-D tensor is; see layout_of)
    why: str = ""  # kept raw: the reason, for the stash table
    #: segment recompute: the segment whose recompute makes it (None: the forward does)
    segment: str | None = None
    #: segment recompute: forms the forward keeps all the same (1-bit masks under a lossy
    #: scheme: exact, where one remade from a restored input would flip near zero)
    segment_keeps: list[Form] = field(default_factory=list)
    #: segment recompute: the segments that read it as an input of their recompute
    segment_readers: list[str] = field(default_factory=list)

    def raw_bytes(self, batch: int) -> int:
        return self.type.numel(batch) * DTYPE_BYTES[self.type.dtype]

    def stored_bytes(self, batch: int) -> int:
        total = 0
        for form in self.forms:
            if form.kind == "recompute":
                continue  # remade in the backward: nothing is kept
            if form.kind == "raw":
                total += self.raw_bytes(batch)
            else:
                t = form.type or self.type
                shape = tuple(batch if d == "N" else d for d in t.shape)
                dtype = "bool" if form.kind == "mask" else t.dtype
                total += form.codec.instance().stored_bytes(shape, torch_dtype(dtype))
        return total


@dataclass
class Segment:
    """A top-level block instance whose forward runs again when its backward begins."""

    call: BlockCall
    nodes: list[Node]  # its statements, in order (contiguous in the graph)
    inputs: list[str]  # values from outside it that its recompute reads (kept for it)
    internal: list[str] = field(default_factory=list)  # stash keys only its recompute makes
    #: its recompute and backward run in this many pieces of the batch (``plan_pieces``)
    pieces: int = 1
    #: or, when not 0, in pieces of at most this many samples: the working set is then the
    #: same at every batch size, so it drops out of the bytes each extra sample costs
    piece_size: int = 0
    #: names of its statements the recompute does not run again (``segment_keep``): the
    #: forward keeps their outputs and saved extras, and the recompute starts from them
    kept: list[str] = field(default_factory=list)

    @property
    def in_pieces(self) -> bool:
        return self.pieces > 1 or self.piece_size > 0

    def pieces_text(self) -> str:
        """How the batch is split, for comments and tables: "8 pieces of the batch" or
        "pieces of 4 samples"."""
        if self.piece_size:
            return f"pieces of {self.piece_size} sample{'s' if self.piece_size > 1 else ''}"
        return f"{self.pieces} pieces of the batch"

    @property
    def name(self) -> str:
        return self.call.name


@dataclass
class StashPlan:
    entries: list[Stashed]
    config: CompressionConfig
    segments: list[Segment] = field(default_factory=list)  # recomputed, in graph order
    #: block instances the config's segment patterns matched but that cannot be recomputed,
    #: with the reason (for the stash table's notes)
    skipped_segments: dict[str, str] = field(default_factory=dict)
    #: recomputed segments asked to run in pieces that cannot, with the reason
    unpieced_segments: dict[str, str] = field(default_factory=dict)

    def by_key(self) -> dict[str, Stashed]:
        return {e.key: e for e in self.entries}

    def reads_of(self, node: Node) -> list[tuple[Stashed, str, Form]]:
        """(stashed, saved entry, form) for each saved tensor ``node`` reads, in plan order.

        Indexed once, so that emitting a model of n statements stays linear in n.
        """
        index = self.__dict__.get("_reads")
        if index is None:
            index = {}
            for stashed in self.entries:
                for reader, saved, form in stashed.readers:
                    index.setdefault(id(reader), []).append((stashed, saved.entry, form))
            self.__dict__["_reads"] = index
        return index.get(id(node), [])

    def form_for(self, node: Node, entry: str) -> tuple[Stashed, Form] | None:
        for stashed, saved_entry, form in self.reads_of(node):
            if saved_entry == entry:
                return stashed, form
        return None

    def codecs(self) -> list[Codec]:
        found: list[Codec] = []
        for stashed in self.entries:
            for form in stashed.forms:
                if form.codec is not None and form.codec not in found:
                    found.append(form.codec)
        return found

    def report(self, batch: int) -> dict:
        rows = [
            {
                "tensor": s.key,
                "readers": [n.name for n, _, _ in s.readers]
                + [f"{name} (recompute)" for name in s.segment_readers],
                "compressor": "+".join(f.label() for f in s.forms),
                "shape": [batch if d == "N" else d for d in s.type.shape],
                "raw_bytes": s.raw_bytes(batch),
                "stored_bytes": s.stored_bytes(batch),
                "why": s.why,
            }
            for s in self.entries
        ]
        return {
            "rows": rows,
            "total_raw_bytes": sum(r["raw_bytes"] for r in rows),
            "total_stored_bytes": sum(r["stored_bytes"] for r in rows),
        }


ELEMENTWISE_KINDS = ("activation", "arith", "regularizer")
"""Op kinds whose output is laid out like their inputs (a GELU of attention rows is rows)."""


def rows_values(graph: Graph) -> set[str]:
    """Names of the values laid out as rows along the last dim: outputs of ops that declare
    ``layout = "rows"`` in the registry (softmax, matmul, attention), and, passed on through
    elementwise ops (activations, arithmetic, dropout), what those make of them."""
    found: set[str] = set()
    for node in graph.nodes:
        if node.op.layout == ROWS or (
            node.op.kind in ELEMENTWISE_KINDS and any(v.name in found for v in node.inputs)
        ):
            found.add(node.output.name)
    return found


def layout_of(value_name: str, rows: set[str], readers: list[Node]) -> str:
    """ROWS when the value is rows (``rows_values``) or an op that saves it declares
    ``layout = "rows"`` (it reads its last dim as rows: q, k, v heads of an attention),
    else MAP (a 4-D tensor is an image map [N, C, H, W] by default)."""
    if value_name in rows or any(n.op.layout == ROWS for n in readers):
        return ROWS
    return MAP


def _reader_form(
    node: Node, saved: SavedTensor, config: CompressionConfig, layout: str = MAP
) -> Form:
    mask = node.op.masks.get(saved.entry)
    if config.masks and mask is not None:
        env = {**node.args, **node.derived}
        if mask.when is None or eval_expr(mask.when, env):
            like = saved.type
            if mask.like is not None:
                names = node.input_names
                like = node.inputs[names.index(mask.like)].type
            return Form("mask", BITS, mask.kernel, node.name, TensorType("bool", like.shape))
    if not saved.activation and saved.entry in node.op.activations:
        return Form("raw", why="a model input: the caller holds it anyway")
    if not saved.activation:
        return Form("raw", why=f"{node.name}'s backward needs {saved.entry} exactly")
    if not is_float(saved.type.dtype):
        return Form("raw", why=f"not a float tensor ({saved.type.dtype})")
    derivative = node.op.derivative.get(saved.entry)
    if derivative is not None and config.derivatives:
        params = {"function": derivative.function, "bits": derivative.bits}
        return Form("codec", make_codec("fewbit", params))
    codec, why = config.choose_why(node.op.name, node.name, saved.type.shape, layout, saved.key)
    if codec is not None:
        return Form("codec", codec)
    return Form("raw", why=why)


def plan_stash(
    graph: Graph, config: CompressionConfig, pieces: int = 1, piece_size: int = 0
) -> StashPlan:
    """Decide the stored forms of every tensor saved for backward (``pieces``: the
    recomputed segments' recompute and backward run in that many pieces of the batch
    where they can, ``plan_pieces``; ``piece_size``: in pieces of at most that many
    samples instead)."""
    if pieces == 1 and not piece_size:  # the config's, unless the options say otherwise
        piece_size = config.segment_piece_size
    producers = {v.name: -1 for v in graph.inputs}
    for node in graph.nodes:
        producers[node.output.name] = node.index
    entries: dict[str, Stashed] = {}
    found: dict[str, list[tuple[Node, SavedTensor]]] = {}
    rows = rows_values(graph)
    for node in graph.nodes:
        for saved in saved_tensors(node):
            found.setdefault(saved.key, []).append((node, saved))
    for key, reads in found.items():
        value_name = key.split(":")[0]
        stashed = Stashed(key, reads[0][1].type, producers[value_name])
        stashed.layout = layout_of(value_name, rows, [n for n, _ in reads])
        stashed.readers = [(n, s, _reader_form(n, s, config, stashed.layout)) for n, s in reads]
        entries[key] = stashed
    ordered = sorted(entries.values(), key=lambda s: s.producer)  # stable: first reads first
    if config.first_only:
        _keep_first_compressed(ordered)
    for stashed in ordered:
        forms = [form for _, _, form in stashed.readers]
        if any(f.kind == "raw" for f in forms):
            stashed.why = _raw_reason(stashed)
            stashed.readers = [(n, s, Form("raw")) for n, s, _ in stashed.readers]
            stashed.forms = [Form("raw")]
        else:
            stashed.forms = list(dict.fromkeys(forms))
    segments: list[Segment] = []
    skipped: dict[str, str] = {}
    if config.segments:
        segments, skipped = plan_segments(graph, ordered, config, rows)
        ordered.sort(key=lambda s: s.producer)  # stable: inputs kept for a segment join
    split = pieces > 1 or piece_size > 0
    unpieced = plan_pieces(graph, ordered, segments, pieces, piece_size) if split else {}
    if config.recompute:
        plan_recompute(graph, ordered, segments, config.recompute_keep)
    return StashPlan(ordered, config, segments, skipped, unpieced)


RECOMPUTE = Form("recompute")


def value_form(stashed: Stashed) -> Form | None:
    """The kept form that is the tensor itself (raw, or an activation compressor's), from
    which the backward can remake what is computed from it; None when only a mask or a
    derivative code is kept."""
    for form in stashed.forms:
        if form.kind == "raw" or _is_value_codec(form):
            return form
    return None


def _is_value_codec(form: Form) -> bool:
    """An activation compressor's form (decompresses to the tensor itself)."""
    return form.kind == "codec" and form.type is None and form.codec.name != "fewbit"


def always_there(producers: dict[str, Node | None], name: str) -> bool:
    """Values the backward can read without keeping anything: the model's inputs (the
    caller holds them) and free parameters (views of the weights). ``producers``: each
    value's node, None for the model's inputs (``value_producers``)."""
    node = producers.get(name, False)
    return node is None or (node is not False and node.op.view and not node.inputs)


def value_producers(graph: Graph) -> dict[str, Node | None]:
    """Every value's producing node by name; None for the model's inputs."""
    found: dict[str, Node | None] = {v.name: None for v in graph.inputs}
    found.update({n.output.name: n for n in graph.nodes})
    return found


def plan_recompute(
    graph: Graph,
    ordered: list[Stashed],
    segments: list[Segment] = (),
    keep: tuple[str, ...] = (),
) -> None:
    """Remake in the backward, instead of keeping, every saved tensor that a short chain of
    cheap ops (registry ``recompute``: activations, pooling, resampling, concatenation, batch
    norm with its batch statistics) makes from tensors kept anyway.

    In topological order, a tensor whose readers all read it as an activation (raw or
    compressed) is remade when every input of its producer is kept (in a form that is the
    tensor itself: not a mask or a derivative code), always there, or itself remade, with at
    most ``MAX_RECOMPUTE_OPS`` ops in all. Nothing new is kept for it: what it is remade from
    is what other backward steps read already, so the stash only shrinks. Masks stay: a relu
    mask is 1 bit and exact, so it is not remade from a compressed input. Under a
    compressor the remade tensor is computed from the restored inputs: its error is theirs,
    passed through the op (relu(bn(c~)) for conv2's input instead of dct(relu(bn(c)))~).

    With recomputed ``segments``, what a segment's recompute makes (``Stashed.segment``) is
    left to it, and the inputs kept for a segment stay kept; a chain never reads a value
    made inside a segment unless the forward keeps it (the recompute comes after every
    reader outside the segment).

    ``keep``: globs on saved tensor names that stay kept as the scheme says (the config's
    ``recompute_keep``: where remaking would raise the step's peak).
    """
    by_key = {s.key: s for s in ordered}
    producers = value_producers(graph)
    ops: dict[str, int | None] = {}  # decided tensors: ops to remake (0: kept or there)
    inside = {n.output.name for segment in segments for n in segment.nodes}
    kept_for_segments = {name for segment in segments for name in segment.inputs}

    def ops_to_make(name: str) -> int | None:
        if name in ops:
            return ops[name]
        stashed = by_key.get(name)
        if name in inside and (
            stashed is None or stashed.segment is not None or value_form(stashed) is None
        ):
            return None  # only a segment's recompute makes it
        if always_there(producers, name) or (stashed is not None and value_form(stashed)):
            return 0
        return chain(name)

    def chain(name: str) -> int | None:
        node = producers.get(name)
        if node is None or node.op.recompute is None or not node.inputs:
            return None
        total = 1
        for value in node.inputs:
            found = ops_to_make(value.name)
            if found is None:
                return None
            total += found
        return total if total <= MAX_RECOMPUTE_OPS else None

    for stashed in ordered:
        if ":" in stashed.key or stashed.producer < 0:
            continue
        if stashed.segment is not None or stashed.key in kept_for_segments:
            continue
        if any(fnmatch.fnmatchcase(stashed.key, pattern) for pattern in keep):
            ops[stashed.key] = 0
            continue
        value_forms = [f for f in stashed.forms if f.kind == "raw" or _is_value_codec(f)]
        reads_value = [r for r in stashed.readers if r[2] in value_forms]
        if not value_forms or not all(saved.activation for _, saved, _ in reads_value):
            continue
        count = chain(stashed.key)
        if count is None:
            ops[stashed.key] = 0
            continue
        ops[stashed.key] = count
        stashed.readers = [
            (n, saved, RECOMPUTE if form in value_forms else form)
            for n, saved, form in stashed.readers
        ]
        stashed.forms = [f for f in stashed.forms if f not in value_forms] + [RECOMPUTE]
        stashed.why = f"remade in the backward from kept tensors ({count} op{'s' * (count > 1)})"


SEGMENT_KEEP_MATMULS = "matmuls"
"""``segment_keep`` pattern: every statement of a segment that is a matrix product."""
MATMUL_FLOPS = 32
"""A statement is a matrix product (``segment_keep = "matmuls"``) when its forward costs at
least this many FLOPs per output element (``flops.forward_flops``): a linear layer or
convolution with 16 or more inputs per output, attention. Norms, activations and sums cost
a handful: those are what a selective recompute remakes."""


def kept_statement(node: Node, patterns: tuple[str, ...]) -> bool:
    """Does ``segment_keep`` (``patterns``) keep ``node`` inside a recomputed segment?"""
    for pattern in patterns:
        if pattern == SEGMENT_KEEP_MATMULS:
            out = node.output.type.numel(1)
            if out and forward_flops(node, 1) >= MATMUL_FLOPS * out:
                return True
        elif fnmatch.fnmatchcase(node.name, pattern):
            return True
    return False


SEGMENT_BLOCKS = "blocks"
"""``recompute_segments`` pattern: every top-level block instance that can be recomputed."""
SEGMENT_AUTO = "auto"
"""``recompute_segments`` pattern for the planner (``--scheme auto``, ``unroll plan``): it
chooses the instances and writes their names into the config it makes."""


def block_instances(graph: Graph) -> list[tuple[BlockCall, list[Node]]]:
    """The top-level block instances with their statements, in graph order."""
    found: dict[str, tuple[BlockCall, list[Node]]] = {}
    for node in graph.nodes:
        if node.blocks:
            found.setdefault(node.blocks[0].name, (node.blocks[0], []))[1].append(node)
    return list(found.values())


def draws_random(node: Node) -> bool:
    """Does the node's forward draw random numbers (dropout with 0 < p < 1: its registry kind
    is ``regularizer`` and it makes a mask)? Running it again would draw other ones."""
    return node.op.kind == "regularizer" and any(e.present for e in node.extras)


def changes_state(node: Node) -> bool:
    """Does the node's training forward update buffers (batch norm's running statistics)?
    A segment's recompute calls its registry ``recompute`` kernel instead, which leaves them
    alone and makes the output only."""
    return any(b.present for b in node.buffers)


def segment_problem(graph: Graph, nodes: list[Node]) -> str:
    """Why a block instance cannot be recomputed as a segment; "" when it can.

    Only deterministic, state-free re-runs give the forward's tensors again: a random op
    (dropout) would draw new masks (keeping its mask and replaying it is not built), and an
    op that updates buffers must have a registry ``recompute`` kernel that leaves them alone
    (batch norm's does)."""
    first = nodes[0].index
    if [n.index for n in nodes] != list(range(first, first + len(nodes))):
        return "its statements are not consecutive in the model"
    if not any(n.needs_backward for n in nodes):
        return "none of its statements has a backward step"
    for node in nodes:
        if node.output is graph.loss:
            return f"it makes the loss ({node.name})"
        if draws_random(node):
            return (
                f"{node.name} is {node.op.name}, which draws random numbers (a recompute "
                "would draw new ones)"
            )
        if changes_state(node) and (
            node.op.recompute is None or node.op.recompute.kernel == node.op.name
        ):
            return (
                f"{node.name} ({node.op.name}) updates its buffers and has no recompute kernel "
                "that leaves them alone"
            )
    return ""


def chosen_instances(
    graph: Graph, patterns: tuple[str, ...]
) -> tuple[list[tuple[BlockCall, list[Node]]], dict[str, str]]:
    """The block instances ``patterns`` pick (``blocks``: all; else globs on instance
    names), in graph order, and those they match that cannot be recomputed, with why.

    A pattern matching nothing, and an instance named exactly that cannot be recomputed,
    are errors: a config that names a segment expects it to be one."""
    instances = block_instances(graph)
    chosen: set[str] = set()
    skipped: dict[str, str] = {}
    for pattern in patterns:
        if pattern == SEGMENT_AUTO:
            raise ModelError(
                "recompute_segments 'auto' is the planner's choice: use --scheme auto or "
                "unroll plan, or name the block instances"
            )
        if pattern == SEGMENT_BLOCKS:
            matched = instances
        else:
            matched = [(c, n) for c, n in instances if fnmatch.fnmatchcase(c.name, pattern)]
            if not matched:
                names = [c.name for c, _ in instances]
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ModelError(
                    f"recompute segment '{pattern}' matches no block instance "
                    f"({'the model has none' if not names else 'the model has ' + shown})"
                )
        for call, nodes in matched:
            why = segment_problem(graph, nodes)
            if why and pattern == call.name:
                raise ModelError(f"block instance '{call.name}' cannot be recomputed: {why}")
            if why:
                skipped[call.name] = why
            else:
                chosen.add(call.name)
    picked = [(c, n) for c, n in instances if c.name in chosen]
    return picked, {k: v for k, v in skipped.items() if k not in chosen}


def plan_segments(
    graph: Graph, ordered: list[Stashed], config: CompressionConfig, rows: set[str]
) -> tuple[list[Segment], dict[str, str]]:
    """Segment recompute: for every block instance the config's ``segments`` pick, which
    saved tensors only its recompute makes, and what the forward keeps for it.

    A saved tensor is the segment's own (made again, not kept by the forward) when a
    statement of the segment makes it and only the segment's backward steps read it; an
    extra output of an op whose recompute kernel makes only the output (batch norm's
    statistics) stays kept by the forward. Under a lossy scheme 1-bit masks stay kept by
    the forward too (``Stashed.segment_keeps``): the recompute starts from a restored input,
    and a relu mask remade from it flips wherever the error crosses zero, each flip a whole
    gradient element (on resnet_like under 8-bit quant that made the gradient error 13x
    that of the scheme without segment recompute; with the forward's masks 1.24x).
    Everything else stays as it is: parameters, what the rest of the graph reads, and the
    segment's inputs, which the forward keeps in
    their value form (the one their readers already keep, or what the config chooses for
    them as an activation of the segment's first reader; raw if none applies), appended to
    ``ordered`` when nothing kept them before. Mutates ``ordered``'s entries."""
    picked, skipped = chosen_instances(graph, config.segments)
    producers = value_producers(graph)
    values = {v.name: v for v in graph.inputs} | {n.output.name: n.output for n in graph.nodes}
    segments: list[Segment] = []
    for call, nodes in picked:
        made = {n.output.name for n in nodes}
        inputs: list[str] = []
        for node in nodes:
            for value in node.inputs:
                name = value.name
                if name not in made and name not in inputs and not always_there(producers, name):
                    inputs.append(name)
        kept = [n.name for n in nodes if kept_statement(n, config.segment_keep)]
        segments.append(Segment(call, nodes, inputs, kept=kept))
    own = _own_stash(graph, ordered, segments, config)
    if any(not own[s.name] for s in segments):
        # a segment none of whose saved tensors is its own would re-run for nothing: drop
        # it, and what it needed kept may become another segment's own
        for segment in segments:
            if not own[segment.name]:
                skipped[segment.name] = "its backward reads nothing that only it makes"
        segments = [s for s in segments if own[s.name]]
        own = _own_stash(graph, ordered, segments, config)
    by_key = {s.key: s for s in ordered}
    for segment in segments:
        _kept_inputs(segment, [s.producer for s, _ in own[segment.name]])
        for stashed, keeps in own[segment.name]:
            stashed.segment = segment.name
            stashed.segment_keeps = keeps
            segment.internal.append(stashed.key)
            note = f"made again by {segment.name}'s recompute, kept during its backward only"
            if keeps:
                note += " (its 1-bit mask kept by the forward: exact)"
            stashed.why = f"{stashed.why}; {note}" if stashed.why else note
    for segment in segments:
        for name in segment.inputs:
            stashed = by_key.get(name)
            if stashed is None:
                node = producers[name]
                stashed = Stashed(name, values[name].type, node.index if node else -1)
                stashed.layout = layout_of(name, rows, [])
                ordered.append(stashed)
                by_key[name] = stashed
            if value_form(stashed) is None:
                reader = next(n for n in segment.nodes if any(v.name == name for v in n.inputs))
                form = _input_form(stashed, reader, config)
                if form.kind == "raw":  # one raw form serves every reader
                    stashed.readers = [(n, s, form) for n, s, _ in stashed.readers]
                    stashed.forms = [Form("raw")]
                    stashed.why = stashed.why or form.why
                else:
                    stashed.forms.append(form)
            stashed.segment_readers.append(segment.name)
    return segments, skipped


def _kept_inputs(segment: Segment, producers: list[int]) -> None:
    """Selective recompute: the outputs of the segment's kept statements that the statements
    it runs again read (``rerun_nodes`` stops at them) join its inputs, restored from what
    the forward keeps like any input. Mutates ``segment.inputs``."""
    if not segment.kept:
        return
    kept = set(segment.kept)
    made_by_kept = {n.output.name for n in segment.nodes if n.name in kept}
    for node in rerun_nodes(segment, producers):
        for value in node.inputs:
            if value.name in made_by_kept and value.name not in segment.inputs:
                segment.inputs.append(value.name)


def _own_stash(
    graph: Graph, ordered: list[Stashed], segments: list[Segment], config: CompressionConfig
) -> dict[str, list[tuple[Stashed, list[Form]]]]:
    """Per segment, the saved tensors only its recompute would make, each with the forms the
    forward keeps all the same (``plan_segments`` says which and why). What a kept statement
    (``segment_keep``) makes, its output and saved extras, the forward keeps."""
    segment_of = {n.index: segment for segment in segments for n in segment.nodes}
    needed = {name for segment in segments for name in segment.inputs}
    kept = {n.index for segment in segments for n in segment.nodes if n.name in segment.kept}
    found: dict[str, list[tuple[Stashed, list[Form]]]] = {s.name: [] for s in segments}
    for stashed in ordered:
        segment = segment_of.get(stashed.producer)
        if segment is None or stashed.key in needed or stashed.producer in kept:
            continue
        if not all(segment_of.get(n.index) is segment for n, _, _ in stashed.readers):
            continue
        if ":" in stashed.key and changes_state(graph.nodes[stashed.producer]):
            continue  # its recompute kernel makes the output only: the forward keeps these
        keeps = [f for f in stashed.forms if f.kind == "mask"] if config.lossy else []
        if len(keeps) == len(stashed.forms):
            continue  # only a mask, under a lossy scheme: the forward's exact one is kept
        found[segment.name].append((stashed, keeps))
    return found


def pieces_problem(graph: Graph, segment: Segment, ordered: list[Stashed]) -> str:
    """Why ``segment``'s recompute and backward cannot run in pieces of the batch; "" when
    they can.

    A piece must give the same result as the whole batch sliced: no op may couple the
    samples (registry ``batch_coupled``: batch norm's statistics), and every tensor the
    segment reads from outside or makes has the batch as its first dimension, so that a
    piece is a slice of it. What the forward keeps for the segment beside its inputs (1-bit
    masks under a lossy scheme) is packed for the whole batch and cannot be sliced."""
    producers = value_producers(graph)
    made = {n.output.name for n in segment.nodes}
    for node in segment.nodes:
        if node.op.batch_coupled:
            return f"{node.name} ({node.op.name}) couples the samples of the batch"
        values = [node.output] + [v for v in node.inputs if v.name not in made]
        for value in values:
            if not value.type.shape or value.type.shape[0] != "N":
                return f"{value.name} has no batch dimension first ({value.type})"
        if any(always_there(producers, v.name) and producers[v.name] for v in node.inputs):
            return f"{node.name} reads a free parameter made outside it"
    inside = {id(n) for n in segment.nodes}
    for stashed in ordered:
        if stashed.segment == segment.name:
            if stashed.segment_keeps:
                return f"the forward keeps {stashed.key} for it, packed for the whole batch"
            continue
        masked = any(f.kind == "mask" for f in stashed.forms)
        if masked and any(id(reader) in inside for reader, _, _ in stashed.readers):
            return f"it reads the 1-bit mask of {stashed.key}, packed for the whole batch"
    return ""


def plan_pieces(
    graph: Graph, ordered: list[Stashed], segments: list[Segment], pieces: int, piece_size: int = 0
) -> dict[str, str]:
    """Segment pieces: each recomputed segment that can (``pieces_problem``) runs its
    recompute and backward in ``pieces`` pieces of the batch, one piece at a time, so that
    their working set scales with a piece rather than the batch. Its own stash is then kept
    raw: a piece's stash is consumed by the piece's backward right away, and compressing it
    would only cost time (its bytes no longer grow with the batch). Returns the segments
    that stay whole, with why. Mutates the segments and ``ordered``'s entries."""
    unpieced: dict[str, str] = {}
    for segment in segments:
        why = pieces_problem(graph, segment, ordered)
        if why:
            unpieced[segment.name] = why
            continue
        segment.pieces, segment.piece_size = (1, piece_size) if piece_size else (pieces, 0)
        for stashed in ordered:
            if stashed.segment != segment.name:
                continue
            stashed.readers = [(n, s, Form("raw")) for n, s, _ in stashed.readers]
            stashed.forms = [Form("raw")]
            stashed.why = (
                f"made again by {segment.name}'s recompute in {segment.pieces_text()}, "
                "each consumed by the piece's backward right away (compressing it would "
                "only cost time)"
            )
    return unpieced


def rerun_nodes(segment: Segment, producers: list[int]) -> list[Node]:
    """The statements of ``segment`` that the nodes at ``producers`` (graph indices) depend
    on, themselves included, in order: what its recompute runs again. A kept statement
    (``Segment.kept``) is not run again: its output is restored instead."""
    kept = set(segment.kept)
    inside = {n.output.name: n for n in segment.nodes if n.name not in kept}
    wanted = set(producers)
    found: set[int] = set()
    stack = [n for n in segment.nodes if n.index in wanted]
    while stack:
        node = stack.pop()
        if node.index in found:
            continue
        found.add(node.index)
        stack += [inside[v.name] for v in node.inputs if v.name in inside]
    return [n for n in segment.nodes if n.index in found]


def _input_form(stashed: Stashed, reader: Node, config: CompressionConfig) -> Form:
    """The form the forward keeps a segment's input in, when no backward step keeps it as a
    value already: the config's codec for it as an activation of ``reader``, else raw."""
    if not is_float(stashed.type.dtype):
        return Form("raw", why=f"not a float tensor ({stashed.type.dtype})")
    if config.first_only:
        return Form("raw", why="dct-first compresses only the first activation")
    codec, why = config.choose_why(
        reader.op.name, reader.name, stashed.type.shape, stashed.layout, stashed.key
    )
    if codec is not None:
        return Form("codec", codec)
    return Form("raw", why=why)


def _raw_reason(stashed: Stashed) -> str:
    """Why a tensor is kept raw: the first raw reader's reason, naming that reader when
    another reader would have compressed it (one raw reader keeps it raw for all)."""
    raw = [(n, f) for n, _, f in stashed.readers if f.kind == "raw"]
    node, form = raw[0]
    why = form.why or "kept raw"
    if len(raw) < len(stashed.readers):
        return f"read raw by {node.name}: {why}"
    return why


def _keep_first_compressed(ordered: list[Stashed]) -> None:
    """dct-first: only the first tensor (topological order) keeps its compressor."""
    first = None
    for stashed in ordered:
        has_codec = any(f.kind == "codec" for _, _, f in stashed.readers)
        if has_codec and first is None:
            first = stashed.key
            continue
        why = f"dct-first compresses only the first activation ({first})"
        stashed.readers = [
            (n, s, Form("raw", why=why) if f.kind == "codec" else f) for n, s, f in stashed.readers
        ]


def wire_codec(
    graph: Graph, config: CompressionConfig, value: Value, readers: list[Node]
) -> Codec | None:
    """The codec a pipeline boundary value (and its gradient) travels in between processes:
    what the scheme's rules choose for it as the first of ``readers`` would keep it; None
    (raw) when none applies, for a tensor without a batch dimension (a free parameter,
    sent as it is once per micro-batch), and under dct-first, which compresses one tensor
    only."""
    if config.first_only or not value.type.dtype.startswith("f"):
        return None
    if not value.type.shape or value.type.shape[0] != "N":  # a weight (free parameter)
        return None
    layout = layout_of(value.name, rows_values(graph), readers)
    reader = readers[0]
    codec, _ = config.choose_why(reader.op.name, reader.name, value.type.shape, layout, value.name)
    return codec
