"""What the ``gpu`` and ``ipu`` runtime modules share: one copy, imported by both.

Three kinds of code live here, so that a fix reaches both platforms at once:

* the helpers generated code calls around the kernels (``add_layer``, ``layers``,
  ``tensors``, ``check_inputs``, ``collect``, the ``stash`` accounting);
* the ``needs`` / gradient-padding helpers every backward kernel uses (``_need``, ``_fit``,
  ``_need_mask``) and the accessors that read a layer handle's parameters and buffers;
* every kernel whose code is the same on both platforms. These use only operations PopTorch
  runs on the IPU, because ``unroller.runtime.ipu`` takes them: ``unroll lint --platform ipu``
  follows its star import of ``unroller.runtime.shared`` to each name this module offers,
  and checks it with what it uses.

Kernel conventions (both platforms):

* forward: ``op(*inputs, [layer], **kernel_args)`` returns the output, or ``(output, *extras)``;
  ``layer`` is the module holding the op's parameters and buffers as attributes (registry
  names: ``weight``, ``bias``, ``running_mean``, ...), for the ops that have any.
* backward: ``op_backward(g, *saved, **backward_args, needs)``: ``saved`` in the registry's
  order with its parameter entries replaced by one ``layer`` (at the first one's place);
  returns one gradient per input then one per parameter, ``None`` where ``needs`` says so.
* every keyword with a registry default has that default (normalised as the graph gives it),
  because the code generator leaves out arguments equal to their default.

``__all__`` is what both platforms take from here, through ``unroller.runtime.shared``.
Gradient accumulation into ``.grad`` (``accumulate``, ``accumulate_fresh``) is not here but
``gpu``'s own: it allocates with ``torch.empty_like`` and runs only on the host platform
(the IPU hands gradients to PopTorch through ``collect``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from unroller.compiler.dtypes import is_float, torch_dtype
from unroller.runtime.cast_cache import CastLayer
from unroller.runtime.cast_cache import cast_layer as _cast_layer

Pair = tuple[int, int]
Needs = tuple[bool, ...]
Grads = tuple[Tensor | None, ...]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
# aten's hardsigmoid_backward multiplies by scalar_t(1.0f / 6.0f): a float32 1/6, in float64 too
_ONE_SIXTH_F32 = struct.unpack("f", struct.pack("f", 1.0 / 6.0))[0]
#: The batch size of the step (or prediction) running now in this thread, recorded by
#: ``check_inputs`` at its entry: expand(size=(N, ...)) of a tensor without the batch dim
#: reads it (shapeops.expand). Per thread, so models stepping in parallel threads do not
#: see each other's batch.
_STEP = threading.local()
_RUNTIME_PACKAGE = "unroller.runtime."


# ---------------------------------------------------------------- needs and gradient padding


def _need(needs: Needs | None, i: int) -> bool:
    """Whether gradient ``i`` is wanted; a short ``needs`` wants nothing past its end, and
    None (the default, which generated code leaves out) wants every one."""
    return needs is None or (i < len(needs) and bool(needs[i]))


def _need_mask(needs: Needs | None, n: int = 3) -> list[bool]:
    """``needs`` as the fixed-length ``output_mask`` aten backward kernels take."""
    return [_need(needs, i) for i in range(n)]


def _widened(t: Tensor) -> Tensor:
    """``t`` in float32 (float64 stays float64): what a low-precision input is computed in
    where a mixed precision keeps an op in float32 (cross_entropy_low)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def _fit(grads: Iterable[Tensor | None], needs: Needs | None) -> Grads:
    """One entry per element of ``needs``: the gradient where needed, else None, so a kernel
    never hands back a gradient nobody asked for (the caller would accumulate it); with
    ``needs`` None, every gradient the kernel made."""
    if needs is None:
        return tuple(grads)
    out = list(grads)[: len(needs)]
    out += [None] * (len(needs) - len(out))
    return tuple(t if _need(needs, i) else None for i, t in enumerate(out))


# ---------------------------------------------------------------- layer handles


# A torch.nn.Module's tensors are read from its parameter and buffer dicts: attribute
# syntax would go through Module.__getattr__, a few microseconds each, hundreds of times
# per step. Any other object with the attributes works too. Literal names throughout, so
# that `unroll lint` sees every attribute read.


def _dicts(layer: Any) -> tuple[dict, dict] | None:
    params = getattr(layer, "_parameters", None)
    return (params, layer._buffers) if isinstance(params, dict) else None


def _weight_bias(layer: Any) -> tuple[Tensor, Tensor | None]:
    """A conv / linear layer's parameters; ``bias`` may be absent or None (bias=False)."""
    found = _dicts(layer)
    if found is not None:
        return found[0]["weight"], found[0].get("bias")
    return layer.weight, getattr(layer, "bias", None)


