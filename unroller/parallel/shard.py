"""Sharded data parallel of a generated module on FSDP2 (``--shard``).

A module generated with ``--shard`` lists its shard units (``Model.SHARD_UNITS``: the
top-level block instances and the top-level layers with parameters of their own, an LM's
embedding, final norm and head) and its step calls ``K.gather(L, name)`` before a unit's
statements (forward, and again for its recompute and backward), ``K.release(L, name)``
after them, and ``K.scatter_grads(L, names)`` after the backward run in which those
gradients became final. ``attach(model, mesh)`` shards the model with FSDP2:
``fully_shard`` on each unit, then on the model itself (its free parameters), so each rank
holds a ``Shard(0)`` DTensor of each parameter. Then:

- ``gather``/``release`` are the unit's ``unshard()`` / ``reshard()``: the module
  attributes the step's kernels read become the all-gathered full tensors, and are
  freed again; in the backward each gather starts the next unit's (``unshard(async_op=
  True)``, in the last step's order), as FSDP2 prefetches; the model's free parameters
  are gathered by FSDP2's root pre-forward hook when the step is called, and released when
  it returns (``finish``: FSDP2's own end of a backward, which no autograd runs here);
- ``scatter_grads`` reduce-scatters the full gradients the unrolled backward wrote into
  ``.grad`` (each rank's, of its own share of the batch) to the shards, after the unit's
  release (the full gradients stay on FSDP2's unsharded parameter objects), all of one
  run in one collective laid out as FSDP2 lays its own, averaged over the ranks (times
  ``weight`` for unequal shares), added into the sharded parameters' ``.grad``; an
  optimizer over ``model.parameters()`` then steps the shards;
- ``everything()`` gathers the whole model for ``predict`` (an evaluation); a collective
  that loses its peer raises ``RankFailure`` naming the rank;
- the units the step lists as ``ROW_UNITS`` (an embedding, a vocabulary-sized head) are
  never gathered: their kernels compute where each rank's rows live
  (``unroller.parallel.rows``).

A module the user sharded (``unroller.parallel.adopted``) is trained by the same
``Sharder`` over the user's FSDP modules: each unit's gather unshards the FSDP modules
holding it (``units``: name -> (path, module) pairs), a ``Binder`` points the step's
module at the tensors the user's modules hold after each unshard and reshard, and the
user's root is gathered for the whole step (``begin``) and released at its end.

Each rank computes its share's mean loss; the average of the ranks' gradients is the
whole batch's when the shares are equal. Without ``attach`` the three calls do nothing
and the file trains in one process.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from unroller.parallel import rows

SHARDER_ATTR = "gradient_sharder"
"""The attribute of the generated Model that holds its ``Sharder``."""


class ShardError(ValueError):
    """A model or mesh the sharded step cannot use."""


class RankFailure(RuntimeError):
    """A collective of the sharded step failed: another rank stopped or went elsewhere."""


#: what a backend's error says when a peer has gone (gloo's transport, NCCL's watchdog)
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "timed out")


def peer_lost(exc: BaseException) -> bool:
    """Does ``exc`` say a collective lost a peer (not a bug of the step's own)?"""
    text = str(exc)
    distributed = isinstance(exc, getattr(torch.distributed, "DistError", ())) or any(
        word in text for word in ("gloo", "NCCL", "ProcessGroup")
    )
    return distributed and any(word.lower() in text.lower() for word in PEER_LOST)


def step_guard() -> Any:
    """A whole sharded step (``unroller.unroll(shard=)`` calls it through this), whose
    first collective, the model's own gather, runs in FSDP2's hook before the step."""
    return _collective("a collective of the step")


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """``what`` (a gather, a reduce-scatter) raising one clear error, naming this rank,
    where the backend reports a peer gone (gloo: the connection reset)."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, RankFailure) or not peer_lost(exc):
            raise
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RankFailure(
            f"rank {rank}: {what} failed: another rank has stopped or is running something "
            f"else (see its own error); the backend said: {first[:300]}"
        ) from exc


@dataclass
class Sharder:
    """The FSDP2 units of one generated model and its sharded parameters by name."""

    model: torch.nn.Module
    mesh: Any
    #: step unit name -> the FSDP modules gathered for it, by their paths in the sharded
    #: module (the unit itself where we sharded; the user's units where the user did)
    units: dict[str, tuple[tuple[str, Any], ...]] = field(default_factory=dict)
    sharded: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    #: where the user sharded the module: their root FSDP module (gathered for the whole
    #: step by ``begin``) and what points the step's module at their current tensors
    root: Any = None
    binder: Binder | None = None
    #: the reduce-scatter's dtype (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``, else its
    #: ``param_dtype``); None: the gradients' own
    reduce_dtype: torch.dtype | None = None
    prefetch: bool = True  # in the backward, start the next unit's gather with this one's
    gathered_bytes: int = 0  # all-gathered by gather(), in all
    scattered_bytes: int = 0  # reduce-scattered by scatter_grads(), in all
    wait_seconds: float = 0.0  # time gather() spent waiting for all-gathers, in all
    prefetched: int = 0  # gathers started ahead of their unit's statements, in all
    #: this rank's gradients are multiplied by it before the average: world x its share of
    #: the batch (1 when the shares are equal), so unequal shares give the whole batch's
    weight: float = 1.0
    #: the order of the units' gathers in this step and in the last (what prefetch follows)
    order: list[str] = field(default_factory=list)
    last_order: list[str] = field(default_factory=list)
    pending: dict[str, Any] = field(default_factory=dict)  # name -> unshard handle
    unit_bytes: dict[str, int] = field(default_factory=dict)  # the full parameters' bytes
    #: each unit's unsharded parameter objects (FSDP2 keeps them from one gather to the
    #: next), whose ``.grad`` the backward writes: read after the unit's release too
    full: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    #: FSDP modules gathered for more than one unit (a user's module holding several of the
    #: step's units): released only when a unit without them is gathered, or at the end
    shared: set[str] = field(default_factory=set)
    deferred: dict[str, Any] = field(default_factory=dict)  # path -> FSDP module kept
    #: units never gathered: computed where their rows live (``unroller.parallel.rows``:
    #: an LM's embedding and head), set by ``compute_rows_in_place``
    rows: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        counts = Counter(path for group in self.units.values() for path, _ in group)
        self.shared = {path for path, count in counts.items() if count > 1}
        paths = set(counts)
        for name, group in self.units.items():
            self.unit_bytes[name] = sum(
                p.numel() * p.element_size()
                for path, _ in group
                for key, p in self.sharded.items()
                if _under(key, path) and _owned_by(key, path, paths)
            )

    def gather(self, name: str) -> None:
        """Unit ``name`` all-gathered (waiting for it where ``prefetch`` started it), and
        the gather of the unit that came after it in the last step started (FSDP2's
        ``unshard(async_op=True)``), so that it runs while this one computes."""
        if name in self.rows:
            return
        started = time.perf_counter()
        handles = self.pending.pop(name, None)
        group = self.units[name]
        self._release_deferred(keep={path for path, _ in group})
        with _collective(f"the all-gather of {name}'s parameters"):
            for handle in handles or ():
                handle.wait()
            for _, unit in group:  # nothing where the prefetch gathered it
                unit.unshard()
        self._gathered(group)
        self.wait_seconds += time.perf_counter() - started
        self.gathered_bytes += self.unit_bytes[name]
        self.order.append(name)
        if self.prefetch:
            self._prefetch(len(self.order))

    def _gathered(self, group: tuple[tuple[str, Any], ...]) -> None:
        """The full parameters of ``group``'s modules (FSDP2's unsharded parameter objects,
        whose ``.grad`` the backward writes) recorded by key, and the step's module pointed
        at them where the user's module is not the step's."""
        for path, unit in group:
            for key, param in unit.named_parameters():  # the full ones, while gathered
                self.full[f"{path}.{key}" if path else key] = param
        if self.binder is not None:
            self.binder.bind(path for path, _ in group)

    def _prefetch(self, position: int) -> None:
        """Start the gather of the unit the last step gathered at ``position``, if it is a
        backward gather (its unit gathered before in the step: FSDP2's default, which
        prefetches in the backward only, so that the forward holds one unit at a time)."""
        if position < len(self.last_order):
            following = self.last_order[position]
            backward = following in self.last_order[:position]
            current = {path for path, _ in self.units[self.order[-1]]}
            apart = current.isdisjoint(path for path, _ in self.units[following])
            wanted = self.units[following] and following not in self.rows
            if backward and apart and wanted and following not in self.pending:
                with _collective(f"the all-gather of {following}'s parameters"):
                    self.pending[following] = [
                        unit.unshard(async_op=True) for _, unit in self.units[following]
                    ]
                self.prefetched += 1

    def release(self, name: str) -> None:
        if name in self.rows:
            return
        group = self.units[name]
        for path, unit in group:
            if path in self.shared:  # the next unit may be gathered from it too
                self.deferred[path] = unit
            else:
                unit.reshard()
        if self.binder is not None:
            self.binder.bind(path for path, _ in group)

    def _release_deferred(self, keep: set[str] = frozenset()) -> None:
        """The deferred releases done, but of the modules in ``keep`` (which stay gathered
        for the unit being gathered now)."""
        for path in [p for p in self.deferred if p not in keep]:
            self.deferred.pop(path).reshard()
            if self.binder is not None:
                self.binder.bind((path,))
        for path in keep:
            self.deferred.pop(path, None)

    def begin(self) -> None:
        """The step starts: where the user sharded the module, their root's own parameters
        (outside every unit) gathered for the whole step, as FSDP2's root pre-forward does
        (with our own sharding the generated module's root hook does it)."""
        rows.set_share(self.weight / self.mesh.size())
        if self.root is None:
            return
        with _collective("the all-gather of the module's own parameters"):
            _fsdp_state(self.root)._lazy_init()  # FSDP2's first-forward setup (private)
            self.root.unshard()
        self._gathered((("", self.root),))

    @contextlib.contextmanager
    def everything(self) -> Iterator[None]:
        """Every parameter gathered while inside (``predict``, an evaluation), then the
        shards alone again; every rank enters it."""
        modules = self._modules()
        with _collective("the all-gather of every parameter"):
            for _, unit in modules:
                unit.unshard()
        self._gathered(modules)
        try:
            yield
        finally:
            for _, unit in modules:
                unit.reshard()
            if self.binder is not None:
                self.binder.bind(path for path, _ in modules)

    def settle(self) -> None:
        """Every FSDP module of the step released (after a forward of the module's own,
        whose root FSDP2 leaves gathered), the step's module pointed at the shards."""
        for _, unit in self._modules():
            unit.reshard()
        if self.binder is not None:
            self.binder.bind(path for path, _ in self._modules())

    def _modules(self) -> tuple[tuple[str, Any], ...]:
        """Every FSDP module of the step, each once, the root last."""
        found = {path: unit for group in self.units.values() for path, unit in group}
        found[""] = self.root if self.root is not None else self.model
        return tuple(found.items())

    def finish(self) -> None:
        """The step has returned: the model's own parameters, which FSDP's root pre-forward
        hook gathered (and, with no autograd backward to wait for, leaves gathered), are
        released too, so that between steps every rank holds its shards only."""
        pending, self.pending = list(self.pending.values()), {}
        with _collective("the end of the step"):
            for handles in pending:  # a prefetch no gather took (the step failed)
                for handle in handles:
                    handle.wait()
            self._release_deferred()
            if self.root is None:  # FSDP2's own end of a backward (private)
                _fsdp_state(self.model)._root_post_backward_final_callback()
            else:
                self.settle()
        self.last_order, self.order = self.order, []
        rows.set_share(None)

    def compute_rows_in_place(self) -> None:
        """The units the step lists as ``ROW_UNITS`` (an embedding or a vocabulary-sized
        linear layer) left sharded, where each is its own FSDP module with a row per rank:
        their kernels compute where the rows live (``unroller.parallel.rows``)."""
        world = self.mesh.size()
        self.rows = set()
        for name in getattr(self.model, "ROW_UNITS", ()):
            group = self.units.get(name, ())
            if len(group) == 1 and group[0][0] == name:
                weight = self.sharded.get(f"{name}.weight")
                if weight is not None and weight.shape[0] >= world:
                    self.rows.add(name)
                    self.unit_bytes[name] = 0

    def scatter_grads(self, names: tuple[str, ...]) -> None:
        """The full ``.grad`` of each of ``names`` reduce-scattered into its shard's
        ``.grad``, all of them in one collective (``scatter_into``), the full ones freed."""
        current: dict[str, torch.nn.Parameter] | None = None  # the model's free ones
        done: set[int] = set()
        pairs = []
        for name in names:
            full = self.full.get(name)
            if full is None:
                if current is None:
                    current = dict(self.model.named_parameters(remove_duplicate=False))
                full = current.get(name)
            shard = self.sharded.get(name)
            if full is None or shard is None or id(shard) in done:
                continue
            if full.grad is None or full is shard:  # nothing made, or not gathered
                continue
            done.add(id(shard))
            pairs.append((full, shard))
        if not pairs:
            return
        with _collective(f"the reduce-scatter of {len(pairs)} gradients"):
            self.scattered_bytes += scatter_into(pairs, self.mesh, self.weight, self.reduce_dtype)


def scatter_into(pairs: list, mesh: Any, weight: float = 1.0, dtype: Any = None) -> int:
    """Reduce-scatter each ``(full, shard)`` pair's ``full.grad`` (each rank's) so that
    ``shard.grad`` gains the average over the ranks of its rows, in one collective: each
    gradient padded along dim 0 to a multiple of the ranks (``fully_shard``'s chunks: rank
    r owns rows [r*c, (r+1)*c)), the ranks' chunks of all of them laid side by side, as
    FSDP2's own reduce-scatter lays them; each full ``.grad`` freed once copied. Returns
    the bytes reduce-scattered (the padded gradients'). ``dtype``: what the collective
    runs in (the gradients are cast to it first, and the result to each shard's dtype, as
    FSDP2's ``reduce_dtype`` does); None: the gradients' own."""
    from torch.distributed.tensor import DTensor, Shard

    world = mesh.size()
    rank = mesh.get_local_rank()
    group = mesh.get_group()
    sizes = []
    for full, _ in pairs:
        rows = full.grad.shape[0]
        sizes.append(-(-rows // world) * (full.grad.numel() // max(rows, 1)))
    first = pairs[0][0].grad
    if len(pairs) == 1 and first.shape[0] % world == 0 and dtype in (None, first.dtype):
        # one gradient whose rows divide: already the layout, no copy (an LM's embedding
        # or head, the largest gradients of the step, are reduce-scattered in place)
        stacked = first.contiguous().view(world, -1)
        pairs[0][0].grad = None
    else:
        stacked = _stack(pairs, sizes, world, dtype)
    if weight != 1.0:
        stacked.mul_(weight)
    out = stacked.new_empty(stacked.shape[1])
    torch.distributed.reduce_scatter_single(out, stacked.reshape(-1), group=group)
    out.div_(world)
    offset = 0
    for (_, shard), size in zip(pairs, sizes):
        rows = shard.shape[0]
        chunk = -(-rows // world)
        mine = max(0, min(chunk, rows - rank * chunk))
        local = out[offset : offset + size].view(chunk, *shard.shape[1:])[:mine]
        offset += size
        grad = DTensor.from_local(
            local.to(shard.dtype, copy=True),
            mesh,
            [Shard(0)],
            shape=shard.shape,
            stride=shard.stride(),
        )
        shard.grad = grad if shard.grad is None else shard.grad + grad
    return world * sum(sizes) * stacked.element_size()


def _stack(pairs: list, sizes: list[int], world: int, dtype: Any) -> torch.Tensor:
    """The gradients of ``pairs`` in one (world, sum of sizes) buffer, rank r's chunks of each
    side by side in row r (the last chunks zero-padded), each full gradient freed once
    copied, before the next is."""
    first = pairs[0][0].grad
    stacked = first.new_zeros((world, sum(sizes)), dtype=dtype)
    offset = 0
    for (full, _), size in zip(pairs, sizes):
        flat = full.grad.reshape(-1)
        for r in range(world):  # rank r's rows of this gradient (the last ones padded)
            part = flat[r * size : (r + 1) * size]
            stacked[r, offset : offset + part.numel()] = part
        offset += size
        full.grad = None
    return stacked


def _under(key: str, path: str) -> bool:
    """Is ``key`` (a parameter's or a module's) inside module ``path`` ("" the root)?"""
    return not path or key.startswith(path + ".")


def owner_of(key: str, paths: Any) -> str:
    """The nearest of the FSDP module ``paths`` ("" the root) at or above module or
    parameter ``key``."""
    return max((p for p in paths if p == key or _under(key, p)), key=len)


def _owned_by(key: str, path: str, paths: set[str]) -> bool:
    """Is parameter ``key`` FSDP module ``path``'s own (not a unit nested inside it)?"""
    return not any(
        other != path and _under(other, path) and _under(key, other) for other in paths if other
    )


def _fsdp_state(module: torch.nn.Module) -> Any:
    return module._get_fsdp_state()


@dataclass
class Binder:
    """Points the step's module at the tensors the user's sharded module holds now: FSDP2
    swaps a module's parameters between the shards and the full tensors at each
    ``unshard``/``reshard``, on the user's modules, which are not the step's."""

    step_module: torch.nn.Module
    user_module: torch.nn.Module
    #: user FSDP module path -> (the step's owner, the user's owner, leaf) of its own keys
    slots: dict[str, list[tuple[Any, Any, str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, step_module, user_module, paths: set[str]) -> Binder:
        binder = cls(step_module, user_module)
        for key, _ in user_module.named_parameters(remove_duplicate=False):
            owner = owner_of(key, paths)
            path, _, leaf = key.rpartition(".")
            slot = (step_module.get_submodule(path), user_module.get_submodule(path), leaf)
            binder.slots.setdefault(owner, []).append(slot)
        return binder

    def bind(self, paths: Iterator[str] | Any) -> None:
        for path in paths:
            for mine, theirs, leaf in self.slots.get(path, ()):
                mine._parameters[leaf] = theirs._parameters[leaf]


def attach(model: torch.nn.Module, mesh: Any = None, mp_policy: Any = None) -> Sharder:
    """Shard ``model`` (a generated Model built with ``--shard``) over ``mesh`` (default: a
    1-D CPU/CUDA mesh over the default process group) with FSDP2: ``fully_shard`` on each
    of ``Model.SHARD_UNITS``, then on the model; returns the sharder its step calls.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (the units gathered in its
    ``param_dtype``, for a step generated with that plain ``--precision``; the shards stay
    in the model's dtype; the gradients reduce-scattered in its ``reduce_dtype``)."""
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
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    units = {}
    for name in names:
        unit = model.get_submodule(name)
        fully_shard(unit, mesh=mesh, **policy)
        units[name] = ((name, unit),)
    fully_shard(model, mesh=mesh, **policy)
    sharder = Sharder(model, mesh, units, dict(model.named_parameters(remove_duplicate=False)))
    sharder.reduce_dtype = reduce_dtype(mp_policy)
    sharder.compute_rows_in_place()
    for name, p in sharder.sharded.items():
        if not isinstance(p, DTensor) or list(p.placements) != [Shard(0)]:
            raise ShardError(f"parameter {name} is not sharded on dim 0 by fully_shard")
    object.__setattr__(model, SHARDER_ATTR, sharder)
    return sharder


#: a plain low ``--precision`` -> the dtype FSDP2 gathers the parameters in for it
GATHER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def policy_for(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a sharded step of a plain low ``precision``
    (float32 shards gathered in its dtype, gradients reduce-scattered in float32), or None
    (the shards' own dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = GATHER_DTYPES.get(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def reduce_dtype(policy: Any) -> torch.dtype | None:
    """The dtype FSDP2 reduce-scatters in under ``policy`` (None: the gradients' own)."""
    if policy is None:
        return None
    return policy.reduce_dtype or policy.param_dtype


def sharder_of(model: torch.nn.Module) -> Sharder | None:
    """The ``Sharder`` attached to ``model`` (a generated Model), or None."""
    return model.__dict__.get(SHARDER_ATTR)
