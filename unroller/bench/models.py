"""The suite's models: a benchmark's reference and generated module at the run's sizes.

A benchmark (``unroller.bench.reference.BENCHMARKS[name]``) gives the reference ``torch.nn``
module at a resolution (``build``; ``forward_checkpointed`` on it is the checkpoint
peer), synthetic batches (``make_batch``), its sizes (``native_resolution``,
``quick_resolution``, ``paper_batch``) and the generated module of any ``Options``
(``model_class``: from ``model_text`` at ``Options.resolution``). The generated module of
every scheme gets the reference's weights and buffers, strictly, both ways.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from unroller.codegen import Options


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


def build_ours(
    bench: Any,
    options: Options,
    ref: nn.Module,
    device: torch.device,
    directory: Path,
) -> nn.Module:
    """The generated module of ``options`` with the reference's weights and buffers."""
    model = bench.model_class(options, directory)()
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