def _norm_tensors(layer: Any) -> tuple[Tensor | None, ...]:
    """A batch-norm layer's (weight, bias, running_mean, running_var, num_batches_tracked);
    each may be None, as in nn.BatchNorm2d(affine=False, track_running_stats=False)."""
    found = _dicts(layer)
    if found is not None:
        params, buffers = found
        return (
            params.get("weight"),
            params.get("bias"),
            buffers.get("running_mean"),
            buffers.get("running_var"),
            buffers.get("num_batches_tracked"),
        )
    return (
        getattr(layer, "weight", None),
        getattr(layer, "bias", None),
        getattr(layer, "running_mean", None),
        getattr(layer, "running_var", None),
        getattr(layer, "num_batches_tracked", None),
    )


def _running_stats_used(
    layer: Any, running_mean: Tensor | None, running_var: Tensor | None
) -> bool:
    """Whether a batch-norm layer normalises with its running statistics in a training step,
    as torch.nn's batch norm decides: its module in eval mode (``training`` False) and
    running statistics tracked. Nothing is updated then, and the backward is eval-mode
    batch norm's (each sample on its own). A handle without the flag trains."""
    if getattr(layer, "training", True):
        return False
    return running_mean is not None or running_var is not None


# ---------------------------------------------------------------- attention scaling


def _attention_factors(embed: int, scale: float | None) -> tuple[float, float]:
    """The factors ATen's math attention multiplies q and k^T by: each is the square root of
    the softmax scale (1 / sqrt(E) when None), so that q k^T * scale is formed from two
    better-scaled operands; a negative scale puts its sign on q's factor. Computed in
    double precision as ATen does (sdp::calculate_scale, then sqrt)."""
    softmax_scale = 1.0 / math.sqrt(embed) if scale is None else scale
    root = math.sqrt(abs(softmax_scale))
    return (-root if softmax_scale < 0 else root), root


# ---------------------------------------------------------------- kernels shared by both


def linear(x: Tensor, layer: Any) -> Tensor:
    """F.linear; the backward reads x and the layer's weight."""
    weight, bias = _weight_bias(layer)
    return torch.nn.functional.linear(x, weight, bias)


def linear_backward(g: Tensor, x: Tensor, layer: Any, *, needs: Needs | None = None) -> Grads:
    """gx = g @ W, gW = g^T @ x over the flattened leading dims (mm_mat2_backward's order:
    matmul of two matrices is aten::mm), gb = the sum of g over them."""
    weight = layer.weight
    gx = g.matmul(weight) if _need(needs, 0) else None
    g2 = g.reshape(-1, g.shape[-1])
    gw = g2.t().matmul(x.reshape(-1, x.shape[-1])) if _need(needs, 1) else None
    gb = g2.sum(0) if _need(needs, 2) else None
    return _fit((gx, gw, gb), needs)


def relu(x: Tensor) -> Tensor:
    """torch.relu; the backward reads the output (or its mask y > 0)."""
    return torch.relu(x)


def relu_mask(y: Tensor) -> Tensor:
    """What relu's backward needs of its output: y > 0, one bit per element when packed."""
    return y > 0


def sigmoid(x: Tensor) -> Tensor:
    """torch.sigmoid; the backward reads the output."""
    return torch.sigmoid(x)


def tanh(x: Tensor) -> Tensor:
    """torch.tanh; the backward reads the output."""
    return torch.tanh(x)


def leaky_relu_mask(x: Tensor, *, negative_slope: float = 0.01) -> Tensor:
    """What leaky_relu's backward needs of its input: x > 0 (the slope is not needed)."""
    return x > 0


Shape = tuple[int | str, ...]


def _sum_to(g: Tensor, shape: Shape | None) -> Tensor:
    """``g`` summed down to ``shape`` (an operand that was broadcast), as autograd's sum_to:
    the leading dims it lacks and its size-1 dims, in one keepdim sum, then a reshape.
    None: the operand had the output's shape. ``"N"`` in ``shape`` is the batch size."""
    if shape is None:
        return g
    lead = g.dim() - len(shape)
    dims = list(range(lead))
    dims += [lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1]
    if dims:
        g = g.sum(dims, keepdim=True)
    if lead:
        g = g.reshape([g.shape[0] if d == "N" else d for d in shape])
    return g


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b, broadcasting as torch; saves nothing."""
    return a + b


def add_backward(
    g: Tensor,
    *,
    a_shape: Shape | None = None,
    b_shape: Shape | None = None,
    needs: Needs | None = None,
) -> Grads:
    """Both gradients are g itself (shared: accumulate() copies before any in-place add),
    summed down to an operand's shape where it was broadcast."""
    return (
        _sum_to(g, a_shape) if _need(needs, 0) else None,
        _sum_to(g, b_shape) if _need(needs, 1) else None,
    )


