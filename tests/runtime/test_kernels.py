"""Kernels of every platform against torch: the OpInfo table (tests/opinfo.py) x platforms.

For each operator row, sample and dtype, on ``gpu`` and ``ipu``: the forward equals the
torch reference (bit for bit where the row says so, else to rel. error 1e-12 in float64 /
1e-6 in float32), buffers are updated as torch.nn updates them, each extra is None exactly
when the registry's ``when`` says so, and the backward equals torch.autograd (1e-10 relative
in float64, 1e-5 in float32; bit for bit where the row says so) for every ``needs``
pattern, with None wherever a gradient is not needed. Eval kernels equal the module in eval
mode and change nothing; a backward fed a mask kernel's 1-bit mask equals one fed the tensor,
bit for bit. What the registry says drives the calls (inputs, layer handle, saved entries,
extras, masks), so these tests also check that the kernels follow the registry.

The ipu section at the end keeps what only the ipu kernels promise: only operations PopTorch
runs (at the source, at the dispatcher, and through ``unroll lint``), ``unsupported``, the
documented NaN difference of maxpool2d, gelu's erf-free accuracy, dropout's own stream.
Tests run on the CPU (gpu also on CUDA when available).
"""

from __future__ import annotations

import ast
import copy
import io
import math
import re
import tokenize
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from opinfo import BY_NAME, F32, F64, ROWS, Case, Ctx, OpInfo, Sample, normalized_defaults, rel
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from unroller.compiler.registry import OpSpec, eval_expr, load_registry
from unroller.runtime import (
    attention,
    common,
    derived,
    gpu,
    ipu,
    norms,
    positions,
    precision,
    recurrent,
    shapeops,
    shared,
)

OPS = load_registry()
KERNELS = {"gpu": gpu, "ipu": ipu}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {F64: (1e-12, 1e-10), F32: (1e-6, 1e-5)}  # (forward, backward) relative errors
# a cast to a low dtype (the forward is exact: the same op as torch; its rounding is the dtype's)
TOL[torch.bfloat16], TOL[torch.float16] = (2**-8, 2**-8), (2**-11, 2**-11)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The samples are tiny: torch's intra-op threads would only contend with each other and
    with other processes (three times the wall time on two busy cores). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_every_registry_operator_has_a_row():
    assert set(BY_NAME) == set(OPS)


# ---------------------------------------------------------------- the harness


class AtenCalls(TorchDispatchMode):
    """Records the aten ops (and their args) called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket.__name__), args))
        return func(*args, **(kwargs or {}))

    @property
    def names(self) -> set[str]:
        return {name for name, _ in self.calls}


def _ids(platform: str, row: OpInfo, case: Case, dtype: torch.dtype) -> str:
    return f"{platform}-{row.name}-{case.label}-{str(dtype).removeprefix('torch.')}"


def _params(rows: list[OpInfo], platforms: tuple[str, ...] = ("gpu", "ipu")) -> list:
    return [
        pytest.param(platform, row, case, dtype, id=_ids(platform, row, case, dtype))
        for platform in platforms
        for row in rows
        for case in row.cases
        for dtype in case.dtypes
    ]


def _env(op: OpSpec, s: Sample) -> dict[str, Any]:
    """What registry expressions (``when``) see: every argument's value, defaults included."""
    return {**normalized_defaults(op), **s.kwargs, **s.derived}


def _backward_kwargs(op: OpSpec, s: Sample) -> dict[str, Any]:
    return {k: v for k, v in {**s.kwargs, **s.derived}.items() if k in op.backward_args}


