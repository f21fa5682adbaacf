"""Model value names never collide with the names the templates use themselves.

A loss named ``total`` once silently returned the multi-IPU surrogate loss instead of
the real one. Every name a template emits is reserved (``names.RESERVED`` and the
numbered families K2, CODEC_...), checked here two ways: the names each platform's
module uses that do not come from the model are all reserved, and a model whose values
take each reserved name trains exactly like the same model with plain names.
"""

from __future__ import annotations

import ast

import pytest
import torch
from conftest import generated_text, rel_err

from unroller.api import generate_from_text
from unroller.compiler.names import _RESERVED_PATTERN, RESERVED, TEMPLATE_NAMES
from unroller.compiler.options import Options
from unroller.compiler.registry import load_registry
from unroller.runtime import ipu_device, poptorch_emulation

# Every template name, the numbered families, builtins a template could call, Python
# keywords and soft keywords: each becomes a value name below (the loss is `total`,
# the input `range`).
NAMES = sorted(TEMPLATE_NAMES - {"_", "total"}) + [
    "_",
    "sum",
    "len",
    "print",
    "super",
    "getattr",
    "K2",
    "K3",
    "CODEC_DCT",
    "CODEC_QUANT",
    "CODEC_DCT_2",
    "grad_x",
    "grad_weight",
    "lambda",
    "class",
    "None",
    "match",
]

PLATFORMS = [
    Options(scheme="dct-dense"),
    Options(scheme="quant"),
    Options(platform="ipu", scheme="dct-dense"),
    Options(platform="ipu", scheme="dct-dense", num_ipus=2),
]


def chain_model(names: list[str], loss: str, data: str = "x", p: str = "") -> str:
    """conv -> (batchnorm, relu)* under the given names -> pool -> linear -> loss."""
    lines = [f"    {names[0]} = conv2d({data}, out_channels=4, kernel_size=3, padding=1)"]
    for i, name in enumerate(names[1:-1], start=1):
        op = "relu" if i % 2 else "batchnorm2d"
        lines.append(f"    {name} = {op}({names[i - 1]})")
    lines.append(f"    {p}pooled = adaptive_avgpool2d({names[-2]}, output_size=1)")
    lines.append(f"    {p}flat = flatten({p}pooled)")
    lines.append(f"    {names[-1]} = linear({p}flat, out_features=3)")
    lines.append(f"    {loss} = cross_entropy({names[-1]}, {p}y)")
    body = "\n".join(lines)
    return (
        f"model m {{\n    input {data}: f32[N, 2, 8, 8]\n    target {p}y: i64[N]\n{body}\n"
        f"    return {loss}, {names[-1]}\n}}\n"
    )


def _module(tmp_path, text: str, options: Options, tag: str):
    from unroller.api import import_generated, write_atomic

    path = tmp_path / f"{tag}.py"
    write_atomic(path, generated_text(text, options, label="m.txt"))
    return import_generated(path, f"reserved_{tmp_path.name}_{tag}")


def _step(module, state, options: Options):
    model = module.Model().double()
    model.load_state_dict(dict(zip(model.state_dict(), state.values())))
    torch.manual_seed(0)
    x = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    if options.platform == "ipu":
        ipu_device.use_emulation()
        try:
            training = poptorch_emulation.trainingModel(model, poptorch_emulation.Options())
            _, loss = training(x, y)
        finally:
            ipu_device.use_emulation(False)
        grads = []  # the emulation applies them; the loss is what the bug got wrong
    else:
        loss = model(x, y)
        grads = [p.grad for p in model.parameters()]
    return loss, grads, model.predict(x)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(o, marks=() if i in (0, 2) else pytest.mark.slow)  # gpu-dct, ipu fast
        for i, o in enumerate(PLATFORMS)
    ],
    ids=["gpu-dct", "gpu-quant", "ipu", "ipu2"],
)
def test_reserved_words_as_value_names_train_like_plain_names(tmp_path, options):
    plain = [f"v{i}" for i in range(len(NAMES))]
    clean = _module(tmp_path, chain_model(plain, "loss"), options, "clean")
    hostile = _module(tmp_path, chain_model(NAMES, "total", data="range"), options, "hostile")
    torch.manual_seed(1)
    state = clean.Model().double().state_dict()
    want_loss, want_grads, want_pred = _step(clean, state, options)
    loss, grads, pred = _step(hostile, state, options)
    assert rel_err(loss, want_loss) <= 1e-12
    assert rel_err(pred, want_pred) <= 1e-12
    for got, want in zip(grads, want_grads):
        assert rel_err(got, want) <= 1e-12


@pytest.mark.parametrize("options", PLATFORMS, ids=["gpu-dct", "gpu-quant", "ipu", "ipu2"])
def test_every_name_a_template_uses_is_reserved(options):
    names = [f"zz{i}" for i in range(8)]
    text = generate_from_text(
        chain_model(names, "zzloss", data="zzx", p="zz"), options, label="m.txt"
    )
    used = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.arg):
            used.add(node.arg)
        elif isinstance(node, ast.alias):
            used.add(node.asname or node.name.split(".")[0])
    # The per-parameter gradient temporaries (grad_weight, ...) are named by the same
    # Namer as model values, after them, so a value named so keeps its name and the
    # temporary becomes grad_weight_2 (the hostile model above has one).
    temporaries = {f"grad_{p.name}" for op in load_registry().values() for p in op.params}
    from_template = {n for n in used if "zz" not in n} - temporaries
    unreserved = {n for n in from_template if n not in RESERVED and not _RESERVED_PATTERN.match(n)}
    assert not unreserved, f"template names a model value could take: {sorted(unreserved)}"
