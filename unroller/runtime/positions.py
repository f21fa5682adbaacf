"""Position-embedding kernels that are the same on both platforms: ``rotary``.

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

import torch
from torch import Tensor

from unroller.runtime.common import Grads, Needs, _fit, _need


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