def _differentiable(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad


def _layer_params(op: OpSpec, s: Sample) -> list[Tensor | None]:
    """The layer's parameters in registry order (a free parameter: the one its ``name``
    keyword names), None where absent."""
    if op.free:
        return [getattr(s.layer, s.kwargs["name"])]
    return [_param(s.layer, p.name) for p in op.params]


def _param(layer: nn.Module | None, name: str) -> Tensor | None:
    """The layer's parameter by its registry name, a dotted one (``out_proj.weight``)
    through the submodules; None where it is absent."""
    for part in name.split("."):
        layer = getattr(layer, part, None)
    return layer


def _slots(op: OpSpec, s: Sample) -> tuple[bool, ...]:
    """Which gradients exist: one per input (float leaves), then one per present parameter."""
    params = [p is not None for p in _layer_params(op, s)]
    return tuple(_differentiable(t) for t in s.inputs) + tuple(params)


class Run:
    """One sample through one platform's kernels, with the torch reference beside it."""

    def __init__(self, platform: str, row: OpInfo, s: Sample, device: str = "cpu") -> None:
        self.platform, self.row, self.s, self.device = platform, row, s, device
        self.op, self.K = OPS[row.name], KERNELS[platform]
        self.layer = copy.deepcopy(s.layer)  # the kernels' own, before the reference runs
        self.calls = AtenCalls()  # what the kernels (not the reference) ran

    def forward(self) -> tuple[Tensor, tuple]:
        args = [*self.s.inputs, *([self.layer] if self.layer is not None else [])]
        torch.manual_seed(self.s.seed)
        with torch.no_grad(), self.calls:
            out = getattr(self.K, self.op.name)(*args, **self.s.kwargs)
        if not self.op.extras:
            return out, ()
        return out[0], tuple(out[1:])

    def saved(self, y: Tensor, extras: tuple) -> list[tuple[str, Any]]:
        """(entry, value) in the backward's positional order: the registry's ``saved`` with
        its parameter entries replaced by the layer, at the first one's place."""
        names = self.op.input_names(len(self.s.inputs))
        params = {p.name for p in self.op.params}
        extra_names = [e.name for e in self.op.extras]
        out: list[tuple[str, Any]] = []
        for entry in self.op.saved:
            if entry in params:
                if not any(name == "layer" for name, _ in out):
                    out.append(("layer", self.layer))
            elif entry == "output":
                out.append((entry, y))
            elif entry in extra_names:
                out.append((entry, extras[extra_names.index(entry)]))
            elif entry in names:
                out.append((entry, self.s.inputs[names.index(entry)]))
            else:  # an optional input the call leaves out
                out.append((entry, None))
        return out

    def backward(self, g: Tensor, saved: list[tuple[str, Any]], needs: tuple) -> tuple:
        kernel = getattr(self.K, f"{self.op.name}_backward")
        with torch.no_grad(), self.calls:
            return kernel(
                g, *(v for _, v in saved), **_backward_kwargs(self.op, self.s), needs=needs
            )

    def reference(self, extras: tuple) -> Tensor:
        return self.row.reference(self.s, Ctx(self.platform, extras))

    def unsupported(self) -> str | None:
        return self.K.unsupported(self.op.name, _env(self.op, self.s))


def _sample(case: Case, dtype: torch.dtype, device: str = "cpu") -> Sample:
    s = case.make(dtype)
    if device != "cpu":
        s.inputs = tuple(_to(t, device) for t in s.inputs)
        s.layer = s.layer.to(device) if s.layer is not None else None
    return s


def _to(t: Tensor, device: str) -> Tensor:
    moved = t.detach().to(device)
    return moved.requires_grad_() if t.requires_grad else moved


def _output_grad(ref: Tensor) -> Tensor:
    """1.7 for a loss (as a later scale), a seeded random tensor otherwise."""
    if ref.dim() == 0:
        return torch.tensor(1.7, dtype=ref.dtype, device=ref.device)
    torch.manual_seed(99)
    return torch.randn_like(ref)


def _reference_grads(run: Run, ref: Tensor, g: Tensor) -> list[Tensor | None]:
    """torch.autograd's gradient for each slot (None where the slot has none)."""
    slots = [*run.s.inputs, *_layer_params(run.op, run.s)]
    leaves = [t for t in slots if _differentiable(t)]
    grads = iter(torch.autograd.grad(ref, leaves, g))
    return [next(grads) if _differentiable(t) else None for t in slots]


def _exact(platforms: tuple[str, ...], run: Run) -> bool:
    return run.platform in platforms and run.device == "cpu"


def assert_close(ours: Tensor, ref: Tensor, tol: float, exact: bool, what: str) -> None:
    """Bit for bit when exact; else rel. error <= tol on the finite part, and the same
    infinities (bce's target gradient is infinite at probabilities 0 and 1)."""
    ref = ref.detach()
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, what
    if exact:
        assert _bit_equal(ours, ref), f"{what}: not bit-identical"
        return
    finite = torch.isfinite(ref)
    if not finite.all():
        assert _bit_equal(ours[~finite], ref[~finite]), f"{what}: non-finite values differ"
        ours, ref = ours[finite], ref[finite]
    assert rel(ours, ref) <= tol, f"{what}: rel error {rel(ours, ref)}"


def _bit_equal(a: Tensor, b: Tensor) -> bool:
    """torch.equal, with NaN equal to NaN at the same places (a loss over no element)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def assert_grads(ours: tuple, refs: list, needs: tuple, tol: float, exact: bool) -> None:
    assert isinstance(ours, tuple) and len(ours) == len(needs), (ours, needs)
    for i, (o, r, n) in enumerate(zip(ours, refs, needs)):
        if not n:
            assert o is None, f"gradient {i} computed but not needed"
            continue
        assert o is not None, f"gradient {i} missing"
        assert_close(o, r, tol, exact, f"gradient {i}")


def _needs_variants(slots: tuple[bool, ...]) -> list[tuple[bool, ...]]:
    """All that exist, each one alone, and none."""
    singles = [tuple(j == i for j in range(len(slots))) for i, ok in enumerate(slots) if ok]
    return [slots, *singles, (False,) * len(slots)]


# ---------------------------------------------------------------- forward and backward


def _check_forward(run: Run, y: Tensor, extras: tuple, ref: Tensor) -> None:
    if not ref.is_floating_point():  # integers (padded_positions): equal, nothing else
        assert y.dtype == ref.dtype and torch.equal(y, ref), "forward"
        return
    fwd_tol = TOL[ref.dtype][0]
    exact = run.s.exact_forward if run.s.exact_forward is not None else run.row.exact_forward
    assert_close(y, ref, fwd_tol, _exact(exact, run), "forward")
    env = _env(run.op, run.s)
    for spec, value in zip(run.op.extras, extras):
        if spec.when is not None and not eval_expr(spec.when, env):
            assert value is None, f"extra {spec.name} exists though {spec.when!r} is false"
    if run.row.check_extras is not None:
        run.row.check_extras(run.platform, run.s, y, extras)
    _check_buffers(run, fwd_tol)


def _check_buffers(run: Run, tol: float) -> None:
    """The layer's buffers, updated in place, equal the reference module's after its step
    (bit for bit for the gpu kernels on the CPU)."""
    for spec in run.op.buffers:
        ours, ref = getattr(run.layer, spec.name, None), getattr(run.s.layer, spec.name, None)
        if ref is None:
            assert ours is None
        elif not ref.is_floating_point():
            assert torch.equal(ours, ref), spec.name
        else:
            assert_close(ours, ref, tol, _exact(("gpu",), run), spec.name)


def _check_backward(run: Run, g: Tensor, saved: list, refs: list) -> None:
    tol = TOL[g.dtype][1]
    exact = _exact(run.row.exact_grads, run)
    slots = _slots(run.op, run.s)
    limited = run.unsupported() is not None and run.row.ipu_unsupported == "input_grad"
    first = None
    for needs in _needs_variants(slots):
        if limited and needs[0]:
            with pytest.raises(NotImplementedError, match="dilation"):
                run.backward(g, saved, needs)
            continue
        grads = run.backward(g, saved, needs)
        assert_grads(grads, refs, needs, tol, exact)
        if run.row.contiguous_grads and needs[0]:
            assert grads[0].is_contiguous()
        first = first if first is not None else grads  # fewer needs must not change any
        assert all(torch.equal(a, b) for a, b in zip(grads, first) if None not in (a, b))
    if run.op.params:  # layer kernels fit their gradients to needs, even an empty one
        assert run.backward(g, saved, ()) == ()
    if all(slots) and not limited:  # needs=None (generated code leaves it out) is all of them
        every = run.backward(g, saved, None)
        assert len(every) == len(slots)
        assert all(torch.equal(a, b) for a, b in zip(every, run.backward(g, saved, slots)))
    if run.op.fresh_param_grads and not limited:
        _assert_fresh_param_grads(run, g, saved, run.backward(g, saved, slots))


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _assert_fresh_param_grads(run: Run, g: Tensor, saved: list, grads: tuple) -> None:
    """The registry's ``fresh_param_grads``: every parameter gradient is a tensor of its own
    (``K.accumulate_fresh`` makes it the parameter's .grad as it is), sharing memory with no
    other gradient, the output gradient, an input, a saved value or a parameter."""
    count = sum(p is not None for p in _layer_params(run.op, run.s))
    params = [t for t in grads[len(grads) - count :] if t is not None]
    others = [g, *run.s.inputs, *(v for _, v in saved if isinstance(v, Tensor))]
    others += [t for t in grads[: len(grads) - count] if t is not None]
    others += list(run.layer.parameters()) if run.layer is not None else []
    taken = {_storage(t) for t in others if isinstance(t, Tensor)}
    for grad in params:
        assert _storage(grad) not in taken, "a parameter gradient shares memory with another value"
        taken.add(_storage(grad))


def _forward_or_reference(run: Run) -> tuple[Tensor, tuple, Tensor, bool]:
    """The kernel's forward and the reference; where ipu refuses the forward (attention with
    dropout), the refusal is checked and the reference stands in for the output."""
    if run.unsupported() is not None and run.row.ipu_unsupported == "forward":
        with pytest.raises(NotImplementedError) as refused:
            run.forward()
        assert str(refused.value) == run.unsupported()
        ref = run.reference(())
        return ref.detach(), (), ref, False
    y, extras = run.forward()
    return y, extras, run.reference(extras), True


def _forward_backward(platform: str, row: OpInfo, case: Case, dtype, device: str) -> None:
    run = Run(platform, row, _sample(case, dtype, device), device)
    y, extras, ref, ran = _forward_or_reference(run)
    if ran:
        _check_forward(run, y, extras, ref)
    elif run.op.extras:  # its backward reads what the refused forward would have made
        return
    if not ref.is_floating_point() or not ref.requires_grad:
        return  # an integer output, or one made from integers only (padding_mask): no gradient
    g = _output_grad(ref)
    refs = _reference_grads(run, ref, g)
    _check_backward(run, g, run.saved(y, extras), refs)
    if platform == "ipu":
        _assert_only_ipu_aten_ops(run.calls.names)


@pytest.mark.parametrize("platform,row,case,dtype", _params(list(ROWS)))
def test_forward_backward(platform, row, case, dtype):
    _forward_backward(platform, row, case, dtype, "cpu")


@pytest.mark.parametrize(
    "platform,row,case,dtype", _params(list(ROWS), ("gpu",)) if "cuda" in DEVICES else []
)
def test_forward_backward_cuda(platform, row, case, dtype):
    """The gpu kernels on CUDA (collected only where CUDA is available): within tolerance,
    since cuDNN / cuBLAS round differently from the CPU kernels torch's reference ran."""
    _forward_backward(platform, row, case, dtype, "cuda")


# ---------------------------------------------------------------- eval and mask kernels


@pytest.mark.parametrize(
    "platform,row,case,dtype", _params([r for r in ROWS if OPS[r.name].has_eval])
)
def test_eval(platform, row, case, dtype):
    """OP_eval equals the torch module in eval mode and leaves every buffer as it was."""
    run = Run(platform, row, _sample(case, dtype))
    layer_args = [run.layer] if run.layer is not None else []
    before = {k: v.clone() for k, v in (run.layer.state_dict() if run.layer else {}).items()}
    with torch.no_grad():
        y = getattr(run.K, f"{row.name}_eval")(*run.s.inputs, *layer_args, **run.s.kwargs)
    ref = row.eval_reference(run.s)
    assert_close(y, ref, TOL[dtype][0], False, "eval")
    for key, value in before.items():
        assert torch.equal(run.layer.state_dict()[key], value), key


def _mask_applies(op: OpSpec, s: Sample) -> bool:
    """Whether the registry lets any saved entry of this call be kept as a mask: the mask's
    ``when`` holds, and so does the ``when`` of the extra it replaces (dropout's keep-mask
    exists only for 0 < p < 1)."""
    env = _env(op, s)
    extras = {e.name: e for e in op.extras}

    def holds(expr: str | None) -> bool:
        return expr is None or bool(eval_expr(expr, env))

    return any(
        holds(m.when) and holds(extras[m.entry].when if m.entry in extras else None)
        for m in op.masks.values()
    )


def _mask_params() -> list:
    """The mask rows' cases where a mask applies (the others keep nothing to test)."""
    rows = [
        replace(row, cases=tuple(c for c in row.cases if _mask_applies(OPS[row.name], c.make(F64))))
        for row in ROWS
        if OPS[row.name].masks
    ]
    return _params(rows)


def _mask_of(run: Run, spec, value: Tensor) -> Tensor:
    if spec.kernel is None:
        return value
    with torch.no_grad():
        return getattr(run.K, spec.kernel)(value, **_backward_kwargs(run.op, run.s))


@pytest.mark.parametrize("platform,row,case,dtype", _mask_params())
def test_masks(platform, row, case, dtype):
    """Where the registry allows a mask (``when``), it is bool, shaped like its ``like`` (or
    the entry), and the backward fed it equals the backward fed the tensor, bit for bit;
    both platforms' mask kernels make the same mask."""
    run = Run(platform, row, _sample(case, dtype))
    y, extras = run.forward()
    saved = run.saved(y, extras)
    g = _output_grad(y)
    needs = _slots(run.op, run.s)
    want = run.backward(g, saved, needs)
    names = run.op.input_names(len(run.s.inputs))
    for entry, spec in run.op.masks.items():
        if spec.when is not None and not eval_expr(spec.when, _env(run.op, run.s)):
            continue
        i = [name for name, _ in saved].index(entry)
        if saved[i][1] is None:  # dropout at p = 0 or 1 keeps nothing
            continue
        mask = _mask_of(run, spec, saved[i][1])
        like = run.s.inputs[names.index(spec.like)] if spec.like else saved[i][1]
        assert mask.dtype == torch.bool and mask.shape == like.shape
        got = run.backward(g, [*saved[:i], (entry, mask), *saved[i + 1 :]], needs)
        assert [a is None for a in got] == [b is None for b in want], entry
        assert all(torch.equal(a, b) for a, b in zip(got, want) if b is not None), entry
        if spec.kernel and row.check_mask is not None:
            row.check_mask(run.s, mask, y)
        if spec.kernel and platform == "ipu":
            assert torch.equal(mask, _gpu_mask(row, case, dtype, entry))


def _gpu_mask(row: OpInfo, case: Case, dtype: torch.dtype, entry: str) -> Tensor:
    run = Run("gpu", row, _sample(case, dtype))
    y, extras = run.forward()
    value = dict(run.saved(y, extras))[entry]
    return _mask_of(run, run.op.masks[entry], value)


# ---------------------------------------------------------------- checks beyond the table


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_mul_same_tensor(platform):
    """a * a: both gradients, added, are autograd's (out of place, so a may be b)."""
    K = KERNELS[platform]
    a = torch.randn(3, 4, dtype=F64, requires_grad=True)
    ref = a * a
    g = torch.randn_like(ref)
    (ref_ga,) = torch.autograd.grad(ref, [a], g)
    with torch.no_grad():
        y = K.mul(a, a)
        ga, gb = K.mul_backward(g, a, a, needs=(True, True))
    assert torch.equal(y, ref.detach())
    assert rel(ga + gb, ref_ga) <= 1e-10


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_mse_loss_then_tanh_sharing_an_input(platform):
    """mse_loss(a, tanh(a)): the gradients through both arguments add up to autograd's."""
    K = KERNELS[platform]
    a = torch.randn(3, 4, dtype=F64, requires_grad=True)
    b = torch.tanh(a)
    g = torch.tensor(1.3, dtype=F64)
    (ref_ga,) = torch.autograd.grad(F.mse_loss(a, b), [a], g)
    with torch.no_grad():
        ga, gb = K.mse_loss_backward(g, a, b, needs=(True, True))
        (ga_tanh,) = K.tanh_backward(gb, b, needs=(True,))
    assert rel(ga + ga_tanh, ref_ga) <= 1e-10


def _conv_layer() -> tuple[nn.Conv2d, Tensor, Tensor, tuple]:
    torch.manual_seed(0)
    m = nn.Conv2d(3, 4, 3, padding=1).to(F64)
    x = torch.randn(2, 3, 5, 5, dtype=F64, requires_grad=True)
    out = m(x)
    g = torch.randn_like(out)
    return m, x, g, torch.autograd.grad(out, [x, m.weight, m.bias], g)


NEEDS = [(False, True, False), (True, False, False), (False, False, True), (False,) * 3]


@pytest.mark.parametrize("needs", NEEDS + [(True, True, True)])
def test_gpu_conv_backward_asks_aten_for_what_is_needed(needs):
    """The output_mask of aten::convolution_backward is ``needs``; none at all: no call."""
    m, x, g, ref_grads = _conv_layer()
    with torch.no_grad(), AtenCalls() as calls:
        grads = gpu.conv2d_backward(g, x, m, padding=(1, 1), needs=needs)
    assert_grads(grads, list(ref_grads), needs, 1e-10, False)
    masks = [list(a[-1]) for name, a in calls.calls if name == "convolution_backward"]
    assert masks == ([list(needs)] if any(needs) else [])


@pytest.mark.parametrize("needs,convs", list(zip(NEEDS + [(True, True, True)], [1, 1, 0, 0, 2])))
def test_ipu_conv_backward_runs_one_convolution_per_needed_gradient(needs, convs):
    m, x, g, ref_grads = _conv_layer()
    with torch.no_grad(), AtenCalls() as calls:
        grads = ipu.conv2d_backward(g, x, m, padding=(1, 1), needs=needs)
    assert_grads(grads, list(ref_grads), needs, 1e-10, False)
    assert [name for name, _ in calls.calls].count("convolution") == convs


@pytest.mark.parametrize("platform", ["gpu", "ipu"])
def test_layer_handle_is_any_object_with_the_registry_names(platform):
    """Kernels read the layer's attributes only: a plain namespace works, bias may be absent."""
    K = KERNELS[platform]
    from types import SimpleNamespace

    torch.manual_seed(0)
    m = nn.Conv2d(3, 4, 3, bias=False).to(F64)
    x = torch.randn(2, 3, 5, 5, dtype=F64)
    handle = SimpleNamespace(weight=m.weight.detach())
    with torch.no_grad():
        assert torch.equal(K.conv2d(x, handle), K.conv2d(x, m))
        lin = SimpleNamespace(weight=torch.randn(2, 5, dtype=F64), bias=None)
        assert torch.equal(K.linear(x, lin), x @ lin.weight.t())


# ---------------------------------------------------------------- ipu only


def test_ipu_unsupported():
    """Dilated convolutions run on the ipu platform (their transposed convolutions are plain
    conv2d there); attention dropout, stochastic depth with p > 0 and a mixture of experts
    (data-dependent row counts) are refused."""
    for name in ("conv2d", "conv_transpose2d", "conv1d"):
        for dilation in ((1, 2), 2, [1, 1], (3, 3)):
            assert ipu.unsupported(name, {"dilation": dilation, "stride": 2}) is None
    assert "dropout" in ipu.unsupported("scaled_dot_product_attention", {"dropout": 0.1})
    assert "needs torch.autograd" in ipu.unsupported("aten", {"op": "aten.exp.default"})
    assert "PopTorch" in ipu.unsupported("drop_path", {"p": 0.1})
    assert ipu.unsupported("drop_path", {"p": 0.0}) is None
    assert "data-dependent sizes" in ipu.unsupported("moe", {})
    for name in OPS:  # refused whatever its args
        assert ipu.unsupported(name, {}) is None or name in ("aten", "moe")
        assert gpu.unsupported(name, {"dilation": (2, 2)}) is None


def _gelu_points() -> Tensor:
    edges = [0.0, 1e-300, -1e-300, 1e-20, -1e-8, 0.0999999999, 0.1, -0.1, 0.1000000001]
    edges += [-0.7518, -5.0, -8.0, -10.0, -20.0, -40.0, 40.0]
    torch.manual_seed(0)
    return torch.cat(
        [
            torch.linspace(-40, 40, 8001, dtype=F64),
            torch.linspace(-0.2, 0.2, 2001, dtype=F64),
            torch.tensor(edges, dtype=F64),
            3 * torch.randn(4000, dtype=F64),
        ]
    )


def test_ipu_gelu_exact_gradient_accuracy():
    """gelu(approximate="none") without erf: Phi(x) = gelu(x)/x for |x| >= 0.1, a Taylor
    series below. Against autograd in float64: norm-relative error <= 1e-14 (measured ~6e-17),
    and per element |ours - ref| <= 4e-15 * |g| * (|Phi(x)| + |x phi(x)|) (measured ~5e-16),
    over [-40, 40] including 0, +-1e-300 and both sides of the 0.1 switch."""
    x = _gelu_points()
    xr = x.clone().requires_grad_()
    g = torch.randn_like(x)
    (ref,) = torch.autograd.grad(F.gelu(xr), xr, g)
    with torch.no_grad():
        (ours,) = ipu.gelu_backward(g, x, needs=(True,))
    assert torch.isfinite(ours).all()
    assert rel(ours, ref) <= 1e-14
    cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2))
    size = g.abs() * (cdf + (x * torch.exp(-x * x / 2)).abs() / math.sqrt(2 * math.pi))
    assert ((ours - ref).abs() <= 4e-15 * size).all()


