"""OpInfo-style table of the operators: one row per registry operator, for tests/runtime/test_kernels.py.

A row says how to check the kernels of one operator on every platform: the torch reference
of its forward (torch.nn modules / torch.nn.functional, differentiated by torch.autograd
for the gradients) and the sample inputs to run it on, each with the kernel keywords it
takes. Everything else the harness needs (which inputs and parameters get gradients, what
the backward reads, the mask kernels, the eval kernel) comes from the registry, so the
table holds only what the registry cannot know: what the operator means in torch, and the
inputs that exercise its edge cases (ties, ignored targets, probabilities at 0 and 1, ...).

Adding an operator: one ``OpInfo`` in ``ROWS`` (tests/runtime/test_kernels.py refuses a registry
operator without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroller.compiler.ast import Loc
from unroller.compiler.graph import normalize_arg
from unroller.compiler.registry import OpSpec
from unroller.runtime import common as runtime_common

F64, F32 = torch.float64, torch.float32
BOTH = (F64, F32)
PLATFORMS = ("gpu", "ipu")


@dataclass
class Sample:
    """One call of an operator: tensor inputs (the float ones are autograd leaves), the layer
    module of a parameterised op (the reference runs it; kernels get a copy), the kernel
    keywords (registry-normalised; omitted ones take the kernel defaults) and the values the
    shape rule derives for the backward (input_hw, sizes, input_shape)."""

    inputs: tuple[Tensor, ...]
    layer: nn.Module | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    derived: dict[str, Any] = field(default_factory=dict)
    #: platforms whose forward equals the reference bit for bit (None: the row's setting)
    exact_forward: tuple[str, ...] | None = None
    seed: int = 0  # torch's seed right before the kernel's forward (and a seeded reference)


@dataclass(frozen=True)
class Case:
    """A named sample builder; ``make(dtype)`` seeds torch itself, so samples repeat."""

    label: str
    make: Callable[[torch.dtype], Sample]
    dtypes: tuple[torch.dtype, ...] = BOTH


@dataclass(frozen=True)
class Ctx:
    """What a reference may need of the kernel run it is compared with."""

    platform: str
    extras: tuple[Any, ...]


Reference = Callable[[Sample, Ctx], Tensor]
ExtrasCheck = Callable[[str, Sample, Tensor, tuple[Any, ...]], None]


@dataclass(frozen=True)
class OpInfo:
    """How to check one operator's kernels; see the module docstring."""

    name: str
    reference: Reference
    cases: tuple[Case, ...]
    eval_reference: Callable[[Sample], Tensor] | None = None
    #: platforms whose forward equals the reference bit for bit on the CPU: gpu for every op
    #: (its kernels call the aten kernels torch calls), ipu where it calls the same op
    exact_forward: tuple[str, ...] = ("gpu",)
    #: platforms whose gradients equal torch.autograd's bit for bit on the CPU: gpu for every
    #: op (float32 and float64), ipu where its formula is autograd's
    exact_grads: tuple[str, ...] = ("gpu",)
    #: on ipu, what raises NotImplementedError when ``ipu.unsupported`` refuses the args
    ipu_unsupported: str = ""  # "forward" | "input_grad"
    check_extras: ExtrasCheck | None = None
    contiguous_grads: bool = False  # the input gradient is contiguous (as autograd's)
    #: extra checks of a mask kernel's mask: (sample, mask, forward output)
    check_mask: Callable[[Sample, Tensor, Tensor], None] | None = None


# ---------------------------------------------------------------- sample helpers


def _seeded(seed: int = 1234) -> None:
    torch.manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype) -> Tensor:
    """A standard-normal autograd leaf."""
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_()


def _pair(v: Any) -> tuple:
    return tuple(v) if isinstance(v, tuple) else (v, v)


# ---------------------------------------------------------------- convolutions and linear

# cin, cout, kernel, stride, padding, dilation, groups, bias
CONV_CASES = [
    (4, 6, (3, 2), (2, 1), (1, 2), (1, 2), 2, True),
    (4, 4, (3, 3), (1, 1), (1, 1), (1, 1), 4, False),  # depthwise
    (3, 5, (1, 3), (1, 2), (0, 1), (2, 1), 1, True),
    (2, 3, (2, 2), (2, 2), (0, 0), (1, 1), 1, False),
    (4, 6, (3, 2), (2, 3), (1, 0), (1, 1), 2, True),  # strides leaving input rows unused
    (6, 3, (2, 3), (3, 1), (1, 1), (1, 1), 3, True),
    (4, 6, (3, 3), (2, 2), (1, 1), (2, 2), 2, True),  # stride 2, dilation 2, a column unread
    (2, 4, (2, 3), (3, 2), (0, 2), (2, 3), 2, False),  # asymmetric dilation, rows unread
    (3, 2, (2, 2), (1, 2), (3, 1), (1, 2), 1, True),  # padding wider than the dilated kernel
]


def _conv_case(cin, cout, k, s, p, d, groups, bias) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = nn.Conv2d(cin, cout, k, s, p, d, groups, bias).to(dtype)
        kwargs = dict(stride=s, padding=p, dilation=d, groups=groups)
        return Sample((randn(2, cin, 7, 6, dtype=dtype),), layer, kwargs)

    return Case(
        f"{cin}x{cout}-k{k[0]}{k[1]}-s{s[0]}{s[1]}-p{p[0]}{p[1]}-d{d[0]}{d[1]}-g{groups}"
        f"-{'bias' if bias else 'nobias'}",
        make,
    )


def _conv_defaults(dtype: torch.dtype) -> Sample:
    """No keywords: the kernel defaults must be nn.Conv2d's (stride 1, no padding, ...)."""
    _seeded()
    return Sample((randn(2, 3, 6, 5, dtype=dtype),), nn.Conv2d(3, 4, 3).to(dtype))


# cin, cout, kernel, stride, padding, output_padding, dilation, groups, bias
CONVT_CASES = [
    (4, 6, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 2, True),
    (3, 2, (3, 2), (2, 3), (1, 0), (1, 2), (1, 1), 1, False),
    (2, 4, (2, 3), (2, 2), (0, 1), (1, 0), (2, 1), 2, True),
    (4, 4, (3, 3), (2, 1), (1, 1), (0, 0), (1, 1), 4, False),  # depthwise
    (2, 3, (2, 2), (1, 1), (0, 0), (0, 0), (2, 2), 1, True),
    (4, 2, (3, 2), (2, 3), (1, 2), (1, 2), (2, 3), 2, False),  # stride and dilation both > 1
]


def _convt_case(cin, cout, k, s, p, op, d, groups, bias) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = nn.ConvTranspose2d(cin, cout, k, s, p, op, groups, bias, d).to(dtype)
        kwargs = dict(stride=s, padding=p, output_padding=op, dilation=d, groups=groups)
        # dilated, ipu's forward is a plain conv2d (no dilated ConvTranspose): not torch's sums
        exact = ("gpu",) if d != (1, 1) else None
        return Sample((randn(2, cin, 5, 4, dtype=dtype),), layer, kwargs, exact_forward=exact)

    return Case(
        f"{cin}x{cout}-k{k[0]}{k[1]}-s{s[0]}{s[1]}-p{p[0]}{p[1]}-op{op[0]}{op[1]}"
        f"-d{d[0]}{d[1]}-g{groups}-{'bias' if bias else 'nobias'}",
        make,
    )


def _convt_defaults(dtype: torch.dtype) -> Sample:
    _seeded()
    return Sample((randn(2, 3, 5, 4, dtype=dtype),), nn.ConvTranspose2d(3, 2, 3).to(dtype))


def _linear_case(shape: tuple[int, ...], bias: bool) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(*shape, dtype=dtype),), nn.Linear(4, 3, bias=bias).to(dtype))

    return Case(f"{'x'.join(map(str, shape))}-{'bias' if bias else 'nobias'}", make)


def _layer_reference(s: Sample, ctx: Ctx) -> Tensor:
    return s.layer(s.inputs[0])


# ---------------------------------------------------------------- batch norm


def _bn_case(momentum: float | None, affine: bool, defaults: bool = False) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = {} if defaults else dict(eps=1e-3, momentum=momentum)
        layer = nn.BatchNorm2d(3, affine=affine, **kwargs).to(dtype)
        with torch.no_grad():
            if affine:
                layer.weight.copy_(torch.rand(3) + 0.5)
                layer.bias.copy_(torch.randn(3))
            layer.running_mean.copy_(torch.randn(3))
            layer.running_var.copy_(torch.rand(3) + 0.5)
            layer.num_batches_tracked.fill_(4)
        return Sample((randn(4, 3, 5, 4, dtype=dtype),), layer.train(), kwargs)

    label = "defaults" if defaults else f"momentum{momentum}-{'affine' if affine else 'plain'}"
    return Case(label, make)


def _bn_eval_reference(s: Sample) -> Tensor:
    return s.layer.eval()(s.inputs[0])


def _bn_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    """save_mean and save_invstd are the batch statistics (biased variance)."""
    x, eps = s.inputs[0].detach(), s.kwargs.get("eps", 1e-5)
    mean, invstd = extras
    tol = 1e-12 if x.dtype == F64 else 1e-6
    assert rel(mean, x.mean((0, 2, 3))) <= tol
    assert rel(invstd, 1 / (x.var((0, 2, 3), unbiased=False) + eps).sqrt()) <= tol


# ---------------------------------------------------------------- activations


