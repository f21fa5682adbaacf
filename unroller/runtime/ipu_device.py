"""Which PopTorch the generated IPU modules talk to: the real one, or the CPU emulation.

Generated IPU modules import ``poptorch`` from here. Importing never needs PopTorch;
the first use does: it resolves to the real ``poptorch`` (Graphcore's Poplar SDK) when
it is installed, to ``unroller.runtime.poptorch_emulation`` after ``use_emulation()``
(the runner's ``--emulate``), and otherwise raises ``PopTorchMissing`` with one line
saying what is needed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from types import ModuleType
from typing import Any

import torch

from unroller.compiler.dtypes import is_float, torch_dtype

MISSING = (
    "unroll: PopTorch (Graphcore's Poplar SDK) is required to run this module on an IPU and "
    "is not installed; pass --emulate to run the CPU emulation instead"
)
_backend: ModuleType | None = None


class PopTorchMissing(RuntimeError):
    pass


def use_emulation(on: bool = True) -> ModuleType | None:
    """Route every ``poptorch.X`` of generated modules to the CPU emulation (or back)."""
    global _backend
    from unroller.compress import base

    # Under the emulation the compressors take their IPU-safe path, so the emulated
    # step runs the same operations PopTorch would trace.
    base.IPU_SAFE = on
    _backend = importlib.import_module("unroller.runtime.poptorch_emulation") if on else None
    return _backend


def backend() -> ModuleType:
    global _backend
    if _backend is None:
        try:
            _backend = importlib.import_module("poptorch")
        except ImportError:
            raise PopTorchMissing(MISSING) from None
    return _backend


class _Proxy:
    """Stands for the module ``poptorch``; resolved on first attribute access."""

    def __getattr__(self, name: str) -> Any:
        return getattr(backend(), name)


poptorch = _Proxy()


def surrogate(
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    keys=None,
    loss_scaling: float = 1.0,
):
    """sum(p * g) over parameters, g detached: its gradient with respect to each p is
    exactly the unrolled gradient g, so PopTorch's optimizer, replica reduction and
    gradient accumulation apply our gradients while its autodiff saves nothing large.

    Under PopTorch's loss scaling S (``--precision fp16-mixed`` / ``fp16``) the unrolled
    backward was seeded with S (``K.loss_seed``), so g = S * dL/dp, and PopTorch
    differentiates S * (what this returns) and its optimizer divides the result by S. So
    this returns sum(p * g) / S: PopTorch's autodiff gives S * (1 / S) * g = g (exactly,
    S a power of two), the scaled gradient in the parameter's dtype, which is what it
    would have computed itself, and the optimizer's update uses g / S = dL/dp. The 1 / S
    multiplies the float32 total, never a float16 gradient (which would underflow), and a
    half parameter's term is summed in float32 (its value is never read, but must not
    overflow: S * g * p in float16 would)."""
    total = None
    for key in keys if keys is not None else grads:
        p, g = params[key], grads[key].detach()
        if p.dtype == torch.float16:
            p, g = p.to(torch.float32), g.to(torch.float32)
        term = (p * g).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no parameter gradients to apply")
    return total if loss_scaling == 1.0 else total / loss_scaling


def synthetic_batch(inputs: list, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """Inputs and targets of the declared shapes: normal floats, class indices for ints."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for _name, _kind, dtype, dims, high in inputs:
        if is_float(dtype):
            t = torch.randn(batch, *dims, generator=gen).to(torch_dtype(dtype))
            if high == 1:  # probabilities (bce targets)
                t = torch.rand(batch, *dims, generator=gen).to(torch_dtype(dtype))
        else:
            t = torch.randint(0, max(1, high), (batch, *dims), generator=gen)
            t = t.to(torch_dtype(dtype))
        tensors.append(t)
    return tensors


def run_main(  # unroller-lint: host-only
    model_class, inputs: list, num_ipus: int, argv: list[str] | None = None
) -> int:
    """``python GENERATED.py [--emulate] ...``: train a few steps on synthetic data.

    Runs on the host: it builds the options, the optimizer and the data, and calls the
    compiled training model; only the module's ``forward`` runs on the IPU."""
    parser = argparse.ArgumentParser(description="Run the generated training step on IPUs.")
    parser.add_argument("--emulate", action="store_true", help="use the CPU emulation of PopTorch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device-batch-size", type=int, default=4, help="micro-batch per replica")
    parser.add_argument("--device-iterations", type=int, default=1)
    parser.add_argument("--replication-factor", type=int, default=1)
    parser.add_argument(
        "--gradient-accumulation",
        type=int,
        default=None,
        help="micro-batches per step (default: 1, or 2 x IPUs when pipelined)",
    )
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--profile", metavar="DIR", help="write a PopVision report to DIR")
    parser.add_argument(
        "--loss-scaling",
        type=float,
        default=None,
        help="PopTorch's loss scaling (--precision fp16-mixed / fp16; default: the module's)",
    )
    args = parser.parse_args(argv)
    if args.emulate:
        use_emulation()
    else:
        try:
            backend()
        except PopTorchMissing as exc:
            print(exc, file=sys.stderr)
            return 2
    if args.profile:
        os.environ["POPLAR_ENGINE_OPTIONS"] = json.dumps(
            {"autoReport.all": "true", "autoReport.directory": args.profile}
        )
    accum = args.gradient_accumulation or (2 * num_ipus if num_ipus > 1 else 1)
    opts = poptorch.Options()
    opts.deviceIterations(args.device_iterations)
    opts.replicationFactor(args.replication_factor)
    opts.randomSeed(args.random_seed)
    opts.Training.gradientAccumulation(accum)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    torch.manual_seed(args.random_seed)
    model = model_class()
    sgd = dict(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaling = getattr(model, "loss_scaling", None)  # a module generated for float16
    if scaling is None and args.loss_scaling is not None:
        parser.error("--loss-scaling is for a module generated with --precision fp16-mixed or fp16")
    if scaling is not None:
        # One value for both: the module seeds its backward with it and divides it out of
        # the surrogate; the optimizer scales the loss by it and divides it out again.
        # Gradient accumulation and velocity in float32 (PopTorch's defaults, named): a half
        # model's weights are float16, its optimizer state float32.
        if args.loss_scaling is not None:
            model.loss_scaling = scaling = float(args.loss_scaling)
        float32 = torch.float32
        sgd.update(loss_scaling=scaling, accum_type=float32, velocity_accum_type=float32)
    optimizer = poptorch.optim.SGD(model.parameters(), **sgd)
    training = poptorch.trainingModel(model, opts, optimizer)
    batch = args.device_batch_size * args.device_iterations * args.replication_factor * accum
    mode = "CPU emulation of PopTorch" if args.emulate else "PopTorch"
    scaled = f", loss scaling {scaling:g}" if scaling is not None else ""
    print(
        f"{mode}: {num_ipus} IPU(s) x {args.replication_factor} replica(s), batch {batch}{scaled}"
    )
    for step in range(args.steps):
        out = training(*synthetic_batch(inputs, batch, seed=step))
        loss = out[1] if isinstance(out, tuple) else out
        print(f"step {step}: loss {float(loss.mean()):.6f}")
    training.copyWeightsToHost()
    return 0
