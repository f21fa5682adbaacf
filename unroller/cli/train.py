"""``unroll train`` and ``unroll accuracy``: train generated gpu modules on a dataset.

Both commands take one set of training options (``TRAINING`` below, declared in
``unroller.cli.options``) and turn it into a ``TrainConfig`` the same way; ``train`` adds
a scheme, a seed and --resume, ``accuracy`` a list of schemes and a number of seeds.
Training imports torch, so it is imported only when one of these commands runs.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from unroller.api import PathError
from unroller.cli.errors import config_error, fail, model_error, path_error, shown_path
from unroller.cli.options import (
    DEFAULT_PRECISION,
    DEFAULT_SCHEME,
    BatchOpt,
    ConfigOpt,
    DataSeedOpt,
    DatasetOpt,
    DecayOpt,
    DeviceOpt,
    EpochsOpt,
    LrOpt,
    ModelArg,
    MomentumOpt,
    OptimizerOpt,
    PrecisionOpt,
    QuietOpt,
    ResolutionOpt,
    ScheduleOpt,
    SchemeOpt,
    TestSizeOpt,
    TrainSizeOpt,
    value_of,
)
from unroller.cli.target import checked
from unroller.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from unroller.training.loop import TrainConfig

#: The options train and accuracy share, by parameter name: each is a TrainConfig field.
TRAINING = (
    "dataset",
    "epochs",
    "batch_size",
    "lr",
    "optimizer",
    "momentum",
    "weight_decay",
    "schedule",
    "data_seed",
    "train_size",
    "test_size",
    "resolution",
    "device",
    "precision",
)


def training_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The shared training options out of a command's parameters (its ``locals()``); the
    resolution refused as ``Options`` refuses it (status 2)."""
    checked("resolution", values["resolution"])
    settings = {name: values[name] for name in TRAINING}
    settings["precision"] = checked("precision", value_of(values["precision"]))
    return settings


def _logger(quiet: bool):
    return (lambda line: None) if quiet else (lambda line: typer.echo(line, err=True))


def _resumed_config(ctx: typer.Context, config: TrainConfig, resume: Path) -> TrainConfig:
    """The checkpoint's settings, overridden by the options given on the command line
    (``train`` then refuses any that differ, except --epochs)."""
    from unroller.training.loop import TrainConfig, load_checkpoint

    recorded = TrainConfig.from_dict(load_checkpoint(resume)["config"])
    given = {
        name
        for name in config.to_dict()
        # compared by name: typer may ship its own copy of click's ParameterSource
        if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"
    }
    values = recorded.to_dict()
    values.update({name: value for name, value in config.to_dict().items() if name in given})
    return TrainConfig.from_dict(values)


def _default_out(model: Path, dataset: str, label: str, seed: int) -> Path:
    return Path("runs") / f"{model.stem}-{dataset.split(':', 1)[0]}-{label}-s{seed}"


def _check_out(out: Path, resume: Path | None, force: bool) -> None:
    """Refuse a run folder before torchrun launches anything. One process (and rank 0
    inside torchrun) checks in ``training.train``; the other ranks would see its files
    half-made."""
    from unroller.training.loop import resumes_in_place
    from unroller.training.run_folder import check_run_folder

    check_run_folder(out, force=force, ours=resumes_in_place(resume, out))


