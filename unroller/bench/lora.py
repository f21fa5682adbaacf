"""The lora_llama preset: a LoRA fine-tune of a Llama-shaped model, trained through
``unroller.unroll``, against what a user of peft picks instead.

    unroll bench lora_llama [--sequence 512,2048] [--precision bf16-mixed]
        [--scheme nocompress,quant,auto] [--peers checkpoint,hf-checkpoint]
        [--memory-budget 1GiB] [--budget-sequence 2048] [--out-dir DIR]

(``python -m benchmarks.run lora_llama ...`` runs the same.) The model is
``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (4 layers, width 256, 8 query
heads over 2 key/value heads, MLP 688, vocabulary 1024 by default; random weights, nothing
downloaded) with peft's ``LoraConfig(r=8, target_modules=["q_proj", "v_proj"])`` on it:
only the LoRA matrices train, the base weights are frozen. The batch is random token ids,
with Hugging Face ``labels`` (the ids: the model shifts them itself), so the loss is the
model's own causal-LM loss.

Per sequence length, every method on the same weights and batch:

- ``ours:SCHEME``: ``step = unroller.unroll(model, {"input_ids": ids, "labels": ids},
  precision=P, scheme=SCHEME, logits=False)`` (the loss alone, as the peers' loops read it:
  no logits held through the backward), one step ``step(input_ids=ids, labels=ids)``; and
  ``ours:SCHEME+blocks+pieces`` (``recompute_segments="blocks", segment_piece_size=1``:
  each decoder layer keeps its input and runs again in its backward, one sample at a
  time);
- ``autograd``: ``model(input_ids=ids, labels=ids).loss.backward()``, the forward under
  ``torch.autocast`` for a mixed precision;
- ``checkpoint``: the same with ``torch.utils.checkpoint(use_reentrant=False)`` around
  every decoder layer (a copy of the model with the same weights);
- ``hf-checkpoint``: the same with Hugging Face's own gradient checkpointing
  (``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` with
  ``use_reentrant=False``; a copy of the model).

Measured as the suite measures (``unroller.bench.suite``): step time (interleaved rounds,
the ratio to autograd's per round), stashed bytes, the step peak (``measure.peak_step``),
bytes per sample (the slope of the step peak between the two ``--batches``), and on the
``--budget-sequence`` lengths the largest batch under ``--memory-budget``
(``budget.search``: a line through the two measured batches, confirmed by measured steps
up to ``--max-step-seconds``, beyond that predicted and marked so). Writes ``lora.jsonl``,
``lora.csv`` and ``lora.md`` (the suite's formats; the benchmark is named
``lora_llama@SEQUENCE``) to ``--out-dir``. Needs ``transformers`` and ``peft``
(``pip install -e '.[dev]'``); without them it says so and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from unroller.bench import budget, machine, options, output, peers, per_sample, targets
from unroller.bench import precision as bench_precision
from unroller.bench.paths import default_results_dir
from unroller.bench.peers import Method
from unroller.bench.timing import time_interleaved
from unroller.compiler.schemes import SCHEMES

NAME = "lora_llama"
DEFAULT_SCHEMES = ("nocompress", "quant", "auto")
SEGMENT_SCHEMES = ("nocompress", "quant")
#: the +blocks+pieces rows' piece size: one sample, since the batches measured here are 1
#: and 2 (the suite's 4 would never split them: the recompute would hold the whole batch)
SEGMENT_PIECE_SIZE = 1
PEERS = ("checkpoint", "hf-checkpoint")
KEYWORDS = ("input_ids", "labels")
OUT_NAME = "lora"
METHODS = {
    "ours": "step = unroller.unroll(model, {'input_ids': ids, 'labels': ids}, precision=P, "
    "scheme=S, logits=False[, recompute_segments='blocks', segment_piece_size=P]) (the loss "
    "alone, as the peers read it: no logits held through the backward), each row on its own "
    "copy of the model (same weights); per step "
    "model.zero_grad(set_to_none=True); step(input_ids=ids, labels=ids) (forward and "
    "unrolled backward; the LoRA gradients in the model's .grad). Its first step at a new "
    "batch imports and generates the step for that shape, so one untimed step comes first "
    "at every batch measured",
    "autograd": "model.zero_grad(set_to_none=True); loss = model(input_ids=ids, "
    "labels=ids).loss under torch.autocast(device, dtype) for a mixed precision; "
    "loss.backward() after it",
    "checkpoint": "the same on a copy of the model (same weights) whose every decoder layer "
    "runs under torch.utils.checkpoint.checkpoint(use_reentrant=False)",
    "hf-checkpoint": "the same on a copy of the model with Hugging Face's gradient "
    "checkpointing on (activation_checkpointing_enable, or gradient_checkpointing_enable on "
    "older transformers, with use_reentrant=False): transformers checkpoints every decoder "
    "layer, and makes the embedding output require grad",
}


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The Llama-shaped model and its LoRA adapters."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 1024
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def describe(self) -> str:
        return (
            f"LlamaForCausalLM ({self.layers} layers, hidden {self.hidden}, {self.heads} heads "
            f"/ {self.kv_heads} key-value heads, MLP {self.intermediate}, vocabulary "
            f"{self.vocab}, random weights) with peft LoRA r={self.rank}, alpha={self.alpha}, "
            f"dropout {self.dropout:g} on {', '.join(self.targets)}"
        )


class MissingPackages(RuntimeError):
    """transformers or peft is not installed."""


def _libraries() -> tuple[Any, Any]:
    """(transformers, peft), or MissingPackages naming what to install."""
    try:
        import peft
        import transformers
    except ImportError as exc:
        raise MissingPackages(
            f"the {NAME} preset needs transformers and peft ({exc}): pip install -e '.[dev]'"
        ) from None
    return transformers, peft


def build_model(shape: LlamaShape, sequence: int, seed: int) -> nn.Module:
    """The peft LoRA model in train mode, seeded: the same weights for the same seed."""
    transformers, peft = _libraries()
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(sequence, 2048),
        use_cache=False,
    )
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(
        r=shape.rank,
        lora_alpha=shape.alpha,
        lora_dropout=shape.dropout,
        target_modules=list(shape.targets),
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated names
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(base, lora)
    model.train()
    return model


def make_batch(shape: LlamaShape, batch: int, sequence: int, seed: int) -> list[Tensor]:
    """``[input_ids, labels]``: random token ids, the labels the ids themselves."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, shape.vocab, (batch, sequence), generator=gen)
    return [ids, ids.clone()]


