"""Every method the harness measures, ours and the peers, behind one small interface.

A ``Method`` runs one training step on a batch (``run(batch, mark)`` returns the loss;
with ``mark`` the autograd family wraps ``loss.backward()`` in the profiler's
``record_function`` marker so the profiler sees where the backward pass begins) and
reports what a step keeps for backward (``stash(batch)``). ``METHODS`` says what each
one runs and ``STASH_METHODS`` how its stashed bytes are counted (both go into the
results).

The compiled peers (``compiled_peers``) are autograd under ``torch.compile``: their first
step compiles (seconds to minutes on a CPU), so ``Method.compiles`` is set and a harness
must run at least one untimed step before timing or profiling them.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from unroller.bench.config import ipu_accumulation
from unroller.bench.profiling import BACKWARD_MARK, backward_marker
from unroller.bench.saved import count_autograd_saved
from unroller.bench.steps import backward, step_autograd, step_ours
from unroller.compiler.schemes import builtin
from unroller.compress import Compressor, packed_nbytes

HOOK_MIN_HW = 8
COMPILE_BUDGETS = (0.5, 0.1)  # torch._functorch.config.activation_memory_budget
#: what a peer's forward runs in: a factory of a context manager (``torch.autocast`` under a
#: mixed --precision, ``unroller.bench.precision``); the backward runs after it
Context = Callable[[], AbstractContextManager]


def plain() -> AbstractContextManager:
    """No context: the peers' forward as it is (float32)."""
    return contextlib.nullcontext()


METHODS = {
    "ours": "the generated module: model.zero_grad(set_to_none=True); loss = model(*batch) "
    "(unroller.bench.steps.step_ours; forward and unrolled backward, gradients in .grad). --platform "
    "ipu: the generated IPU module under poptorch.trainingModel (--emulate: the CPU "
    "emulation), one call per step, SGD with lr 0 so the weights stay those of the peers "
    "(the update is still computed and applied)",
    "autograd": "the torch.nn reference: ref.zero_grad(set_to_none=True); loss = "
    "ref(*batch)[0]; loss.backward()",
    "checkpoint": "the same with ref.forward_checkpointed: torch.utils.checkpoint "
    "(use_reentrant=False) around every stage of the reference",
    "compiled": "the reference's step under torch.compile (inductor): ref.zero_grad(set_to_none"
    "=True); loss = compiled(*batch)[0]; loss.backward() (the backward is AOTAutograd's "
    "compiled backward); the batch dimension of every input is marked dynamic "
    "(torch._dynamo.maybe_mark_dynamic), so the one compilation in the warm-up serves "
    "every batch size of the max-batch search (batch 1 is specialised and compiles once "
    "more); compiled in the first, untimed, step",
    "compiled-budget-B": "the same, compiled with torch._functorch.config."
    "activation_memory_budget = B (set around every compilation of this peer, which has "
    "its own compiled graphs): AOTAutograd's min-cut partitioner saves at most about B of "
    "the activations the default partition saves and recomputes the rest in the backward",
    "autocast": "under a mixed --precision every peer above runs its forward (the hooks' "
    "pack calls included) under torch.autocast(device_type, dtype) and loss.backward() after "
    "it (the PyTorch AMP recipe); the checkpointed peers recompute under the autocast state "
    "their forward recorded. Under a plain low precision (bf16, fp16) the reference and the "
    "batch's floating inputs are cast to the dtype",
    "hooks": "the reference under torch.autograd.graph.saved_tensors_hooks whose pack hook "
    "compresses, with the scheme's own compressor (dct-dense: dct block 8 keep 4 int8; "
    "quant: 8 bits), every floating tensor that is not a parameter and that the compressor "
    "takes (dct: exactly 4 dims with H, W >= 8; quant: 2 dims or more, the last two (of 2 "
    "dims: the last) >= 8, so token tensors [N, L, E], their [N * L, E] views, per-head "
    "tensors and 1-D signals [N, C, L] too), and whose unpack hook decompresses it: how "
    "hook-based activation-compression libraries (ActNN, GACT) work; integer tensors (token "
    "ids, targets) are kept as they are",
}
STASH_METHODS = {
    "ours": "model.stash_report() after one step: bytes of the tensors the generated code "
    "keeps (raw: as made; stored: after masks and compression)",
    "autograd": "unroller.bench.saved.count_autograd_saved: saved_tensors_hooks record every tensor "
    "autograd saves in one forward, each storage once, parameters excluded (raw = stored)",
    "checkpoint": "the same count over forward_checkpointed: what autograd saves outside the "
    "checkpointed stages plus the stage inputs the checkpoints keep (raw = stored)",
    "compiled": "unroller.bench.saved.count_autograd_saved over the compiled step: the "
    "compiled autograd function saves its tensors with ctx.save_for_backward, which "
    "saved_tensors_hooks see; each storage once, parameters excluded (raw = stored)",
    "compiled-budget-B": "the same count over the step compiled under the budget",
    "hooks": "the peer's pack hook in one step, parameters excluded: the tensors it keeps as "
    "they are, each storage once (raw = stored), plus per compressing call (a tensor saved "
    "by two ops is compressed twice) the tensor's bytes (raw) and the packed bytes (stored)",
}


