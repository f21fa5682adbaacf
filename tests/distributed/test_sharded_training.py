"""``unroll train --shard --nproc-per-node 2``: sharded data parallel through the command
line (torchrun, gloo, two processes).

- The two-epoch run's losses and weights are the replicated run's (``--nproc-per-node 2``)
  up to float32 rounding (the average is the same; the sums run in another order).
- Its checkpoint holds plain full tensors, as an unsharded run's: the generated module
  (unsharded) loads its weights.
- A run cut after its first epoch and resumed ends as the uninterrupted one, bit for bit.
- Refused: ``--shard`` without two or more processes, with ``--sync-bn``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unroller.training.loop import TrainConfig, TrainError, load_checkpoint

BLOCKS = """model blocks {
    input x: f32[N, 1, 8, 8]
    target y: i64[N]
    block mlp(x, width) {
        norm = layernorm(x, normalized_shape=width)
        h = linear(norm, out_features=width)
        a = gelu(h)
        out = add(x, a)
        return out
    }
    flat = flatten(x)
    inp = linear(flat, out_features=24)
    blocks.0 = mlp(inp, width=24)
    blocks.1 = mlp(blocks.0, width=24)
    fc = linear(blocks.1, out_features=10)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""
SETTINGS = ["--dataset", "digits", "--train-size", "64", "--test-size", "16", "--batch-size", "16"]
SETTINGS += ["--optimizer", "adam", "--lr", "0.01", "--quiet", "--nproc-per-node", "2"]


def _train(folder: Path, out: str, *extra: str) -> dict:
    command = [sys.executable, "-m", "unroller.cli", "train", "m.txt", *SETTINGS, "-o", out]
    result = subprocess.run(
        [*command, *extra], cwd=folder, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return load_checkpoint(folder / out / "checkpoint.pt")


@pytest.mark.slow  # six torchrun launches of two processes: make test-slow
def test_sharded_run_equals_the_replicated_one_and_resumes_exactly(tmp_path):
    (tmp_path / "m.txt").write_text(BLOCKS)
    sharded = _train(tmp_path, "sharded", "--shard", "--epochs", "2")
    replicated = _train(tmp_path, "replicated", "--epochs", "2")
    for a, b in zip(sharded["history"], replicated["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    for key, value in replicated["model"].items():
        got = sharded["model"][key]
        assert type(got) is torch.Tensor and got.shape == value.shape, key
        assert torch.allclose(got, value, rtol=1e-4, atol=1e-6), key
    _train(tmp_path, "cut", "--shard", "--epochs", "1")
    resumed = _train(tmp_path, "cut", "--shard", "--epochs", "2", "--resume", "cut/checkpoint.pt")
    assert [r["train_loss"] for r in resumed["history"]] == [
        r["train_loss"] for r in sharded["history"]
    ]
    assert all(torch.equal(resumed["model"][k], v) for k, v in sharded["model"].items())


@pytest.mark.parametrize(
    "fields,words",
    [({"nproc_per_node": 1}, "2 or more"), ({"nproc_per_node": 2, "sync_bn": True}, "sync-bn")],
)
def test_shard_is_refused_without_processes_or_with_sync_bn(tmp_path, fields, words):
    model = tmp_path / "m.txt"
    model.write_text(BLOCKS)
    config = TrainConfig(model=str(model), shard=True, **fields)
    with pytest.raises(TrainError, match=words):
        config.validate()
