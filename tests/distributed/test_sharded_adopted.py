"""A module the user sharded with FSDP2's ``fully_shard``, handed to ``unroller.unroll``
(``unroller.parallel.adopted``), gloo, processes this test starts itself.

- Four ranks, each on a quarter of the batch, the blocks and the root wrapped by the user
  and an AdamW made before ``unroll`` over the shards: three steps end where torch.autograd
  ends in one process on the whole batch (float64, 1e-10); the same with the optimizer
  stepped inside the backward (``optimizer=``), and with the root alone wrapped. Dims that
  do not divide by four (10 and 3 rows: one rank holds no row of the head).
- A ``torch.distributed.checkpoint`` the four ranks save before the last step loads into
  two ranks (the module wrapped the same way, unrolled again), whose last step ends there.
- Bad layouts (a block wrapped on one rank only, the blocks wrapped but not the root,
  ``shard=False``) are one clear error on every rank, and the ranks go on together.
- FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, set by the
  user or by ``unroll(shard=True, precision="bf16")``: the units gathered in bfloat16, the
  step in bfloat16, the gradients reduce-scattered in float32 into float32 shards: two
  ranks end where one process ends stepping float32 master weights with the average of
  the bfloat16 gradients of each half (float32 rounding), and away from float32 training.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import rel_err
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unroller

BATCH, STEPS = 8, 3
CASES = ("blocks", "in_backward", "root_only")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(10)
        self.fc = torch.nn.Linear(10, 10)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Lm(torch.nn.Module):
    """A language model whose embedding and head have a vocabulary's shape (66 rows of 4:
    rows per rank 17, 17, 17, 15 at four ranks), the embedding with a padding row."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(66, 4, padding_idx=0)
        self.blocks = torch.nn.ModuleList(Block4() for _ in range(2))
        self.head = torch.nn.Linear(4, 66, bias=not tied)
        if tied:  # one tensor in two layers: neither is a unit, the root holds it
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h).permute(0, 2, 1)


class Block4(Block):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.fc = torch.nn.Linear(4, 4)


def _lm_data(seq: int):
    g = torch.Generator().manual_seed(4)
    return [
        (
            torch.randint(0, 66, (BATCH, seq), generator=g),
            torch.randint(0, 66, (BATCH, seq), generator=g),
        )
        for _ in range(STEPS)
    ]