def _activation_case(label: str, kwargs: dict[str, Any]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = torch.randn(3, 4, 5, dtype=dtype)
        x[0, 0, :2] = 0.0  # the kink of relu / leaky_relu, and gelu's series branch
        return Sample((leaf(x),), kwargs=kwargs)

    return Case(label, make)


def _gelu_reference(s: Sample, ctx: Ctx) -> Tensor:
    return F.gelu(s.inputs[0], approximate=s.kwargs.get("approximate", "none"))


def _leaky_reference(s: Sample, ctx: Ctx) -> Tensor:
    return F.leaky_relu(s.inputs[0], s.kwargs.get("negative_slope", 0.01))


# ---------------------------------------------------------------- pooling

# kernel, stride, padding, input hw
MAXPOOL_CASES = [
    ((3, 3), (2, 2), (1, 1), (9, 8)),
    ((2, 3), (1, 2), (1, 1), (9, 8)),
    ((2, 2), (2, 2), (0, 0), (9, 8)),
    ((3, 2), (1, 1), (1, 1), (6, 7)),  # heavy overlap
    ((3, 3), (3, 2), (1, 0), (10, 7)),
    ((2, 2), (3, 3), (1, 1), (8, 8)),  # gaps between windows
    ((3, 2), (3, 2), (1, 0), (10, 7)),  # non-overlapping: the 1-bit mask applies
    ((2, 2), (3, 3), (0, 0), (8, 8)),
    ((2, 3), (2, 4), (1, 1), (7, 9)),
]
TIE_KINDS = ("random", "small_ints", "constant", "neg_inf")


def ties_input(hw: tuple[int, int], kind: str, dtype: torch.dtype) -> Tensor:
    """Pooling inputs with ties: small integers tie in nearly every window, a constant in
    all of them; -inf fills a whole window and borders the padding."""
    if kind == "random":
        return torch.randn(2, 3, *hw, dtype=dtype)
    if kind == "small_ints":
        return torch.randint(0, 3, (2, 3, *hw)).to(dtype)
    if kind == "constant":
        return torch.full((2, 3, *hw), 0.5, dtype=dtype)
    if kind == "neg_inf":
        x = torch.randint(0, 2, (2, 3, *hw)).to(dtype)
        x[:, :, :3, :3] = -math.inf
        return x
    raise AssertionError(kind)


def _maxpool_case(k, s, p, hw, kind: str) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = leaf(ties_input(hw, kind, dtype))
        kwargs = dict(kernel_size=k, stride=s, padding=p)
        return Sample((x,), kwargs=kwargs, derived=dict(input_hw=hw))

    label = f"k{k[0]}{k[1]}-s{s[0]}{s[1]}-p{p[0]}{p[1]}-{hw[0]}x{hw[1]}-{kind}"
    return Case(label, make)


def _maxpool_reference(s: Sample, ctx: Ctx) -> Tensor:
    k = s.kwargs
    ceil = k.get("ceil_mode", False)
    return nn.MaxPool2d(k["kernel_size"], k["stride"], k.get("padding", 0), ceil_mode=ceil)(
        s.inputs[0]
    )


def selection_from_indices(idx: Tensor, k, s, p, w: int) -> Tensor:
    """PyTorch's indices as the one-hot offset within each window, [N, C, kh*kw, Ho, Wo]:
    the ipu kernel's selection."""
    ho, wo = idx.shape[-2:]
    row0 = (torch.arange(ho) * s[0] - p[0]).reshape(ho, 1)
    col0 = (torch.arange(wo) * s[1] - p[1]).reshape(1, wo)
    q = (idx // w - row0) * k[1] + (idx % w - col0)
    return F.one_hot(q, k[0] * k[1]).permute(0, 1, 4, 2, 3).bool()


def _maxpool_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    """gpu keeps PyTorch's indices; ipu a bool selection that picks the same elements
    (the first maximum of each window in row-major order, PyTorch's tie rule)."""
    (idx,) = extras
    k, st, p = s.kwargs["kernel_size"], s.kwargs["stride"], s.kwargs.get("padding", (0, 0))
    ceil = s.kwargs.get("ceil_mode", False)
    _, ref_idx = F.max_pool2d(s.inputs[0].detach(), k, st, p, 1, ceil, return_indices=True)
    if platform == "gpu":
        assert torch.equal(idx, ref_idx)
        return
    assert idx.dtype == torch.bool and idx.shape == (2, 3, k[0] * k[1], *y.shape[-2:])
    assert torch.equal(idx, selection_from_indices(ref_idx, k, st, p, s.inputs[0].shape[-1]))


def _maxpool_mask(s: Sample, mask: Tensor, y: Tensor) -> None:
    """One argmax per window."""
    assert int(mask.sum()) == y.numel()


# kernel, stride, padding, input hw
AVGPOOL_CASES = [
    ((3, 2), (2, 1), (1, 1), (7, 6)),
    ((2, 2), (2, 2), (0, 0), (7, 6)),
    ((3, 3), (1, 1), (1, 1), (7, 6)),
    ((2, 3), (3, 2), (1, 1), (8, 7)),
]


def _avgpool_case(k, s, p, hw) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = dict(kernel_size=k, stride=s, padding=p)
        return Sample((randn(2, 3, *hw, dtype=dtype),), kwargs=kwargs, derived=dict(input_hw=hw))

    return Case(f"k{k[0]}{k[1]}-s{s[0]}{s[1]}-p{p[0]}{p[1]}-{hw[0]}x{hw[1]}", make)


def _avgpool_reference(s: Sample, ctx: Ctx) -> Tensor:
    k = s.kwargs
    ceil = k.get("ceil_mode", False)
    return nn.AvgPool2d(k["kernel_size"], k["stride"], k.get("padding", 0), ceil)(s.inputs[0])


ADAPTIVE_CASES = [((7, 5), (1, 1)), ((7, 5), (3, 2)), ((8, 8), (4, 4)), ((5, 7), (3, 4))]
ADAPTIVE_CASES += [((3, 4), (5, 6))]  # more outputs than inputs


def _adaptive_case(in_hw, out_hw) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = randn(2, 3, *in_hw, dtype=dtype)
        return Sample((x,), kwargs=dict(output_size=out_hw), derived=dict(input_hw=in_hw))

    return Case(f"{in_hw[0]}x{in_hw[1]}-to-{out_hw[0]}x{out_hw[1]}", make)


def _adaptive_reference(s: Sample, ctx: Ctx) -> Tensor:
    return nn.AdaptiveAvgPool2d(s.kwargs["output_size"])(s.inputs[0])


# ---------------------------------------------------------------- upsampling

UPSAMPLE_CASES = [
    (2.0, "nearest", None),
    (1.5, "nearest", None),
    ((2.0, 3.0), "nearest", None),
    ((2.0, 1.5), "nearest", None),
    (0.6, "nearest", None),
    (1.1, "nearest", None),  # output size == input size for 5 x 4: a copy
    (2.0, "bilinear", False),
    (2.0, "bilinear", True),
    (1.5, "bilinear", False),
    (1.5, "bilinear", True),
    ((2.0, 3.0), "bilinear", False),
    ((2.0, 3.0), "bilinear", True),
    ((1.5, 3.0), "bilinear", False),
    (0.6, "bilinear", False),
    (1.1, "bilinear", True),
]


def _upsample_case(scale, mode: str, align: bool | None, hw: tuple[int, int]) -> Case:
    """Nearest: the same source index as PyTorch (float32 arithmetic on ipu), so both
    forwards are exact; bilinear: exact on gpu, PyTorch's weights on ipu (within rounding)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        sf = tuple(float(v) for v in _pair(scale))
        kwargs = dict(scale_factor=sf, mode=mode, align_corners=bool(align))
        exact = PLATFORMS if mode == "nearest" else ("gpu",)
        x = randn(2, 3, *hw, dtype=dtype)
        return Sample((x,), kwargs=kwargs, derived=dict(input_hw=hw), exact_forward=exact)

    label = f"{'x'.join(map(str, _pair(scale)))}-{mode}-align{align}-{hw[0]}x{hw[1]}"
    return Case(label, make)


def _upsample_defaults(dtype: torch.dtype) -> Sample:
    """Only scale_factor: the defaults are nn.Upsample's (nearest)."""
    _seeded()
    x = randn(2, 3, 5, 4, dtype=dtype)
    return Sample((x,), kwargs=dict(scale_factor=(2.0, 2.0)), derived=dict(input_hw=(5, 4)))


def _upsample_reference(s: Sample, ctx: Ctx) -> Tensor:
    mode = s.kwargs.get("mode", "nearest")
    align = s.kwargs.get("align_corners", False) if mode == "bilinear" else None
    up = nn.Upsample(scale_factor=s.kwargs["scale_factor"], mode=mode, align_corners=align)
    return up(s.inputs[0])


# ---------------------------------------------------------------- arithmetic and shapes


def _pair_case(label: str = "3d") -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(2, 3, 4, dtype=dtype), randn(2, 3, 4, dtype=dtype)))

    return Case(label, make)


