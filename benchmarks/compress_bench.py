"""The compression benchmark: compressor throughput, and what each scheme stores and costs.

    python -m benchmarks.compress_bench [--models resnet_like,unet_like] [--batch-size 32]
        [--repeats 31] [--warmup 3] [--threads N] [--seed 0] [--shape 32,64,64,64]
        [--out benchmarks/results/compress_bench.json]

Part 1, compressors (``unroller.compress``), on one realistic float32 activation of
``--shape`` (see ``activation_tensor``) and on its ReLU mask (bool): per configuration the
time of ``compress`` and of ``decompress``, their sum (the round trip) against
``torch.clone`` of the same tensor, the two interleaved in every round; throughput in GB/s
of RAW bytes (the input's bytes / the time), its ratio to clone's GB/s, the relative L2
error of the round trip and the stored/raw byte ratio.

Part 2, schemes (``nocompress``, ``dct-first``, ``dct-dense``, ``quant``) on the benchmark
models at ``--batch-size``: the bytes kept for backward as measured by the generated
model's ``stash_report()`` after one step, against nocompress over all kept tensors and
over only the tensors the scheme compresses; the train-step time against nocompress
(interleaved rounds, same weights and batch); the peak step memory.

The timing loop, the percentiles, the profiler memory measure and the machine description
are core_bench's (imported). Goals are printed as met / not met, never asserted. Writes
the JSON (``--out``) and a Markdown report next to it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from benchmarks import core_bench
from benchmarks.core_bench import MIB, profile_step, step_ours, summary, time_steps
from benchmarks.reference import REFERENCES, make_batch, model_path
from unroller.api import load_graph, load_model_class
from unroller.codegen import Options
from unroller.compress import make, packed_nbytes
from unroller.schemes import SCHEMES
from unroller.stash import plan_stash

DEFAULT_MODELS = ("resnet_like", "unet_like")
DEFAULT_OUT = Path("benchmarks/results/compress_bench.json")
DEFAULT_SHAPE = (32, 64, 64, 64)
BASELINE = "nocompress"
DENSE = "dct-dense"
DENSE_BYTES_GOAL = 1.0 / 12.0  # dct-dense stored / nocompress stored, same activations
DENSE_TIME_GOAL = 1.3  # dct-dense step time / nocompress step time
BLUR_SIGMA = 3.0  # pixels
CODEC_COST_REPEATS = 7  # timed calls per stored form in codec_cost (at most --repeats)

# (label, compressor name, parameters, input): input "activation" (float32) or "mask" (bool)
CODEC_CONFIGS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("dct default (b8 keep4 int8)", "dct", {}, "activation"),
    ("dct fold=True", "dct", {"fold": True}, "activation"),
    ("dct storage=bf16", "dct", {"storage": "bf16"}, "activation"),
    ("quant bits=8", "quant", {"bits": 8}, "activation"),
    ("quant bits=4", "quant", {"bits": 4}, "activation"),
    ("quant bits=2", "quant", {"bits": 2}, "activation"),
    ("bits (bool mask)", "bits", {}, "mask"),
)

ACTIVATION_TEXT = (
    "the output of torch.nn.Conv2d(3, C, 3, padding=1) (torch's default initialisation, "
    "seeded) applied to a batch of smooth images: a standard normal field [N, 3, H, W] "
    "blurred by a separable Gaussian of std {sigma} pixels (replicate padding) and "
    "normalised to zero mean and unit std per (sample, channel); float32, contiguous. "
    "The mask is that activation > 0 (a ReLU mask), torch.bool"
)

METHODS = {
    "codec_time": (
        "core_bench.time_steps(round_trip, clone, warmup, repeats) per configuration: in each "
        "round one round trip (compress, then decompress, each timed with time.perf_counter "
        "inside the call) and one torch.clone of the same input tensor, the first of the two "
        "alternating by round; garbage collector off while timing; all under torch.no_grad(). "
        "Both sides allocate their outputs, as they would in a training step"
    ),
    "codec_gbps": (
        "raw bytes of the input tensor (float32: 4 per element; mask: 1 per bool) / median "
        "seconds, in 1e9 bytes/s; for the round trip the time is compress + decompress. "
        "ratio_to_clone = median over rounds of clone_time / round_trip_time (= GB/s of the "
        "round trip / GB/s of clone within the round). Clone reads and writes each byte, so "
        "its memory traffic is twice the figure. ratio_to_pooled_clone = round-trip GB/s / "
        "the GB/s of the median of all float32 clones of every configuration pooled (the "
        "mask: its own clone's median)"
    ),
    "codec_error": (
        "relative L2 error ||x_hat - x|| / ||x|| of one round trip, computed in float64; "
        "stored/raw = packed_nbytes(compress(x)) / x's bytes (also checked equal to "
        "stored_bytes(shape, dtype))"
    ),
    "stored_bytes": (
        "measured: model.stash_report() after one training step of the generated model of "
        "each scheme (unroller.api.load_model_class(path, Options(scheme=S))); "
        "total_stored_bytes and total_raw_bytes; ratio_all = stored / nocompress's stored"
    ),
    "same_activations": (
        "the rows of the scheme's stash_report (keyed by 'tensor') whose compressor holds a "
        "lossy compressor (a part of the label that is neither 'raw' nor 'Bits(...)'); "
        "ratio = sum of their stored bytes under the scheme / sum of the stored bytes of the "
        "same keys under nocompress. Masks stored next to a compressed tensor (e.g. a ReLU "
        "output whose mask also goes to the ReLU backward) are counted in the scheme's bytes. "
        "mask_bytes comes from unroller.stash.plan_stash (the plan the code was generated "
        "from), whose totals are checked against the measured ones"
    ),
    "step_time": (
        "core_bench.time_steps(scheme_step, nocompress_step, warmup, repeats) per scheme "
        "(nocompress is also paired with itself, as a noise control): one step = "
        "model.zero_grad(set_to_none=True); model(*batch); all models hold the same weights "
        "and buffers (nocompress's state_dict loaded strictly) and get the same batch; "
        "ratio = median over rounds of scheme/nocompress within the round"
    ),
    "peak_memory": (
        "core_bench.profile_step (see core_bench's methods: profiler CPU allocation events "
        "of one step, gradients None before it); live_at_backward uses as marker the first "
        "aten op whose name contains 'backward' in a profiled step of that model (the loss "
        "backward), because the compressors call aten::ones_like, core_bench's marker, "
        "during the forward pass"
    ),
    "codec_cost": (
        "per scheme, every stored form that is not raw (from unroller.stash.plan_stash) "
        "gets compress + decompress timed alone on a standard normal tensor of its shape (a "
        "random bool mask for 1-bit forms): one warm-up round, then min(--repeats, 7) rounds "
        "over all forms; per form the median (min_ms: the fastest); total_ms sums the "
        "medians. The mask kernels (e.g. relu_mask) and the stash bookkeeping are not "
        "included"
    ),
    "gradient_check": (
        "one step of each scheme from the same state as nocompress: loss (must be equal, "
        "the forward is the same) and the relative L2 difference of all parameter "
        "gradients concatenated, against nocompress's"
    ),
}


# --------------------------------------------------------------------------- arguments


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,C,H,W integers, got {text!r}") from None
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected 4 positive integers N,C,H,W, got {text!r}")
    return dims


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compress_bench",
        description="Compressor throughput, and bytes, time and memory of compression schemes.",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma-separated model stems of benchmarks/models/ (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=31, help="timed rounds (both parts)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds (both parts)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, batch and tensor seed")
    parser.add_argument(
        "--shape",
        type=_shape,
        default=DEFAULT_SHAPE,
        help="N,C,H,W of the compressor benchmark's activation (default: 32,64,64,64)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON results file (.md written next to it)"
    )
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in REFERENCES]
    if unknown or not args.models:
        parser.error(f"unknown models {unknown}; known: {', '.join(sorted(REFERENCES))}")
    if args.batch_size < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch-size and --repeats must be >= 1, --warmup >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


# --------------------------------------------------------------------------- part 1: codecs


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


def rel_l2(x_hat: Tensor, x: Tensor) -> float:
    x64, d = x.double(), x_hat.double() - x.double()
    return float(d.norm() / max(float(x64.norm()), 1e-300))


def bench_codec(
    label: str, name: str, params: dict[str, Any], x: Tensor, warmup: int, repeats: int
) -> dict[str, Any]:
    codec = make(name, **params)
    shape, dtype = tuple(x.shape[1:]), x.dtype
    raw = x.numel() * x.element_size()
    with torch.no_grad():
        packed = codec.compress(x)
        x_hat = codec.decompress(packed, shape, dtype)
    stored = packed_nbytes(packed)
    predicted = codec.stored_bytes(tuple(x.shape), dtype)
    error = rel_l2(x_hat, x)
    exact = bool(torch.equal(x_hat, x))
    del packed, x_hat

    comp_ms: list[float] = []
    decomp_ms: list[float] = []

    def round_trip() -> None:
        with torch.no_grad():
            t0 = time.perf_counter()
            p = codec.compress(x)
            t1 = time.perf_counter()
            out = codec.decompress(p, shape, dtype)
            t2 = time.perf_counter()
        comp_ms.append((t1 - t0) * 1e3)
        decomp_ms.append((t2 - t1) * 1e3)
        del p, out

    def clone() -> None:
        with torch.no_grad():
            out = x.clone()
        del out

    timing = time_steps(round_trip, clone, warmup, repeats)
    comp_ms, decomp_ms = comp_ms[warmup:], decomp_ms[warmup:]
    trip = timing["ours"]["samples"]
    clone_ms = timing["autograd"]["samples"]
    ratio_samples = [c / r for r, c in zip(trip, clone_ms)]

    def gbps(ms: float) -> float:
        return raw / (ms * 1e-3) / 1e9

    return {
        "label": label,
        "compressor": repr(codec),
        "name": name,
        "params": codec.params,
        "input": "mask" if dtype == torch.bool else "activation",
        "shape": list(x.shape),
        "dtype": str(dtype).replace("torch.", ""),
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
            "round_trip": timing["ours"],
            "clone": timing["autograd"],
        },
        "gbps": {
            "round_trip": gbps(timing["ours"]["median"]),
            "compress": gbps(statistics.median(comp_ms)),
            "decompress": gbps(statistics.median(decomp_ms)),
            "clone": gbps(timing["autograd"]["median"]),
        },
        "ratio_to_clone": summary(ratio_samples),
        "ratio_to_clone_of_medians": timing["autograd"]["median"] / timing["ours"]["median"],
    }


def bench_codecs(args: argparse.Namespace) -> dict[str, Any]:
    act = activation_tensor(args.shape, args.seed)
    mask = act > 0
    inputs = {"activation": act, "mask": mask}
    results = [
        bench_codec(label, name, params, inputs[kind], args.warmup, args.repeats)
        for label, name, params, kind in CODEC_CONFIGS
    ]
    a64 = act.double()
    raw = act.numel() * act.element_size()
    pooled = [
        ms for c in results if c["input"] == "activation" for ms in c["time_ms"]["clone"]["samples"]
    ]
    pooled_gbps = raw / (statistics.median(pooled) * 1e-3) / 1e9
    for c in results:  # the mask against its own clone (medians)
        c["ratio_to_pooled_clone"] = (
            c["gbps"]["round_trip"] / pooled_gbps
            if c["input"] == "activation"
            else c["ratio_to_clone_of_medians"]
        )
    return {
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
        "configs": results,
    }


# --------------------------------------------------------------------------- part 2: schemes


def _lossy(label: str) -> bool:
    """Whether a stash_report compressor label holds a lossy compressor (not raw, not Bits)."""
    parts = [p.strip() for p in label.split(" + ")]
    return any(p != "raw" and not p.startswith("Bits(") for p in parts)


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_DTYPES["f64"] = torch.float64


def plan_figures(stem: str, scheme: str, batch: int) -> dict[str, Any]:
    """The stash plan the code was generated from: totals, the 1-bit mask bytes per key, and
    every stored form that is not raw (key, kind, compressor, full shape, dtype)."""
    plan = plan_stash(load_graph(model_path(stem)), Options(scheme=scheme).compression())
    report = plan.report(batch)
    masks: dict[str, int] = {}
    codec_keys = []
    forms = []
    for entry in plan.entries:
        for form in entry.forms:
            if form.kind == "raw":
                continue
            t = form.type or entry.type
            shape = tuple(batch if d == "N" else d for d in t.shape)
            dtype = torch.bool if form.kind == "mask" else _DTYPES[t.dtype]
            codec = form.codec.instance()
            forms.append((entry.key, form.kind, codec, shape, dtype))
            if form.kind == "mask":
                masks[entry.key] = masks.get(entry.key, 0) + codec.stored_bytes(shape, dtype)
        if any(form.kind == "codec" for form in entry.forms):
            codec_keys.append(entry.key)
    return {
        "total_stored_bytes": report["total_stored_bytes"],
        "total_raw_bytes": report["total_raw_bytes"],
        "mask_bytes": masks,
        "codec_keys": sorted(codec_keys),
        "forms": forms,
    }


def codec_cost(forms: list[tuple], repeats: int, seed: int) -> dict[str, Any]:
    """compress + decompress of every stored form of a scheme's step, timed alone on a
    standard normal tensor (a random mask for 1-bit forms) of the form's shape: one warm-up
    round, then ``repeats`` rounds over all forms (so a burst of load on the machine hits
    one round of every form rather than every round of one form); per form the median."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for _, _, _, shape, dtype in forms:
        if dtype == torch.bool:
            inputs.append(torch.rand(shape, generator=gen) > 0.5)
        else:
            inputs.append(torch.randn(shape, generator=gen).to(dtype))
    samples: list[list[float]] = [[] for _ in forms]
    with torch.no_grad():
        for r in range(repeats + 1):
            for i, (_, _, codec, shape, dtype) in enumerate(forms):
                t0 = time.perf_counter()
                out = codec.decompress(codec.compress(inputs[i]), tuple(shape[1:]), dtype)
                if r:
                    samples[i].append((time.perf_counter() - t0) * 1e3)
                del out
    rows = [
        {
            "tensor": key,
            "kind": kind,
            "compressor": repr(codec),
            "shape": list(shape),
            "ms": statistics.median(times),
            "min_ms": min(times),
        }
        for (key, kind, codec, shape, _), times in zip(forms, samples)
    ]
    return {
        "rows": rows,
        "total_ms": sum(r["ms"] for r in rows),
        "mask_ms": sum(r["ms"] for r in rows if r["kind"] == "mask"),
        "codec_ms": sum(r["ms"] for r in rows if r["kind"] == "codec"),
        "total_min_ms": sum(r["min_ms"] for r in rows),
    }


