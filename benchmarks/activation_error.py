"""Round-trip error of each compressor on the activations a trained model really saves.

Why does one scheme cost more accuracy than another that perturbs gradients as much?
This measures, for one training batch and trained weights, the relative L2 error
``||decompress(compress(a)) - a|| / ||a||`` of every saved float activation ``a`` of the
generated module, for each compressor, and averages it by spatial size (DCT+Chop keeps
the low frequencies of 8x8 blocks, so it hurts small maps most).

    python -m benchmarks.activation_error benchmarks/models/quick.txt \
        --weights benchmarks/results/accuracy/digits/runs/nocompress/seed0/checkpoint.pt \
        --dataset digits

The saved tensors are captured by wrapping the gpu runtime's ``stash`` / ``stash_raw``
(which every generated step calls with each tensor it keeps) during one step of the
``nocompress`` module; the model's own inputs are skipped (never compressed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

import unroller.runtime.gpu as runtime
from unroller import data
from unroller.api import load_graph, load_model_class
from unroller.compiler.options import Options
from unroller.compress import make

COMPRESSORS = {
    "dct (dct-dense)": ("dct", {}),
    "quant 8 bits": ("quant", {"bits": 8}),
    "quant 4 bits": ("quant", {"bits": 4}),
    "quant 2 bits": ("quant", {"bits": 2}),
}


@contextmanager
def captured_stash():
    """Collect ``{name: tensor}`` of everything a generated step keeps for backward."""
    seen: dict[str, torch.Tensor] = {}
    stash, stash_raw = runtime.stash, runtime.stash_raw

    def spy(log, key, raw, *forms):
        seen[key] = raw.detach().clone()
        return stash(log, key, raw, *forms)

    def spy_raw(log, tensors):
        seen.update({k: t.detach().clone() for k, t in tensors.items()})
        return stash_raw(log, tensors)

    runtime.stash, runtime.stash_raw = spy, spy_raw
    try:
        yield seen
    finally:
        runtime.stash, runtime.stash_raw = stash, stash_raw


def relative_error(name: str, params: dict, tensor: torch.Tensor) -> float:
    codec = make(name, **params)
    back = codec.decompress(codec.compress(tensor), tensor.shape[1:], tensor.dtype)
    return ((back - tensor).norm() / tensor.norm().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--weights", type=Path, help="checkpoint.pt of a training run")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--resolution", type=int)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    graph = load_graph(args.model, args.resolution)
    inputs = {v.name for v in graph.inputs}
    split = data.load(args.dataset, data.signature(graph)).train
    batch = [split.inputs[: args.batch_size]]
    if split.targets is not None:
        batch.append(split.targets[: args.batch_size])
    options = Options(resolution=args.resolution)
    Model = load_model_class(args.model, options, Path(tempfile.mkdtemp(prefix="unroller-")))
    model = Model()
    if args.weights:
        model.load_state_dict(torch.load(args.weights, weights_only=True)["model"])
    torch.manual_seed(0)
    with captured_stash() as seen:
        model(*batch)

    names = list(COMPRESSORS)
    print("| activation | shape | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    by_size: dict[int, list[list[float]]] = {}
    for key, tensor in seen.items():
        if key in inputs or tensor.dim() != 4 or not tensor.is_floating_point():
            continue
        errors = [relative_error(*COMPRESSORS[n], tensor) for n in names]
        by_size.setdefault(tensor.shape[-1], []).append(errors)
        cells = " | ".join(f"{e:.3f}" for e in errors)
        print(f"| {key} | {list(tensor.shape)} | {cells} |")
    print()
    print("| map width | activations | " + " | ".join(f"mean {n}" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for size in sorted(by_size, reverse=True):
        means = [statistics.fmean(col) for col in zip(*by_size[size])]
        print(f"| {size} | {len(by_size[size])} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


if __name__ == "__main__":
    main()
