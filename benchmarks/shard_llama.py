"""A Llama-shaped network of about 100M parameters (Hugging Face ``LlamaForCausalLM``),
sharded through ``unroller.unroll(..., shard=True)`` against FSDP2 under autograd, per rank
(gloo on this CPU, one thread per process).

What a user of ``transformers`` runs: the same network, K processes, each its own
``SEQ``-token sequences, AdamW; two warm-up steps, then the peak (what the rank holds
between steps + the profiler's peak of the step, the median of three) and the median
step time of ``--steps`` more, as ``benchmarks.shard_bench`` measures them:

- ``ours, sharded``: ``unroller.unroll(net, (ids,), labels, shard=True)``, AdamW made
  afterwards over ``net.parameters()`` (the shards), attached inside the backward;
- ``FSDP2, autograd``: ``fully_shard`` on each decoder layer and the model, the loss on
  ``net(ids).logits`` (the same unshifted cross entropy), ``backward(); opt.step()``;
- ``ours on your fully_shard``: that same wrapping and AdamW, handed to
  ``unroller.unroll(net, ..., optimizer=opt)`` (the embedding and head the root's);
- one process on the whole batch: ``unroller.unroll(net, ...)``, AdamW after the step, and
  with ``optimizer=`` (AdamW inside the backward: no full gradient set either).

With ``shard=True`` the embedding and the head are units of their own, computed where their
rows live (``unroller.parallel.rows``): neither is ever gathered.

    python -m benchmarks.shard_llama [--worlds 2,4] [--batch 1] [--steps 2]
        [--out benchmarks/results/shard_llama.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.shard_bench import MIB, _held, _measure, fsdp_autograd, run_rank
from unroller.bench.machine import cpu_model, loadavg
from unroller.bench.profiling import profile_step

SEQ = 128
CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ,
    "use_cache": False,
    "tie_word_embeddings": False,
}
SIDES = (
    "ours, sharded, update in backward",
    "FSDP2, autograd",
    "ours on your fully_shard (layers, root), update in backward",
)


def _net() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), generator=g)
    return ids, torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), generator=g)


def _ours(rank: int, args, folder: Path) -> dict:
    import unroller
    from unroller.runtime.in_backward import attach

    net = _net()
    ids, y = _batch(args.batch, rank)
    step = unroller.unroll(
        net, (ids,), y, shard=True, update_in_backward=True, directory=folder / f"gen{rank}"
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    attach(step.model, opt)
    found = _measure(lambda: step(ids, y), net, opt, 2, args.steps)
    found["params"] = sum(p.numel() for p in net.parameters())
    return found


def _ours_on_yours(rank: int, args, folder: Path) -> dict:
    """The FSDP2 recipe (each decoder layer, then the model), AdamW over the shards, then
    ``unroller.unroll(net, ..., optimizer=opt)``: the embedding and head are the root's,
    gathered for the whole step as FSDP2's root keeps them."""
    from torch.distributed.fsdp import fully_shard

    import unroller

    net = _net()
    for layer in net.model.layers:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ids, y = _batch(args.batch, rank)
    step = unroller.unroll(net, (ids,), y, optimizer=opt, directory=folder / f"yours{rank}")
    return _measure(lambda: step(ids, y), net, opt, 2, args.steps)


def _fsdp(rank: int, args) -> dict:
    net = _net()
    ids, y = _batch(args.batch, rank)

    def loss_of(m):
        logits = m(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits.permute(0, 2, 1), y)

    return fsdp_autograd(net, list(net.model.layers), loss_of, args.steps)


def _worker(rank: int, world: int, folder: str, args) -> None:
    run_rank(
        rank,
        world,
        folder,
        lambda path: {
            SIDES[0]: _ours(rank, args, path),
            SIDES[1]: _fsdp(rank, args),
            SIDES[2]: _ours_on_yours(rank, args, path),
        },
    )


def _one_process(args, world: int, folder: Path, in_backward: bool) -> int:
    """One process on the whole batch: AdamW after the step, or inside its backward."""
    import unroller

    torch.set_num_threads(1)
    net = _net()
    ids, y = _batch(world * args.batch, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    extra = {"optimizer": opt} if in_backward else {}
    step = unroller.unroll(net, (ids,), y, directory=folder / "one", **extra)

    def run():
        loss = step(ids, y)
        if not in_backward:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    run()
    run()
    return _held(net, opt) + profile_step(run, "")["peak_bytes"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/shard_llama.md"))
    args = parser.parse_args(argv)
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_worker, args=(world, folder, args), nprocs=world, join=True)
            ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(world)]
            one = [_one_process(args, world, Path(folder), flag) for flag in (False, True)]
        rows.append((world, one, ranks))
    command = "python -m benchmarks.shard_llama " + " ".join(argv or sys.argv[1:])
    params = rows[0][2][0][SIDES[0]]["params"]
    lines = [
        "# A Llama-shaped network sharded: unroller.unroll(shard=True) against FSDP2",
        "",
        f"From `{command.strip()}` ({datetime.datetime.now(datetime.timezone.utc).isoformat()}, "
        f"{cpu_model() or 'unknown CPU'}, torch {torch.__version__}, load {loadavg()}, gloo, one "
        f"thread per process, {os.cpu_count()} cores). LlamaForCausalLM, {params / 1e6:.0f}M "
        f"parameters ({CONFIG['num_hidden_layers']} layers, width {CONFIG['hidden_size']}), "
        f"{args.batch} sequence(s) of {SEQ} tokens per rank, AdamW. Peak per rank (the "
        "largest rank): held between steps + the step's profiler peak, MiB; time: rank 0's "
        "median step, ms.",
        "",
        "| ranks | one process, whole batch: AdamW after / in backward | "
        + " | ".join(SIDES)
        + " | ours / FSDP2 | ours / one process (after / in backward) |",
        "|---:|---:|" + "---:|" * len(SIDES) + "---:|---:|",
    ]
    for world, one, ranks in rows:
        peaks = {s: max(r[s]["peak"] for r in ranks) for s in SIDES}
        cells = [f"{peaks[s] / MIB:.0f} ({ranks[0][s]['ms']:.0f} ms)" for s in SIDES]
        ours = peaks[SIDES[0]]
        lines.append(
            f"| {world} | {one[0] / MIB:.0f} / {one[1] / MIB:.0f} | "
            + " | ".join(cells)
            + f" | {ours / peaks[SIDES[1]]:.2f}x peak, "
            f"{ranks[0][SIDES[0]]['ms'] / ranks[0][SIDES[1]]['ms']:.2f}x time | "
            f"{ours / one[0]:.2f}x / {ours / one[1]:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