def sub(a: Tensor, b: Tensor) -> Tensor:
    """a - b, broadcasting as torch; saves nothing."""
    return a - b


def sub_backward(
    g: Tensor,
    *,
    a_shape: Shape | None = None,
    b_shape: Shape | None = None,
    needs: Needs | None = None,
) -> Grads:
    """(g, -g), each summed down to its operand's shape."""
    return (
        _sum_to(g, a_shape) if _need(needs, 0) else None,
        _sum_to(-g, b_shape) if _need(needs, 1) else None,
    )


def mul(a: Tensor, b: Tensor) -> Tensor:
    """a * b, broadcasting as torch; the backward reads both factors."""
    return a * b


def mul_backward(
    g: Tensor,
    a: Tensor,
    b: Tensor,
    *,
    a_shape: Shape | None = None,
    b_shape: Shape | None = None,
    needs: Needs | None = None,
) -> Grads:
    """(g * b, g * a), out of place (a and b may be the same tensor), each summed down to
    its operand's shape."""
    return (
        _sum_to(g * b, a_shape) if _need(needs, 0) else None,
        _sum_to(g * a, b_shape) if _need(needs, 1) else None,
    )


def div(a: Tensor, b: Tensor) -> Tensor:
    """a / b, broadcasting as torch; the backward reads both."""
    return a / b


def div_backward(
    g: Tensor,
    a: Tensor,
    b: Tensor,
    *,
    a_shape: Shape | None = None,
    b_shape: Shape | None = None,
    needs: Needs | None = None,
) -> Grads:
    """(g / b, -g * ((a / b) / b)): autograd's formulas, each summed down to its operand."""
    return (
        _sum_to(g / b, a_shape) if _need(needs, 0) else None,
        _sum_to(-g * ((a / b) / b), b_shape) if _need(needs, 1) else None,
    )


def padded_positions(ids: Tensor, *, padding_idx: int) -> Tensor:
    """Position ids from token ids: each non-padding token's count of non-padding tokens up
    to it, plus padding_idx; padding tokens get padding_idx (RoBERTa's positions). Integer
    arithmetic, so exact on every platform; no gradient."""
    mask = (ids != padding_idx).to(torch.int32)
    return (torch.cumsum(mask, dim=1).to(torch.int32) * mask).to(torch.int64) + padding_idx


def padded_positions_backward(g: Tensor, *, padding_idx: int, needs: Needs | None = None) -> Grads:
    """Never called: integer positions carry no gradient (the kernel pair's other half)."""
    return _fit((None,), needs)


def padding_mask(mask: Tensor, *, invert: bool = False) -> Tensor:
    """An additive score bias [N, 1, 1, S] from a padding mask [N, S] (nonzero attends, 0 is
    padding, as Hugging Face's attention_mask; ``invert``: nonzero is padding, as
    nn.MultiheadAttention's key_padding_mask): 0 where attended, float32's lowest where
    padded. Finite so that a row of padding only stays a number; added to scores of any
    float dtype it makes those probabilities exactly 0 (exp underflows), as Hugging Face's
    lowest-filled or boolean masks (and torch's -inf) do. No gradient (integer input)."""
    bias = mask.new_zeros(mask.shape, dtype=torch.float32)
    bias = bias.masked_fill_((mask != 0) if invert else (mask == 0), torch.finfo(torch.float32).min)
    return bias.unsqueeze(1).unsqueeze(1)


def _causal_keep(x: Tensor) -> Tensor:
    """[L, S]: True where a query (row) may see a key (column), as a causal mask of L
    queries ending at the last of S keys."""
    rows, cols = x.shape[-2:]
    query = torch.arange(cols - rows, cols, device=x.device).unsqueeze(1)
    return torch.arange(cols, device=x.device).unsqueeze(0) <= query


def causal_mask(x: Tensor) -> Tensor:
    """The scores with the causal mask added as Hugging Face's eager attention adds it (0,
    or the dtype's lowest, which the add leaves exactly so): masked entries set to lowest."""
    return x.masked_fill(~_causal_keep(x), torch.finfo(x.dtype).min)


def causal_mask_backward(g: Tensor, *, needs: Needs | None = None) -> Grads:
    """The gradient where a key is seen, 0 where it is masked."""
    return _fit((g.masked_fill(~_causal_keep(g), 0) if _need(needs, 0) else None,), needs)


def padding_mask_backward(g: Tensor, *, invert: bool = False, needs: Needs | None = None) -> Grads:
    """Never called: an integer padding mask carries no gradient."""
    return _fit((None,), needs)


def scale(x: Tensor, *, factor: float) -> Tensor:
    """x * factor (a constant); saves nothing."""
    return x * factor


def scale_backward(g: Tensor, *, factor: float, needs: Needs | None = None) -> Grads:
    """g * factor."""
    return (g * factor if _need(needs, 0) else None,)


