"""Data parallel training of a generated module over torch.distributed.

A module generated with ``--data-parallel`` (``Options(data_parallel=True)``) calls
``K.reduce_bucket(L, i, names)`` right after the backward run in which bucket ``i``'s last
gradient became final, and ``K.reduce_wait(L)`` before the step returns. Without a
reducer attached those are no-ops, so the same file trains in one process. With one
(``attach``), ``reduce_bucket`` copies the bucket's ``.grad`` tensors into one flat buffer
and starts an asynchronous all-reduce of it; the backward goes on computing the earlier
layers meanwhile; ``reduce_wait`` waits for each, divides by the number of processes and
copies the averages back: every process ends the step with the gradient of the mean loss
over the concatenated batch, as DistributedDataParallel averages.

Batch norm uses each process's own batch by default (as DDP without SyncBatchNorm);
``attach(..., sync_bn=True)`` makes every batch-norm layer normalise with the statistics
of the whole distributed batch, forward and backward (the kernels in
``unroller.runtime.gpu`` read ``SYNC_ATTR`` on the layer), so that N processes compute
what one process computes on the concatenated batch.

The reducer also measures how much of the all-reduce time the backward hides
(``overlap``): the time ``reduce_wait`` spends blocked, against the time the same
all-reduces take when nothing else runs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

SYNC_ATTR = "_unroller_sync_group"
"""Set on a batch-norm layer (to a process group, or the default group's ``WORLD``): its
kernels reduce the batch statistics over that group."""
REDUCER_ATTR = "gradient_reducer"
"""The attribute of the generated Model that holds its ``GradientReducer``."""


@dataclass
class _Pending:
    work: Any
    flat: Tensor
    grads: list[Tensor]
    started: float


@dataclass
class GradientReducer:
    """Averages a model's gradients over a process group, bucket by bucket."""

    model: torch.nn.Module
    group: Any = None
    pending: list[_Pending] = field(default_factory=list)
    buckets: dict[int, tuple[str, ...]] = field(default_factory=dict)  # as the step named them
    blocked_seconds: float = 0.0  # the last step: time reduce_wait waited
    launched: int = 0
    #: this process's gradients are multiplied by it before the average: world x its share
    #: of the batch (1 when the shares are equal), so unequal shares still give the
    #: gradient of the whole batch's mean loss
    weight: float = 1.0

    def __post_init__(self) -> None:
        self.world = dist.get_world_size(self.group)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))

    def _grads(self, names: tuple[str, ...]) -> list[Tensor]:
        return [self.params[n].grad for n in names if self.params[n].grad is not None]

    def launch(self, index: int, names: tuple[str, ...]) -> None:
        self.buckets[index] = names
        grads = self._grads(names)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.weight != 1.0:
            flat.mul_(self.weight)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append(_Pending(work, flat, grads, time.perf_counter()))
        self.launched += 1

    def finish(self) -> None:
        start = time.perf_counter()
        for item in self.pending:
            item.work.wait()
        self.blocked_seconds = time.perf_counter() - start
        for item in self.pending:
            item.flat.div_(self.world)
            offset = 0
            for g in item.grads:
                n = g.numel()
                g.copy_(item.flat[offset : offset + n].view_as(g))
                offset += n
        self.pending.clear()

    def standalone_seconds(self, repeats: int = 3) -> float:
        """The median time of the last step's all-reduces, run one after another with
        nothing else to do (the gradients are summed into scratch copies, not changed)."""
        times = []
        for _ in range(repeats):
            dist.barrier(group=self.group)
            start = time.perf_counter()
            for names in self.buckets.values():
                grads = self._grads(names)
                if grads:
                    dist.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group=self.group)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]


