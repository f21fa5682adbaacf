"""Bytes kept for backward per token by each scheme, for the two transformer models.

The figures are the stash plan's (what ``unroll graph MODEL --batch-size 1 --scheme S``
prints under its table), divided by the tokens of one sample: a property of the model
and the generator, computed in seconds, nothing timed. Beside them, the bytes the
accuracy runs measured in their first step (``stored_bytes`` of their ``summary.json``,
divided by batch and tokens), and what ``quant`` keeps, by stored form and raw item.

    python -m benchmarks.stash_per_token            # rewrite the results file
    python -m benchmarks.stash_per_token --check    # exit 1 if it is not what it writes
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks.results_file import write_or_check
from unroller.api import compression_config, load_graph
from unroller.cli.target import make_options
from unroller.compiler.stash import plan_stash

ROOT = Path(__file__).resolve().parent.parent
ACCURACY = ROOT / "benchmarks" / "results" / "accuracy"
OUT = ACCURACY / "stash_per_token.md"
COMMAND = "python -m benchmarks.stash_per_token"
CONFIGS = "benchmarks/results/accuracy/gpt_pysource/configs"

#: model name: (model file, tokens per sample, what the tokens are, accuracy folders).
MODELS = {
    "gpt_tiny": (
        "benchmarks/models/gpt_tiny.txt",
        64,
        "64 characters of context",
        ("gpt_pysource", "gpt_pysource_blocks"),
    ),
    "vit_digits": (
        "benchmarks/models/vit_digits.txt",
        17,
        "16 patches of 2x2 and a class token",
        ("vit_digits", "vit_digits_blocks"),
    ),
}
#: scheme label: (--scheme, --compress-config or None).
SCHEMES = {
    "nocompress": ("nocompress", None),
    "dct-first": ("dct-first", None),
    "dct-dense": ("dct-dense", None),
    "quant-8bit": ("quant", None),
    "quant-4bit": ("nocompress", f"{CONFIGS}/quant-4bit.toml"),
    "quant-2bit": ("nocompress", f"{CONFIGS}/quant-2bit.toml"),
}


def stash(model: str, scheme: str, config: str | None) -> dict:
    """The stash report of ``model`` at batch 1, as ``unroll graph --format json`` has it."""
    graph = load_graph(ROOT / model)
    options = make_options("gpu", scheme, None if config is None else ROOT / config)
    return plan_stash(graph, compression_config(options, graph)).report(1)


def _ratio(value: float, base: float) -> str:
    return "1.00x" if value == base else f"1/{base / value:.1f}"


def _per_token(summary: dict, tokens: int) -> dict[str, float]:
    batch = int(re.search(r"batch (\d+)", summary["header"]["training"]).group(1))
    return {row["scheme"]: row["stored_bytes"] / batch / tokens for row in summary["rows"]}


def report() -> str:
    reports = {
        (name, label): stash(path, scheme, config)
        for name, (path, *_rest) in MODELS.items()
        for label, (scheme, config) in SCHEMES.items()
    }
    lines = [
        "# Bytes kept for backward per token, by scheme",
        "",
        f"Command: `{COMMAND}` (the stash plan of `unroll graph MODEL --batch-size 1 "
        f"--scheme S`; quant-4bit and quant-2bit with `--compress-config {CONFIGS}/"
        "quant-Nbit.toml`, the files the accuracy runs wrote)",
        "",
        "Tokens per sample: "
        + "; ".join(f"{name} {tokens} ({what})" for name, (_, tokens, what, _) in MODELS.items())
        + ". The stored bytes include every byte kept: codes with their scales, and the "
        "items kept raw.",
        "",
        "| scheme | " + " | ".join(f"{name} B/token | vs nocompress" for name in MODELS) + " |",
        "|---|" + "---|---|" * len(MODELS),
    ]
    for label in SCHEMES:
        cells = []
        for name, (_, tokens, _, _) in MODELS.items():
            stored = reports[name, label]["total_stored_bytes"]
            base = reports[name, "nocompress"]["total_stored_bytes"]
            cells.append(f"{stored / tokens:,.0f} | {_ratio(stored, base)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    lines += [
        "",
        "## What quant-8bit keeps, per token",
        "",
        "| stored form or raw item | " + " | ".join(f"{name} B/token" for name in MODELS) + " |",
        "|---|" + "---|" * len(MODELS),
    ]
    groups: dict[str, dict[str, float]] = {}
    for name, (_, tokens, _, _) in MODELS.items():
        for row in reports[name, "quant-8bit"]["rows"]:
            if row["compressor"] == "raw":
                item = row["tensor"].split(":")[-1] if ":" in row["tensor"] else row["tensor"]
                key = f"raw: {item} ({row['why'].split(': ')[-1].replace(row['readers'][0], 'X')})"
            else:
                key = re.sub(r", group_size=\w+|, stochastic=\w+", "", row["compressor"])
            cell = groups.setdefault(key, {})
            cell[name] = cell.get(name, 0) + row["stored_bytes"] / tokens
    for key, cell in sorted(groups.items(), key=lambda kv: (kv[0].startswith("raw"), kv[0])):
        values = " | ".join(f"{cell[n]:,.1f}" if n in cell else "-" for n in MODELS)
        lines.append(f"| {key} | {values} |")

    lines += [
        "",
        "## Measured in the accuracy runs' first step, per token",
        "",
        "`stored_bytes` of each folder's summary.json divided by the batch and the tokens "
        "per sample: what the generated module of that run kept.",
        "",
        "| accuracy folder | scheme | B/token | vs nocompress |",
        "|---|---|---|---|",
    ]
    for _name, (_, tokens, _, folders) in MODELS.items():
        for folder in folders:
            summary = json.loads((ACCURACY / folder / "summary.json").read_text())
            measured = _per_token(summary, tokens)
            for scheme, value in measured.items():
                lines.append(
                    f"| {folder} | {scheme} | {value:,.0f} "
                    f"| {_ratio(value, measured['nocompress'])} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(__doc__.splitlines()[0], OUT, COMMAND, report, argv)


if __name__ == "__main__":
    sys.exit(main())