def backward_marker(run: Callable[[], Any]) -> str | None:
    """The first aten op of the step whose name contains 'backward' (the loss backward)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    del result
    _, first_start = core_bench._allocation_trace(prof)
    found = [(t, name) for name, t in first_start.items() if "backward" in name]
    return min(found)[1] if found else None


def grad_vector(model: nn.Module) -> Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
            for _, p in model.named_parameters()
        ]
    )


def build_models(stem: str, seed: int, directory: Path) -> dict[str, nn.Module]:
    """One generated model per scheme, all with nocompress's default-initialised state."""
    torch.manual_seed(seed)
    models: dict[str, nn.Module] = {}
    for scheme in [BASELINE, *(s for s in SCHEMES if s != BASELINE)]:  # baseline first
        cls = load_model_class(model_path(stem), Options(scheme=scheme), directory / scheme)
        models[scheme] = cls()
    state = models[BASELINE].state_dict()
    for model in models.values():
        model.load_state_dict(state, strict=True)
        model.train()
    return models


def same_activations(rows: list[dict], base_rows: dict[str, dict]) -> dict[str, Any]:
    keys = [r["tensor"] for r in rows if _lossy(r["compressor"])]
    scheme_bytes = sum(r["stored_bytes"] for r in rows if r["tensor"] in keys)
    base_bytes = sum(base_rows[k]["stored_bytes"] for k in keys)
    return {
        "tensors": keys,
        "count": len(keys),
        "nocompress_stored_bytes": base_bytes,
        "scheme_stored_bytes": scheme_bytes,
        "ratio": scheme_bytes / base_bytes if base_bytes else None,
    }