@dataclass
class Method:
    name: str
    kind: str  # "ours", "autograd", "checkpoint", "hooks" or "compiled"
    scheme: str | None
    module: nn.Module
    run: Callable[[list[Tensor], bool], Tensor]
    stash: Callable[[list[Tensor]], dict[str, Any]]
    backward_mark: str | None = None  # ours: found by its first stash (see _ours)
    notes: list[str] = field(default_factory=list)
    compiles: bool = False  # its first step compiles: run one untimed step first
    recompute: bool = False  # ours with --recompute: cheap ops remade in the backward
    #: ours built with more than the scheme: Options fields (``recompute_segments``,
    #: ``segment_pieces``) the memory model must see too; the row's name says which
    variant: dict[str, Any] = field(default_factory=dict)

    def step(self, batch: list[Tensor]) -> Tensor:
        return self.run(batch, False)


# --------------------------------------------------------------------------- ours


def _stash_report(model: nn.Module) -> dict[str, Any]:
    report = model.stash_report()
    return {
        "raw_bytes": report["total_raw_bytes"],
        "stored_bytes": report["total_stored_bytes"],
        "rows": report["rows"],
    }


def _ours(
    scheme: str,
    model: nn.Module,
    run: Callable[[list[Tensor], bool], Tensor],
    owner: nn.Module | None = None,
) -> Method:
    """Ours: ``stash`` runs one step and reads ``model.stash_report()``; the first time,
    that step runs under the profiler to find where the backward pass begins (the first
    aten op named '...backward...', profiling.backward_marker) for the memory phase.
    ``owner``: the module whose parameters the step trains, when ``model`` shares them
    without holding them (``unroller.unroll``'s step)."""
    held = model if owner is None else owner
    method = Method(f"ours:{scheme}", "ours", scheme, held, run, lambda batch: {})

    def stash(batch: list[Tensor]) -> dict[str, Any]:
        if method.backward_mark is None:
            method.backward_mark = backward_marker(lambda: run(batch, False))
        else:
            run(batch, False)
        return _stash_report(model)

    method.stash = stash
    return method


def ours_gpu(scheme: str, model: nn.Module) -> Method:
    return _ours(scheme, model, lambda batch, mark: step_ours(model, batch))


def ours_unrolled(
    scheme: str, step: nn.Module, owner: nn.Module, keywords: Sequence[str]
) -> Method:
    """An ``unroller.unroll`` step of ``owner`` called with the batch by keyword
    (``step(**dict(zip(keywords, batch)))``, a Hugging Face batch with ``labels``): the
    gradients go to ``owner``'s ``.grad``, reset to None before each step."""

    def run(batch: list[Tensor], mark: bool) -> Tensor:
        owner.zero_grad(set_to_none=True)
        out = step(**dict(zip(keywords, batch)))
        return getattr(out, "loss", out)

    return _ours(scheme, step, run, owner)


def ours_ipu(scheme: str, model: nn.Module, poptorch: Any, args: Any) -> Method:
    """The generated IPU module under ``poptorch.trainingModel`` (real or emulated); its
    stash_report is that of the last micro-batch of the call."""
    opts = poptorch.Options()
    opts.deviceIterations(1)
    opts.replicationFactor(args.replication_factor)
    opts.randomSeed(args.seed)
    opts.Training.gradientAccumulation(ipu_accumulation(args.num_ipus))
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0)
    training = poptorch.trainingModel(model, opts, optimizer)

    def run(batch: list[Tensor], mark: bool) -> Tensor:
        out = training(*batch)
        return out[1] if isinstance(out, tuple) else out

    method = _ours(scheme, model, run)
    method.notes.append("one poptorch.trainingModel call (SGD, lr 0)")
    return method


# --------------------------------------------------------------------------- autograd family


