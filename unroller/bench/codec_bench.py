"""The compress preset, part 1: compressor throughput and error on a realistic activation.

A compressor's cost is what its round trip (compress, then decompress) takes against
``torch.clone`` of the same tensor, the cheapest thing that reads and writes it once;
both run interleaved in every round, so load on the machine hits them alike. The input
is the output of a real conv layer on smooth images (``activation_tensor``) and its
ReLU mask, since white noise would be the worst case for DCT+Chop.

Each round trip is timed twice: eagerly, and under torch.compile (compress and decompress
compiled apart, as a compiled step keeps the packed form between them), where the codec
chains fuse; the goal is a compiled round trip at half a copy's bandwidth or better.
The tensors live on ``--device`` (the CPU by default; the same code on CUDA).

The ``quant`` configurations also run on a token tensor [N, L, E] of the same byte count
(``token_tensor``), where groups are tokens (rows of E values) rather than channels. On the
CPU they run the native kernels when those could be built (``unroller.compress.native``);
``native`` in the results says whether they were, and why not.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroller.bench.stats import summary
from unroller.bench.timing import synchronize, time_interleaved
from unroller.compress import base, make, native, packed_nbytes

BLUR_SIGMA = 3.0  # pixels
COMPILED_GOAL = 0.5  # a compiled round trip at half a copy's bandwidth or better

# (label, compressor name, parameters, input): input "activation" (float32 [N, C, H, W]),
# "tokens" (float32 [N, L, E], the same bytes) or "mask" (bool)
CODEC_CONFIGS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("dct default (b8 keep4 int8)", "dct", {}, "activation"),
    ("dct fold=True", "dct", {"fold": True}, "activation"),
    ("dct storage=bf16", "dct", {"storage": "bf16"}, "activation"),
    ("quant bits=8", "quant", {"bits": 8}, "activation"),
    ("quant bits=4", "quant", {"bits": 4}, "activation"),
    ("quant bits=2", "quant", {"bits": 2}, "activation"),
    ("quant bits=8 tokens", "quant", {"bits": 8}, "tokens"),
    ("quant bits=4 tokens", "quant", {"bits": 4}, "tokens"),
    ("quant bits=2 tokens", "quant", {"bits": 2}, "tokens"),
    ("quant bits=2 stochastic tokens", "quant", {"bits": 2, "stochastic": True}, "tokens"),
    ("fewbit bits=3 gelu", "fewbit", {"bits": 3, "function": "gelu"}, "activation"),
    ("bits (bool mask)", "bits", {}, "mask"),
)
TOKEN_WIDTHS = (768, 512, 256, 128, 64)
"""E of the token tensor: the first of these that divides C * H * W (else W)."""

ACTIVATION_TEXT = (
    "the output of torch.nn.Conv2d(3, C, 3, padding=1) (torch's default initialisation, "
    "seeded) applied to a batch of smooth images: a standard normal field [N, 3, H, W] "
    "blurred by a separable Gaussian of std {sigma} pixels (replicate padding) and "
    "normalised to zero mean and unit std per (sample, channel); float32, contiguous. "
    "The mask is that activation > 0 (a ReLU mask), torch.bool"
)


def gaussian_blur(x: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of [N, C, H, W] per channel, replicate padding."""
    radius = max(1, int(math.ceil(3 * sigma)))
    offsets = torch.arange(-radius, radius + 1, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    c = x.shape[1]
    rows = kernel.reshape(1, 1, 1, -1).expand(c, 1, 1, -1)
    cols = kernel.reshape(1, 1, -1, 1).expand(c, 1, -1, 1)
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), rows, groups=c)
    return F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), cols, groups=c)


def activation_tensor(shape: Sequence[int], seed: int) -> Tensor:
    """A smooth-ish float32 activation [N, C, H, W]: a real conv layer on smooth images."""
    n, c, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        images = gaussian_blur(torch.randn(n, 3, h, w, generator=gen), BLUR_SIGMA)
        mean = images.mean(dim=(2, 3), keepdim=True)
        std = images.std(dim=(2, 3), keepdim=True).clamp_min(1e-12)
        images = (images - mean) / std
        torch.manual_seed(seed)
        conv = nn.Conv2d(3, c, 3, padding=1)
        return conv(images).contiguous()


TOKEN_TEXT = (
    "torch.nn.Linear(E, E) (torch's default initialisation, seeded) applied to "
    "torch.nn.functional.layer_norm of standard normal tokens [N, L, E]: what a transformer "
    "block saves for the backward of its next linear layer; float32, contiguous, as many "
    "bytes as the activation"
)


def token_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """[N, L, E] with the elements of the map ``shape`` [N, C, H, W] (``TOKEN_WIDTHS``)."""
    n, c, h, w = shape
    per = c * h * w
    e = next((e for e in TOKEN_WIDTHS if per % e == 0), w)
    return n, per // e, e