def train(
    ctx: typer.Context,
    model: ModelArg,
    dataset: DatasetOpt = "digits",
    scheme: SchemeOpt = DEFAULT_SCHEME,
    compress_config: ConfigOpt = None,
    epochs: EpochsOpt = 10,
    batch_size: BatchOpt = 64,
    lr: LrOpt = 0.05,
    optimizer: OptimizerOpt = "sgd",
    momentum: MomentumOpt = 0.9,
    weight_decay: DecayOpt = 5e-4,
    schedule: ScheduleOpt = "cosine",
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and data order.")] = 0,
    data_seed: DataSeedOpt = 0,
    train_size: TrainSizeOpt = None,
    test_size: TestSizeOpt = None,
    resolution: ResolutionOpt = None,
    precision: PrecisionOpt = DEFAULT_PRECISION,
    device: DeviceOpt = "cpu",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Run folder (default runs/MODEL-DATASET-SCHEME-sSEED)."),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(help="Continue from this checkpoint.pt (same settings; --epochs may grow)."),
    ] = None,
    quiet: QuietOpt = False,
    nproc_per_node: Annotated[
        int,
        typer.Option(
            "--nproc-per-node",
            min=1,
            help="Data parallel: processes, each on its share of every batch, gradients "
            "all-reduced during the backward (launched through torchrun; gloo on the CPU, "
            "nccl on CUDA).",
        ),
    ] = 1,
    sync_bn: Annotated[
        bool,
        typer.Option("--sync-bn", help="Data parallel: batch norm over the whole batch."),
    ] = False,
    shard: Annotated[
        bool,
        typer.Option(
            "--shard",
            help="Data parallel sharded on FSDP2 (with --nproc-per-node): each process holds "
            "a shard of every parameter, gradient and optimizer state, each block's "
            "parameters all-gathered where the step needs them.",
        ),
    ] = False,
    update_in_backward: Annotated[
        bool,
        typer.Option(
            "--update-in-backward",
            help="Step the optimizer inside the backward, each parameter as soon as its "
            "gradient is final, freeing the gradient (one process; not with fp16-mixed).",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Write into --out even if it is a non-empty folder unroller did not make "
            "(its model.py, metrics.jsonl, run.json are replaced).",
        ),
    ] = False,
) -> None:
    """Train the generated gpu-platform model of MODEL on a dataset.

    Writes OUT/metrics.jsonl (one line per epoch), OUT/checkpoint.pt (after every
    epoch, atomically), OUT/run.json and OUT/model.py (the generated module). OUT must be
    new, empty or a run folder unroll train made (marked by OUT/.unroller-run).

    Example: unroll train benchmarks/models/quick.txt --dataset digits --scheme dct-dense --epochs 15
    """
    from unroller.training.loop import TrainConfig
    from unroller.training.loop import train as run_training

    config = TrainConfig(
        **training_settings(locals()),
        model=str(model.resolve()),  # absolute: a resume may start in another folder
        scheme=value_of(scheme),
        compress_config=str(compress_config.resolve()) if compress_config else None,
        seed=seed,
        nproc_per_node=nproc_per_node,
        sync_bn=sync_bn,
        update_in_backward=update_in_backward,
        shard=shard,
    )
    if out is None and resume is not None:
        out = resume.parent
    if out is None:
        label = value_of(scheme) if compress_config is None else compress_config.stem
        out = _default_out(model, dataset, label, seed)
    try:
        if resume is not None:
            config = _resumed_config(ctx, config, resume)
        config.validate()
        if config.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
            _check_out(out, resume, force)
            raise typer.Exit(_launch(config, out, resume, quiet, force))
        with _process_group(config):
            run = run_training(
                config, out, resume=resume, progress=not quiet, log=_logger(quiet), force=force
            )
    except ModelError as exc:
        raise model_error(exc, model) from None
    except ConfigError as exc:
        raise config_error(exc) from None
    except PathError as exc:  # a link or FIFO where a run file goes: the message names it
        raise fail(shown_path(exc)) from None
    except OSError as exc:  # anything a run folder's checks did not foresee: one line
        if exc.filename is None:
            exc.filename = out
        raise path_error(exc) from None
    except KeyboardInterrupt:
        if (out / "checkpoint.pt").is_file():
            typer.echo(f"interrupted; continue with --resume {out / 'checkpoint.pt'}", err=True)
        else:
            typer.echo("interrupted before the first epoch ended; nothing to resume", err=True)
        raise typer.Exit(130) from None
    last = run.history[-1] if run.history else None
    if last is not None and last.get("diverged"):
        typer.echo(f"the loss stopped being finite at epoch {last['epoch']}", err=True)
        raise typer.Exit(1)
    if not quiet and last is not None:
        typer.echo(
            f"{run.primary} {last['test'][run.primary]:.4g} after epoch {last['epoch']}; "
            f"metrics in {out / 'metrics.jsonl'}",
            err=True,
        )