def attach(model: torch.nn.Module, group: Any = None, sync_bn: bool = False) -> GradientReducer:
    """Make ``model`` (a generated Model) average its gradients over ``group`` (default: the
    default process group, which must be initialised); ``sync_bn``: batch norm over the
    whole distributed batch. Parameters and buffers are broadcast from rank 0 first, so all
    processes start from the same weights."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0, group=group)
    reducer = GradientReducer(model, group)
    setattr(model, REDUCER_ATTR, reducer)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            if sync_bn:
                setattr(module, SYNC_ATTR, group if group is not None else dist.group.WORLD)
            elif hasattr(module, SYNC_ATTR):
                delattr(module, SYNC_ATTR)
    return reducer


def reducer_of(layers: Any) -> GradientReducer | None:
    """The reducer attached to the model whose layer handles these are (``L[""]`` is the
    model itself), or None in one process."""
    root = layers[""]
    return getattr(root, REDUCER_ATTR, None)


def overlap(reducer: GradientReducer, repeats: int = 3) -> dict[str, float]:
    """The fraction of the last step's all-reduce time hidden behind the backward: 1 -
    (time blocked in reduce_wait) / (the all-reduces' time alone)."""
    alone = reducer.standalone_seconds(repeats)
    hidden = 1.0 - reducer.blocked_seconds / alone if alone > 0 else 0.0
    return {
        "allreduce_seconds": alone,
        "blocked_seconds": reducer.blocked_seconds,
        "hidden_fraction": max(0.0, min(1.0, hidden)),
        "buckets": float(len(reducer.buckets)),
    }


# -- synchronised batch norm (the kernels call these when the layer has SYNC_ATTR) ---------


def sync_batchnorm(
    x: Tensor,
    layer: torch.nn.Module,
    group: Any,
    eps: float,
    momentum: float | None,
    update: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch norm with the statistics of every process's batch; ``update``: the running
    statistics move as one process's on the concatenated batch would (not when the backward
    recomputes the output). Returns (y, mean, invstd)."""
    dims = [0, *range(2, x.dim())]
    count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
    stats = torch.cat([x.sum(dims), x.square().sum(dims), count])
    dist.all_reduce(stats, group=group)
    c = x.shape[1]
    total = stats[-1]
    mean = stats[:c] / total
    var = (stats[c : 2 * c] / total - mean.square()).clamp_min(0)
    invstd = torch.rsqrt(var + eps)
    shape = [1, c] + [1] * (x.dim() - 2)
    y = (x - mean.view(shape)) * invstd.view(shape)
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if update and getattr(layer, "running_mean", None) is not None:
        tracked = layer.num_batches_tracked
        tracked.add_(1)
        factor = (1.0 / float(tracked)) if momentum is None else momentum
        unbiased = var * (total / (total - 1))
        layer.running_mean.mul_(1 - factor).add_(mean * factor)
        layer.running_var.mul_(1 - factor).add_(unbiased * factor)
    return y, mean, invstd


def sync_batchnorm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    mean: Tensor,
    invstd: Tensor,
    group: Any,
    mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The input gradient with the sums over every process's batch; the weight and bias
    gradients of this process's batch (the reducer averages them like every gradient)."""
    dims = [0, *range(2, x.dim())]
    c = x.shape[1]
    shape = [1, c] + [1] * (x.dim() - 2)
    xhat = (x - mean.view(shape)) * invstd.view(shape)
    sum_g = g.sum(dims)
    sum_g_xhat = (g * xhat).sum(dims)
    grad_x = None
    if mask[0]:
        count = torch.tensor([x.numel() // c], dtype=x.dtype, device=x.device)
        sums = torch.cat([sum_g, sum_g_xhat, count])
        dist.all_reduce(sums, group=group)
        total = sums[-1]
        mean_g = (sums[:c] / total).view(shape)
        mean_g_xhat = (sums[c : 2 * c] / total).view(shape)
        weight = getattr(layer, "weight", None)
        scale = invstd if weight is None else invstd * weight
        grad_x = (g - mean_g - xhat * mean_g_xhat) * scale.view(shape)
    grad_w = sum_g_xhat if mask[1] else None
    grad_b = sum_g if mask[2] else None
    return grad_x, grad_w, grad_b


# -- launching: no code from the working directory ------------------------------------------

# ``python -m MODULE`` puts the working directory first on sys.path, so a ``./numpy.py`` or
# ``./typer.py`` there would run in the launcher and in every process. The launcher and the
# processes run instead as ``python [-P] -c BOOT MODULE ARGS``: BOOT drops the entry that
# ``-c`` puts first on sys.path (the working directory, as ''; none under -P, Python 3.11+)
# before anything is imported, then runs MODULE as ``-m`` would. Nothing else of the
# interpreter's setup (PYTHONPATH, site-packages, a virtual environment) changes.
BOOT = """\
import sys
if not getattr(sys.flags, "safe_path", False):
    if sys.path[:1] != [""]:
        sys.exit("unroll: error: cannot launch: sys.path does not start as documented")
    del sys.path[0]
import runpy
name = sys.argv[1]
del sys.argv[0]
runpy.run_module(name, run_name="__main__", alter_sys=True)
"""


def python_module_command(module: str, args: list[str], unbuffered: bool = False) -> list[str]:
    """``python -m module args`` without the working directory on sys.path."""
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    if unbuffered:
        flags.append("-u")  # as torchrun runs its processes: their lines arrive whole
    return [sys.executable, *flags, "-c", BOOT, module, *args]


def torchrun_command(processes: int, module: str, args: list[str]) -> list[str]:
    """torchrun on this machine (a rendezvous on a free local port) running ``processes``
    copies of ``python -m module args``; neither torchrun nor the copies import anything
    from the working directory (``--no-python``: torchrun runs the given command as is)."""
    worker = python_module_command(module, args, unbuffered=True)
    launcher = ["--standalone", f"--nproc-per-node={processes}", "--no-python", *worker]
    return python_module_command("torch.distributed.run", launcher)