def test_ipu_gelu_series_branch_is_exact_to_rounding():
    """Near 0 (|x| < 0.1) Phi comes from its series: relative error <= 1e-15 against erfc."""
    x = torch.cat(
        [torch.linspace(-0.1, 0.1, 4001, dtype=F64), torch.tensor([0.0, 1e-300], dtype=F64)]
    )
    phi = ipu._std_normal_cdf(x)
    exact = 0.5 * torch.special.erfc(-x / math.sqrt(2))
    assert ((phi - exact).abs() / exact).max().item() <= 1e-15


def test_ipu_maxpool2d_nan_window_is_the_one_documented_difference():
    """A window whose maximum is NaN: PyTorch routes its gradient to the window's last NaN; the
    ipu kernel selects nothing there (NaN equals nothing), so that window's gradient is 0.
    Every other window is unaffected."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4, dtype=F64)
    x[0, 0, 0, 0] = x[0, 0, 1, 1] = math.nan
    xr = x.clone().requires_grad_()
    out = F.max_pool2d(xr, 2, 2)
    g = torch.randn_like(out)
    (ref,) = torch.autograd.grad(out, [xr], g)
    kw = dict(kernel_size=(2, 2), stride=(2, 2))
    with torch.no_grad():
        _, sel = ipu.maxpool2d(x, **kw)
        (ours,) = ipu.maxpool2d_backward(g, sel, **kw, input_hw=(4, 4), needs=(True,))
    assert not sel[0, 0, :, 0, 0].any() and ref[0, 0, 1, 1] == g[0, 0, 0, 0]
    assert ours[0, 0, :2, :2].eq(0).all()
    assert torch.equal(ours[0, 0, 2:], ref[0, 0, 2:])
    assert torch.equal(ours[0, 0, :, 2:], ref[0, 0, :, 2:])
    assert torch.equal(ours[0, 1], ref[0, 1])


def test_ipu_maxpool2d_backward_refuses_indices():
    """ipu keeps no pooling indices: an int64 tensor in their place is a caller's bug."""
    g = torch.randn(1, 1, 2, 2)
    idx = torch.zeros(1, 1, 2, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="bool selection"):
        ipu.maxpool2d_backward(
            g, idx, kernel_size=(2, 2), stride=(2, 2), input_hw=(4, 4), needs=(True,)
        )


