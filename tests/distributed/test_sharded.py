"""Sharded data parallel on FSDP2 (``--shard``, ``unroller.parallel.shard``), gloo, two
processes this test starts itself.

- Where: ``K.gather``/``K.release`` around each block instance's forward and backward (a
  release before the next gather), ``K.scatter_grads`` after the run in which gradients
  became final and before the release; nothing of it without the option; one process
  without a mesh trains as the plain file.
- Checkpoints: ``torch.distributed.checkpoint`` saves a sharded run (``unroll(shard=)``)
  and loads it at another world size (one process, no sharding), exactly.
- What: two processes, each on half the batch, end three AdamW steps with the parameters
  one process reaches on the whole batch (float64, 1e-10), for gpt_tiny whole, with its
  blocks recomputed in pieces of one sample, with ``--recompute``, under ``quant`` (against
  one process running each rank's half in turn: a codec's scale is its tensor's), and
  with the optimizer stepped inside the
  backward, and for a model whose dimensions do not divide by the ranks; between steps
  every parameter is a ``Shard(0)`` DTensor again; from the second step on each backward
  gather starts the next unit's (in the last step's order) ahead of time.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import ROOT, generated_text, rel_err
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from unroller.api import import_generated, write_atomic
from unroller.compiler.options import Options

GPT_TINY = ROOT / "benchmarks/models/gpt_tiny.txt"
#: dims that do not divide by the ranks (5, 7, 3 rows; a 1-row parameter): the padded chunks
ODD = """model odd {
    input x: f32[N, 5]
    target y: i64[N]
    block mlp(x, width) {
        norm = layernorm(x, normalized_shape=5)
        h = linear(norm, out_features=width)
        a = gelu(h)
        out = linear(a, out_features=5)
        return out
    }
    scale = parameter(shape=(1, 5), init="normal", std=0.02)
    s = add(x, scale)
    blocks.0 = mlp(s, width=7)
    blocks.1 = mlp(blocks.0, width=3)
    head = linear(blocks.1, out_features=3)
    loss = cross_entropy(head, y)
    return loss, head
}
"""
WORLD, BATCH, STEPS = 2, 4, 3
CASES = {
    "odd": {},
    "whole": {},
    "pieces": {"recompute_segments": ("blocks",), "segment_piece_size": 1},
    "in_backward": {"update_in_backward": True},
    "recompute": {"recompute": True},
    "quant": {"scheme": "quant"},  # per rank compressed: against each half in one process
}
#: cases whose one-process reference runs each rank's half in turn (their gradients
#: averaged), not the whole batch at once: a codec's scale is its tensor's, so half a
#: batch compresses otherwise than the whole
HALVES = ("quant",)


def _data(case: str = ""):
    g = torch.Generator().manual_seed(1)
    if case == "odd":
        return [
            (
                torch.randn(BATCH, 5, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (BATCH,), generator=g),
            )
            for _ in range(STEPS)
        ]
    return [
        (
            torch.randint(0, 128, (BATCH, 64), generator=g),
            torch.randint(0, 128, (BATCH, 64), generator=g),
        )
        for _ in range(STEPS)
    ]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(model, rank: int = 0, world: int = 1, in_backward: bool = False, case: str = "") -> None:
    from unroller.runtime.in_backward import attach

    opt = _adamw(model.parameters())
    if in_backward:
        attach(model, opt)
    n = BATCH // world
    for ids, y in _data(case):
        if world == 1 and case in HALVES:
            for part in range(WORLD):  # each rank's half in turn, the gradients averaged
                half = BATCH // WORLD
                model(ids[part * half : (part + 1) * half], y[part * half : (part + 1) * half])
            for p in model.parameters():
                p.grad.div_(WORLD)
        else:
            model(ids[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        if not in_backward:
            opt.step()
            opt.zero_grad()


def _worker(rank: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    from unroller.parallel.shard import attach

    path = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{path / 'store'}", rank=rank, world_size=WORLD
    )
    torch.set_num_threads(1)
    found = {}
    for case in CASES:
        module = import_generated(path / f"{case}.py", f"shard_{case}_{rank}")
        torch.manual_seed(0)
        model = module.Model().double()
        sharder = attach(model)
        _train(model, rank, WORLD, in_backward=case == "in_backward", case=case)
        found[case] = {
            "state": {k: p.full_tensor().clone() for k, p in sharder.sharded.items()},
            "all_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            "grads_left": sum(p.grad is not None for p in model.parameters()),
            "scattered": sharder.scattered_bytes,
            "prefetched": sharder.prefetched,
            "units": len(model.SHARD_UNITS),
        }
    torch.save(found, path / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_two_processes_equal_one_on_the_whole_batch(tmp_path):
    single = {}
    for case, fields in CASES.items():
        source = generated_text(ODD if case == "odd" else GPT_TINY, Options(shard=True, **fields))
        module = import_generated(write_atomic(tmp_path / f"{case}.py", source), f"one_{case}")
        torch.manual_seed(0)
        model = module.Model().double()
        _train(model, in_backward=case == "in_backward", case=case)  # one process: no-ops
        single[case] = {k: v.detach().clone() for k, v in model.named_parameters()}
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        for case in CASES:
            got, want = found[case]["state"], single[case]
            assert got.keys() == want.keys()
            worst = max(rel_err(got[k], want[k]) for k in want)
            assert worst <= 1e-10, (case, worst)
            assert found[case]["all_sharded"], case
            assert found[case]["scattered"] > 0
            # from the second step on, each backward gather but the last starts the next
            # (more where a remade statement's span starts a unit's gather twice)
            units = found[case]["units"]
            assert found[case]["prefetched"] >= (STEPS - 1) * (units - 1), case
        assert found["in_backward"]["grads_left"] == 0
        assert found["whole"]["grads_left"] == 0  # zero_grad after each step


class Blocks(torch.nn.Module):
    """A torch.nn network with two blocks (one instance each) and parameters outside them,
    for ``unroller.unroll(..., shard=True)`` against one process of torch.autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(10), torch.nn.Linear(10, 10), torch.nn.GELU())
            for _ in range(2)
        )
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _unroll_worker(rank: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    import unroller

    path = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{path / 'store'}", rank=rank, world_size=WORLD
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Blocks().double()
    x, y = _blocks_data()
    n = BATCH // WORLD
    mine = (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
    step = unroller.unroll(net, (mine[0],), mine[1], shard=True, directory=path / f"gen{rank}")
    opt = _adamw(net.parameters())
    for i in range(STEPS):
        step(*mine)
        opt.step()
        opt.zero_grad()
        if i == STEPS - 2:  # a checkpoint before the last step, as a sharded run saves it
            model_state, optim_state = get_state_dict(net, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path / "ckpt")
    found = {k: p.full_tensor().clone() for k, p in net.named_parameters()}
    plain = Blocks().double()
    plain.load_state_dict(found)
    # a forward-only call: the module's own forward under FSDP2, the loss replayed
    evaluated = _no_grad(step, mine).item(), _ce(plain, *mine).item()
    # another batch size on each rank (1 and 2 samples): the mean of the ranks' gradients
    sizes = (1, 2)
    step(*(t[: sizes[rank]] for t in mine))
    want = [torch.zeros_like(p) for p in plain.parameters()]
    for r, size in enumerate(sizes):
        plain.zero_grad()
        _ce(plain, *(t[r * n : r * n + size] for t in (x, y))).backward()
        for w, p in zip(want, plain.parameters()):
            w.add_(p.grad / WORLD)
    grads = [p.grad.full_tensor() for p in net.parameters()]
    worst = max(rel_err(g, w) for g, w in zip(grads, want))
    after = all(isinstance(p, DTensor) for p in net.parameters())
    torch.save(
        {"state": found, "evaluated": evaluated, "other shapes": worst, "shards": after},
        path / f"unroll{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def _resume_worker(rank: int, folder: str) -> None:
    """One process, no sharding: the checkpoint two ranks saved, loaded into the torch.nn
    network and a new AdamW, and the last step taken with torch.autograd."""
    path = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{path / 'store1'}", rank=0, world_size=1)
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    net = Blocks().double()
    opt = _adamw(net.parameters())
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path / "ckpt")
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    x, y = _blocks_data()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    torch.save({k: v.detach().clone() for k, v in net.named_parameters()}, path / "resumed.pt")
    dist.destroy_process_group()


def _ce(net, x, y):
    return torch.nn.functional.cross_entropy(net(x), y)


def _no_grad(step, batch):
    with torch.no_grad():
        return step(*batch)


def _blocks_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (BATCH,), generator=g
    )


def test_unroll_with_shard_equals_autograd_in_one_process(tmp_path):
    """``unroller.unroll(net, ..., shard=True)`` on two ranks, each on half the batch, an
    AdamW made afterwards over ``net.parameters()`` (the shards): three steps end where
    torch.autograd ends in one process on the whole batch (float64, 1e-10); then a
    forward-only call (``no_grad``: the module's own FSDP2 forward) gives autograd's loss,
    and a step with another batch size on each rank (another specialisation on each) the
    mean of the ranks' gradients, the parameters shards again after both; a
    ``torch.distributed.checkpoint`` of the two ranks' shards and AdamW state,
    saved before the last step, loads into the torch.nn network in one process (another
    world size, no sharding), whose last step with autograd ends there too."""
    torch.manual_seed(0)
    ref = Blocks().double()
    opt = _adamw(ref.parameters())
    x, y = _blocks_data()
    for _ in range(STEPS):
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    mp.spawn(_unroll_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        found = torch.load(tmp_path / f"unroll{rank}.pt")
        got = found["state"]
        worst = max(rel_err(got[k], v.detach()) for k, v in ref.named_parameters())
        assert worst <= 1e-10, worst
        got, want = found["evaluated"]
        assert abs(got - want) <= 1e-10 * abs(want), found["evaluated"]
        assert found["other shapes"] <= 1e-10
        assert found["shards"]
    mp.spawn(_resume_worker, args=(str(tmp_path),), nprocs=1, join=True)
    resumed = torch.load(tmp_path / "resumed.pt")
    worst = max(rel_err(resumed[k], v.detach()) for k, v in ref.named_parameters())
    assert worst <= 1e-10, worst


def _dying_worker(rank: int, folder: str) -> None:
    """Rank 1 leaves after the first step; rank 0 takes a second one and records how it
    ended and how long that took."""
    import datetime
    import time

    import unroller

    path = Path(folder)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Blocks().double()
    x, y = _blocks_data()
    step = unroller.unroll(net, (x[:2],), y[:2], shard=True, directory=path / f"gen{rank}")
    step(x[:2], y[:2])
    if rank == 1:
        os._exit(3)
    started = time.perf_counter()
    try:
        step(x[:2], y[:2])
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - what it raises is what the test reads
        outcome = f"{type(exc).__name__}: {exc}"
    (path / "outcome.txt").write_text(f"{time.perf_counter() - started:.1f}\n{outcome}")
    os._exit(0)


def test_a_rank_that_dies_makes_the_others_fail_with_a_clear_message(tmp_path):
    """Rank 1 exits between steps: rank 0's next step raises ``RankFailure`` naming its rank
    and that another rank stopped, within seconds (not the process group's timeout)."""
    context = mp.spawn(_dying_worker, args=(str(tmp_path),), nprocs=WORLD, join=False)
    for process in context.processes:
        process.join(timeout=120)
    seconds, outcome = (tmp_path / "outcome.txt").read_text().split("\n", 1)
    assert outcome.startswith("RankFailure: rank 0:"), outcome
    assert "another rank has stopped" in outcome
    assert float(seconds) < 30


def test_gathers_releases_and_scatters_are_where_the_step_needs_them():
    """Per shard unit (block instances and the top-level layers with parameters: the
    embedding, the final norm, the head): in the forward a gather right before its
    statements and a release right after (the next unit's gather after it); in the
    backward, in reverse order, the gather
    before its recompute or backward, the release right after its last statement, then
    the reduce-scatter of its gradients (the full parameters freed before the
    reduce-scatter's buffer is made); none of it without the option."""
    for case, fields in CASES.items():
        if case in ("odd", "recompute"):  # another model; remakes that widen a span
            continue
        text = generated_text(GPT_TINY, Options(shard=True, **fields), readable=True)
        calls = re.findall(r'K\.(gather|release)\(L, "([^"]+)"\)', text)
        forward = ["tok_emb", "layers.0", "layers.1", "ln_f", "head"]
        expected = [(kind, name) for name in forward for kind in ("gather", "release")]
        expected += [(kind, name) for name in forward[::-1] for kind in ("gather", "release")]
        assert calls == expected
        lines = text.splitlines()
        gather = [i for i, line in enumerate(lines) if 'K.gather(L, "layers.1")' in line][1]
        release = [i for i, line in enumerate(lines) if 'K.release(L, "layers.1")' in line][1]
        following = [i for i, line in enumerate(lines) if 'K.gather(L, "layers.0")' in line][1]
        scatter = next(i for i in range(release, following) if "K.scatter_grads(" in lines[i])
        assert gather < release < scatter < following
        assert '"layers.1.linear1.weight"' in "".join(lines[scatter:following])
        assert 'SHARD_UNITS = ("tok_emb", "layers.0", "layers.1", "ln_f", "head")' in text
    plain = generated_text(GPT_TINY, Options(), readable=True)
    assert not re.search(r"K\.(gather|release|scatter_grads)\(", plain)


LM = """model lm {
    input ids: i64[N, 8]
    target y: i64[N, 8]
    emb = embedding(ids, num_embeddings=320, embedding_dim=16)
    mid = linear(emb, out_features=64)
    head = linear(mid, out_features=320)
    logits = permute(head, dims=(0, 2, 1))
    loss = cross_entropy(logits, y)
    return loss, head
}
"""


def test_row_units_are_the_embeddings_and_linear_layers_of_a_vocabulary_shape():
    """An embedding or linear unit with at least 5 rows per column (more than an MLP's 4x)
    is listed in ``ROW_UNITS`` (computed where its rows live, never gathered); a 4x
    projection is not; without ``--shard`` neither list is written."""
    text = generated_text(LM, Options(shard=True), readable=True)
    assert 'SHARD_UNITS = ("emb", "mid", "head")' in text
    assert 'ROW_UNITS = ("emb", "head")' in text
    assert "ROW_UNITS" not in generated_text(LM, Options(), readable=True)
    assert "ROW_UNITS = ()" in generated_text(GPT_TINY, Options(shard=True), readable=True)
    # a tied head: the table is one tensor in two layers, so neither is a unit (FSDP2 keeps
    # a tensor in one unit): the model holds it
    tied = LM.replace("out_features=64", "out_features=16").replace(
        "head = linear(mid, out_features=320)",
        'head = linear(mid, out_features=320, bias=false, tied_weight="emb.weight")',
    )
    text = generated_text(tied, Options(shard=True), readable=True)
    assert 'SHARD_UNITS = ("mid",)' in text and "ROW_UNITS = ()" in text


def test_attach_refuses_a_module_generated_without_the_option(tmp_path):
    from unroller.parallel.shard import ShardError, attach

    source = generated_text(GPT_TINY, Options())
    module = import_generated(write_atomic(tmp_path / "plain.py", source), f"plain_{os.getpid()}")
    with pytest.raises(ShardError, match="--shard"):
        attach(module.Model())


def test_attach_refuses_a_mesh_of_more_than_one_dimension(tmp_path):
    """A 2-D mesh (replicate x shard, HSDP) is not what the step's collectives use: refused
    before anything is sharded."""
    from types import SimpleNamespace

    from unroller.parallel.shard import ShardError, attach

    source = generated_text(GPT_TINY, Options(shard=True))
    module = import_generated(write_atomic(tmp_path / "m.py", source), f"mesh_{os.getpid()}")
    model = module.Model()
    with pytest.raises(ShardError, match="1-D mesh"):
        attach(model, SimpleNamespace(ndim=2))
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