def _lm_reference(seq: int, tied: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = Lm(tied).double()
    opt = _adamw(ref.parameters())
    for ids, y in _lm_data(seq):
        torch.nn.functional.cross_entropy(ref(ids), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ref.named_parameters()}


def _lm(rank: int, path: Path, world: int, seq: int, tied: bool = False) -> dict:
    """``unroll(shard=True)`` of ``Lm``: the embedding and the head computed where their
    rows live (5 tokens a sequence: 40 in all, fewer than the 66 rows), or gathered in
    their kernels after all (10: 80 tokens, more than the rows), three AdamW steps."""
    torch.manual_seed(0)
    net = Lm(tied).double()
    data = [_share(batch, rank, world) for batch in _lm_data(seq)]
    step = unroller.unroll(net, data[0][:1], data[0][1], shard=True, directory=path / f"l{rank}")
    opt = _adamw(net.parameters())
    for ids, y in data:
        step(ids, y)
        opt.step()
        opt.zero_grad()
    sharder = step.model.gradient_sharder
    return {
        "state": {k: p.full_tensor().clone() for k, p in net.named_parameters()},
        "rows": sorted(sharder.rows),
        "gathered": list(sharder.last_order),
    }


def _data():
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _wrapped(seed: int, blocks: bool = True, root: bool = True, policy=None) -> Net:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    net = Net().double() if policy is None else Net()
    extra = {} if policy is None else {"mp_policy": policy}
    for block in net.blocks if blocks else ():
        fully_shard(block, **extra)
    if root:
        fully_shard(net, **extra)
    return net


def _init(path: Path, rank: int, world: int, store: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{path / store}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)


def _share(batch, rank: int, world: int):
    n = BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _four_ranks(rank: int, folder: str) -> None:
    path = Path(folder)
    _init(path, rank, 4, "store4")
    found = {}
    for case in CASES:
        net = _wrapped(0, blocks=case != "root_only")
        opt = _adamw(net.parameters())  # over the user's shards, before unroll
        data = [_share(batch, rank, 4) for batch in _data()]
        extra = {"optimizer": opt} if case == "in_backward" else {}
        step = unroller.unroll(net, data[0][:1], data[0][1], directory=path / f"g{rank}", **extra)
        for i, (x, y) in enumerate(data):
            if case == "blocks" and i == STEPS - 1:  # a checkpoint before the last step
                model_state, optim_state = get_state_dict(net, opt)
                state = {"model": model_state, "optim": optim_state}
                dcp.save(state, checkpoint_id=path / "ckpt")
            step(x, y)
            if case != "in_backward":
                opt.step()
                opt.zero_grad()
        sharder = step.model.gradient_sharder
        found[case] = {
            "state": {k: p.full_tensor().clone() for k, p in net.named_parameters()},
            "units": {k: [p for p, _ in group] for k, group in sharder.units.items()},
            "gathered": sharder.gathered_bytes,
            "grads_left": sum(p.grad is not None for p in net.parameters()),
        }
    found["lm"] = {seq: _lm(rank, path, 4, seq) for seq in (5, 10)}
    found["tied"] = _lm(rank, path, 4, 5, tied=True)
    torch.save(found, path / f"four{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _two_ranks_resume(rank: int, folder: str) -> None:
    """The four ranks' checkpoint loaded into two (other initial weights, replaced by it),
    and the last step taken there through ``unroll``."""
    path = Path(folder)
    _init(path, rank, 2, "store2")
    net = _wrapped(1)
    opt = _adamw(net.parameters())
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path / "ckpt")
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    x, y = _share(_data()[-1], rank, 2)
    step = unroller.unroll(net, (x,), y, directory=path / f"r{rank}")
    step(x, y)
    opt.step()
    found = {k: p.full_tensor().clone() for k, p in net.named_parameters()}
    torch.save(found, path / f"resumed{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = Net().double()
    opt = _adamw(ref.parameters())
    for x, y in _data():
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ref.named_parameters()}


def test_four_ranks_train_a_module_the_user_sharded_as_one_process(tmp_path):
    want = _reference()
    mp.spawn(_four_ranks, args=(str(tmp_path),), nprocs=4, join=True)
    for rank in range(4):
        found = torch.load(tmp_path / f"four{rank}.pt")
        for case in CASES:
            got = found[case]["state"]
            assert got.keys() == want.keys()
            worst = max(rel_err(got[k], want[k]) for k in want)
            assert worst <= 1e-10, (case, worst)
        # each block's statements gather the user's block module; the rest is the root's
        units = found["blocks"]["units"]
        assert {k: v for k, v in units.items() if v} == {
            name: [name] for name in ("blocks.0", "blocks.1", "blocks.2")
        }, units
        assert found["blocks"]["gathered"] > 0
        assert not any(found["root_only"]["units"].values())
        assert found["in_backward"]["grads_left"] == 0
        for seq, lm in found["lm"].items():
            lm_want = _lm_reference(seq)
            worst = max(rel_err(lm["state"][k], lm_want[k]) for k in lm_want)
            assert worst <= 1e-10, ("lm", seq, worst)
            assert lm["rows"] == ["emb", "head"]  # not gathered by the step's K.gather
            assert lm["gathered"] == ["blocks.0", "blocks.1", "blocks.1", "blocks.0"]
        tied, tied_want = found["tied"], _lm_reference(5, tied=True)
        worst = max(rel_err(tied["state"][k], tied_want[k]) for k in tied_want)
        assert worst <= 1e-10, ("tied", worst)
        assert tied["rows"] == []
    mp.spawn(_two_ranks_resume, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        resumed = torch.load(tmp_path / f"resumed{rank}.pt")
        worst = max(rel_err(resumed[k], want[k]) for k in want)
        assert worst <= 1e-10, worst


def _bad_layouts(rank: int, folder: str) -> None:
    path = Path(folder)
    _init(path, rank, 2, "store")
    x, y = _share(_data()[0], rank, 2)
    layouts = {
        "one rank wraps a block": lambda: _wrapped(0, blocks=rank == 0),
        "the root left out": lambda: _wrapped(0, root=False),
    }
    said = {}
    for what, make in layouts.items():
        try:
            unroller.unroll(make(), (x,), y, directory=path / f"g{rank}")
            said[what] = "no error"
        except Exception as exc:  # noqa: BLE001 - what it raises is what the test reads
            said[what] = f"{type(exc).__name__}: {exc}"
    try:
        unroller.unroll(_wrapped(0), (x,), y, shard=False, directory=path / f"g{rank}")
        said["shard=False"] = "no error"
    except Exception as exc:  # noqa: BLE001
        said["shard=False"] = f"{type(exc).__name__}: {exc}"
    together = torch.ones(1)
    dist.all_reduce(together)  # both ranks are still in step with each other
    said["together"] = together.item()
    torch.save(said, path / f"said{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_a_layout_the_step_cannot_use_is_one_clear_error_on_every_rank(tmp_path):
    mp.spawn(_bad_layouts, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        said = torch.load(tmp_path / f"said{rank}.pt")
        assert said["one rank wraps a block"].startswith(
            "ShardError: rank 1 shards the module otherwise than rank 0 (module blocks.0: "
            "wrapped by fully_shard on rank 0, not wrapped there)"
        ), said
        assert said["the root left out"].startswith("ShardError: rank 0: parameter inp.weight")
        assert "wrap the module itself with fully_shard" in said["the root left out"]
        assert said["shard=False"].startswith("ShardError: unroll: shard=False")
        assert said["together"] == 2.0


def _bf16_ranks(rank: int, folder: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    path = Path(folder)
    _init(path, rank, 2, "store")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    found = {}
    for case in ("user policy", "shard=True"):
        if case == "user policy":
            net = _wrapped(0, policy=policy)
            extra = {}
        else:
            torch.manual_seed(0)
            net = Net()
            extra = {"shard": True, "precision": "bf16"}
        data = [_float_share(batch, rank, 2) for batch in _data()]
        step = unroller.unroll(net, data[0][:1], data[0][1], directory=path / f"g{rank}", **extra)
        opt = _adamw(net.parameters())
        for x, y in data:
            step(x, y)
            opt.step()
            opt.zero_grad()
        found[case] = {
            "state": {k: p.full_tensor().clone() for k, p in net.named_parameters()},
            "dtypes": {str(p.dtype) for p in net.parameters()},
            "text": step.source.splitlines()[0],
        }
    torch.save(found, path / f"bf16_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _float_share(batch, rank: int, world: int):
    x, y = _share(batch, rank, world)
    return x.float(), y


def _bf16_reference(tmp_path) -> dict[str, torch.Tensor]:
    """One process: float32 master weights; each step the average over the two halves of
    the bfloat16 step's gradients (a bfloat16 copy of the masters, unrolled the same way,
    its gradients cast to float32), then AdamW on the masters; one thread, as each rank
    runs (a bfloat16 layer norm's parameter gradients sum per thread: another rounding)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _bf16_masters(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _bf16_masters(tmp_path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    master = Net()
    opt = _adamw(master.parameters())
    for batch in _data():
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for rank in range(2):
            x, y = _float_share(batch, rank, 2)
            low = copy.deepcopy(master).bfloat16()
            step = unroller.unroll(low, (x,), y, precision="bf16", directory=tmp_path / "ref")
            step(x, y)
            for g, p in zip(grads, low.parameters()):
                g.add_(p.grad.float())
        for p, g in zip(master.parameters(), grads):
            p.grad = g / 2
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in master.named_parameters()}


def test_fsdp2_mixed_precision_gathers_and_computes_in_bf16_with_float32_shards(tmp_path):
    want = _bf16_reference(tmp_path)
    torch.manual_seed(0)
    fp32 = Net()
    opt = _adamw(fp32.parameters())
    for x, y in _data():
        torch.nn.functional.cross_entropy(fp32(x.float()), y).backward()
        opt.step()
        opt.zero_grad()
    mp.spawn(_bf16_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        found = torch.load(tmp_path / f"bf16_{rank}.pt")
        for case, got in found.items():
            assert got["dtypes"] == {"torch.float32"}, case  # the shards stay float32
            assert '"precision": "bf16"' in got["text"], case
            worst = max(rel_err(got["state"][k], want[k]) for k in want)
            assert worst <= 1e-6, (case, worst)
            away = max(rel_err(got["state"][k], v.detach()) for k, v in fp32.named_parameters())
            assert away > 1e-4, (case, away)  # it did compute in bfloat16


def _hf_llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _hf_batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(2)]


def _hf_ranks(rank: int, folder: str) -> None:
    """The canonical FSDP2 recipe on a Hugging Face Llama: each decoder layer, then the
    model, wrapped; AdamW over the shards; ``unroll`` on a keyword batch with labels."""
    from torch.distributed.fsdp import fully_shard

    path = Path(folder)
    _init(path, rank, 2, "store_hf")
    net = _hf_llama()
    for layer in net.model.layers:
        fully_shard(layer)
    fully_shard(net)
    opt = _adamw(net.parameters())
    step = None
    for ids in _hf_batches():
        mine = ids[rank * 2 : (rank + 1) * 2]
        batch = {"input_ids": mine, "labels": mine}
        step = step or unroller.unroll(net, batch, directory=path / f"hf{rank}")
        step(**batch)
        opt.step()
        opt.zero_grad()
    found = {k: p.full_tensor().clone() for k, p in net.named_parameters()}
    torch.save(found, path / f"hf{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_a_hugging_face_llama_the_user_sharded_trains_as_one_process(tmp_path):
    """Two ranks, each on half of every batch, end two AdamW steps where torch.autograd
    ends in one process on the whole batch (float64, 1e-10; Hugging Face's RMSNorm as it
    computes without its float32 cast, as verify compares it; its shifted loss)."""
    pytest.importorskip("transformers")
    from unroller.importer.hf_norms import swap_float64_twins

    ref = _hf_llama()
    swap_float64_twins(ref)
    opt = _adamw(ref.parameters())
    for ids in _hf_batches():
        logits = ref(input_ids=ids).logits
        v = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    mp.spawn(_hf_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    want = {k: v.detach() for k, v in ref.named_parameters()}
    for rank in range(2):
        got = torch.load(tmp_path / f"hf{rank}.pt")
        worst = max(rel_err(got[k], want[k]) for k in want)
        assert worst <= 1e-10, worst