@pytest.mark.parametrize("p", [0.3, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(4, 500), (2, 3, 50, 40)])
def test_ipu_dropout_draws(p, shape):
    """The draws differ from the gpu kernel's (torch.rand, not bernoulli_): the kept share is
    1 - p within 5 standard deviations, and a seed repeats them."""
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=F64)
    _, mask = ipu.dropout(x, p=p)
    kept = mask.double().mean().item()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / x.numel())
    torch.manual_seed(5)
    _, m1 = ipu.dropout(x, p=p)
    torch.manual_seed(5)
    _, m2 = ipu.dropout(x, p=p)
    assert torch.equal(m1, m2)


def test_ipu_constants_cached_on_eager_devices_only():
    """Interpolation matrices and kernel banks depend only on static sizes: cached on CPU and
    CUDA, rebuilt per call elsewhere (a traced IPU graph must not reuse another's tensors)."""
    built = []

    def build() -> Tensor:
        built.append(1)
        return torch.zeros(2)

    key = ("test", len(ipu._CACHE))
    first = ipu._constant(key, torch.device("cpu"), build)
    assert ipu._constant(key, torch.device("cpu"), build) is first and len(built) == 1
    ipu._constant(key, torch.device("meta"), build)
    ipu._constant(key, torch.device("meta"), build)
    assert len(built) == 3
    a = ipu._adaptive_matrix(3, 7, F64, torch.device("cpu"))
    assert ipu._adaptive_matrix(3, 7, F64, torch.device("cpu")) is a