def _broadcast_case(a: tuple, b: tuple, a_shape=None, b_shape=None) -> Case:
    """Operands of shapes ``a`` and ``b`` broadcast by torch; ``a_shape``/``b_shape`` as the
    shape rule derives them (an operand's model shape, "N" for the batch, where broadcast)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        derived = {"a_shape": a_shape, "b_shape": b_shape}
        ta, tb = randn(*a, dtype=dtype), randn(*b, dtype=dtype)
        with torch.no_grad():  # away from zero: div divides by b
            tb.copy_(tb.sign() * (tb.abs() + 0.5))
        return Sample((ta, tb), derived=derived)

    label = f"{'x'.join(map(str, a))}-{'x'.join(map(str, b))}"
    return Case(label, make)


_BROADCAST_CASES = (
    _broadcast_case((2, 3, 4), (4,), b_shape=(4,)),  # a bias-like free parameter
    _broadcast_case((2, 3, 4), (1, 3, 4), b_shape=(1, 3, 4)),  # a position embedding
    _broadcast_case((2, 1, 4), (2, 3, 4), a_shape=("N", 1, 4)),  # one token against many
    _broadcast_case((3, 1), (2, 3, 4), a_shape=(3, 1)),  # both stretched
)


class _Holder(nn.Module):
    """The module holding a free parameter (``parameter``'s layer handle)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(shape, dtype=dtype))


def _parameter_case(shape: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((), _Holder(shape, dtype), kwargs={"name": "pos_embedding"})

    return Case("x".join(map(str, shape)) or "scalar", make)  # shape=(): a learned scalar


def _concat_case(dim: int | None, counts: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        shapes = [[2, 3, 3, 2] for _ in counts]
        for shape, n in zip(shapes, counts):
            shape[1 if dim is None else dim] = n
        xs = tuple(randn(*shape, dtype=dtype) for shape in shapes)
        kwargs = {} if dim is None else dict(dim=dim)
        return Sample(xs, kwargs=kwargs, derived=dict(sizes=counts))

    return Case(f"dim{dim}-{'-'.join(map(str, counts))}", make)


def _concat_reference(s: Sample, ctx: Ctx) -> Tensor:
    return torch.cat(s.inputs, s.kwargs.get("dim", 1))


def _flatten_case(start_dim: int | None) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = {} if start_dim is None else dict(start_dim=start_dim)
        x = randn(2, 3, 4, 5, dtype=dtype)
        return Sample((x,), kwargs=kwargs, derived=dict(input_shape=(3, 4, 5)))

    return Case(f"start{start_dim}", make)


def _reshape_case(shape: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = randn(2, 3, 4, 5, dtype=dtype)
        return Sample((x,), kwargs=dict(shape=shape), derived=dict(input_shape=(3, 4, 5)))

    return Case("x".join(map(str, shape)), make)


# ---------------------------------------------------------------- dropout


def _dropout_case(p: float | None, shape: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = {} if p is None else dict(p=p)
        edge = p in (0.0, 1.0)
        exact = PLATFORMS if edge else ("gpu",)
        return Sample((randn(*shape, dtype=dtype),), kwargs=kwargs, exact_forward=exact, seed=7)

    return Case(f"p{p}-{'x'.join(map(str, shape))}", make)


def _dropout_reference(s: Sample, ctx: Ctx) -> Tensor:
    """gpu: nn.Dropout itself, same seed, same draws. ipu draws from torch.rand, another
    stream: x * keep / (1 - p) with the kernel's keep-mask."""
    x, p = s.inputs[0], s.kwargs.get("p", 0.5)
    (mask,) = ctx.extras
    if ctx.platform == "gpu" or mask is None:
        torch.manual_seed(s.seed)
        return nn.Dropout(p).train()(x)
    return x * mask.to(x.dtype) / (1 - p)


def _dropout_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    """The keep-mask is bool, x's shape, and zero exactly where dropped (or x is zero)."""
    (mask,) = extras
    if mask is None:
        return
    x = s.inputs[0].detach()
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert torch.equal(y == 0, ~mask | (x == 0))


# ---------------------------------------------------------------- mixture of experts


def _moe_case(family: str, experts: int, top_k: int, norm: bool = True) -> Case:
    """transformers' own block as the layer and reference (its experts run eagerly: the
    default grouped_mm takes no float64), weights drawn wide enough that the tokens spread
    over the experts."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        if family == "mixtral":
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

            config = MixtralConfig(
                hidden_size=6, intermediate_size=5, num_local_experts=experts,
                num_experts_per_tok=top_k,
            )  # fmt: skip
            block: nn.Module = MixtralSparseMoeBlock(config)
            kwargs: dict[str, Any] = dict(top_k=top_k)
        else:
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

            config = Qwen2MoeConfig(
                hidden_size=6, moe_intermediate_size=5, num_experts=experts,
                num_experts_per_tok=top_k, shared_expert_intermediate_size=4,
                norm_topk_prob=norm,
            )  # fmt: skip
            block = Qwen2MoeSparseMoeBlock(config)
            kwargs = dict(top_k=top_k, norm_topk=norm, router_float32=True)
        config._experts_implementation = "eager"
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.5)
        return Sample((randn(3, 4, 6, dtype=dtype),), block.to(dtype), kwargs=kwargs)

    return Case(f"{family}-{experts}x{top_k}{'' if norm else '-raw'}", make)


def _moe_reference(s: Sample, ctx: Ctx) -> Tensor:
    """The block under autograd with its activations' casts to float32 lifted, as verify
    steps it (Mixtral's ``router_logits.float()`` is the identity in a float32 network and
    the text has no such cast; Qwen2-MoE's softmax(dtype=torch.float) stays)."""
    from unroller.analysis.lifted_casts import LiftedCasts

    with LiftedCasts():
        return s.layer(s.inputs[0])


# ---------------------------------------------------------------- stochastic depth


def _drop_path_case(p: float, shape: tuple[int, ...], scale: bool = True) -> Case:
    """Stochastic depth on 16 samples (gpu; ipu refuses p > 0): at these p some samples
    are dropped and some kept after seed 3 (``_drop_path_extras`` checks both happen)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs: dict[str, Any] = dict(p=p) if scale else dict(p=p, scale=False)
        return Sample((randn(16, *shape, dtype=dtype),), kwargs=kwargs, seed=3)

    return Case(f"p{p}-{'x'.join(map(str, shape))}{'' if scale else '-unscaled'}", make)


def _drop_path_reference(s: Sample, ctx: Ctx) -> Tensor:
    """A stochastic depth module (Hugging Face's, timm's) as verify steps it: its mask drawn
    as the generated kernel draws it (verify.stochastic_depth_as_generated), after the same
    seed, under autograd."""
    from unroller.analysis.verify import stochastic_depth_as_generated

    class DropPath(nn.Module):
        def __init__(self, drop_prob: float, scale_by_keep: bool) -> None:
            super().__init__()
            self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

        def forward(self, x: Tensor) -> Tensor:
            raise AssertionError("verify's reference replaces this forward")

    module = DropPath(s.kwargs.get("p", 0.0), s.kwargs.get("scale", True)).train()
    torch.manual_seed(s.seed)
    with stochastic_depth_as_generated(module):
        return module(s.inputs[0])


def _drop_path_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    """The seed is one int64 (none at p == 0); whole samples are zero or all kept."""
    (seed,) = extras
    if not s.kwargs.get("p", 0.0):
        assert seed is None
        return
    assert seed.dtype == torch.int64 and seed.shape == (1,)
    x = s.inputs[0].detach()
    dropped = (y == 0).flatten(1).all(1)
    assert 0 < int(dropped.sum()) < x.shape[0], "the case should drop some samples, not all"
    assert not (x[dropped] == 0).flatten(1).all(1).any()


# ---------------------------------------------------------------- losses


def _cross_entropy_case(ignored: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        logits = randn(6, 5, dtype=dtype)
        target = torch.randint(0, 5, (6,))
        target[list(ignored)] = -100
        return Sample((logits, target))

    return Case(f"ignore{len(ignored)}", make)


def _cross_entropy_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    (log_probs,) = extras
    ref = F.log_softmax(s.inputs[0].detach(), 1)
    assert rel(log_probs, ref) <= (1e-12 if ref.dtype == F64 else 1e-6)


def _two_normal(dtype: torch.dtype) -> Sample:
    _seeded()
    return Sample((randn(4, 5, dtype=dtype), randn(4, 5, dtype=dtype)))


def _probabilities(dtype: torch.dtype) -> Sample:
    _seeded()
    p = torch.sigmoid(torch.randn(4, 5, dtype=dtype))
    return Sample((leaf(p), leaf(torch.rand(4, 5, dtype=dtype))))


def _extreme_probabilities(dtype: torch.dtype) -> Sample:
    """Probabilities at and next to 0 and 1: the -100 clamp of the logs and the 1e-12 clamp
    of the gradient's denominator (the target's gradient is infinite at 0 and 1)."""
    p = torch.tensor([[0.0, 1e-50, 1e-8, 0.3], [1 - 1e-9, 0.5, 0.9, 1.0 - 2**-40]], dtype=dtype)
    t = torch.tensor([[0.0, 0.2, 1.0, 0.7], [1.0, 0.5, 0.1, 0.0]], dtype=dtype)
    return Sample((leaf(p), leaf(t)))


def _extreme_logits(dtype: torch.dtype) -> Sample:
    _seeded()
    big = torch.tensor([[-60.0, 60.0, 0.0, 30.0, -1e-3]])
    x = torch.cat([torch.randn(3, 5), big]).to(dtype)
    return Sample((leaf(x), leaf(torch.rand(4, 5, dtype=dtype))))


def _two_inputs(fn: Callable[[Tensor, Tensor], Tensor]) -> Reference:
    return lambda s, ctx: fn(*s.inputs)


def _one_input(fn: Callable[[Tensor], Tensor]) -> Reference:
    return lambda s, ctx: fn(s.inputs[0])


def rel(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b||: the measure the tolerances are stated in."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / max(b.norm().item(), 1e-300)).item()


# ---------------------------------------------------------------- attention

# The references run torch's math attention (SDPBackend.MATH). Both platforms compute
# attention block by block from the row logsumexp (unroller/runtime/attention.py: the
# probabilities are remade in the backward, never kept), which rounds differently from the
# math path, so neither platform is bit for bit (_ATTENTION): the table's bounds hold, 1e-10
# relative in float64 and 1e-5 in float32 for the gradients. With q, k, v of one head size
# torch's default CPU backend is a fused flash kernel (tests/operators/test_attention.py compares the
# kernels with that default too).
_ATTENTION = dict(exact_forward=(), exact_grads=())

# q length, k/v length, head size of q and k, head size of v, is_causal, scale (None: omitted)
SDPA_CASES = [
    (4, 4, 5, 5, False, None),
    (4, 6, 5, 7, False, None),  # cross-attention shapes: S != L, v's head size differs
    (5, 5, 3, 3, True, None),
    (3, 6, 4, 2, True, None),  # causal with more keys than queries
    (6, 3, 4, 4, True, None),  # causal with fewer keys: every row keeps key 0
    (4, 5, 6, 6, False, 0.3),
    (4, 4, 2, 3, True, -0.5),  # a negative scale: its sign goes on q
    (3, 4, 5, 5, False, 0.0),  # uniform attention
]


def _math_attention() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _sdpa_case(lq: int, lk: int, e: int, ev: int, causal: bool, scale: float | None) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        q, k = randn(2, 3, lq, e, dtype=dtype), randn(2, 3, lk, e, dtype=dtype)
        v = randn(2, 3, lk, ev, dtype=dtype)
        kwargs: dict[str, Any] = dict(is_causal=causal)
        if scale is not None:
            kwargs["scale"] = scale
        return Sample((q, k, v), kwargs=kwargs)

    label = f"L{lq}-S{lk}-E{e}-Ev{ev}-{'causal' if causal else 'full'}-scale{scale}"
    return Case(label, make)


def _sdpa_gqa_case(heads: int, kv_heads: int, causal: bool) -> Case:
    """Grouped-query attention: k and v with ``kv_heads`` heads serving ``heads`` query
    heads (torch's enable_gqa)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        q = randn(2, heads, 4, 3, dtype=dtype)
        k, v = randn(2, kv_heads, 5, 3, dtype=dtype), randn(2, kv_heads, 5, 2, dtype=dtype)
        return Sample((q, k, v), kwargs=dict(is_causal=causal, enable_gqa=True))

    return Case(f"gqa-H{heads}-Hkv{kv_heads}-{'causal' if causal else 'full'}", make)


def _rotary_case(shape: tuple[int, ...], kwargs: dict[str, Any]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(*shape, dtype=dtype),), kwargs=kwargs)

    label = "x".join(map(str, shape)) + "-" + "-".join(f"{k}{v}" for k, v in kwargs.items())
    return Case(label, make)


def _rotary_reference(s: Sample, ctx: Ctx) -> Tensor:
    """Hugging Face's default rope as transformers writes it (LlamaRotaryEmbedding's tables
    in float32 at positions 0..L-1, then apply_rotary_pos_emb), under autograd."""
    (x,) = s.inputs
    theta, scaling = s.kwargs.get("theta", 10000.0), s.kwargs.get("scaling", 1.0)
    length, dim = x.shape[-2:]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    position_ids = torch.arange(length)[None, :]
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(dtype=x.dtype).unsqueeze(1)
    sin = (emb.sin() * scaling).to(dtype=x.dtype).unsqueeze(1)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def _positions_case(label: str, pad: int) -> Case:
    """Token ids with padding tokens (whole padded rows too): integers in, integers out."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        ids = torch.randint(0, 9, (4, 7))
        ids[:, ::3] = pad
        ids[0] = pad
        return Sample((ids,), kwargs={"padding_idx": pad})

    return Case(label, make, dtypes=(F64,))


def _positions_reference(s: Sample, ctx: Ctx) -> Tensor:
    """Hugging Face RoBERTa's create_position_ids_from_input_ids, as it is written."""
    (ids,) = s.inputs
    pad = s.kwargs["padding_idx"]
    mask = ids.ne(pad).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + pad


def _padding_mask_case(label: str, dtype: torch.dtype) -> Case:
    """Padding masks of 0 and 1 (left and right padding, a row without any), integers in."""

    def make(_: torch.dtype) -> Sample:
        _seeded()
        mask = torch.randint(0, 2, (4, 7)).to(dtype)
        mask[0] = 1
        mask[1, 5:] = 0
        mask[2, :3] = 0
        return Sample((mask,))

    return Case(label, make, dtypes=(F64,))


def _padding_mask_reference(s: Sample, ctx: Ctx) -> Tensor:
    """Hugging Face's eager mask from an attention_mask: 0 where attended, lowest where not."""
    (mask,) = s.inputs
    lowest = torch.finfo(torch.float32).min
    attend = mask.bool()[:, None, None, :]
    return torch.where(attend, torch.tensor(0.0), torch.tensor(lowest))


def _causal_mask_case(shape: tuple[int, ...]) -> Case:
    """Scores [..., L, S] (S >= L: the keys after each query's own, S - L + i), as an eager
    attention adds Hugging Face's causal mask to them."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(*shape, dtype=dtype),))

    return Case("x".join(map(str, shape)), make)


def _causal_mask_reference(s: Sample, ctx: Ctx) -> Tensor:
    """The scores with the keys after each query's set to the dtype's lowest: what Hugging
    Face's additive mask gives (x + lowest rounds to lowest for any score below 2**100 in
    float32), with masked_fill's gradient (0 where masked, where the softmax after it sends
    exactly 0 anyway)."""
    (x,) = s.inputs
    length, keys = x.shape[-2:]
    masked = torch.ones(length, keys, dtype=torch.bool).tril(keys - length).logical_not()
    added = x.detach() + torch.zeros(length, keys, dtype=x.dtype).masked_fill(
        masked, torch.finfo(x.dtype).min
    )
    filled = x.masked_fill(masked, torch.finfo(x.dtype).min)
    assert torch.equal(added, filled.detach())  # the add and the fill agree bit for bit
    return filled


def _alibi_case(shape: tuple[int, ...]) -> Case:
    """Scores [N, H, L, S], as BLOOM's ``baddbmm`` adds its ALiBi bias to them."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(*shape, dtype=dtype),))

    return Case("x".join(map(str, shape)), make)


def _alibi_reference(s: Sample, ctx: Ctx) -> Tensor:
    """The scores plus ALiBi's bias as Hugging Face's BLOOM writes it without padding
    (``_get_alibi_slopes``, copied: powers of a float32 base per head, then slope times key
    position in float32, cast to the scores' dtype), the add under autograd."""
    (x,) = s.inputs
    heads, keys = x.shape[1], x.shape[3]
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != heads:
        extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        count = min(closest, heads - closest)
        odd = torch.arange(1, 1 + 2 * count, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra, odd)], dim=0)
    bias = slopes[:, None, None] * torch.arange(keys)
    return x + bias.repeat(x.shape[0], 1, 1).to(x.dtype).view(x.shape[0], heads, 1, keys)


def _sdpa_peaked(dtype: torch.dtype) -> Sample:
    """Large scores: softmax rows close to one-hot (probabilities near 0 and 1)."""
    _seeded()
    q = leaf(8 * torch.randn(1, 2, 4, 3, dtype=dtype))
    return Sample((q, randn(1, 2, 4, 3, dtype=dtype), randn(1, 2, 4, 3, dtype=dtype)))


def _sdpa_reference(s: Sample, ctx: Ctx) -> Tensor:
    kwargs = dict(s.kwargs)
    dropout = kwargs.pop("dropout", 0.0)
    q, k, v, *bias = s.inputs
    if dropout:  # the generated kernel's mask, drawn after the same seed (verify's reference)
        from unroller.analysis.verify import reference_dropped_attention

        torch.manual_seed(s.seed)
        return reference_dropped_attention(
            q,
            k,
            v,
            bias[0] if bias else None,
            dropout,
            kwargs.get("is_causal", False),
            kwargs.get("scale"),
            kwargs.get("enable_gqa", False),
        )
    if bias:  # torch takes a float attn_mask or is_causal, not both: the causal part as -inf
        mask = bias[0]
        if kwargs.pop("is_causal", False):
            masked = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril().logical_not()
            mask = mask.masked_fill(masked, float("-inf"))
        with _math_attention():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    with _math_attention():
        return F.scaled_dot_product_attention(*s.inputs, **kwargs)


def _sdpa_eval_reference(s: Sample) -> Tensor:
    """Evaluation mode: no dropout (torch modules pass dropout_p=0 when not training)."""
    kwargs = {k: v for k, v in s.kwargs.items() if k != "dropout"}
    return _sdpa_reference(replace(s, kwargs=kwargs), None)


def _sdpa_bias_case(
    samples: int, heads: int, causal: bool, kv_heads: int = 3, dropout: float = 0.0
) -> Case:
    """An additive score bias [samples, heads, L, S] (1 broadcasts), with a learned bias's
    gradient summed over the broadcast dims; a few entries at float32's lowest, as the
    padding masks Hugging Face builds (never a whole row)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        q = randn(2, 3, 5, 4, dtype=dtype)
        k, v = randn(2, kv_heads, 6, 4, dtype=dtype), randn(2, kv_heads, 6, 3, dtype=dtype)
        with torch.no_grad():
            bias = torch.randn(samples, heads, 5, 6, dtype=dtype)
            bias[..., 1, 4:] = torch.finfo(torch.float32).min
        kwargs: dict[str, Any] = dict(is_causal=causal)
        if kv_heads != 3:
            kwargs["enable_gqa"] = True
        if dropout:
            kwargs["dropout"] = dropout
        return Sample((q, k, v, leaf(bias)), kwargs=kwargs, seed=5 if dropout else 0)

    tail = f"-Hkv{kv_heads}" if kv_heads != 3 else ""
    tail += f"-dropout{dropout}" if dropout else ""
    return Case(f"bias{samples}x{heads}-{'causal' if causal else 'full'}{tail}", make)


def _sdpa_dropout_case(causal: bool, kv_heads: int, p: float) -> Case:
    """Dropout on the probabilities (gpu; ipu refuses it): the mask from a generator seeded
    by one draw of torch's stream after ``seed``, drawn again in the backward."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        q = randn(2, 4, 5, 3, dtype=dtype)
        k, v = randn(2, kv_heads, 6, 3, dtype=dtype), randn(2, kv_heads, 6, 2, dtype=dtype)
        kwargs = dict(is_causal=causal, dropout=p, enable_gqa=kv_heads != 4)
        return Sample((q, k, v), kwargs=kwargs, seed=11)

    return Case(f"dropout{p}-Hkv{kv_heads}-{'causal' if causal else 'full'}", make)


# embed dim, heads, length, bias, is_causal
MHA_CASES = [
    (6, 2, 4, True, False),
    (6, 3, 5, True, True),
    (8, 1, 3, False, False),  # one head, no biases
    (8, 4, 4, False, True),
    (4, 4, 1, True, False),  # head size 1, one token
]


def _mha_case(embed: int, heads: int, length: int, bias: bool, causal: bool) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = nn.MultiheadAttention(embed, heads, bias=bias, batch_first=True).to(dtype)
        if bias:  # torch initialises them to zero: give them values, so their use is checked
            with torch.no_grad():
                layer.in_proj_bias.copy_(torch.randn(3 * embed))
                layer.out_proj.bias.copy_(torch.randn(embed))
        kwargs: dict[str, Any] = dict(num_heads=heads)
        if causal:
            kwargs["is_causal"] = True
        return Sample((randn(2, length, embed, dtype=dtype),), layer, kwargs)

    label = f"E{embed}-H{heads}-L{length}-{'bias' if bias else 'nobias'}-causal{causal}"
    return Case(label, make)


def _mha_reference(s: Sample, ctx: Ctx) -> Tensor:
    """The module as nn.TransformerEncoderLayer calls it: need_weights=False and, for a causal
    op, is_causal with the causal mask it stands for."""
    x = s.inputs[0]
    causal = s.kwargs.get("is_causal", False)
    mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
    with _math_attention():
        return s.layer(
            x, x, x, need_weights=False, is_causal=causal, attn_mask=mask if causal else None
        )[0]


# ---------------------------------------------------------------- v2: activations, losses, embedding


def _wide_case(label: str, kwargs: dict[str, Any], specials: tuple[float, ...]) -> Case:
    """4 * standard normal (so every piece of a piecewise activation is hit), with the
    ``specials`` (kinks, the ends of linear ranges, thresholds) placed exactly."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = 4 * torch.randn(3, 4, 5, dtype=dtype)
        x.view(-1)[: len(specials)] = torch.tensor(specials, dtype=dtype)
        return Sample((leaf(x),), kwargs=kwargs)

    return Case(label, make)


_HARD_EDGES = (-3.0, 3.0, 0.0, 6.0, -1.0, 1.0, -0.5, 2.5, 1e-300, -1e-300, 50.0, -50.0)


def _kwarg_reference(fn: Callable[..., Tensor]) -> Reference:
    return lambda s, ctx: fn(s.inputs[0], **s.kwargs)


def _ce_nd_case(
    label: str,
    shape: tuple[int, ...],
    kwargs: dict[str, Any],
    ignored: int = 0,
    log_probs: bool = False,
) -> Case:
    """Scores [N, C, d1, ...] and targets [N, d1, ...]; the first ``ignored`` targets (in
    flat order; -1: all of them) set to the ignore_index. ``log_probs``: the input is a
    log_softmax (nll_loss); num_classes is derived for nll_loss's backward."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        n, c, *rest = shape
        scores = torch.randn(*shape, dtype=dtype)
        if log_probs:
            scores = F.log_softmax(scores, 1)
        target = torch.randint(0, c, (n, *rest))
        count = target.numel() if ignored < 0 else ignored
        target.view(-1)[:count] = kwargs.get("ignore_index", -100)
        return Sample((leaf(scores), target), kwargs=kwargs, derived=dict(num_classes=c))

    return Case(label, make)


CROSS_ENTROPY_V2_CASES = (
    _ce_nd_case("nd3", (3, 4, 5), {}),
    _ce_nd_case("nd3-ignore", (3, 4, 5), {}, ignored=4),
    _ce_nd_case("nd4-image", (2, 3, 4, 5), {}, ignored=3),
    _ce_nd_case("nd5", (2, 3, 2, 3, 2), {}, ignored=2),
    _ce_nd_case("smooth", (6, 5), {"label_smoothing": 0.1}),
    _ce_nd_case("smooth-ignore", (6, 5), {"label_smoothing": 0.25}, ignored=2),
    _ce_nd_case("smooth-nd3-ignore", (3, 4, 5), {"label_smoothing": 0.2}, ignored=5),
    _ce_nd_case("smooth-nd4", (2, 3, 4, 5), {"label_smoothing": 1.0}, ignored=1),
    _ce_nd_case("ignore-class2", (6, 5), {"ignore_index": 2}, ignored=1),
    _ce_nd_case("smooth-ignore-class0", (3, 4, 5), {"label_smoothing": 0.3, "ignore_index": 0}),
    _ce_nd_case("all-ignored", (4, 3), {}, ignored=-1),
    _ce_nd_case("smooth-all-ignored", (2, 3, 4), {"label_smoothing": 0.1}, ignored=-1),
)

NLL_CASES = (
    _ce_nd_case("2d", (6, 5), {}, log_probs=True),
    _ce_nd_case("2d-ignore", (6, 5), {}, ignored=2, log_probs=True),
    _ce_nd_case("nd3-ignore", (3, 4, 5), {}, ignored=3, log_probs=True),
    _ce_nd_case("nd4", (2, 3, 4, 5), {}, ignored=1, log_probs=True),
    _ce_nd_case("nd5", (2, 3, 2, 3, 2), {}, log_probs=True),
    _ce_nd_case("ignore-class1", (3, 4, 5), {"ignore_index": 1}, log_probs=True),
    _ce_nd_case("all-ignored", (4, 3), {}, ignored=-1, log_probs=True),
)


def _embedding_case(
    label: str, ids_shape: tuple[int, ...], padding_idx: int | None, defaults: bool = False
) -> Case:
    """ids with repeats (rows accumulate several gradients) and, when padding_idx is set,
    occurrences of it (its row gets none)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        num, dim = 7, 3
        layer = nn.Embedding(num, dim, padding_idx=padding_idx).to(dtype)
        ids = torch.randint(0, num, ids_shape)
        if padding_idx is not None:
            ids.view(-1)[:2] = padding_idx % num
        kwargs = {} if defaults else {"padding_idx": padding_idx}
        return Sample((ids,), layer, kwargs)

    return Case(label, make)


EMBEDDING_CASES = (
    _embedding_case("defaults", (4, 6), None, defaults=True),
    _embedding_case("pad2", (4, 6), 2),
    _embedding_case("pad-last-negative", (3, 2, 5), -1),
    _embedding_case("pad0-3d", (2, 3, 4), 0),
)

# ---------------------------------------------------------------- Hugging Face layers


def _embedding_rows_case(num: int, length: int, start: int | None) -> Case:
    """Rows start .. start+length-1 of a table of ``num`` rows (``start`` None: left out,
    the default 0); the backward gets num_embeddings as the graph derives it."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = {"length": length, **({} if start is None else {"start": start})}
        layer = nn.Embedding(num, 3).to(dtype)
        return Sample((), layer, kwargs, derived={"num_embeddings": num})

    return Case(f"{num}rows-start{start}-length{length}", make)


def _embedding_rows_reference(s: Sample, ctx: Ctx) -> Tensor:
    """``weight[start:start + length]``: autograd's slice_backward is the gradient."""
    start = s.kwargs.get("start", 0)
    return s.layer.weight[start : start + s.kwargs["length"]]


EMBEDDING_ROWS_CASES = (
    _embedding_rows_case(7, 3, 2),  # zero rows on both sides
    _embedding_rows_case(7, 4, None),  # the default start: rows from the first
    _embedding_rows_case(7, 2, 5),  # the last rows
    _embedding_rows_case(7, 7, 0),  # the whole table: the gradient is g itself
    _embedding_rows_case(2, 1, 0),  # a token-type table read at row 0
)


def _relative_bias_case(buckets: int, length: int, keys: int, distance: int, both: bool) -> Case:
    """T5's relative position bias: a [buckets, 3] table read at each (query, key) pair's
    bucket (offsets past max_distance share the last one)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = dict(
            query_length=length, key_length=keys, max_distance=distance, bidirectional=both
        )
        layer = nn.Embedding(buckets, 3).to(dtype)
        return Sample((), layer, kwargs, derived={"num_buckets": buckets})

    way = "both" if both else "one"
    return Case(f"{buckets}buckets-L{length}-S{keys}-max{distance}-{way}", make)


def _t5_bucket(offset: int, buckets: int, distance: int, both: bool) -> int:
    """The bucket of one key-minus-query offset, written out per pair (the log step in
    float32, as T5 computes it)."""
    bucket = 0
    if both:
        buckets //= 2
        bucket += buckets if offset > 0 else 0
        offset = abs(offset)
    else:
        offset = max(-offset, 0)
    exact = buckets // 2
    if offset < exact:
        return bucket + offset
    ratio = torch.tensor(offset / exact, dtype=torch.float32)
    scaled = torch.log(ratio) / math.log(distance / exact) * (buckets - exact)
    return bucket + min(exact + int(scaled.item()), buckets - 1)


def _relative_bias_reference(s: Sample, ctx: Ctx) -> Tensor:
    k = s.kwargs
    ids = torch.tensor(
        [
            [
                _t5_bucket(j - i, s.layer.num_embeddings, k["max_distance"], k["bidirectional"])
                for j in range(k["key_length"])
            ]
            for i in range(k["query_length"])
        ]
    )
    return s.layer(ids).permute(2, 0, 1).unsqueeze(0)


RELATIVE_BIAS_CASES = (
    _relative_bias_case(8, 5, 5, 16, True),
    _relative_bias_case(8, 9, 12, 20, False),  # decoder-style: one way, more keys
    _relative_bias_case(32, 40, 40, 128, True),  # offsets on the log scale and past max
    _relative_bias_case(6, 30, 7, 9, False),
)


def _transposed_linear_case(shape: tuple[int, ...], bias: bool) -> Case:
    """x [..., 4] through a Conv1D-shaped layer (weight [4, 3]) with random weights: the
    factory's own (normal 0.02, zero bias) would hide a missing bias."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = runtime_common.transposed_linear_layer(4, 3, bias).to(dtype)
        with torch.no_grad():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape))
        return Sample((randn(*shape, dtype=dtype),), layer)

    return Case(f"{'x'.join(map(str, shape))}-{'bias' if bias else 'nobias'}", make)