class _Checkpointed(nn.Module):
    """The reference whose forward is its ``forward_checkpointed``, to count what it saves."""

    def __init__(self, ref: nn.Module):
        super().__init__()
        self.ref = ref

    def forward(self, *batch: Tensor):
        return self.ref.forward_checkpointed(*batch)


def _counted(module: nn.Module, batch: list[Tensor]) -> dict[str, Any]:
    saved = count_autograd_saved(module, batch)
    n = saved["without_params_bytes"]
    return {"raw_bytes": n, "stored_bytes": n, "rows": None, "counted": saved}


def _in(context: Context, method: Method) -> Method:
    """``method`` whose stash count runs in ``context`` too (its step does already)."""
    if context is plain:
        return method
    count = method.stash

    def stash(batch: list[Tensor]) -> dict[str, Any]:
        with context():
            return count(batch)

    method.stash = stash
    return method


def autograd(ref: nn.Module, context: Context = plain) -> Method:
    """Plain autograd: ``loss = ref(*batch)[0]`` (in ``context``), ``loss.backward()``."""

    def run(batch: list[Tensor], mark: bool) -> Tensor:
        return step_autograd(ref, batch, mark, context)

    stash = lambda b: _counted(ref, b)  # noqa: E731
    return _in(context, Method("autograd", "autograd", None, ref, run, stash, BACKWARD_MARK))


def checkpointed(ref: nn.Module, context: Context = plain) -> Method:
    """``ref.forward_checkpointed`` (in ``context``): torch.utils.checkpoint per stage."""
    wrapper = _Checkpointed(ref)

    def run(batch: list[Tensor], mark: bool) -> Tensor:
        ref.zero_grad(set_to_none=True)
        with context():
            loss = ref.forward_checkpointed(*batch)[0]
        backward(loss, mark)
        return loss

    def stash(batch: list[Tensor]) -> dict[str, Any]:
        return _counted(wrapper, batch)

    return _in(context, Method("checkpoint", "checkpoint", None, ref, run, stash, BACKWARD_MARK))


class CompressingHooks:
    """pack: compress eligible saved tensors with ``codec``; unpack: decompress them."""

    def __init__(self, codec: Compressor, module: nn.Module):
        self.codec = codec
        self.exact_4d = codec.name == "dct"  # dct needs a map [N, C, H, W]
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.reset()

    def reset(self) -> None:
        self.kept: dict[int, int] = {}  # storage -> bytes, of the tensors kept as they are
        self.compressed_raw_bytes = 0  # bytes of the tensors compressed, per call
        self.packed_bytes = 0  # what those calls stored
        self.compressed_calls = 0
        self.compressed_shapes: dict[str, int] = {}  # "[2, 64, 64]" -> compressing calls

    def eligible(self, t: Tensor) -> bool:
        """Floating, not a parameter, and a shape the compressor takes: dct exactly 4 dims
        with H and W >= 8; quant 2 dims or more with the last two (of 2 dims: the last)
        >= 8 (token tensors [N, L, E] and their [N * L, E] views, 1-D signals [N, C, L],
        maps; not per-row statistics such as a layer norm's [N, L, 1])."""
        dims_ok = t.dim() == 4 if self.exact_4d else t.dim() >= 2
        return (
            t.is_floating_point()
            and dims_ok
            and min(t.shape[-2:] if t.dim() > 2 else t.shape[-1:]) >= HOOK_MIN_HW
            and not self.is_param(t)
        )

    def is_param(self, t: Tensor) -> bool:
        return isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self.param_ptrs

    def pack(self, t: Tensor) -> Any:
        if self.is_param(t):
            return t
        if not self.eligible(t):  # kept alive by autograd: its storage address is unique
            self.kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t
        with torch.no_grad():
            packed = self.codec.compress(t.detach())
        self.compressed_raw_bytes += t.numel() * t.element_size()
        self.packed_bytes += packed_nbytes(packed)
        self.compressed_calls += 1
        key = str(list(t.shape))
        self.compressed_shapes[key] = self.compressed_shapes.get(key, 0) + 1
        return (packed, tuple(t.shape[1:]), t.dtype)

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        data, shape, dtype = packed
        with torch.no_grad():
            return self.codec.decompress(data, shape, dtype)

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def hooks(scheme: str, ref: nn.Module, context: Context = plain) -> Method:
    codec = builtin(scheme).default.instance()
    hk = CompressingHooks(codec, ref)

    def run(batch: list[Tensor], mark: bool) -> Tensor:
        ref.zero_grad(set_to_none=True)
        hk.reset()
        with hk.context(), context():
            loss = ref(*batch)[0]
        backward(loss, mark)
        return loss

    def stash(batch: list[Tensor]) -> dict[str, Any]:
        run(batch, False)
        return {
            "raw_bytes": hk.compressed_raw_bytes + sum(hk.kept.values()),
            "stored_bytes": hk.packed_bytes + sum(hk.kept.values()),
            "rows": None,
            "compressed_calls": hk.compressed_calls,
            "compressed_shapes": dict(hk.compressed_shapes),
            "compressor": repr(codec),
        }

    method = Method(f"hooks:{scheme}", "hooks", scheme, ref, run, stash, BACKWARD_MARK)
    method.notes.append(f"saved_tensors_hooks with {codec!r}")
    return method