# The calls ipu's kernels may make, each on PopTorch's list of supported operations
# (the PopTorch reference of the project's spec), or a view / cast / metadata query.
TORCH_CALLS = {
    "arange", "ones", "ones_like", "zeros", "full", "rand",  # creation, random
    "cat", "stack", "split", "gather", "where",  # indexing, joining
    "relu", "sigmoid", "tanh", "exp", "log", "log1p", "rsqrt", "sign", "clamp", "floor",
    "floor_divide", "logical_and", "matmul", "flatten",
}  # fmt: skip
F_CALLS = {
    "conv2d", "conv_transpose2d", "linear", "gelu", "leaky_relu", "max_pool2d", "avg_pool2d",
    "pad", "log_softmax", "softmax",
}  # fmt: skip
TENSOR_METHODS = {
    "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",  # views
    "to",  # dtype casts
    "sum", "mean", "square", "abs", "neg", "reciprocal", "matmul", "add_", "mul_",
    "new_zeros", "dim", "numel",
    "narrow",  # a constant-bound slice (a view)
    "contiguous",  # layout only (a ceil-mode pool's cropped gradient)
    "index_select",  # on the indexing list: a dilated convolution's flipped kernel
}  # fmt: skip
# v2 activations, losses and embedding (all on PopTorch's list)
TORCH_CALLS |= {"reciprocal", "scatter_add"}
TORCH_CALLS |= {"addmm"}  # transposed_linear (Hugging Face's Conv1D); PopTorch's BLAS list
F_CALLS |= {"hardtanh", "silu", "elu", "softplus", "embedding"}
# block-by-block attention (unroller/runtime/attention.py): amax is on the pointwise list,
# masked_fill on the indexing list; the in-place forms of listed ops write a block's tile
TENSOR_METHODS |= {"amax", "masked_fill_", "sub_", "exp_", "div_", "is_contiguous"}
TENSOR_METHODS |= {"masked_fill"}  # causal_mask (eager attention's mask): the indexing list
# rmsnorm (unroller/runtime/norms.py) and rotary (positions.py): on the pointwise list;
# finfo is a dtype's constant (eps), read on the host
TENSOR_METHODS |= {"pow", "cos", "sin"}
TORCH_CALLS |= {"finfo"}
TORCH_CALLS |= {"cumsum"}  # padded_positions (RoBERTa's position ids); on the "Other" list
TORCH_CALLS |= {"pow"}  # alibi's slopes (positions.py): on the pointwise list
PYTHON_METHODS = {"get", "clear", "append", "items", "values", "insert"}
# relative_position_bias (positions.py): log of a size ratio, a constant made on the host
HOST_CALLS = {
    "math": {"sqrt", "floor", "factorial", "prod", "log", "log2"},  # log2: alibi's head count
    "struct": {"pack", "unpack"},
    "derived": {"install"},  # the namespace assembly at import: derived's kernels are scanned
}
FORBIDDEN_NAMES = {
    "ops", "aten", "autograd", "erf", "erfc", "erfinv", "special", "max_pool2d_with_indices",
    "return_indices", "interpolate", "upsample", "upsample_bilinear2d", "upsample_nearest2d",
    "unfold", "fold", "logit", "log_sigmoid", "grad", "backward", "Function", "flip",
    "scatter_", "index_put_", "nonzero", "masked_select", "repeat_interleave",
}  # fmt: skip
# What ipu takes from common but runs on the host, outside the traced graph's tensor math
# (module bookkeeping, input checks, stash accounting, __all__): not kernels.
HOST_HELPERS = {
    "add_layer", "layers", "tensors", "check_inputs", "collect", "stash", "stash_raw",
    "stash_report", "_exports", "free_parameter", "transposed_linear_layer", "tie", "freeze",
    "take", "within",
}  # fmt: skip


