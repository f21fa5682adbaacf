"""Forward and backward kernels of the ``gpu`` platform: plain PyTorch, on CPU or CUDA.

Generated code calls ``K.<op>(...)`` and ``K.<op>_backward(...)`` inside ``torch.no_grad()``;
the calling convention, the layer handles and the helpers are described in
``unroller.runtime.common``. Everything this module shares with ``ipu`` comes from
``unroller.runtime.shared``, in one star import. Here are only the kernels whose gpu code
differs, each under ``@conventions.implements`` (its
parameters and defaults are ``unroller.runtime.conventions``' stub, written once for both);
the kernels made from these (the 1-D pools, ...) come from ``unroller.runtime.derived``.

Every backward calls the aten kernel that autograd's derivative formula calls, with the
tensors autograd would have saved, so in float64 gradients equal ``torch.autograd``'s
(bit for bit for almost every op; attention, computed block by block in
``unroller.runtime.attention``, to rounding), and nothing that is not needed is computed: aten
backward kernels get an ``output_mask`` built from ``needs``. Each op's forward and backward
sit side by side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

# Data parallel: the gradient reducer and synchronised batch norm (not kernels themselves).
from unroller.compiler.precision import AUTOCAST_MATCH
from unroller.parallel import rows as _rows
from unroller.parallel.data import (
    SYNC_ATTR,
    reducer_of,
    sync_batchnorm,
    sync_batchnorm_backward,
)
from unroller.parallel.shard import sharder_of as _sharder
from unroller.runtime import attention as _blocks
from unroller.runtime import common as _common
from unroller.runtime import conventions, derived

# What this module's own code uses of the shared modules.
from unroller.runtime.common import (
    _ONE_SIXTH_F32,
    Grads,
    Layers,
    Needs,
    _attention_factors,
    _ceil_mode_of,
    _dicts,
    _exports,
    _fit,
    _need,
    _need_mask,
    _norm_tensors,
    _running_stats_used,
    _weight_bias,
    _widened,
    layers,
)
from unroller.runtime.in_backward import updater_of as _updater_of
from unroller.runtime.moe import moe, moe_backward, moe_layer  # noqa: F401 (gpu only)
from unroller.runtime.opaque import aten, aten_backward  # noqa: F401, E402 (the fallback)

# Every kernel and helper the two platforms share (see shared's doc), exported from here as
# gpu kernels (see __all__ at the end); the definitions below replace shared ones of the same
# name. shapeops' sum and slice shadow the builtins here, so this module calls neither bare.
from unroller.runtime.shared import *  # noqa: F403

_aten = torch.ops.aten
_MEAN = 1  # at::Reduction::Mean
_NO_OUTPUT_PADDING = (0, 0)
_NO_DILATION = (1, 1)
# Devices on which F.dropout uses the fused aten::native_dropout (ATen's is_fused_kernel_acceptable).
_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def _shape_only(g: Tensor, shape: tuple[int, ...] | list[int]) -> Tensor:
    """A tensor of `shape` that costs no memory (0-stride scalar), for aten ops that read only
    the input's sizes and options."""
    return g.new_zeros(()).expand(*shape)


# ---------------------------------------------------------------- the step, eager or compiled

Step = Callable[..., Tensor]
#: torch.compile'd step functions by (function, backend): one wrapper per generated class and
#: backend, shared by its instances (a wrapper held by an instance would follow it into
#: copy.deepcopy and keep stepping the original).
_COMPILED: dict[tuple[Step, str | Callable[..., Any]], Step] = {}


def run_step(
    model: torch.nn.Module,
    step: Step,
    *inputs: Tensor,
    scaler: Any = None,
    low: torch.dtype | None = None,
) -> Tensor:
    """``step(model, layers, model.stash_log, *inputs)``, the generated step's tensor work:
    eagerly, or under torch.compile when ``model.compile_step`` is True (the default
    backend, inductor), a backend's name or a backend function, so that the codec chains
    fuse. The input checks and the layer handles stay outside the compiled region; the
    stash log and the ``.grad`` writes inside it are side effects torch.compile replays
    after the graph. The batch dim of every input is marked dynamic, so that another batch
    size reuses the compiled graph instead of compiling a new one.

    ``low``: the low dtype of a mixed-precision step, which then takes ``scaler`` (a
    ``torch.amp.GradScaler`` or None) after its inputs. Such a step writes its casts out,
    so an ambient ``torch.autocast`` of that dtype is switched off while it runs (it would
    cast again); any other ambient autocast is refused (``_autocast_refusal``)."""
    ambient = _ambient_autocast(inputs)
    if ambient is not None and ambient[1] != low:
        raise RuntimeError(_autocast_refusal(*ambient, low))
    backend = getattr(model, "compile_step", False)
    updater = _updater_of(model)
    if updater is not None:
        if backend:
            raise RuntimeError(
                "compile=True and an optimizer in the backward do not combine yet "
                "(unroller.runtime.in_backward): the updates would run inside the compiled graph"
            )
        updater.begin(scaler)
    handles = layers(model)
    extra = (scaler,) if low is not None else ()
    with torch.autocast(ambient[0], enabled=False) if ambient else contextlib.nullcontext():
        if not backend:
            try:
                sharder = _sharder_of(handles)
                if sharder is not None:
                    sharder.begin()
                return step(model, handles, model.stash_log, *inputs, *extra)
            finally:
                if updater is not None:
                    updater.end()
                sharder = _sharder_of(handles)
                if sharder is not None:
                    sharder.finish()
        for t in inputs:
            if t.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return _compiled(step, "inductor" if backend is True else backend)(
            model, handles, model.stash_log, *inputs, *extra
        )


def loss_seed(loss: Tensor, scaler: Any = None) -> Tensor:
    """d loss / d loss: ones, or with a ``torch.amp.GradScaler`` its scale, as
    ``scaler.scale(loss).backward()`` seeds the backward (ones times the scale, float32)."""
    ones = torch.ones_like(loss)
    if scaler is None:
        return ones
    return scaler.scale(ones).reshape(loss.shape)


