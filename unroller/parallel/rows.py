"""Row-sharded layers computed where their rows live: an LM's embedding and head.

FSDP2 gathers a unit's whole weight on every rank before its statements run. For a layer
with many more rows than columns (a vocabulary: 32,000 to 128,000 rows of 768 to 4,096)
that is the largest tensor of the step, gathered twice and its full gradient made once,
while the activations it touches are a few tokens wide. Here each rank keeps its own rows
(FSDP2's ``Shard(0)`` chunk: rank r holds rows [r*c, r*c + its rows)) and the tokens travel
instead:

- a head (``linear``): every rank's inputs all-gathered, each rank computes the logits of
  its vocabulary rows for every token, and an all-to-all gives each rank its own tokens'
  logits over the whole vocabulary; backward, the logit gradients go back by an all-to-all,
  each rank makes its rows' weight gradient from every token (its shard's ``.grad`` at
  once: nothing to reduce-scatter) and its part of every token's input gradient, summed at
  the token's rank by another all-to-all;
- an embedding: every rank's ids all-gathered, each rank looks up those in its rows, and
  the rows found are summed at each token's rank; backward, the output gradients are
  all-gathered and each rank adds those of the ids in its rows into its shard's gradient.

The gradient each rank's tokens contribute is scaled by that rank's share (``share``: the
weight the sharder averages with, over the ranks) before it leaves, and an input gradient
is divided by it again when it comes back, so the shard's gradient is the ranks' average
exactly as the reduce-scatter would give, and the input gradients are the rank's own.
Without a DTensor weight these functions are never called (``is_rows``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

#: this rank's share of the batch over the ranks (the sharder's weight / the world size),
#: set by the sharder at the start of each step (one step runs at a time in a process)
_SHARE = {"value": None}


def set_share(value: float | None) -> None:
    _SHARE["value"] = value


@functools.cache
def _dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_rows(weight: Any) -> bool:
    """Is ``weight`` a shard left where it lives (a DTensor the step did not gather)?"""
    return isinstance(weight, _dtensor())


def _layout(weight: Any) -> tuple[Any, int, int, int]:
    """The process group, this rank, the world size and the first row this rank holds."""
    mesh = weight.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-weight.shape[0] // world)
    return mesh.get_group(), rank, world, rank * chunk


def _widths(weight: Any, world: int) -> list[int]:
    """Each rank's number of rows (FSDP2's ``Shard(0)`` chunks, the last ones short)."""
    rows = weight.shape[0]
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def _share(world: int) -> float:
    value = _SHARE["value"]
    return 1.0 / world if value is None else value


def _counts(n: int, group: Any, world: int, device: Any) -> list[int]:
    """Every rank's number of tokens (ranks may hold different batch sizes)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    found = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(found, mine, group=group)
    return [int(c.item()) for c in found]


def _gather_rows(t: Tensor, counts: list[int], group: Any) -> Tensor:
    """Every rank's ``t`` (rows = its tokens) stacked in rank order."""
    top = max(counts)
    padded = t.new_zeros((top, *t.shape[1:]))
    padded[: t.shape[0]] = t
    found = [torch.empty_like(padded) for _ in counts]
    torch.distributed.all_gather(found, padded, group=group)
    return torch.cat([f[:c] for f, c in zip(found, counts)])


def _exchange(blocks: list[Tensor], shapes: list[tuple], group: Any) -> list[Tensor]:
    """``blocks[r]`` sent to rank r; the blocks every rank sent here, of ``shapes``."""
    send = torch.cat([b.reshape(-1) for b in blocks])
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    recv = send.new_empty(sum(sizes))
    torch.distributed.all_to_all_single(recv, send, sizes, [b.numel() for b in blocks], group=group)
    return [part.view(s) for part, s in zip(recv.split(sizes), shapes)]


