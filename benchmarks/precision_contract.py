"""The accuracy of mixed-precision steps against torch.autocast, per benchmark model.

    python -m benchmarks.precision_contract [--precision bf16-mixed,fp16-mixed]
        [--batch 2] [--seeds 3] [--out benchmarks/results/precision_contract.md]

For every benchmark model at the quick preset's input size, and each seed (weights, batch
and dropout draws), three steps on the same weights and batch: the torch.nn reference in
float64 (the truth), the reference in float32 under ``torch.autocast("cpu", dtype)``
(autograd), and the generated step for the precision. Per tensor (the loss and each
parameter gradient) the relative error against the truth (a gradient that is zero in
exact arithmetic measured against the largest one).
The table gives, over tensors and seeds, the median error of each side, the largest ratio
ours / autocast, and how many tensors break the tested contract (the criterion of
``unroll verify --precision``, unroller.analysis.verify_precision).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from pathlib import Path

import torch

from unroller.analysis.verify_precision import (
    FACTOR,
    FLOORS,
    ContractRow,
    contract_row,
    largest_norm,
)
from unroller.bench.reference.registry import BENCHMARKS
from unroller.compiler.options import Options
from unroller.compiler.precision import get as get_precision

NOTE = """A largest ratio of 1.00 means the generated step computed autocast's numbers on every
tensor (the CNNs: convolutions and batch norm follow the same policy and kernels); the
transformers differ where the step follows CUDA's lists (layer norm and softmax in
float32, which the CPU's autocast runs in the low dtype). The CNNs' large errors on both
sides are batch norm over two samples at the quick input size, which amplifies any
rounding: the comparison, not the size, is the point."""

DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _tensors(loss, net) -> dict:
    return {"loss": loss, **{k: p.grad for k, p in net.named_parameters()}}


def measure(name: str, precision: str, batch: int, seed: int) -> list[ContractRow]:
    """The contract's row of each tensor (ours' and autocast's errors, the verdict) for one
    model, precision and seed."""
    bench = BENCHMARKS[name]
    resolution = bench.quick_resolution
    torch.manual_seed(seed)
    ref = bench.build(resolution)
    options = Options(precision=precision, resolution=resolution)
    model = bench.model_class(options, readable=False)()
    model.load_state_dict(ref.state_dict())
    inputs = bench.make_batch(batch, resolution, seed=seed)
    torch.manual_seed(seed + 1000)
    ours = _tensors(model(*inputs), model)
    ref64 = copy.deepcopy(ref).double()
    torch.manual_seed(seed + 1000)
    loss64 = ref64(*[t.double() if t.is_floating_point() else t for t in inputs])[0]
    loss64.backward()
    peer = copy.deepcopy(ref)
    torch.manual_seed(seed + 1000)
    with torch.autocast("cpu", dtype=DTYPES[precision]):
        peer_loss = peer(*inputs)[0]
    peer_loss.backward()
    truth = _tensors(loss64, ref64)
    theirs, scale = _tensors(peer_loss, peer), largest_norm(truth.values())
    chosen = get_precision(precision)
    return [contract_row(k, ours[k], theirs[k], t, chosen, scale) for k, t in truth.items()]


def row(name: str, precision: str, batch: int, seeds: int) -> str:
    ours_all, peer_all, ratios, broken = [], [], [], 0
    for seed in range(seeds):
        for r in measure(name, precision, batch, seed):
            ours_all.append(r.ours)
            peer_all.append(r.peer)
            ratios.append(r.ours / max(r.peer, 1e-30))
            broken += not r.ok
    return (
        f"| {name} | {precision} | {len(ours_all)} | {statistics.median(ours_all):.2e} | "
        f"{statistics.median(peer_all):.2e} | {max(ratios):.2f} | {broken} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-mixed,fp16-mixed")
    parser.add_argument("--models", default=",".join(sorted(BENCHMARKS)))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    lines = [
        "# Mixed precision against torch.autocast (accuracy)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, one thread, with: `python -m benchmarks.precision_contract"
        f" --precision {args.precision} --batch {args.batch} --seeds {args.seeds}`.",
        "",
        "Per benchmark model (quick preset's input size, batch "
        f"{args.batch}, seeds 0..{args.seeds - 1}): relative errors against the float64 "
        "reference of the loss and every parameter gradient (tensors x seeds), the median "
        "for the generated step and for autograd under torch.autocast on the CPU, the "
        "largest ratio of the two on one tensor, and the tensors outside the tested contract "
        f"(ours <= {FACTOR:g} x autocast's + {FLOORS['bf16']:g} for bf16, "
        f"{FLOORS['f16']:g} for fp16: unroller.analysis.verify_precision).",
        "",
        "| model | precision | tensors | median error, ours | median error, autocast "
        "| largest ratio | outside the contract |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision in args.precision.split(","):
        for name in args.models.split(","):
            lines.append(row(name, precision, args.batch, args.seeds))
            print(lines[-1], flush=True)
    lines += ["", NOTE, "", f"Took {time.perf_counter() - began:.0f} s.", ""]
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
