"""The compress preset, part 2: what each compression scheme stores and costs on a model.

Per scheme, the generated module of one benchmark model: the bytes kept for backward
as its ``stash_report()`` measures them after one step (against nocompress, over all
kept tensors and over the tensors the scheme compresses), the step time against
nocompress (interleaved rounds, same weights and batch; nocompress against itself as a
noise control), the peak step memory, the time its codecs take alone, and the gradient
difference from nocompress. The stash plan the code was generated from is checked
against the measured bytes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from unroller.api import compression_config, load_graph, load_model_class
from unroller.bench.profiling import SEED_OP, backward_marker, profile_step
from unroller.bench.reference import Benchmark
from unroller.bench.stashed import same_activations
from unroller.bench.steps import step_ours
from unroller.bench.timing import time_pair
from unroller.compiler.dtypes import torch_dtype
from unroller.compiler.options import Options
from unroller.compiler.schemes import SCHEMES
from unroller.compiler.stash import plan_stash

BASELINE = "nocompress"
DENSE = "dct-dense"
DENSE_BYTES_GOAL = 1.0 / 12.0  # dct-dense stored / nocompress stored, same activations
DENSE_TIME_GOAL = 1.3  # dct-dense step time / nocompress step time
CODEC_COST_REPEATS = 7  # timed calls per stored form in codec_cost (at most --repeats)


def plan_figures(path: Path, scheme: str, batch: int) -> dict[str, Any]:
    """The stash plan the code was generated from: totals, the 1-bit mask bytes per key, and
    every stored form that is not raw (key, kind, compressor, full shape, dtype)."""
    graph = load_graph(path)
    plan = plan_stash(graph, compression_config(Options(scheme=scheme), graph))
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
            dtype = torch_dtype("bool" if form.kind == "mask" else t.dtype)
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


def grad_vector(model: nn.Module) -> Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
            for _, p in model.named_parameters()
        ]
    )


def build_models(path: Path, seed: int, directory: Path) -> dict[str, nn.Module]:
    """One generated model per scheme, all with nocompress's default-initialised state."""
    torch.manual_seed(seed)
    models: dict[str, nn.Module] = {}
    for scheme in [BASELINE, *(s for s in SCHEMES if s != BASELINE)]:  # baseline first
        cls = load_model_class(path, Options(scheme=scheme), directory / scheme)
        models[scheme] = cls()
    state = models[BASELINE].state_dict()
    for model in models.values():
        model.load_state_dict(state, strict=True)
        model.train()
    return models


def bench_model(bench: Benchmark, args: argparse.Namespace) -> dict[str, Any]:
    """Every scheme on one model: stash, checks, time vs nocompress, memory, codec cost."""
    with tempfile.TemporaryDirectory(prefix="unroller-bench-") as tmp:
        models = build_models(bench.path, args.seed, Path(tmp))
    batch = bench.make_batch(args.batch_size, None, args.seed)

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
        t = time_pair(
            lambda m=model: step_ours(m, batch),
            lambda: step_ours(base, batch),
            args.warmup,
            args.repeats,
        )
        timings[scheme] = {
            "unit": "ms",
            "scheme": t["first"],
            "nocompress": t["second"],
            "ratio": t["ratio"],
        }

    # memory
    memory = {}
    for scheme, model in models.items():
        marker = backward_marker(lambda m=model: step_ours(m, batch))
        model.zero_grad(set_to_none=True)
        mem = profile_step(lambda m=model: step_ours(m, batch), marker or SEED_OP)
        mem["backward_marker"] = marker
        memory[scheme] = mem

    base_report = reports[BASELINE]
    base_rows = {r["tensor"]: r for r in base_report["rows"]}
    schemes = []
    for scheme in models:
        rep = reports[scheme]
        plan = plan_figures(bench.path, scheme, args.batch_size)
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
        "model": bench.name,
        "model_file": bench.label,
        "batch_size": args.batch_size,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in base.parameters()),
        "schemes": schemes,
        "goals": goals,
    }
