"""Sharded data parallel of a generated module on FSDP2 (``--shard``).

A module generated with ``--shard`` lists its top-level block instances
(``Model.SHARD_UNITS``) and its step calls ``K.gather(L, name)`` before a block instance's
statements (forward, and again for its recompute and backward), ``K.release(L, name)``
after them, and ``K.scatter_grads(L, names)`` after the backward run in which those
gradients became final. ``attach(model, mesh)`` shards the model with FSDP2:
``fully_shard`` on each unit, then on the model itself (the parameters outside every
block: embeddings, head, final norm), so each rank holds a ``Shard(0)`` DTensor of each
parameter. Then:

- ``gather``/``release`` are the unit's ``unshard()`` / ``reshard()``: the module
  attributes the step's kernels read become the all-gathered full tensors, and are
  freed again; the model's own parameters are gathered by FSDP's root pre-forward hook
  when the step is called, and released after it returns;
- ``scatter_grads`` reduce-scatters each full gradient the unrolled backward wrote into
  ``.grad`` (each rank's of its own share of the batch) to the shards, averaged over the
  ranks as FSDP2 averages (DTensor's ``Partial`` -> ``Shard(0)`` redistribution), adds it
  into the sharded parameter's ``.grad`` and frees the full one; an optimizer over
  ``model.parameters()`` then steps the shards.

Each rank computes its share's mean loss; the average of the ranks' gradients is the
whole batch's when the shares are equal. Without ``attach`` the three calls do nothing
and the file trains in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SHARDER_ATTR = "gradient_sharder"
"""The attribute of the generated Model that holds its ``Sharder``."""


class ShardError(ValueError):
    """A model or mesh the sharded step cannot use."""


@dataclass
class Sharder:
    """The FSDP2 units of one generated model and its sharded parameters by name."""

    model: torch.nn.Module
    mesh: Any
    units: dict[str, Any] = field(default_factory=dict)  # name -> FSDPModule
    sharded: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    gathered_bytes: int = 0  # all-gathered by gather(), in all
    scattered_bytes: int = 0  # reduce-scattered by scatter_grads(), in all

    def gather(self, name: str) -> None:
        unit = self.units[name]
        unit.unshard()
        self.gathered_bytes += sum(
            p.numel() * p.element_size() for p in unit.parameters(recurse=False)
        ) + sum(
            p.numel() * p.element_size()
            for m in unit.modules()
            if m is not unit
            for p in m.parameters(recurse=False)
        )

    def release(self, name: str) -> None:
        self.units[name].reshard()

    def finish(self) -> None:
        """The step has returned: the model's own parameters, which FSDP's root pre-forward
        hook gathered (and, with no autograd backward to wait for, leaves gathered), are
        released too, so that between steps every rank holds its shards only."""
        state = self.model._get_fsdp_state()  # FSDP2's own end of a backward (private)
        state._root_post_backward_final_callback()

    def scatter_grads(self, names: tuple[str, ...]) -> None:
        """Each full ``.grad`` of ``names`` reduce-scattered into its shard's ``.grad``."""
        current = dict(self.model.named_parameters(remove_duplicate=False))
        done: set[int] = set()
        for name in names:
            full = current.get(name)
            shard = self.sharded.get(name)
            if full is None or shard is None or id(shard) in done:
                continue
            done.add(id(shard))
            grad = full.grad
            if grad is None or full is shard:  # nothing made, or not gathered (one process)
                continue
            local = _reduce_scatter(grad, shard)
            self.scattered_bytes += grad.numel() * grad.element_size()
            full.grad = None
            shard.grad = local if shard.grad is None else shard.grad + local


def _reduce_scatter(grad: torch.Tensor, shard: torch.nn.Parameter) -> Any:
    """The average over the mesh of each rank's full ``grad``, as ``shard``'s placement (a
    DTensor)."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = shard.device_mesh
    summed = DTensor.from_local(
        grad.contiguous(), mesh, [Partial("avg")], shape=shard.shape, stride=shard.stride()
    )
    return summed.redistribute(mesh, list(shard.placements))


def attach(model: torch.nn.Module, mesh: Any = None) -> Sharder:
    """Shard ``model`` (a generated Model built with ``--shard``) over ``mesh`` (default: a
    1-D CPU/CUDA mesh over the default process group) with FSDP2: ``fully_shard`` on each
    of ``Model.SHARD_UNITS``, then on the model; returns the sharder its step calls."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    names = getattr(model, "SHARD_UNITS", None)
    if names is None:
        raise ShardError(
            f"{type(model).__name__} was not generated with --shard "
            "(Options(shard=True)): its step neither gathers nor reduce-scatters"
        )
    if mesh is None:
        world = torch.distributed.get_world_size()
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (world,))
    if mesh.ndim != 1:
        raise ShardError(f"a 1-D mesh is needed (one dimension of ranks), got {mesh.ndim}-D")
    units = {}
    for name in names:
        unit = model.get_submodule(name)
        fully_shard(unit, mesh=mesh)
        units[name] = unit
    fully_shard(model, mesh=mesh)
    sharder = Sharder(model, mesh, units, dict(model.named_parameters(remove_duplicate=False)))
    for name, p in sharder.sharded.items():
        if not isinstance(p, DTensor) or list(p.placements) != [Shard(0)]:
            raise ShardError(f"parameter {name} is not sharded on dim 0 by fully_shard")
    object.__setattr__(model, SHARDER_ATTR, sharder)
    return sharder


def sharder_of(model: torch.nn.Module) -> Sharder | None:
    return model.__dict__.get(SHARDER_ATTR)