def _split_at(counts: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(counts).cumsum(0).tolist()
    return [(end - c, end) for c, end in zip(counts, ends)]


def linear(x: Tensor, weight: Any, bias: Any) -> Tensor:
    """F.linear of this rank's ``x`` with a row-sharded weight: its logits over every row."""
    group, rank, world, _ = _layout(weight)
    flat = x.reshape(-1, x.shape[-1])
    counts = _counts(flat.shape[0], group, world, x.device)
    if _gathering(counts, weight):
        return torch.nn.functional.linear(x, _whole(weight, x.dtype), _whole(bias, x.dtype))
    mine = weight.to_local().to(x.dtype)  # a mixed-precision step's compute dtype
    local = torch.nn.functional.linear(
        _gather_rows(flat, counts, group),
        mine,
        None if bias is None else bias.to_local().to(x.dtype),
    )
    widths = _widths(weight, world)
    blocks = [local[a:b] for a, b in _split_at(counts)]
    parts = _exchange(blocks, [(flat.shape[0], w) for w in widths], group)
    return torch.cat(parts, dim=1).reshape(*x.shape[:-1], weight.shape[0])


def linear_backward(
    g: Tensor, x: Tensor, weight: Any, bias: Any, need_x: bool, need_w: bool, need_b: bool
) -> tuple[Tensor | None, Any, Any]:
    """The input gradient of this rank's tokens and the weight's and bias's gradients of
    this rank's rows (DTensors: the ranks' average), from this rank's logit gradients."""
    group, rank, world, _ = _layout(weight)
    share = _share(world)
    flat = x.reshape(-1, x.shape[-1])
    counts = _counts(flat.shape[0], group, world, x.device)
    if _gathering(counts, weight):
        return _gathered_linear_backward(g, x, weight, bias, (need_x, need_w, need_b), share)
    mine = weight.to_local().to(g.dtype)
    g2 = g.reshape(-1, g.shape[-1]).mul(share)
    widths = _widths(weight, world)
    columns = _split_at(widths)
    blocks = [g2[:, a:b].contiguous() for a, b in columns]
    parts = _exchange(blocks, [(c, mine.shape[0]) for c in counts], group)
    g_all = torch.cat(parts)  # every rank's tokens, this rank's rows
    gx = gw = gb = None
    if need_w:
        gw = _as_shard(g_all.t().matmul(_gather_rows(flat, counts, group)), weight)
    if need_b and bias is not None:
        gb = _as_shard(g_all.sum(0), bias)
    if need_x:
        partial = g_all.matmul(mine)
        spans = _split_at(counts)
        back = _exchange([partial[a:b] for a, b in spans], [flat.shape] * world, group)
        gx = torch.stack(back).sum(0).div_(share).reshape(x.shape)
    return gx, gw, gb


def embedding(ids: Tensor, weight: Any, padding_row: int) -> Tensor:
    """F.embedding of this rank's ``ids`` with a row-sharded table."""
    group, rank, world, first = _layout(weight)
    mine = weight.to_local()
    flat = ids.reshape(-1)
    counts = _counts(flat.shape[0], group, world, ids.device)
    if _gathering(counts, weight):
        return torch.nn.functional.embedding(ids, _whole(weight), _padding_arg(padding_row))
    every = _gather_rows(flat, counts, group)
    if ((every < 0) | (every >= weight.shape[0])).any():
        raise IndexError("embedding: an id is out of the table's range")
    rows = every - first
    held = (rows >= 0) & (rows < mine.shape[0])
    found = mine.new_zeros((every.shape[0], mine.shape[1]))
    found[held] = mine[rows[held]]
    spans = _split_at(counts)
    back = _exchange(
        [found[a:b] for a, b in spans], [(flat.shape[0], mine.shape[1])] * world, group
    )
    return torch.stack(back).sum(0).reshape(*ids.shape, mine.shape[1])


def embedding_backward(g: Tensor, ids: Tensor, weight: Any, padding_row: int) -> Any:
    """This rank's rows' gradient (a DTensor: the ranks' average) from every rank's output
    gradients of the ids in its rows; the padding row's stays zero."""
    group, rank, world, first = _layout(weight)
    mine = weight.to_local()
    flat = ids.reshape(-1)
    counts = _counts(flat.shape[0], group, world, ids.device)
    if _gathering(counts, weight):
        full = torch.ops.aten.embedding_dense_backward(g, ids, weight.shape[0], padding_row, False)
        return _averaged(full, weight, _share(world))
    every = _gather_rows(flat, counts, group)
    g_all = _gather_rows(g.reshape(-1, g.shape[-1]).mul(_share(world)), counts, group)
    rows = every - first
    held = (rows >= 0) & (rows < mine.shape[0]) & (every != padding_row)
    grad = mine.new_zeros(mine.shape).index_add_(0, rows[held], g_all[held])
    return _as_shard(grad, weight)


def _gathering(counts: list[int], weight: Any) -> bool:
    """Whether the layer is better gathered after all: when the ranks' tokens together
    outnumber its rows, the inputs every rank would all-gather (tokens x width) outweigh
    the weight itself (rows x width), and the exchange of logits the all-gather of the
    weight. The same on every rank (the counts are every rank's), so the collectives match."""
    return sum(counts) > weight.shape[0]


def _whole(t: Any, dtype: Any = None) -> Tensor | None:
    """A row-sharded tensor all-gathered whole (FSDP2's gather, for this call alone)."""
    if t is None:
        return None
    full = t.full_tensor()
    return full if dtype is None else full.to(dtype)


def _averaged(full: Tensor, like: Any, share: float) -> Any:
    """Every rank's full gradient ``full`` times its share, summed and reduce-scattered into
    ``like``'s rows (a DTensor: the ranks' average, as the reduce-scatter of a gathered unit)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = like.device_mesh
    summed = DTensor.from_local(full.mul(share).to(like.dtype), mesh, [Partial()])
    return summed.redistribute(mesh, [Shard(0)])


def _gathered_linear_backward(g, x, weight, bias, needs, share):
    """``linear_backward`` with the weight gathered (``_gathering``): the input gradient
    from the whole weight, the weight's and bias's reduce-scattered to this rank's rows."""
    need_x, need_w, need_b = needs
    g2 = g.reshape(-1, g.shape[-1])
    gx = g.matmul(_whole(weight, g.dtype)) if need_x else None
    gw = gb = None
    if need_w:
        gw = _averaged(g2.t().matmul(x.reshape(-1, x.shape[-1])), weight, share)
    if need_b and bias is not None:
        gb = _averaged(g2.sum(0), bias, share)
    return gx, gw, gb


def _padding_arg(padding_row: int) -> int | None:
    return None if padding_row < 0 else padding_row


def _as_shard(local: Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(
        local.to(like.dtype), like.device_mesh, [Shard(0)], shape=like.shape, stride=like.stride()
    )