def _transposed_linear_reference(s: Sample, ctx: Ctx) -> Tensor:
    """Hugging Face's Conv1D.forward: addmm(bias, x.view(-1, in), weight).view(..., out)
    (x.view(-1, in).mm(weight) without a bias)."""
    x, weight, bias = s.inputs[0], s.layer.weight, s.layer.bias
    x2 = x.view(-1, x.shape[-1])
    y = x2.mm(weight) if bias is None else torch.addmm(bias, x2, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


TRANSPOSED_LINEAR_CASES = tuple(
    _transposed_linear_case(shape, bias)
    for shape, bias in [((2, 5, 4), True), ((3, 4), False), ((2, 3, 2, 4), True), ((6, 4), True)]
)

# ---------------------------------------------------------------- normalisation and 1-D ops (v2)


def _randomize_affine(layer: nn.Module) -> nn.Module:
    """Weights away from 1 and biases away from 0, so a swapped or missing one shows."""
    with torch.no_grad():
        if getattr(layer, "weight", None) is not None:
            layer.weight.copy_(torch.rand(layer.weight.shape) + 0.5)
        if getattr(layer, "bias", None) is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape))
    return layer


def _layernorm_case(shape, normalized, eps=None, affine=True, bias=True) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs: dict[str, Any] = dict(normalized_shape=normalized)
        if eps is not None:
            kwargs["eps"] = eps
        layer = nn.LayerNorm(normalized, eps=eps or 1e-5, elementwise_affine=affine, bias=bias).to(
            dtype
        )
        x = torch.randn(*shape, dtype=dtype) * 3 + 1
        return Sample((leaf(x),), _randomize_affine(layer), kwargs)

    label = f"{'x'.join(map(str, shape))}-norm{'x'.join(map(str, normalized))}-eps{eps}"
    return Case(f"{label}-affine{affine}-bias{bias}", make)


