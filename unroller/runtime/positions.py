"""Position kernels that are the same on both platforms: ``rotary`` and
``relative_position_bias``.

Rotary position embeddings (RoPE, the Llama family's): each head's vector at position p is
turned by angles p * f_i, written as Hugging Face's ``apply_rotary_pos_emb`` writes it,
y = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) (x1, x2 the halves of
the last dim). The tables are Hugging Face's default rope, made as its rotary module makes
them: in float32, inv_freq = 1 / theta ** (arange(0, D, 2) / D), angles = position *
inv_freq for positions 0 .. L-1, both halves alike, cos and sin times ``scaling``, then
cast to x's dtype; so the statement equals the original bit for bit where the original
runs the same ops. Nothing is kept for the backward: it is linear in x, g_x = g * cos +
rotate_half^T(g * sin), rotate_half^T(v) = cat(v2, -v1). Written with ops PopTorch has
(arange, pow, cos, sin, cat, slicing, neg), so gpu and ipu import it from here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from unroller.runtime.common import Grads, Needs, _exports, _fit, _need, _weight_bias


def rotary_tables(
    length: int, dim: int, theta: float, scaling: float, dtype: torch.dtype, device
) -> tuple[Tensor, Tensor]:
    """(cos, sin) [L, D] as Hugging Face's default rotary embedding computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    positions = torch.arange(length, device=device).to(torch.float)
    freqs = positions[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = angles.cos() * scaling
    sin = angles.sin() * scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_t(v: Tensor) -> Tensor:
    """The transpose of ``_rotate_half``: the gradient of its input."""
    half = v.shape[-1] // 2
    return torch.cat((v[..., half:], -v[..., :half]), dim=-1)


def rotary(x: Tensor, *, theta: float = 10000.0, scaling: float = 1.0) -> Tensor:
    """x [N, H, L, D] turned by position: x * cos + rotate_half(x) * sin (module doc)."""
    cos, sin = rotary_tables(x.shape[-2], x.shape[-1], theta, scaling, x.dtype, x.device)
    return (x * cos) + (_rotate_half(x) * sin)


def rotary_backward(
    g: Tensor, *, theta: float = 10000.0, scaling: float = 1.0, needs: Needs | None = None
) -> Grads:
    """g * cos + rotate_half^T(g * sin)."""
    if not _need(needs, 0):
        return _fit((), needs)
    cos, sin = rotary_tables(g.shape[-2], g.shape[-1], theta, scaling, g.dtype, g.device)
    return _fit((g * cos + _rotate_half_t(g * sin),), needs)


# ---------------------------------------------------------------- relative position bias


def relative_buckets(
    query_length: int,
    key_length: int,
    num_buckets: int,
    max_distance: int,
    bidirectional: bool,
    device=None,
) -> Tensor:
    """T5's bucket of each (query i, key j) pair [L, S], int64, from the offset j - i: half
    the buckets (a quarter each way when bidirectional) are exact offsets, the rest cover
    offsets up to ``max_distance`` on a log scale, and farther ones share the last bucket.
    The log-scale part is computed in float32 with the operations the original uses, so
    that the buckets are the same integers."""
    queries = torch.arange(query_length, dtype=torch.long, device=device).unsqueeze(1)
    keys = torch.arange(key_length, dtype=torch.long, device=device).unsqueeze(0)
    offset = keys - queries
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket = (offset > 0).to(torch.long) * num_buckets
        distance = offset.abs()
    else:
        distance = torch.clamp(-offset, min=0)  # -min(offset, 0)
    exact = num_buckets // 2
    scaled = torch.log(distance.to(torch.float32) / exact) / math.log(max_distance / exact)
    far = exact + (scaled * (num_buckets - exact)).to(torch.long)
    far = torch.clamp(far, max=num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


def relative_position_bias(
    layer,
    *,
    query_length: int,
    key_length: int,
    max_distance: int = 128,
    bidirectional: bool = True,
) -> Tensor:
    """The layer's [num_buckets, H] table read at each pair's bucket: [1, H, L, S], the bias
    an attention adds to its scores. Nothing is kept: the buckets are remade."""
    weight = _weight_bias(layer)[0]
    buckets = relative_buckets(
        query_length, key_length, weight.shape[0], max_distance, bidirectional, weight.device
    )
    return torch.nn.functional.embedding(buckets, weight).permute(2, 0, 1).unsqueeze(0)


def relative_position_bias_backward(
    g: Tensor,
    *,
    num_buckets: int,
    query_length: int,
    key_length: int,
    max_distance: int = 128,
    bidirectional: bool = True,
    needs: Needs | None = None,
) -> Grads:
    """The table's gradient: g [1, H, L, S] as [L * S, H] rows, each added into its pair's
    bucket row in pair order (scatter_add: the sums autograd's embedding backward makes)."""
    if not _need(needs, 0):
        return _fit((None,), needs)
    buckets = relative_buckets(
        query_length, key_length, num_buckets, max_distance, bidirectional, g.device
    )
    heads = g.shape[1]
    per_pair = g.sum(0).permute(1, 2, 0).reshape(-1, heads)
    index = buckets.reshape(-1, 1).expand(-1, heads)
    table = torch.scatter_add(g.new_zeros((num_buckets, heads)), 0, index, per_pair)
    return _fit((table,), needs)


# ---------------------------------------------------------------- ALiBi


def alibi_slopes(heads: int, device=None) -> Tensor:
    """ALiBi's slope of each head [H], float32, made as Hugging Face's BLOOM makes them
    (``_get_alibi_slopes``: powers of 2 ** -(8 / P) for the P heads of the largest power of
    two, the odd powers of 2 ** -(4 / P) for the rest), with the same float32 ops, so the
    slopes are its values bit for bit (on the device it runs on, as the original's)."""
    closest = 2 ** math.floor(math.log2(heads))
    exponent = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    base = torch.full((), exponent, dtype=torch.float32, device=device)
    powers = torch.arange(1, 1 + closest, dtype=torch.int32, device=device)
    slopes = torch.pow(base, powers)
    if closest != heads:
        exponent = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        extra_base = torch.full((), exponent, dtype=torch.float32, device=device)
        remaining = min(closest, heads - closest)
        extra = torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32, device=device)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra)], dim=0)
    return slopes


def alibi_bias(heads: int, keys: int, dtype: torch.dtype, device=None) -> Tensor:
    """ALiBi's bias [H, 1, S]: each head's slope times the key position 0 .. S-1, the
    product in float32 and then cast to ``dtype``, as BLOOM builds it for a batch without
    padding (its position of a key is its index then)."""
    slopes = alibi_slopes(heads, device)
    return (slopes[:, None, None] * torch.arange(keys, device=device)).to(dtype)


def alibi(x: Tensor) -> Tensor:
    """Scores x [N, H, L, S] plus ALiBi's bias (``alibi_bias``), broadcast over the batch
    and the queries: the add BLOOM's ``baddbmm`` makes with the bias as its input."""
    return x + alibi_bias(x.shape[-3], x.shape[-1], x.dtype, x.device)


def alibi_backward(g: Tensor, *, needs: Needs | None = None) -> Grads:
    """The output's gradient: the bias is a constant of the sizes."""
    return _fit((g if _need(needs, 0) else None,), needs)


#: The kernels both platforms take from here (through ``unroller.runtime.shared``): not the
#: tables, buckets and slopes, which the importer reads to match a traced model's to these
#: kernels.
__all__ = _exports(
    globals(), besides=("relative_buckets", "rotary_tables", "alibi_slopes", "alibi_bias")
)
