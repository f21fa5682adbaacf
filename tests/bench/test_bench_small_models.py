"""The benchmark suite on the spec-v2 models (vit_tiny, gpt_tiny; tcn_small and
mobilenet_v2 run in `make bench` too).

Fast: the suite's default model list holds the four spec-v2 models; the hook-based peer
keeps integer tensors (token ids) and compresses the token tensors of a transformer and
the [N, C, L] signals of a 1-D conv net with quant, while dct stays on 4-D maps. Slow
(SLOW=1): the suite end to end on vit_tiny and gpt_tiny at batch 2, one timed round,
every scheme and every peer: the same loss everywhere, dct leaves gpt_tiny's token
tensors raw (what the README says), quant stores less, the hook peers compress
floating token tensors and never the integer ids. Nothing here asserts speed or memory
targets.
"""

from __future__ import annotations

import json

import pytest
import torch

from unroller.bench import config, main, peers
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.schemes import SCHEMES, builtin

slow = pytest.mark.slow

V2 = ("vit_tiny", "gpt_tiny", "tcn_small", "mobilenet_v2")
PEERS = ["autograd", "checkpoint", "hooks:dct-dense", "hooks:quant"]


def test_the_suite_runs_the_spec_v2_models_by_default():
    args = config.parse_args([])
    assert args.benchmarks == [*config.PUBLISHED, *V2, "gpt_small", "bert_encoder"]
    assert set(V2) <= set(BENCHMARKS)


#: the hooks' module, alive for the whole file: the hooks know its parameters by storage
#: address, and a module freed after the hooks were made could hand a later tensor (the
#: token ids below) one of those addresses, which the hooks would then take for a parameter
MODULE = torch.nn.Linear(64, 64)


def _hooks(scheme: str) -> peers.CompressingHooks:
    return peers.CompressingHooks(builtin(scheme).default.instance(), MODULE)


def test_hook_peers_on_tokens_ids_and_signals():
    quant, dct = _hooks("quant"), _hooks("dct-dense")
    ids = BENCHMARKS["gpt_tiny"].make_batch(2)[0]
    assert ids.dtype == torch.int64 and ids.shape == (2, 64)
    for hk in (quant, dct):
        assert not hk.eligible(ids)
        assert hk.pack(ids) is ids  # kept as it is, counted once
        assert hk.compressed_calls == 0 and sum(hk.kept.values()) == ids.numel() * 8
    tokens, rows, signal = torch.randn(2, 65, 64), torch.randn(130, 64), torch.randn(2, 32, 128)
    for t in (tokens, rows, signal, torch.randn(2, 4, 64, 16)):
        assert quant.eligible(t)
        back = quant.unpack(quant.pack(t))
        assert back.shape == t.shape and (back - t).abs().max() < 0.05
    assert not quant.eligible(torch.randn(2, 64, 1))  # a layer norm's per-row statistic
    assert not quant.eligible(torch.randn(64))
    assert not quant.eligible(torch.nn.Parameter(torch.randn(64, 64)))
    assert not dct.eligible(tokens) and not dct.eligible(signal)
    assert quant.compressed_shapes == {
        "[2, 65, 64]": 1,
        "[130, 64]": 1,
        "[2, 32, 128]": 1,
        "[2, 4, 64, 16]": 1,
    }


@pytest.fixture(scope="module")
def v2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_v2")
    argv = ["--benchmark", "vit_tiny,gpt_tiny", "--batch-size", "2", "--iterations", "1"]
    argv += ["--warmup", "0", "--memory-budget", "none", "--no-plots", "--no-progress"]
    assert main([*argv, "--out-dir", str(out)]) == 0
    lines = [json.loads(x) for x in (out / "bench.jsonl").read_text("utf-8").splitlines()]
    runs = [x for x in lines if x["type"] == "run"]
    return {(r["benchmark"], r["method"]): r for r in runs}, out


@slow
def test_every_model_runs_every_scheme_and_peer(v2_run):
    by, out = v2_run
    assert "| gpt_tiny | 2 @ 64 |" in (out / "bench.md").read_text("utf-8")
    for bench, tokens in (("vit_tiny", 65), ("gpt_tiny", 64)):
        methods = [m for b, m in by if b == bench]
        assert methods == [f"ours:{s}" for s in SCHEMES] + PEERS
        loss = by[bench, "autograd"]["loss"]
        for m in methods:
            r = by[bench, m]
            assert r["loss"] == pytest.approx(loss, rel=1e-5)  # same weights, same batch
            assert r["memory"]["step_peak_bytes"] > 0
            assert 0 < r["stash"]["stored_bytes"] <= r["stash"]["raw_bytes"]
        noc = by[bench, "ours:nocompress"]["stash"]["stored_bytes"]
        assert by[bench, "ours:quant"]["stash"]["stored_bytes"] < noc / 2
        assert by[bench, "hooks:quant"]["stash"]["stored_bytes"] < noc
        shapes = by[bench, "hooks:quant"]["stash"]["compressed_shapes"]
        assert f"[2, {tokens}, 64]" in shapes  # token tensors [N, L, E]
        assert f"[{2 * tokens}, 64]" in shapes  # their [N * L, E] views (linear inputs)
    # gpt_tiny: every value is a token tensor or an attention map: dct leaves them raw
    for scheme in ("dct-first", "dct-dense"):
        r = by["gpt_tiny", f"ours:{scheme}"]["stash"]
        assert r["stored_bytes"] == by["gpt_tiny", "ours:nocompress"]["stash"]["stored_bytes"]
    # the integer ids are saved (by the embedding) and never compressed
    assert by["gpt_tiny", "autograd"]["stash"]["counted"]["by_kind_bytes"]["batch"] > 0
    for scheme in ("dct-dense", "quant"):
        shapes = by["gpt_tiny", f"hooks:{scheme}"]["stash"]["compressed_shapes"]
        assert "[2, 64]" not in shapes
