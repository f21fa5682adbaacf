"""Scaled dot-product attention that never holds the [N, H, L, S] probabilities: the forward
and backward of softmax(q k^T * scale [+ causal mask]) v computed block by block, as flash
attention computes them. Both platforms' attention kernels are these functions
(``unroller.runtime.gpu`` and ``unroller.runtime.ipu`` import them; their multi-head
attention calls them between its projections), so they use only operations on PopTorch's
list (matmul, exp, log, amax, sum, masked_fill, arange, zeros, new_zeros, narrow,
contiguous, in-place add/sub/mul/div/exp): ``unroll lint --platform ipu`` follows generated
ipu code into here.

What the backward keeps from the forward: q, k, v, the output O and the row logsumexp
``lse`` [N, H, L] (one number per query row, in q's dtype), the tensors torch's CPU flash
attention keeps. Keeping the probabilities instead (the math path) costs H * S numbers per
query, more than q, k, v and O together whenever S > 4E / H.

Forward, per block of queries: the scores s = (q * a) @ (k * b)^T with ATen's math-path
factors a * b = scale (``_attention_factors``: the scores round as torch's math attention's
do), -inf above the diagonal when causal, the row maximum m, p = exp(s - m), the row sum l,
the output (p @ v) / l and lse = m + log(l).

Backward, per block: p = exp(s - lse) remade from q, k and lse (the forward's
probabilities, to rounding), dV += p^T dO, dP = dO v^T, D = rowsum(dO * O) (each row once:
it equals rowsum(dP * p) because O = p v), dS = p * (dP - D), dQ = dS (k * b) * a, dK +=
dS^T (q * a) * b. Only the gradients asked for are made: dV alone needs neither dP nor dS.

Blocks (``blocks``): the score tile of a block, [samples, H, rows, keys], is at most
``TILE_BYTES`` (1 MiB), unless one query row of every head of one sample is larger. Whole
samples go into a block while they fit (one block when the whole batch does, as for the
benchmark transformers at small batches), then blocks of query rows of one sample. 1 MiB is
big enough that each block's matmuls amortise the Python loop over blocks (up to 256K
float32 scores per block, a few dozen ops each: on the benchmark transformers' shapes,
multi-head attention forward and backward took 5-18% longer with 256 KiB tiles, 20-100%
with 64 KiB) and small enough that the two tiles the backward holds at once stay a small
part of a transformer's working set at any batch (at small batches, where the whole batch
is one block, the tiles still grow with it: a smaller bound would trade time for that).
Under a causal mask a block reads only the keys up to its last row: the rest are masked for
all its rows. The memory model reads the tile from here (``largest_tile``).

Fully masked rows: the only mask is the top-left causal one (key j is masked for query i
when j > i), which keeps key 0 in every row, and shapes have S >= 1, so no row is ever fully
masked: the row maximum is finite and every row's probabilities sum to 1 (the math path's
``_safe_softmax`` returns 0 for a fully masked row; that case cannot arise here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from unroller.runtime.common import Grads, Needs, _attention_factors, _fit, _need

#: The most bytes one block's score tile may take (see the module docstring).
TILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Block:
    """Samples ``start`` .. ``start + samples`` (dim 0), query rows ``first`` .. ``first +
    rows`` (dim 2), against keys 0 .. ``keys``."""

    start: int
    samples: int
    first: int
    rows: int
    keys: int


def blocks(
    batch: int, heads: int, length: int, keys: int, itemsize: int, is_causal: bool
) -> list[Block]:
    """The blocks attention over q [batch, heads, length, .] and k [batch, heads, keys, .]
    runs in, in order, each score tile at most ``TILE_BYTES`` where a row allows it."""
    row = heads * keys * itemsize  # one query row of every head of one sample
    sample = row * length
    spans: list[tuple[int, int, int, int]]
    if batch * sample <= TILE_BYTES:
        spans = [(0, batch, 0, length)]
    elif sample <= TILE_BYTES:
        per = TILE_BYTES // sample
        spans = [(n, min(per, batch - n), 0, length) for n in range(0, batch, per)]
    else:
        per = max(1, TILE_BYTES // row)
        spans = [
            (n, 1, first, min(per, length - first))
            for n in range(batch)
            for first in range(0, length, per)
        ]
    return [
        Block(n, count, first, rows, min(keys, first + rows) if is_causal else keys)
        for n, count, first, rows in spans
    ]


def largest_tile(
    batch: int, heads: int, length: int, keys: int, itemsize: int, is_causal: bool
) -> int:
    """Bytes of the largest score tile among ``blocks``: what the memory model counts for
    each tile the kernels hold at once. Read off one sample's blocks when a sample is split
    (every sample is split alike), else off the first block (the fullest), so the memory
    model's batch searches never list a large batch's blocks."""
    plan = blocks(1, heads, length, keys, itemsize, is_causal)
    if len(plan) == 1:
        plan = blocks(batch, heads, length, keys, itemsize, is_causal)[:1]
    return max(b.samples * heads * b.rows * b.keys * itemsize for b in plan)


def _rows(t: Tensor, b: Block) -> Tensor:
    """The block's part of a per-query tensor (q, dO, O: [N, H, L, .]; lse: [N, H, L])."""
    return t.narrow(0, b.start, b.samples).narrow(2, b.first, b.rows)


