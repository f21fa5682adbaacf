"""``unroll estimate``: memory and time on a device this machine does not have.

The work is ``unroller.analysis.estimate`` (imported when the command runs: it imports torch);
this module reads the options, runs the estimate per scheme and prints a table or JSON.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from unroller.cli.errors import config_error, fail, model_error
from unroller.cli.options import (
    DEFAULT_PRECISION,
    ConfigOpt,
    ModelArg,
    PrecisionOpt,
    RecomputeOpt,
    ResolutionOpt,
    UpdateInBackwardOpt,
    value_of,
)
from unroller.cli.target import checked, make_options
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.schemes import SCHEMES
from unroller.errors import ConfigError, ModelError

MIB = 2**20


def _size(text: str, flag: str) -> int:
    from unroller.bench.options import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise fail(f"{flag}: {exc}") from None


def _rate(text: str, flag: str) -> float:
    """``20GB/s`` -> 2e10 bytes per second (the units of --device-memory, per second)."""
    return float(_size(text.removesuffix("/s"), flag))


def _schemes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return [s for s in SCHEMES if s != "auto"]
    unknown = [s for s in names if s not in SCHEMES]
    if unknown or not names:
        raise fail(
            f"unknown scheme '{unknown[0] if unknown else text}' (known: {', '.join(SCHEMES)})"
        )
    return names


def estimate(
    model: ModelArg,
    platform: Annotated[str, typer.Option("--platform", "-p", help="ipu or gpu.")] = "ipu",
    scheme: Annotated[
        str,
        typer.Option(
            "--scheme", help="A scheme, a comma list, or all (nocompress is always the baseline)."
        ),
    ] = "all",
    ipus: Annotated[
        int, typer.Option("--ipus", help="ipu: pipeline stages, one per IPU (1, 2, 4).")
    ] = 1,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="ipu: samples per micro-batch.")
    ] = 32,
    micro_batches: Annotated[
        int,
        typer.Option(
            "--micro-batches",
            min=1,
            help="ipu, pipelined: micro-batches per step (gradient accumulation; at least "
            "the IPUs).",
        ),
    ] = 8,
    streaming_bandwidth: Annotated[
        str,
        typer.Option(
            "--streaming-bandwidth",
            help="ipu: Streaming Memory bandwidth, reads and writes together (not published: "
            "an assumption to calibrate).",
        ),
    ] = "20GB/s",
    efficiency: Annotated[
        float,
        typer.Option("--efficiency", min=0.001, max=1.0, help="ipu: achieved / peak FP32 compute."),
    ] = 0.25,
    code_allowance: Annotated[
        str,
        typer.Option("--code-allowance", help="ipu: per IPU, for code and exchange buffers."),
    ] = "150MiB",
    device_memory: Annotated[
        str, typer.Option("--device-memory", help="gpu: the device's memory.")
    ] = "80GiB",
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="gpu: sgd (one state per parameter) or adam (two).")
    ] = "sgd",
    compress_config: ConfigOpt = None,
    recompute: RecomputeOpt = False,
    update_in_backward: UpdateInBackwardOpt = False,
    resolution: ResolutionOpt = None,
    precision: PrecisionOpt = DEFAULT_PRECISION,
    fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
) -> None:
    """Estimate memory and speed on an IPU (GC200) or the largest batch on a GPU, per scheme.

    IPU: per IPU, the weights, gradients and optimizer state, the stash at the micro-batch,
    the largest working set of one op and an allowance for code, against 897 MiB of
    In-Processor-Memory; what does not fit goes to Streaming Memory. The step time is a
    roofline of FLOPs and bytes with the bandwidths as named parameters (unroller/analysis/estimate.py);
    the ratios against nocompress, on the same IPUs and on one, are the figures to read.
    GPU: the largest batch whose predicted total (weights, optimizer state, batch, the memory
    model's step peak) fits --device-memory; with --update-in-backward the step frees each
    gradient at its update (no full gradient set).

    Examples: unroll estimate benchmarks/models/emdenoise.txt --platform ipu --ipus 2
    --batch-size 8 --scheme dct-dense;
    unroll estimate benchmarks/models/resnet34.txt --platform gpu --device-memory 16GiB
    """
    try:
        kind = get_platform(platform).estimate
    except ValueError as exc:
        raise fail(str(exc)) from None
    if fmt not in ("table", "json"):
        raise fail(f"unknown format '{fmt}' (table or json)")
    if optimizer not in ("sgd", "adam"):
        raise fail(f"unknown optimizer '{optimizer}' (sgd or adam)")
    if update_in_backward:  # refused where the platform's step cannot update (status 2)
        make_options({"platform": platform, "update_in_backward": True})
    if ipus not in (1, 2, 4):
        raise fail("--ipus must be 1, 2 or 4")
    names = _schemes(scheme)
    checked("resolution", resolution)
    precision = checked("precision", value_of(precision))
    from unroller.api import load_graph, source_label
    from unroller.compiler.options import Options

    try:
        graph = load_graph(model, resolution, precision)
    except ModelError as exc:
        raise model_error(exc, model) from None
    config = source_label(compress_config) if compress_config else None

    def options(name: str, k: int = 1) -> Options:
        """The options of one row: a scheme, or "config" (the --compress-config file)."""
        return Options(
            platform=platform,
            scheme="nocompress" if name == "config" else name,
            compress_config=config if name == "config" else None,
            num_ipus=k,
            resolution=resolution,
            recompute=recompute,
            update_in_backward=update_in_backward,
            precision=precision,
        )

    if config is not None:
        names = ["nocompress", "config"]
    settings = {
        "ipus": ipus,
        "batch": batch_size,
        "micro_batches": micro_batches,
        "streaming": _rate(streaming_bandwidth, "--streaming-bandwidth"),
        "efficiency": efficiency,
        "code": _size(code_allowance, "--code-allowance"),
        "device": _size(device_memory, "--device-memory"),
        "optimizer": optimizer,
    }
    try:
        found = ESTIMATES[kind](graph, options, names, settings)
    except ConfigError as exc:
        raise config_error(exc) from None
    except ModelError as exc:
        raise model_error(exc, model) from None
    if fmt == "json":
        typer.echo(json.dumps(found, indent=1))
    else:
        typer.echo(found["table"])


def _batch_text(batch: int, at_least: bool) -> str:
    """A largest batch for the table: ``>=N`` when the search stopped at its ceiling."""
    return f">={batch}" if at_least else str(batch)


def _ceiling_note(scheme: str, batch: int, what: str) -> str:
    return (
        f"  note ({scheme}): the search stopped at {batch} with the predicted memory still "
        f"within {what}: the largest batch is at least {batch}, maybe more"
    )


def _ipu(graph, options, names, settings: dict[str, Any]) -> dict[str, Any]:
    from unroller.analysis.estimate import (
        IpuSpec,
        at_ceiling,
        estimate_ipu,
        largest_on_chip,
        samples_per_second,
    )
    from unroller.api import compression_config

    ipus, batch, micro_batches = settings["ipus"], settings["batch"], settings["micro_batches"]
    spec = IpuSpec(
        streaming_bandwidth=settings["streaming"],
        efficiency=settings["efficiency"],
        code_bytes=settings["code"],
    )
    one = estimate_ipu(graph, options("nocompress"), batch, 1, spec)
    same = estimate_ipu(graph, options("nocompress", ipus), batch, ipus, spec, micro_batches)
    rows: list[dict[str, Any]] = []
    for name in dict.fromkeys(["nocompress", *names]):
        opts = options(name, ipus)
        config = compression_config(opts, graph)  # the auto scheme planned here, once
        est = estimate_ipu(graph, opts, batch, ipus, spec, micro_batches, config=config)
        rate = samples_per_second(est)
        largest = largest_on_chip(graph, opts, ipus, spec, config=config)
        rows.append(
            {
                "scheme": name,
                **est.as_dict(),
                "samples_per_s": rate,
                "vs_nocompress_same_ipus": rate / samples_per_second(same),
                "vs_nocompress_one_ipu": rate / samples_per_second(one),
                "largest_on_chip_micro_batch": largest,
                # true: a lower bound (the search's ceiling), not the largest
                "largest_on_chip_at_least": at_ceiling(largest),
            }
        )
    lines = [
        f"IPU estimate (GC200, {spec.memory_bytes / MIB:.0f} MiB per IPU): {ipus} IPU(s), "
        f"micro-batch {batch}"
        + (f", {rows[0]['micro_batches']} micro-batches per step" if ipus > 1 else ""),
        f"assumptions: streaming {spec.streaming_bandwidth / 1e9:g} GB/s, compute "
        f"{spec.efficiency:g} x {spec.flops / 1e12:g} TFLOPS, code allowance "
        f"{spec.code_bytes / MIB:.0f} MiB/IPU, IPU-Links {spec.ipu_link_bandwidth / 1e9:g} GB/s",
        "",
        f"{'scheme':<11} {'IPU':>3} {'weights+opt':>11} {'stash':>8} {'working':>8} "
        f"{'total MiB':>9} {'off chip':>9} {'step ms':>8} {'samples/s':>9} {'vs noc':>7} "
        f"{'vs noc@1':>8} {'max on chip':>11}",
    ]
    for row in rows:
        for stage in row["stages"]:
            first = stage["ipu"] == 0
            state = stage["weights_bytes"] + stage["grads_bytes"] + stage["optimizer_bytes"]
            tail = (
                f"{row['streaming_bytes'] / MIB:>9.1f} {row['step_seconds'] * 1e3:>8.2f} "
                f"{row['samples_per_s']:>9.1f} {row['vs_nocompress_same_ipus']:>6.2f}x "
                f"{row['vs_nocompress_one_ipu']:>7.2f}x "
                f"{_batch_text(row['largest_on_chip_micro_batch'], row['largest_on_chip_at_least']):>11}"
                if first
                else ""
            )
            lines.append(
                f"{row['scheme'] if first else '':<11} {stage['ipu']:>3} {state / MIB:>11.1f} "
                f"{stage['stash_bytes'] / MIB:>8.1f} {stage['working_bytes'] / MIB:>8.1f} "
                f"{stage['total_bytes'] / MIB:>9.1f} {tail}"
            )
        for note in row["notes"]:
            lines.append(f"  note ({row['scheme']}): {note}")
        if row["largest_on_chip_at_least"]:
            largest = row["largest_on_chip_micro_batch"]
            lines.append(_ceiling_note(row["scheme"], largest, "each IPU's memory"))
    return {"platform": "ipu", "spec": spec.__dict__, "rows": rows, "table": "\n".join(lines)}


def _gpu(graph, options, names, settings: dict[str, Any]) -> dict[str, Any]:
    from unroller.analysis.estimate import estimate_gpu
    from unroller.api import compression_config

    device, optimizer = settings["device"], settings["optimizer"]
    states = 2 if optimizer == "adam" else 1
    rows = []
    for name in dict.fromkeys(["nocompress", *names]):
        opts = options(name)
        est = estimate_gpu(graph, opts, device, states, config=compression_config(opts, graph))
        rows.append({**est.as_dict(), "scheme": name})
    base = rows[0]["max_batch"] or 1
    lines = [
        f"GPU estimate: {device / MIB:.0f} MiB device memory, {optimizer} ({states} state(s) "
        "per parameter); predicted by unroller.analysis.memory (CPU kernels' working memory)",
        "",
        f"{'scheme':<11} {'max batch':>9} {'vs nocompress':>13} {'total MiB there':>15} "
        f"{'step peak MiB':>13}",
    ]
    bounded = rows[0]["max_batch_at_least"]
    for row in rows:
        at_least = row["max_batch_at_least"]
        ratio = row["max_batch"] / base
        versus = "unknown" if bounded or at_least else f"{ratio:.2f}x"
        lines.append(
            f"{row['scheme']:<11} {_batch_text(row['max_batch'], at_least):>9} {versus:>13} "
            f"{row['total_bytes'] / MIB:>15.1f} {row['step_peak_bytes'] / MIB:>13.1f}"
        )
    for row in rows:
        if row["max_batch_at_least"]:
            lines.append(_ceiling_note(row["scheme"], row["max_batch"], "--device-memory"))
    return {"platform": "gpu", "rows": rows, "table": "\n".join(lines)}


#: The estimate of each kind a platform names (``Platform.estimate``): memory per device
#: against its on-chip memory and a step time, or the largest batch in --device-memory.
ESTIMATES = {"on_chip": _ipu, "largest_batch": _gpu}


def register(app: typer.Typer) -> None:
    app.command()(estimate)


__all__ = ["estimate", "register"]
