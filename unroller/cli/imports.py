"""``unroll import`` and ``unroll weights``: bring an existing network into the language.

``import`` writes the model text for a ``torch.nn.Module`` (``package.module:Factory``,
``path/file.py:Name``) or an ONNX file; ``weights`` writes an ONNX file's initializers as
a state_dict ``.pt`` the generated module loads with ``strict=True``. A network that
cannot be imported prints every unmapped operation (module path, op, source line), exit
status 2, and nothing is written; an existing file is replaced only with ``--force``,
atomically. torch (and onnx) are imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unroller.cli.errors import fail
from unroller.cli.options import KwargsOpt

SpecArg = Annotated[
    str,
    typer.Argument(
        help="The network: package.module:Factory, path/to/file.py:Name, or model.onnx.",
        metavar="SPEC",
    ),
]


def _spec_file(spec: str) -> tuple[Path, ...]:
    """The file a SPEC names (``model.onnx``, ``path/file.py:Name``); none for a module."""
    path = spec.rpartition(":")[0] if spec.rpartition(":")[0].endswith(".py") else spec
    return (Path(path),) if path.endswith((".py", ".onnx")) else ()


def _output_path(output: Path, force: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse an output that is a folder, exists (without --force), lies in a missing
    folder, or is the command's input (never replaced, --force or not)."""
    from unroller.cli.output import is_input

    if is_input(output, inputs) is not None:
        raise fail(f"{output} is the input file; it is never replaced: write elsewhere")
    if output.is_dir():
        raise fail(f"{output} is a folder; give the output file's name")
    if output.exists() and not force:
        raise fail(f"{output} exists; use --force to replace it")
    if not output.parent.is_dir():
        raise fail(f"folder {output.parent} does not exist")


def import_command(
    spec: SpecArg,
    inputs: Annotated[
        list[str],
        typer.Option(
            "--input",
            help='An input of the network and its shape, batch first: "x: f32[N, 3, 224, 224]" '
            "(repeat for several inputs, in forward's order).",
        ),
    ],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help='The loss target, e.g. "y: i64[N]" (default: class indices for cross_entropy '
            "and nll_loss, the predictions' shape for the others).",
        ),
    ] = None,
    loss: Annotated[
        str,
        typer.Option(
            "--loss",
            help="cross_entropy, nll_loss, mse_loss, l1_loss, bce_with_logits or bce_loss, "
            "applied to what forward returns.",
        ),
    ] = "cross_entropy",
    kwargs: KwargsOpt = None,
    name: Annotated[
        str | None, typer.Option("--name", help="The model's name (default: from SPEC).")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="The model file to write; none or '-': stdout."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Before writing, run unroll verify on the text against the original (float64, "
            "1e-10); write nothing and exit 1 if it differs. torch.nn networks only.",
        ),
    ] = False,
    no_fallback: Annotated[
        bool,
        typer.Option(
            "--no-fallback",
            help="Refuse an ATen op no registry operator computes, instead of importing it "
            "as an opaque aten(...) statement (run as is, its backward by torch.autograd).",
        ),
    ] = False,
) -> None:
    """Write the model text of an existing network (torch.nn.Module or ONNX).

    Every statement is named after the module tree (layer1.0.conv1), so the generated
    module's state_dict has the original's keys; submodules that repeat with the same
    structure become blocks. Check the result with unroll verify.

    Example: unroll import torchvision.models:resnet18 --input "x: f32[N, 3, 224, 224]"
    -o resnet18.txt
    """
    from unroller.importer.model import ImportFailure

    to_stdout = output is None or str(output) == "-"
    if not to_stdout:
        _output_path(output, force, _spec_file(spec))
    try:
        from unroller.importer.api import import_network

        imported = import_network(
            spec, inputs, target, loss, kwargs, name, fallback=not no_fallback
        )
    except ImportFailure as exc:
        raise fail(exc.format()) from None
    for note in imported.model.notes:
        if note.startswith("opaque: "):
            typer.echo(f"unroll: {note}", err=True)
    if check:
        _verify(imported.text, spec, kwargs)
    if to_stdout:
        typer.echo(imported.text, nl=False)
        return
    from unroller.api import write_atomic

    try:
        write_atomic(output, imported.text, parents=False)
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    count = len(imported.model.stmts)
    typer.echo(f"wrote {output} ({count} statements)", err=True)


def _verify(text: str, spec: str, kwargs: str | None) -> None:
    """``--verify``: the summary line on standard error; exit 1 (nothing written) on a
    difference, with the failing rows."""
    from unroller.importer.model import ImportFailure
    from unroller.importer.source import is_onnx, parse_kwargs

    if is_onnx(spec):
        raise fail("--verify needs the torch.nn original; an ONNX file cannot be run here")
    from unroller.analysis.verify import verify_text
    from unroller.errors import ModelError

    try:
        report = verify_text(text, spec, parse_kwargs(kwargs), label="<imported>")
    except ImportFailure as exc:
        raise fail(exc.format()) from None
    except ModelError as exc:
        raise fail(f"cannot verify the imported text: {exc.message}") from None
    if not report.ok:
        typer.echo(report.render(), err=True)
        raise fail("the imported text does not match the original; nothing written", code=1)
    typer.echo(f"verify: {report.summary()}", err=True)


def weights_command(
    model: Annotated[Path, typer.Argument(help="The ONNX file.", metavar="MODEL.onnx")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The .pt file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
) -> None:
    """Write an ONNX file's weights as a state_dict .pt for the imported module.

    Example: unroll weights resnet18.onnx -o resnet18.pt, then
    Model().load_state_dict(torch.load("resnet18.pt"))
    """
    _output_path(output, force, (model,))
    from unroller.importer.model import ImportFailure

    try:
        from unroller.importer.onnx_frontend import onnx_state_dict

        state = onnx_state_dict(model)
    except ImportFailure as exc:
        raise fail(exc.format()) from None
    import io

    import torch

    from unroller.api import write_atomic

    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        write_atomic(output, buffer.getvalue(), parents=False)
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {output} ({len(state)} tensors)", err=True)


def register(app: typer.Typer) -> None:
    app.command("import")(import_command)
    app.command("weights")(weights_command)
