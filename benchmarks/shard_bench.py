"""Sharded data parallel (``--shard``) against FSDP2 under autograd and our replicated data
parallel, per rank, measured (gloo on this CPU, one thread per process).

For each world size K, K processes each take a batch of B samples (one process: K x B), and
train gpt_small with AdamW, three ways, two warm-up steps then ``--steps`` timed ones:

- ``ours, sharded``: the module generated with ``--shard`` (``unroller.parallel.shard``),
  optionally with the optimizer inside the backward (``--update-in-backward``);
- ``FSDP2, autograd``: the torch.nn reference with ``fully_shard`` on each block and the
  root; ``loss.backward(); opt.step()``;
- ``ours, replicated``: the module generated with ``--data-parallel`` (every parameter,
  gradient and optimizer state on every rank).

Per rank: the peak of the whole step = what it holds before the step (its parameters,
optimizer state; no gradients) + the profiler's peak of the step's own allocations
(forward, backward, gathers, the optimizer's step), the median of three steps (where the
gloo threads' buffers fall moves it between steps); the largest over the ranks is
reported. Also the step time (rank 0's median), the bytes all-gathered and
reduce-scattered per step, and for ours the share of the all-gather time hidden behind
compute: 1 - (time ``gather`` waited) / (the same all-gathers run alone).

    python -m benchmarks.shard_bench [--worlds 2,4] [--batch 4] [--resolution 64]
        [--steps 3] [--out benchmarks/results/shard_bench.md]

The goals it judges: per-rank peak at 4 ranks <= 0.3 x one process's (the same step on the
whole batch, one process, plain) and <= FSDP2-under-autograd's; time per sample <= 1.15 x
FSDP2-under-autograd's; >= 70% of the gathers hidden.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unroller.bench.machine import cpu_model, loadavg
from unroller.bench.profiling import profile_step
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.options import Options

MODEL = "gpt_small"
PROFILED = 3  # profiled steps per side and rank (their median peak)
MIB = 2**20
SIDES = (
    "ours, sharded",
    "ours, sharded, update in backward",
    "FSDP2, autograd",
    "ours, replicated",
)


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes this rank holds between steps: its parameters (shards) and optimizer state."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += local(v).numel() * local(v).element_size()
    return total


def _measure(step, model, opt, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        step()
    held = _held(model, opt)
    # the median of three: a step's peak moves with where the gloo threads' buffers fall
    peak = statistics.median(profile_step(step, "")["peak_bytes"] for _ in range(PROFILED))
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak": held + peak, "held": held, "ms": statistics.median(times) * 1e3}


def _ours(rank: int, world: int, args, folder: Path, fields: dict, in_backward: bool) -> dict:
    from unroller.parallel import data as replicated
    from unroller.parallel.shard import attach
    from unroller.runtime.in_backward import attach as attach_optimizer

    bench = BENCHMARKS[MODEL]
    options = Options(resolution=args.resolution, **fields)
    Model = bench.model_class(options, folder / f"r{rank}_{len(fields)}{int(in_backward)}")
    torch.manual_seed(0)
    model = Model()
    sharder = attach(model) if fields.get("shard") else None
    if fields.get("data_parallel"):
        replicated.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if in_backward:
        attach_optimizer(model, opt)
    inputs = bench.make_batch(args.batch, args.resolution, seed=rank)

    def step():
        loss = model(*inputs)
        if not in_backward:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    found = _measure(step, model, opt, 2, args.steps)
    if sharder is not None:
        steps_run = 2 + PROFILED + args.steps
        found["gathered"] = sharder.gathered_bytes / steps_run
        found["scattered"] = sharder.scattered_bytes / steps_run
        waited = sharder.wait_seconds / steps_run
        found["hidden"] = 1 - waited / _gathers_alone(sharder) if waited >= 0 else None
    return found


def _gathers_alone(sharder) -> float:
    """Seconds the step's all-gathers take one after another with nothing else running."""
    dist.barrier()
    t0 = time.perf_counter()
    for name in sharder.last_order:
        for _, unit in sharder.units[name]:
            unit.unshard()
            unit.reshard()
    return time.perf_counter() - t0


