"""Checkpoints of a sharded run in the format of an unsharded one.

``unroll train --shard`` keeps one ``checkpoint.pt`` as every run does, readable by every
tool that reads a run (evaluation, ``unroll accuracy``, an unsharded resume): its model
and optimizer state dicts hold plain full tensors, all-gathered from the shards when it is
written (``plain_state``, ``plain_optimizer_state``: collectives, every rank calls them),
and a sharded resume takes each rank's rows back out of them (``load_sharded``), the rows
``fully_shard`` gives that rank (``torch.chunk``'s: rank r holds rows [r*c, (r+1)*c) of
c = ceil(rows / ranks)). For a checkpoint per rank, loadable at another world size without
one process holding everything, ``torch.distributed.checkpoint`` works on the shards as
they are (docs/scaling.md).
"""

from __future__ import annotations

from typing import Any

import torch


def _is_shard(value: Any) -> bool:
    """A DTensor (its class is not imported where no process group exists)."""
    return isinstance(value, torch.Tensor) and hasattr(value, "full_tensor")


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model's state dict with each sharded tensor all-gathered (every rank calls it)."""
    return {k: v.full_tensor() if _is_shard(v) else v for k, v in state.items()}


def plain_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict with each sharded state tensor all-gathered."""
    return {
        **state,
        "state": {
            index: {k: v.full_tensor() if _is_shard(v) else v for k, v in entry.items()}
            for index, entry in state["state"].items()
        },
    }


def _rows(full: torch.Tensor, like: Any) -> Any:
    """The rows of ``full`` that ``like`` (a ``Shard(0)`` DTensor) holds on this rank, as a
    DTensor placed as ``like``."""
    from torch.distributed.tensor import DTensor

    mesh = like.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    chunk = -(-full.shape[0] // world)
    local = full[rank * chunk : min((rank + 1) * chunk, full.shape[0])]
    local = local.to(dtype=like.dtype, device=like.to_local().device).clone()
    return DTensor.from_local(local, mesh, like.placements, shape=like.shape, stride=like.stride())


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict
) -> None:
    """A plain checkpoint's state loaded into a sharded ``model`` and its ``optimizer``:
    each rank keeps its rows of every sharded tensor. A key or shape that does not fit
    raises (the caller has checked the checkpoint against the model first)."""
    current = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in model_state.items():
            target = current[key]
            if _is_shard(target):
                target.to_local().copy_(_rows(value, target).to_local())
            else:
                target.copy_(value)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in optim_state["state"].items():
        param = params[int(index)]
        state[index] = {
            k: (
                _rows(v, param)
                if _is_shard(param) and isinstance(v, torch.Tensor) and v.shape == param.shape
                else v
            )
            for k, v in entry.items()
        }
    optimizer.load_state_dict({**optim_state, "state": state})