def concat(*xs: Tensor, dim: int = 1) -> Tensor:
    """torch.cat; saves nothing."""
    return torch.cat(xs, dim)


def concat_backward(
    g: Tensor, *, dim: int = 1, sizes: tuple[int, ...], needs: Needs | None = None
) -> Grads:
    """Views of g along dim (torch.split), as cat's backward (narrow)."""
    parts = torch.split(g, list(sizes), dim)
    return tuple(part if _need(needs, i) else None for i, part in enumerate(parts))


def flatten(x: Tensor, *, start_dim: int = 1) -> Tensor:
    """torch.flatten (a reshape: resolved before the IPU); saves nothing."""
    return torch.flatten(x, start_dim)


def flatten_backward(
    g: Tensor, *, input_shape: tuple[int, ...], needs: Needs | None = None
) -> Grads:
    """g reshaped to (N, *input_shape)."""
    return (g.reshape(g.shape[0], *input_shape) if _need(needs, 0) else None,)


def reshape(x: Tensor, *, shape: tuple[int, ...]) -> Tensor:
    """x.reshape(N, *shape), keeping the batch dim; saves nothing."""
    return x.reshape(x.shape[0], *shape)


def reshape_backward(
    g: Tensor, *, input_shape: tuple[int, ...], needs: Needs | None = None
) -> Grads:
    """g reshaped to (N, *input_shape)."""
    return (g.reshape(g.shape[0], *input_shape) if _need(needs, 0) else None,)


def dropout_eval(x: Tensor, *, p: float = 0.5) -> Tensor:
    """Identity, as nn.Dropout.eval()."""
    return x


def drop_path_eval(x: Tensor, *, p: float = 0.0, scale: bool = True) -> Tensor:
    """Identity, as stochastic depth at inference."""
    return x


def l1_loss(a: Tensor, b: Tensor) -> Tensor:
    """As F.l1_loss: (a - b).abs().mean() (l1_loss is a composite op)."""
    return (a - b).abs().mean()


def parameter(layer: Any, *, name: str) -> Tensor:
    """A free parameter's tensor, read from the module holding it (its parent path, a
    torch.nn.Module: add_layer registered the parameter in its dict)."""
    return layer._parameters[name]


def parameter_backward(g: Tensor, *, needs: Needs | None = None) -> Grads:
    """The gradient is what flows in: its consumers already reduced it to the parameter's
    shape (summed over the batch where they broadcast it)."""
    return _fit((g,), needs)


# ---------------------------------------------------------------- Hugging Face layers (shared)
#
# The two layer forms Hugging Face models use beyond torch.nn's: a position (or token type)
# table read at constant rows, and Conv1D (GPT-2's c_attn, c_proj, c_fc), a linear layer
# whose weight is stored [in_features, out_features]. Views, cats, addmm and matmul: the
# same operations on both platforms (PopTorch runs them; no index_put).


def embedding_rows(layer: Any, *, length: int, start: int = 0) -> Tensor:
    """Rows start .. start+length-1 of the layer's table, a view (no batch dim), as
    ``weight[start:start + length]``; the backward reads nothing."""
    return _weight_bias(layer)[0].narrow(0, start, length)


def embedding_rows_backward(
    g: Tensor, *, num_embeddings: int, start: int = 0, needs: Needs | None = None
) -> Grads:
    """The table's gradient: g (its consumers already summed it over the batch) between
    zero rows, joined by torch.cat, constant sizes (aten's slice_backward's values, a copy
    into zeros, bit for bit)."""
    if not _need(needs, 0):
        return _fit((None,), needs)
    after = num_embeddings - start - g.shape[0]
    parts = [g]
    if start:
        parts.insert(0, g.new_zeros((start, g.shape[1])))
    if after:
        parts.append(g.new_zeros((after, g.shape[1])))
    return _fit((torch.cat(parts, 0) if len(parts) > 1 else g,), needs)


def transposed_linear(x: Tensor, layer: Any) -> Tensor:
    """Hugging Face's Conv1D: addmm(bias, x as [-1, in_features], weight) viewed back to x's
    leading dims (x @ weight without a bias); the backward reads x and the weight."""
    weight, bias = _weight_bias(layer)
    x2 = x.reshape(-1, x.shape[-1])
    y = x2.matmul(weight) if bias is None else torch.addmm(bias, x2, weight)
    return y.reshape(*x.shape[:-1], weight.shape[1])


