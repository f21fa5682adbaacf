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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unroller.dtypes import DTYPE_BYTES, is_float, torch_dtype
from unroller.graph import Graph, Node, Value
from unroller.registry import eval_expr
from unroller.report import SavedTensor, saved_tensors
from unroller.schemes import MAP, ROWS, Codec, CompressionConfig, make_codec
from unroller.shapes import TensorType

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
class StashPlan:
    entries: list[Stashed]
    config: CompressionConfig

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
                "readers": [n.name for n, _, _ in s.readers],
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
    tensor = saved.key.split(":")[0]
    codec, why = config.choose_why(node.op.name, node.name, saved.type.shape, layout, tensor)
    if codec is not None:
        return Form("codec", codec)
    return Form("raw", why=why)


def plan_stash(graph: Graph, config: CompressionConfig) -> StashPlan:
    """Decide the stored forms of every tensor saved for backward."""
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
    if config.recompute:
        plan_recompute(graph, ordered)
    return StashPlan(ordered, config)


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


def plan_recompute(graph: Graph, ordered: list[Stashed]) -> None:
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
    """
    by_key = {s.key: s for s in ordered}
    producers = value_producers(graph)
    ops: dict[str, int | None] = {}  # decided tensors: ops to remake (0: kept or there)

    def ops_to_make(name: str) -> int | None:
        if name in ops:
            return ops[name]
        stashed = by_key.get(name)
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
