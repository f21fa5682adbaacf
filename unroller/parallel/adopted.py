"""A module the user sharded with FSDP2's ``fully_shard``, trained by a generated step.

The usual FSDP2 flow shards the blocks, then the whole module, then makes the optimizer
over the shards; ``unroller.unroll`` then takes that module as it is (``shard=`` left out):

- the import sees the module as it was before ``fully_shard`` (``plain_view``: its own
  classes, no FSDP hooks, and full-shape parameters that are never written or read, so
  no parameter is gathered for it);
- the step is generated with ``--shard``, and ``adopt`` maps each of its shard units to the
  user's FSDP modules that hold its parameters (the nearest wrapped module at or above it,
  and any wrapped inside it), so ``K.gather``/``K.release`` unshard and reshard the user's
  modules, and the user's root is gathered for the whole step (``Sharder.begin``);
- the shards the step reduce-scatters into are the user's parameters themselves, so an
  optimizer made over ``module.parameters()`` before or after ``unroll`` steps them, in the
  backward too (``optimizer=``).

Every check of the layout runs on every rank and its findings are exchanged before any
rank raises (``agree``), so a layout that differs between ranks, or is wrong on one, is
one clear error on all of them, never a hang in the first collective.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from unroller.parallel.shard import (
    GATHER_DTYPES,
    SHARDER_ATTR,
    Binder,
    Sharder,
    ShardError,
    _under,
    owner_of,
    reduce_dtype,
)

#: nn.Module's forward hook registries, where FSDP2 puts its pre- and post-forward hooks
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def user_units(module: torch.nn.Module) -> dict[str, Any]:
    """The FSDP modules inside ``module`` by path ("" the module itself), empty when the
    user has not sharded it."""
    from torch.distributed.fsdp import FSDPModule

    return {path: m for path, m in module.named_modules() if isinstance(m, FSDPModule)}


def policy_of(module: torch.nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` the user's root was sharded with (FSDP2's private
    state: the policy is not readable otherwise)."""
    return module._get_fsdp_state()._mp_policy


def adopted_precision(module: torch.nn.Module, options: Any, settings: dict) -> str:
    """The ``--precision`` the step of a module the user sharded runs in: the plain one of
    the ``param_dtype`` its units are gathered in (FSDP2 computes the whole forward in
    it), else what ``options``/``settings`` say; a precision asked for that is not what
    the policy gathers is refused."""
    asked = options.precision if options is not None else settings.get("precision")
    policy = policy_of(module) if "" in user_units(module) else None
    dtype = None if policy is None else policy.param_dtype
    gathered = {v: k for k, v in GATHER_DTYPES.items()}.get(dtype)
    if dtype is not None and gathered is None:
        raise ShardError(f"unroll: a MixedPrecisionPolicy of param_dtype={dtype} is not offered")
    if gathered is not None and asked not in (None, "fp32", gathered):
        raise ShardError(
            f"unroll: precision={asked!r}, but the module's MixedPrecisionPolicy gathers its "
            f"parameters in {dtype} (precision={gathered!r}, every op in it, as FSDP2 runs "
            "the forward); leave precision= out"
        )
    return gathered or asked or "fp32"


def _fsdp_hook(hook: Any) -> bool:
    func = getattr(hook, "func", None) or getattr(hook, "__func__", None) or hook
    return getattr(func, "__module__", "").startswith("torch.distributed.fsdp")