class CausalLM(nn.Module):
    """``forward(ids, labels) -> (loss, logits)`` of a Hugging Face causal LM: the
    reference interface the suite's peers step (``loss = ref(*batch)[0]``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        out = self.model(input_ids=ids, labels=labels)
        return out.loss, out.logits


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The layers Hugging Face's gradient checkpointing checkpoints (its
    ``GradientCheckpointingLayer``s: the decoder layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """``model`` with torch.utils.checkpoint (use_reentrant=False) around every decoder
    layer's forward; the layers are counted in the model's notes."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers to checkpoint")
    for layer in layers:
        layer.forward = partial(_checkpointed, layer.forward)
    return model


def hf_checkpointing(model: nn.Module) -> str:
    """Turn on Hugging Face's gradient checkpointing with use_reentrant=False, as a user
    would; returns the call made."""
    kwargs = {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name's warning
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            return "activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return (
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
        )


def _copy(model: nn.Module) -> nn.Module:
    found = copy.deepcopy(model)
    found.load_state_dict(model.state_dict(), strict=True)
    found.train()
    return found


def ours_rows(
    schemes: Sequence[str], segments: bool, piece_size: int = SEGMENT_PIECE_SIZE
) -> list[tuple[str, str, dict[str, Any]]]:
    """(row name, scheme, unroll keywords) of every ours row, in table order."""
    rows = [(f"ours:{s}", s, {}) for s in schemes]
    if segments:
        fields = {"recompute_segments": "blocks", "segment_piece_size": piece_size}
        rows += [(f"ours:{s}+blocks+pieces", s, fields) for s in schemes if s in SEGMENT_SCHEMES]
    return rows


