"""The runtime modules' surface against the registry: what generated code may call.

For every registry operator and both platform modules: the kernels exist and are exported,
take the keywords the registry passes (forward / eval: kernel_args; backward and mask
kernels: backward_args and needs), take the layer handle where the registry has parameters,
and default every keyword to the registry's default in the graph's normalised form (the
code generator leaves out arguments equal to their defaults, so the kernel default IS the
meaning). Then the helpers generated code calls around the kernels: add_layer, layers,
tensors, accumulate, collect.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from opinfo import normalized_defaults
from torch import nn

from unroller.compiler import platforms
from unroller.compiler.registry import OpSpec, load_registry
from unroller.runtime import (
    attention,
    common,
    derived,
    gpu,
    ipu,
    moe,
    norms,
    opaque,
    positions,
    precision,
    recurrent,
    shapeops,
)

OPS = load_registry()
KERNELS = {"gpu": gpu, "ipu": ipu}
SHARED_HELPERS = [
    "add_layer",
    "layers",
    "tensors",
    "check_inputs",
    "collect",
    "stash",
    "stash_raw",
    "stash_report",
    "stash_log",
    "unsupported",
    "take",
    "within",
]
#: gpu's own: gradient accumulation into .grad, on the host platform only
GPU_HELPERS = ["accumulate", "accumulate_fresh"]
HELPERS = {"gpu": [*SHARED_HELPERS, *GPU_HELPERS], "ipu": SHARED_HELPERS}
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
PER_OP = [
    pytest.param(platform, name, id=f"{platform}-{name}") for platform in KERNELS for name in OPS
]


#: The working-set keywords' defaults: whole, a new input gradient, nothing to add into.
LEAN_DEFAULTS = {
    "piece_bytes": 0,
    "in_place": False,
    "add_into": None,
    "consume": False,
    "accumulate": False,
}


def lean_keywords(op: OpSpec, platform: str) -> set[str]:
    """The keywords a backward kernel takes beyond the registry's arguments and ``needs``
    on a platform that shrinks the backward working set (``Platform.piece_bytes``), and
    ``accumulate`` (registry ``backward_accumulates``) where gradients go into ``.grad``."""
    target = platforms.platform(platform)
    into_grad = (
        {"accumulate"} if op.backward_accumulates and target.grads == "accumulate" else set()
    )
    if target.piece_bytes <= 0:
        return into_grad
    flags = {
        "piece_bytes": op.backward_pieces,
        "in_place": op.backward_in_place,
        "add_into": op.backward_add_into,
        "consume": bool(op.backward_consumes),
    }
    return {name for name, on in flags.items() if on} | into_grad


def kernel_names(op: OpSpec) -> list[str]:
    """Every kernel the code generator may call for ``op``."""
    names = [op.name, f"{op.name}_backward"]
    names += [f"{op.name}_eval"] if op.has_eval else []
    return names + [m.kernel for m in op.masks.values() if m.kernel]


def keyword_only(func) -> dict[str, inspect.Parameter]:
    params = inspect.signature(func).parameters.values()
    return {p.name: p for p in params if p.kind is KEYWORD_ONLY}


def positional(func) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(func).parameters.values()
    return [p for p in params if p.kind in kinds or p.kind is inspect.Parameter.VAR_POSITIONAL]


def backward_positionals(op: OpSpec) -> list[str]:
    """g, then ``saved`` with its parameter entries replaced by one ``layer``."""
    params = {p.name for p in op.params}
    out = ["g"]
    for entry in op.saved:
        if entry not in params:
            out.append(entry)
        elif "layer" not in out:
            out.append("layer")
    return out


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("platform,name", PER_OP)
def test_kernels_exist_and_are_exported(platform, name):
    K = KERNELS[platform]
    for kernel in kernel_names(OPS[name]):
        assert callable(getattr(K, kernel, None)), kernel
        assert kernel in K.__all__, kernel


@pytest.mark.parametrize("platform,name", PER_OP)
def test_registry_names_these_modules(platform, name):
    """Each op's kernels live in the module the registry names, or the platform's default."""
    module = OPS[name].kernels.get(platform, platforms.platform(platform).kernels)
    assert module == KERNELS[platform].__name__


@pytest.mark.parametrize("platform", list(KERNELS))
def test_all_is_every_public_function_and_nothing_else(platform):
    """__all__ is derived from the module, so it cannot drift from what it offers."""
    K = KERNELS[platform]
    public = {
        name
        for name, obj in vars(K).items()
        if inspect.isfunction(obj) and not name.startswith("_")
        # the runtime's shared modules: common helpers, shape ops, the blocked attention, norms,
        # and the kernels derived once from each platform's own (1-d pools, eval attention)
        if obj.__module__
        in (
            K.__name__,
            common.__name__,
            shapeops.__name__,
            attention.__name__,
            norms.__name__,
            positions.__name__,
            precision.__name__,
            recurrent.__name__,
            derived.__name__,
            opaque.__name__,  # the importer's fallback (aten)
            moe.__name__,  # the mixture of experts (gpu's kernels; ipu's layer builder)
        )
    }
    assert K.__all__ == sorted(set(K.__all__))
    assert set(K.__all__) == public
    assert all(callable(getattr(K, name)) for name in K.__all__)


@pytest.mark.parametrize("platform,name", PER_OP)
def test_kernels_take_what_the_registry_passes(platform, name):
    """Forward / eval take the kernel_args, backward the backward_args and needs, mask
    kernels the backward_args (codegen calls them with the backward's keywords)."""
    op, K = OPS[name], KERNELS[platform]
    forward, backward = getattr(K, name), getattr(K, f"{name}_backward")
    assert set(keyword_only(forward)) == set(op.kernel_args)
    # piece_bytes, in_place, add_into: passed under lossy schemes where the platform has
    # piece_bytes (registry backward_pieces, backward_in_place, backward_add_into)
    assert set(keyword_only(backward)) == set(op.backward_args) | {"needs"} | lean_keywords(
        op, platform
    )
    if op.has_eval:
        assert set(keyword_only(getattr(K, f"{name}_eval"))) == set(op.kernel_args)
    for mask in op.masks.values():
        if mask.kernel:
            kernel = getattr(K, mask.kernel)
            assert set(keyword_only(kernel)) == set(op.backward_args), mask.kernel
            assert len(positional(kernel)) == 1


@pytest.mark.parametrize("platform,name", PER_OP)
def test_positional_arguments_follow_the_registry(platform, name):
    """Forward / eval: the inputs, then one layer handle for an op with parameters or
    buffers; backward: g, then ``saved`` with the layer at its first parameter's place."""
    op, K = OPS[name], KERNELS[platform]
    has_layer = bool(op.params or op.buffers)
    forwards = [getattr(K, name)] + ([getattr(K, f"{name}_eval")] if op.has_eval else [])
    for func in forwards:
        params = positional(func)
        if op.variadic:
            assert [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL]
        else:
            want = [*op.inputs, *(["layer"] if has_layer else [])]
            assert len(params) == len(want), (func.__name__, params)
            assert (params[-1].name == "layer") == has_layer
    back = positional(getattr(K, f"{name}_backward"))
    assert len(back) == len(backward_positionals(op))
    if "layer" in backward_positionals(op):  # a param entry in saved (not a free parameter)
        assert back[backward_positionals(op).index("layer")].name == "layer"


@pytest.mark.parametrize("platform,name", PER_OP)
def test_keyword_defaults_are_the_normalised_registry_defaults(platform, name):
    """An argument with a registry default has it (a pair default 1 as (1, 1)); one without
    (required, or defaulting from another) has none: leaving it out is an error, not a
    silent default; a derived value (input_hw, sizes, ...) has none, or None when None means
    "not needed" (the code generator leaves derived Nones out). ``needs`` defaults to None,
    every gradient (generated code leaves it out when it wants them all)."""
    op, K = OPS[name], KERNELS[platform]
    defaults = {**normalized_defaults(op), "needs": None, **LEAN_DEFAULTS}
    for kernel in kernel_names(op):
        for pname, param in keyword_only(getattr(K, kernel)).items():
            if pname in defaults:
                assert param.default == defaults[pname], (kernel, pname, param.default)
                assert type(param.default) is type(defaults[pname]), (kernel, pname)
            elif pname in op.args:
                assert param.default is inspect.Parameter.empty, (kernel, pname)
            else:  # derived: required, or None where the shape rule may give None ("not
                # needed", e.g. a_shape of an operand that was not broadcast): left out then
                assert param.default in (inspect.Parameter.empty, None), (kernel, pname)


@pytest.mark.parametrize("platform", list(KERNELS))
def test_shape_only_backwards_take_no_activation(platform):
    K = KERNELS[platform]
    for name in ["avgpool2d_backward", "adaptive_avgpool2d_backward", "upsample_backward"]:
        params = list(inspect.signature(getattr(K, name)).parameters.values())
        assert [p.name for p in params if p.kind is not KEYWORD_ONLY] == ["g"], name
        assert "input_hw" in [p.name for p in params]


# ---------------------------------------------------------------- helpers


@pytest.mark.parametrize("platform", list(KERNELS))
def test_helpers_are_exported(platform):
    """The helpers generated code calls; one copy of each shared one, in common (ipu has its
    own ``unsupported``); ``accumulate`` is gpu's own: PopTorch gets gradients through
    ``collect``."""
    K = KERNELS[platform]
    for name in HELPERS[platform]:
        assert name in K.__all__, name
        if name in GPU_HELPERS:
            assert getattr(K, name).__module__ == gpu.__name__, name
        elif not (platform == "ipu" and name == "unsupported"):
            assert getattr(K, name) is getattr(common, name), name
    assert ("accumulate" in ipu.__all__) is False
    assert ("accumulate_fresh" in ipu.__all__) is False
    assert ipu.unsupported is not common.unsupported


def test_accumulate_as_autograd():
    """The first gradient is copied (not aliased), later ones added in place; None skipped."""
    layer = nn.Linear(4, 3).double()
    ref = nn.Linear(4, 3).double()
    ref.load_state_dict(layer.state_dict())
    x1, x2 = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    ref(x1).sum().backward()
    ref(x2).sum().backward()
    g1 = [torch.ones(5, 3, dtype=torch.float64).t().mm(x) for x in (x1, x2)]
    b = [torch.full((3,), 5.0, dtype=torch.float64)] * 2
    gpu.accumulate(layer, weight=None, bias=None)
    assert layer.weight.grad is None and layer.bias.grad is None
    first = g1[0].clone()
    gpu.accumulate(layer, weight=first, bias=b[0])
    assert layer.weight.grad.data_ptr() != first.data_ptr()
    grad = layer.weight.grad
    gpu.accumulate(layer, weight=g1[1], bias=b[1])
    assert layer.weight.grad is grad  # added in place, as AccumulateGrad does
    assert torch.equal(first, g1[0])  # the first gradient was not written into
    assert not grad.requires_grad
    assert torch.allclose(layer.weight.grad, ref.weight.grad, rtol=1e-12, atol=0)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_accumulate_shared_gradient():
    """add_backward hands back g for both inputs: accumulating into one must not change the
    other's."""
    a, b = nn.Linear(3, 2, bias=False), nn.Linear(3, 2, bias=False)
    g = torch.randn(2, 3)
    ga, gb = gpu.add_backward(g, needs=(True, True))
    gpu.accumulate(a, weight=ga)
    gpu.accumulate(b, weight=gb)
    gpu.accumulate(a, weight=torch.ones_like(g))
    assert torch.equal(b.weight.grad, g) and torch.equal(a.weight.grad, g + 1)


def test_accumulate_fresh_takes_the_first_gradient_as_it_is():
    """accumulate_fresh (the registry's fresh_param_grads): the first gradient becomes .grad
    itself, as autograd's AccumulateGrad takes a gradient only it holds; later ones are added
    in place into it; one with other strides than the parameter's is copied, so an optimizer
    sees the parameter's layout either way."""
    layer = nn.Linear(4, 3)
    first, second = torch.randn(3, 4), torch.randn(3, 4)
    want = first + second
    gpu.accumulate_fresh(layer, weight=first, bias=None)
    assert layer.weight.grad is not None and layer.weight.grad.data_ptr() == first.data_ptr()
    assert layer.bias.grad is None
    gpu.accumulate_fresh(layer, weight=second)
    assert layer.weight.grad.data_ptr() == first.data_ptr()  # added in place
    assert torch.equal(layer.weight.grad, want) and not layer.weight.grad.requires_grad
    other = nn.Linear(4, 3)
    strided = torch.randn(4, 3).t()  # the parameter's shape, not its strides
    gpu.accumulate_fresh(other, weight=strided)
    assert other.weight.grad.data_ptr() != strided.data_ptr()
    assert other.weight.grad.stride() == other.weight.stride()
    assert torch.equal(other.weight.grad, strided)
    wrong_dtype = torch.randn(3, 4, dtype=torch.float64)
    gpu.accumulate_fresh(nn.Linear(4, 3), weight=wrong_dtype)  # copied into float32


def test_the_generator_hands_over_fresh_gradients_only_where_the_registry_says():
    """K.accumulate_fresh for ops whose parameter gradients are new tensors (linear here);
    K.accumulate, which copies, for a free parameter, whose gradient is the output gradient
    itself when nothing was broadcast (add_backward hands back g for both operands)."""
    from unroller.api import generate_from_text

    source = (
        "model m {\n"
        "    input x: f32[N, 4]\n"
        "    target y: f32[N, 3]\n"
        "    fc = linear(x, out_features=3)\n"
        "    shift = parameter(shape=(3,))\n"
        "    out = add(fc, shift)\n"
        "    loss = mse_loss(out, y)\n"
        "    return loss\n"
        "}\n"
    )
    code = generate_from_text(source)
    assert 'K.accumulate_fresh(L["fc"], weight=grad_weight, bias=grad_bias)' in code
    assert 'K.accumulate(L[""], shift=' in code


def test_accumulate_refuses_a_missing_parameter():
    with pytest.raises(ValueError, match="bias"):
        gpu.accumulate(nn.Linear(2, 2, bias=False), bias=torch.zeros(2))


def test_collect_by_state_dict_name():
    root = _build()
    L = common.layers(root)
    grads: dict[str, torch.Tensor] = {}
    w = torch.ones(3, 2)
    common.collect(grads, L, "layer1.0.conv1", weight=w, bias=None)
    common.collect(grads, L.within("class"), "predict", weight=w)
    assert list(grads) == ["layer1.0.conv1.weight", "class.predict.weight"]
    assert grads["layer1.0.conv1.weight"] is w
    assert set(grads) <= set(root.state_dict())


TRICKY_PATHS = [
    "layer1.0.conv1",
    "layer1.0.bn1",
    "forward.training.double",
    "class.predict",
    "0.1",
    "double",
    "lambda",
]


def _build() -> nn.Module:
    root = nn.Module()
    for path in TRICKY_PATHS:
        common.add_layer(root, path, nn.BatchNorm2d(2) if path.endswith("bn1") else nn.Linear(2, 3))
    return root


def test_add_layer_tricky_names():
    root = _build()
    keys = set(root.state_dict())
    for path in TRICKY_PATHS:
        names = ["running_mean", "num_batches_tracked"] if path.endswith("bn1") else ["bias"]
        assert {f"{path}.weight"} | {f"{path}.{n}" for n in names} <= keys
    assert callable(root.forward) and callable(root.double)  # methods are not shadowed
    other = _build()
    for t in other.state_dict().values():
        if t.is_floating_point():
            t.zero_()
    other.load_state_dict(root.state_dict(), strict=True)
    for k, v in root.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
    with pytest.raises(ValueError):
        common.add_layer(root, "a..b", nn.Linear(1, 1))


def test_layers_by_dotted_name():
    """Every submodule under its dotted name (containers too, the root under "": it holds
    top-level free parameters), the live module itself, which follows .double() (it changes
    the tensors, not the modules)."""
    root = _build()
    L = common.layers(root)
    assert set(TRICKY_PATHS) <= set(L) and L[""] is root
    assert {"layer1", "layer1.0", "class", "0"} <= set(L)
    assert L["class.predict"] is root._modules["class"]._modules["predict"]
    root.double()
    again = common.layers(root)
    assert again["layer1.0.bn1"].running_mean.dtype == torch.float64
    assert again["lambda"].weight is root._modules["lambda"].weight
    x = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(gpu.linear(x, again["double"]), root._modules["double"](x))
    view = again.within("layer1.0")
    assert view["conv1"] is again["layer1.0.conv1"] and view.path("bn1") == "layer1.0.bn1"
    assert view[""] is again["layer1.0"] and view.path("") == "layer1.0"
    assert again.within("")["layer1"] is again["layer1"]


def test_free_parameters_join_their_holder_and_survive_a_later_layer():
    """add_layer with a Parameter registers it on the parent path; a layer added later at
    that parent path takes over what the placeholder container held."""
    root = nn.Module()
    common.add_layer(root, "class_token", nn.Parameter(torch.zeros(1, 1, 4)))
    common.add_layer(root, "enc.pos", nn.Parameter(torch.ones(3)))
    common.add_layer(root, "enc", nn.Linear(2, 2))
    assert list(root.state_dict()) == ["class_token", "enc.weight", "enc.bias", "enc.pos"]
    grads: dict = {}
    common.collect(grads, common.layers(root), "", class_token=torch.ones(1, 1, 4))
    common.collect(grads, common.layers(root).within("enc"), "", pos=torch.ones(3))
    assert set(grads) == {"class_token", "enc.pos"}


def test_layers_lists_shared_modules_under_every_name():
    root = nn.Module()
    shared = nn.Linear(2, 2)
    common.add_layer(root, "a", shared)
    common.add_layer(root, "b.c", shared)
    L = common.layers(root)
    assert L["a"] is shared and L["b.c"] is shared


def test_tensors_after_double():
    root = _build()
    before = common.tensors(root)
    assert set(before) == set(root.state_dict())
    root.double()
    after = common.tensors(root)
    assert all(t.dtype == torch.float64 for k, t in after.items() if "num_batches" not in k)
    assert after["layer1.0.bn1.running_mean"] is root.layer1._modules["0"].bn1.running_mean
    assert after["class.predict.weight"] is root._modules["class"].predict.weight
    assert isinstance(after["class.predict.weight"], nn.Parameter)