@contextlib.contextmanager
def plain_view(module: torch.nn.Module) -> Iterator[None]:
    """``module`` as it was before ``fully_shard`` while inside (for the import): each
    wrapped module its own class again, without FSDP2's forward hooks, and each sharded
    parameter a full-shape CPU tensor of its dtype that nothing writes (``torch.empty``:
    the capture runs on CPU inputs and reads shapes only, so its pages are never touched:
    address space, not memory); all put back after."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    attrs: list[tuple[Any, str, Any]] = []
    params: list[tuple[Any, str, Any]] = []
    try:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                attrs.append((m, "__class__", m.__class__))
                m.__class__ = next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule))
                for name in HOOK_DICTS:
                    hooks = getattr(m, name)
                    attrs.append((m, name, hooks))
                    kept = OrderedDict((k, h) for k, h in hooks.items() if not _fsdp_hook(h))
                    setattr(m, name, kept)
            for leaf, p in list(m._parameters.items()):
                if isinstance(p, DTensor):
                    params.append((m, leaf, p))
                    m._parameters[leaf] = torch.nn.Parameter(_untouched(p), p.requires_grad)
        yield
    finally:
        for m, leaf, p in reversed(params):
            m._parameters[leaf] = p
        for m, name, value in reversed(attrs):
            setattr(m, name, value)


def _untouched(p: Any) -> torch.Tensor:
    """A CPU tensor of ``p``'s shape and dtype whose memory is never written (not even by
    deterministic mode's fill of uninitialised memory)."""
    import torch.utils.deterministic as deterministic

    filling = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = False
    try:
        return torch.empty(p.shape, dtype=p.dtype)  # on the CPU, as the capture's inputs
    finally:
        deterministic.fill_uninitialized_memory = filling


def agree(problem: str | None, layout: Any, mesh: Any) -> None:
    """Every rank's ``problem`` (None: none) and ``layout`` (what must be the same on every
    rank) exchanged over ``mesh``; then every rank raises the same ``ShardError`` when any
    rank found a problem or the layouts differ."""
    group = mesh.get_group() if mesh is not None else None
    world = torch.distributed.get_world_size(group)
    found: list[Any] = [None] * world
    torch.distributed.all_gather_object(found, (problem, layout), group=group)
    for rank, (theirs, _) in enumerate(found):
        if theirs is not None:
            raise ShardError(f"rank {rank}: {theirs}")
    for rank, (_, theirs) in enumerate(found):
        if theirs != found[0][1]:
            raise ShardError(
                f"rank {rank} shards the module otherwise than rank 0 "
                f"({_first_difference(found[0][1], theirs)}): every rank must wrap the same "
                "modules with fully_shard on the same mesh"
            )


def _first_difference(mine: Any, theirs: Any) -> str:
    a, b = dict(mine), dict(theirs)
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            missing = "not wrapped" if key.startswith("module ") else "absent"
            return f"{key}: {a.get(key) or missing} on rank 0, {b.get(key) or missing} there"
    return "their layouts differ"


def layout(module: torch.nn.Module) -> tuple:
    """What each rank must agree on: the wrapped modules, and each parameter's shape and
    placement ("replicated" where it is not a DTensor)."""
    from torch.distributed.tensor import DTensor

    found = [
        (f"module {p or '(the root)'}", f"wrapped by fully_shard{_precision_words(m)}")
        for p, m in user_units(module).items()
    ]
    for key, p in module.named_parameters(remove_duplicate=False):
        shape = tuple(p.shape)
        how = f"{list(p.placements)}" if isinstance(p, DTensor) else "not sharded"
        found.append((f"parameter {key}", f"{shape} {how}"))
    return tuple(found)


def _precision_words(unit: Any) -> str:
    policy = policy_of(unit)
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return ""
    return f" (param_dtype={policy.param_dtype}, reduce_dtype={policy.reduce_dtype})"


def mesh_of(module: torch.nn.Module) -> tuple[Any, str | None]:
    """The one 1-D mesh the module's parameters are sharded on, and what is wrong if there
    is none such (a parameter left unsharded, two meshes, a 2-D mesh)."""
    from torch.distributed.tensor import DTensor, Shard

    meshes = []
    for key, p in module.named_parameters(remove_duplicate=False):
        if not isinstance(p, DTensor):
            return None, (
                f"parameter {key} is not sharded: wrap the module itself with fully_shard too "
                "(after its blocks), so that every parameter is a shard"
            )
        if list(p.placements) != [Shard(0)]:
            return None, f"parameter {key} is placed {list(p.placements)}, not [Shard(dim=0)]"
        if all(p.device_mesh != m for m in meshes):
            meshes.append(p.device_mesh)
    if not meshes:
        return None, "the module has no parameters to shard"
    if len(meshes) > 1 or meshes[0].ndim != 1:
        return meshes[0], (
            "the step's collectives run on one 1-D mesh; the module's parameters are on "
            f"{len(meshes)} mesh(es) of {meshes[0].ndim} dimension(s)"
        )
    return meshes[0], None


