"""The compress preset: compressor throughput, and what each scheme stores and costs.

    unroll bench compress [--models resnet_like,unet_like] [--batch-size 32] [--repeats 31]
        [--warmup 3] [--threads N] [--seed 0] [--shape 32,64,64,64]
        [--out benchmarks/results/compress_bench.json]

(``python -m benchmarks.compress_bench`` runs the same.) Part 1 (``codec_bench``): every
compressor configuration on one realistic float32 activation of ``--shape`` and on its
ReLU mask, against ``torch.clone``. Part 2 (``scheme_bench``): every scheme on the
benchmark models at ``--batch-size``, against nocompress. Goals are printed as met /
not met, never asserted. Writes the JSON (``--out``) and a Markdown report next to it
(same name, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from unroller.bench import machine, options
from unroller.bench.codec_bench import bench_codecs
from unroller.bench.compress_report import METHODS, format_markdown, limits_paragraph
from unroller.bench.paths import ModelsNotFound
from unroller.bench.scheme_bench import DENSE_BYTES_GOAL, DENSE_TIME_GOAL, bench_model

DEFAULT_MODELS = ("resnet_like", "unet_like")
DEFAULT_SHAPE = (32, 64, 64, 64)
OUT_NAME = "compress_bench.json"


def parse_args(
    argv: Sequence[str] | None, prog: str = "unroll bench compress"
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Compressor throughput, and bytes, time and memory of compression schemes.",
    )
    options.add_report_flags(
        parser,
        DEFAULT_MODELS,
        repeats=31,
        out_name=OUT_NAME,
        seed_help="weights, batch and " "tensor seed",
    )
    parser.add_argument(
        "--shape",
        type=options.shape4,
        default=DEFAULT_SHAPE,
        help="N,C,H,W of the compressor benchmark's activation (default: 32,64,64,64)",
    )
    parser.add_argument(
        "--device",
        type=codec_device,
        default=torch.device("cpu"),
        help="where the codec benchmark's tensors live: cpu (default), cuda or cuda:N (eager "
        "and torch.compile'd round trips against a clone there; the scheme part runs on the "
        "CPU)",
    )
    return options.finish_report_args(parser, parser.parse_args(argv), OUT_NAME)


def codec_device(text: str) -> torch.device:
    """``--device``: cpu, cuda or cuda:N, and only a CUDA device this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"not a device: {text!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {count} CUDA device(s)"
                + ("" if count else " (torch was built without CUDA or sees no GPU)")
            )
    return device


def main(argv: Sequence[str], prog: str = "unroll bench compress") -> int:
    """Run the compress preset on ``argv``; writes ``--out`` and the ``.md`` next to it."""
    argv = list(argv)
    args = parse_args(argv, prog)
    try:
        registry = options.benchmarks(args.models, args.models_dir)
    except ModelsNotFound as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    meta = machine.describe(prog, argv)
    meta["args"] = {
        "models": args.models,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "seed": args.seed,
        "shape": list(args.shape),
        "device": str(args.device),
        "out": machine.shown_path(args.out),
    }
    results: dict[str, Any] = {"meta": meta, "methods": METHODS}
    results["goals_defined"] = {
        "dense_bytes": f"dct-dense same-activation stored ratio <= 1/12 ({DENSE_BYTES_GOAL:.5f})",
        "dense_time": f"dct-dense median step-time ratio vs nocompress <= {DENSE_TIME_GOAL}",
    }
    results["codecs"] = bench_codecs(args)
    results["models"] = [bench_model(registry[name], args) for name in args.models]
    results["limits"] = limits_paragraph(results)
    results["meta"]["wall_seconds"] = time.perf_counter() - started
    results["meta"]["loadavg_end"] = machine.loadavg()
    text = format_markdown(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md = args.out.with_suffix(".md")
    md.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} and {md} ({results['meta']['wall_seconds']:.0f} s)")
    return 0
