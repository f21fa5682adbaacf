"""The ``train`` and ``accuracy`` commands (registered on the main app by ``cli.py``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from unroller.errors import ConfigError, ConfigFileError, ModelError
from unroller.schemes import SCHEMES
from unroller.training import OPTIMIZERS, TrainConfig

DatasetOpt = Annotated[
    str,
    typer.Option(
        "--dataset",
        "-d",
        help="digits (real, from scikit-learn), denoise / clouds / optics (synthetic), "
        "or sciml:PATH (SciML-Bench data on disk).",
    ),
]
EpochsOpt = Annotated[int, typer.Option(help="Epochs to train.", min=1)]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Samples per step.", min=1)]
LrOpt = Annotated[float, typer.Option(help="Peak learning rate.")]
OptimizerOpt = Annotated[str, typer.Option(help=f"{' or '.join(OPTIMIZERS)}.")]
MomentumOpt = Annotated[float, typer.Option(help="SGD momentum.")]
DecayOpt = Annotated[float, typer.Option("--weight-decay", help="L2 weight decay.")]
ScheduleOpt = Annotated[
    str, typer.Option(help="cosine (lr to lr/100 over the epochs) or constant.")
]
DataSeedOpt = Annotated[
    int, typer.Option("--data-seed", help="Seed of the synthetic datasets (not digits).")
]
TrainSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--train-size",
        help="K training samples: the first K of digits / sciml, K generated for synthetic sets.",
    ),
]
TestSizeOpt = Annotated[
    int | None, typer.Option("--test-size", help="K test samples (as --train-size).")
]
ResolutionOpt = Annotated[
    int | None,
    typer.Option(help="Rewrite the model's image inputs and targets to R rows (as unroll bench)."),
]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or epoch lines.")]


def _fail(message: str) -> typer.Exit:
    from unroller.cli import fail  # imported late: cli.py imports this module

    return fail(message)


def _config_error(exc: ConfigError) -> typer.Exit:
    """A config file's error is already ``FILE:LINE:COL: error: ...``: printed as is."""
    from unroller.cli import fail_plain

    return fail_plain(str(exc)) if isinstance(exc, ConfigFileError) else _fail(str(exc))


def _model_error(exc: ModelError, model: Path) -> typer.Exit:
    from unroller.cli import report_model_error

    return report_model_error(exc, model)


def _resumed_config(ctx: typer.Context, config: TrainConfig, resume: Path) -> TrainConfig:
    """The checkpoint's settings, overridden by the options given on the command line
    (``train`` then refuses any that differ, except --epochs)."""
    from unroller.training import load_checkpoint

    try:
        recorded = TrainConfig.from_dict(load_checkpoint(resume)["config"])
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    given = {
        name
        for name in config.to_dict()
        # compared by name: typer may ship its own copy of click's ParameterSource
        if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"
    }
    values = recorded.to_dict()
    values.update({name: value for name, value in config.to_dict().items() if name in given})
    return TrainConfig.from_dict(values)


def register(app: typer.Typer) -> None:
    @app.command()
    def train(
        ctx: typer.Context,
        model: Annotated[Path, typer.Argument(help="The model file (.txt).")],
        dataset: DatasetOpt = "digits",
        scheme: Annotated[
            str, typer.Option(help=f"Compression scheme: {', '.join(SCHEMES)}.")
        ] = "nocompress",
        compress_config: Annotated[
            Path | None, typer.Option("--compress-config", help="TOML compression config.")
        ] = None,
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
        device: DeviceOpt = "cpu",
        out: Annotated[
            Path | None,
            typer.Option(
                "--out", "-o", help="Run folder (default runs/MODEL-DATASET-SCHEME-sSEED)."
            ),
        ] = None,
        resume: Annotated[
            Path | None,
            typer.Option(
                help="Continue from this checkpoint.pt (same settings; --epochs may grow)."
            ),
        ] = None,
        quiet: QuietOpt = False,
    ) -> None:
        """Train the generated gpu-platform model of MODEL on a dataset.

        Writes OUT/metrics.jsonl (one line per epoch), OUT/checkpoint.pt (after every
        epoch, atomically), OUT/run.json and OUT/model.py (the generated module).

        Example: unroll train benchmarks/models/quick.txt --dataset digits --scheme dct-dense --epochs 15
        """
        from unroller.training import train as run_training

        if scheme not in SCHEMES:
            raise _fail(f"unknown scheme '{scheme}' (known: {', '.join(SCHEMES)})")
        config = TrainConfig(
            model=str(model.resolve()),  # absolute: a resume may start in another folder
            dataset=dataset,
            scheme=scheme,
            compress_config=str(compress_config.resolve()) if compress_config else None,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            optimizer=optimizer,
            momentum=momentum,
            weight_decay=weight_decay,
            schedule=schedule,
            seed=seed,
            data_seed=data_seed,
            train_size=train_size,
            test_size=test_size,
            resolution=resolution,
            device=device,
        )
        if resume is not None:
            config = _resumed_config(ctx, config, resume)
            if out is None:
                out = resume.parent
        if out is None:
            data_name = dataset.split(":", 1)[0]
            label = scheme if compress_config is None else compress_config.stem
            out = Path("runs") / f"{model.stem}-{data_name}-{label}-s{seed}"
        log = (lambda line: None) if quiet else (lambda line: typer.echo(line, err=True))
        try:
            run = run_training(config, out, resume=resume, progress=not quiet, log=log)
        except ModelError as exc:
            raise _model_error(exc, model) from None
        except ConfigError as exc:
            raise _config_error(exc) from None
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

    @app.command()
    def accuracy(
        model: Annotated[Path, typer.Argument(help="The model file (.txt).")],
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
        device: DeviceOpt = "cpu",
        out: Annotated[
            Path | None,
            typer.Option(
                "--out", "-o", help="Results folder (default runs/accuracy-MODEL-DATASET)."
            ),
        ] = None,
        quiet: QuietOpt = False,
    ) -> None:
        """Train every scheme over several seeds from the same initial weights; write
        OUT/accuracy.md, accuracy.csv, summary.json and per-epoch PNG plots.

        Runs already finished in OUT are reused, unfinished ones continue.

        Example: unroll accuracy benchmarks/models/quick.txt --dataset digits --schemes all --seeds 3
        """
        from unroller.accuracy import parse_schemes, run_accuracy

        if out is None:
            out = Path("runs") / f"accuracy-{model.stem}-{dataset.split(':', 1)[0]}"
        base = TrainConfig(
            model=str(model),
            dataset=dataset,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            optimizer=optimizer,
            momentum=momentum,
            weight_decay=weight_decay,
            schedule=schedule,
            data_seed=data_seed,
            train_size=train_size,
            test_size=test_size,
            resolution=resolution,
            device=device,
        )
        log = (lambda line: None) if quiet else (lambda line: typer.echo(line, err=True))
        command = "unroll " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        try:
            rows = run_accuracy(
                base, parse_schemes(schemes), list(range(seeds)), out, command, not quiet, log
            )
        except ModelError as exc:
            raise _model_error(exc, model) from None
        except ConfigError as exc:
            raise _config_error(exc) from None
        except KeyboardInterrupt:
            typer.echo("interrupted; run the same command again to continue", err=True)
            raise typer.Exit(130) from None
        typer.echo((out / "accuracy.md").read_text(encoding="utf-8"))
        del rows
