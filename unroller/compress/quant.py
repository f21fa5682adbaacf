"""Affine per-group integer quantisation to 8, 4 or 2 bits, codes packed into bytes."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import (
    Compressor,
    ParamSpec,
    host_checks,
    itemsize,
    native_path,
    pack_codes,
    pack_codes_compiled,
    pack_codes_fast,
    pack_flat,
    packed_code_bytes,
    prod,
    remember_plan,
    row_blocks,
    skip_checks,
    unpack_codes,
    unpack_codes_compiled,
    unpack_codes_fast,
    use_compiled_path,
    use_fast_path,
    work_dtype,
    zero_nan_compiled,
)
from .quant_native import _NativeQuant

__all__ = ["Quant"]


class Quant(_NativeQuant, Compressor):
    """Affine quantisation with one (min, scale) pair per group.

    Groups: ``group_size=None`` makes one group per channel of each sample for inputs of rank
    >= 3 ([N, C, ...]) and one group per sample for rank 1-2 inputs; an int makes groups of that
    many consecutive elements of each flattened sample (the last group padded by repeating the
    sample's last element, which changes no min/max). The planner (``schemes.Codec.fit``)
    sets ``group_size`` to the last dim for 4-D tensors laid out as rows (attention maps,
    per-head tensors), so that token tensors [N, L, E], their [N*L, E] views and per-head
    tensors all get one group per row. Per group: mn = amin, mx = amax (a zero min or max is
    +0.0), scale = (mx - mn) / (2**bits - 1), code = round((x - mn) / scale) in
    [0, 2**bits - 1] (``stochastic``: floor(v + U[0, 1)), unbiased, the noise from torch's
    global RNG or the ``generator`` given to ``compress``); x_hat = mn + code * scale. Error
    per element: <= scale / 2 (nearest), < scale (stochastic).

    Packed form: (codes uint8 [N, ceil(M * bits / 8)], mn [N, G], scale [N, G]) where M is the
    per-sample element count and G the groups per sample; mn and scale are float32 (float64 for
    float64 inputs). Work is done in float32 (float64 for float64 inputs). On the CPU the native
    kernels of ``compress/native`` run when they can be built (``base.NATIVE``), with the same
    bytes.

    float16 / bfloat16 inputs and outputs: on the CPU they are read and written as they are,
    never widened to float32 as a whole: min and max per group on the input itself (exact),
    the float32 arithmetic on blocks, and the native kernels (which read and write float32)
    fed a span of ``base.WIDEN_ELEMENTS`` elements at a time. The codes are those of the
    float32 input with the same values, and the decompressed tensor is the float32 one cast
    to the dtype: the round trip errs by at most the float32 codec's error plus the dtype's
    rounding of the result (half a unit in the last place). The IPU-safe and compiled
    formulations (whole-tensor expressions by design) still compute on a float32 tensor.

    Zero-size inputs round-trip: N = 0 gives packed tensors with N = 0; empty samples (M = 0,
    e.g. C, H or W of 0) have no groups (codes [N, 0], mn and scale [N, 0]).

    Constant groups (mx == mn, all-zero tensors included) decompress exactly. Huge finite
    values (up to the dtype's max) never overflow: when mx - mn could exceed the dtype's range,
    the group is computed on halved values.

    Non-finite input: a NaN, +inf or -inf anywhere in a group makes the group's scale NaN or
    inf, and then EVERY element of that group decompresses to NaN; no group with a non-finite
    input ever decompresses to finite values. Other groups are unaffected.
    """

    name: ClassVar[str] = "quant"
    flops: ClassVar[float] = 8.0  # a scale, round and clamp each way
    lossless: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, ParamSpec]] = {
        "bits": ParamSpec(int, 8, "bits per code", choices=(8, 4, 2)),
        "group_size": ParamSpec(
            int,
            None,
            "elements per (min, scale) group; None = one channel of one sample (rank >= 3) "
            "or one sample (rank <= 2)",
            min=1,
            optional=True,
        ),
        "stochastic": ParamSpec(
            bool, False, "unbiased stochastic rounding instead of round-to-nearest"
        ),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        # per (shape, dtype): what a native call needs, so that a repeated call (the same few
        # shapes every step) checks its inputs and calls the kernel, nothing else: a small
        # step makes tens of calls, where the general dispatch cost as much as the kernel
        self._encode_plans: dict[tuple, tuple] = {}
        self._decode_plans: dict[tuple, tuple] = {}

    # layout ------------------------------------------------------------------------------

    def layout(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """(N, M, group, groups) for a full shape: M elements per sample, ``groups`` groups of
        ``group`` elements each per sample (groups * group >= M). Remembered per (shape,
        group_size): every codec call asks, with the few shapes of one model."""
        key = (tuple(shape), self.params["group_size"])
        known = self.__dict__.setdefault("_layouts", {})
        found = known.get(key)
        if found is None:
            if len(known) >= 256:  # many shapes (variable lengths): start again
                known.clear()
            found = known[key] = self._layout(*key)
        return found

    def _layout(self, shape: tuple[int, ...], gs: int | None) -> tuple[int, int, int, int]:
        if len(shape) < 1:
            raise ValueError(f"{self!r}: expected a batch dimension, got shape {tuple(shape)}")
        n = shape[0]
        m = prod(tuple(shape[1:]))
        if m == 0:  # empty samples: no groups
            return n, 0, 1, 0
        if gs is None:
            g = prod(tuple(shape[2:])) if len(shape) >= 3 else m
        else:
            g = min(gs, m)
        return n, m, g, -(-m // g)

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        self._float_dtype(dtype)
        n, m, _, groups = self.layout(tuple(shape))
        side = itemsize(work_dtype(dtype))
        return n * (packed_code_bytes(m, self.params["bits"]) + 2 * groups * side)

    # compress ----------------------------------------------------------------------------

    def compress(self, t: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, ...]:
        """The packed form of ``t``. ``generator`` (a ``torch.Generator`` on ``t``'s device)
        draws the noise of stochastic rounding instead of torch's global RNG: the same
        generator state gives the same packed bytes on every path (tests, reproductions)."""
        if isinstance(t, Tensor):
            plan = self._encode_plans.get((t.shape, t.dtype))
            if plan is not None:
                lib = native_path(t)
                if lib is not None:
                    return self._encode_planned(lib, t, plan)
        self._float_input(t)
        n, m, g, groups = self.layout(tuple(t.shape))
        bits = self.params["bits"]
        levels = float((1 << bits) - 1)
        wd = work_dtype(t.dtype)
        if n * m == 0:  # zero-size input; same on both paths (a shape-only branch, no draw)
            return (
                torch.zeros((n, packed_code_bytes(m, bits)), dtype=torch.uint8, device=t.device),
                torch.zeros((n, groups), dtype=wd, device=t.device),
                torch.zeros((n, groups), dtype=wd, device=t.device),
            )
        lib = native_path(t)
        if lib is not None:
            if t.dtype == wd and not self.params["stochastic"]:
                remember_plan(self._encode_plans, (t.shape, t.dtype), (n, m, g, groups, wd))
            return self._compress_native(lib, t, n, m, g, groups, wd, generator)
        compiled = use_compiled_path(t)
        if not compiled and use_fast_path(t):  # without the native kernels
            return self._compress_fast(t, n, m, g, groups, levels, wd, generator)
        big_range = torch.finfo(wd).max * 0.25
        x = t.reshape(n, m).to(wd)
        if groups * g != m:  # pad the last group with copies of the last element
            x = torch.cat([x, x[:, m - 1 : m].expand(n, groups * g - m)], dim=1)
        x = x.reshape(n, groups, g)
        mn = torch.amin(x, dim=-1, keepdim=True)  # NaN propagates
        mx = torch.amax(x, dim=-1, keepdim=True)
        # a zero min or max is +0.0: which zero amin/amax return from a group holding both
        # depends on the reduction order, and the formulations must agree bit for bit
        mn = torch.where(mn == 0, torch.zeros_like(mn), mn)
        mx = torch.where(mx == 0, torch.zeros_like(mx), mx)
        # s = 1/2 for groups whose range mx - mn might not fit the dtype, else 1 (exact).
        half = torch.full_like(mn, 0.5)
        s = torch.where(mx * 0.5 - mn * 0.5 > big_range, half, torch.ones_like(mn))
        scale = (mx * s - mn * s) / levels / s
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: v = 0
        v = (x * s - mn * s) / (safe * s)
        if self.params["stochastic"]:
            noise = torch.rand(v.shape, dtype=v.dtype, device=v.device, generator=generator)
            v = torch.floor(v + noise)
        else:
            v = torch.round(v)
        v = torch.clamp(v, 0.0, levels)
        # defined cast where the scale is NaN
        v = (
            zero_nan_compiled(v)
            if compiled
            else torch.where(torch.isnan(v), torch.zeros_like(v), v)
        )
        codes = v.to(torch.int32).reshape(n, groups * g)[:, :m]
        return (
            pack_codes_compiled(codes, bits) if compiled else pack_codes(codes, bits),
            mn.reshape(n, groups),
            scale.reshape(n, groups),
        )

    # decompress --------------------------------------------------------------------------

    def decompress(
        self, packed: tuple[Tensor, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        if len(packed) == 3 and isinstance(packed[0], Tensor):
            plan = self._decode_plans.get((packed[0].shape, tuple(shape), dtype))
            if plan is not None and self._planned_ok(packed, plan):
                lib = native_path(*packed)
                if lib is not None:
                    return self._decode_planned(lib, packed, plan)
        self._float_dtype(dtype)
        if len(packed) != 3:
            raise ValueError(f"{self!r}: expected packed (codes, mn, scale), got {len(packed)}")
        codes, mn, scale = packed
        n = codes.shape[0]
        full = (n, *shape)
        _, m, g, groups = self.layout(full)
        bits = self.params["bits"]
        levels = float((1 << bits) - 1)
        wd = work_dtype(dtype)
        if n * m == 0:  # zero-size tensor; same on both paths
            return torch.zeros(full, dtype=dtype, device=codes.device)
        lib = native_path(codes, mn, scale)
        if lib is not None and self._native_packed_ok(codes, mn, scale, n, m, groups):
            if dtype == wd:
                key = (codes.shape, tuple(shape), dtype)
                remember_plan(self._decode_plans, key, (full, n, m, g, groups, wd))
            return self._decompress_native(lib, codes, mn, scale, full, m, g, groups, wd, dtype)
        compiled = use_compiled_path(codes, mn, scale)
        if not compiled and use_fast_path(codes, mn, scale):
            return self._decompress_fast(codes, mn, scale, full, m, g, groups, levels, wd, dtype)
        fmax = torch.finfo(wd).max
        unpack = unpack_codes_compiled if compiled else unpack_codes
        q = unpack(codes, bits, m).to(wd)
        if groups * g != m:
            q = torch.nn.functional.pad(q, (0, groups * g - m))
        q = q.reshape(n, groups, g)
        mn = mn.to(wd).reshape(n, groups, 1)
        scale = scale.to(wd).reshape(n, groups, 1)
        # Halve the terms where mn + q * scale might overflow on the way (inexact only for
        # values that are huge anyway); clamp catches a last rounding step past the max.
        half = torch.full_like(scale, 0.5)
        big = scale > fmax / (2.0 * levels)
        s = torch.where(big, half, torch.ones_like(scale))
        if compiled:  # times 1 / s: exact (a power of two), and no division per element
            x = (mn * s + q * (scale * s)) * torch.where(
                big, torch.full_like(scale, 2.0), torch.ones_like(scale)
            )
        else:
            x = (mn * s + q * (scale * s)) / s
        x = torch.clamp(x, -fmax, fmax)
        # scale - scale is 0 for finite groups and NaN where the group held NaN or +-inf.
        x = x + (scale - scale)
        x = x.reshape(n, groups * g)[:, :m].reshape(full)
        return x.to(dtype).contiguous()

    # fast cpu/cuda path ------------------------------------------------------------------

    @staticmethod
    def _group_params(  # unroller-lint: host-only (fast cpu/cuda path)
        x: Tensor, levels: float, wd: torch.dtype, checks: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
        """(mn, s, scale, safe, simple) of the groups (rows) of ``x``, as in the IPU-safe
        formulation. ``simple`` (only found with host ``checks``): every group is finite and
        needs no halving (s == 1), so v = (x - mn) / safe exactly and v has no NaN."""
        mn = torch.amin(x, dim=-1, keepdim=True).to(wd)  # exact in any float dtype; NaN
        mx = torch.amax(x, dim=-1, keepdim=True).to(wd)  # propagates
        mn = torch.where(mn == 0, 0.0, mn)  # a zero is +0.0, as in the IPU-safe formulation
        mx = torch.where(mx == 0, 0.0, mx)
        d = mx * 0.5 - mn * 0.5
        big_range = torch.finfo(wd).max * 0.25
        # NaN and +-inf make d NaN or inf: not simple
        simple = checks and bool((d <= big_range).all())
        if simple:  # s == 1: (mx * 1 - mn * 1) / levels / 1 is (mx - mn) / levels exactly
            s = None
            scale = (mx - mn) / levels
        else:
            half = torch.full_like(mn, 0.5)
            s = torch.where(d > big_range, half, torch.ones_like(mn))
            scale = (mx * s - mn * s) / levels / s
        safe = torch.where(scale > 0, scale, 1.0)
        return mn, s, scale, safe, simple

    def _compress_fast(  # unroller-lint: host-only (fast cpu/cuda path)
        self,
        t: Tensor,
        n: int,
        m: int,
        g: int,
        groups: int,
        levels: float,
        wd: torch.dtype,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, ...]:
        """``compress`` with the same packed bytes. Per block of rows (groups): amin/amax on the
        input as it is (exact in any float dtype), then v = (x - mn) / safe, round, clamp and
        uint8 codes, packed straight into the output, in place on one block-sized buffer, so
        the input is read from memory once. The group-halving and NaN steps run only when
        some group of the block needs them (checked on the small per-group tensors on the
        CPU; on CUDA always, to avoid waiting for the device)."""
        bits = self.params["bits"]
        per = 8 // bits
        rows = n * groups
        x = t.reshape(n, m)
        padded = groups * g != m
        if padded:  # pad the last group with copies of the last element
            x = torch.cat([x, x[:, m - 1 : m].expand(n, groups * g - m)], dim=1)
        x = x.reshape(rows, g)
        blocks = row_blocks(rows, g, host_checks(t), multiple=per)
        checks = skip_checks(t)
        whole_rows = blocks[0][3] == g  # else rows longer than a block: stats first
        if not whole_rows:
            params = self._group_params(x, levels, wd, checks)
        mn_out = torch.empty((rows, 1), dtype=wd, device=t.device)
        scale_out = torch.empty((rows, 1), dtype=wd, device=t.device)
        noise = None
        stochastic = self.params["stochastic"]
        if stochastic and len(blocks) == 1:  # one draw, as in the IPU-safe formulation
            noise = torch.rand((rows, g), dtype=wd, device=t.device, generator=generator)
        direct = not padded and g % per == 0  # whole bytes per row: pack block by block
        if direct:
            out = torch.empty(rows * g // per, dtype=torch.uint8, device=t.device)
        else:
            codes = torch.empty((rows, g), dtype=torch.uint8, device=t.device)
        buf = None
        for r0, r1, c0, c1 in blocks:
            xb = x[r0:r1, c0:c1]
            if whole_rows:
                mn, s, scale, safe, simple = self._group_params(xb, levels, wd, checks)
                mn_out[r0:r1], scale_out[r0:r1] = mn, scale
            else:
                mn, s, scale, safe, simple = params
                mn, safe = mn[r0:r1], safe[r0:r1]
                s = None if s is None else s[r0:r1]
            if buf is None or buf.numel() < xb.numel():
                buf = torch.empty(xb.numel(), dtype=wd, device=t.device)
            v = buf[: xb.numel()].view(xb.shape)
            if simple:  # s == 1 everywhere: (x - mn) / safe
                torch.sub(xb, mn, out=v).div_(safe)
            else:  # v = (x * s - mn * s) / (safe * s), as in the IPU-safe formulation
                torch.mul(xb, s, out=v).sub_(mn * s).div_(safe * s)
            if stochastic:
                # blocks on the CPU: the noise drawn block by block, in row-major order, is
                # the one draw piece by piece (the CPU generator's stream is consumed element
                # by element; the tests compare), without a full-size float32 noise tensor
                if noise is not None:
                    nb = noise[r0:r1, c0:c1]
                else:
                    nb = torch.rand(v.shape, dtype=wd, device=t.device, generator=generator)
                v.add_(nb).floor_()
            else:
                v.round_()
            v.clamp_(0.0, levels)
            if not simple:
                v.nan_to_num_(0.0)  # defined cast where the group's scale is NaN or inf
            # codes are whole numbers in [0, levels]: exact through int16 (or int8 for < 8
            # bits), a much faster cast than float -> uint8
            if direct:
                k0, k1 = (r0 * g + c0) // per, ((r1 - 1) * g + c1) // per
                if bits == 8:
                    out[k0:k1].view(v.shape).copy_(v.to(torch.int16))
                else:
                    pack_flat(v.to(torch.int8).view(torch.uint8).view(-1), bits, out=out[k0:k1])
            else:
                codes[r0:r1, c0:c1].copy_(v.to(torch.int16))
        if not whole_rows:
            mn_out, scale_out = params[0], params[2]
        if direct:
            packed = out.view(n, -1)
        else:
            packed = pack_codes_fast(codes.view(n, groups * g)[:, :m], bits)
        return packed, mn_out.reshape(n, groups), scale_out.reshape(n, groups)

    def _decompress_fast(  # unroller-lint: host-only (fast cpu/cuda path)
        self,
        codes: Tensor,
        mn: Tensor,
        scale: Tensor,
        full: tuple[int, ...],
        m: int,
        g: int,
        groups: int,
        levels: float,
        wd: torch.dtype,
        dtype: torch.dtype,
    ) -> Tensor:
        """``decompress`` with bit-identical output: per block of rows, the codes unpacked with
        shifts or a lookup table and x = q * scale + mn written into the output (one
        multiply, one in-place add); the halving, clamp and NaN steps only when some group
        needs them (on CUDA always)."""
        bits = self.params["bits"]
        per = 8 // bits
        n = codes.shape[0]
        rows = n * groups
        fmax = torch.finfo(wd).max
        mn = mn.to(wd).reshape(rows, 1)
        scale = scale.to(wd).reshape(rows, 1)
        # simple (only found with host checks): |q * scale + mn| <= |mn| + levels * scale stays
        # far inside the range (no halving, no clamp) and every scale is finite and >= +0, so
        # scale - scale is +0 and adding it changes nothing (x is never -0.0: q * scale >= +0).
        # A NaN or inf scale or mn fails the comparison.
        simple = skip_checks(codes) and bool(
            ((mn.abs() + scale * levels < fmax * 0.5) & ~torch.signbit(scale)).all()
        )
        if not simple:  # x = (mn * s + q * (scale * s)) / s, as in the IPU-safe formulation
            half = torch.full_like(scale, 0.5)
            s = torch.where(scale > fmax / (2.0 * levels), half, torch.ones_like(scale))
            scale_s, mn_s = scale * s, mn * s
            nan_term = scale - scale  # NaN where the group held NaN or +-inf
        padded = groups * g != m
        direct = not padded and g % per == 0  # whole bytes per row: unpack block by block
        if direct:
            flat = codes.reshape(-1)
            q_all = None
        else:
            q_all = unpack_codes_fast(codes, bits, m)
            if padded:
                q_all = torch.nn.functional.pad(q_all, (0, groups * g - m))
            q_all = q_all.reshape(rows, g)
        # written in the output dtype block by block, also where the groups are padded (then
        # cropped in that dtype): a float16 / bfloat16 output never has a float32 copy
        out = torch.empty((rows, g), dtype=dtype, device=codes.device)
        buf = None
        for r0, r1, c0, c1 in row_blocks(rows, g, host_checks(codes), multiple=per):
            if q_all is None:
                k0, k1 = (r0 * g + c0) // per, ((r1 - 1) * g + c1) // per
                qb = unpack_codes_fast(flat[k0:k1].view(1, -1), bits, (k1 - k0) * per)
                qb = qb.view(r1 - r0, c1 - c0)
            else:
                qb = q_all[r0:r1, c0:c1]
            ob = out[r0:r1, c0:c1]
            if dtype == wd:
                xb = ob
            else:
                if buf is None or buf.numel() < qb.numel():
                    buf = torch.empty(qb.numel(), dtype=wd, device=codes.device)
                xb = buf[: qb.numel()].view(qb.shape)
            # codes cast first (exact), then float * float: a uint8 * float product takes
            # TensorIterator's slower mixed-dtype loop, for the same bits
            xb.copy_(qb)
            if simple:
                xb.mul_(scale[r0:r1]).add_(mn[r0:r1])
            else:
                xb.mul_(scale_s[r0:r1]).add_(mn_s[r0:r1]).div_(s[r0:r1])
                xb.clamp_(-fmax, fmax).add_(nan_term[r0:r1])
            if xb is not ob:
                ob.copy_(xb)
        if padded:
            return out.view(n, groups * g)[:, :m].reshape(full).contiguous()
        return out.view(full)