def shard_module(module: torch.nn.Module, names: tuple, mesh: Any = None, policy: Any = None):
    """``fully_shard`` on each of the step's units ``names`` (top-level block instances and
    layers: none inside another) that is a module of ``module``, then on ``module``, over
    ``mesh`` (default: a 1-D mesh over the default process group) with FSDP2's
    ``MixedPrecisionPolicy`` ``policy``: what ``unroll(shard=True)`` does in the user's
    place, so that the module is an FSDP2 module as any other afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device = next(module.parameters()).device.type
        mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    if mesh.ndim != 1:
        raise ShardError(f"a 1-D mesh is needed (one dimension of ranks), got {mesh.ndim}-D")
    extra = {} if policy is None else {"mp_policy": policy}
    modules = dict(module.named_modules())
    for name in names:
        if name in modules:
            fully_shard(modules[name], mesh=mesh, **extra)
    fully_shard(module, mesh=mesh, **extra)


def adopt(
    step_module: torch.nn.Module,
    user_module: torch.nn.Module,
    mesh: Any = None,
    check: bool = True,
) -> Sharder:
    """The sharder of ``step_module`` (a generated Model with ``SHARD_UNITS``, sharing
    ``user_module``'s tensors) over the user's own FSDP modules; ``mesh``, when given, must
    be the one the user sharded on. ``check``: the layout checked on every rank together
    (``agree``: one collective; a later specialisation of the same module, made on one rank
    alone for another batch shape, skips it, as the gathers of every shape are the same)."""
    units = user_units(user_module)
    found, problem = mesh_of(user_module)
    if problem is None and "" not in units:
        problem = "wrap the module itself with fully_shard too (after its blocks)"
    if problem is None and mesh is not None and mesh != found:
        problem = "shard= names another mesh than the one the module is sharded on"
    if problem is None:
        problem = _unreachable(user_module, units, step_module.SHARD_UNITS)
    if problem is None and len({_precision_words(m) for m in units.values()}) > 1:
        problem = (
            "the module's fully_shard units have different MixedPrecisionPolicy dtypes; the "
            "step runs in one precision: give every unit the same policy"
        )
    if check:
        agree(problem, layout(user_module), found)
    elif problem is not None:
        raise ShardError(problem)
    groups = {name: _group(name, units) for name in step_module.SHARD_UNITS}
    sharder = Sharder(
        step_module,
        found,
        groups,
        dict(user_module.named_parameters(remove_duplicate=False)),
        root=units[""],
        binder=Binder.of(step_module, user_module, set(units)),
        reduce_dtype=reduce_dtype(policy_of(user_module)),
    )
    sharder.compute_rows_in_place()
    object.__setattr__(step_module, SHARDER_ATTR, sharder)
    return sharder


def _group(name: str, units: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The user's FSDP modules to gather for step unit ``name``: the one holding it (not
    the root, gathered for the whole step) and every one inside it."""
    owner = owner_of(name, units)
    inside = [p for p in units if p and p != name and _under(p, name)]
    return tuple((p, units[p]) for p in ([owner] if owner else []) + inside)


def _unreachable(module: torch.nn.Module, units: dict[str, Any], names: tuple) -> str | None:
    """A parameter the step reads outside every unit's gather (a free or tied parameter)
    must be the root's, which stays gathered through the step."""
    for key, _ in module.named_parameters(remove_duplicate=False):
        owner = owner_of(key, units)
        if owner and not any(_under(key, n) for n in names):
            return (
                f"parameter {key} is in the fully_shard module {owner}, which the step does "
                "not gather where it reads it (outside its blocks); leave that module "
                "unwrapped, so the root holds it"
            )
    return None