def floats_in(dtype: torch.dtype, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The inputs with the floating-point ones in ``dtype`` (a step generated for a plain
    low precision, ``--precision bf16``, takes float32 batches too), the others as they are."""
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def _ambient_autocast(inputs: Sequence[Tensor]) -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of a torch.autocast enabled around the call, or None."""
    devices = {"cpu"} | {t.device.type for t in inputs if isinstance(t, Tensor)}
    for device in sorted(devices):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def _autocast_refusal(device: str, dtype: torch.dtype, low: torch.dtype | None) -> str:
    """One line: the step computes in the precision it was generated for, every cast written
    out; autocast would change the dtype of some forward ops and none of the explicit
    backward's (a raw dtype error deep in a kernel, or numbers of neither precision)."""
    name = str(dtype).removeprefix("torch.")
    wanted = AUTOCAST_MATCH.get(name)
    made = "float32" if low is None else f"{str(low).removeprefix('torch.')} mixed precision"
    fix = (
        f"generate it with --precision {wanted} (unroller.unroll(..., precision={wanted!r})), "
        "which computes what this autocast would, with its casts written out, "
        if wanted
        else ""
    )
    return (
        f"the unrolled step was called under torch.autocast({device!r}, dtype=torch.{name}), "
        f"but it was generated for {made}: {fix}or call it outside torch.autocast"
    )


def _compiled(step: Step, backend: str | Callable[..., Any]) -> Step:
    """The torch.compile wrapper of ``step`` for ``backend``, made on first use."""
    key = (step, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(step, backend=backend)
    return _COMPILED[key]


# ---------------------------------------------------------------- gradient accumulation
#
# The host platform's: generated gpu code hands parameter gradients to these, which write
# them into ``.grad`` as autograd does (ipu has none: PopTorch gets them through ``collect``).


def accumulate(layer: Any, /, **grads: Tensor | None) -> None:
    """Add each ``name=grad`` into ``getattr(layer, name).grad``, as autograd's AccumulateGrad:
    the first gradient is stored, later ones added in place; None (not needed) is skipped.

    The first one is always copied, into a tensor with the param's layout (as autograd's
    clone_obey_contract), because a kernel's gradient may be shared (add_backward returns g
    for both inputs) or a view (concat_backward): a later in-place add must not write into it.
    """
    for name, grad in grads.items():
        if grad is not None:
            _accumulate_one(_param(layer, name), grad)


def _param(layer: Any, name: str) -> Tensor:
    """The layer's parameter ``name``; a gradient for a missing one is a generator bug."""
    found = _dicts(layer)
    param = found[0].get(name) if found is not None else getattr(layer, name, None)
    if param is None:
        raise ValueError(f"accumulate: {type(layer).__name__} has no parameter '{name}'")
    return param


def accumulate_fresh(layer: Any, /, **grads: Tensor | None) -> None:
    """``accumulate`` for gradients the caller made and holds alone (the registry's
    ``fresh_param_grads``: a backward kernel's matmul or reduction results, handed over and
    dropped): the first one becomes ``.grad`` itself when it has the parameter's dtype, device
    and strides, as autograd's AccumulateGrad takes a gradient nothing else holds. That
    saves a parameter-sized allocation and copy per parameter and step. A later one is added
    in place as ``accumulate`` does, into a tensor nothing else holds either."""
    for name, grad in grads.items():
        if grad is not None:
            _accumulate_one(_param(layer, name), grad, adopt=True)


def _accumulate_one(param: Tensor, grad: Tensor, adopt: bool = False) -> None:
    with torch.no_grad():
        if param.grad is None:
            if adopt and _adoptable(param, grad):
                param.grad = grad.detach()
            else:
                param.grad = torch.empty_like(param, memory_format=torch.preserve_format).copy_(
                    grad
                )
        else:
            param.grad += grad


def _adoptable(param: Tensor, grad: Tensor) -> bool:
    """May ``grad`` be the parameter's ``.grad`` as it is? Its layout must be the one
    ``accumulate`` would give (the parameter's), or an optimizer would see other strides."""
    return (
        grad.dtype == param.dtype
        and grad.device == param.device
        and grad.shape == param.shape
        and grad.stride() == param.stride()
        and not grad.requires_grad
    )


# ---------------------------------------------------------------- convolutions


@conventions.implements
def conv2d(x, layer, *, stride, padding, dilation, groups):
    """aten::convolution, as F.conv2d; autograd saves x and weight."""
    weight, bias = _weight_bias(layer)
    return _aten.convolution(
        x, weight, bias, stride, padding, dilation, False, _NO_OUTPUT_PADDING, groups
    )


class RestoredInPieces:
    """A saved tensor kept compressed, which the backward kernel that reads it decompresses
    one piece of the batch at a time (``restore_in_pieces``): the whole restored tensor never
    exists, so in the first stage of a CNN, where the step peaks, the working set holds one
    piece of it instead of a full-size map. Every compressor packs each sample on its own
    (``unroller.compress.base.Compressor``), so rows ``start:start + length`` of each packed
    tensor are the packed form of those samples."""

    def __init__(
        self, codec: Any, packed: Sequence[Tensor], shape: Sequence[int], dtype: torch.dtype
    ) -> None:
        self.codec, self.packed, self.dtype = codec, tuple(packed), dtype
        self.sample_shape = tuple(shape)
        self.shape = torch.Size((self.packed[0].shape[0], *self.sample_shape))
        self.device = self.packed[0].device

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        """Samples ``start:start + length``, decompressed (a new tensor, the caller's own)."""
        if dim != 0:
            raise ValueError("a tensor restored in pieces is read along the batch dim only")
        part = tuple(p.narrow(0, start, length) for p in self.packed)
        return self.codec.decompress(part, self.sample_shape, self.dtype)

    def whole(self) -> Tensor:
        return self.codec.decompress(self.packed, self.sample_shape, self.dtype)


def packed_split(
    packed: Sequence[Tensor], size: int | None = None, pieces: int | None = None
) -> list[tuple[Tensor, ...]]:
    """A compressed tensor's packed form in pieces of the batch, as ``x.split(size)`` or
    ``x.tensor_split(pieces)`` splits the tensor itself (views): every compressor packs each
    sample on its own, so rows of each packed tensor are samples. A segment run in pieces
    restores each piece of its compressed input from these, never the whole batch."""
    if size is not None:
        return list(zip(*(p.split(size) for p in packed)))
    return list(zip(*(p.tensor_split(pieces) for p in packed)))


def restore_in_pieces(
    codec: Any, packed: Sequence[Tensor], shape: Sequence[int], dtype: torch.dtype
) -> RestoredInPieces | Tensor:
    """A compressed saved tensor handed to backward kernels that run in pieces of the batch
    (the code generator emits this instead of ``codec.decompress`` when every reader takes
    ``piece_bytes``): each piece is decompressed when the kernel reaches it. Compiled
    (``Model(compile=True)``): decompressed whole, as the kernels then run whole."""
    if torch.compiler.is_compiling():
        return codec.decompress(tuple(packed), tuple(shape), dtype)
    return RestoredInPieces(codec, packed, shape, dtype)


def _whole(x: Tensor | RestoredInPieces) -> Tensor:
    return x.whole() if isinstance(x, RestoredInPieces) else x


def _sample_bytes(t: Tensor | RestoredInPieces) -> int:
    return t.shape[1:].numel() * t.dtype.itemsize


def piece_samples(batch: int, sample_bytes: int, piece_bytes: int, weight_bytes: int = 0) -> int:
    """Samples per piece of a backward kernel run in pieces of the batch (``piece_bytes``):
    about ``piece_bytes`` of the largest batch-sized operand per piece, in whole samples (at
    least one), but no fewer bytes than the weight's, so that a layer whose weight gradient
    outweighs its maps (a late ResNet stage) is not split into pieces that each make a
    weight-sized gradient to sum (the CPU kernel ran 3x slower in 8 pieces there). The
    working buffers are then a constant, not a fraction, of the batch; ``batch``: whole.
    The memory model (``unroller.analysis.memory``) counts pieces by this same rule."""
    if piece_bytes <= 0 or batch < 2:
        return batch
    return min(batch, max(1, max(piece_bytes, weight_bytes) // max(1, sample_bytes)))


def _conv_backward(
    g: Tensor,
    x: Tensor | RestoredInPieces,
    weight: Tensor,
    bias_sizes: list[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    mask: list[bool],
    piece_bytes: int = 0,
    in_place: bool = False,
    add_into: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """aten::convolution_backward, in pieces of the batch of about ``piece_bytes`` each
    (``piece_samples``; the generated code passes the platform's ``piece_bytes`` under lossy
    schemes only).

    The CPU kernel (mkldnn) allocates, besides its results, a buffer the size of its input
    and a contiguous copy of the output gradient: two batch-sized tensors on top of the
    step's working set, where the step peaks (the first stage's backward). In pieces those
    are a piece's, and ``x`` may be restored one piece at a time (``RestoredInPieces``).
    ``in_place``: the input gradient is written into ``g`` piece by piece (each piece of
    ``g`` is read only by its own call), when the two have the same shape; the code
    generator passes it only when ``g`` is its own and dead after this call. ``add_into``:
    the input gradient is added into that tensor (piece by piece: the same sums as adding
    the whole), which is returned. The weight and bias gradients are summed over the
    pieces, so their bits differ from the whole kernel's (float64: 1e-15)."""
    args = (weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    n = g.shape[0]
    sample = max(_sample_bytes(x), _sample_bytes(g))
    step = piece_samples(n, sample, piece_bytes, weight.numel() * weight.element_size())
    if step >= n or torch.compiler.is_compiling():
        # compiled (Model(compile=True)): whole, as the loop over pieces would specialise
        # the graph on the batch size, and the compiler plans the kernel's memory itself
        gx, gw, gb = _aten.convolution_backward(g, _whole(x), *args, mask)
        if add_into is not None and gx is not None:
            gx = add_into.add_(gx)
        return gx, gw, gb
    grad_x = None
    if mask[0]:
        same = in_place and g.shape == x.shape and g.dtype == x.dtype
        grad_x = g if same else torch.empty(x.shape, dtype=x.dtype, device=g.device)
        grad_x = add_into if add_into is not None else grad_x
    grad_w = grad_b = None
    for start in range(0, n, step):
        size = min(step, n - start)
        gx, gw, gb = _aten.convolution_backward(
            g.narrow(0, start, size), x.narrow(0, start, size), *args, mask
        )
        if add_into is not None and gx is not None:
            add_into.narrow(0, start, size).add_(gx)
        elif grad_x is not None:
            grad_x.narrow(0, start, size).copy_(gx)
        del gx
        if mask[1]:
            grad_w = gw if grad_w is None else grad_w.add_(gw)
        if mask[2]:
            grad_b = gb if grad_b is None else grad_b.add_(gb)
    return grad_x, grad_w, grad_b


@conventions.implements
def conv2d_backward(
    g,
    x,
    layer,
    *,
    stride,
    padding,
    dilation,
    groups,
    needs,
    piece_bytes: int = 0,
    in_place: bool = False,
    add_into: Tensor | None = None,
):
    """aten::convolution_backward (transposed=False); ``piece_bytes``, ``in_place``, ``add_into``: see
    _conv_backward."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = layer.weight
    grads = _conv_backward(
        g,
        x,
        weight,
        [weight.shape[0]],
        stride,
        padding,
        dilation,
        False,
        _NO_OUTPUT_PADDING,
        groups,
        mask,
        piece_bytes,
        in_place,
        add_into,
    )
    return _fit(grads, needs)


@conventions.implements
def conv_transpose2d(x, layer, *, stride, padding, output_padding, dilation, groups):
    """aten::convolution(transposed=True), as F.conv_transpose2d; autograd saves x and weight."""
    weight, bias = _weight_bias(layer)
    return _aten.convolution(
        x, weight, bias, stride, padding, dilation, True, output_padding, groups
    )


@conventions.implements
def conv_transpose2d_backward(
    g,
    x,
    layer,
    *,
    stride,
    padding,
    output_padding,
    dilation,
    groups,
    needs,
    piece_bytes: int = 0,
    in_place: bool = False,
    add_into: Tensor | None = None,
):
    """aten::convolution_backward (transposed=True); weight is [in, out/groups, kh, kw];
    ``piece_bytes``, ``in_place``, ``add_into``: see _conv_backward."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = layer.weight
    grads = _conv_backward(
        g,
        x,
        weight,
        [weight.shape[1] * groups],
        stride,
        padding,
        dilation,
        True,
        output_padding,
        groups,
        mask,
        piece_bytes,
        in_place,
        add_into,
    )
    return _fit(grads, needs)


# ---------------------------------------------------------------- batch norm


@conventions.implements
def batchnorm2d(x, layer, *, eps, momentum):
    """aten::native_batch_norm(training=True), as nn.BatchNorm2d.train(): updates the layer's
    running stats (unbiased var) and num_batches_tracked in place; autograd saves x, weight,
    save_mean, save_invstd. The layer in eval mode (with running stats), as
    nn.BatchNorm2d.eval(): training=False, normalised with the running stats, nothing
    updated (under --sync-bn too, as nn.SyncBatchNorm in eval mode)."""
    weight, bias, running_mean, running_var, num_batches_tracked = _norm_tensors(layer)
    if _running_stats_used(layer, running_mean, running_var):
        return _aten.native_batch_norm(x, weight, bias, running_mean, running_var, False, 0.0, eps)
    group = getattr(layer, SYNC_ATTR, None)
    if group is not None:  # data parallel with --sync-bn: the whole distributed batch
        return sync_batchnorm(x, layer, group, eps, momentum)
    factor = 0.0 if momentum is None else momentum
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if momentum is None:  # cumulative moving average
            factor = 1.0 / float(num_batches_tracked)
    return _aten.native_batch_norm(x, weight, bias, running_mean, running_var, True, factor, eps)


@conventions.implements
def batchnorm2d_backward(
    g,
    x,
    layer,
    save_mean,
    save_invstd,
    *,
    eps,
    momentum,
    needs,
    piece_bytes: int = 0,
    in_place: bool = False,
):
    """aten::native_batch_norm_backward(train=True); running stats are not read in training.
    The layer in eval mode (with running stats): train=False with the running stats, what
    autograd computes for nn.BatchNorm2d.eval() (``_batchnorm_eval_backward``).

    ``piece_bytes`` (lossy schemes): in pieces of the batch (``_batchnorm_backward_pieces``)
    when that makes more than one; ``in_place``: then the input gradient is written into
    ``g`` (the code generator passes it when ``g`` is its own and dead after this call)."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    _, _, running_mean, running_var, _ = _norm_tensors(layer)
    if _running_stats_used(layer, running_mean, running_var):
        step = piece_samples(g.shape[0], _sample_bytes(g), piece_bytes)
        grads = _batchnorm_eval_backward(
            g,
            x,
            layer,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            eps,
            mask,
            step,
            in_place,
        )
        return _fit(grads, needs)
    group = getattr(layer, SYNC_ATTR, None)
    if group is not None:
        return _fit(
            sync_batchnorm_backward(g, _whole(x), layer, save_mean, save_invstd, group, mask),
            needs,
        )
    weight = getattr(layer, "weight", None)
    step = piece_samples(g.shape[0], _sample_bytes(g), piece_bytes)
    if step < g.shape[0] and not torch.compiler.is_compiling():
        grads = _batchnorm_backward_pieces(
            g, x, weight, save_mean, save_invstd, mask, step, in_place, eps
        )
        return _fit(grads, needs)
    grads = _aten.native_batch_norm_backward(
        g, _whole(x), weight, None, None, save_mean, save_invstd, True, eps, mask
    )
    return _fit(grads, needs)


def _batchnorm_eval_backward(
    g: Tensor,
    x: Tensor | RestoredInPieces,
    layer: Any,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    save_mean: Tensor,
    save_invstd: Tensor,
    eps: float,
    mask: list[bool],
    step: int,
    in_place: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Eval-mode batch norm's backward: aten::native_batch_norm_backward(train=False) with the
    running stats and what the forward returned, as autograd calls it. Each sample is
    normalised on its own, so in pieces of ``step`` samples (fewer than the batch) the
    kernel on each piece gives that piece's input gradient exactly, written into ``g``
    with ``in_place``, and the weight and bias gradients are the pieces' sums."""
    weight = getattr(layer, "weight", None)
    n = g.shape[0]
    if step >= n or torch.compiler.is_compiling():
        return _aten.native_batch_norm_backward(
            g,
            _whole(x),
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            False,
            eps,
            mask,
        )
    out = None
    if mask[0]:
        out = g if in_place and g.is_contiguous() else torch.empty_like(g)
    grad_w: Tensor | None = None
    grad_b: Tensor | None = None
    for start in range(0, n, step):
        size = min(step, n - start)
        gx, gw, gb = _aten.native_batch_norm_backward(
            g.narrow(0, start, size),
            x.narrow(0, start, size),
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            False,
            eps,
            mask,
        )
        if out is not None:
            out.narrow(0, start, size).copy_(gx)
        if gw is not None:
            grad_w = gw if grad_w is None else grad_w.add_(gw)
        if gb is not None:
            grad_b = gb if grad_b is None else grad_b.add_(gb)
    return out, grad_w, grad_b


def _batchnorm_backward_pieces(
    g: Tensor,
    x: Tensor | RestoredInPieces,
    weight: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    mask: list[bool],
    step: int,
    in_place: bool,
    eps: float,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The training batch-norm backward over pieces of ``step`` samples, with aten's CPU
    formula: per channel, sum_dy = sum(g) and dot = sum(g * (x - mean)) * invstd over the
    batch, in a first pass over the pieces (aten's own kernel on each piece, asked for the
    weight and bias gradients only: the batch's statistics given, it sums exactly these);
    then, piece by piece, dx = (g - sum_dy / M - (x - mean) * dot * invstd / M) * invstd *
    weight (M: elements per channel). The whole kernel holds an input-sized buffer besides
    its result, and its result beside ``g``; here a piece's x - mean is all, and with
    ``in_place`` dx overwrites ``g``, so the first stage of a CNN, where the step peaks,
    holds one full-size gradient less and no restored input. Each pass reads x: a
    ``RestoredInPieces`` is decompressed twice a piece at a time, but for the last piece,
    which the second pass, run backwards, takes from the first. The sums run in another order
    than aten's, so the bits differ (float64: 1e-15); the code generator asks for this only
    under lossy schemes."""
    n, c = g.shape[0], g.shape[1]
    view = (1, c) + (1,) * (g.dim() - 2)
    acc = mean.dtype  # float32 for half inputs, as aten's accumulation
    sum_dy = torch.zeros(c, dtype=acc, device=g.device)
    dot = torch.zeros(c, dtype=acc, device=g.device)  # sum(g * (x - mean)) * invstd
    starts = list(range(0, n, step))
    last: Tensor | None = None
    for start in starts:
        size = min(step, n - start)
        last = x.narrow(0, start, size)
        _, dot_piece, sum_piece = _aten.native_batch_norm_backward(
            g.narrow(0, start, size),
            last,
            None,
            None,
            None,
            mean,
            invstd,
            True,
            eps,
            [False, True, True],
        )
        sum_dy += sum_piece
        dot += dot_piece
    grad_w = dot.to(weight.dtype) if mask[1] and weight is not None else None
    grad_b = sum_dy.to(weight.dtype) if mask[2] and weight is not None else None
    if not mask[0]:
        return None, grad_w, grad_b
    count = g.numel() // c
    k = (dot * invstd / count).reshape(view)
    grad_mean = (sum_dy / count).reshape(view)
    scale = (invstd if weight is None else invstd * weight).reshape(view)
    centre = mean.reshape(view)
    fresh = isinstance(x, RestoredInPieces)  # its pieces are the kernel's own
    out = g if in_place and g.is_contiguous() else torch.empty_like(g)
    for start in reversed(starts):
        size = min(step, n - start)
        piece = last if last is not None else x.narrow(0, start, size)
        last = None
        centred = piece.sub_(centre) if fresh and piece.dtype == acc else piece.sub(centre)
        part = out.narrow(0, start, size)
        torch.sub(g.narrow(0, start, size), grad_mean, out=part)
        part.addcmul_(centred, k, value=-1).mul_(scale)
        del piece, centred
    return out, grad_w, grad_b


def reduce_bucket(layers: Layers, index: int, names: tuple[str, ...]) -> None:
    """Data parallel (``--data-parallel``): start the all-reduce of bucket ``index``, the
    gradients ``names`` (state-dict names), if a reducer is attached to the model
    (``unroller.parallel.data.attach``); in one process, nothing."""
    reducer = reducer_of(layers)
    if reducer is not None:
        reducer.launch(index, names)


def update_params(layers: Layers, names: tuple[str, ...]) -> None:
    """``--update-in-backward``: the gradients of ``names`` (state-dict names) are final;
    the optimizer attached to the model (``unroller.runtime.in_backward.attach``) updates
    those parameters and frees the gradients. None attached: nothing."""
    updater = _updater_of(layers[""])
    if updater is not None:
        updater.update(names)


def gather(layers: Layers, name: str) -> None:
    """``--shard``: block instance ``name``'s parameters all-gathered into the full tensors
    its statements read (``unroller.parallel.shard``); no mesh attached: nothing."""
    sharder = _sharder_of(layers)
    if sharder is not None:
        sharder.gather(name)


def release(layers: Layers, name: str) -> None:
    """``--shard``: block instance ``name``'s full parameters freed, its shards kept."""
    sharder = _sharder_of(layers)
    if sharder is not None:
        sharder.release(name)


def scatter_grads(layers: Layers, names: tuple[str, ...]) -> None:
    """``--shard``: the final gradients of ``names`` reduce-scattered to their shards."""
    sharder = _sharder_of(layers)
    if sharder is not None:
        sharder.scatter_grads(names)


def _sharder_of(layers: Layers) -> Any:
    """The ``unroller.parallel.shard.Sharder`` of the model these layer handles are."""
    return _sharder(layers[""])


def reduce_wait(layers: Layers) -> None:
    """Data parallel: wait for the step's all-reduces and leave the averages in ``.grad``."""
    reducer = reducer_of(layers)
    if reducer is not None:
        reducer.finish()


@conventions.implements
def batchnorm2d_recompute(x, layer, *, eps, momentum):
    """The training forward's output again (``--recompute``): the same kernel on the same x
    gives the same bits, with no running statistics passed, so none change. The layer in
    eval mode: the eval forward's output again (the running stats unchanged since)."""
    weight, bias, running_mean, running_var, _ = _norm_tensors(layer)
    if _running_stats_used(layer, running_mean, running_var):
        return _aten.native_batch_norm(x, weight, bias, running_mean, running_var, False, 0.0, eps)[
            0
        ]
    group = getattr(layer, SYNC_ATTR, None)
    if group is not None:
        return sync_batchnorm(x, layer, group, eps, momentum, update=False)[0]
    return _aten.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)[0]


@conventions.implements
def batchnorm2d_eval(x, layer, *, eps, momentum):
    """aten::native_batch_norm(training=False): normalizes with the running stats, changes
    nothing."""
    weight, bias, running_mean, running_var, _ = _norm_tensors(layer)
    factor = 0.0 if momentum is None else momentum
    batch_stats = running_mean is None  # track_running_stats=False: torch uses batch stats
    out = _aten.native_batch_norm(
        x, weight, bias, running_mean, running_var, batch_stats, factor, eps
    )
    return out[0]


# ---------------------------------------------------------------- activations


@conventions.implements
def relu_backward(g, y, *, needs, in_place: bool = False):
    """aten::threshold_backward(g, y, 0); y may be the bool mask y > 0 (same result).
    ``in_place``: written into ``g`` (the same kernels with ``g`` as their output, so the
    same bits), which the code generator passes when ``g`` is its own and dead after this
    call: a full-size gradient less in a CNN's backward."""
    if not _need(needs, 0):
        return (None,)
    if y.dtype == torch.bool:
        return (torch.where(y, g, g.new_zeros(()), out=g if in_place else None),)
    if in_place:
        return (_aten.threshold_backward.grad_input(g, y, 0, grad_input=g),)
    return (_aten.threshold_backward(g, y, 0),)


@conventions.implements
def sigmoid_backward(g, y, *, needs):
    """aten::sigmoid_backward(g, y)."""
    return (_aten.sigmoid_backward(g, y) if _need(needs, 0) else None,)


@conventions.implements
def tanh_backward(g, y, *, needs):
    """aten::tanh_backward(g, y)."""
    return (_aten.tanh_backward(g, y) if _need(needs, 0) else None,)


@conventions.implements
def gelu(x, *, approximate):
    """aten::gelu; autograd saves the input."""
    return _aten.gelu(x, approximate=approximate)


@conventions.implements
def gelu_backward(g, x, *, approximate, needs):
    """aten::gelu_backward(g, x, approximate)."""
    return (_aten.gelu_backward(g, x, approximate=approximate) if _need(needs, 0) else None,)


@conventions.implements
def leaky_relu(x, *, negative_slope):
    """aten::leaky_relu; autograd saves the input."""
    return _aten.leaky_relu(x, negative_slope)


@conventions.implements
def leaky_relu_backward(g, x, *, negative_slope, needs):
    """aten::leaky_relu_backward(g, x, negative_slope, self_is_result=False); x may be the
    bool mask x > 0."""
    if not _need(needs, 0):
        return (None,)
    if x.dtype == torch.bool:
        return (torch.where(x, g, g * negative_slope),)
    return (_aten.leaky_relu_backward(g, x, negative_slope, False),)


# ---------------------------------------------------------------- v2 activations
# relu6, hardtanh, silu, elu and softplus forwards are shared (common.py: one F call each).


@conventions.implements
def hardtanh_backward(g, x, *, min_val, max_val, needs):
    """aten::hardtanh_backward(g, x, min_val, max_val); x may be the bool mask of
    ``hardtanh_mask`` (g where set, +0 elsewhere: the same, bit for bit)."""
    if not _need(needs, 0):
        return (None,)
    if x.dtype == torch.bool:
        return (torch.where(x, g, g.new_zeros(())),)
    return (_aten.hardtanh_backward(g, x, min_val, max_val),)


@conventions.implements
def hardsigmoid(x):
    """aten::hardsigmoid; autograd saves the input."""
    return _aten.hardsigmoid(x)


@conventions.implements
def hardsigmoid_backward(g, x, *, needs):
    """aten::hardsigmoid_backward(g, x); x may be the bool mask -3 < x < 3, then g times
    aten's constant 1/6 (a float32 1/6, also in float64) where set, +0 elsewhere."""
    if not _need(needs, 0):
        return (None,)
    if x.dtype == torch.bool:
        return (torch.where(x, g * _ONE_SIXTH_F32, g.new_zeros(())),)
    return (_aten.hardsigmoid_backward(g, x),)


@conventions.implements
def hardswish(x):
    """aten::hardswish; autograd saves the input."""
    return _aten.hardswish(x)


@conventions.implements
def hardswish_backward(g, x, *, needs):
    """aten::hardswish_backward(g, x)."""
    return (_aten.hardswish_backward(g, x) if _need(needs, 0) else None,)


@conventions.implements
def silu_backward(g, x, *, needs):
    """aten::silu_backward(g, x)."""
    return (_aten.silu_backward(g, x) if _need(needs, 0) else None,)


@conventions.implements
def mish(x):
    """aten::mish; autograd saves the input."""
    return _aten.mish(x)


@conventions.implements
def mish_backward(g, x, *, needs):
    """aten::mish_backward(g, x)."""
    return (_aten.mish_backward(g, x) if _need(needs, 0) else None,)


@conventions.implements
def elu_backward(g, x, *, alpha, needs):
    """aten::elu_backward(g, alpha, 1, 1, is_result=False, x), autograd's formula for F.elu."""
    if not _need(needs, 0):
        return (None,)
    return (_aten.elu_backward(g, alpha, 1, 1, False, x),)


@conventions.implements
def softplus_backward(g, x, *, beta, threshold, needs):
    """aten::softplus_backward(g, x, beta, threshold)."""
    if not _need(needs, 0):
        return (None,)
    return (_aten.softplus_backward(g, x, beta, threshold),)


# ---------------------------------------------------------------- v2 nll_loss and embedding


def _nll_nd(log_probs: Tensor, target: Tensor) -> tuple[Tensor, Tensor, bool]:
    """As aten's nll_loss_nd: [N, C] goes to nll_loss; [N, C, H, W] to nll_loss2d; any other
    rank is viewed as [N, C, 1, L] (target [N, 1, L]) for nll_loss2d. Returns the tensors
    the aten kernels take and whether they are the 2-D form."""
    if log_probs.dim() == 2:
        return log_probs, target, False
    if log_probs.dim() == 4:
        return log_probs, target, True
    n, c = log_probs.shape[:2]
    return log_probs.reshape(n, c, 1, -1), target.reshape(n, 1, -1), True


def _nll_forward(log_probs: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """aten::nll_loss_forward / nll_loss2d_forward (mean), as F.nll_loss."""
    if not log_probs.is_contiguous():  # cross_entropy's [N, L, C] layout: aten would copy it
        return _nll_picked(log_probs, target, ignore_index)
    lp, t, image = _nll_nd(log_probs, target)
    forward = _aten.nll_loss2d_forward if image else _aten.nll_loss_forward
    return forward(lp, t, None, _MEAN, ignore_index)[0]


def _nll_backward(g: Tensor, log_probs: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """aten::nll_loss_backward / nll_loss2d_backward (mean); the total weight is the count of
    non-ignored targets, as the forward computes it. log_probs is read for its shape only."""
    if not log_probs.is_contiguous():  # cross_entropy's [N, L, C] layout: aten needs [N, C, ...]
        return _nll_grad_like(g, log_probs, target, ignore_index)
    lp, t, image = _nll_nd(log_probs, target)
    total = target.ne(ignore_index).sum().to(g.dtype)
    backward = _aten.nll_loss2d_backward if image else _aten.nll_loss_backward
    return backward(g, lp, t, None, _MEAN, ignore_index, total).reshape(log_probs.shape)


def _nll_picked(log_probs: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """The mean over kept rows of -log_probs at the target class, read in place (no copy of
    the log-probabilities); nan when every row is ignored, as aten's."""
    kept = target.ne(ignore_index)
    index = torch.where(kept, target, target.new_zeros(())).unsqueeze(1)
    picked = log_probs.gather(1, index).squeeze(1)
    zero = picked.new_zeros(())
    return torch.where(kept, picked, zero).sum().neg() / kept.sum().to(picked.dtype)


def _nll_grad_like(g: Tensor, log_probs: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """What aten's nll backward (mean) makes, in ``log_probs``' layout: -g / count at each
    kept row's target class, zero elsewhere (ignored rows included)."""
    kept = target.ne(ignore_index)
    total = kept.sum().to(g.dtype)
    weight = torch.where(kept, -g / total, g.new_zeros(())).unsqueeze(1)
    index = torch.where(kept, target, target.new_zeros(())).unsqueeze(1)
    return torch.zeros_like(log_probs).scatter_(1, index, weight.to(log_probs.dtype))


@conventions.implements
def nll_loss(log_probs, target, *, ignore_index):
    """F.nll_loss (mean over the non-ignored targets; all ignored: nan, as torch)."""
    return _nll_forward(log_probs, target, ignore_index)


@conventions.implements
def nll_loss_backward(g, target, *, ignore_index, num_classes, needs):
    """aten's nll backward, given a 0-stride tensor of the input's shape [N, C, d1, ...]: it
    reads only sizes, so no activation is kept, only the target."""
    if not _need(needs, 0):
        return _fit((), needs)
    shape = _shape_only(g, (target.shape[0], num_classes, *target.shape[1:]))
    return _fit((_nll_backward(g, shape, target, ignore_index),), needs)


@conventions.implements
def embedding(ids, layer, *, padding_idx):
    """aten::embedding, as F.embedding (an id out of range raises, as torch); autograd keeps
    only the ids."""
    weight = layer.weight
    if _rows.is_rows(weight):  # --shard: the table left where its rows live
        return _rows.embedding(ids, weight, _padding_row(padding_idx, weight.shape[0]))
    return _aten.embedding(weight, ids, _padding_row(padding_idx, weight.shape[0]), False, False)


@conventions.implements
def embedding_backward(g, ids, layer, *, padding_idx, needs):
    """(None for the ids, aten::embedding_dense_backward for the weight): a dense gradient
    whose padding_idx row stays zero."""
    if not _need(needs, 1):
        return _fit((None, None), needs)
    num_embeddings = layer.weight.shape[0]
    pad = _padding_row(padding_idx, num_embeddings)
    if _rows.is_rows(layer.weight):  # this rank's rows' gradient only
        return _fit((None, _rows.embedding_backward(g, ids, layer.weight, pad)), needs)
    gw = _aten.embedding_dense_backward(g, ids, num_embeddings, pad, False)
    return _fit((None, gw), needs)


def _padding_row(padding_idx: int | None, num_embeddings: int) -> int:
    """F.embedding's form of padding_idx: a row index, negative counted from the end; -1
    for none."""
    if padding_idx is None:
        return -1
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


# ---------------------------------------------------------------- pooling


@conventions.implements
def maxpool2d(x, *, kernel_size, stride, padding, ceil_mode):
    """aten::max_pool2d_with_indices (dilation 1); autograd saves x and indices."""
    return _aten.max_pool2d_with_indices(x, kernel_size, stride, padding, _NO_DILATION, ceil_mode)


@conventions.implements
def maxpool2d_backward(g, indices, *, kernel_size, stride, padding, input_hw, needs):
    """aten::max_pool2d_with_indices_backward, which reads only the input's sizes, so no
    activation is kept: just the indices, or (non-overlapping windows) a bool mask of the
    argmax positions from ``maxpool2d_mask``, whose gradient is the same, bit for bit."""
    if not _need(needs, 0):
        return (None,)
    n, c = g.shape[:2]
    if indices.dtype == torch.bool:
        rows = _window_of(input_hw[0], stride[0], padding[0], g.shape[2], g.device)
        cols = _window_of(input_hw[1], stride[1], padding[1], g.shape[3], g.device)
        spread = g.index_select(2, rows).index_select(3, cols)
        return (torch.where(indices, spread, spread.new_zeros(())),)
    x = _shape_only(g, (n, c, *input_hw))
    ceil_mode = _ceil_mode_of(input_hw, g.shape[2:], kernel_size, stride, padding)
    return (
        _aten.max_pool2d_with_indices_backward(
            g, x, kernel_size, stride, padding, _NO_DILATION, ceil_mode, indices
        ).contiguous(),
    )


def _window_of(size: int, stride: int, padding: int, out: int, device: torch.device) -> Tensor:
    """For each input position, the (non-overlapping) pooling window that covers it."""
    return ((torch.arange(size, device=device) + padding) // stride).clamp_(max=out - 1)


@conventions.implements
def maxpool2d_mask(indices, *, kernel_size, stride, padding, input_hw):
    """The argmax positions as a bool mask of the input's shape (one per window; ties
    resolved as PyTorch resolved them). Exact only for non-overlapping windows."""
    n, c = indices.shape[:2]
    mask = torch.zeros(n, c, input_hw[0] * input_hw[1], dtype=torch.bool, device=indices.device)
    mask.scatter_(2, indices.reshape(n, c, -1), True)
    return mask.reshape(n, c, *input_hw)


@conventions.implements
def avgpool2d(x, *, kernel_size, stride, padding, ceil_mode):
    """aten::avg_pool2d (count_include_pad); the backward needs no activation."""
    return _aten.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, True, None)


@conventions.implements
def avgpool2d_backward(g, *, kernel_size, stride, padding, input_hw, needs):
    """aten::avg_pool2d_backward; it reads only the input's shape, given as a 0-stride tensor."""
    if not _need(needs, 0):
        return (None,)
    shape = _shape_only(g, (*g.shape[:-2], *input_hw))
    ceil_mode = _ceil_mode_of(input_hw, g.shape[-2:], kernel_size, stride, padding)
    return (
        _aten.avg_pool2d_backward(g, shape, kernel_size, stride, padding, ceil_mode, True, None),
    )


@conventions.implements
def adaptive_avgpool2d(x, *, output_size):
    """As F.adaptive_avg_pool2d: a mean over H, W for 1x1, else aten::_adaptive_avg_pool2d."""
    if tuple(output_size) == (1, 1):
        return x.mean((-1, -2), keepdim=True)
    return _aten._adaptive_avg_pool2d(x, output_size)


@conventions.implements
def adaptive_avgpool2d_backward(g, *, output_size, input_hw, needs):
    """mean's backward (expand / numel) for 1x1, else aten::_adaptive_avg_pool2d_backward
    given a 0-stride tensor of the input's shape."""
    if not _need(needs, 0):
        return (None,)
    shape = (*g.shape[:-2], *input_hw)
    if tuple(output_size) == (1, 1):
        return (g.expand(shape).div(input_hw[0] * input_hw[1]),)
    return (_aten._adaptive_avg_pool2d_backward(g, _shape_only(g, shape)),)


# ---------------------------------------------------------------- upsampling


def _upsample_size(
    hw: tuple[int, int] | torch.Size, scale_factor: tuple[float, float]
) -> list[int]:
    # as ATen's compute_output_size for scale factors: int64(in * scale), i.e. floor
    return [int(hw[0] * scale_factor[0]), int(hw[1] * scale_factor[1])]


@conventions.implements
def upsample(x, *, scale_factor, mode, align_corners):
    """As nn.Upsample(scale_factor=...): aten::upsample_{nearest,bilinear}2d with the scales
    passed through, as F.interpolate with recompute_scale_factor=None; saves nothing."""
    size = _upsample_size(x.shape[-2:], scale_factor)
    sh, sw = float(scale_factor[0]), float(scale_factor[1])
    if mode == "nearest":
        return _aten.upsample_nearest2d(x, size, sh, sw)
    if mode == "bilinear":
        return _aten.upsample_bilinear2d(x, size, bool(align_corners), sh, sw)
    raise ValueError(f"upsample: unsupported mode {mode!r}")


@conventions.implements
def upsample_backward(g, *, scale_factor, mode, align_corners, input_hw, needs):
    """aten::upsample_{nearest,bilinear}2d_backward; sizes come from g and input_hw."""
    if not _need(needs, 0):
        return (None,)
    out_hw = list(g.shape[-2:])
    in_size = [*g.shape[:-2], *input_hw]
    sh, sw = float(scale_factor[0]), float(scale_factor[1])
    if mode == "nearest":
        return (_aten.upsample_nearest2d_backward(g, out_hw, in_size, sh, sw),)
    if mode == "bilinear":
        return (
            _aten.upsample_bilinear2d_backward(g, out_hw, in_size, bool(align_corners), sh, sw),
        )
    raise ValueError(f"upsample: unsupported mode {mode!r}")


# ---------------------------------------------------------------- dropout


@conventions.implements
def dropout(x, *, p):
    """As F.dropout(train=True), same random draws. Saves a bool keep-mask (autograd saves float
    noise on CPU, the same bool mask from aten::native_dropout on CUDA). The mask is None for
    p == 0 (identity) and p == 1 (all dropped)."""
    if p == 0 or x.numel() == 0:
        return x, None
    if p == 1:
        return x * x.new_zeros(()), None
    if x.device.type in _FUSED_DROPOUT_DEVICES:
        return _aten.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    mask = noise.bool()
    return x * noise.div_(1 - p), mask


@conventions.implements
def dropout_backward(g, mask, *, p, needs):
    """g * noise with noise rebuilt from the mask exactly as forward made it (CPU), or
    aten::native_dropout_backward (fused devices)."""
    if not _need(needs, 0):
        return (None,)
    if p == 1:
        return (g * g.new_zeros(()),)
    if mask is None:
        return (g,)
    if g.device.type in _FUSED_DROPOUT_DEVICES:
        return (_aten.native_dropout_backward(g, mask, 1.0 / (1.0 - p)),)
    return (g * mask.to(g.dtype).div_(1 - p),)


@conventions.implements
def drop_path(x, *, p, scale):
    """Stochastic depth: x times a per-sample factor (keep / (1 - p), or keep unscaled), the
    keep-mask drawn from a generator seeded by one draw of torch's random stream. Returns
    (y, seed); the backward draws the mask again from the seed (nothing batch-sized kept)."""
    if p == 0 or x.numel() == 0:
        return x, None
    seed = random_seed()
    return x * drop_path_factor(seed, x, p, scale), seed


@conventions.implements
def drop_path_backward(g, seed, *, p, scale, needs):
    """g times the forward's per-sample factor, remade from the seed."""
    if not _need(needs, 0):
        return (None,)
    if seed is None:
        return (g,)
    return (g * drop_path_factor(seed, g, p, scale),)


def drop_path_factor(seed: Tensor, x: Tensor, p: float, scale: bool) -> Tensor:
    """[N, 1, ...]: 1 / (1 - p) (or 1 unscaled) for a kept sample, 0 for a dropped one; the
    keep-mask is ``seeded_keep`` over the batch (each sample kept with probability 1 - p)."""
    keep = seeded_keep(seed, (x.shape[0],), p, x.device).to(x.dtype)
    factor = keep / (1 - p) if scale else keep
    return factor.reshape(x.shape[0], *([1] * (x.dim() - 1)))


# ---------------------------------------------------------------- losses (mean reduction)


@conventions.implements
def cross_entropy(logits, target, *, label_smoothing, ignore_index):
    """As F.cross_entropy: aten::_log_softmax over dim 1 then aten's nll (nll_loss_nd's
    choice of kernel and view); with label smoothing, PyTorch's composite
    (1 - ls) * nll + ls / C * (the mean over kept elements of -sum_c log_probs), op for op.
    Autograd saves the log-probabilities (and the target).

    Logits whose classes are the innermost dim in memory (a token model's [N, L, C] head
    seen as [N, C, L] through a permute) keep that layout: the log-probabilities are made
    over the last dim of the [N, L, C] tensor and seen as [N, C, L] again, so the gradient
    made in their storage (``consume``) permutes back to a contiguous [N, L, C] tensor and
    the head's linear backward needs no copy of it. aten's log_softmax over dim 1 would
    write them [N, C, L]-contiguous; the values agree to rounding."""
    moved = logits.movedim(1, -1)
    if logits.dim() > 2 and moved.is_contiguous():
        log_probs = _aten._log_softmax(moved, -1, False).movedim(-1, 1)
    else:
        log_probs = _aten._log_softmax(logits, 1, False)
    nll = _nll_forward(log_probs, target, ignore_index)
    if label_smoothing == 0.0:
        return nll, log_probs
    ignored = target == ignore_index
    smooth = log_probs.sum(1).neg().masked_fill_(ignored, 0.0)
    smooth = smooth.sum() / ignored.logical_not().sum()
    classes = logits.shape[1]
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / classes), log_probs


@conventions.implements
def cross_entropy_backward(
    g, log_probs, target, *, label_smoothing, ignore_index, needs, consume: bool = False
):
    """aten's nll backward then aten::_log_softmax_backward_data; the total weight is the
    count of non-ignored targets, as nll_loss_forward computes it. With label smoothing,
    the composite's backward step by step: mul, then div by the count, sum's expand,
    masked_fill, neg and sum's expand over C, added to the nll path's gradient.

    ``consume`` (registry ``backward_consumes``): ``log_probs`` is the caller's own and dead
    after this call, so the logits' gradient is written into it (_cross_entropy_grad_into)
    instead of two new logits-sized tensors."""
    if not _need(needs, 0):
        return _fit((), needs)
    if consume:
        grad = _cross_entropy_grad_into(g, log_probs, target, ignore_index, label_smoothing)
        return _fit((grad,), needs)
    if label_smoothing == 0.0:
        glp = _nll_backward(g, log_probs, target, ignore_index)
    else:
        glp = _nll_backward(g * (1 - label_smoothing), log_probs, target, ignore_index)
        ignored = target == ignore_index
        g_smooth = g * (label_smoothing / log_probs.shape[1]) / ignored.logical_not().sum()
        g_rows = g_smooth.expand(ignored.shape).masked_fill(ignored, 0).neg()
        glp = glp + g_rows.unsqueeze(1).expand(log_probs.shape)
    moved = log_probs.movedim(1, -1)
    if not log_probs.is_contiguous() and moved.is_contiguous():  # cross_entropy's [N, L, C]
        grad = _aten._log_softmax_backward_data(glp.movedim(1, -1), moved, -1, moved.dtype)
        return _fit((grad.movedim(-1, 1),), needs)
    return _fit((_aten._log_softmax_backward_data(glp, log_probs, 1, log_probs.dtype),), needs)


CROSS_ENTROPY_CHUNKS = 16
"""cross_entropy_low makes its float32 log-probabilities this many chunks of rows at a time
(each at least one row): its working memory is two float32 chunks, a quarter of bf16
logits' bytes (the registry's workspace), whatever the batch."""


def _class_rows(logits: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``logits`` [N, C, d1, ...] as rows [R, C] (the classes innermost: a view of a token
    model's [N, L, C] head seen as [N, C, L]), and what puts a [R, C] tensor back in
    ``logits``' shape (a view of it, the classes innermost in memory)."""
    if logits.dim() == 2:
        return logits, lambda rows: rows
    moved = logits.movedim(1, -1)
    return moved.reshape(-1, logits.shape[1]), lambda rows: rows.view(moved.shape).movedim(-1, 1)


def _row_chunks(rows: Tensor) -> list[tuple[int, int]]:
    step = max(1, -(-rows.shape[0] // CROSS_ENTROPY_CHUNKS))
    return [(i, min(i + step, rows.shape[0])) for i in range(0, rows.shape[0], step)]


@conventions.implements
def cross_entropy_low(logits, target, *, label_smoothing, ignore_index):
    """cross_entropy of low-precision logits, computed in float32 a chunk of rows at a time
    (``CROSS_ENTROPY_CHUNKS``): each chunk's log-probabilities are aten's
    _log_softmax of its rows cast to float32, the bits cross_entropy makes after a float32
    cast of all the logits; the loss sums the chunks' kept rows (-log p of the target,
    with label smoothing -sum_c log p too) over the count of kept rows. No float32 copy of
    the logits, nor their log-probabilities, exists at once."""
    rows, _ = _class_rows(logits)
    flat = target.reshape(-1)
    kept = flat.ne(ignore_index)
    index = torch.where(kept, flat, flat.new_zeros(())).unsqueeze(1)
    nll = smooth = None
    for start, stop in _row_chunks(rows):
        log_probs = _aten._log_softmax(_widened(rows[start:stop]), -1, False)
        keep = kept[start:stop]
        part = log_probs.gather(1, index[start:stop]).squeeze(1).masked_fill(~keep, 0.0).sum()
        nll = part if nll is None else nll + part
        if label_smoothing != 0.0:
            every = log_probs.sum(1).masked_fill(~keep, 0.0).sum()
            smooth = every if smooth is None else smooth + every
    count = kept.sum()
    loss = nll.neg() / count
    if label_smoothing == 0.0:
        return loss
    classes = logits.shape[1]
    return (1 - label_smoothing) * loss + smooth.neg() / count * (label_smoothing / classes)


@conventions.implements
def cross_entropy_low_backward(g, logits, target, *, label_smoothing, ignore_index, needs):
    """The logits' gradient in their dtype, chunk by chunk: the chunk's log-probabilities
    made again (the forward's bits), the gradient of cross_entropy's consume path
    (``_cross_entropy_grad_into``) in float32 over all kept rows' count, then rounded to the
    logits' dtype as autograd's cast backward rounds the float32 gradient."""
    if not _need(needs, 0):
        return _fit((), needs)
    rows, back = _class_rows(logits)
    flat = target.reshape(-1)
    total = flat.ne(ignore_index).sum().to(g.dtype)
    grad = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
    for start, stop in _row_chunks(rows):
        log_probs = _aten._log_softmax(_widened(rows[start:stop]), -1, False)
        part = flat[start:stop]
        grad[start:stop] = _cross_entropy_grad_into(
            g, log_probs, part, ignore_index, label_smoothing, total
        )
    return _fit((back(grad),), needs)


def _cross_entropy_grad_into(
    g: Tensor,
    log_probs: Tensor,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    total: Tensor | None = None,
) -> Tensor:
    """The logits' gradient made in ``log_probs``' storage: exp(log_probs) * s - w_smooth -
    one_hot(target) * w_nll per kept row, where w_nll = g (1 - ls) / count, w_smooth =
    g ls / C / count and s = w_nll + C w_smooth (what _log_softmax_backward_data sums
    over the classes); zero on ignored rows (all ignored: zero, as aten's kernels give).
    aten's kernels compute the same products in another order, so the results differ
    only where their exp or a fused multiply-add rounds differently. ``total``: the count
    of kept rows (default: those of ``target``; cross_entropy_low's chunks pass all's)."""
    kept = target.ne(ignore_index)
    total = kept.sum().to(g.dtype) if total is None else total
    zero = g.new_zeros(())
    classes = log_probs.shape[1]
    w_nll = torch.where(kept, g * (1 - label_smoothing) / total, zero).unsqueeze(1)
    index = torch.where(kept, target, target.new_zeros(())).unsqueeze(1)
    if label_smoothing == 0.0:
        return log_probs.exp_().mul_(w_nll).scatter_add_(1, index, w_nll.neg())
    w_smooth = torch.where(kept, g * (label_smoothing / classes) / total, zero).unsqueeze(1)
    grad = log_probs.exp_().mul_(w_nll + classes * w_smooth).sub_(w_smooth)
    return grad.scatter_add_(1, index, w_nll.neg())


@conventions.implements
def mse_loss(a, b):
    """aten::mse_loss(mean); autograd saves both arguments."""
    return _aten.mse_loss(a, b, _MEAN)


@conventions.implements
def mse_loss_backward(g, a, b, *, needs):
    """aten::mse_loss_backward for a, and with the arguments swapped for b (derivatives.yaml)."""
    ga = _aten.mse_loss_backward(g, a, b, _MEAN) if _need(needs, 0) else None
    gb = _aten.mse_loss_backward(g, b, a, _MEAN) if _need(needs, 1) else None
    return (ga, gb)


@conventions.implements
def l1_loss_backward(g, a, b, *, needs):
    """mean -> abs -> sub backward: sgn(a - b) * g / numel for a, its negation for b."""
    if not (_need(needs, 0) or _need(needs, 1)):
        return (None, None)
    diff = a - b
    ga = g.expand(diff.shape).div(diff.numel()) * diff.sgn()
    return (ga if _need(needs, 0) else None, ga.neg() if _need(needs, 1) else None)


@conventions.implements
def bce_loss(p, t):
    """aten::binary_cross_entropy(mean); autograd saves both arguments."""
    return _aten.binary_cross_entropy(p, t, None, _MEAN)


@conventions.implements
def bce_loss_backward(g, p, t, *, needs):
    """aten::binary_cross_entropy_backward for p; for t, -logit(p) * g / numel (autograd's
    binary_cross_entropy_target_backward)."""
    gp = _aten.binary_cross_entropy_backward(g, p, t, None, _MEAN) if _need(needs, 0) else None
    gt = torch.logit(p).neg_().mul_(g).div_(t.numel()) if _need(needs, 1) else None
    return (gp, gt)


@conventions.implements
def bce_with_logits(x, t):
    """aten::binary_cross_entropy_with_logits(mean); autograd saves both arguments."""
    return _aten.binary_cross_entropy_with_logits(x, t, None, None, _MEAN)


@conventions.implements
def bce_with_logits_backward(g, x, t, *, needs):
    """(sigmoid(x) - t) * g / numel for x and -x * g / numel for t, as autograd's
    binary_cross_entropy_with_logits_{,target_}backward."""
    gx = (x.sigmoid() - t).mul_(g).div_(x.numel()) if _need(needs, 0) else None
    gt = x.neg().mul_(g).div_(t.numel()) if _need(needs, 1) else None
    return (gx, gt)


# ---------------------------------------------------------------- softmax, log_softmax (v2)


@conventions.implements
def softmax_backward(g, y, *, dim, needs):
    """aten's _softmax_backward_data with the saved output, as autograd."""
    if not _need(needs, 0):
        return (None,)
    return (torch._softmax_backward_data(g, y, dim, y.dtype),)


@conventions.implements
def log_softmax_backward(g, y, *, dim, needs):
    """aten's _log_softmax_backward_data with the saved output, as autograd."""
    if not _need(needs, 0):
        return (None,)
    return (torch._log_softmax_backward_data(g, y, dim, y.dtype),)


# ---------------------------------------------------------------- gradients added into .grad
#
# A backward kernel called with ``accumulate=True`` (registry ``backward_accumulates``; the
# code generator passes it inside segments run in pieces of the batch) adds its parameter
# gradients into each parameter's ``.grad`` itself and returns None for them: from the
# second piece on, a matmul adds its product into ``.grad`` in place (``addmm_``) instead of
# making a parameter-sized gradient to add, so later pieces need no more memory than the
# first. Equal to the gradient made and then added, to rounding.


def _product_grad(param: Tensor, a: Tensor, b: Tensor, into: bool) -> Tensor | None:
    """``param``'s gradient a @ b, returned; ``into``: added into param.grad instead (the
    product itself becomes .grad when there is none yet, else ``addmm_`` in place) and None
    returned."""
    if not into:
        return a.mm(b)
    with torch.no_grad():
        if param.grad is None:
            _accumulate_one(param, a.mm(b), adopt=True)
        else:
            param.grad.addmm_(a, b)
    return None


def _rows_grad(param: Tensor | None, rows: Tensor, into: bool) -> Tensor | None:
    """A bias gradient, the sum of ``rows`` [M, C] over M: returned, or with ``into`` added
    into param.grad and None returned."""
    if not into:
        return rows.sum(0)
    if param is not None:
        _accumulate_one(param, rows.sum(0), adopt=True)
    return None


def linear(x: Tensor, layer: Any) -> Tensor:
    """common.linear; a weight left sharded where its rows live (``--shard``: an LM's head,
    ``unroller.parallel.rows``) computed there."""
    weight, bias = _weight_bias(layer)
    if _rows.is_rows(weight):
        return _rows.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def linear_backward(
    g: Tensor, x: Tensor, layer: Any, *, needs: Needs | None = None, accumulate: bool = False
) -> Grads:
    """common.linear_backward; ``accumulate``: the weight and bias gradients are added into
    their ``.grad`` (see above) and returned as None. A weight sharded where its rows live:
    ``unroller.parallel.rows``, its gradients those of this rank's rows."""
    weight, bias = _weight_bias(layer)
    if _rows.is_rows(weight):
        wanted = (_need(needs, 0), _need(needs, 1), _need(needs, 2))
        gx, gw, gb = _rows.linear_backward(g, x, weight, bias, *wanted)
        if not accumulate:
            return _fit((gx, gw, gb), needs)
        accumulate_fresh(layer, weight=gw, bias=gb)
        return _fit((gx, None, None), needs)
    if not accumulate:
        return _common.linear_backward(g, x, layer, needs=needs)
    gx = g.matmul(layer.weight) if _need(needs, 0) else None
    g2 = g.reshape(-1, g.shape[-1])
    if _need(needs, 1):
        _product_grad(layer.weight, g2.t(), x.reshape(-1, x.shape[-1]), into=True)
    if _need(needs, 2):
        _rows_grad(_weight_bias(layer)[1], g2, into=True)
    return _fit((gx, None, None), needs)


def transposed_linear_backward(
    g: Tensor, x: Tensor, layer: Any, *, needs: Needs | None = None, accumulate: bool = False
) -> Grads:
    """common.transposed_linear_backward; ``accumulate`` as for ``linear_backward``."""
    if not accumulate:
        return _common.transposed_linear_backward(g, x, layer, needs=needs)
    g2 = g.reshape(-1, g.shape[-1])
    gx = g.matmul(layer.weight.t()) if _need(needs, 0) else None
    if _need(needs, 1):
        _product_grad(layer.weight, x.reshape(-1, x.shape[-1]).t(), g2, into=True)
    if _need(needs, 2):
        _rows_grad(_weight_bias(layer)[1], g2, into=True)
    return _fit((gx, None, None), needs)


# ---------------------------------------------------------------- attention
#
# Both keep q, k, v, the output and the row logsumexp lse [N, H, L], never the [N, H, L, S]
# probabilities. On the CPU they are ATen's flash-attention kernels, the ones
# F.scaled_dot_product_attention runs under autograd there (so the values are autograd's,
# bit for bit); elsewhere, or where that kernel does not apply (v's head size differs from
# q's), unroller.runtime.attention's block-by-block version of the same algorithm, which
# equals them to rounding (1e-10 in float64) and is also the ipu platform's.


def _aten_flash(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """May ATen's CPU flash-attention kernels take these? (CPU tensors of 4 dims, of one float
    dtype (bfloat16 and float16 too: the kernels accumulate in float32, as F.sdpa under
    torch.autocast runs them), one head size for q, k and v, each head's entries adjacent: the kernel reads a
    head dim of another stride as if it were 1 and returns garbage, where
    F.scaled_dot_product_attention checks the stride and runs another kernel; heads split
    from a transposed projection, (W @ x^T)^T, have such a stride.)"""
    return (
        q.device.type == "cpu"
        and q.dim() == k.dim() == v.dim() == 4
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and q.dtype == k.dtype == v.dtype
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and _flash_enabled()
    )


def _flash_enabled() -> bool:
    """False when ``UNROLLER_ATEN_ATTENTION`` is ``0`` (then the block version runs on the CPU
    too: what tests and benchmarks compare it by)."""
    return os.environ.get("UNROLLER_ATEN_ATTENTION", "1").strip() != "0"


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float | None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(output, lse): ATen's CPU flash kernel where it applies (no bias), else the blocks."""
    if bias is None and _aten_flash(q, k, v):
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, scale=scale
        )
    return _blocks.scaled_dot_product_attention(q, k, v, bias, is_causal=is_causal, scale=scale)


@conventions.implements
def scaled_dot_product_attention(q, k, v, bias, *, is_causal, scale, enable_gqa, dropout):
    """F.scaled_dot_product_attention (a float attn_mask ``bias`` [N or 1, H or 1, L, S]
    added to the scores, and/or the causal mask). Returns (output [N, H, L,
    Ev], lse [N, H, L], seed); the backward reads q, k, v, the output, lse and the seed.
    ``enable_gqa``: k and v may have fewer heads, each serving a group of query heads.
    ``dropout`` > 0: the probabilities are dropped with a keep-mask drawn from a generator
    seeded by one draw of torch's random stream (``seeded_keep``), which the backward
    draws again from the kept seed (the mask is never kept); the attention then runs whole."""
    if enable_gqa:
        k, v = _blocks.gqa_heads(k, q.shape[1]), _blocks.gqa_heads(v, q.shape[1])
    if dropout:
        seed = random_seed()
        keep = seeded_keep(seed, (*q.shape[:-1], k.shape[-2]), dropout, q.device)
        out, lse = _dropped_attention(q, k, v, keep, dropout, is_causal, scale, bias)
        return out, lse, seed
    out, lse = _attention(q, k, v, is_causal, scale, bias)
    return out, lse, None


def random_seed() -> Tensor:
    """One draw of torch's random stream (CPU) seeding a mask that the backward draws again
    (attention dropout, stochastic depth): the step keeps this int64, never the mask."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


def seeded_keep(seed: Tensor, shape: tuple[int, ...], p: float, device) -> Tensor:
    """A keep-mask (attention dropout's, stochastic depth's): uniform float32 draws of a
    generator seeded with ``seed``, kept where at least p (each with probability 1 - p)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed.item()))
    return torch.rand(shape, generator=generator, device=device) >= p


def _scores(
    q: Tensor, k: Tensor, is_causal: bool, scale: float | None, bias: Tensor | None
) -> Tensor:
    qa, kb = _attention_factors(q.shape[-1], scale)
    s = torch.matmul(q * qa, (k * kb).transpose(-2, -1))
    if bias is not None:
        s = s + bias
    if is_causal:
        rows, cols = s.shape[-2:]
        allowed = torch.ones(rows, cols, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _dropped_attention(q, k, v, keep, p, is_causal, scale, bias) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, is_causal, scale, bias)
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(probs * keep / (1 - p), v), lse


@conventions.implements
def scaled_dot_product_attention_backward(
    g, q, k, v, output, lse, seed, bias, *, is_causal, scale, enable_gqa, dropout, needs
):
    """Gradients of q, k, v and the bias (only those ``needs`` asks for), the probabilities
    remade from q, k, the bias and lse (and the dropout mask from the seed)."""
    if not any(_need(needs, i) for i in range(4 if bias is not None else 3)):
        return _fit((), needs)
    if enable_gqa and k.shape[1] != q.shape[1]:
        return _blocks.gqa_backward(
            scaled_dot_product_attention_backward,
            *(g, q, k, v, output, lse, seed, bias),
            is_causal=is_causal,
            scale=scale,
            dropout=dropout,
            needs=needs,
        )
    if dropout:
        return _dropped_attention_backward(
            g, q, k, v, output, lse, seed, dropout, is_causal, scale, needs, bias
        )
    if bias is not None:
        return _blocks.scaled_dot_product_attention_backward(
            g, q, k, v, output, lse, bias, is_causal=is_causal, scale=scale, needs=needs
        )
    if _aten_flash(q, k, v):
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, output, lse, 0.0, is_causal, scale=scale
        )
        return _fit(grads, needs)
    return _blocks.scaled_dot_product_attention_backward(
        g, q, k, v, output, lse, is_causal=is_causal, scale=scale, needs=needs
    )


def _dropped_attention_backward(g, q, k, v, output, lse, seed, p, is_causal, scale, needs, bias):
    """dV = (P * Z)^T dO, dP = (dO V^T) * Z, dS = P * (dP - rowsum(dO * O)), with Z the
    kept mask over 1 - p, remade from the seed; dQ, dK through the two scale factors."""
    qa, kb = _attention_factors(q.shape[-1], scale)
    probs = torch.exp(_scores(q, k, is_causal, scale, bias) - lse.unsqueeze(-1))
    keep = seeded_keep(seed, probs.shape, p, q.device)
    dropped = probs * keep / (1 - p)  # as the forward made it
    gv = torch.matmul(dropped.transpose(-2, -1), g) if _need(needs, 2) else None
    gq = gk = gbias = None
    need_bias = bias is not None and _need(needs, 3)
    if _need(needs, 0) or _need(needs, 1) or need_bias:
        d = (g * output).sum(-1, keepdim=True)
        ds = (torch.matmul(g, v.transpose(-2, -1)) / (1 - p) * keep - d) * probs
        gq = torch.matmul(ds, k * kb) * qa if _need(needs, 0) else None
        gk = torch.matmul(ds.transpose(-2, -1), q * qa) * kb if _need(needs, 1) else None
        gbias = _blocks.bias_grad(ds, bias) if need_bias else None
    return _fit((gq, gk, gv) if bias is None else (gq, gk, gv, gbias), needs)


def _mha_tensors(layer: torch.nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias (biases None without)."""
    out_weight, out_bias = _weight_bias(layer.out_proj)
    return layer.in_proj_weight, getattr(layer, "in_proj_bias", None), out_weight, out_bias


@conventions.implements
def multihead_attention(x, bias, layer, *, num_heads, is_causal):
    """nn.MultiheadAttention(batch_first=True)(x, x, x, need_weights=False): the packed
    in-projection [N, L, 3E], whose thirds seen as [N, H, L, E/H] are q, k and v (views: ATen's
    CPU flash kernels read them strided, faster than from copies, and write the output in
    the same [N, L, H, E/H] order, so the context [N, L, E] is a view too), the attention,
    the out-projection. Rows stay in the input's [N, L] order throughout, so no step copies
    x or the output gradient to reorder them (F.multi_head_attention_forward works in
    [L, N]: the values agree to rounding, float64 to 1e-10). ``bias``: [N or 1, H or 1,
    L, L] added to the scores (a key padding mask); a call without it is (x, layer), as
    generated code makes it. Returns (y, q, k, v, lse, context): lse [N, H, L] the row
    logsumexp the attention backward reads beside q, k, v and the context (its output)."""
    if layer is None:  # (x, layer): the optional bias left out
        bias, layer = None, bias
    n, length, embed = x.shape
    w_in, b_in, w_out, b_out = _mha_tensors(layer)
    proj = torch.nn.functional.linear(x, w_in, b_in)
    heads = proj.view(n, length, 3, num_heads, embed // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = heads.unbind(0)
    del proj, heads
    y, lse = _attention(q, k, v, is_causal, None, bias)
    context = y.transpose(1, 2).reshape(n, length, embed)
    del y
    return torch.nn.functional.linear(context, w_out, b_out), q, k, v, lse, context


def _packed_grad(
    g_context: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    context: Tensor,
    is_causal: bool,
    bias: Tensor | None = None,
    need_bias: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The packed in-projection's output gradient [N * L, 3E] from the context's
    [N * L, E]: the attention backward on the heads, then each head gradient copied into
    its third of the packed layout and released (the values torch.cat of the three gives,
    with fewer bytes live at once); and the bias's gradient where asked. A function of its
    own so that the heads' gradients are freed when it returns."""
    n, heads, length, head_dim = q.shape
    g_y = g_context.view(n, length, heads, head_dim).transpose(1, 2)
    del g_context
    y = context.view(n, length, heads, head_dim).transpose(1, 2)
    needs = (True, True, True, need_bias)
    grads = list(
        scaled_dot_product_attention_backward(
            g_y, q, k, v, y, lse, None, bias, is_causal=is_causal, needs=needs
        )
    )
    del g_y
    g_proj = q.new_empty(n, length, 3, heads, head_dim)
    for i in range(3):
        g_proj[:, :, i].copy_(grads[i].transpose(1, 2))
        grads[i] = None
    return g_proj.view(n * length, 3 * heads * head_dim), grads[3] if need_bias else None


@conventions.implements
def multihead_attention_backward(
    g, x, layer, q, k, v, lse, context, bias, *, is_causal, needs, accumulate: bool = False
):
    """The backward of the forward above: the out-projection's (rows in [N, L] order), the
    attention's (block by block, from q, k, v, the context as its output and lse), the
    heads joined back into the packed layout, then the in-projection's. Gradients: x,
    the bias (where given; summed over the dims it broadcasts), in_proj_weight,
    in_proj_bias, out_proj.weight, out_proj.bias; ``accumulate``: the four parameter
    gradients are added into their ``.grad`` and returned as None."""
    args = (g, x, layer, q, k, v, lse, context)
    if bias is None:
        return _mha_backward(*args, None, False, is_causal, needs, accumulate)[0]
    rest = None if needs is None else (*needs[:1], *needs[2:])  # without the bias's slot
    grads, g_bias = _mha_backward(*args, bias, _need(needs, 1), is_causal, rest, accumulate)
    return _fit((grads[0] if grads else None, g_bias, *grads[1:]), needs)


def _mha_backward(
    g, x, layer, q, k, v, lse, context, bias, need_bias, is_causal, needs, accumulate
):
    """multihead_attention_backward's gradients of x and the four parameters, and the
    bias's (None unless ``need_bias``)."""
    if not (need_bias or any(_need(needs, i) for i in range(5))):
        return _fit((), needs), None
    n, length, embed = x.shape
    w_in, b_in, w_out, b_out = _mha_tensors(layer)
    g2 = g.reshape(n * length, embed)
    context2 = context.reshape(n * length, embed)
    g_w_out = g_b_out = gx = g_w_in = g_b_in = None
    if _need(needs, 3):
        g_w_out = _product_grad(w_out, g2.t(), context2, accumulate)
    if _need(needs, 4):
        g_b_out = _rows_grad(b_out, g2, accumulate)
    g_bias = None
    if need_bias or any(_need(needs, i) for i in range(3)):
        g_proj, g_bias = _packed_grad(
            g2.mm(w_out), q, k, v, lse, context, is_causal, bias, need_bias
        )
        del g2  # only the out-projection's gradients read it
        if _need(needs, 2):
            g_b_in = _rows_grad(b_in, g_proj, accumulate)
        if _need(needs, 1):
            g_w_in = _product_grad(w_in, g_proj.t(), x.reshape(n * length, embed), accumulate)
        if _need(needs, 0):
            gx = g_proj.mm(w_in).view(n, length, embed)
    return _fit((gx, g_w_in, g_b_in, g_w_out, g_b_out), needs), g_bias


# ---------------------------------------------------------------- normalisation and 1-D ops (v2)


@conventions.implements
def layernorm(x, layer, *, normalized_shape, eps):
    """aten::native_layer_norm, as F.layer_norm; autograd saves x, mean, rstd, weight, bias."""
    weight, bias = _weight_bias(layer)
    return _aten.native_layer_norm(x, normalized_shape, weight, bias, eps)


@conventions.implements
def layernorm_backward(g, x, layer, mean, rstd, *, normalized_shape, needs):
    """aten::native_layer_norm_backward; bias is read only for its presence (its gradient)."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight, bias = _weight_bias(layer)
    grads = _aten.native_layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias, mask)
    return _fit(grads, needs)


@conventions.implements
def groupnorm(x, layer, *, num_groups, eps):
    """aten::native_group_norm, as F.group_norm; autograd saves x, weight, mean, rstd."""
    weight, bias = _weight_bias(layer)
    n, c = x.shape[:2]
    return _aten.native_group_norm(x, weight, bias, n, c, x.shape[2:].numel(), num_groups, eps)


@conventions.implements
def groupnorm_backward(g, x, layer, mean, rstd, *, num_groups, needs):
    """aten::native_group_norm_backward."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight, _ = _weight_bias(layer)
    n, c = x.shape[:2]
    grads = _aten.native_group_norm_backward(
        g, x, mean, rstd, weight, n, c, x.shape[2:].numel(), num_groups, mask
    )
    return _fit(grads, needs)


# BatchNorm1d is BatchNorm2d's computation on [N, C] or [N, C, L]: aten::native_batch_norm
# takes any rank, so the 2-D kernels serve unchanged.
batchnorm1d = batchnorm2d
batchnorm1d_backward = batchnorm2d_backward
batchnorm1d_eval = batchnorm2d_eval
batchnorm1d_recompute = batchnorm2d_recompute


@conventions.implements
def conv1d(x, layer, *, stride, padding, dilation, groups):
    """aten::convolution on [N, C, L], as F.conv1d; autograd saves x and weight."""
    weight, bias = _weight_bias(layer)
    return _aten.convolution(x, weight, bias, [stride], [padding], [dilation], False, [0], groups)


@conventions.implements
def conv1d_backward(
    g,
    x,
    layer,
    *,
    stride,
    padding,
    dilation,
    groups,
    needs,
    piece_bytes: int = 0,
    in_place: bool = False,
    add_into: Tensor | None = None,
):
    """aten::convolution_backward with one spatial dim; ``piece_bytes``, ``in_place``, ``add_into``: see
    _conv_backward."""
    mask = _need_mask(needs)
    if not any(mask):
        return _fit((), needs)
    weight = layer.weight
    grads = _conv_backward(
        g,
        x,
        weight,
        [weight.shape[0]],
        [stride],
        [padding],
        [dilation],
        False,
        [0],
        groups,
        mask,
        piece_bytes,
        in_place,
        add_into,
    )
    return _fit(grads, needs)


@conventions.implements
def maxpool1d_mask(indices, *, kernel_size, stride, padding, input_length):
    """The argmax positions as a bool mask of the input's shape (non-overlapping windows)."""
    n, c = indices.shape[:2]
    mask = torch.zeros(n, c, input_length, dtype=torch.bool, device=indices.device)
    return mask.scatter_(2, indices, True)


# The kernels made from this platform's own (see derived's doc).
derived.install(globals())

__all__ = _exports(globals())