def token_tensor(shape: Sequence[int], seed: int) -> Tensor:
    """A float32 token tensor [N, L, E]: a seeded linear layer on layer-normed tokens."""
    n, length, e = shape
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        x = F.layer_norm(torch.randn(n, length, e, generator=gen), (e,))
        torch.manual_seed(seed)
        return nn.Linear(e, e)(x).contiguous()


def rel_l2(x_hat: Tensor, x: Tensor) -> float:
    x64, d = x.double(), x_hat.double() - x.double()
    return float(d.norm() / max(float(x64.norm()), 1e-300))


def _compiled_round_trip(
    codec: Any, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[Callable[[Tensor], tuple[Tensor, ...]], Callable[[tuple[Tensor, ...]], Tensor]]:
    """``codec``'s compress and decompress, each under torch.compile (two graphs, as in a
    compiled step, where the packed form is kept between them; compiled as one graph, the
    compiler could skip a storage rounding by fusing it with the decompression's cast)."""

    def compress(t: Tensor) -> tuple[Tensor, ...]:
        return codec.compress(t)

    def decompress(packed: tuple[Tensor, ...]) -> Tensor:
        return codec.decompress(packed, shape, dtype)

    return torch.compile(compress, dynamic=False), torch.compile(decompress, dynamic=False)


def bench_codec(
    label: str,
    name: str,
    params: dict[str, Any],
    x: Tensor,
    warmup: int,
    repeats: int,
    compiled: bool = True,
    kind: str | None = None,
) -> dict[str, Any]:
    """One configuration: bytes, error, and the round trip timed against ``torch.clone``,
    eagerly and (``compiled``) under torch.compile, the three interleaved round by round.
    ``kind`` names the input in the results (default: "mask" for bool, else "activation")."""
    codec = make(name, **params)
    shape, dtype, device = tuple(x.shape[1:]), x.dtype, x.device
    raw = x.numel() * x.element_size()
    with torch.no_grad():
        packed = codec.compress(x)
        x_hat = codec.decompress(packed, shape, dtype)
    stored = packed_nbytes(packed)
    predicted = codec.stored_bytes(tuple(x.shape), dtype)
    error = rel_l2(x_hat, x)
    exact = bool(torch.equal(x_hat, x))
    del packed

    comp_ms: list[float] = []
    decomp_ms: list[float] = []

    def round_trip() -> None:
        with torch.no_grad():
            t0 = time.perf_counter()
            p = codec.compress(x)
            synchronize(device)
            t1 = time.perf_counter()
            out = codec.decompress(p, shape, dtype)
            synchronize(device)
            t2 = time.perf_counter()
        comp_ms.append((t1 - t0) * 1e3)
        decomp_ms.append((t2 - t1) * 1e3)
        del p, out

    def clone() -> None:
        with torch.no_grad():
            out = x.clone()
        del out

    sides: dict[str, Callable[[], Any]] = {"trip": round_trip, "clone": clone}
    fused = _compile_side(codec, x, x_hat, sides) if compiled else None
    del x_hat
    found = time_interleaved(sides, warmup, repeats, None, device)
    timing = {side: found[side]["time_ms"] for side in sides}
    comp_ms, decomp_ms = comp_ms[-repeats:], decomp_ms[-repeats:]
    trip = timing["trip"]["samples"]
    clone_ms = timing["clone"]["samples"]
    ratio_samples = [c / r for r, c in zip(trip, clone_ms)]

    def gbps(ms: float) -> float:
        return raw / (ms * 1e-3) / 1e9

    result = {
        "label": label,
        "compressor": repr(codec),
        "name": name,
        "params": codec.params,
        "input": kind or ("mask" if dtype == torch.bool else "activation"),
        "shape": list(x.shape),
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "stored_bytes_predicted": predicted,
        "stored_over_raw": stored / raw,
        "stored_over_float32": stored / (x.numel() * 4),
        "rel_l2_error": error,
        "exact": exact,
        "time_ms": {
            "compress": summary(comp_ms),
            "decompress": summary(decomp_ms),
            "round_trip": timing["trip"],
            "clone": timing["clone"],
        },
        "gbps": {
            "round_trip": gbps(timing["trip"]["median"]),
            "compress": gbps(statistics.median(comp_ms)),
            "decompress": gbps(statistics.median(decomp_ms)),
            "clone": gbps(timing["clone"]["median"]),
        },
        "ratio_to_clone": summary(ratio_samples),
        "ratio_to_clone_of_medians": timing["clone"]["median"] / timing["trip"]["median"],
    }
    if fused is not None:
        result["compiled"] = _compiled_figures(fused, timing, raw)
    return result


def _compile_side(
    codec: Any, x: Tensor, x_hat: Tensor, sides: dict[str, Callable[[], Any]]
) -> dict[str, Any]:
    """Compile ``codec``'s round trip on ``x`` (timed: the first call), check it against the
    eager one (``x_hat``; not for stochastic rounding, whose noise the compiled graph draws
    from its own generator: ``equal_to_eager`` None) and add it to ``sides`` as "compiled";
    what torch.compile raised, if it failed (no C++ compiler, an unsupported device),
    instead of a side."""
    shape, dtype, device = tuple(x.shape[1:]), x.dtype, x.device
    # every configuration compiles the same two wrappers anew: without a reset the wrappers'
    # recompilations pass torch._dynamo's cache limit after eight and the rest run eagerly
    torch.compiler.reset()
    compress, decompress = _compiled_round_trip(codec, shape, dtype)
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = decompress(compress(x))
            synchronize(device)
            compile_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported in the results, never fatal
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    same: bool | None = None
    max_diff: float | None = None
    if not codec.params.get("stochastic"):  # the compiled graph draws its noise otherwise
        same = bool(torch.equal(out, x_hat))
        max_diff = 0.0 if same else float((out.double() - x_hat.double()).abs().max())
    del out

    def compiled_trip() -> None:
        with torch.no_grad():
            out = decompress(compress(x))
        del out

    sides["compiled"] = compiled_trip
    return {"compile_s": compile_s, "equal_to_eager": same, "max_abs_diff_to_eager": max_diff}


def _compiled_figures(
    fused: dict[str, Any], timing: dict[str, dict[str, Any]], raw: int
) -> dict[str, Any]:
    """The compiled round trip's figures: its time, GB/s and ratio to the clone's bandwidth
    (per round, and of the medians), beside the compile time and the check against eager."""
    if "error" in fused:
        return fused
    trip, clone_ms = timing["compiled"]["samples"], timing["clone"]["samples"]
    median = timing["compiled"]["median"]
    return {
        **fused,
        "time_ms": timing["compiled"],
        "gbps": raw / (median * 1e-3) / 1e9,
        "ratio_to_clone": summary([c / r for r, c in zip(trip, clone_ms)]),
        "ratio_to_clone_of_medians": timing["clone"]["median"] / median,
        "speedup_over_eager": timing["trip"]["median"] / median,
    }


def bench_codecs(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration of ``CODEC_CONFIGS`` on the activation of ``--shape`` or its
    mask, and all float32 clones pooled (the reference throughput). ``args.device`` (if
    set; default the CPU) is where the tensors live; ``args.compile_codecs`` False skips
    the compiled round trips."""
    device = torch.device(getattr(args, "device", None) or "cpu")
    compiled = getattr(args, "compile_codecs", True)
    act = activation_tensor(args.shape, args.seed).to(device)
    mask = act > 0
    tokens = token_tensor(token_shape(args.shape), args.seed).to(device)
    inputs = {"activation": act, "mask": mask, "tokens": tokens}
    results = [
        bench_codec(label, name, params, inputs[kind], args.warmup, args.repeats, compiled, kind)
        for label, name, params, kind in CODEC_CONFIGS
    ]
    a64 = act.double()
    raw = act.numel() * act.element_size()
    pooled = [
        ms for c in results if c["input"] == "activation" for ms in c["time_ms"]["clone"]["samples"]
    ]
    pooled_gbps = raw / (statistics.median(pooled) * 1e-3) / 1e9
    for c in results:  # the mask against its own clone (medians); tokens: as many bytes
        c["ratio_to_pooled_clone"] = (
            c["gbps"]["round_trip"] / pooled_gbps
            if c["input"] in ("activation", "tokens")
            else c["ratio_to_clone_of_medians"]
        )
    lib = native.library() if device.type == "cpu" else None
    return {
        "device": str(device),
        "compiled_goal": f"compiled round trip >= {COMPILED_GOAL}x a clone's bandwidth",
        "clone_pooled": {
            "what": "every timed torch.clone of the float32 activation, all configurations",
            "time_ms": summary(pooled),
            "median_gbps": pooled_gbps,
            "max_gbps": raw / (min(pooled) * 1e-3) / 1e9,
        },
        "activation": {
            "description": ACTIVATION_TEXT.format(sigma=BLUR_SIGMA),
            "shape": list(act.shape),
            "dtype": "float32",
            "raw_bytes": act.numel() * act.element_size(),
            "mean": float(a64.mean()),
            "std": float(a64.std()),
            "fraction_positive": float(mask.double().mean()),
        },
        "tokens": {
            "description": TOKEN_TEXT,
            "shape": list(tokens.shape),
            "dtype": "float32",
            "raw_bytes": tokens.numel() * tokens.element_size(),
        },
        "native": {
            "used": lib is not None and base.NATIVE,
            "why_not": None if lib is not None else native.build_error() or "not on the CPU",
            "threads": torch.get_num_threads(),
        },
        "configs": results,
    }
