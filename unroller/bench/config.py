"""Flags of the benchmark suite (the default preset) and its quick and full sizes.

Without ``--full`` the quick preset applies (what ``make bench`` runs): every suite
model (the four published ones, the four spec-v2 ones and the two larger transformers,
``SUITE``) at its ``quick_resolution`` (for gpt_small a shorter context), a small batch, few timed rounds, the memory-budget search under
the "quarter" budget (weights, their gradients and the optimizer state are a quarter of
it), no measured step predicted to take over ``step_seconds`` (larger max batches are
predicted, not confirmed) and the peers that compile nothing. ``--full`` runs the
published sizes (``paper_batch`` at ``native_resolution``) with more rounds, every peer
and no step-time limit. Any explicit flag overrides its preset value.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from unroller.bench import precision as bench_precision
from unroller.bench.options import (
    Parser,
    add_common,
    choose,
    non_negative,
    pair,
    parse_bytes,
    positive,
)
from unroller.bench.paths import default_results_dir
from unroller.bench.reference import BENCHMARKS
from unroller.compiler.options import DEFAULT_TIME_RATIO
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.schemes import SCHEMES

PUBLISHED = ("resnet34", "emdenoise", "slstrcloud", "opticaldamage")
# Models in the spec-v2 language: transformers on tokens (vit_tiny: 65 tokens of an image;
# gpt_tiny: 64 integer character ids), 1-D convolutions on [N, 4, 128] signals, and
# depthwise-separable convolutions. They run at their declared size only.
SPEC_V2 = ("vit_tiny", "gpt_tiny", "tcn_small", "mobilenet_v2")
# Transformers of the size published activation-memory work measures: a GPT-style causal
# decoder (context 256, width 256, 6 layers) and a BERT-style encoder (128 tokens, width
# 128, 4 layers). Their sequence length is rewritable, so the quick preset can shorten it.
LARGER_TRANSFORMERS = ("gpt_small", "bert_encoder")
SUITE = PUBLISHED + SPEC_V2 + LARGER_TRANSFORMERS  # what --benchmark all (the default) runs
HOOK_SCHEMES = ("dct-dense", "quant")  # schemes with a hook-based peer (same compressor)
# schemes with an ours:SCHEME+recompute row (--recompute): none, the densest, the planned
RECOMPUTE_SCHEMES = ("nocompress", "dct-dense", "auto")
# schemes with an ours:SCHEME+blocks+pieces row (--segments): every top-level block instance
# keeps only its inputs and runs its forward again in the backward, in pieces of at most
# SEGMENT_PIECE_SIZE samples where no op couples the samples (unroll generate
# --recompute-segments blocks --segment-piece-size P: a piece's working set is then the same
# at both batches of the bytes-per-sample slope); none and the token codec
SEGMENT_SCHEMES = ("nocompress", "quant")
SEGMENT_PIECE_SIZE = 4
# schemes with an ours:SCHEME+blocks+keep row (--segments): the same segments, selective
# (--segment-keep matmuls: the matrix products kept by the forward, compressed, and not run
# again); the token codec, which compresses what is kept
SELECTIVE_SCHEMES = ("quant",)
AUTO = "auto"
NONE = "none"
QUARTER = "quarter"
COMPILED_PEERS = ("compiled", "compiled-budget-0.5", "compiled-budget-0.1")
PEERS = ("checkpoint", "hooks", *COMPILED_PEERS)  # besides autograd, always run
#: the peers a user picks instead under a mixed --precision (all under torch.autocast):
#: checkpointing, and in the full preset the compiler's activation budget; the hook
#: compressors (the ActNN/GACT kind) run there only when --peers names them
MIXED_PEERS = {"quick": ("checkpoint",), "full": ("checkpoint", *COMPILED_PEERS)}


@dataclass(frozen=True)
class Preset:
    iterations: int
    warmup: int
    max_batch: int | None  # the batch: min(paper_batch, max_batch); None: paper_batch
    full_size: bool  # native_resolution (else quick_resolution)
    budget_factor: float  # "auto": autograd's predicted peak at factor x the run's batch
    max_batch_rounds: int  # timed rounds at each method's max batch (after one warm-up)
    step_seconds: float | None  # the longest step the max-batch phase measures (None: any)
    peers: tuple[str, ...]  # the peers run besides autograd
    recompute: bool = True  # ours:SCHEME+recompute rows (RECOMPUTE_SCHEMES)
    segments: bool = True  # ours:SCHEME+blocks+pieces rows (SEGMENT_SCHEMES)


QUICK = Preset(
    iterations=7,
    warmup=2,
    max_batch=4,
    full_size=False,
    budget_factor=3.0,
    max_batch_rounds=2,
    step_seconds=3.0,
    # torch.compile takes ~50 s per ResNet-34 graph on a 2-core CPU, and once more when the
    # max-batch search changes the batch: too slow for make bench (--peers all adds them).
    # The transformers too: the first compile of compiled-budget-0.5 took 231 s on gpt_tiny
    # and 339 s on gpt_small at 128 tokens (2-core CPU, loaded), longer than the rest of
    # either model's quick run; the full preset runs them (and --peers adds them here)
    peers=("checkpoint", "hooks"),
)
FULL = Preset(
    iterations=10,
    warmup=2,
    max_batch=None,
    full_size=True,
    budget_factor=2.0,
    max_batch_rounds=3,
    step_seconds=None,
    peers=PEERS,
)


def _budget(text: str) -> int | str:
    if text.lower() in (AUTO, NONE, "off", QUARTER):
        return NONE if text.lower() == "off" else text.lower()
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser(prog: str = "unroll bench") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description=(
            "Benchmark the generated unrolled training step, per compression scheme, against "
            "its peers (autograd, torch.utils.checkpoint, autograd with the same compressor "
            "in saved_tensors_hooks, torch.compile'd autograd with and without an activation "
            "memory budget): step time, samples/s, stashed bytes, peak step memory against "
            "the predicted peak and floor, and the largest batch under a memory budget with "
            "samples/s there. Writes JSON lines, CSV, Markdown and PNG plots to --out-dir."
        ),
        epilog=(
            "Example: unroll bench --benchmark resnet34 --scheme dct-dense --resolution 16 "
            "--memory-budget 512MiB   (make bench: the quick preset; make bench FULL=1: --full). "
            f"Two more reports: '{prog} core --help' (generated step vs autograd, "
            f"python -m benchmarks.core_bench) and '{prog} compress --help' (compressors "
            "and schemes, python -m benchmarks.compress_bench)."
        ),
    )
    add = parser.add_argument
    add(
        "--benchmark",
        default="all",
        help="a model of the registry, a comma list, or 'all' (the four published models, "
        f"the four spec-v2 ones and the two larger transformers: {', '.join(SUITE)}; "
        "default)",
    )
    add("--scheme", default="all", help=f"one of {', '.join(SCHEMES)}, a comma list, or 'all'")
    add(
        "--precision",
        type=_precision,
        default=bench_precision.DEFAULT,
        help=bench_precision.HELP,
    )
    add("--platform", choices=("gpu", "ipu"), default="gpu")
    add("--device", choices=("cpu", "cuda"), default="cpu", help="where gpu-platform steps run")
    add("--full", action="store_true", help="published sizes: paper batch, native resolution")
    add("--iterations", type=positive, help="timed rounds (each method once per round)")
    add("--warmup", type=non_negative, help="untimed rounds before timing")
    add("--batch-size", type=positive, help="samples per step (default: preset)")
    add(
        "--resolution",
        type=positive,
        help="rows of image inputs (default: preset); the spec-v2 models take only their "
        "declared size (vit_tiny 32, gpt_tiny 64 tokens, tcn_small 128 steps, mobilenet_v2 "
        "any); for gpt_small and bert_encoder the sequence length, a multiple of 16",
    )
    add(
        "--get-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the peak memory of one step per method (default: on)",
    )
    add(
        "--memory-budget",
        type=_budget,
        help="find the largest batch per method whose peak fits this size (2GiB, 512MiB); "
        "'quarter': 4 x (parameters + their gradients + SGD momentum) of the model, so the "
        "weights and what goes with them are a quarter of it (default); 'auto': autograd's "
        "predicted peak at a multiple of the batch; 'none': skip",
    )
    add(
        "--max-batch-rounds",
        type=positive,
        help="timed rounds at each method's max batch, after one warm-up round (default: "
        "quick 2, full 3)",
    )
    add(
        "--max-step-seconds",
        type=_seconds,
        help="the max-batch phase measures no step predicted (from the time phase's ms per "
        "sample) to take longer: beyond it the max batch is predicted and marked "
        "unconfirmed, and samples/s is timed at the largest batch under the limit; 0: no "
        "limit (default: quick 3, full no limit)",
    )
    add(
        "--peers",
        help=f"the peers besides autograd, a comma list of {', '.join(PEERS)}, or 'all' or "
        "'none' (default: quick checkpoint,hooks; full all)",
    )
    add(
        "--compile",
        action="store_true",
        help="also run ours:SCHEME+compile, the generated module built with "
        "Model(compile=True) (torch.compile of the step)",
    )
    add(
        "--max-time-ratio",
        type=float,
        default=DEFAULT_TIME_RATIO,
        help="the auto rows' time limit: the least bytes per sample whose predicted step "
        "takes at most this many times the uncompressed step's (unroll generate --scheme auto "
        "--max-time-ratio; default: %(default)s)",
    )
    add(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        help="also run ours:SCHEME+recompute for nocompress, dct-dense and auto (those run; "
        "default: on in both presets): "
        "the generated module with cheap ops' outputs remade in the backward instead of kept "
        "(unroll generate --recompute)",
    )
    add(
        "--segments",
        action=argparse.BooleanOptionalAction,
        help="also run ours:SCHEME+blocks+pieces for nocompress and quant (those run; default: "
        f"on in both presets): every block instance recomputed in pieces of at most "
        f"{SEGMENT_PIECE_SIZE} samples (unroll generate --recompute-segments blocks "
        f"--segment-piece-size {SEGMENT_PIECE_SIZE}) on models with blocks; and "
        "ours:quant+blocks+keep, the same keeping the matrix products (--segment-keep "
        "matmuls)",
    )
    add(
        "--timeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plot the bytes live over one step, ours per scheme vs autograd, per benchmark "
        "(with --plots; default: on)",
    )
    add(
        "--per-sample-batches",
        type=pair,
        help="the two batch sizes A,B the bytes per sample (the slope of the measured step "
        "peak) are measured between (default: the run's batch and twice it)",
    )
    add(
        "--probe-batches",
        type=pair,
        help="the two batch sizes of the linear peak fit, A,B (default: the run's batch and "
        "twice it)",
    )
    add("--device-batch-size", type=positive, help="ipu: micro-batch per replica")
    add("--num-ipus", type=int, choices=(1, 2, 4, 8, 16), default=1, help="ipu: pipeline stages")
    add("--replication-factor", type=positive, default=1, help="ipu: data-parallel replicas")
    add("--profile", metavar="DIR", help="ipu: write a PopVision report to DIR")
    add("--emulate", action="store_true", help="ipu: the CPU emulation of PopTorch")
    add_common(parser)
    add(
        "--out-dir",
        type=Path,
        help="results folder (default: benchmarks/results/ of the checkout; outside one "
        "./benchmark-results)",
    )
    add("--plots", action=argparse.BooleanOptionalAction, default=True, help="write PNG plots")
    add("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    return parser


def _precision(text: str) -> str:
    try:
        return bench_precision.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _peers(
    text: str | None, preset: Preset, parser: argparse.ArgumentParser, precision: str = "fp32"
) -> list[str]:
    if text is None and bench_precision.of(precision).autocast is not None:
        return list(MIXED_PEERS["full" if preset.full_size else "quick"])
    if text is None:
        return list(preset.peers)
    if text.strip() == NONE:
        return []
    return choose(text, PEERS, PEERS, "peer", parser)


def parse_args(argv: Sequence[str] | None, prog: str = "unroll bench") -> argparse.Namespace:
    """Parsed flags with the preset filled in (``args.preset``, ``args.benchmarks``,
    ``args.schemes``, ``args.out_dir``); argparse exits 2 on bad flags."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    preset = FULL if args.full else QUICK
    args.preset = preset
    args.benchmarks = choose(args.benchmark, list(BENCHMARKS), SUITE, "benchmark", parser)
    args.schemes = choose(args.scheme, SCHEMES, SCHEMES, "scheme", parser)
    args.out_dir = args.out_dir or default_results_dir()
    args.iterations = args.iterations or preset.iterations
    args.warmup = preset.warmup if args.warmup is None else args.warmup
    args.peers = _peers(args.peers, preset, parser, args.precision)
    args.max_batch_rounds = args.max_batch_rounds or preset.max_batch_rounds
    if args.recompute is None:
        args.recompute = preset.recompute
    if args.segments is None:
        args.segments = preset.segments
    if args.max_step_seconds is None:
        args.max_step_seconds = preset.step_seconds
    elif args.max_step_seconds == 0:
        args.max_step_seconds = None
    if args.memory_budget is None:
        args.memory_budget = QUARTER
    elif args.memory_budget == NONE:
        args.memory_budget = None
    target = get_platform(args.platform)
    if args.precision not in target.precisions:
        note = f": {target.precision_note}" if target.precision_note else ""
        parser.error(
            f"--precision {args.precision} is not for --platform {args.platform} (it takes "
            f"{', '.join(target.precisions)}){note}"
        )
    ipu_only = ("device_batch_size", "profile")
    if not get_platform(args.platform).graph_compiled:  # the options of a PopTorch run
        given = [f"--{n.replace('_', '-')}" for n in ipu_only if getattr(args, n) is not None]
        given += ["--emulate"] if args.emulate else []
        given += ["--num-ipus"] if args.num_ipus != 1 else []
        given += ["--replication-factor"] if args.replication_factor != 1 else []
        if given:
            parser.error(f"{', '.join(given)} only apply with --platform ipu")
    elif args.device != "cpu":
        parser.error("--platform ipu runs on IPUs (or their CPU emulation): drop --device")
    elif args.compile:
        parser.error("--compile builds the gpu platform's module: drop it with --platform ipu")
    elif not args.emulate:  # the host cannot see IPU memory: PopVision (--profile) does
        args.get_memory, args.memory_budget = False, None
    return args


def ipu_accumulation(num_ipus: int) -> int:
    """Micro-batches per step, as the generated runner sets it: 2 x IPUs when pipelined."""
    return 2 * num_ipus if num_ipus > 1 else 1


def ipu_batch(args: argparse.Namespace, batch: int) -> tuple[int, int]:
    """(device batch, whole batch): the whole batch one emulated call takes is device batch
    x replicas x gradient-accumulation micro-batches; without --device-batch-size the
    device batch is the preset's batch split over them (at least 1)."""
    parts = args.replication_factor * ipu_accumulation(args.num_ipus)
    device = args.device_batch_size or max(1, batch // parts)
    return device, device * parts
