"""``--precision`` in the benchmark harness and the lora_llama preset.

Fast: the flag (a bad value is one line and exit 2, on the suite and on lora_llama), the
peers a mixed precision picks, the options every ours row is generated with; one tiny
bf16-mixed step of every method the suite builds (ours, autograd and checkpointing under
torch.autocast) and one plain bf16 step; a peft LoRA Llama through ``unroller.unroll`` in
bf16-mixed (float32 loss, float32 gradients on the LoRA matrices only, close to autograd
under autocast); the lora_llama preset's methods and a tiny run of it end to end; the
headline and summary tables of a mixed-precision run; the goals under a mixed precision.
Slow (SLOW=1): every module the bf16-mixed quick run of the transformers generates.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import SLOW_MARK
from typer.testing import CliRunner

from unroller.bench import config, lora, models, peers, per_sample, suite, targets
from unroller.bench import precision as bench_precision
from unroller.bench.reference import BENCHMARKS
from unroller.cli import app

CPU = torch.device("cpu")
MIB = 2**20
TRANSFORMERS = "vit_tiny,gpt_tiny,gpt_small,bert_encoder"
#: a Llama small enough for a step in milliseconds
TINY_LLAMA = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"]
TINY_LLAMA += ["--intermediate", "64", "--vocab", "64", "--rank", "4"]

needs_peft = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None,
    reason="the lora_llama preset needs peft and transformers (the dev extra)",
)


# --------------------------------------------------------------------------- the flag


@pytest.mark.parametrize("preset", [[], ["lora_llama"]])
def test_a_bad_precision_is_one_line_and_exit_2(preset):
    """The suite's and the lora_llama preset's flags fail alike: one line, status 2."""
    result = CliRunner().invoke(app, ["bench", *preset, "--precision", "nonsense"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "unknown precision 'nonsense'" in lines[0] and "bf16-mixed" in lines[0]


def test_precision_defaults_and_the_peers_a_mixed_precision_picks():
    assert config.parse_args([]).precision == "fp32"
    args = config.parse_args(["--precision", "bf16-mixed"])
    assert args.precision == "bf16-mixed" and args.peers == ["checkpoint"]
    full = config.parse_args(["--precision", "bf16-mixed", "--full"])
    assert full.peers == ["checkpoint", *config.COMPILED_PEERS]
    asked = config.parse_args(["--precision", "bf16-mixed", "--peers", "checkpoint,hooks"])
    assert asked.peers == ["checkpoint", "hooks"]
    assert config.parse_args(["--precision", "bf16"]).peers == ["checkpoint", "hooks"]
    with pytest.raises(SystemExit) as exc:  # PopTorch's modules are float32
        config.parse_args(["--precision", "bf16-mixed", "--platform", "ipu", "--emulate"])
    assert exc.value.code == 2


def test_every_ours_row_is_generated_in_the_precision():
    args = config.parse_args(["--precision", "bf16-mixed", "--benchmark", TRANSFORMERS])
    for name in args.benchmarks:
        bench = BENCHMARKS[name]
        builds = suite.ours_builds(bench, args, models.resolution_of(bench, args))
        assert {b.options.precision for b in builds} == {"bf16-mixed"}
        assert any("+blocks+pieces" in b.name for b in builds)


def test_peer_precision():
    mixed, plain, fp32 = (bench_precision.of(n) for n in ("bf16-mixed", "bf16", "fp32"))
    assert mixed.autocast is torch.bfloat16 and mixed.dtype is None
    assert plain.dtype is torch.bfloat16 and plain.autocast is None
    assert fp32.is_default and bench_precision.about("fp32") is None
    with mixed.forward_context(CPU):
        assert torch.is_autocast_enabled("cpu")
    ids, x = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
    assert [t.dtype for t in plain.batch([ids, x])] == [torch.long, torch.bfloat16]
    assert "torch.autocast(cpu, bfloat16)" in bench_precision.about("bf16-mixed", CPU)
    with pytest.raises(ValueError, match="unknown precision"):
        bench_precision.parse("fp8")


# --------------------------------------------------------------------------- suite steps


def _one_step_each(name: str, argv: list[str], tmp_path: Path) -> dict[str, torch.Tensor]:
    args = config.parse_args(["--benchmark", name, "--no-recompute", *argv])
    bench = BENCHMARKS[name]
    resolution = models.resolution_of(bench, args)
    ref = models.build_reference(bench, resolution, 0, CPU)
    ref = bench_precision.of(args.precision).module(ref)
    notes: list[str] = []
    methods = suite._methods(bench, args, resolution, ref, CPU, tmp_path, notes)
    batch = bench_precision.of(args.precision).batch(models.batch_on(bench, 2, resolution, 0, CPU))
    losses = {}
    for m in methods:
        losses[m.name] = m.step(batch).detach()
        grads = [p.grad for p in m.module.parameters() if p.grad is not None]
        assert grads, m.name
        want = torch.bfloat16 if args.precision == "bf16" else torch.float32
        assert {g.dtype for g in grads} == {want}, m.name
    assert not notes
    return losses


def test_one_bf16_mixed_step_of_every_suite_method(tmp_path: Path):
    argv = ["--precision", "bf16-mixed", "--scheme", "nocompress,quant"]
    losses = _one_step_each("gpt_tiny", argv, tmp_path)
    assert set(losses) == {
        "ours:nocompress",
        "ours:quant",
        "ours:nocompress+blocks+pieces",
        "ours:quant+blocks+pieces",
        "ours:quant+blocks+keep",
        "autograd",
        "checkpoint",
    }
    assert {t.dtype for t in losses.values()} == {torch.float32}
    base = float(losses["autograd"])
    for name, loss in losses.items():  # the CUDA policy against the CPU's: bf16 rounding
        assert abs(float(loss) - base) <= 2e-2 * abs(base), name


def test_one_plain_bf16_step(tmp_path: Path):
    argv = ["--precision", "bf16", "--scheme", "nocompress", "--no-segments", "--peers", "none"]
    losses = _one_step_each("vit_tiny", argv, tmp_path)
    assert set(losses) == {"ours:nocompress", "autograd"}
    assert abs(float(losses["ours:nocompress"]) - float(losses["autograd"])) < 5e-2


def test_hooks_under_autocast_compress_low_precision_tensors():
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    class Ref(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = ref

        def forward(self, x, y):
            return (torch.nn.functional.cross_entropy(self.net(x).float(), y),)

    method = peers.hooks("quant", Ref(), bench_precision.of("bf16-mixed").contexts(CPU))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    loss = method.step([x, y])
    assert loss.dtype is torch.float32 and ref[0].weight.grad.dtype is torch.float32
    assert method.stash([x, y])["compressed_calls"] > 0


# --------------------------------------------------------------------------- LoRA Llama


def _tiny_lora(dropout: float = 0.0):
    args = lora.parse_args([*TINY_LLAMA, "--lora-dropout", str(dropout)])
    model = lora.build_model(args.shape, 16, seed=0)
    with torch.no_grad():  # peft starts B at zero (so A's gradient is zero): not here
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return args, model


@needs_peft
def test_peft_lora_through_unroll_in_bf16_mixed(tmp_path: Path):
    import unroller

    args, model = _tiny_lora()
    ids = torch.randint(0, args.shape.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    step = unroller.unroll(
        model,
        {"input_ids": ids, "labels": ids},
        precision="bf16-mixed",
        scheme="nocompress",
        directory=tmp_path,
    )
    out = step(input_ids=ids, labels=ids)
    assert out.loss.dtype is torch.float32
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert frozen and all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    assert {g.dtype for g in trained.values()} == {torch.float32}
    ours = {n: g.clone() for n, g in trained.items()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = model(input_ids=ids, labels=ids)
    theirs.loss.backward()
    assert abs(float(out.loss.detach()) - float(theirs.loss.detach())) <= 1e-2 * float(out.loss)
    for name, grad in ours.items():  # bf16 matmuls on both sides, CUDA's policy vs the CPU's
        other = dict(model.named_parameters())[name].grad
        assert float((grad - other).norm()) <= 0.1 * float(other.norm()) + 1e-6, name


@needs_peft
def test_lora_methods_step_and_only_lora_weights_train(tmp_path: Path):
    args, model = _tiny_lora()
    args.schemes, args.peers = ["nocompress"], list(lora.PEERS)
    batch = lora.make_batch(args.shape, 2, 16, seed=0)
    found = lora.methods(model, args, batch, CPU, tmp_path)
    names = [m.name for m in found]
    assert names == [
        "ours:nocompress",
        "ours:nocompress+blocks+pieces",
        "autograd",
        "checkpoint",
        "hf-checkpoint",
    ]
    assert [r[0] for r in lora.ours_rows(["nocompress", "quant", "auto"], True)] == [
        "ours:nocompress",
        "ours:quant",
        "ours:auto",
        "ours:nocompress+blocks+pieces",
        "ours:quant+blocks+pieces",
    ]
    losses = {}
    for m in found:
        losses[m.name] = float(m.step(batch))
        grads = {n: p.grad for n, p in m.module.named_parameters() if p.grad is not None}
        assert grads and all("lora_" in n for n in grads), m.name
        assert {g.dtype for g in grads.values()} == {torch.float32}, m.name
    assert max(losses.values()) - min(losses.values()) <= 1e-2 * losses["autograd"]
    # the two checkpointing peers checkpoint every decoder layer
    assert len(lora.decoder_layers(model)) == args.shape.layers
    assert any("gradient checkpointing" in n for n in found[-1].notes)


@needs_peft
def test_lora_preset_end_to_end(tmp_path: Path):
    argv = [*TINY_LLAMA, "--sequence", "16", "--budget-sequence", "16"]
    argv += ["--scheme", "nocompress", "--no-segments", "--iterations", "1", "--warmup", "1"]
    argv += ["--memory-budget", "4MiB", "--max-step-seconds", "0.5", "--no-progress"]
    argv += ["--peers", "hf-checkpoint"]
    argv += ["--out-dir", str(tmp_path)]
    assert lora.main(argv) == 0
    lines = [json.loads(x) for x in (tmp_path / "lora.jsonl").read_text().splitlines()]
    meta, runs = lines[0], [x for x in lines if x["type"] == "run"]
    assert meta["precision"] == "bf16-mixed" and "peft" in meta["about"][1]
    assert {r["benchmark"] for r in runs} == {"lora_llama@16"}
    assert [r["method"] for r in runs] == ["ours:nocompress", "autograd", "hf-checkpoint"]
    for r in runs:
        assert r["per_sample"]["batches"] == [1, 2] and r["time_ms"]["median"] > 0
        assert r["max_batch"]["max_batch"] >= 1
    goals = {g["goal"] for g in lines if g["type"] == "goal"}
    assert {"per_sample_nocompress", "per_sample_best_mixed", "max_batch_imported"} <= goals
    assert "lora_llama@16" in (tmp_path / "lora.md").read_text()


def test_lora_preset_without_peft_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    assert lora.main(["--sequence", "16", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "peft" in err[0] and "pip install" in err[0]


def test_lora_preset_flags():
    args = lora.parse_args([])
    assert args.sequences == [512, 2048] and args.budget_sequences == [2048]
    assert args.precision == "bf16-mixed" and args.memory_budget == 2**30
    assert args.schemes == list(lora.DEFAULT_SCHEMES) and args.peers == list(lora.PEERS)
    assert lora.parse_args(["--peers", "none", "--memory-budget", "none"]).peers == []
    for bad in (["--sequence", "x"], ["--peers", "deepspeed"], ["--lora-dropout", "1"]):
        with pytest.raises(SystemExit) as exc:
            lora.parse_args(bad)
        assert exc.value.code == 2


# --------------------------------------------------------------------------- goals, tables


def _rec(method, slope, time=1.0, bench="gpt_small", precision="bf16-mixed", max_batch=None):
    kind = "ours" if method.startswith("ours:") else method.split(":")[0]
    kind = "checkpoint" if kind == "hf-checkpoint" else kind
    return {
        "benchmark": bench,
        "method": method,
        "kind": kind,
        "scheme": None,
        "precision": precision,
        "device": "cpu",
        "batch": 4,
        "time_ratio": {"median": time},
        "max_batch": (
            None
            if max_batch is None
            else {"max_batch": max_batch, "confirmed": False, "basis": "predicted"}
        ),
        "predicted": None,
        "max_batch_speed": None,
        "stash": {"rows": [], "raw_bytes": 1, "stored_bytes": 1},
        "memory": None,
        "per_sample": per_sample.slope([(4, 10_000), (8, 10_000 + 4 * slope)]),
    }


def test_mixed_precision_goals_ask_16x_and_every_checkpointing_peer():
    rows = [
        _rec("autograd", 1_600_000),
        _rec("checkpoint", 200_000),
        _rec("ours:nocompress", 1_600_000),
        _rec("ours:quant+blocks+pieces", 90_000, time=1.2),
    ]
    found = {g["goal"]: g for g in targets.evaluate(rows, "cpu")}
    best = found["per_sample_best_mixed"]
    assert best["met"] is True and "bf16-mixed" in best["text"] and "16x" in best["text"]
    assert "per_sample_best" not in found  # the fp32 goal is not stated here
    rows[-1]["per_sample"] = per_sample.slope([(4, 10_000), (8, 10_000 + 4 * 150_000)])
    best = {g["goal"]: g for g in targets.evaluate(rows, "cpu")}["per_sample_best_mixed"]
    assert best["met"] is False  # 10.7x
    fp32 = [dict(r, precision="fp32") for r in rows]
    assert "per_sample_best" in {g["goal"] for g in targets.evaluate(fp32, "cpu")}


def test_imported_goals_count_hugging_face_checkpointing():
    bench = "lora_llama@512"
    rows = [
        _rec("autograd", 1_600_000, bench=bench, max_batch=8),
        _rec("checkpoint", 200_000, bench=bench, max_batch=40),
        _rec("hf-checkpoint", 100_000, bench=bench, max_batch=60),
        _rec("ours:nocompress", 1_600_000, bench=bench, max_batch=8),
        _rec("ours:quant+blocks+pieces", 150_000, time=1.25, bench=bench, max_batch=50),
    ]
    found = {g["goal"]: g for g in targets.evaluate(rows, "cpu")}
    # 10.7x less than autograd, but more than hf-checkpoint keeps
    assert found["per_sample_best_imported"]["met"] is False
    assert "hf-checkpoint 16.00x less" in found["per_sample_best_imported"]["figures"]
    assert found["per_sample_best_mixed"]["met"] is False
    assert found["max_batch_imported"]["met"] is False  # 50 < hf-checkpoint's 60
    assert found["max_batch_imported"]["value"].startswith("50 (predicted)")
    rows[-1]["per_sample"] = per_sample.slope([(4, 10_000), (8, 10_000 + 4 * 90_000)])
    rows[-1]["max_batch"]["max_batch"] = 70
    found = {g["goal"]: g for g in targets.evaluate(rows, "cpu")}
    assert found["per_sample_best_imported"]["met"] is True
    assert found["per_sample_best_mixed"]["met"] is True
    assert found["max_batch_imported"]["met"] is True


def _write(tmp_path: Path, name: str, precision: str, rows: list[dict]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    meta = {"type": "meta", "command": f"python -m benchmarks.run --precision {precision}"}
    meta.update(precision=precision, cpu_count=2, torch="x", date="2026-12-07T00:00:00")
    lines = [meta, *({"type": "run", **r} for r in rows)]
    (folder / "bench.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return folder


def test_headline_holds_fp32_and_mixed_precision_rows(tmp_path: Path):
    from benchmarks.headline import headline_of

    fp32 = _write(
        tmp_path,
        "fp32",
        "fp32",
        [
            dict(_rec("autograd", 8 * MIB, precision="fp32"), time_ratio={"median": 1.0}),
            _rec("ours:quant", 2 * MIB, time=1.2, precision="fp32"),
            _rec("checkpoint", 4 * MIB, time=1.5, precision="fp32"),
        ],
    )
    mixed = _write(
        tmp_path,
        "mixed",
        "bf16-mixed",
        [
            _rec("autograd", 4 * MIB),
            _rec("ours:quant", MIB / 4, time=1.1),
            _rec("checkpoint", 2 * MIB, time=1.4),
        ],
    )
    table = headline_of([fp32, mixed], 1.3)
    rows = [line for line in table.splitlines() if line.startswith("| gpt_small")]
    assert len(rows) == 2
    assert "| fp32 |" in rows[0] and "4.0x less at 1.20x time" in rows[0]
    assert "| bf16-mixed (CPU) |" in rows[1] and "16.0x less at 1.10x time" in rows[1]
    assert "torch.autocast" in table and "not GPU times" in table
    assert table.count("Measured by:") == 2


def test_summary_matrix_names_autocast(tmp_path: Path):
    from benchmarks.summary_tables import per_sample_matrix

    mixed = _write(
        tmp_path,
        "mixed",
        "bf16-mixed",
        [_rec("autograd", 4 * MIB), _rec("ours:quant", MIB / 4, time=1.1)],
    )
    table = per_sample_matrix(mixed / "bench.jsonl")
    assert "autograd under torch.autocast" in table


# --------------------------------------------------------------------------- generation


def _mixed_builds() -> list:
    args = config.parse_args(["--precision", "bf16-mixed", "--benchmark", TRANSFORMERS])
    found = []
    for name in args.benchmarks:
        bench = BENCHMARKS[name]
        resolution = models.resolution_of(bench, args)
        for build in suite.ours_builds(bench, args, resolution):
            fast = name == "gpt_tiny" and build.name in (
                "ours:nocompress",
                "ours:quant+blocks+pieces",
            )
            found.append(
                pytest.param(
                    name, build, id=f"{name}-{build.name}", marks=() if fast else SLOW_MARK
                )
            )
    return found


@pytest.mark.parametrize(("name", "build"), _mixed_builds())
def test_the_bf16_mixed_quick_rows_generate(name, build):
    """Every module the bf16-mixed quick run builds generates and the memory model
    simulates it (gpt_tiny's plain and segment rows in make test, the rest SLOW=1)."""
    bench = BENCHMARKS[name]
    source = bench.generate(build.options)
    assert "class Model" in source and '"precision": "bf16-mixed"' in source.splitlines()[0]
    predicted = models.predict_memory(bench, build.options, 2)
    assert predicted is not None and predicted["peak_bytes"] > 0