def methods(
    model: nn.Module,
    args: argparse.Namespace,
    example: list[Tensor],
    device: torch.device,
    directory: Path,
) -> list[Method]:
    """Ours (``ours_rows``, each through ``unroller.unroll``), autograd and the peers of
    --peers, the peers' forward in --precision's context."""
    import unroller

    found = []
    batch = dict(zip(KEYWORDS, example))
    for name, scheme, fields in ours_rows(args.schemes, args.segments, args.segment_piece_size):
        # a copy per row: two unroll steps of one peft model, called in turn, would each
        # import again at every call (torch.export replaces the model's peft_config and
        # LoRA kwargs dicts with equal copies, which the step's settings check sees)
        owner = _copy(model)
        step = unroller.unroll(
            owner,
            batch,
            precision=args.precision,
            scheme=scheme,
            directory=directory,
            logits=False,  # the loss alone, as the peers' loops read it
            **fields,
        )
        method = peers.ours_unrolled(scheme, step, owner, KEYWORDS)
        method.name = name
        method.compiles = True  # a new batch shape imports and generates in its first step
        method.variant = dict(fields)
        found.append(method)
    context = bench_precision.of(args.precision).contexts(device)
    found.append(peers.autograd(CausalLM(model), context))
    if "checkpoint" in args.peers:
        method = peers.autograd(CausalLM(checkpoint_layers(_copy(model))), context)
        method.name, method.kind = "checkpoint", "checkpoint"
        method.notes.append("torch.utils.checkpoint(use_reentrant=False) per decoder layer")
        found.append(method)
    if "hf-checkpoint" in args.peers:
        copied = _copy(model)
        call = hf_checkpointing(copied)
        method = peers.autograd(CausalLM(copied), context)
        method.name, method.kind = "hf-checkpoint", "checkpoint"
        method.notes.append(f"Hugging Face gradient checkpointing: model.{call}")
        found.append(method)
    return found


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = options.Parser(
        prog=prog,
        description=(
            "A peft LoRA fine-tune of a Llama-shaped model (transformers, random weights) "
            "trained through unroller.unroll, per scheme, against autograd, "
            "torch.utils.checkpoint per decoder layer and Hugging Face gradient "
            "checkpointing, all in --precision (autocast for the peers): step time, bytes "
            "per sample, and the max batch under a memory budget."
        ),
        epilog=f"Example: {prog} --sequence 512 --scheme nocompress,quant --iterations 3",
    )
    add = parser.add_argument
    add(
        "--sequence",
        default="512,2048",
        help="sequence lengths, a comma list (default: %(default)s)",
    )
    add(
        "--batches",
        type=options.pair,
        default=(1, 2),
        help="the two batch sizes A,B the bytes per sample are measured between; A is the "
        "timed batch (default: 1,2)",
    )
    add(
        "--precision",
        type=_precision,
        default="bf16-mixed",
        help=bench_precision.HELP.replace("(default: fp32)", "(default: bf16-mixed)"),
    )
    add(
        "--scheme",
        default=",".join(DEFAULT_SCHEMES),
        help=f"of {', '.join(SCHEMES)}, a comma list, or 'all' (default: %(default)s)",
    )
    add(
        "--segments",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run ours:SCHEME+blocks+pieces for nocompress and quant: every decoder layer "
        "recomputed in its backward, in pieces of --segment-piece-size samples (default: on)",
    )
    add(
        "--segment-piece-size",
        type=options.positive,
        default=SEGMENT_PIECE_SIZE,
        help="samples per piece of the +blocks+pieces rows' recompute (default: %(default)s, "
        "the batches measured being small)",
    )
    add(
        "--peers",
        default=",".join(PEERS),
        help=f"besides autograd: {', '.join(PEERS)}, 'all' or 'none' (default: %(default)s)",
    )
    add(
        "--memory-budget",
        default="1GiB",
        help="the budget of the max-batch search (2GiB, 512MiB) or 'none' (default: %(default)s)",
    )
    add(
        "--budget-sequence",
        default="2048",
        help="the sequence lengths the max batch is searched at, a comma list (default: "
        "%(default)s)",
    )
    add(
        "--max-step-seconds",
        type=float,
        default=60.0,
        help="the max-batch search measures no step predicted to take longer; beyond it the "
        "max batch is predicted and marked so (default: %(default)s)",
    )
    add("--iterations", type=options.positive, default=3, help="timed rounds")
    add("--warmup", type=options.non_negative, default=1, help="untimed rounds")
    shape = LlamaShape()
    add("--layers", type=options.positive, default=shape.layers)
    add("--hidden", type=options.positive, default=shape.hidden)
    add("--heads", type=options.positive, default=shape.heads)
    add("--kv-heads", type=options.positive, default=shape.kv_heads)
    add("--intermediate", type=options.positive, default=shape.intermediate)
    add("--vocab", type=options.positive, default=shape.vocab)
    add("--rank", type=options.positive, default=shape.rank)
    add("--lora-dropout", type=float, default=shape.dropout, help="LoRA dropout (default: 0)")
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--threads", type=options.positive, help="torch.set_num_threads (default: torch's)")
    add("--seed", type=int, default=0, help="weights and batch seed")
    add("--out-dir", type=Path, help="results folder (default: benchmarks/results/lora_llama)")
    add("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress lines")
    return parser


def _precision(text: str) -> str:
    try:
        return bench_precision.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lengths(text: str, flag: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        found = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        parser.error(f"{flag}: expected a comma list of lengths, got {text!r}")
    if not found or min(found) < 1:
        parser.error(f"{flag}: expected positive lengths, got {text!r}")
    return list(dict.fromkeys(found))


def parse_args(
    argv: Sequence[str] | None, prog: str = f"unroll bench {NAME}"
) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.sequences = _lengths(args.sequence, "--sequence", parser)
    args.budget_sequences = (
        []
        if args.budget_sequence.strip() == "none"
        else _lengths(args.budget_sequence, "--budget-sequence", parser)
    )
    args.schemes = options.choose(args.scheme, SCHEMES, SCHEMES, "scheme", parser)
    args.peers = (
        []
        if args.peers.strip() == "none"
        else options.choose(args.peers, PEERS, PEERS, "peer", parser)
    )
    if args.memory_budget.strip().lower() in ("none", "off"):
        args.memory_budget = None
    else:
        try:
            args.memory_budget = options.parse_bytes(args.memory_budget)
        except ValueError as exc:
            parser.error(f"argument --memory-budget: {exc}")
    if not 0.0 <= args.lora_dropout < 1.0:
        parser.error(f"argument --lora-dropout: expected 0 <= p < 1, got {args.lora_dropout}")
    if args.max_step_seconds < 0:
        parser.error("argument --max-step-seconds: expected seconds >= 0")
    args.shape = LlamaShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        rank=args.rank,
        dropout=args.lora_dropout,
    )
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    args.out_dir = args.out_dir or default_results_dir() / NAME
    return args


def _say(args: argparse.Namespace, what: str) -> None:
    if args.progress:
        print(f"{NAME}: {what}", file=sys.stderr, flush=True)


def bench_sequence(
    args: argparse.Namespace, sequence: int, device: torch.device, directory: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every method at one sequence length: the records, and what was run."""
    phases: dict[str, float] = {}
    started = last = time.perf_counter()

    def done(phase: str) -> None:
        nonlocal last
        now = time.perf_counter()
        phases[phase] = round(now - last, 2)
        last = now

    label = f"{NAME}@{sequence}"
    a, b = args.batches

    def batch_of(n: int) -> list[Tensor]:
        return [t.to(device) for t in make_batch(args.shape, n, sequence, args.seed)]

    model = build_model(args.shape, sequence, args.seed).to(device)
    batch = batch_of(a)
    _say(args, f"{label}: importing and generating")
    found = methods(model, args, batch, device, directory)
    names = [m.name for m in found]
    done("generate")
    _say(args, f"{label}: timing {', '.join(names)}")
    timing = time_interleaved(
        {m.name: partial(m.step, batch) for m in found},
        args.warmup,
        args.iterations,
        "autograd",
        device,
        on_round=lambda r: _say(args, f"{label}: round {r}"),
    )
    done("time")
    stash = {m.name: m.stash(batch) for m in found}
    done("stash")
    peaks: dict[str, dict[int, dict[str, Any]]] = {m.name: {} for m in found}
    for n in (a, b):
        at = batch if n == a else batch_of(n)
        for m in found:
            _say(args, f"{label}: peak memory, {m.name} at batch {n}")
            peaks[m.name][n] = budget.measure_step(m, at, device)
    done("memory")
    slopes = {
        name: per_sample.slope([(n, by[n]["step_peak_bytes"]) for n in (a, b)])
        for name, by in peaks.items()
    }
    searched: dict[str, dict[str, Any] | None] = dict.fromkeys(names)
    if args.memory_budget is not None and sequence in args.budget_sequences:
        ms = {k: v["time_ms"]["median"] / a for k, v in timing.items()}
        for m in found:
            known = {n: budget.own_total(peaks[m.name][n], m.module, batch) for n in (a, b)}
            fit = budget.probe_fit(m, batch_of, (a, b), device, known)
            largest = budget.largest_batch(ms[m.name], args.max_step_seconds or None)
            searched[m.name] = budget.search(
                m,
                batch_of,
                args.memory_budget,
                fit,
                device,
                progress=lambda what: _say(args, f"{label}: max batch, {what}"),
                largest=largest,
            )
        done("max_batch")
    base_peak = peaks["autograd"][a]["step_peak_bytes"]
    base_batch = (searched["autograd"] or {}).get("max_batch")
    records = []
    for m in found:
        t, mem, mb = timing[m.name], peaks[m.name][a], searched[m.name]
        records.append(
            {
                "benchmark": label,
                "method": m.name,
                "kind": m.kind,
                "scheme": m.scheme,
                "precision": args.precision,
                "compiled": False,
                "first_step_s": None,
                "platform": "gpu",
                "device": device.type,
                "emulated": False,
                "batch": a,
                "resolution": sequence,
                "time_ms": t["time_ms"],
                "time_ratio": t["ratio"],
                "samples_per_s": a / (t["time_ms"]["median"] / 1e3),
                "loss": t["loss"],
                "stash": stash[m.name],
                "memory": mem,
                "peak_ratio_vs_autograd": mem["step_peak_bytes"] / base_peak if base_peak else None,
                "predicted": None,
                "max_batch": mb,
                "max_batch_ratio_vs_autograd": (
                    mb["max_batch"] / base_batch if mb and base_batch else None
                ),
                "max_batch_speed": None,
                "per_sample": slopes[m.name],
                "per_sample_ratio_vs_autograd": per_sample.ratio(
                    slopes[m.name], slopes["autograd"]
                ),
                "notes": m.notes,
                "variant": m.variant,
            }
        )
    info = {
        "benchmark": label,
        "batch": a,
        "resolution": sequence,
        "methods": names,
        "phase_seconds": phases,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return records, info


def _meta(
    args: argparse.Namespace, argv: Sequence[str], prog: str, device: torch.device
) -> dict[str, Any]:
    import peft
    import transformers

    meta = machine.describe(prog, argv)
    meta["title"] = f"{NAME} preset, precision {args.precision}, device {device.type}"
    meta["precision"] = args.precision
    meta["about"] = [
        f"model: {args.shape.describe()}; batch: random token ids with labels (the causal-LM "
        f"loss of the model); transformers {transformers.__version__}, peft {peft.__version__}",
        f"time: {args.iterations} rounds after {args.warmup} warm-up, methods interleaved, "
        "same weights and batch; peak memory: " + output_memory(device),
    ]
    line = bench_precision.about(args.precision, device)
    if line:
        meta["about"].insert(0, line)
    if args.memory_budget is not None and args.budget_sequences:
        meta["about"].append(
            f"max batch under {args.memory_budget / 2**20:.0f} MiB (total step peak: the step "
            "peak + parameters, buffers and the batch; no optimizer state counted) at sequence "
            f"{', '.join(map(str, args.budget_sequences))}; no step predicted over "
            f"{args.max_step_seconds:g} s measured (beyond: predicted by the line, marked)"
        )
    if args.lora_dropout > 0:
        meta["about"].append(
            "LoRA dropout > 0: a decoder layer that draws dropout masks is not recomputed by "
            "--recompute-segments (docs/compression.md), so the +blocks+pieces rows keep what "
            "the plain rows keep"
        )
    meta["args"] = {
        k: (machine.shown_path(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "shape"
    }
    meta["args"]["shape"] = dataclasses.asdict(args.shape)
    meta["methods"] = {
        **{f"method_{k}": v for k, v in METHODS.items()},
        "autocast": peers.METHODS["autocast"],
        "time": _time_method(),
        "per_sample": per_sample.METHOD,
        "max_batch": budget.METHOD,
    }
    return meta


def output_memory(device: torch.device) -> str:
    from unroller.bench.measure import MEMORY_SHORT

    return MEMORY_SHORT["cuda" if device.type == "cuda" else "cpu"]


def _time_method() -> str:
    from unroller.bench.measure import TIME_METHOD

    return TIME_METHOD


def main(argv: Sequence[str], prog: str = f"unroll bench {NAME}") -> int:
    """The preset: 0, or 2 with one line when it cannot start."""
    argv = list(argv)
    args = parse_args(argv, prog)
    try:
        _libraries()
    except MissingPackages as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"{prog}: error: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr
        )
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    ran: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="unroller-lora-") as tmp:
        for sequence in args.sequences:
            found, info = bench_sequence(args, sequence, device, Path(tmp) / str(sequence))
            records += found
            ran.append(info)
    meta = _meta(args, argv, prog, device)
    goals = targets.evaluate(records, device=device.type, command=meta["command"])
    meta["wall_s"] = time.perf_counter() - started
    meta["benchmarks"] = ran
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"{OUT_NAME}.jsonl", out / f"{OUT_NAME}.csv", out / f"{OUT_NAME}.md"]
    output.write_jsonl(files[0], meta, records, goals)
    output.write_csv(files[1], records)
    files[2].write_text(output.markdown(meta, records, goals), encoding="utf-8")
    print(f"{prog}: wrote {', '.join(str(f) for f in files)} in {meta['wall_s']:.0f} s")
    return 0