def fsdp_autograd(net: torch.nn.Module, layers, loss_of, steps: int) -> dict:
    """FSDP2 under autograd, measured: ``fully_shard`` on each of ``layers`` and on ``net``,
    AdamW; a step is ``loss_of(net).backward(); opt.step(); opt.zero_grad()``."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step():
        loss = loss_of(net)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _measure(step, net, opt, 2, steps)


def _fsdp_autograd(rank: int, world: int, args) -> dict:
    bench = BENCHMARKS[MODEL]
    torch.manual_seed(0)
    ref = bench.build(args.resolution)
    inputs = bench.make_batch(args.batch, args.resolution, seed=rank)
    return fsdp_autograd(ref, list(ref.layers.children()), lambda m: m(*inputs)[0], args.steps)


def run_rank(rank: int, world: int, folder: str, sides) -> None:
    """One rank of a benchmark: a gloo group over ``folder``'s store, one thread, what
    ``sides(path)`` measures written to ``rank{rank}.json`` there."""
    path = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{path / 'store'}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    (path / f"rank{rank}.json").write_text(json.dumps(sides(path)))
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, world: int, folder: str, args) -> None:
    run_rank(
        rank,
        world,
        folder,
        lambda path: {
            SIDES[0]: _ours(rank, world, args, path, {"shard": True}, False),
            SIDES[1]: _ours(
                rank, world, args, path, {"shard": True, "update_in_backward": True}, True
            ),
            SIDES[2]: _fsdp_autograd(rank, world, args),
            SIDES[3]: _ours(rank, world, args, path, {"data_parallel": True}, False),
        },
    )


def _one_process(args, world: int) -> int:
    """One process, the whole batch (world x batch), our plain step with AdamW: its peak."""
    bench = BENCHMARKS[MODEL]
    with tempfile.TemporaryDirectory() as folder:
        Model = bench.model_class(Options(resolution=args.resolution), Path(folder))
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        inputs = bench.make_batch(world * args.batch, args.resolution)

        def step():
            loss = model(*inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        step()
        step()
        return _held(model, opt) + profile_step(step, "")["peak_bytes"]


def run(args) -> list[dict]:
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_worker, args=(world, folder, args), nprocs=world, join=True)
            ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(world)]
        one = _one_process(args, world)
        row = {"world": world, "one_process": one, "sides": {}}
        for side in SIDES:
            per_rank = [r[side] for r in ranks]
            row["sides"][side] = {
                "peak": max(r["peak"] for r in per_rank),
                "ms": per_rank[0]["ms"],
                **{
                    k: per_rank[0][k]
                    for k in ("gathered", "scattered", "hidden")
                    if k in per_rank[0]
                },
            }
        rows.append(row)
    return rows


def report(rows: list[dict], args, command: str) -> str:
    lines = [
        "# Sharded data parallel: per-rank peak, time, communication",
        "",
        f"From `{command}` ({datetime.datetime.now(datetime.timezone.utc).isoformat()}, "
        f"{cpu_model() or 'unknown CPU'}, torch {torch.__version__}, load {loadavg()}, gloo, one "
        f"thread per process on a machine with {os.cpu_count()} "
        f"cores). {MODEL} at context {args.resolution}, {args.batch} samples per rank, AdamW. Peak: "
        "what a rank holds between steps (parameters, optimizer state) + the profiler's peak "
        f"of the step (forward, backward, gathers, the optimizer's step; the median of {PROFILED} "
        "steps), the largest rank; "
        "MiB. Time: rank 0's median step, ms (processes share the machine's cores: compare "
        "sides within a row).",
        "",
        "| ranks | one process, whole batch | "
        + " | ".join(SIDES)
        + " | gathered / scattered per step (MiB) | gathers hidden |",
        "|---:|---:|" + "---:|" * len(SIDES) + "---:|---:|",
    ]
    for row in rows:
        sides = row["sides"]
        ours = sides[SIDES[0]]
        cells = [f"{sides[s]['peak'] / MIB:.1f} ({sides[s]['ms']:.0f} ms)" for s in SIDES]
        hidden = ours.get("hidden")
        lines.append(
            f"| {row['world']} | {row['one_process'] / MIB:.1f} | "
            + " | ".join(cells)
            + f" | {ours['gathered'] / MIB:.1f} / {ours['scattered'] / MIB:.1f} | "
            + (f"{100 * hidden:.0f}%" if hidden is not None else "n/a")
            + " |"
        )
    lines += ["", "Goals at 4 ranks (ours, sharded, update in backward):", ""]
    for row in rows:
        if row["world"] != 4:
            continue
        sides = row["sides"]
        best = sides[SIDES[1]]
        fsdp = sides[SIDES[2]]
        hidden = sides[SIDES[0]].get("hidden") or 0.0
        checks = [
            (
                "peak <= 0.3 x one process's",
                best["peak"] <= 0.3 * row["one_process"],
                f"{best['peak'] / row['one_process']:.2f}x",
            ),
            (
                "peak <= FSDP2-under-autograd's",
                best["peak"] <= fsdp["peak"],
                f"{best['peak'] / fsdp['peak']:.2f}x",
            ),
            (
                "time <= 1.15 x FSDP2-under-autograd's",
                best["ms"] <= 1.15 * fsdp["ms"],
                f"{best['ms'] / fsdp['ms']:.2f}x",
            ),
            (">= 70% of the gathers hidden", hidden >= 0.7, f"{100 * hidden:.0f}%"),
        ]
        lines += [f"- {what}: {value}, {'met' if ok else 'not met'}" for what, ok, value in checks]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/shard_bench.md"))
    args = parser.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    torch.set_num_threads(1)
    rows = run(args)
    command = "python -m benchmarks.shard_bench " + " ".join(argv or sys.argv[1:])
    text = report(rows, args, command.strip())
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
