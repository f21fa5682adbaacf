"""How much of the gradient all-reduce the unrolled backward hides, two gloo processes.

    python -m benchmarks.dp_overlap [--benchmark resnet34] [--batch-size 32] [--steps 4]

Each process runs the ``--data-parallel`` module of the benchmark on its half of the
batch (1 thread each), for ``--steps`` SGD steps after one warm-up; per step the reducer
records the time ``reduce_wait`` blocks, and after the last step the same all-reduces are
timed alone (``unroller.parallel.data.overlap``). Hidden fraction = 1 - blocked / alone;
the per-step medians of rank 0 are printed as a Markdown row with the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unroller.bench.reference import BENCHMARKS
from unroller.compiler.options import Options
from unroller.materialize import load_file, write_source


def _worker(rank: int, folder: str, name: str, batch: int, steps: int) -> None:
    from unroller.parallel import data as distributed

    path = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{path / 'store'}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    bench = BENCHMARKS[name]
    model = load_file(path / "model.py", f"dp_overlap_{rank}").Model()
    reducer = distributed.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inputs = bench.make_batch(batch, bench.native_resolution, 0)
    half = [t[rank * (batch // 2) : (rank + 1) * (batch // 2)] for t in inputs]
    rows = []
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        began = time.perf_counter()
        model(*half)
        elapsed = time.perf_counter() - began
        opt.step()
        if step:  # the first is a warm-up
            rows.append((elapsed, reducer.blocked_seconds))
    found = distributed.overlap(reducer)
    if rank == 0:
        step_s = statistics.median(r[0] for r in rows)
        blocked = statistics.median(r[1] for r in rows)
        hidden = max(0.0, min(1.0, 1 - blocked / found["allreduce_seconds"]))
        torch.save(
            {
                "step_s": step_s,
                "blocked_s": blocked,
                "alone_s": found["allreduce_seconds"],
                "hidden": hidden,
                "buckets": found["buckets"],
            },
            path / "result.pt",
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dp_overlap")
    parser.add_argument("--benchmark", default="resnet34")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    bench = BENCHMARKS[args.benchmark]
    options = Options(data_parallel=True, resolution=bench.native_resolution)
    with tempfile.TemporaryDirectory() as folder:
        write_source(Path(folder) / "model.py", bench.generate(options))
        mp.spawn(_worker, args=(folder, args.benchmark, args.batch_size, args.steps), nprocs=2)
        found = torch.load(Path(folder) / "result.pt")
    command = "python -m benchmarks.dp_overlap " + " ".join(argv or sys.argv[1:])
    print(f"command: `{command.strip()}`")
    print(
        "| model | batch (2 x half) | buckets | step s | all-reduce alone s | blocked s | hidden |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.benchmark} | {args.batch_size} | {found['buckets']:.0f} | {found['step_s']:.3f} "
        f"| {found['alone_s']:.4f} | {found['blocked_s']:.4f} | {found['hidden']:.2f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
