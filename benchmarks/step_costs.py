"""The constants of the step time model (``unroller/analysis/step_time.py``), measured, and
its predictions checked against measured steps.

Constants (one CPU thread):

- ``flops_per_s``, ``thin_flops_per_s`` and ``statement_us``: fitted together (least
  squares of relative errors) to the uncompressed steps of the benchmark models
  (``FIT_STEPS``: small and large transformers, the TCN, ResNet-34 and mobilenet_v2, and
  gpt_tiny at batch 1, whose ops are tiny): each step is ``(1 + BACKWARD)`` times the sum
  over its ops of dense FLOPs / ``flops_per_s`` + thin FLOPs (``flops.is_thin``: a depthwise
  convolution's) / ``thin_flops_per_s`` + bytes / ``bytes_per_s`` + ``statement_us``. A
  512 x 512 matrix product alone (``matmul_flops_per_s``, reported) runs at under half
  the dense rate the models' steps reach, and depthwise convolutions at a tenth of it;
  fitted to one matrix product, the model put the uncompressed step of ResNet-34 at 2.4
  times its measured time and mobilenet_v2's at half, and so every move's share of it
  wrong by as much;
- ``bytes_per_s``: ``x + x`` on 4M floats (three arrays moved), median of 30;
- ``codec_ns_per_element``: compress + decompress of a [16, 64, 32, 32] map, per codec, less
  the per-call cost, over its elements;
- ``codec_us_per_call``: compress + decompress of a [2, 4, 8, 8] map (its elements are few),
  median of 200 (fitting these two to whole steps instead was tried: a step of gpt_tiny
  is too short for the fit to stay put between runs);
- ``piece_op_us_by_size``: gpt_tiny at batch 32 with every block recomputed, in pieces of
  1, 2 and 4 samples against whole: the extra time over the extra pieces and the pieced
  segments' ops, per piece size (``piece_op_us``: 4's);
- ``time_margin``: from the check below, the median of measured less predicted ratios
  (at least 0): ``auto`` holds its predictions that far under its time limit, so the plan
  it picks, the one nearest the limit among many, measures within the limit as often as
  not even though the model is off by a few hundredths on a plan it has not seen.

The check: per model and plan, the predicted time ratio against the uncompressed step's
beside the measured one (the two steps taking turns, ``--rounds`` timed rounds after one
warm-up, the median of the per-round ratios).

    python -m benchmarks.step_costs [--rounds 7] [--write]
        [--out benchmarks/results/step_costs.md]

``--write`` also rewrites ``unroller/analysis/step_costs.toml`` with the constants measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from unroller.analysis.flops import forward_flops, is_thin
from unroller.analysis.inputs import make_inputs
from unroller.analysis.step_time import (
    BACKWARD,
    COSTS_FILE,
    StepCosts,
    codec_label,
    node_forward_s,
    predict_time,
)
from unroller.api import compression_config, load_graph
from unroller.bench.timing import time_interleaved
from unroller.compiler.options import Options
from unroller.compiler.schemes import CompressionConfig, make_codec
from unroller.compiler.stash import plan_stash
from unroller.materialize import model_class

CODECS = {
    "quant": make_codec("quant", {"bits": 8}),
    "dct": make_codec("dct", {}, min_size=8),
    "dct-k6": make_codec("dct", {"keep": 6}, min_size=8),
    "fewbit": make_codec("fewbit", {"function": "gelu", "bits": 3}),
}
#: (model, resolution, batch, plans): each plan (label, scheme, segments, piece size,
#: recompute[, segment_keep])
CHECKS = (
    (
        "gpt_tiny",
        None,
        16,
        (
            ("quant", "quant", (), 0, False),
            ("blocks", "nocompress", ("blocks",), 0, False),
            ("blocks in pieces of 4", "nocompress", ("blocks",), 4, False),
            ("blocks in pieces of 1", "nocompress", ("blocks",), 1, False),
            ("quant + blocks in pieces of 4", "quant", ("blocks",), 4, False),
            ("--recompute", "nocompress", (), 0, True),
        ),
    ),
    (
        "resnet34",
        32,
        16,
        (
            ("dct-dense", "dct-dense", (), 0, False),
            ("quant", "quant", (), 0, False),
            ("dct-dense --recompute", "dct-dense", (), 0, True),
            ("blocks", "nocompress", ("blocks",), 0, False),
        ),
    ),
    (
        "mobilenet_v2",
        32,
        16,
        (
            ("dct-dense", "dct-dense", (), 0, False),
            ("quant", "quant", (), 0, False),
            ("dct-dense --recompute", "dct-dense", (), 0, True),
        ),
    ),
    (
        "tcn_small",
        128,
        8,
        (
            ("quant", "quant", (), 0, False),
            ("quant --recompute", "quant", (), 0, True),
        ),
    ),
    (
        "bert_encoder",
        128,
        8,
        (
            ("quant", "quant", (), 0, False),
            ("blocks", "nocompress", ("blocks",), 0, False),
            ("blocks in pieces of 4", "nocompress", ("blocks",), 4, False),
        ),
    ),
    (
        "gpt_small",
        64,
        8,
        (
            ("quant", "quant", (), 0, False),
            ("blocks keeping linear", "nocompress", ("blocks",), 0, False, ("*.linear*",)),
            (
                "blocks in pieces of 2 keeping linear",
                "nocompress",
                ("blocks",),
                2,
                False,
                ("*.linear*",),
            ),
        ),
    ),
    (
        "vit_tiny",
        32,
        8,
        (
            ("quant", "quant", (), 0, False),
            ("quant + blocks in pieces of 4", "quant", ("blocks",), 4, False),
        ),
    ),
)


def _median(fn, n: int = 30) -> float:
    fn()
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _codec_s(codec, m: torch.Tensor, n: int = 30) -> float:
    """Seconds of one compress and one decompress of ``m``."""
    instance = codec.instance()
    packed = instance.compress(m)
    squeeze = _median(lambda: instance.compress(m), n)
    return squeeze + _median(lambda: instance.decompress(packed, tuple(m.shape[1:]), m.dtype), n)


def micro() -> dict[str, float]:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    x = torch.randn(4_000_000)
    found = {
        "matmul_flops_per_s": 2 * 512**3 / _median(lambda: a @ b),
        "bytes_per_s": 3 * 4 * x.numel() / _median(lambda: x + x),
    }
    m, tiny = torch.randn(16, 64, 32, 32), torch.randn(2, 4, 8, 8)
    for label, codec in CODECS.items():
        call = _codec_s(codec, tiny, 200)
        found[f"call:{label}"] = call * 1e6
        found[f"codec:{label}"] = max(0.0, _codec_s(codec, m) - call) / m.numel() * 1e9
        assert codec_label(codec) == label
    return found


def _config(graph, scheme: str, segments, piece_size: int, recompute: bool, keep=()):
    options = Options(scheme=scheme, recompute=recompute, recompute_segments=segments)
    config = compression_config(options, graph)
    return dataclasses.replace(config, segment_piece_size=piece_size, segment_keep=tuple(keep))


def _step(graph, config, batch: int):
    torch.manual_seed(0)
    model = model_class(graph, "step_costs", config)()
    model.train()
    inputs = [t.float() if t.is_floating_point() else t for t in make_inputs(graph, batch, 1)]

    def step():
        model.zero_grad(set_to_none=True)
        return model(*inputs)

    return step


def _ratios(graph, configs: dict[str, CompressionConfig], batch: int, rounds: int):
    sides = {"base": _step(graph, CompressionConfig(), batch)}
    sides.update({label: _step(graph, c, batch) for label, c in configs.items()})
    found = time_interleaved(sides, 1, rounds, "base")
    return found


#: (model, resolution, batch): the uncompressed steps the FLOP rates and the statement
#: cost are fitted to
FIT_STEPS = (
    ("gpt_tiny", None, 1),
    ("gpt_tiny", None, 8),
    ("vit_tiny", 32, 8),
    ("tcn_small", 128, 8),
    ("bert_encoder", 128, 8),
    ("gpt_small", 64, 8),
    ("resnet34", 32, 16),
    ("mobilenet_v2", 32, 16),
)


def step_features(graph, batch: int, byte_s: float) -> tuple[float, float, float, float]:
    """A step's (dense FLOPs, thin FLOPs, statements) times ``1 + BACKWARD``, and its
    byte time, as ``step_time.predict_time`` counts them."""
    dense = thin = moved = 0.0
    bytes_only = StepCosts(0.0, byte_s, 0.0, 0.0)
    for node in graph.nodes:
        flops = forward_flops(node, batch)
        if is_thin(node):
            thin += flops
        else:
            dense += flops
        moved += node_forward_s(node, batch, bytes_only)
    k = 1 + BACKWARD
    return k * dense, k * thin, k * len(graph.nodes), k * moved


def fit_rates(constants: dict[str, float], rounds: int) -> dict[str, float]:
    """``flops_per_s``, ``thin_flops_per_s`` and ``statement_us`` from ``FIT_STEPS`` (the
    module's docstring): least squares of the relative errors; each step's time is the
    median of ``rounds`` after a warm-up."""
    rows, targets = [], []
    for model, resolution, batch in FIT_STEPS:
        graph = load_graph(f"benchmarks/models/{model}.txt", resolution, "fp32")
        found = time_interleaved(
            {"base": _step(graph, CompressionConfig(), batch)}, 2, rounds, None
        )
        measured = found["base"]["time_ms"]["median"] * 1e-3
        dense, thin, statements, moved = step_features(graph, batch, 1 / constants["bytes_per_s"])
        rows.append([dense / measured, thin / measured, statements / measured])
        targets.append([(measured - moved) / measured])
    solution = torch.linalg.lstsq(
        torch.tensor(rows, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64)
    ).solution.flatten()
    flop_s, thin_s, statement_s = (float(v) for v in solution)
    if min(flop_s, thin_s, statement_s) <= 0:
        raise RuntimeError(f"the step fit came out non-positive: {solution.tolist()}")
    return {
        "flops_per_s": 1 / flop_s,
        "thin_flops_per_s": 1 / thin_s,
        "statement_us": statement_s * 1e6,
    }


PIECE_SIZES = (1, 2, 4)
PIECE_BATCH = 32


def fit_pieces(rounds: int) -> dict[str, float]:
    """``piece_op_us`` per piece size: gpt_tiny at batch ``PIECE_BATCH`` with every block
    recomputed, in pieces of each of ``PIECE_SIZES`` samples against whole: the extra time
    over the extra pieces and the pieced segments' ops (``piece_op_us`` itself: pieces of
    4's)."""
    graph = load_graph("benchmarks/models/gpt_tiny.txt", None, "fp32")
    configs = {"whole": _config(graph, "nocompress", ("blocks",), 0, False)}
    for size in PIECE_SIZES:
        configs[str(size)] = _config(graph, "nocompress", ("blocks",), size, False)
    found = _ratios(graph, configs, PIECE_BATCH, rounds)
    whole = found["whole"]["time_ms"]["median"]
    result = {}
    for size in PIECE_SIZES:
        extra = max(0.0, found[str(size)]["time_ms"]["median"] - whole) * 1e-3
        config = configs[str(size)]
        pieced = sum(len(s.nodes) for s in plan_stash(graph, config).segments if s.in_pieces)
        extra_pieces = -(-PIECE_BATCH // size) - 1
        result[f"piece:{size}"] = extra / (extra_pieces * pieced) * 1e6
    result["piece_op_us"] = result[f"piece:{PIECE_SIZES[-1]}"]
    return result


def check(costs: StepCosts, rounds: int) -> list[tuple[str, str, float, float]]:
    rows = []
    for model, resolution, batch, plans in CHECKS:
        graph = load_graph(f"benchmarks/models/{model}.txt", resolution, "fp32")
        configs = {label: _config(graph, *rest) for label, *rest in plans}
        found = _ratios(graph, configs, batch, rounds)
        for label, config in configs.items():
            predicted = predict_time(graph, config, batch, step_costs=costs).ratio
            measured = found[label]["ratio"]["median"]
            at = f"{model}@{resolution}" if resolution else model
            rows.append((f"{at}, batch {batch}", label, predicted, measured))
    return rows


def time_margin(rows: list[tuple[str, str, float, float]]) -> float:
    """The time model's typical under-prediction: the median over the checked plans of the
    measured ratio less the predicted one, or 0 where the model errs high as often (the
    headroom ``auto`` keeps under its time limit, ``search.search``)."""
    return max(0.0, statistics.median(measured - predicted for *_, predicted, measured in rows))


def toml_text(c: dict[str, float], when: str, machine: str) -> str:
    def table(prefix: str) -> str:
        return "\n".join(
            f'"{k.split(":", 1)[1]}" = {v:.3g}' for k, v in c.items() if k.startswith(prefix)
        )

    return (
        "# The step time model's constants (unroller/analysis/step_time.py), measured by\n"
        "# python -m benchmarks.step_costs --write\n"
        f"# on {machine}, {when}, one CPU thread.\n"
        f"flops_per_s = {c['flops_per_s']:.3g}\n"
        f"thin_flops_per_s = {c['thin_flops_per_s']:.3g}\n"
        f"bytes_per_s = {c['bytes_per_s']:.3g}\n"
        f"statement_us = {c['statement_us']:.3g}\n"
        f"piece_op_us = {c['piece_op_us']:.3g}\n"
        f"time_margin = {c['time_margin']:.3g}\n\n"
        "[piece_op_us_by_size]\n"
        f"{table('piece:')}\n\n"
        "[codec_ns_per_element]\n"
        f"{table('codec:')}\n\n"
        "[codec_us_per_call]\n"
        f"{table('call:')}\n"
    )


def report(c: dict[str, float], rows, when: str, machine: str, command: str) -> str:
    lines = [
        "# The step time model: constants and predicted against measured time",
        "",
        f"Measured {when} on {machine}, one CPU thread: `{command}`.",
        "",
        "| constant | value |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.3g} |" for k, v in c.items()]
    lines += [
        "",
        "Time of a step against the uncompressed step's (the two taking turns, median of "
        "the per-round ratios):",
        "",
        "| model | plan | predicted | measured |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {m} | {p} | {a:.2f}x | {b:.2f}x |" for m, p, a, b in rows]
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    """The CPU's model name where Linux says it, else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_costs.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    constants = micro()
    constants.update(fit_rates(constants, args.rounds))
    constants.update(fit_pieces(args.rounds))
    costs = StepCosts(
        1 / constants["flops_per_s"],
        1 / constants["bytes_per_s"],
        constants["statement_us"] * 1e-6,
        constants["piece_op_us"] * 1e-6,
        {k.split(":", 1)[1]: v * 1e-9 for k, v in constants.items() if k.startswith("codec:")},
        {k.split(":", 1)[1]: v * 1e-6 for k, v in constants.items() if k.startswith("call:")},
        1 / constants["thin_flops_per_s"],
        {int(k.split(":", 1)[1]): v * 1e-6 for k, v in constants.items() if k.startswith("piece:")},
    )
    rows = check(costs, args.rounds)
    constants["time_margin"] = time_margin(rows)
    when = datetime.date.today().isoformat()
    machine = f"{_cpu()}, torch {torch.__version__}"
    command = "python -m benchmarks.step_costs" + (" --write" if args.write else "")
    text = report(constants, rows, when, machine, command)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.write:
        COSTS_FILE.write_text(toml_text(constants, when, machine))


if __name__ == "__main__":
    main()
