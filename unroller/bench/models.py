"""The suite's models: a benchmark's reference and generated module at the run's sizes.

A benchmark (``unroller.bench.reference.BENCHMARKS[name]``) gives the reference ``torch.nn``
module at a resolution (``build``; ``forward_checkpointed`` on it is the checkpoint
peer), synthetic batches (``make_batch``), its sizes (``native_resolution``,
``quick_resolution``, ``paper_batch``) and the generated module of any ``Options``
(``model_class``: from ``model_text`` at ``Options.resolution``). The generated module of
every scheme gets the reference's weights and buffers, strictly, both ways.

``predict_memory`` is what the memory model (``unroller.api.simulate``) predicts for a
generated step: its peak and its floor, and the floor's line in the batch size (fixed
bytes + bytes per sample) from two batch sizes, which gives the floor-limited ideal max
batch under a budget (``ideal_max_batch``).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from unroller.compiler.options import Options


def resolution_of(bench: Any, args: Any) -> int:
    if args.resolution is not None:
        return args.resolution
    return bench.native_resolution if args.preset.full_size else bench.quick_resolution


def batch_of(bench: Any, args: Any) -> int:
    if args.batch_size is not None:
        return args.batch_size
    cap = args.preset.max_batch
    return bench.paper_batch if cap is None else min(bench.paper_batch, cap)


def build_reference(bench: Any, resolution: int, seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    ref = bench.build(resolution).to(device)
    ref.train()
    return ref


class CompileUnsupported(RuntimeError):
    """The generated Model of this tree takes no ``compile`` argument."""


def build_ours(
    bench: Any,
    options: Options,
    ref: nn.Module,
    device: torch.device,
    directory: Path,
    compile: bool = False,
) -> nn.Module:
    """The generated module of ``options`` with the reference's weights and buffers;
    ``compile``: built with ``Model(compile=True)`` (CompileUnsupported where the generated
    Model has no such argument)."""
    cls = bench.model_class(options, directory)
    if not compile:
        model = cls()
    elif "compile" in inspect.signature(cls).parameters:
        model = cls(compile=True)
    else:
        raise CompileUnsupported("the generated Model takes no compile argument")
    model.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(model.state_dict(), strict=True)
    model.to(device)
    model.train()
    return model


def batch_on(bench: Any, batch: int, resolution: int, seed: int, device: torch.device) -> list:
    return [t.to(device) for t in bench.make_batch(batch, resolution, seed)]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def state_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers (held before and after a step)."""
    return tensor_bytes(module.parameters()) + tensor_bytes(module.buffers())


def memory_model() -> Any:
    """The memory model of a model text (``unroller.api.simulate``; an older tree's
    ``unroller.analysis.memory.simulate``), or None in a tree without the memory model."""
    try:
        from unroller.api import simulate
    except ImportError:
        try:
            from unroller.analysis.memory import simulate
        except ImportError:
            return None
    return simulate


def predict_memory(bench: Any, options: Options, batch: int) -> dict[str, Any] | None:
    """The memory model's peak, floor and stash of the generated step at ``batch``, and the
    floor's line ``fixed + per_sample * n`` through ``batch`` and twice it; None without a
    memory model. The memory model's exceptions propagate (the caller notes them)."""
    simulate = memory_model()
    if simulate is None:
        return None
    text = bench.model_text(options.resolution)
    at, twice = (simulate(text, options, n) for n in (batch, 2 * batch))
    per_sample = (twice.floor_bytes - at.floor_bytes) / batch
    return {
        "batch": batch,
        "peak_bytes": at.peak_bytes,
        "floor_bytes": at.floor_bytes,
        "stash_bytes": at.stash_bytes,
        "floor_per_sample_bytes": per_sample,
        "floor_fixed_bytes": at.floor_bytes - per_sample * batch,
    }


def ideal_max_batch(
    predicted: dict[str, Any],
    budget: int,
    fixed: int,
    batch_bytes_per_sample: float,
    granularity: int = 1,
) -> int | None:
    """What fits ``budget`` if the step peaked at its floor: the largest multiple of
    ``granularity`` with fixed + floor(n) + batch(n) <= budget, ``fixed`` being the bytes
    resident whatever the batch (parameters, buffers, reserved optimizer state); None when
    the floor does not grow with the batch."""
    per = predicted["floor_per_sample_bytes"] + batch_bytes_per_sample
    if per <= 0:
        return None
    room = budget - fixed - predicted["floor_fixed_bytes"]
    return max(0, math.floor(room / (per * granularity))) * granularity
