"""The platforms code is generated for: one definition each, the only place they differ.

A platform is what the emitter and the CLI need to know about a target: which template
lays out the module, which runtime module holds the kernels an operator does not name
itself, where parameter gradients go, and whether the step may be split into pipeline
stages. The emitter and the CLI ask the platform; they never test its name. Adding a
platform means one ``Platform`` below, one template under ``templates/<name>/`` and one
runtime module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Platform:
    name: str
    summary: str  # one line for --help and error messages
    template: str  # path under templates/
    kernels: str  # runtime module for operators whose registry entry names no other
    #: Where a backward step hands its parameter gradients: "accumulate" adds them into
    #: each parameter's ``.grad`` (K.accumulate); "collect" gathers them in a dict the
    #: module returns through a surrogate loss (PopTorch owns the optimizer step).
    grads: str
    max_stages: int = 1  # pipeline stages (one per device); 1: no pipelining
    stage_counts: tuple[int, ...] = (1,)  # the stage counts that are accepted
    #: Pipelined: the ``with`` line that places the steps after it on one stage's device
    #: (formatted with ``section`` and ``stage``).
    stage_block: str = ""
    #: Under a lossy scheme, backward kernels whose registry entry says ``backward_pieces``
    #: (convolutions, batch norm) run on pieces of the batch of about this many bytes each
    #: (``piece_bytes=`` in the generated call), reading a compressed input one piece at a
    #: time, and those that say ``backward_in_place`` write their input gradient into the
    #: output gradient when the step owns it: the working set of the largest stage shrinks
    #: to what must be held, at the cost of a different summation order (so never under
    #: nocompress, which stays bit-identical). 0: whole, as on a platform whose graph
    #: compiler plans memory itself.
    piece_bytes: int = 0
    #: ``--pipeline K``: the module also gets one generator per stage, for K processes
    #: (``unroller.parallel.pipeline``) that send boundary tensors over torch.distributed.
    process_stages: bool = False
    #: Memory on each device that the stage report weighs params and stash against (an
    #: IPU's In-Processor-Memory, ``unroller.analysis.report``); 0: none (a GPU's is a run option)
    device_sram_bytes: int = 0
    #: What ``unroll estimate`` models for it: "on_chip" (memory per device against
    #: ``device_sram_bytes``, a roofline step time, the largest micro-batch on chip) or
    #: "largest_batch" (the largest batch whose predicted peak fits --device-memory).
    estimate: str = "largest_batch"
    #: Its compiler accepts only a listed set of torch calls (``unroller/<name>_supported.toml``,
    #: PopTorch's list for the IPU): ``unroll lint`` checks code against that list, by default
    #: that of the first platform with one (``LINTED``); False: every torch call runs.
    call_list: bool = False
    #: The step is handed to a graph compiler and runs as one compiled program (PopTorch):
    #: the host sees none of its allocations, and the benchmark feeds it micro-batches and
    #: sets its backend up first. False: the host runs the step op by op (PyTorch eager).
    graph_compiled: bool = False
    #: The ``--precision`` values it generates (``unroller.compiler.precision``), and why
    #: the others are not (for the refusal)
    precisions: tuple[str, ...] = ("fp32",)
    precision_note: str = ""
    #: What scales the loss under a low precision, so that float16 gradients do not
    #: underflow: "grad_scaler", a ``torch.amp.GradScaler`` the caller gives a mixed step
    #: (it unscales float32 gradients only, so a plain low precision is not scaled);
    #: "optimizer", the optimizer's loss scaling (PopTorch's ``loss_scaling``), which the
    #: step seeds its backward with under every low precision, a half model's too.
    loss_scaler: str = "grad_scaler"

    @property
    def pipelined(self) -> bool:
        return self.max_stages > 1


GPU = Platform(
    name="gpu",
    summary="plain PyTorch (CUDA or CPU)",
    template="gpu/module.py.j2",
    kernels="unroller.runtime.gpu",
    grads="accumulate",
    piece_bytes=1 << 20,
    process_stages=True,
    precisions=("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16"),
)

IPU = Platform(
    name="ipu",
    summary="Graphcore IPU through PopTorch, one IPU or a pipeline over several",
    template="ipu/module.py.j2",
    kernels="unroller.runtime.ipu",
    grads="collect",
    max_stages=16,
    stage_counts=(1, 2, 4, 8, 16),
    stage_block='with poptorch.Block(user_id="{section}{stage}", ipu_id={stage}):  # IPU {stage}',
    device_sram_bytes=900 * 1000**2,  # one GC200's In-Processor-Memory (about 900 MB)
    estimate="on_chip",
    call_list=True,
    graph_compiled=True,
    precisions=("fp32", "fp16-mixed", "fp16"),
    precision_note="the IPU's arithmetic is float16 and float32, it has no bfloat16",
    loss_scaler="optimizer",
)

PLATFORMS: dict[str, Platform] = {p.name: p for p in (GPU, IPU)}

#: What ``unroll lint`` (and ``unroller.lint``) checks against unless told: the first
#: platform whose compiler accepts a listed set of calls; on the others every call runs.
LINTED: Platform = next(p for p in PLATFORMS.values() if p.call_list)

#: The platform names as an Enum, for typer options.
PlatformName = Enum("PlatformName", {name.upper(): name for name in PLATFORMS}, type=str)


def platform(name: str) -> Platform:
    """The platform called ``name``; ValueError naming the known ones otherwise."""
    found = PLATFORMS.get(str(getattr(name, "value", name)))
    if found is None:
        raise ValueError(f"unknown platform '{name}' (known: {', '.join(PLATFORMS)})")
    return found