SHARED_KERNEL_MODULES = (
    "unroller.runtime.common",
    "unroller.runtime.shapeops",
    "unroller.runtime.attention",
    "unroller.runtime.norms",
    "unroller.runtime.positions",
    "unroller.runtime.precision",
    "unroller.runtime.recurrent",
)


def _ipu_kernel_code() -> list[ast.AST]:
    """ipu.py whole, and what it takes from the shared modules to compute with: the shared
    kernels it imports (by name, attention's included, or by its star import of shared)
    and, transitively, the functions of those modules they use (as ``unroll lint`` follows
    names imported from a module); the host helpers are left out."""
    ipu_tree = ast.parse(Path(ipu.__file__).read_text())
    own = {n.name for n in ipu_tree.body if isinstance(n, ast.FunctionDef)}
    todo = [
        alias.name
        for node in ast.walk(ipu_tree)
        if isinstance(node, ast.ImportFrom) and node.module in SHARED_KERNEL_MODULES
        for alias in node.names
        if alias.name not in HOST_HELPERS and alias.name != "*"
    ]
    # what its star import of shared binds, but the names it defines again itself
    todo += [name for name in shared.__all__ if name not in HOST_HELPERS | own]
    defs = {
        n.name: n
        for module in (common, shapeops, attention, norms, positions, precision, recurrent)
        for n in ast.parse(Path(module.__file__).read_text()).body
        if isinstance(n, ast.FunctionDef)
    }
    seen: dict[str, ast.FunctionDef] = {}
    while todo:
        name = todo.pop()
        if name in defs and name not in seen:
            seen[name] = defs[name]
            todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)]
    made = [  # the kernels derived makes from ipu's own, not how it adds them (host code)
        n
        for n in ast.parse(Path(derived.__file__).read_text()).body
        if isinstance(n, ast.FunctionDef) and n.name not in ("install", "kernels")
    ]
    return [ipu_tree, *seen.values(), *made]


