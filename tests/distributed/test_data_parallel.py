"""Data parallel over torch.distributed (gloo, two processes this test starts itself).

- Two processes, each on half the batch, end three SGD steps with the weights one process
  reaches on the whole batch (float64, 1e-12): the all-reduced gradients are the averages.
- With batch norm and ``sync_bn``, the same holds (running statistics included).
- The same weights as torch's DistributedDataParallel wrapping the equivalent torch.nn
  module after three steps.
- Several buckets, each started right after the backward run that finished it, and the
  overlap figures are in range.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import generated_text, rel_err
from torch import nn

from unroller.api import generate_from_text, import_generated, write_atomic
from unroller.compiler.options import Options

PLAIN = """model plain {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    conv1 = conv2d(x, out_channels=6, kernel_size=3, padding=1)
    r1 = relu(conv1)
    conv2 = conv2d(r1, out_channels=6, kernel_size=3, padding=1)
    r2 = relu(conv2)
    pool = adaptive_avgpool2d(r2, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=4)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""
NORMED = PLAIN.replace("model plain", "model normed").replace(
    "r1 = relu(conv1)", "bn1 = batchnorm2d(conv1)\n    r1 = relu(bn1)"
)
BATCH, STEPS, WORLD = 8, 3, 2


class Plain(nn.Module):
    """The torch.nn twin of PLAIN (same state-dict names)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x, y):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        out = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))
        return nn.functional.cross_entropy(out, y)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (BATCH,), generator=g)
        batches.append((x, y))
    return batches


def _module(folder: Path, text: str, name: str, **options):
    source = generated_text(text, Options(data_parallel=True, **options), f"{name}.txt")
    return import_generated(write_atomic(folder / f"{name}.py", source), f"dp_{name}_{os.getpid()}")


def _train(model, batches, rank: int = 0, world: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n = BATCH // world
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        if loss.requires_grad:  # torch's DDP: autograd
            loss.backward()
        opt.step()


def _worker(rank: int, folder: str, text: str, name: str, kind: str, options: dict) -> None:
    from unroller.parallel import data as distributed

    folder_path = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder_path / 'store'}", rank=rank, world_size=WORLD
    )
    torch.set_num_threads(1)
    initial = torch.load(folder_path / "initial.pt")
    batches = _data()
    found: dict = {}
    if kind == "ddp":
        model = Plain().double()
        model.load_state_dict(initial)
        wrapped = nn.parallel.DistributedDataParallel(model)
        _train(wrapped, batches, rank, WORLD)
    else:
        module = import_generated(folder_path / f"{name}.py", f"dp_{name}_{rank}")
        model = module.Model().double()
        model.load_state_dict(initial)
        reducer = distributed.attach(model, sync_bn=kind == "sync_bn")
        _train(model, batches, rank, WORLD)
        found["overlap"] = distributed.overlap(reducer)
        found["launched"] = reducer.launched
    found["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(found, folder_path / f"{kind}_{rank}.pt")
    dist.barrier()  # both done before either tears gloo down (else an abort at exit)
    dist.destroy_process_group()


def _run(folder: Path, text: str, name: str, kind: str, **options) -> list[dict]:
    store = folder / "store"
    if store.exists():
        store.unlink()
    mp.spawn(_worker, args=(str(folder), text, name, kind, options), nprocs=WORLD, join=True)
    return [torch.load(folder / f"{kind}_{rank}.pt") for rank in range(WORLD)]


def _assert_same_state(got: dict, want: dict, tol: float = 1e-12) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if value.is_floating_point():
            assert rel_err(got[key], value) <= tol, (key, rel_err(got[key], value))
        else:
            assert torch.equal(got[key], value), key


# make test keeps one two-process run (batch norm synchronised, so the reducer and the
# statistics both cross processes); the plain model and the DDP peer under SLOW=1
@pytest.mark.parametrize(
    "text, name, kind",
    [pytest.param(PLAIN, "plain", "ours", marks=pytest.mark.slow), (NORMED, "normed", "sync_bn")],
)
def test_two_processes_equal_one_on_the_whole_batch(tmp_path, text, name, kind):
    module = _module(tmp_path, text, name, bucket_bytes=1)  # a bucket per run: several
    torch.manual_seed(0)
    single = module.Model().double()
    torch.save(single.state_dict(), tmp_path / "initial.pt")
    _train(single, _data())  # one process, the whole batch: the same file, no reducer
    results = _run(tmp_path, text, name, kind)
    for found in results:
        _assert_same_state(found["state"], single.state_dict())
        assert found["launched"] >= 2 * STEPS  # two or more buckets per step
        overlap = found["overlap"]
        assert 0.0 <= overlap["hidden_fraction"] <= 1.0 and overlap["allreduce_seconds"] > 0


@pytest.mark.slow  # two more processes: make test-slow
def test_same_weights_as_torch_ddp(tmp_path):
    """torch's DDP on the torch.nn twin, two processes, ends where one process of the
    generated module ends on the whole batch, which is where two of ours end (above)."""
    module = _module(tmp_path, PLAIN, "plain")
    torch.manual_seed(0)
    initial = Plain().double().state_dict()
    torch.save(initial, tmp_path / "initial.pt")
    single = module.Model().double()
    single.load_state_dict(initial)
    _train(single, _data())
    for found in _run(tmp_path, PLAIN, "plain", "ddp"):
        _assert_same_state(found["state"], single.state_dict())


def test_buckets_follow_the_backward(tmp_path):
    """Bucket 0 holds the last layer's gradients (final first), each reduce sits right after
    the run that finished its bucket, and the wait comes last."""
    source = generate_from_text(PLAIN, Options(data_parallel=True, bucket_bytes=1), "p.txt")
    lines = [line.strip() for line in source.splitlines()]
    reduces = [i for i, line in enumerate(lines) if line.startswith("K.reduce_bucket(")]
    assert len(reduces) >= 3
    first = " ".join(lines[reduces[0] : reduces[0] + 3])
    assert '"fc.weight"' in first and '"fc.bias"' in first
    wait = lines.index("K.reduce_wait(L)")
    assert wait > max(reduces)
    assert "K.reduce_bucket" not in generate_from_text(PLAIN, Options(), "p.txt")
    with pytest.raises(ValueError, match="data_parallel= is for platform='gpu'"):
        generate_from_text(PLAIN, Options(platform="ipu", data_parallel=True), "p.txt")


def test_one_process_runs_the_same_file_unchanged(tmp_path):
    """Without a reducer the reduce calls do nothing: the data-parallel file trains exactly
    as the plain one."""
    dp = _module(tmp_path, PLAIN, "plain").Model().double()
    source = generate_from_text(PLAIN, Options(), "plain.txt")
    plain = import_generated(write_atomic(tmp_path / "p.py", source), "dp_plain_ref").Model()
    plain = plain.double()
    plain.load_state_dict(dp.state_dict())
    _train(dp, _data())
    _train(plain, _data())
    _assert_same_state(dp.state_dict(), plain.state_dict(), 0.0)


# -- unroll train --nproc-per-node ---------------------------------------------------------

TRAIN = ["--dataset", "digits", "--train-size", "96", "--test-size", "32", "--batch-size", "24"]


def _train_cli(out: Path, *extra: str) -> None:
    import subprocess
    import sys

    command = [sys.executable, "-m", "unroller.cli", "train", "benchmarks/models/quick.txt"]
    command += [*TRAIN, "--out", str(out), "--quiet", *extra]
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def _final_state(out: Path) -> dict:
    from unroller.training.loop import load_checkpoint

    return load_checkpoint(out / "checkpoint.pt")


@pytest.mark.slow  # the heaviest test of the suite (torchrun + 3 trainings): make test-slow
def test_train_two_processes_with_sync_bn_is_the_one_process_run(tmp_path):
    """torchrun, two gloo processes, --sync-bn: the weights and the loss of one process on
    the whole batch, to float32 rounding (the sums are taken in another order; the float64
    equality is test_two_processes_equal_one_on_the_whole_batch's); rank 0 wrote the files,
    with both processes' generators in the checkpoint."""
    from unroller.training.loop import TrainConfig, train

    root = Path(__file__).resolve().parents[2]
    config = TrainConfig(
        model=str(root / "benchmarks/models/quick.txt"),
        dataset="digits",
        train_size=96,
        test_size=32,
        batch_size=24,
        epochs=1,
        lr=0.005,
    )
    train(config, tmp_path / "one", progress=False, log=lambda line: None)
    args = ["--epochs", "1", "--lr", "0.005", "--nproc-per-node", "2", "--sync-bn"]
    _train_cli(tmp_path / "two", *args)
    one, two = _final_state(tmp_path / "one"), _final_state(tmp_path / "two")
    keys = [k for k, v in one["model"].items() if v.is_floating_point()]
    flat = [torch.cat([state["model"][k].flatten() for k in keys]) for state in (one, two)]
    assert rel_err(flat[1], flat[0]) <= 1e-4  # measured 3.7e-5 after 4 steps
    a, b = one["history"][0]["train_loss"], two["history"][0]["train_loss"]
    assert abs(a - b) <= 1e-5 * abs(a)
    assert two["config"]["nproc_per_node"] == 2 and len(two["rng_ranks"]) == 2
    assert (tmp_path / "two" / "model.py").read_text().count("K.reduce_bucket(") >= 1


@pytest.mark.slow  # three torchrun launches: make test-slow
def test_train_two_processes_resume_exactly(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    _train_cli(whole, "--epochs", "2", "--nproc-per-node", "2")
    _train_cli(part, "--epochs", "1", "--nproc-per-node", "2")
    _train_cli(
        part, "--epochs", "2", "--nproc-per-node", "2", "--resume", str(part / "checkpoint.pt")
    )
    _assert_same_state(_final_state(part)["model"], _final_state(whole)["model"], 0.0)


def test_cli_generate_data_parallel_records_it_and_check_regenerates_it(tmp_path):
    from typer.testing import CliRunner

    from unroller.cli import app
    from unroller.compiler.codegen import read_header

    runner = CliRunner()
    model = tmp_path / "plain.txt"
    model.write_text(PLAIN)
    out = tmp_path / "gen" / "plain_dp.py"
    result = runner.invoke(
        app, ["generate", str(model), "--data-parallel", "-o", str(out), "--mkdir"]
    )
    assert result.exit_code == 0, result.output
    assert read_header(out.read_text())["data_parallel"] is True
    assert runner.invoke(app, ["check", str(out.parent)]).exit_code == 0
    refused = runner.invoke(app, ["generate", str(model), "--data-parallel", "--platform", "ipu"])
    assert refused.exit_code == 2 and "--data-parallel is for --platform gpu" in refused.output
