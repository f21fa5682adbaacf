"""Command-line pieces every preset shares: value parsers, the common flags, model lists.

Each preset has its own flags, but the ones they share (threads, seed, models folder,
rounds, sizes) are defined once here, so they parse, default and fail alike: a bad
value exits 2 with argparse's one-line message, naming the flag.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from unroller.bench.paths import ModelsNotFound, default_results_dir
from unroller.bench.reference import BENCHMARKS, Benchmark

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on standard error, exit status 2, as
    the rest of ``unroll`` reports a bad argument: ``PROG: error: MESSAGE`` (``--help``
    prints the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message if message.endswith("\n") else message + "\n")
        raise SystemExit(status)


def parse_bytes(text: str) -> int:
    """``2GiB`` -> 2147483648. KiB/MiB/GiB and bare K/M/G are powers of 1024, KB/MB/GB of
    1000; a bare number is bytes. Raises ValueError on anything else."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not found or found.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 2GiB, 512MiB or 1000000 (bytes), got {text!r}")
    value = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the size must be positive, got {text!r}")
    return int(value)


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
    return value


def positive(text: str) -> int:
    return _integer(text, 1)


def non_negative(text: str) -> int:
    return _integer(text, 0)


def pair(text: str) -> tuple[int, int]:
    """``A,B`` with 1 <= A < B (two batch sizes)."""
    try:
        a, b = (int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two batch sizes A,B, got {text!r}") from None
    if not 1 <= a < b:
        raise argparse.ArgumentTypeError(f"expected 1 <= A < B, got {text!r}")
    return a, b


def shape4(text: str) -> tuple[int, ...]:
    """``N,C,H,W``: four positive integers."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,C,H,W integers, got {text!r}") from None
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected 4 positive integers N,C,H,W, got {text!r}")
    return dims


def choose(
    text: str,
    known: Sequence[str],
    every: Sequence[str],
    what: str,
    parser: argparse.ArgumentParser,
) -> list[str]:
    """A comma list of ``known`` names, or 'all' (``every``); parser.error otherwise."""
    names = list(every) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"unknown {what} {unknown or text!r}; known: {', '.join(known)}, all")
    return list(dict.fromkeys(names))


def add_common(parser: argparse.ArgumentParser, seed_help: str = "weights and batch seed") -> None:
    """--threads, --seed and --models-dir."""
    parser.add_argument("--threads", type=positive, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(
        "--models-dir",
        type=Path,
        help="the benchmark model files (default: benchmarks/models/ of the checkout)",
    )


def benchmarks(names: Sequence[str], models_dir: Path | None) -> dict[str, Benchmark]:
    """The named benchmarks reading their files from ``models_dir`` (None: the
    checkout's); ModelsNotFound names the first missing file."""
    found = {name: BENCHMARKS[name].with_models_dir(models_dir) for name in names}
    for bench in found.values():
        if not bench.path.is_file():
            raise ModelsNotFound(f"{bench.path}: no such model file")
    return found


def add_report_flags(
    parser: argparse.ArgumentParser,
    default_models: Sequence[str],
    repeats: int,
    out_name: str,
    seed_help: str = "weights and batch seed",
) -> None:
    """The flags of the core and compress presets: --models, --batch-size, --repeats,
    --warmup, --out, and the common ones."""
    parser.add_argument(
        "--models",
        default=",".join(default_models),
        help="comma-separated benchmark names (model files of benchmarks/models/; "
        "default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=positive, default=32)
    parser.add_argument("--repeats", type=positive, default=repeats, help="timed rounds")
    parser.add_argument("--warmup", type=non_negative, default=3, help="untimed rounds")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"JSON results file (default: {out_name} in benchmarks/results/ of the checkout)",
    )
    add_common(parser, seed_help)


def finish_report_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, out_name: str
) -> argparse.Namespace:
    """``args.models`` as a list of known names, ``args.out`` defaulted."""
    args.models = choose(args.models, list(BENCHMARKS), list(BENCHMARKS), "models", parser)
    args.out = args.out or default_results_dir() / out_name
    return args