def _keys(t: Tensor, b: Block) -> Tensor:
    """The block's part of a per-key tensor (k, v and their gradients: [N, H, S, .])."""
    return t.narrow(0, b.start, b.samples).narrow(2, 0, b.keys)


def _packed(t: Tensor) -> Tensor:
    """``t`` in contiguous memory (itself when it is already). The heads of a multi-head
    attention are strided views of its packed projection, rows of different samples
    interleaved ([N, H, L, E/H] with the length's stride N * E): a batched matmul on such
    an operand runs several times slower on the CPU than on a copy, which costs a pass
    over a block's q, k, v or dO, not over its tile."""
    return t.contiguous()


def _work(t: Tensor) -> Tensor:
    """A block's tile in the dtype the attention computes in: float32 for bfloat16 and
    float16 inputs (as ATen's fused attention kernels accumulate), one tile at a time so
    that no float32 copy of a whole q, k or v exists; other dtypes as they are."""
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
        return t.to(torch.float32)
    return t


def _accumulator(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Zeros to sum blocks' results into, in ``_work``'s dtype for ``t``."""
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
        return t.new_zeros(shape, dtype=torch.float32)
    return t.new_zeros(shape)


def _scaled(t: Tensor, factor: float) -> Tensor:
    """t * factor in contiguous memory (see ``_packed``), with one allocation either way."""
    if t.is_contiguous():
        return t * factor
    return t.contiguous().mul_(factor)


Masks = dict[tuple[int, int, int], Tensor]
"""The causal masks one kernel call has made, by (first row, rows, keys)."""


def _causal_mask(b: Block, like: Tensor, masks: Masks) -> Tensor | None:
    """The block's additive causal mask [rows, keys]: 0, and -inf where a key comes after
    the query's own position; None when the block holds no such pair. Added to the scores
    it broadcasts over samples and heads (on the CPU several times faster than masked_fill_
    with a broadcast boolean mask). Blocks of whole samples share one: made once a call."""
    if b.keys - 1 <= b.first:
        return None
    key = (b.first, b.rows, b.keys)
    mask = masks.get(key)
    if mask is None:
        rows = torch.arange(b.first, b.first + b.rows, device=like.device).unsqueeze(1)
        cols = torch.arange(b.keys, device=like.device).unsqueeze(0)
        mask = torch.zeros(b.rows, b.keys, dtype=like.dtype, device=like.device)
        mask = mask.masked_fill_(cols > rows, -math.inf)
        masks[key] = mask
    return mask


def _bias(t: Tensor, b: Block) -> Tensor:
    """The block's part of an additive score bias [N or 1, H or 1, L, S] (a dim of size 1
    broadcasts, so only a full batch dim is narrowed to the block's samples)."""
    if t.shape[0] != 1:
        t = t.narrow(0, b.start, b.samples)
    return t.narrow(2, b.first, b.rows).narrow(3, 0, b.keys)


def _scores(qs: Tensor, ks: Tensor, mask: Tensor | None, bias: Tensor | None = None) -> Tensor:
    """(q * a) @ (k * b)^T for one block, plus its bias (already the block's part) and its
    causal mask if any: the bias is added first, as F.scaled_dot_product_attention adds an
    attn_mask to the scaled scores."""
    s = torch.matmul(qs, ks.transpose(-2, -1))
    if bias is not None:
        s = s.add_(bias)
    return s if mask is None else s.add_(mask)


def bias_grad(ds: Tensor, like: Tensor) -> Tensor:
    """dS summed over the dims the bias ``like`` broadcasts (samples, heads)."""
    dims = [d for d in (0, 1) if like.shape[d] == 1 and ds.shape[d] != 1]
    return ds.sum(dims, keepdim=True) if dims else ds


def _add_block(
    totals: Sequence[Tensor | None],
    parts: Sequence[Tensor | None],
    b: Block,
    regions: Sequence[Callable[[Tensor, Block], Tensor]],
) -> None:
    """Adds each block result into its place in the whole (zeros there before: rows of q's
    results are written once, keys' results summed over the blocks of queries). The parts
    are the caller's temporaries, freed when this returns."""
    for total, part, region in zip(totals, parts, regions):
        if total is not None and part is not None:
            region(total, b).add_(part)


def _whole(plan: list[Block], keys: int) -> bool:
    """One block that covers everything: its results are the kernel's, with no copy."""
    return len(plan) == 1 and plan[0].keys == keys


def _forward_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    b: Block,
    qa: float,
    kb: float,
    mask: Tensor | None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One block's output and row logsumexp; the score tile is made once and then reused in
    place for exp(s - m), and the output is divided by the row sums rather than the tile
    (Ev numbers a row instead of S)."""
    part = None if bias is None else _work(_bias(bias, b))
    s = _scores(_scaled(_work(_rows(q, b)), qa), _scaled(_work(_keys(k, b)), kb), mask, part)
    m = s.amax(-1, keepdim=True)
    p = s.sub_(m).exp_()
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, _packed(_work(_keys(v, b)))).div_(total)
    return out.to(q.dtype), m.add_(torch.log(total)).squeeze(-1)


def gqa_heads(t: Tensor, heads: int) -> Tensor:
    """k or v of Hkv heads as ``heads`` heads, each repeated for its group of heads // Hkv
    query heads (head i reads key head i // (heads // Hkv)): torch's ``enable_gqa``, which
    is ``repeat_interleave`` on dim 1. A transient copy inside the kernel; the step keeps the
    Hkv heads."""
    n, kv_heads, length, embed = t.shape
    if kv_heads == heads:
        return t
    return (
        t.unsqueeze(2)
        .expand(n, kv_heads, heads // kv_heads, length, embed)
        .reshape(n, heads, length, embed)
    )


def gqa_grad(g: Tensor | None, kv_heads: int) -> Tensor | None:
    """The gradient of ``gqa_heads``' input: each key/value head's sum over its group."""
    if g is None or g.shape[1] == kv_heads:
        return g
    n, heads, length, embed = g.shape
    return g.reshape(n, kv_heads, heads // kv_heads, length, embed).sum(2)


def gqa_backward(kernel, g: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest, **kwargs) -> Grads:
    """``kernel(g, q, k, v, *rest, **kwargs)``, an attention backward, for k, v of fewer
    heads than q: run on k, v repeated per group (``gqa_heads``), their gradients summed back
    per group."""
    kv_heads = k.shape[1]
    k, v = gqa_heads(k, q.shape[1]), gqa_heads(v, q.shape[1])
    grads = kernel(g, q, k, v, *rest, **kwargs)
    return tuple(gqa_grad(t, kv_heads) if i in (1, 2) else t for i, t in enumerate(grads))


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """F.scaled_dot_product_attention (an additive ``bias`` [N or 1, H or 1, L, S] as its
    float attn_mask, and/or the causal mask; no dropout) block by block. Returns (output
    [N, H, L, Ev], lse [N, H, L]); the backward reads q, k, v, the output, lse and the bias.
    ``enable_gqa``: k and v may have fewer heads (``gqa_heads``)."""
    if enable_gqa:
        k, v = gqa_heads(k, q.shape[1]), gqa_heads(v, q.shape[1])
    n, heads, length, embed = q.shape
    keys = k.shape[-2]
    qa, kb = _attention_factors(embed, scale)
    plan = blocks(n, heads, length, keys, q.dtype.itemsize, is_causal)
    masks: Masks = {}
    if _whole(plan, keys):
        mask = _causal_mask(plan[0], q, masks) if is_causal else None
        return _forward_block(q, k, v, plan[0], qa, kb, mask, bias)
    out = q.new_zeros(n, heads, length, v.shape[-1])
    lse = _accumulator(q, (n, heads, length))  # float32 for a low-precision q, as ATen's
    for b in plan:
        mask = _causal_mask(b, q, masks) if is_causal else None
        part = _forward_block(q, k, v, b, qa, kb, mask, bias)
        _add_block((out, lse), part, b, (_rows, _rows))
    return out, lse


def _backward_block(
    g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    output: Tensor,
    lse: Tensor,
    b: Block,
    scales: tuple[float, float],
    mask: Tensor | None,
    need: tuple[bool, bool, bool, bool],
    bias: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """One block's parts of the q, k and v gradients (None where not needed). A function of
    its own so that its two tiles (p and dS) are freed when it returns, before the next
    block makes its own: a loop body's locals would live on into the next iteration."""
    qa, kb = scales
    need_q, need_k, need_v, need_bias = need
    qs, ks = _scaled(_work(_rows(q, b)), qa), _scaled(_work(_keys(k, b)), kb)
    g_rows, v_keys = _packed(_work(_rows(g, b))), _packed(_work(_keys(v, b)))
    bias_part = None if bias is None else _work(_bias(bias, b))
    p = _scores(qs, ks, mask, bias_part).sub_(_work(_rows(lse, b)).unsqueeze(-1)).exp_()
    part_v = torch.matmul(p.transpose(-2, -1), g_rows) if need_v else None
    if not (need_q or need_k or need_bias):
        return None, None, part_v, None
    d = (g_rows * _work(_rows(output, b))).sum(-1, keepdim=True)
    ds = torch.matmul(g_rows, v_keys.transpose(-2, -1)).sub_(d).mul_(p)
    part_q = torch.matmul(ds, ks).mul_(qa) if need_q else None
    part_k = torch.matmul(ds.transpose(-2, -1), qs).mul_(kb) if need_k else None
    part_bias = bias_grad(ds, bias) if need_bias else None
    return part_q, part_k, part_v, part_bias


def scaled_dot_product_attention_backward(
    g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    output: Tensor,
    lse: Tensor,
    bias: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    needs: Needs | None = None,
) -> Grads:
    """Gradients of q, k, v and the bias (only those ``needs`` asks for), the probabilities
    remade per block from q, k, the bias and lse (see the module docstring)."""
    need = (_need(needs, 0), _need(needs, 1), _need(needs, 2), _need(needs, 3))
    need_q, need_k, need_v, need_bias = need = (*need[:3], need[3] and bias is not None)
    if not any(need):
        return _fit((), needs)
    if enable_gqa and k.shape[1] != q.shape[1]:
        return gqa_backward(
            scaled_dot_product_attention_backward,
            *(g, q, k, v, output, lse, bias),
            is_causal=is_causal,
            scale=scale,
            needs=needs,
        )
    n, heads, length, embed = q.shape
    keys = k.shape[-2]
    scales = _attention_factors(embed, scale)
    plan = blocks(n, heads, length, keys, q.dtype.itemsize, is_causal)
    masks: Masks = {}
    if _whole(plan, keys):
        mask = _causal_mask(plan[0], q, masks) if is_causal else None
        parts = _backward_block(g, q, k, v, output, lse, plan[0], scales, mask, need, bias)
        return _fit(_as_inputs(parts, (q, k, v, bias))[: 4 if need_bias else 3], needs)
    gq = _accumulator(q, q.shape) if need_q else None
    gk = _accumulator(k, k.shape) if need_k else None
    gv = _accumulator(v, v.shape) if need_v else None
    gbias = _accumulator(bias, bias.shape) if need_bias else None
    for b in plan:
        mask = _causal_mask(b, q, masks) if is_causal else None
        parts = _backward_block(g, q, k, v, output, lse, b, scales, mask, need, bias)
        _add_block((gq, gk, gv, gbias), parts, b, (_rows, _keys, _keys, _bias))
        del parts  # a loop variable would outlive the iteration: free it before the next tiles
    grads = _as_inputs((gq, gk, gv, gbias), (q, k, v, bias))
    return _fit(grads if need_bias else grads[:3], needs)


def _as_inputs(grads: Sequence[Tensor | None], inputs: Sequence[Tensor | None]) -> Grads:
    """Each gradient in its input's dtype (``_work`` may have computed it in float32)."""
    return tuple(
        None if g is None or t is None else g if g.dtype == t.dtype else g.to(t.dtype)
        for g, t in zip(grads, inputs)
    )
