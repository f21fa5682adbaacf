"""Reshapes that merge the batch with the dims after it and that a later reshape undoes.

A network may flatten ``[N, L, E]`` to rows ``[N*L, E]`` around a block that treats each
row alone (OPT's decoder layer before its MLP, many MLP blocks) and view the rows back
as ``[N, L, E']`` afterwards. The language keeps the batch first and whole, so such a
region is imported on the unmerged shapes: the merging reshape is an identity, every
op in between computes on ``[N, L, ...]`` the numbers it computed on the rows, and the
splitting reshape is an identity or a reshape of the dims after the batch.

That is exact only when no op mixes rows, so each region is proven, not assumed:
every node in it is one whose per-row independence is checked here (an op of the
whitelist below, with its dims away from the merged dim 0, reading only values of the
same region or tensors without a batch that broadcast along the rows, or, as baddbmm's
input, such a tensor repeated once per sample: BLOOM's ALiBi bias); no value leaves
the region except through a reshape whose output has the batch whole in front again.
Anything else leaves the merging reshape refused, with the reason (``refused``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from unroller.importer.aten_ops import schema_arguments
from unroller.importer.model import BATCH, shape_text

#: reshapes that may merge the batch in (entries) or split it back out (exits)
RESHAPES = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.flatten.using_ints",
}

#: reads of a tensor's sizes: no value flows through them
SIZES = {"aten.sym_size.int", "aten.sym_numel.default", "aten._assert_tensor_metadata.default"}

#: ops that compute each element from the same element of their inputs
ELEMENTWISE = {
    *(f"aten.{op}.default" for op in ("relu", "sigmoid", "tanh", "silu", "hardswish")),
    *(f"aten.{op}_.default" for op in ("relu", "sigmoid", "tanh", "silu", "hardswish")),
    *(f"aten.{op}.default" for op in ("hardsigmoid", "mish", "relu6", "neg", "softplus")),
    *(f"aten.{op}.default" for op in ("gelu", "gelu_", "hardtanh", "hardtanh_", "elu")),
    *(f"aten.{op}.default" for op in ("elu_", "leaky_relu", "leaky_relu_", "exp", "rsqrt")),
    *(f"aten.{op}.default" for op in ("sqrt", "log", "abs", "clone", "contiguous", "alias")),
    *(f"aten.{op}.{form}" for op in ("add", "sub", "mul", "div") for form in ("Tensor", "Scalar")),
    *(f"aten.{op}_.{form}" for op in ("add", "sub", "mul", "div") for form in ("Tensor", "Scalar")),
    "aten.pow.Tensor_Scalar",
    "aten.where.self",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy.default",
    # a random mask of the value's own shape: element for element the same draw
    "aten.dropout.default",
    "aten.dropout_.default",
}

#: ops that act on the last dims of each row (the dims they act on are checked)
LAST_DIMS = {
    "aten.linear.default",  # the last dim
    "aten.layer_norm.default",  # normalized_shape: trailing dims
    "aten.rms_norm.default",
    "aten.embedding.default",  # one row of the table per index
    "aten.softmax.int",
    "aten.log_softmax.int",
    "aten.mean.dim",
    "aten.sum.dim_IntList",
    "aten.matmul.default",
    "aten.bmm.default",  # both operands [rows, n, m]: the rows are its batch dim
    "aten.baddbmm.default",  # bmm plus its input, which must meet the rows row for row
}

#: ops that hand their input on unchanged but for its dtype or memory (a tile seen through)
CASTS = {"aten.to.dtype", "aten._to_copy.default", "aten.clone.default", "aten.contiguous.default"}

#: ops that multiply matrices: an operand from outside the rows must have no batch
_MATMULS = ("aten.matmul.default", "aten.bmm.default", "aten.baddbmm.default")

#: ops that move dims after the rows (the rows are checked to stay first)
MOVES = {"aten.transpose.int", "aten.permute.default", *RESHAPES}

#: the arguments that name dims, shifted by the dims the merge took in
DIM_KEYS = ("dim", "dim0", "dim1", "start_dim", "end_dim")


@dataclass
class Merged:
    """What ``find`` proved: the shapes with the batch unmerged, and what it refused."""

    #: a node of a region (its merging reshapes included) -> its shape, batch unmerged
    shapes: dict[fx.Node, tuple] = field(default_factory=dict)
    #: a node of a region -> how many dims after the batch the merge took in
    lead: dict[fx.Node, int] = field(default_factory=dict)
    #: a merging reshape that stays refused -> why
    refused: dict[fx.Node, str] = field(default_factory=dict)


def find(mapper, target_name) -> Merged:
    """Every merging reshape of the graph, proven row-wise up to its splits, or refused."""
    merged = Merged()
    done: set[fx.Node] = set()
    for node in mapper.nodes:
        if node in done or not _is_reshape(node, target_name):
            continue
        entry = _entry(mapper, node)
        if entry is None:
            continue
        prefix, reason = entry
        if reason is not None:
            merged.refused[node] = reason
            continue
        region, why = _grow(mapper, node, prefix, target_name)
        entries = {n for n in region if _is_reshape(n, target_name)}
        done |= entries
        if why is not None:
            for other in entries:
                if (_entry(mapper, other) or ((), ""))[0] == prefix:
                    merged.refused[other] = why  # each merge of these rows, one reason
            continue
        k = len(prefix) - 1
        for member in region:
            merged.shapes[member] = prefix + mapper.shape(member)[1:]
            merged.lead[member] = k
    return merged


def _is_reshape(node, target_name) -> bool:
    return node.op == "call_function" and target_name(node) in RESHAPES


def _entry(mapper, node) -> tuple[tuple, str | None] | None:
    """(the unmerged prefix ``(N, d1, ..., dk)``, None) for a reshape ``[N, d1, ..., dk,
    E...] -> [N*d1*...*dk, E...]``; (prefix, why not) for another reshape that merges the
    batch; None for a reshape that keeps it first and whole."""
    try:
        source = mapper.shape(node.args[0])
        out = mapper.shape(node)
    except Exception:  # noqa: BLE001 - not a tensor reshape: nothing to prove
        return None
    if not source or source[0] != BATCH or not out or out[0] == BATCH:
        return None
    if not isinstance(out[0], str):
        return None
    said = f"reshaping {shape_text(source)} to {shape_text(out)} merges the batch dim"
    batch = mapper.batch.node.expr
    merged = node.meta["val"].shape[0]
    for k in range(1, len(source)):
        dims = source[1 : k + 1]
        if any(not isinstance(d, int) for d in dims):
            break
        if tuple(out[1:]) != tuple(source[k + 1 :]):
            continue
        if isinstance(merged, torch.SymInt) and merged.node.expr == batch * math.prod(dims):
            return tuple(source[: k + 1]), None
    return (), (
        f"{said} and reshapes the dims after it too: only a merge of the batch with the "
        "dims right after it, the others kept, is imported"
    )


def _grow(mapper, entry, prefix, target_name) -> tuple[set, str | None]:
    """The region of rows from ``entry``: (its nodes, None), or (what was seen, why it is
    not row-wise)."""
    rows = mapper.dim(entry.meta["val"].shape[0])
    said = (
        f"reshaping {shape_text(mapper.shape(entry.args[0]))} to "
        f"{shape_text(mapper.shape(entry))} merges the batch dim"
    )
    window = ""
    source = entry.args[0]
    while target_name(source) in ("aten.clone.default", "aten.contiguous.default"):
        source = source.args[0]
    if len(prefix) > 2 and target_name(source) in ("aten.permute.default", "aten.transpose.int"):
        window = " (a window partition, as Swin's: windows of the image merged into the batch)"
    region = {entry}  # everything the rows reach before a reshape splits them back
    todo = [entry]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in region or (_is_reshape(user, target_name) and _splits(mapper, user)):
                continue  # an exit: the batch whole again in front
            if target_name(user) in SIZES:
                continue  # a size read, not a value
            region.add(user)
            todo.append(user)
            for arg in user.all_input_nodes:  # another merge of the same rows it reads
                if arg not in region and _is_reshape(arg, target_name):
                    found = _entry(mapper, arg)
                    if found is not None and found[1] is None and found[0] == prefix:
                        region.add(arg)
                        todo.append(arg)
    order = {node: i for i, node in enumerate(mapper.nodes)}
    for user in sorted(region, key=lambda n: order.get(n, len(order))):
        if _is_reshape(user, target_name) and (_entry(mapper, user) or ((), ""))[0] == prefix:
            continue  # a merge of the same rows
        why = _row_wise(mapper, user, region, rows, prefix, target_name)
        if why is not None:
            return region, (
                f"{said}{window}, and the rows are not split back by a reshape to "
                f"[N, ...] before {user.name} ({target_name(user)}), which {why}"
            )
    return region, None


def _splits(mapper, node) -> bool:
    try:
        out = mapper.shape(node)
    except Exception:  # noqa: BLE001
        return False
    return bool(out) and out[0] == BATCH


def _row_wise(mapper, node, region, rows, prefix, target_name) -> str | None:
    """None when ``node`` computes each row from the same row of what it reads, else
    what it does instead (the reason given)."""
    if node.op == "output":
        return "is the network's output"
    if node.op != "call_function":
        return "is not an operator"
    target = target_name(node)
    if target not in ELEMENTWISE and target not in LAST_DIMS and target not in MOVES:
        return "is not one of the ops proven to act on each row alone"
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return "is not a tensor of rows"
    rank = val.dim()
    a = _arguments(node)
    if target == "aten.transpose.int" and 0 in (int(a["dim0"]) % rank, int(a["dim1"]) % rank):
        return "moves the merged dim"
    if target == "aten.permute.default" and int(a["dims"][0]) % rank != 0:
        return "moves the merged dim"
    if target in ("aten.softmax.int", "aten.log_softmax.int"):
        if int(a["dim"]) % rank == 0:
            return "is a softmax over the merged dim"
    if target in ("aten.mean.dim", "aten.sum.dim_IntList"):
        dims = a.get("dim")
        in_rank = node.args[0].meta["val"].dim()
        if not dims or any(int(d) % in_rank == 0 for d in dims):
            return "reduces over the merged dim"
    if target in ("aten.layer_norm.default", "aten.rms_norm.default"):
        if len(a["normalized_shape"]) >= node.args[0].meta["val"].dim():
            return "normalizes over the merged dim"
    if mapper.dim(val.shape[0]) != rows:
        return f"has {shape_text(mapper.shape(node))}, not the merged rows first"
    if target == "aten.linear.default" and node.args[0] not in region:
        return "reads the rows as its weight"
    if target == "aten.embedding.default" and a["indices"] not in region:
        return "reads the rows as its table"
    if target in ("aten.matmul.default", "aten.bmm.default"):
        why = _matmul_rows(node.args[0], node.args[1], region)
        if why is not None:
            return why
    if target == "aten.baddbmm.default":
        why = _matmul_rows(a["batch1"], a["batch2"], region) or _added_rows(
            mapper, a["self"], region, prefix, target_name
        )
        if why is not None:
            return why
    read = [arg for arg in node.all_input_nodes if arg in region]
    if (
        len(read) > 1
        and target in ELEMENTWISE
        and any(arg.meta["val"].dim() != rank for arg in read)
    ):
        return "broadcasts rows of fewer dims, which would not meet row for row"
    for arg in node.all_input_nodes:
        if arg in region:
            continue
        if target == "aten.baddbmm.default" and arg is a["self"]:
            continue  # checked above (_added_rows)
        if target in _MATMULS or arg in _weights(node, target):
            if any(isinstance(mapper.dim(d), str) for d in arg.meta["val"].shape):
                return f"reads {arg.name} {shape_text(mapper.shape(arg))}, a batched value"
            continue  # checked above
        why = _broadcasts(mapper, arg, rank)
        if why is not None:
            return why
    return None


def _arguments(node) -> dict:
    return schema_arguments(node)


def _weights(node, target) -> set:
    if target in ("aten.linear.default", "aten.layer_norm.default", "aten.rms_norm.default"):
        return set(node.all_input_nodes[1:])
    if target == "aten.embedding.default":
        return {node.args[0]}
    return set()


def _matmul_rows(left, right, region) -> str | None:
    """A matmul is row-wise when the rows are a batch dim of it (rank 3 and up) or the
    rows of its left operand times a matrix without them."""
    lrank, rrank = left.meta["val"].dim(), right.meta["val"].dim()
    if left in region and right in region:
        return None if lrank == rrank >= 3 else "multiplies rows with rows"
    if left in region:
        return None if lrank >= 2 and rrank == 2 else "multiplies the rows by a batched tensor"
    if rrank >= 3 and lrank <= 2:
        return None
    return "contracts over the merged dim"


def _added_rows(mapper, arg, region, prefix, target_name) -> str | None:
    """None when baddbmm's ``input`` (added to the product [rows, n, m]) meets the rows row
    for row: rows of the region (rank 3: the rows first, the rest broadcast within a row),
    a tensor without the batch that broadcasts along the rows, or a tile of one
    (``_tiled``), which on the unmerged shape is that tensor broadcast along the batch."""
    if not isinstance(arg, fx.Node):
        return None  # a number: the same for every row
    if arg in region:
        return None if arg.meta["val"].dim() == 3 else "broadcasts rows of fewer dims"
    if _tiled(mapper, arg, prefix, target_name):
        return None
    return _broadcasts(mapper, arg, 3)


def _tiled(mapper, arg, prefix, target_name) -> bool:
    """Whether ``arg`` is ``x.repeat(N, 1, ..., 1)`` (through casts) of an ``x`` without
    the batch whose dim 0 is the product ``P`` of the dims the merge took in (BLOOM's ALiBi
    bias, ``[H, 1, L]`` repeated to ``[N*H, 1, L]``): row ``n*P + p`` of it is ``x[p]`` for
    every sample ``n``, so on the unmerged shape ``[N, d1, ..., dk, ...]`` it is ``x`` viewed
    as ``[d1, ..., dk, ...]``, the same for every sample, and meets each row of the merge as
    a tensor without the batch would."""
    node = arg
    while isinstance(node, fx.Node) and target_name(node) in CASTS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or target_name(node) != "aten.repeat.default":
        return False
    source, repeats = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor):
        return False
    shape = [mapper.dim(d) for d in source.meta["val"].shape]
    if not shape or any(not isinstance(d, int) for d in shape) or len(repeats) != len(shape):
        return False
    first = repeats[0].meta.get("val") if isinstance(repeats[0], fx.Node) else repeats[0]
    if mapper.dim(first) != BATCH or any(not _is_one(r) for r in repeats[1:]):
        return False
    return shape[0] == math.prod(prefix[1:])


def _is_one(size) -> bool:
    return not isinstance(size, fx.Node) and int(size) == 1


def _broadcasts(mapper, arg, rank) -> str | None:
    """None when ``arg`` (read from outside the region) has no batch and broadcasts
    along the rows (fewer dims, or a leading 1)."""
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    shape = tuple(mapper.dim(d) for d in val.shape)
    if any(isinstance(d, str) for d in shape):
        return f"reads {arg.name} {shape_text(shape)}, a batched value from outside the rows"
    if len(shape) >= rank and shape[len(shape) - rank] != 1:
        return f"reads {arg.name} {shape_text(shape)}, whose first dim meets the rows"
    return None


def unmerge_dims(a: dict, k: int) -> dict:
    """The arguments of a region's node with its dims counted on the unmerged shape: a
    dim after the rows moves ``k`` on (the merged dim 0 is ``k + 1`` dims there)."""
    out = dict(a)

    def shift(d):
        d = int(d)
        return d if d <= 0 else d + k

    for key in DIM_KEYS:
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = shift(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(d, int) for d in value):
            out[key] = type(value)(shift(d) for d in value)
    dims = out.get("dims")
    if isinstance(dims, (list, tuple)) and dims:
        moved = [int(d) % len(dims) for d in dims]
        out["dims"] = [*range(k + 1), *(d + k for d in moved[1:])]
    return out