def bench_model(stem: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="compress_bench-") as tmp:
        models = build_models(stem, args.seed, Path(tmp))
    batch = make_batch(stem, args.batch_size, seed=args.seed)

    # one step each from the same state: measured stash, loss, gradients
    reports: dict[str, dict] = {}
    checks: dict[str, dict] = {}
    base_grads: Tensor | None = None
    base_loss = None
    for scheme, model in models.items():
        loss = step_ours(model, batch)
        reports[scheme] = model.stash_report()
        grads = grad_vector(model)
        if base_grads is None:
            base_grads, base_loss = grads, float(loss)
        checks[scheme] = {
            "loss": float(loss),
            "loss_equal_to_nocompress": float(loss) == base_loss,
            "grad_rel_diff_vs_nocompress": float(
                (grads - base_grads).norm() / max(float(base_grads.norm()), 1e-300)
            ),
        }

    # time: each scheme paired with nocompress (nocompress with itself as a control)
    base = models[BASELINE]
    timings = {}
    for scheme, model in models.items():
        t = time_steps(
            lambda m=model: step_ours(m, batch),
            lambda: step_ours(base, batch),
            args.warmup,
            args.repeats,
        )
        timings[scheme] = {
            "unit": "ms",
            "scheme": t["ours"],
            "nocompress": t["autograd"],
            "ratio": t["ratio"],
        }

    # memory
    memory = {}
    for scheme, model in models.items():
        marker = backward_marker(lambda m=model: step_ours(m, batch))
        model.zero_grad(set_to_none=True)
        mem = profile_step(lambda m=model: step_ours(m, batch), marker or core_bench.SEED_OP)
        mem["backward_marker"] = marker
        memory[scheme] = mem

    base_report = reports[BASELINE]
    base_rows = {r["tensor"]: r for r in base_report["rows"]}
    schemes = []
    for scheme in models:
        rep = reports[scheme]
        plan = plan_figures(stem, scheme, args.batch_size)
        same = same_activations(rep["rows"], base_rows)
        mask_in_same = sum(plan["mask_bytes"].get(k, 0) for k in same["tensors"])
        same["mask_bytes_in_scheme"] = mask_in_same
        lossy_bytes = same["scheme_stored_bytes"] - mask_in_same
        same["ratio_without_masks"] = (
            lossy_bytes / same["nocompress_stored_bytes"] if same["count"] else None
        )
        raw_rows = [r for r in rep["rows"] if r["compressor"] == "raw"]
        schemes.append(
            {
                "scheme": scheme,
                "stash": rep,
                "total_stored_bytes": rep["total_stored_bytes"],
                "total_raw_bytes": rep["total_raw_bytes"],
                "ratio_all": rep["total_stored_bytes"] / base_report["total_stored_bytes"],
                "same_activations": same,
                "mask_bytes_total": sum(plan["mask_bytes"].values()),
                "raw_kept_bytes": sum(r["stored_bytes"] for r in raw_rows),
                "raw_kept_count": len(raw_rows),
                "plan": {
                    "total_stored_bytes": plan["total_stored_bytes"],
                    "matches_measured": plan["total_stored_bytes"] == rep["total_stored_bytes"]
                    and plan["codec_keys"] == sorted(same["tensors"]),
                },
                "time": timings[scheme],
                "codec_cost": codec_cost(
                    plan["forms"], min(args.repeats, CODEC_COST_REPEATS), args.seed
                ),
                "extra_step_ms": statistics.median(
                    a - b
                    for a, b in zip(
                        timings[scheme]["scheme"]["samples"],
                        timings[scheme]["nocompress"]["samples"],
                    )
                ),
                "memory": memory[scheme],
                "check": checks[scheme],
            }
        )
    by = {s["scheme"]: s for s in schemes}
    goals: dict[str, Any] = {}
    if DENSE in by:
        ratio = by[DENSE]["same_activations"]["ratio"]
        tr = by[DENSE]["time"]["ratio"]["median"]
        goals = {
            "dense_bytes": {
                "goal": "dct-dense stored bytes <= 1/12 of nocompress's, same activations",
                "value": ratio,
                "met": ratio is not None and ratio <= DENSE_BYTES_GOAL,
            },
            "dense_time": {
                "goal": f"dct-dense step time <= {DENSE_TIME_GOAL}x nocompress (median ratio)",
                "value": tr,
                "met": tr <= DENSE_TIME_GOAL,
            },
        }
    return {
        "model": stem,
        "model_file": f"benchmarks/models/{model_path(stem).name}",
        "batch_size": args.batch_size,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in base.parameters()),
        "schemes": schemes,
        "goals": goals,
    }