def _call_allowed(node: ast.Call) -> bool:
    attr, base = node.func.attr, node.func.value
    if isinstance(base, ast.Name) and base.id == "torch":
        return attr in TORCH_CALLS
    if isinstance(base, ast.Name) and base.id == "F":
        return attr in F_CALLS
    if isinstance(base, ast.Name) and base.id in HOST_CALLS:
        return attr in HOST_CALLS[base.id]
    if isinstance(base, ast.Attribute):  # torch.nn.functional.x, torch.special.x, ...
        return ast.unparse(base) == "torch.nn.functional" and attr in F_CALLS
    return attr in TENSOR_METHODS | PYTHON_METHODS


def test_ipu_kernels_call_only_supported_operations():
    bad = [
        f"line {node.lineno}: {ast.unparse(node.func)}"
        for tree in _ipu_kernel_code()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and not _call_allowed(node)
    ]
    assert not bad, bad


def test_ipu_kernels_use_no_backward_kernels_or_forbidden_calls():
    """No aten backward kernels, autograd, pooling indices, bilinear interpolation or erf in
    the code (comments and docstrings, which explain what is avoided, are not code)."""
    used: set[str] = set()
    for tree in _ipu_kernel_code():
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
    assert not used & FORBIDDEN_NAMES, used & FORBIDDEN_NAMES
    text = "\n".join(ast.unparse(tree) for tree in _ipu_kernel_code())
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    code = " ".join(t.string for t in tokens if t.type not in (tokenize.STRING, tokenize.COMMENT))
    for pattern in [
        r"torch\s*\.\s*ops",
        r"\baten\b(?!\s*\()",  # the opaque op's refusing stubs are named aten
        r"\.\s*\w*_backward\w*\s*\(",
        r"max_pool2d_with_indices",
        r"interpolate",
        r"bilinear2d",
        r"erf",
        r"autograd",
    ]:
        assert not re.search(pattern, code), pattern


def _assert_only_ipu_aten_ops(names: set[str]) -> None:
    """At the dispatcher: no *_backward aten op, no bilinear, no erf ran."""
    bad = {n for n in names if "backward" in n or "erf" in n or "bilinear" in n}
    assert not bad, bad


def test_ipu_module_passes_unroll_lint(tmp_path):
    """What the lint sees of a generated ipu module: ipu.py and what it imports from common."""
    from unroller.lint import lint_module

    path = tmp_path / "model.py"
    path.write_text("import unroller.runtime.ipu as K\n")
    report = lint_module(path, "ipu")
    assert report.ok and not report.warnings, report.format()