def transposed_linear_backward(
    g: Tensor, x: Tensor, layer: Any, *, needs: Needs | None = None
) -> Grads:
    """addmm's gradients over the flattened leading dims, in autograd's order
    (mm_mat1_backward, mm_mat2_backward, sum_to for the bias): gx = g @ W^T,
    gW = x^T @ g, gb = the sum of g's rows."""
    weight = _weight_bias(layer)[0]
    g2 = g.reshape(-1, g.shape[-1])
    gx = g2.matmul(weight.t()).reshape(x.shape) if _need(needs, 0) else None
    gw = x.reshape(-1, x.shape[-1]).t().matmul(g2) if _need(needs, 1) else None
    gb = g2.sum(0) if _need(needs, 2) else None
    return _fit((gx, gw, gb), needs)


# ---------------------------------------------------------------- v2 activations (shared)
#
# Forwards that are one torch.nn.functional call on both platforms (PopTorch runs Hardtanh,
# SiLU, ELU and Softplus; on the CPU and CUDA each is the aten op autograd records), and
# the 1-bit mask kernels: relu6, hardtanh and hardsigmoid's gradients depend on x only
# through whether it lies strictly inside the linear range.


def relu6(x: Tensor) -> Tensor:
    """F.relu6 is aten::hardtanh(x, 0, 6); the backward reads x (or its mask 0 < x < 6)."""
    return torch.nn.functional.hardtanh(x, 0.0, 6.0)


def relu6_mask(x: Tensor) -> Tensor:
    """0 < x < 6, as hardtanh_backward decides (NaN counts as inside: its gradient passes)."""
    return ~((x <= 0.0) | (x >= 6.0))