def _rmsnorm_case(shape, normalized, eps=None, affine=True, scale=3.0, offset=0.0) -> Case:
    """``offset``: the norm times weight + offset, against Gemma's RMSNorm written in the
    input's dtype (``hf_norms.OffsetRMSNorm``, last dim only)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs: dict[str, Any] = dict(normalized_shape=normalized)
        if eps is not None:
            kwargs["eps"] = eps
        layer = nn.RMSNorm(normalized, eps=eps, elementwise_affine=affine).to(dtype)
        x = torch.randn(*shape, dtype=dtype) * scale + 1
        layer = _randomize_affine(layer)
        if offset:
            from unroller.importer.hf_norms import OffsetRMSNorm

            kwargs["weight_offset"] = offset
            layer = OffsetRMSNorm(layer.weight, eps)
        return Sample((leaf(x),), layer, kwargs)

    label = f"{'x'.join(map(str, shape))}-norm{'x'.join(map(str, normalized))}-eps{eps}"
    return Case(f"{label}-affine{affine}-scale{scale}-offset{offset}", make)


def _rms_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    """rstd is 1 / sqrt(mean(x**2) + eps) per row (eps None: the dtype's epsilon)."""
    x = s.inputs[0].detach()
    eps = s.kwargs.get("eps")
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    (rstd,) = extras
    ref = 1 / (x.square().mean(_layernorm_dims(s), keepdim=True) + eps).sqrt()
    assert rel(rstd, ref) <= (1e-12 if x.dtype == F64 else 1e-6)


def _norm_extras(dims_of: Callable[[Sample], Any], group: bool = False) -> ExtrasCheck:
    """mean and rstd are the biased statistics aten::native_{layer,group}_norm saves."""

    def check(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
        x, eps = s.inputs[0].detach(), s.kwargs.get("eps", 1e-5)
        mean, rstd = extras
        if group:
            x = x.reshape(x.shape[0], s.kwargs["num_groups"], -1)
        dims = dims_of(s)
        tol = 1e-12 if x.dtype == F64 else 1e-6
        ref_mean = x.mean(dims, keepdim=not group)
        ref_rstd = 1 / (x.var(dims, unbiased=False, keepdim=not group) + eps).sqrt()
        assert rel(mean, ref_mean) <= tol
        assert rel(rstd, ref_rstd) <= tol

    return check


def _layernorm_dims(s: Sample) -> tuple[int, ...]:
    rank, count = s.inputs[0].dim(), len(s.kwargs["normalized_shape"])
    return tuple(range(rank - count, rank))


def _groupnorm_case(shape, groups, eps=None, affine=True) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs: dict[str, Any] = dict(num_groups=groups)
        if eps is not None:
            kwargs["eps"] = eps
        layer = nn.GroupNorm(groups, shape[1], eps=eps or 1e-5, affine=affine).to(dtype)
        x = torch.randn(*shape, dtype=dtype) * 2 - 0.5
        return Sample((leaf(x),), _randomize_affine(layer), kwargs)

    return Case(f"{'x'.join(map(str, shape))}-g{groups}-eps{eps}-affine{affine}", make)


def _bn1d_case(shape, momentum=0.1, affine=True, track=True, defaults=False) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        kwargs = {} if defaults else dict(eps=1e-3, momentum=momentum)
        layer = nn.BatchNorm1d(3, affine=affine, track_running_stats=track, **kwargs)
        layer = _randomize_affine(layer.to(dtype))
        if track:
            with torch.no_grad():
                layer.running_mean.copy_(torch.randn(3))
                layer.running_var.copy_(torch.rand(3) + 0.5)
                layer.num_batches_tracked.fill_(4)
        return Sample((randn(*shape, dtype=dtype),), layer.train(), kwargs)

    label = "defaults" if defaults else f"momentum{momentum}-affine{affine}-track{track}"
    return Case(f"{'x'.join(map(str, shape))}-{label}", make)


def _bn1d_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    x, eps = s.inputs[0].detach(), s.kwargs.get("eps", 1e-5)
    dims = (0, 2) if x.dim() == 3 else (0,)
    mean, invstd = extras
    tol = 1e-12 if x.dtype == F64 else 1e-6
    assert rel(mean, x.mean(dims)) <= tol
    assert rel(invstd, 1 / (x.var(dims, unbiased=False) + eps).sqrt()) <= tol


def _bn2d_v2_case(affine: bool, track: bool) -> Case:
    """batchnorm2d's affine / track_running_stats (no running stats: batch stats in eval)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = nn.BatchNorm2d(3, momentum=0.3, affine=affine, track_running_stats=track)
        layer = _randomize_affine(layer.to(dtype))
        x = randn(4, 3, 5, 4, dtype=dtype)
        return Sample((x,), layer.train(), dict(momentum=0.3))

    return Case(f"v2-affine{affine}-track{track}", make)


BN2D_V2_CASES = tuple(_bn2d_v2_case(a, t) for a in (True, False) for t in (True, False))

# cin, cout, kernel, stride, padding, dilation, groups, bias
CONV1D_CASES = [
    (4, 6, 3, 2, 1, 2, 2, True),
    (4, 4, 3, 1, 1, 1, 4, False),  # depthwise
    (3, 5, 1, 2, 0, 1, 1, True),
    (2, 3, 2, 3, 1, 1, 1, False),  # stride leaving input positions unused
    (6, 3, 4, 1, 2, 1, 3, True),
    (2, 4, 2, 2, 0, 3, 2, False),  # dilated, the last position unread
    (3, 2, 2, 1, 3, 2, 1, True),  # padding wider than the dilated kernel
]


def _conv1d_case(cin, cout, k, s, p, d, groups, bias) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = nn.Conv1d(cin, cout, k, s, p, d, groups, bias).to(dtype)
        kwargs = dict(stride=s, padding=p, dilation=d, groups=groups)
        return Sample((randn(2, cin, 11, dtype=dtype),), layer, kwargs)

    return Case(f"{cin}x{cout}-k{k}-s{s}-p{p}-d{d}-g{groups}-{'bias' if bias else 'nobias'}", make)


def _conv1d_defaults(dtype: torch.dtype) -> Sample:
    _seeded()
    return Sample((randn(2, 3, 9, dtype=dtype),), nn.Conv1d(3, 4, 3).to(dtype))


# kernel, stride, padding, input length, ceil_mode
POOL1D_CASES = [
    (3, 2, 1, 9, False),
    (2, 1, 1, 8, False),  # heavy overlap
    (2, 2, 0, 9, False),
    (3, 3, 1, 10, False),  # non-overlapping: the 1-bit mask applies
    (2, 3, 1, 8, False),  # gaps between windows
    (3, 2, 0, 8, True),  # ceil mode: one more, partial window
    (2, 2, 1, 5, True),  # ceil mode: a last window starting in the padding is dropped
    (2, 3, 0, 8, True),  # ceil mode with gaps (mask applies)
]


def _pool1d_kwargs(k, s, p, ceil) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(kernel_size=k, stride=s, padding=p)
    if ceil:
        kwargs["ceil_mode"] = True
    return kwargs


def _maxpool1d_case(k, s, p, length, ceil, kind: str) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = leaf(ties_input((1, length), kind, dtype).squeeze(2))
        kwargs = _pool1d_kwargs(k, s, p, ceil)
        return Sample((x,), kwargs=kwargs, derived=dict(input_length=length))

    return Case(f"k{k}-s{s}-p{p}-{length}-ceil{ceil}-{kind}", make)


def _maxpool1d_reference(s: Sample, ctx: Ctx) -> Tensor:
    k = s.kwargs
    pool = nn.MaxPool1d(
        k["kernel_size"], k["stride"], k["padding"], ceil_mode=k.get("ceil_mode", False)
    )
    return pool(s.inputs[0])


def _maxpool1d_extras(platform: str, s: Sample, y: Tensor, extras: tuple) -> None:
    """gpu: PyTorch's indices; ipu: the selection [N, C, k, Lo] picking the same elements."""
    (idx,) = extras
    k = s.kwargs
    x = s.inputs[0].detach()
    _, ref_idx = F.max_pool1d(
        x, k["kernel_size"], k["stride"], k["padding"], 1, k.get("ceil_mode", False), True
    )
    if platform == "gpu":
        assert torch.equal(idx, ref_idx)
        return
    kk = (1, k["kernel_size"])
    sel = selection_from_indices(
        ref_idx.unsqueeze(2), kk, (1, k["stride"]), (0, k["padding"]), x.shape[-1]
    )
    assert torch.equal(idx, sel.squeeze(3))


def _avgpool1d_case(k, s, p, length, ceil) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = randn(2, 3, length, dtype=dtype)
        kwargs = _pool1d_kwargs(k, s, p, ceil)
        return Sample((x,), kwargs=kwargs, derived=dict(input_length=length))

    return Case(f"k{k}-s{s}-p{p}-{length}-ceil{ceil}", make)


def _avgpool1d_reference(s: Sample, ctx: Ctx) -> Tensor:
    k = s.kwargs
    pool = nn.AvgPool1d(k["kernel_size"], k["stride"], k["padding"], k.get("ceil_mode", False))
    return pool(s.inputs[0])


def _adaptive1d_case(length: int, out: int) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = randn(2, 3, length, dtype=dtype)
        return Sample((x,), kwargs=dict(output_size=out), derived=dict(input_length=length))

    return Case(f"{length}-to-{out}", make)


# 2-D pools in ceil mode: kernel, stride, padding, input hw
POOL2D_CEIL_CASES = [
    ((3, 3), (2, 2), (0, 0), (8, 8)),  # one more, partial window per dim
    ((2, 2), (2, 2), (1, 1), (5, 4)),  # a last window starting in the padding is dropped
    ((3, 2), (3, 2), (1, 0), (10, 7)),  # non-overlapping: the 1-bit mask applies
    ((2, 3), (3, 2), (0, 1), (8, 7)),  # gaps between windows
]


def _ceil_case(make_case: Callable[..., Case], *args: Any) -> Case:
    base = make_case(*args)

    def make(dtype: torch.dtype) -> Sample:
        s = base.make(dtype)
        s.kwargs["ceil_mode"] = True
        return s

    return Case(f"{base.label}-ceil", make)


MAXPOOL_CEIL_CASES = tuple(
    _ceil_case(_maxpool_case, *c, kind) for c in POOL2D_CEIL_CASES for kind in TIE_KINDS
)
AVGPOOL_CEIL_CASES = tuple(_ceil_case(_avgpool_case, *c) for c in POOL2D_CEIL_CASES)

NORMS_ROWS: tuple[OpInfo, ...] = (
    OpInfo(
        "layernorm",
        _layer_reference,
        (
            _layernorm_case((3, 4, 5), (5,)),
            _layernorm_case((2, 3, 4), (3, 4), eps=1e-3),
            _layernorm_case((5, 6), (6,), affine=False),
            _layernorm_case((2, 3, 4), (4,), bias=False),
            _layernorm_case((2, 2, 3, 4), (2, 3, 4), eps=0.5),
        ),
        check_extras=_norm_extras(_layernorm_dims),
    ),
    OpInfo(
        "rmsnorm",
        _layer_reference,
        (
            _rmsnorm_case((3, 4, 5), (5,)),
            _rmsnorm_case((2, 3, 4), (3, 4), eps=1e-3),
            _rmsnorm_case((5, 6), (6,), affine=False),
            _rmsnorm_case((2, 2, 3, 4), (2, 3, 4), eps=0.5),
            _rmsnorm_case((3, 7), (7,), scale=1e-3),  # eps comparable to mean(x**2)
            _rmsnorm_case((2, 3, 6), (6,), eps=1e-6, offset=1.0),  # Gemma's 1 + weight
        ),
        check_extras=_rms_extras,
    ),
    OpInfo(
        "groupnorm",
        _layer_reference,
        (
            _groupnorm_case((2, 6, 4, 3), 3),
            _groupnorm_case((3, 4, 5), 2, eps=1e-3),
            _groupnorm_case((4, 6), 2, affine=False),  # no spatial dims
            _groupnorm_case((2, 4, 3, 2), 1),  # one group: layer norm over C, H, W
        ),
        check_extras=_norm_extras(lambda s: 2, group=True),
    ),
    OpInfo(
        "batchnorm1d",
        _layer_reference,
        tuple(
            _bn1d_case(shape, m, a, t)
            for shape in [(4, 3), (4, 3, 5)]
            for m, a, t in [(0.2, True, True), (None, False, True), (0.2, True, False)]
        )
        + (_bn1d_case((4, 3, 5), defaults=True),),
        eval_reference=_bn_eval_reference,
        check_extras=_bn1d_extras,
    ),
    OpInfo(
        "conv1d",
        _layer_reference,
        tuple(_conv1d_case(*c) for c in CONV1D_CASES) + (Case("defaults", _conv1d_defaults),),
        exact_forward=PLATFORMS,
    ),
    OpInfo(
        "maxpool1d",
        _maxpool1d_reference,
        tuple(_maxpool1d_case(*c, kind) for c in POOL1D_CASES for kind in TIE_KINDS),
        check_extras=_maxpool1d_extras,
        contiguous_grads=True,
        check_mask=_maxpool_mask,
        exact_forward=PLATFORMS,
    ),
    OpInfo(
        "avgpool1d",
        _avgpool1d_reference,
        tuple(_avgpool1d_case(*c) for c in POOL1D_CASES),
        contiguous_grads=True,
        exact_forward=PLATFORMS,
    ),
    OpInfo(
        "adaptive_avgpool1d",
        lambda s, ctx: nn.AdaptiveAvgPool1d(s.kwargs["output_size"])(s.inputs[0]),
        tuple(_adaptive1d_case(*c) for c in [(7, 1), (7, 3), (8, 4), (3, 5)]),
    ),
)


# ---------------------------------------------------------------- the table

_SAME_OP = dict(exact_forward=PLATFORMS, exact_grads=PLATFORMS)  # ipu computes as torch does
_SAME_FORWARD = dict(exact_forward=PLATFORMS)  # ipu's forward is torch's op, its gradient not


# ---------------------------------------------------------------- shape and tensor ops (v2)


def _shape_case(label: str, shape: tuple[int, ...], kwargs: dict, derived: dict | None = None):
    """One input of ``shape`` (randn), the kernel keywords as the shape rule normalises them."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(*shape, dtype=dtype),), kwargs=kwargs, derived=derived or {})

    return Case(label, make)


_CAST_DTYPES = {"f32": F32, "f64": F64, "bf16": torch.bfloat16, "f16": torch.float16}


def _cast_case(target: str) -> Case:
    """x.to(target): the backward casts the gradient back to the sample's dtype."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        source = next(name for name, d in _CAST_DTYPES.items() if d == dtype)
        x = randn(3, 5, dtype=dtype)
        return Sample((x,), kwargs={"dtype": target}, derived={"source": source})

    return Case(f"to-{target}", make)


def _expand_case(label: str, shape: tuple[int, ...], size: tuple, input_shape: tuple) -> Case:
    """expand's N is the step's batch size (2 here, as check_inputs would record it)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        runtime_common._STEP.batch = 2
        x = randn(*shape, dtype=dtype)
        return Sample((x,), kwargs=dict(size=size), derived=dict(input_shape=input_shape))

    return Case(label, make)


def _expand_reference(s: Sample, ctx: Ctx) -> Tensor:
    return s.inputs[0].expand(*(2 if d == "N" else d for d in s.kwargs["size"]))


def _slice_reference(s: Sample, ctx: Ctx) -> Tensor:
    k = s.kwargs
    index = (slice(None),) * k["dim"] + (slice(k.get("start", 0), k.get("end"), k.get("step", 1)),)
    return s.inputs[0][index]


def _matmul_case(label: str, a: tuple[int, ...], b: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        return Sample((randn(*a, dtype=dtype), randn(*b, dtype=dtype)))

    return Case(label, make)


def _softmax_case(label: str, kwargs: dict, scale: float = 1.0) -> Case:
    """scale 80: logits far apart (exp would overflow without the max subtracted)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        x = torch.randn(2, 3, 5, dtype=dtype) * scale
        x[0, 0] = 0.0  # a uniform row
        return Sample((leaf(x),), kwargs=kwargs)

    return Case(label, make)


def _reduce_case(dim: tuple[int, ...], keepdim: bool | None) -> Case:
    kwargs: dict[str, Any] = dict(dim=dim)
    if keepdim is not None:
        kwargs["keepdim"] = keepdim
    label = f"dim{''.join(map(str, dim))}-keep{keepdim}"
    return _shape_case(label, (2, 3, 4, 5), kwargs, dict(input_shape=(3, 4, 5)))


def _reduce_reference(fn: Callable) -> Reference:
    return lambda s, ctx: fn(s.inputs[0], s.kwargs["dim"], keepdim=s.kwargs.get("keepdim", False))


SHAPEOP_ROWS: tuple[OpInfo, ...] = (
    OpInfo(
        "expand",
        _expand_reference,
        (
            _expand_case("batched", (2, 1, 4), (-1, 3, 4), ("N", 1, 4)),
            _expand_case("batched-identity", (2, 3, 4), (-1, -1, -1), ("N", 3, 4)),
            _expand_case("class-token", (1, 1, 4), ("N", -1, -1), (1, 1, 4)),
            _expand_case("new-dims", (1, 4), ("N", 3, 4), (1, 4)),
            _expand_case("new-and-grown", (3, 1), ("N", 2, 3, 5), (3, 1)),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "transpose",
        lambda s, ctx: s.inputs[0].transpose(s.kwargs["dim0"], s.kwargs["dim1"]),
        (
            _shape_case("1-3", (2, 3, 4, 5), dict(dim0=1, dim1=3)),
            _shape_case("3-2", (2, 3, 4, 5), dict(dim0=3, dim1=2)),
            _shape_case("same", (2, 3, 4), dict(dim0=2, dim1=2)),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "permute",
        lambda s, ctx: s.inputs[0].permute(*s.kwargs["dims"]),
        (
            _shape_case("0312", (2, 3, 4, 5), dict(dims=(0, 3, 1, 2)), dict(inverse=(0, 2, 3, 1))),
            _shape_case("0213", (2, 3, 4, 5), dict(dims=(0, 2, 1, 3)), dict(inverse=(0, 2, 1, 3))),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "select",
        lambda s, ctx: s.inputs[0].select(s.kwargs["dim"], s.kwargs["index"]),
        tuple(
            _shape_case(
                f"dim{d}-index{i}", (2, 3, 4), dict(dim=d, index=i), dict(input_shape=(3, 4))
            )
            for d, i in [(2, 0), (2, 3), (2, 1), (1, 2)]
        )
        + (_shape_case("size1", (2, 1, 4), dict(dim=1, index=0), dict(input_shape=(1, 4))),)
        # a free parameter's element (gammas[i]): no batch dim, input_shape is all of it
        + (
            _shape_case("free-vector", (3,), dict(dim=0, index=2), dict(input_shape=(3,))),
            _shape_case("free-rows", (3, 4), dict(dim=0, index=1), dict(input_shape=(3, 4))),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "slice",
        _slice_reference,
        tuple(
            _shape_case(
                f"dim{d}-{a}:{e}:{st}",
                (2, 5, 7),
                dict(dim=d, start=a, end=e, step=st),
                dict(input_shape=(5, 7)),
            )
            for d, a, e, st in [
                (2, 1, 7, 2),
                (2, 0, 7, 3),
                (2, 2, 6, 3),
                (1, 0, 5, 1),
                (1, 4, 5, 1),
                (2, 3, 4, 5),
                (2, 1, 6, 4),
            ]
        )
        + (_shape_case("defaults", (2, 5, 7), dict(dim=1), dict(input_shape=(5, 7))),),
        **_SAME_OP,
    ),
    OpInfo(
        "matmul",
        _two_inputs(torch.matmul),
        (
            _matmul_case("x@W", (2, 3, 4), (4, 5)),
            _matmul_case("rows@W", (2, 4), (4, 5)),
            _matmul_case("4d@2d", (2, 2, 3, 4), (4, 5)),
            _matmul_case("batched", (2, 3, 4), (2, 4, 5)),
            _matmul_case("heads-shared", (2, 2, 3, 4), (2, 4, 5)),
            _matmul_case("W@x", (3, 4), (2, 4, 5)),
            _matmul_case("broadcast-1", (2, 1, 3, 4), (2, 4, 5)),
            _matmul_case("broadcast-b", (2, 3, 4), (1, 4, 5)),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "softmax",
        lambda s, ctx: torch.softmax(s.inputs[0], s.kwargs.get("dim", -1)),
        (
            _softmax_case("last", dict(dim=-1)),
            _softmax_case("dim1", dict(dim=1)),
            _softmax_case("defaults", {}),
            _softmax_case("far-apart", dict(dim=2), 80.0),
        ),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "log_softmax",
        lambda s, ctx: torch.log_softmax(s.inputs[0], s.kwargs.get("dim", -1)),
        (
            _softmax_case("last", dict(dim=-1)),
            _softmax_case("dim1", dict(dim=1)),
            _softmax_case("defaults", {}),
            _softmax_case("far-apart", dict(dim=2), 80.0),
        ),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "mean",
        _reduce_reference(torch.mean),
        tuple(
            _reduce_case(d, k)
            for d, k in [((1,), None), ((2, 3), True), ((1, 2, 3), False), ((1, 3), False)]
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "sum",
        _reduce_reference(torch.sum),
        tuple(
            _reduce_case(d, k)
            for d, k in [((1,), None), ((2, 3), True), ((1, 2, 3), False), ((1, 3), False)]
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "pad",
        lambda s, ctx: F.pad(s.inputs[0], s.kwargs["pad"], value=s.kwargs.get("value", 0.0)),
        (
            _shape_case("last", (2, 3, 4, 5), dict(pad=(1, 2))),
            _shape_case("two", (2, 3, 4, 5), dict(pad=(0, 1, 2, 0))),
            _shape_case("three", (2, 3, 4, 5), dict(pad=(1, 1, 1, 1, 1, 1), value=1.5)),
            _shape_case("zero", (2, 3, 4), dict(pad=(0, 0))),
        ),
        **_SAME_OP,
    ),
)


ROWS: tuple[OpInfo, ...] = (
    OpInfo(
        "conv2d",
        _layer_reference,
        tuple(_conv_case(*c) for c in CONV_CASES) + (Case("defaults", _conv_defaults),),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "conv_transpose2d",
        _layer_reference,
        tuple(_convt_case(*c) for c in CONVT_CASES) + (Case("defaults", _convt_defaults),),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "linear",
        _layer_reference,
        tuple(_linear_case(s, b) for s in [(5, 4), (2, 3, 4), (2, 2, 3, 4)] for b in (True, False)),
        **_SAME_OP,
    ),
    OpInfo(
        "batchnorm2d",
        _layer_reference,
        tuple(_bn_case(m, a) for m in (0.2, None) for a in (True, False))
        + (_bn_case(0.1, True, defaults=True),)
        + BN2D_V2_CASES,
        eval_reference=_bn_eval_reference,
        check_extras=_bn_extras,
    ),
    OpInfo("relu", _one_input(torch.relu), (_activation_case("plain", {}),), **_SAME_OP),
    OpInfo(
        "leaky_relu",
        _leaky_reference,
        (
            _activation_case("slope0.1", {"negative_slope": 0.1}),
            _activation_case("slope0", {"negative_slope": 0.0}),
            _activation_case("defaults", {}),
        ),
        **_SAME_OP,
    ),
    OpInfo("sigmoid", _one_input(torch.sigmoid), (_activation_case("plain", {}),), **_SAME_FORWARD),
    OpInfo("tanh", _one_input(torch.tanh), (_activation_case("plain", {}),), **_SAME_FORWARD),
    OpInfo(
        "gelu",
        _gelu_reference,
        (
            _activation_case("none", {"approximate": "none"}),
            _activation_case("tanh", {"approximate": "tanh"}),
            _activation_case("defaults", {}),
        ),
    ),
    OpInfo(
        "maxpool2d",
        _maxpool_reference,
        tuple(_maxpool_case(*c, kind) for c in MAXPOOL_CASES for kind in TIE_KINDS)
        + MAXPOOL_CEIL_CASES,
        check_extras=_maxpool_extras,
        contiguous_grads=True,
        check_mask=_maxpool_mask,
        **_SAME_FORWARD,
    ),
    OpInfo(
        "avgpool2d",
        _avgpool_reference,
        tuple(_avgpool_case(*c) for c in AVGPOOL_CASES) + AVGPOOL_CEIL_CASES,
        contiguous_grads=True,
        **_SAME_FORWARD,
    ),
    OpInfo(
        "adaptive_avgpool2d",
        _adaptive_reference,
        tuple(_adaptive_case(*c) for c in ADAPTIVE_CASES),
    ),
    OpInfo(
        "upsample",
        _upsample_reference,
        tuple(_upsample_case(*c, hw) for c in UPSAMPLE_CASES for hw in [(5, 4), (7, 9)])
        + (Case("defaults", _upsample_defaults),),
    ),
    OpInfo("add", _two_inputs(torch.add), (_pair_case(), *_BROADCAST_CASES), **_SAME_OP),
    OpInfo("sub", _two_inputs(torch.sub), (_pair_case(), *_BROADCAST_CASES), **_SAME_OP),
    OpInfo("mul", _two_inputs(torch.mul), (_pair_case(), *_BROADCAST_CASES), **_SAME_OP),
    OpInfo("div", _two_inputs(torch.div), (_pair_case(), *_BROADCAST_CASES), **_SAME_OP),
    OpInfo(
        "scale",
        lambda s, ctx: s.inputs[0] * s.kwargs["factor"],
        (
            _shape_case("3d", (2, 3, 4), {"factor": 0.5}),
            _shape_case("neg", (3, 5), {"factor": -3.0}),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "cast",
        lambda s, ctx: s.inputs[0].to(_CAST_DTYPES[s.kwargs["dtype"]]),
        tuple(_cast_case(target) for target in ("bf16", "f16", "f32", "f64")),
        **_SAME_OP,
    ),
    OpInfo(
        "parameter",
        lambda s, ctx: s.layer.pos_embedding,
        (_parameter_case((1, 5, 4)), _parameter_case((7,)), _parameter_case(())),
        **_SAME_OP,
    ),
    OpInfo(
        "concat",
        _concat_reference,
        (_concat_case(1, (2, 3, 1)), _concat_case(2, (1, 3)), _concat_case(None, (2, 2))),
        **_SAME_OP,
    ),
    OpInfo(
        "flatten",
        lambda s, ctx: nn.Flatten(s.kwargs.get("start_dim", 1))(s.inputs[0]),
        (_flatten_case(1), _flatten_case(2), _flatten_case(None)),
        **_SAME_OP,
    ),
    OpInfo(
        "reshape",
        lambda s, ctx: s.inputs[0].reshape(s.inputs[0].shape[0], *s.kwargs["shape"]),
        tuple(_reshape_case(shape) for shape in [(-1,), (4, -1), (6, 2, 5), (-1, 3, 2)]),
        **_SAME_OP,
    ),
    OpInfo(
        "dropout",
        _dropout_reference,
        tuple(_dropout_case(p, sh) for p in (0.3, 0.5, 0.9) for sh in [(4, 50), (2, 3, 5, 4)])
        + tuple(_dropout_case(p, (3, 4)) for p in (0.0, 1.0, None)),
        eval_reference=lambda s: nn.Dropout(s.kwargs.get("p", 0.5)).eval()(s.inputs[0]),
        check_extras=_dropout_extras,
    ),
    OpInfo(
        "moe",
        _moe_reference,
        (
            _moe_case("mixtral", 4, 2),
            _moe_case("mixtral", 3, 1),
            _moe_case("qwen2_moe", 4, 2, norm=False),
            _moe_case("qwen2_moe", 5, 3),
        ),
        exact_grads=(),
        ipu_unsupported="forward",
    ),
    OpInfo(
        "drop_path",
        _drop_path_reference,
        (
            _drop_path_case(0.3, (5,)),
            _drop_path_case(0.5, (2, 3, 4)),
            _drop_path_case(0.4, (3, 2), scale=False),
            _drop_path_case(0.0, (4,)),
        ),
        eval_reference=lambda s: s.inputs[0],
        ipu_unsupported="forward",
        check_extras=_drop_path_extras,
    ),
    OpInfo(
        "cross_entropy",
        lambda s, ctx: F.cross_entropy(*s.inputs, **s.kwargs),
        (_cross_entropy_case(()), _cross_entropy_case((2,)), _cross_entropy_case((2, 4)))
        + CROSS_ENTROPY_V2_CASES,
        check_extras=_cross_entropy_extras,
    ),
    OpInfo(
        # the low-precision logits' path of a mixed precision: checked here in float32 and
        # float64 against F.cross_entropy (its chunked sums round in another order: not bit
        # for bit); on bf16 logits in tests/runtime/test_cross_entropy_low.py
        "cross_entropy_low",
        lambda s, ctx: F.cross_entropy(*s.inputs, **s.kwargs),
        (_cross_entropy_case(()), _cross_entropy_case((2, 4))) + CROSS_ENTROPY_V2_CASES,
        exact_forward=(),
        exact_grads=(),
    ),
    OpInfo("mse_loss", _two_inputs(F.mse_loss), (Case("normal", _two_normal),)),
    OpInfo("l1_loss", _two_inputs(F.l1_loss), (Case("normal", _two_normal),), **_SAME_FORWARD),
    OpInfo(
        "bce_loss",
        _two_inputs(F.binary_cross_entropy),
        (Case("probabilities", _probabilities), Case("extremes", _extreme_probabilities, (F64,))),
    ),
    OpInfo(
        "bce_with_logits",
        _two_inputs(F.binary_cross_entropy_with_logits),
        (Case("probabilities", _probabilities), Case("extremes", _extreme_logits, (F64,))),
    ),
    *SHAPEOP_ROWS,
    OpInfo(
        "scaled_dot_product_attention",
        _sdpa_reference,
        tuple(_sdpa_case(*c) for c in SDPA_CASES)
        + (Case("peaked", _sdpa_peaked),)
        + (_sdpa_gqa_case(4, 2, True), _sdpa_gqa_case(6, 2, False), _sdpa_gqa_case(3, 3, True))
        + (
            _sdpa_bias_case(1, 3, False),
            _sdpa_bias_case(2, 1, True),
            _sdpa_bias_case(2, 3, True),
            _sdpa_bias_case(1, 1, False, kv_heads=1),
            _sdpa_bias_case(1, 3, True, dropout=0.2),
        )
        + (
            _sdpa_dropout_case(False, 4, 0.3),
            _sdpa_dropout_case(True, 2, 0.5),
            _sdpa_dropout_case(True, 4, 0.1),
        ),
        ipu_unsupported="forward",
        eval_reference=_sdpa_eval_reference,
        **_ATTENTION,
    ),
    OpInfo(
        "padded_positions",
        _positions_reference,
        (_positions_case("pad1", 1), _positions_case("pad0", 0)),
        exact_forward=("gpu", "ipu"),
        exact_grads=("gpu", "ipu"),
    ),
    OpInfo(
        "causal_mask",
        _causal_mask_reference,
        (
            _causal_mask_case((2, 3, 5, 5)),
            _causal_mask_case((2, 4, 6)),
            _causal_mask_case((1, 2, 3, 7)),
        ),
        exact_forward=("gpu", "ipu"),
        exact_grads=("gpu", "ipu"),
    ),
    OpInfo(
        "alibi",
        _alibi_reference,
        (
            _alibi_case((2, 8, 5, 5)),
            _alibi_case((1, 3, 2, 7)),  # heads not a power of two: the odd slopes
            _alibi_case((2, 12, 1, 4)),
        ),
        exact_forward=("gpu", "ipu"),
        exact_grads=("gpu", "ipu"),
    ),
    OpInfo(
        "padding_mask",
        _padding_mask_reference,
        (_padding_mask_case("i64", torch.int64), _padding_mask_case("bool", torch.bool)),
        exact_forward=("gpu", "ipu"),
        exact_grads=("gpu", "ipu"),
    ),
    OpInfo(
        "rotary",
        _rotary_reference,
        (
            _rotary_case((2, 3, 5, 8), {}),
            _rotary_case((1, 2, 7, 4), {"theta": 500000.0}),
            _rotary_case((2, 1, 3, 6), {"theta": 10.0, "scaling": 0.75}),
            _rotary_case((1, 1, 40, 2), {"theta": 10000.0}),  # many positions, one pair
        ),
        exact_forward=("gpu", "ipu"),
        exact_grads=("gpu", "ipu"),
    ),
    OpInfo(
        "multihead_attention",
        _mha_reference,
        tuple(_mha_case(*c) for c in MHA_CASES),
        **_ATTENTION,
    ),
    *NORMS_ROWS,
)

V2_ROWS: tuple[OpInfo, ...] = (
    OpInfo(
        "relu6",
        _one_input(F.relu6),
        (_wide_case("edges", {}, _HARD_EDGES),),
        **_SAME_OP,
    ),
    OpInfo(
        "hardtanh",
        _kwarg_reference(F.hardtanh),
        (
            _wide_case("defaults", {}, _HARD_EDGES),
            _wide_case("range-2-3", {"min_val": -2.0, "max_val": 3.0}, (-2.0, 3.0, 0.0, 2.9)),
            _wide_case("empty-range", {"min_val": 0.5, "max_val": 0.5}, (0.5, 0.4, 0.6)),
        ),
        **_SAME_OP,
    ),
    OpInfo(
        "hardsigmoid",
        _one_input(F.hardsigmoid),
        (_wide_case("edges", {}, _HARD_EDGES),),
        **_SAME_OP,
    ),
    OpInfo(
        "hardswish",
        _one_input(F.hardswish),
        (_wide_case("edges", {}, _HARD_EDGES),),
        **_SAME_OP,
    ),
    OpInfo(
        "silu",
        _one_input(F.silu),
        (_wide_case("edges", {}, (0.0, 1e-300, 40.0, -40.0, 800.0, -800.0)),),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "mish",
        _one_input(F.mish),
        (_wide_case("edges", {}, (0.0, 1e-300, 25.0, -25.0, 800.0, -800.0)),),
    ),
    OpInfo(
        "elu",
        _kwarg_reference(F.elu),
        (
            _wide_case("defaults", {}, (0.0, -1e-300, 1e-300, -50.0, 800.0)),
            _wide_case("alpha0.5", {"alpha": 0.5}, (0.0, -1e-300, -50.0)),
            _wide_case("alpha-neg", {"alpha": -1.5}, (0.0, -3.0)),
        ),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "softplus",
        _kwarg_reference(F.softplus),
        (
            _wide_case("defaults", {}, (20.0, 20.000001, 19.99, 0.0, -800.0, 800.0)),
            _wide_case("beta2-t3", {"beta": 2.0, "threshold": 3.0}, (1.5, 1.4999, 1.5001)),
            _wide_case("beta0.5-t1", {"beta": 0.5, "threshold": 1.0}, (2.0, -2.0)),
        ),
        **_SAME_FORWARD,
    ),
    OpInfo(
        "nll_loss",
        lambda s, ctx: F.nll_loss(*s.inputs, **s.kwargs),
        NLL_CASES,
    ),
    OpInfo("embedding", _layer_reference, EMBEDDING_CASES, **_SAME_FORWARD),
    OpInfo("embedding_rows", _embedding_rows_reference, EMBEDDING_ROWS_CASES, **_SAME_OP),
    OpInfo("relative_position_bias", _relative_bias_reference, RELATIVE_BIAS_CASES),
    OpInfo(
        "transposed_linear",
        _transposed_linear_reference,
        TRANSPOSED_LINEAR_CASES,
        **_SAME_OP,
    ),
)


# ---------------------------------------------------------------- recurrent layers


def _recurrent_case(
    cls: type, layers: int, bidirectional: bool, states: int, bias: bool = True
) -> Case:
    """torch.nn.LSTM / GRU (batch first) on x [2, 5, 3]; ``states`` initial states given,
    batch first [N, S, H] as the language has them (the reference transposes them)."""

    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        layer = cls(3, 4, layers, bias=bias, batch_first=True, bidirectional=bidirectional)
        stacks = layers * (2 if bidirectional else 1)
        given = [randn(2, stacks, 4, dtype=dtype) for _ in range(states)]
        kwargs = dict(num_layers=layers, bidirectional=bidirectional)
        return Sample(
            (randn(2, 5, 3, dtype=dtype), *given),
            layer.to(dtype),
            kwargs,
            {"initial_states": states},
            exact_forward=(),
        )

    label = f"l{layers}-{'bi' if bidirectional else 'uni'}-states{states}"
    return Case(f"{label}-{'bias' if bias else 'nobias'}", make)


def _recurrent_reference(s: Sample, ctx: Ctx) -> Tensor:
    x, *states = s.inputs
    hx = [t.transpose(0, 1) for t in states]
    if isinstance(s.layer, nn.LSTM):
        if len(hx) == 1:  # the kernel's c0 is zeros when only h0 is given
            hx.append(torch.zeros_like(hx[0]))
        return s.layer(x, tuple(hx) if hx else None)[0]
    return s.layer(x, hx[0] if hx else None)[0]


RECURRENT_ROWS: tuple[OpInfo, ...] = tuple(
    OpInfo(
        name,
        _recurrent_reference,
        (
            _recurrent_case(cls, 1, False, 0),
            _recurrent_case(cls, 2, True, most),
            _recurrent_case(cls, 2, False, 1, bias=False),
            _recurrent_case(cls, 1, True, most, bias=False),
        ),
        exact_forward=(),
        exact_grads=(),
    )
    for name, cls, most in (("lstm", nn.LSTM, 2), ("gru", nn.GRU, 1))
)


def _aten_case(label: str, op: str, call: str, *shapes: tuple[int, ...]) -> Case:
    def make(dtype: torch.dtype) -> Sample:
        _seeded()
        inputs = tuple(randn(*shape, dtype=dtype) for shape in shapes)
        return Sample(inputs, kwargs={"op": op, "call": call}, derived={"random": False})

    return Case(label, make)


def _aten_reference(s: Sample, ctx: Ctx) -> Tensor:
    """The ATen call itself, under autograd: what the opaque statement must reproduce."""
    name, overload = s.kwargs["op"].split(".")[1:]
    tensors = {f"t{i}": t for i, t in enumerate(s.inputs)}
    args, kwargs = eval(f"(lambda *a, **k: (a, k))({s.kwargs['call']})", {}, tensors)
    return getattr(getattr(torch.ops.aten, name), overload)(*args, **kwargs)


#: The importer's exact fallback for an ATen op no registry operator covers (ipu refuses it).
ATEN_ROWS: tuple[OpInfo, ...] = (
    OpInfo(
        "aten",
        _aten_reference,
        (
            _aten_case(
                "baddbmm",
                "aten.baddbmm.default",
                "t0, t1, t2, beta=0.5, alpha=2.0",
                (2, 3, 4),
                (2, 3, 5),
                (2, 5, 4),
            ),
            _aten_case("cumsum", "aten.cumsum.default", "t0, 1", (2, 6)),
        ),
        exact_grads=(),
        ipu_unsupported="forward",
    ),
)

ROWS += V2_ROWS
ROWS += RECURRENT_ROWS
ROWS += ATEN_ROWS

BY_NAME: dict[str, OpInfo] = {row.name: row for row in ROWS}


def normalized_defaults(op: OpSpec) -> dict[str, Any]:
    """The registry defaults of ``op``'s arguments in the form the graph hands kernels
    (``graph.normalize_arg``: a pair default 1 is (1, 1)); arguments without one (required,
    or defaulting from another argument) are left out."""
    loc = Loc(1, 1)
    return {
        name: normalize_arg(op.name, spec, spec.default, loc)
        for name, spec in op.args.items()
        if not spec.required and spec.default_from is None
    }