# --------------------------------------------------------------------------- torch.compile


def _own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own. Dynamo keeps compiled graphs on
    the code object they were traced from: two ``torch.compile(ref)`` share one cache
    (the second reuses the first's graph, whatever the budget) and one recompile limit
    (8); each variant's copy has its own."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _budget_backend(budget: float, inner: Any) -> Callable[..., Any]:
    """``inner`` (a backend name or callable) compiling under the activation memory
    budget: the partitioner reads it when the forward compiles, so it is set around
    every compilation, recompilations included, and nowhere else."""
    compile_graph = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_graph(gm, example_inputs)

    return backend


def _mark_batch(batch: Sequence[Tensor]) -> None:
    """Mark dim 0 of every input as the (dynamic) batch before the compiled call: the
    first compilation then serves every batch size, and none happens inside a profiled
    or timed step of the max-batch search. ``maybe_``: a model that fixes its batch
    size gets a static graph instead of an error."""
    for t in batch:
        if isinstance(t, Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)


class _CompiledStep(nn.Module):
    """The compiled forward as a module that holds the reference (so its parameters are
    known): what ``count_autograd_saved`` counts over."""

    def __init__(self, ref: nn.Module, forward: Callable[..., Any], dynamic_batch: bool):
        super().__init__()
        self.ref = ref
        self.compiled = forward
        self.dynamic_batch = dynamic_batch

    def forward(self, *batch: Tensor):
        if self.dynamic_batch:
            _mark_batch(batch)
        return self.compiled(*batch)


def _compiled_method(
    ref: nn.Module,
    name: str,
    backend: Any,
    dynamic_batch: bool,
    note: str,
    context: Context = plain,
) -> Method:
    """A peer stepping ``ref`` under ``torch.compile(backend=backend)``, with compiled
    graphs of its own (``_own_code``)."""

    def forward(*batch: Tensor):
        return ref(*batch)

    tag = "".join(c if c.isalnum() else "_" for c in name)
    step = _CompiledStep(
        ref, torch.compile(_own_code(forward, tag), backend=backend), dynamic_batch
    )

    def run(batch: list[Tensor], mark: bool) -> Tensor:
        ref.zero_grad(set_to_none=True)
        with context():
            loss = step(*batch)[0]
        backward(loss, mark)
        return loss

    method = Method(name, "compiled", None, ref, run, lambda b: _counted(step, b), BACKWARD_MARK)
    method.compiles = True
    method.notes.append(note)
    return _in(context, method)


def compiled(
    ref: nn.Module, backend: Any = "inductor", dynamic_batch: bool = True, context: Context = plain
) -> Method:
    """Autograd on ``torch.compile``'d ``ref`` ("compiled"); ``backend`` is torch.compile's
    (tests use a cheap one)."""
    note = f"torch.compile({backend})"
    return _compiled_method(ref, "compiled", backend, dynamic_batch, note, context)


def compiled_budget(
    ref: nn.Module,
    budget: float,
    backend: Any = "inductor",
    dynamic_batch: bool = True,
    context: Context = plain,
) -> Method:
    """The same, compiled under ``activation_memory_budget = budget``
    ("compiled-budget-B")."""
    return _compiled_method(
        ref,
        f"compiled-budget-{budget:g}",
        _budget_backend(budget, backend),
        dynamic_batch,
        f"torch.compile({backend}), activation_memory_budget {budget:g}",
        context,
    )


def compiled_peers(
    ref: nn.Module,
    budgets: Sequence[float] = COMPILE_BUDGETS,
    backend: Any = "inductor",
    dynamic_batch: bool = True,
    context: Context = plain,
) -> list[Method]:
    """ "compiled" and one "compiled-budget-B" per budget, each with its own graphs."""
    found = [compiled(ref, backend, dynamic_batch, context)]
    return found + [compiled_budget(ref, b, backend, dynamic_batch, context) for b in budgets]
