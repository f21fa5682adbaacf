"""What a first and a second ``unroller.unroll`` of a Hugging Face Llama cost, in one process.

    python -m benchmarks.unroll_cost [--sizes tiny,100m] [--out benchmarks/results/unroll_cost.md]

The first call imports the network (``torch.export``), generates and caches its module;
a second call with the same network structure, batch signature and options reuses the
class kept in-process (``unroller.stepcache``), so it should cost next to nothing. Each
size is a Llama built from a config (no download) and timed with ``time.perf_counter``
around ``unroller.unroll(model, batch)``; the second call uses a fresh model instance
of the same config, as a user re-creating the model would; then a new process makes its
first call with the generated source already in the cache folder (it still imports the
network to know its model text). The cache folder is a fresh temporary one, so the first
call generates.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=128),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, vocab_size=12000),
}


def build(size: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        num_attention_heads=4 if size == "tiny" else 12,
        num_key_value_heads=4 if size == "tiny" else 12,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        **SIZES[size],
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def one_unroll(size: str) -> tuple[float, int]:
    """Seconds of one ``unroller.unroll`` of a fresh model of ``size``, and its parameters."""
    import unroller

    ids = torch.randint(
        0, SIZES[size]["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1)
    )
    model = build(size)
    start = time.perf_counter()
    unroller.unroll(model, dict(input_ids=ids, labels=ids))
    return time.perf_counter() - start, sum(p.numel() for p in model.parameters())


def time_size(size: str) -> dict[str, float]:
    """The first and second call in this process, then a first call in a new process that
    finds the generated source in the same cache folder."""
    found: dict[str, float] = {}
    found["first"], found["params"] = one_unroll(size)
    found["second"], _ = one_unroll(size)
    code = f"from benchmarks.unroll_cost import one_unroll; print(one_unroll({size!r})[0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    found["new_process"] = float(done.stdout.split()[-1])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/unroll_cost.md"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["UNROLLER_CACHE_DIR"] = cache
        for size in args.sizes.split(","):
            found = time_size(size)
            rows.append(
                f"| Llama {size} | {found['params'] / 1e6:.2f}M | {found['first']:.2f} | "
                f"{found['second']:.3f} | {found['new_process']:.2f} |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# First and second `unroller.unroll` of a Llama in one process",
            "",
            f"Command: `python -m benchmarks.unroll_cost --sizes {args.sizes}`",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}; one run, seconds of wall time.",
            "",
            "| network | parameters | first unroll s | second unroll s | first in a new process s |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    )
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