# --------------------------------------------------------------------------- output


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.2f}"


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def _inv(ratio: float | None) -> str:
    """A byte ratio as '0.0833 (1/12.0)'."""
    if ratio is None:
        return "n/a"
    return f"{ratio:.4f} (1/{1 / ratio:.1f})" if ratio > 0 else f"{ratio:.4f}"


def limits_paragraph(results: dict[str, Any]) -> str:
    """What limits the figures, with this run's numbers filled in."""
    configs = results["codecs"]["configs"]
    floats = [c for c in configs if c["input"] == "activation"]
    clone = results["codecs"]["clone_pooled"]
    best = max(floats, key=lambda c: c["gbps"]["round_trip"])
    worst = min(floats, key=lambda c: c["gbps"]["round_trip"])
    threads = results["meta"]["num_threads"]
    spread = (
        ": a clone of a large tensor may or may not page-fault a fresh buffer, whatever the "
        "allocator did before"
        if clone["max_gbps"] > 1.5 * clone["median_gbps"]
        else ""
    )
    general = (
        "What limits these figures. The compressors are eager, unfused PyTorch: every "
        "reshape, matmul, cast, clamp and bit-packing step writes a full-size temporary, so "
        f"their round trips run at {worst['gbps']['round_trip']:.2f} ({worst['label']}) to "
        f"{best['gbps']['round_trip']:.2f} GB/s ({best['label']}) of raw float32 bytes, "
        f"against {clone['median_gbps']:.2f} GB/s for torch.clone (median of all float32 "
        f"clones; best {clone['max_gbps']:.2f} GB/s{spread}). Their cost is paid in the forward "
        "(compress) and in the backward (decompress) of every compressed tensor, and is "
        f"compared with convolutions that run on {threads} CPU thread(s); on an accelerator the "
        "convolutions speed up far more than these memory-bound op chains, so fused kernels "
        "matter more there. Stored bytes are exact (the packed tensors' bytes), but peak "
        "step memory falls much less than stored bytes: it also holds each raw tensor until "
        "its last forward use, the codecs' temporaries, decompressed tensors and gradients "
        "during the backward. The gradient differences are for the benchmark batches of "
        "make_batch, which are white noise (ResNet: standard normal images; U-Net: uniform "
        "noise plus noise), so the early activations are not smooth and DCT+Chop's 16 of 64 "
        "coefficients lose most of their energy; part 1's smooth activation shows the "
        "working range."
    )
    parts = [general]
    for model in results["models"]:
        by = {s["scheme"]: s for s in model["schemes"]}
        if DENSE not in by or BASELINE not in by:
            continue
        d, base = by[DENSE], by[BASELINE]
        same, cost = d["same_activations"], d["codec_cost"]
        bn = sum(
            r["stored_bytes"]
            for r in d["stash"]["rows"]
            if r["tensor"].endswith((":save_mean", ":save_invstd"))
        )
        raw_names = [
            r["tensor"]
            for r in d["stash"]["rows"]
            if r["compressor"] == "raw" and not r["tensor"].endswith((":save_mean", ":save_invstd"))
        ]
        quant = (
            f"; quant (8 bits): {by['quant']['check']['grad_rel_diff_vs_nocompress']:.3g}"
            if "quant" in by
            else ""
        )
        share = (
            f", {100 * cost['total_ms'] / d['extra_step_ms']:.0f}% of the extra time"
            if d["extra_step_ms"] > 0
            else ""
        )
        parts.append(
            f"{model['model']}: dct-dense's {same['count']} compressed tensors hold "
            f"{_mib(same['scheme_stored_bytes'])} MiB, of which "
            f"{_mib(same['mask_bytes_in_scheme'])} MiB are 1-bit masks kept next to the DCT "
            "coefficients (ReLU and max-pool outputs whose own backward needs a mask while the "
            "next op's backward needs the values); without them the same-activation ratio "
            f"would be {_inv(same['ratio_without_masks'])} instead of {_inv(same['ratio'])}. "
            f"{d['raw_kept_count']} tensors ({_mib(d['raw_kept_bytes'])} MiB) stay raw: "
            f"{', '.join(raw_names)} and the batch-norm statistics save_mean/save_invstd "
            f"({bn} bytes in all). The step took {d['time']['ratio']['median']:.2f}x "
            f"nocompress's (median per-round difference {d['extra_step_ms']:+.1f} ms, "
            f"nocompress {base['time']['scheme']['median']:.1f} ms); compress + decompress "
            "of its stored forms, timed alone on tensors of the same shapes, take "
            f"{cost['total_ms']:.1f} ms ({cost['codec_ms']:.1f} ms DCT, "
            f"{cost['mask_ms']:.1f} ms 1-bit masks){share}. "
            "Gradient relative L2 difference from nocompress: "
            f"{d['check']['grad_rel_diff_vs_nocompress']:.3g}{quant}. Peak step memory "
            f"{_mib(d['memory']['peak_bytes'])} MiB against {_mib(base['memory']['peak_bytes'])}"
            f" MiB; live when the backward begins {_mib(d['memory']['live_at_backward_bytes'])}"
            f" MiB against {_mib(base['memory']['live_at_backward_bytes'])} MiB."
        )
    return "\n\n".join(parts)


