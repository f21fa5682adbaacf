"""The registry and the kernels agree: every op's kernels take exactly what codegen passes."""

from __future__ import annotations

import importlib
import inspect

import pytest

from unroller.compiler.platforms import PLATFORMS
from unroller.compiler.registry import RegistryError, eval_expr, load_registry

OPS = load_registry()


def keyword_only(func) -> set[str]:
    return {
        name
        for name, p in inspect.signature(func).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def positional(func) -> list[inspect.Parameter]:
    return [
        p
        for p in inspect.signature(func).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_kernels_take_what_the_registry_passes(name, platform):
    op = OPS[name]
    module = importlib.import_module(op.kernels.get(platform, PLATFORMS[platform].kernels))
    forward, backward = getattr(module, name), getattr(module, f"{name}_backward")
    assert keyword_only(forward) == set(op.kernel_args)
    lean = {  # passed where the platform shrinks the backward working set
        name
        for name, on in (
            ("piece_bytes", op.backward_pieces),
            ("in_place", op.backward_in_place),
            ("add_into", op.backward_add_into),
            ("consume", bool(op.backward_consumes)),
        )
        if on and PLATFORMS[platform].piece_bytes > 0
    }
    if op.backward_accumulates and PLATFORMS[platform].grads == "accumulate":
        lean.add("accumulate")  # parameter gradients added into .grad by the kernel
    assert keyword_only(backward) == set(op.backward_args) | {"needs"} | lean
    if op.recompute is not None:  # --recompute calls it as the forward is called
        again = getattr(module, op.recompute.kernel)
        assert keyword_only(again) == set(op.kernel_args)
        assert [p.name for p in positional(again)] == [p.name for p in positional(forward)]
    # the tensor inputs, then one layer handle for all parameters and buffers
    has_layer = bool(op.params or op.buffers)
    fwd_pos = positional(forward)
    if op.variadic:
        assert fwd_pos[0].kind is inspect.Parameter.VAR_POSITIONAL
    else:
        assert len(fwd_pos) == len(op.inputs) + has_layer, (name, fwd_pos)
    # backward: the output gradient, then the saved entries in registry order, the
    # parameter entries as one layer handle
    layer_entries = {t.name for t in (*op.params, *op.buffers)}
    saved = [e for e in op.saved if e not in layer_entries]
    assert len(positional(backward)) == 1 + len(saved) + bool(layer_entries & set(op.saved))
    if op.has_eval:
        ev = getattr(module, f"{name}_eval")
        assert keyword_only(ev) == set(op.kernel_args)
        assert len(positional(ev)) == len(op.inputs) + has_layer


def test_every_spec_op_is_registered():
    spec_ops = (
        "conv2d conv_transpose2d linear batchnorm2d relu sigmoid tanh gelu leaky_relu maxpool2d "
        "avgpool2d adaptive_avgpool2d upsample add mul concat flatten reshape dropout "
        "cross_entropy mse_loss l1_loss bce_loss bce_with_logits"
    ).split()
    assert set(spec_ops) <= set(OPS)


def test_shape_expressions_are_restricted():
    assert eval_expr("(a, b // 2, k[0])", {"a": 3, "b": 8, "k": (5, 6)}) == (3, 4, 5)
    with pytest.raises(RegistryError):
        eval_expr("__import__('os')", {})
    with pytest.raises(RegistryError):
        eval_expr("a.b", {"a": 1})


def test_malformed_registry_file_is_reported(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[foo]\ndoc = "x"\nkind = "nonsense"\nshape = "same_float"\nkernels.gpu = "m"\ninputs = ["x"]\n'
    )
    with pytest.raises(RegistryError, match="kind must be one of"):
        load_registry([str(bad)])