def hardtanh(x: Tensor, *, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """F.hardtanh; the backward reads x (or its mask min_val < x < max_val)."""
    return torch.nn.functional.hardtanh(x, min_val, max_val)


def hardtanh_mask(x: Tensor, *, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """min_val < x < max_val, written as aten's hardtanh_backward tests it (x <= min or
    x >= max gives 0), so a NaN lets the gradient through on both paths."""
    return ~((x <= min_val) | (x >= max_val))


def hardsigmoid_mask(x: Tensor) -> Tensor:
    """-3 < x < 3: where hardsigmoid's derivative is 1/6 (0 elsewhere, and for NaN)."""
    return (x > -3.0) & (x < 3.0)


def silu(x: Tensor) -> Tensor:
    """F.silu (aten::silu); the backward reads x."""
    return torch.nn.functional.silu(x)


def elu(x: Tensor, *, alpha: float = 1.0) -> Tensor:
    """F.elu (aten::elu, scale 1, input_scale 1); the backward reads x, as autograd's
    out-of-place elu does (elu_backward with is_result=False)."""
    return torch.nn.functional.elu(x, alpha)


def softplus(x: Tensor, *, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """F.softplus (aten::softplus); the backward reads x."""
    return torch.nn.functional.softplus(x, beta, threshold)


def unsupported(op_name: str, args: Mapping[str, Any]) -> str | None:
    """Why a node with these args cannot run on this platform, or None: every op and argument
    runs here. The code generator asks before emitting a call (ipu overrides this)."""
    return None


# ---------------------------------------------------------------- helpers for generated code


def collect(
    grads: dict[str, Tensor], layers: Layers | LayersView, name: str, /, **named: Tensor | None
) -> None:
    """Store each non-None ``param=grad`` of layer ``name`` as ``grads["<path>.<param>"]``
    (state-dict names; ``layers`` may be a block's scoped view): the ipu step returns them
    through its surrogate loss instead of writing .grad, because PopTorch owns the
    optimizer step. A layer called more than once (``shares=``) collects into the same
    name: the calls' gradients add up, as they do in ``.grad``.

    Each gradient is stored in its parameter's dtype: a mixed precision's low-dtype op reads
    its float32 weights through the cast cache (``L.cast``) and gives float16 gradients,
    which come back to float32 here (the cast's backward) before they add up, as autograd
    adds them into a float32 ``.grad``."""
    path = layers.path(name)
    own = layers[name]._parameters
    for param, grad in named.items():
        if grad is not None:
            weight = own.get(param)
            if weight is not None and grad.dtype != weight.dtype:
                grad = grad.to(weight.dtype)
            key = _join(path, param)
            grads[key] = grads[key] + grad if key in grads else grad


def free_parameter(  # unroller-lint: host-only (runs when the model is built)
    shape: tuple[int, ...], init: str = "zeros", std: float = 0.02, bound: float = 0.0
) -> torch.nn.Parameter:
    """A free parameter of the model language (``parameter(shape=..., init=...)``), made on
    the host when the model is built: zeros, ones, normal(0, std) or uniform(-bound, bound)."""
    tensor = torch.empty(shape)
    with torch.no_grad():
        if init == "zeros":
            tensor.zero_()
        elif init == "ones":
            tensor.fill_(1.0)
        elif init == "normal":
            tensor.normal_(0.0, std)
        elif init == "uniform":
            tensor.uniform_(-bound, bound)
        else:
            raise ValueError(f"free_parameter: unknown init {init!r}")
    return torch.nn.Parameter(tensor)


def transposed_linear_layer(  # unroller-lint: host-only (runs when the model is built)
    in_features: int, out_features: int, bias: bool = True
) -> torch.nn.Module:
    """The module holding a ``transposed_linear`` layer's tensors as Hugging Face's Conv1D
    does (state-dict keys weight [in_features, out_features], bias [out_features]),
    initialised as Conv1D: weight normal(0, 0.02), bias zeros."""
    return _TransposedLinear(in_features, out_features, bias)


class _TransposedLinear(torch.nn.Module):
    """transposed_linear's parameters (Conv1D's); the kernels compute, never ``forward``."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        weight = torch.empty(in_features, out_features)
        self.weight = torch.nn.Parameter(torch.nn.init.normal_(weight, 0.0, 0.02))
        bias_value = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        self.register_parameter("bias", bias_value)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, bias={self.bias is not None}"


def tie(root: torch.nn.Module, key: str, source: str) -> None:  # unroller-lint: host-only (set-up)
    """Make the parameter at state-dict ``key`` the tensor at ``source`` (``tied_PARAM=``),
    as ``lm_head.weight = embed.weight`` does in torch: both keys stay in the state dict,
    one tensor holds them, and each use's gradient adds into its one ``.grad``."""
    path, _, name = key.rpartition(".")
    owner = root.get_submodule(path) if path else root
    if name not in owner._parameters:
        raise ValueError(f"tie: {key} is not a parameter")
    owner._parameters[name] = root.get_parameter(source)


def freeze(root: torch.nn.Module, key: str) -> None:  # unroller-lint: host-only (set-up)
    """The parameter at state-dict ``key`` does not train (``frozen=true``): the step never
    computes its gradient, and ``requires_grad`` off tells optimizers and torch the same."""
    root.get_parameter(key).requires_grad_(False)


def add_layer(
    root: torch.nn.Module, path: str, module: torch.nn.Module | torch.nn.Parameter
) -> None:
    """Attach `module` at the dotted `path` of `root`, creating plain nn.Module containers for
    missing intermediate parts, so that root.state_dict() has keys "<path>.<name>".

    Children are written into ``_modules`` directly, not through ``add_module``/``setattr``:
    ``add_module`` refuses a name that is already an attribute of the module ("forward",
    "training", "double", a method of a subclass such as "predict"), and attribute syntax
    cannot spell a keyword or a digit ("class", "0"). state_dict, load_state_dict,
    named_parameters, named_buffers, .to() and .double() all walk ``_modules``, so they work
    with any such name; only attribute access ``root.forward`` still finds the method. One
    caveat: a child named "training" makes its parent's ``.train()``/``.eval()`` raise,
    because nn.Module.__setattr__ refuses to assign the bool flag over a child's name.
    """
    parts = path.split(".")
    if not all(parts):
        raise ValueError(f"add_layer: bad path {path!r}")
    node = root
    for part in parts[:-1]:
        child = node._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            node._modules[part] = child
        node = child
    if isinstance(module, torch.nn.Parameter):  # a free parameter: held by the parent
        node._parameters[parts[-1]] = module
        return
    placeholder = node._modules.get(parts[-1])
    if placeholder is not None and type(placeholder) is torch.nn.Module:
        # a container made for names under this path earlier (a free parameter
        # "enc.pos" before the layer "enc"): the layer takes over what it holds
        module._modules.update(placeholder._modules)
        module._parameters.update(placeholder._parameters)
    node._modules[parts[-1]] = module


class Layers(dict):
    """Layer handles by dotted name; ``within(prefix)`` is a block instance's view.

    Generated code indexes it (``L["layer1.0.conv1"]``); a block function gets the view
    of its instance (``L.within("layer1.0")["conv1"]`` is the same module) and ``path``
    gives a name's full state-dict prefix back. A view is two fields, made per call.
    """

    def within(self, prefix: str) -> LayersView:
        return LayersView(self, prefix)

    def path(self, name: str) -> str:
        return name

    def cast(self, name: str, dtype: torch.dtype) -> CastLayer:
        """The layer with its float parameters in ``dtype``, cast once per step (a mixed
        precision's low-dtype ops read their weights so: ``unroller.runtime.cast_cache``)."""
        cache = self.__dict__.setdefault("cast_cache", {})
        return _cast_layer(cache, self[name], dtype, name)


class LayersView:
    """The layers under one prefix, by their names relative to it."""

    __slots__ = ("root", "prefix")

    def __init__(self, root: Layers, prefix: str):
        self.root, self.prefix = root, prefix

    def __getitem__(self, name: str) -> torch.nn.Module:
        return self.root[self.path(name)]

    def within(self, prefix: str) -> LayersView:
        return LayersView(self.root, self.path(prefix))

    def cast(self, name: str, dtype: torch.dtype) -> CastLayer:
        return self.root.cast(self.path(name), dtype)

    def path(self, name: str) -> str:
        return _join(self.prefix, name)


def _join(prefix: str, name: str) -> str:
    """A dotted path under ``prefix``; "" is the model itself (a free parameter's holder)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def layers(root: torch.nn.Module) -> Layers:
    """Dotted name -> submodule (shared ones under every name), the layer handles kernels
    take. Rebuilt on each call, like ``tensors``, so nothing stale survives .to()/.double();
    read through ``_modules``, so names add_layer allowed ("forward", "0") work too."""
    found = root.named_modules(remove_duplicate=False)
    return Layers(found)  # the model itself under "": it holds top-level free parameters


def tensors(root: torch.nn.Module) -> dict[str, Tensor]:
    """State-dict name -> live parameter or buffer (shared ones under every name), rebuilt on
    each call so it follows .to()/.double(), which replace the tensors."""
    out: dict[str, Tensor] = dict(root.named_parameters(remove_duplicate=False))
    out.update(root.named_buffers(remove_duplicate=False))
    return out


def check_inputs(*specs: tuple[str, object, str, tuple[int, ...]]) -> None:
    """Refuse, at the entry of a step, inputs that differ from the model's declarations.

    Each spec is (model name, tensor, declared dtype, declared dims after N). A wrong
    shape would otherwise fail deep inside a kernel or a codec with a message about
    something else. Float declarations accept any floating dtype, because a module moved
    with ``.double()`` or ``.half()`` computes in its parameters' dtype; integer ones
    (class indices) need exactly the declared dtype. All inputs share one batch size.
    """
    batch = None
    for name, value, dtype, dims in specs:
        _check_input(name, value, dtype, dims)
        if batch is None:
            batch = (name, value.shape[0])
        elif value.shape[0] != batch[1]:
            raise ValueError(
                f"input '{name}': batch size {value.shape[0]} differs from "
                f"'{batch[0]}' ({batch[1]})"
            )
    if batch is not None and batch[1] == 0:
        raise ValueError(f"input '{batch[0]}': the batch is empty")
    if batch is not None:
        _STEP.batch = int(batch[1])


def _check_input(name: str, value: object, dtype: str, dims: tuple[int, ...]) -> None:
    """One input against its declaration: a tensor, the declared dims after N, the dtype."""
    if not isinstance(value, Tensor):
        raise ValueError(f"input '{name}': expected a tensor, got {type(value).__name__}")
    expected = f"{dtype}[N, {', '.join(map(str, dims))}]" if dims else f"{dtype}[N]"
    given = f"{value.dtype} of shape {list(value.shape)}"
    if tuple(value.shape[1:]) != tuple(dims) or value.dim() != len(dims) + 1:
        raise ValueError(f"input '{name}': expected shape {expected}, got {given}")
    wanted = None if is_float(dtype) else torch_dtype(dtype)
    if (value.dtype != wanted) if wanted is not None else not value.is_floating_point():
        kind = wanted if wanted is not None else "a floating-point dtype"
        raise ValueError(f"input '{name}': expected {expected} ({kind}), got {given}")


# ---------------------------------------------------------------- stash accounting


class StashLog(list):
    """The rows ``stash``/``stash_raw`` record in one step; ``within(prefix)`` is the view a
    block function writes through, so its rows carry the instance's full names.

    ``observer``, when set, is told of each kept tensor as the forward made it (its full
    name and the raw tensor, before compression): the planner's probe reads the saved
    tensors this way (``observe_stash``) instead of replacing ``stash``."""

    prefix = ""
    observer: StashObserver | None = None
    #: where ``hand_out`` puts the step's predictions, by model name (None: not asked)
    predictions: dict[str, Tensor] | None = None

    def within(self, prefix: str) -> StashLog:
        view = _ScopedLog()
        view.root = getattr(self, "root", self)
        view.prefix = f"{self.prefix}.{prefix}" if self.prefix else prefix
        return view

    def add(self, key: str, row: tuple, tensor: Tensor | None = None) -> None:
        full = f"{self.prefix}.{key}" if self.prefix else key
        root = getattr(self, "root", self)
        root.append((full, *row))
        if root.observer is not None and tensor is not None:
            root.observer(full, tensor)


class _ScopedLog(StashLog):
    root: StashLog


StashObserver = Callable[[str, Tensor], None]
"""Told of one kept tensor: its full name and the raw tensor the forward made."""

_OBSERVING = threading.local()  # .observer: what the logs made meanwhile tell (observe_stash)


def stash_log(observer: StashObserver | None = None) -> StashLog:
    """An empty log for one step (``model.stash_log``; ``stash_report`` reads it), telling
    ``observer`` of each kept tensor: by default the one ``observe_stash`` set, if any."""
    log = StashLog()
    log.observer = observer or getattr(_OBSERVING, "observer", None)
    log.predictions = getattr(_OBSERVING, "predictions", None)
    return log


@contextlib.contextmanager
def keep_predictions():
    """Within the block, the training steps of this thread hand out their predictions (the
    forward's values that ``predict()`` returns, as the training forward made them: batch
    statistics, dropout drawn) into the dict this yields, by model name. Outside such a
    block a step keeps none: holding them costs their memory until the caller drops them.
    ``unroller.unroll``'s step reads its ``.logits`` this way."""
    previous = getattr(_OBSERVING, "predictions", None)
    _OBSERVING.predictions = kept = {}
    try:
        yield kept
    finally:
        _OBSERVING.predictions = previous


def hand_out(log: StashLog, name: str, value: Tensor) -> None:
    """A prediction of the training forward, kept when the caller asked (``keep_predictions``)."""
    root = getattr(log, "root", log)
    if root.predictions is not None:
        root.predictions[name] = value


@contextlib.contextmanager
def observe_stash(observer: StashObserver):
    """Within the block, every step's log (``stash_log``, which generated steps call at
    their start) tells ``observer`` of each tensor kept for backward, in this thread."""
    previous = getattr(_OBSERVING, "observer", None)
    _OBSERVING.observer = observer
    try:
        yield
    finally:
        _OBSERVING.observer = previous


def _label(codec: Any) -> str:
    """``repr(codec)``, kept on the codec (its parameters never change after it is made):
    every kept tensor of every step asks."""
    found = getattr(codec, "_stash_label", None)
    if found is None:
        found = repr(codec)
        with contextlib.suppress(AttributeError):
            codec._stash_label = found
    return found


def stash(log: StashLog, key: str, raw: Tensor, *forms: tuple) -> None:
    """Record one tensor kept compressed: its raw bytes and the bytes of each stored form
    (``(compressor, packed tensors)`` pairs)."""
    stored = sum(t.numel() * t.element_size() for _, packed in forms for t in packed)
    label = " + ".join(_label(codec) for codec, _ in forms)
    log.add(key, (label, tuple(raw.shape), raw.numel() * raw.element_size(), stored), raw)


def stash_raw(log: StashLog, tensors: dict[str, Tensor]) -> None:
    """Record the tensors kept as they are."""
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        log.add(key, ("raw", tuple(t.shape), nbytes, nbytes), t)


def within(prefix: str, *scoped: Any) -> tuple:
    """Each of ``scoped`` (the layers ``L``, the stash log) as block instance ``prefix``
    names it: what a block function is called with."""
    return tuple(s.within(prefix) for s in scoped)


def take(items: list) -> list:
    """The items of a list a block function was handed, the list emptied: the caller let
    go of them, so each is freed after its last use in the function."""
    taken = list(items)
    items.clear()
    return taken


def stash_report(log: list) -> dict:
    """The rows ``stash`` recorded, with totals (what ``model.stash_report()`` returns)."""
    rows = [
        {"tensor": k, "compressor": c, "shape": list(s), "raw_bytes": r, "stored_bytes": b}
        for k, c, s, r, b in log
    ]
    return {
        "rows": rows,
        "total_raw_bytes": sum(r["raw_bytes"] for r in rows),
        "total_stored_bytes": sum(r["stored_bytes"] for r in rows),
    }


# ---------------------------------------------------------------- the public surface


# ---------------------------------------------------------------- pooling sizes


def _ceil_mode_of(input_hw: Any, out_hw: Any, kernel_size: Any, stride: Any, padding: Any) -> bool:
    """Whether a pool's output is larger than floor mode gives: the ceil_mode a backward
    kernel needs, read off the sizes it already has (ceil mode with the floor size computes
    exactly what floor mode does), so backward and mask calls need no ceil_mode argument."""
    return any(
        (n + 2 * p - k) // s + 1 != o
        for n, o, k, s, p in zip(input_hw, out_hw, kernel_size, stride, padding)
    )


def _exports(namespace: Mapping[str, Any], *, besides: Iterable[str] = ()) -> list[str]:
    """A runtime module's ``__all__``: every public function in ``namespace`` that a runtime
    module defines (its own or imported from here), but those named in ``besides``, so the
    list cannot drift from what the module offers, as a hand-kept list did; torch functions
    and typing names are left out."""
    left_out = frozenset(besides)
    return sorted(
        name
        for name, obj in namespace.items()
        if not name.startswith("_")
        and name not in left_out
        and inspect.isfunction(obj)
        and obj.__module__.startswith(_RUNTIME_PACKAGE)
    )


#: What both platforms take from here (through ``unroller.runtime.shared``): every public
#: function but the stash observer and ``keep_predictions``, which callers of a generated
#: step use, not generated code.
__all__ = _exports(globals(), besides=("observe_stash", "keep_predictions"))