def format_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    act = results["codecs"]["activation"]
    lines = [
        "## compress_bench: activation compressors and compression schemes (float32, CPU)",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta.get('cpu_model') or meta['processor']!r}, {meta['machine']}, "
        f"{meta['cpu_count']} CPUs, {meta['platform']}",
        f"- torch {meta['torch']}, torch.get_num_threads() = {meta['num_threads']}, "
        f"python {meta['python']}",
        f"- command: `{meta['command']}`",
        f"- warm-up rounds {meta['args']['warmup']}, timed rounds {meta['args']['repeats']}; "
        f"wall time {meta['wall_seconds']:.0f} s; load average (1/5/15 min) at start "
        f"{meta['loadavg_start']}, at end {meta['loadavg_end']} (other jobs share the machine "
        "when these exceed the threads used)",
        "",
        f"### Compressors: round trip vs torch.clone on {act['shape']} float32 "
        f"({_mib(act['raw_bytes'])} MiB)",
        "",
        f"Tensor: {act['description']}. Mean {act['mean']:.3f}, std {act['std']:.3f}, "
        f"{100 * act['fraction_positive']:.1f}% positive.",
        "",
        "| configuration | input | compress ms | decompress ms | round trip ms (p10/p90) "
        "| round trip GB/s | clone ms | clone GB/s | GB/s ratio to clone (p10/p90) "
        "| ratio to pooled clone | rel. L2 error | stored/raw |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results["codecs"]["configs"]:
        t, g, r = c["time_ms"], c["gbps"], c["ratio_to_clone"]
        rt = t["round_trip"]
        lines.append(
            f"| {c['label']} | {c['dtype']} {_mib(c['raw_bytes'])} MiB "
            f"| {t['compress']['median']:.2f} | {t['decompress']['median']:.2f} "
            f"| {rt['median']:.2f} ({rt['p10']:.2f}/{rt['p90']:.2f}) | {g['round_trip']:.2f} "
            f"| {t['clone']['median']:.2f} | {g['clone']:.2f} "
            f"| {r['median']:.3f} ({r['p10']:.3f}/{r['p90']:.3f}) "
            f"| {c['ratio_to_pooled_clone']:.3f} | {c['rel_l2_error']:.3g} | {c['stored_over_raw']:.4f} |"
        )
    cp = results["codecs"]["clone_pooled"]
    lines += [
        "",
        f"All float32 clones pooled: median {cp['time_ms']['median']:.2f} ms "
        f"({cp['median_gbps']:.2f} GB/s), fastest {cp['time_ms']['min']:.2f} ms "
        f"({cp['max_gbps']:.2f} GB/s), slowest {cp['time_ms']['max']:.2f} ms.",
    ]
    lines += [
        "",
        "### Schemes: bytes kept for backward (measured by stash_report), step time, memory",
        "",
        "| model | scheme | stored MiB / raw MiB | stored / nocompress (all) "
        "| same activations: n, nocompress MiB -> scheme MiB | ratio same act. (masks incl.) "
        "| step ms median (p10/p90) | ratio vs nocompress (p10/p90) "
        "| codecs alone ms (masks) | peak MiB | live at bwd MiB | grad rel. diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results["models"]:
        for s in m["schemes"]:
            sa, t, mem = s["same_activations"], s["time"], s["memory"]
            st = t["scheme"]
            lines.append(
                f"| {m['model']} b{m['batch_size']} | {s['scheme']} "
                f"| {_mib(s['total_stored_bytes'])} / {_mib(s['total_raw_bytes'])} "
                f"| {_inv(s['ratio_all'])} "
                f"| {sa['count']}, {_mib(sa['nocompress_stored_bytes'])} -> "
                f"{_mib(sa['scheme_stored_bytes'])} | {_inv(sa['ratio'])} "
                f"| {st['median']:.1f} ({st['p10']:.1f}/{st['p90']:.1f}) "
                f"| {t['ratio']['median']:.3f} ({t['ratio']['p10']:.3f}/{t['ratio']['p90']:.3f}) "
                f"| {s['codec_cost']['total_ms']:.1f} ({s['codec_cost']['mask_ms']:.1f}) "
                f"| {_mib(mem['peak_bytes'])} | {_mib(mem['live_at_backward_bytes'])} "
                f"| {s['check']['grad_rel_diff_vs_nocompress']:.3g} |"
            )
    lines += [
        "",
        "(nocompress's row pairs it with itself: its ratio shows the timing noise. "
        "Step-time p10/p90 are of the scheme's own steps. 'codecs alone': compress + "
        "decompress of every stored form of the step, timed outside it on tensors of the "
        "same shapes; in parentheses the 1-bit masks' share.)",
        "",
        "Goals (reported, never asserted):",
        "",
    ]
    for m in results["models"]:
        g = m["goals"]
        if not g:
            lines.append(f"- {m['model']}: dct-dense not measured")
            continue
        lines.append(
            f"- {m['model']}: dct-dense stores <= 1/12 of nocompress for the same activations: "
            f"{_met(g['dense_bytes']['met'])} ({_inv(g['dense_bytes']['value'])}); "
            f"dct-dense step time <= {DENSE_TIME_GOAL}x nocompress: "
            f"{_met(g['dense_time']['met'])} ({g['dense_time']['value']:.3f})"
        )
    lines += ["", "Checks:", ""]
    for m in results["models"]:
        bits = []
        for s in m["schemes"]:
            bits.append(
                f"{s['scheme']} loss {s['check']['loss']:.6g}"
                f"{'' if s['check']['loss_equal_to_nocompress'] else ' (DIFFERS)'}, "
                f"plan {'matches' if s['plan']['matches_measured'] else 'DIFFERS from'} "
                f"measured, masks {_mib(s['mask_bytes_total'])} MiB"
            )
        lines.append(f"- {m['model']}: " + "; ".join(bits))
    lines += ["", "### What limits the figures", "", results["limits"], "", "### Methods", ""]
    lines += [f"- {k}: {v}" for k, v in METHODS.items()]
    return "\n".join(lines) + "\n"


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """core_bench's machine description, with this benchmark's command and arguments."""
    meta = core_bench.machine_info(args, argv)
    meta["cpu_model"] = _cpu_model()
    meta["loadavg_start"] = _loadavg()
    meta["command"] = shlex.join(["python", "-m", "benchmarks.compress_bench", *argv])
    meta["args"] = {
        "models": args.models,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "seed": args.seed,
        "shape": list(args.shape),
        "out": str(args.out),
    }
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results: dict[str, Any] = {"meta": machine_info(args, argv), "methods": METHODS}
    results["goals_defined"] = {
        "dense_bytes": f"dct-dense same-activation stored ratio <= 1/12 ({DENSE_BYTES_GOAL:.5f})",
        "dense_time": f"dct-dense median step-time ratio vs nocompress <= {DENSE_TIME_GOAL}",
    }
    results["codecs"] = bench_codecs(args)
    results["models"] = [bench_model(stem, args) for stem in args.models]
    results["limits"] = limits_paragraph(results)
    results["meta"]["wall_seconds"] = time.perf_counter() - started
    results["meta"]["loadavg_end"] = _loadavg()
    text = format_markdown(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md = args.out.with_suffix(".md")
    md.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} and {md} ({results['meta']['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