def _child_args(
    config: TrainConfig, out: Path, resume: Path | None, quiet: bool, force: bool = False
) -> list[str]:
    """``unroll train`` arguments that give each torchrun process ``config``."""
    args = [config.model, "--out", str(Path(out).resolve())]
    if resume is not None:
        args += ["--resume", str(Path(resume).resolve())]
    for name in ("dataset", "scheme", "epochs", "batch_size", "lr", "optimizer", "momentum"):
        args += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    for name in ("weight_decay", "schedule", "seed", "data_seed", "device", "nproc_per_node"):
        args += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    for name in ("precision",):
        args += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    for name in ("compress_config", "train_size", "test_size", "resolution"):
        if getattr(config, name) is not None:
            args += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    if config.sync_bn:
        args.append("--sync-bn")
    if config.shard:
        args.append("--shard")
    if config.update_in_backward:
        args.append("--update-in-backward")
    if quiet:
        args.append("--quiet")
    if force:
        args.append("--force")
    return args


def launch_command(
    config: TrainConfig, out: Path, resume: Path | None, quiet: bool, force: bool = False
) -> list[str]:
    """torchrun running ``unroll train`` in ``nproc_per_node`` processes (one machine, a
    rendezvous on a free local port); no code from the working directory runs in it."""
    from unroller.parallel.data import torchrun_command

    args = ["train", *_child_args(config, out, resume, quiet, force)]
    return torchrun_command(config.nproc_per_node, "unroller.cli", args)


def _launch(config: TrainConfig, out: Path, resume: Path | None, quiet: bool, force: bool) -> int:
    """Run the data-parallel training (``launch_command``); its exit status."""
    return subprocess.run(launch_command(config, out, resume, quiet, force), check=False).returncode


@contextlib.contextmanager
def _process_group(config: TrainConfig):
    """Inside torchrun (WORLD_SIZE set): the default process group for the run, gloo on the
    CPU and nccl on CUDA, taken down after it; outside: nothing."""
    if "WORLD_SIZE" not in os.environ or config.nproc_per_node == 1:
        yield
        return
    import torch.distributed as dist

    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    if config.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


def accuracy(
    model: ModelArg,
    dataset: DatasetOpt = "digits",
    schemes: Annotated[
        str,
        typer.Option(
            help="all (nocompress, dct-first, dct-dense, quant-8bit, quant-4bit, "
            "quant-2bit) or a comma-separated list of those and .toml configs."
        ),
    ] = "all",
    seeds: Annotated[int, typer.Option(help="Seeds 0..K-1 per scheme.", min=1)] = 3,
    epochs: EpochsOpt = 10,
    batch_size: BatchOpt = 64,
    lr: LrOpt = 0.05,
    optimizer: OptimizerOpt = "sgd",
    momentum: MomentumOpt = 0.9,
    weight_decay: DecayOpt = 5e-4,
    schedule: ScheduleOpt = "cosine",
    data_seed: DataSeedOpt = 0,
    train_size: TrainSizeOpt = None,
    test_size: TestSizeOpt = None,
    resolution: ResolutionOpt = None,
    precision: PrecisionOpt = DEFAULT_PRECISION,
    device: DeviceOpt = "cpu",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Results folder (default runs/accuracy-MODEL-DATASET)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Train every scheme over several seeds from the same initial weights; write
    OUT/accuracy.md, accuracy.csv, summary.json and per-epoch PNG plots.

    Runs already finished in OUT are reused, unfinished ones continue.

    Example: unroll accuracy benchmarks/models/quick.txt --dataset digits --schemes all --seeds 3
    """
    from unroller.training.accuracy import parse_schemes, run_accuracy
    from unroller.training.loop import TrainConfig

    if out is None:
        out = Path("runs") / f"accuracy-{model.stem}-{dataset.split(':', 1)[0]}"
    base = TrainConfig(model=str(model), **training_settings(locals()))
    from unroller.bench.machine import shown_argument  # results name no absolute path

    command = "unroll " + " ".join(shlex.quote(shown_argument(a)) for a in sys.argv[1:])
    try:
        run_accuracy(
            base,
            parse_schemes(schemes),
            list(range(seeds)),
            out,
            command,
            not quiet,
            _logger(quiet),
        )
    except ModelError as exc:
        raise model_error(exc, model) from None
    except ConfigError as exc:
        raise config_error(exc) from None
    except KeyboardInterrupt:
        typer.echo("interrupted; run the same command again to continue", err=True)
        raise typer.Exit(130) from None
    typer.echo((out / "accuracy.md").read_text(encoding="utf-8"))


def register(app: typer.Typer) -> None:
    """Add train and accuracy to ``app``."""
    app.command()(train)
    app.command()(accuracy)
