"""The operator facts the estimate, the planner, the memory model and the data makers read
from the registry (``weighted``, ``target``, ``workspace``, ``reorders``): the built-in
entries say what the modules hard-coded before, and a bad value is refused when the
registry loads, naming the op and the field."""

from __future__ import annotations

import pytest

from unroller.compiler.registry import RegistryError, Workspace, load_registry
from unroller.compress import COMPRESSORS

OPS = load_registry()

LAYER = """
[{name}]
doc = "a layer"
kind = "layer"
inputs = ["x"]
shape = "same_float"
params = [{{ name = "weight", shape = "(1,)" }}]
module = {{ class = "torch.nn.Linear", args = [] }}
{extra}
"""

LOSS = """
[{name}]
doc = "a loss"
kind = "loss"
inputs = ["pred", "target"]
shape = "same_float"
{extra}
"""


def load(tmp_path, text: str):
    path = tmp_path / "extra.toml"
    path.write_text(text)
    return load_registry([str(path)])


def test_weighted_layers_are_the_matmul_and_convolution_layers():
    weighted = {name: op.weighted for name, op in OPS.items() if op.weighted}
    assert weighted == {
        "conv2d": "output",
        "conv1d": "output",
        "conv_transpose2d": "input",
        "linear": "output",
        "transposed_linear": "output",
    }


def test_loss_targets_follow_torch():
    """F.cross_entropy and F.nll_loss take class indices in [0, C); the binary
    cross-entropies probabilities in [0, 1]; the regression losses any value."""
    targets = {name: op.target for name, op in OPS.items() if op.is_loss}
    assert targets["cross_entropy"] == targets["nll_loss"] == "classes"
    assert targets["bce_loss"] == targets["bce_with_logits"] == "probabilities"
    assert targets["mse_loss"] is None and targets["l1_loss"] is None


def test_workspace_entries_are_read():
    conv = OPS["conv2d"].workspace
    assert conv.backward == (Workspace(1.0, 1.0),)
    assert conv.pieces == Workspace(2.0, 1.0, 2.0, 40 * 1024)
    assert conv.forward == (Workspace(0.0, 1.0, 1.0),)
    assert OPS["batchnorm1d"].workspace.pieces.restored == 0.0
    assert len(OPS["multihead_attention"].workspace.backward) == 2
    assert OPS["cross_entropy"].workspace.contiguous_input
    assert OPS["linear"].workspace.contiguous_grad
    assert {n for n, op in OPS.items() if op.reorders} == {"permute", "transpose"}
    assert OPS["relu"].workspace.backward == () and OPS["relu"].workspace.pieces is None


def test_every_codec_states_its_flops():
    flops = {name: cls.flops for name, cls in COMPRESSORS.items()}
    assert flops == {"dct": 64.0, "quant": 8.0, "bits": 2.0, "fewbit": 8.0}


@pytest.mark.parametrize(
    "template, extra, message",
    [
        (LAYER, 'weighted = "both"', "weighted must be one of"),
        (LAYER, "weighted = true", "weighted must be one of"),
        (LOSS, 'weighted = "output"', "a weighted op needs a parameter named weight"),
        (LOSS, 'target = "labels"', "target must be one of"),
        (LAYER, 'target = "classes"', "target is for a loss"),
        (LAYER, "workspace.backward = [{ input = 1.0 }]", "a workspace entry is"),
        (LAYER, "workspace.backward = [{ input = -1.0, output = 0.0 }]", "a workspace entry"),
        (LAYER, "workspace.backward = { input = 1.0, output = 0.0 }", "is a list of entries"),
        (LAYER, "workspace.pieces = { input = 1.0, output = 0.0, size = 2 }", "workspace entry"),
        (LAYER, "workspace.forward = [{ input = 1.0, output = 0.0, fixed = 1.5 }]", "fixed"),
        (LAYER, "workspace.backward = [{ input = true, output = 0.0 }]", "workspace entry"),
        (LAYER, "workspace.contiguous_input = 1", "are bools"),
        (LAYER, "workspace.scratch = 1", "workspace keys are"),
        (LAYER, "reorders = true", "reorders is true only for a view"),
        (LAYER, 'reorders = "yes"', "reorders is true only for a view"),
    ],
)
def test_bad_fact_values_are_refused(tmp_path, template, extra, message):
    with pytest.raises(RegistryError, match=message) as caught:
        load(tmp_path, template.format(name="custom_op", extra=extra))
    assert "[custom_op]" in str(caught.value)


def test_good_fact_values_load(tmp_path):
    text = LAYER.format(
        name="custom_layer",
        extra='weighted = "input"\n'
        "workspace.backward = [{ input = 1.0, output = 0.5, tiles = 2.0 }]\n"
        "workspace.pieces = { input = 2.0, output = 1.0, fixed = 4096, restored = 0.0 }\n"
        'workspace.forward = [{ input = 0.0, output = 1.0, extra = ["lse", 1.0] }]',
    )
    text += LOSS.format(name="custom_loss", extra='target = "probabilities"')
    ops = load(tmp_path, text)
    layer = ops["custom_layer"]
    assert layer.weighted == "input"
    assert layer.workspace.backward == (Workspace(1.0, 0.5, tiles=2.0),)
    assert layer.workspace.pieces == Workspace(2.0, 1.0, fixed=4096, restored=0.0)
    assert layer.workspace.forward[0].extra == ("lse", 1.0)
    assert ops["custom_loss"].target == "probabilities"
