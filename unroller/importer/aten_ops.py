"""ATen operator -> registry operator: one small function per ATen op, side by side.

A mapper receives a ``NodeView`` (``torch_view``): the node's arguments by schema
name (defaults filled in), the names of the values it reads, the parameter each weight
placeholder is, and the output shape with ``"N"`` for the batch. It returns a
statement (``view.stmt``), an identity (``view.alias``), or refuses with the exact
reason (``Refuse``): only argument combinations whose value and gradient the registry
operator computes exactly are mapped. Adding an ATen op is one decorated function here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from unroller.importer.model import BATCH, shape_text
from unroller.importer.registry import op_table


class Refuse(Exception):
    """This node has no exact registry equivalent; the message says why."""


def schema_arguments(node) -> dict:
    """The node's arguments by their ATen schema names, defaults filled in."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        raise Refuse("not an ATen operator")
    out = {}
    positional = list(node.args)
    for i, arg in enumerate(schema.arguments):
        if i < len(positional):
            out[arg.name] = positional[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


#: ATen overload or packet name ("aten.conv2d.default" / "aten.conv2d") -> mapper.
MAPPERS, maps = op_table()


def mapper_for(target_name: str) -> Callable | None:
    """The mapper for an overload name, else for its packet (``aten.add_.Tensor`` ->
    ``aten.add_``)."""
    if target_name in MAPPERS:
        return MAPPERS[target_name]
    packet = target_name.rsplit(".", 1)[0]
    return MAPPERS.get(packet)


def pair(value) -> int | tuple[int, int]:
    """``[3, 3]`` -> 3, ``[3, 1]`` -> (3, 1): the short form the model files use."""
    values = tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    if len(values) == 1:
        return values[0]
    return values[0] if len(set(values)) == 1 else values


def single(value) -> int:
    values = tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    if len(set(values)) != 1:
        raise Refuse(f"expected one size, got {list(values)}")
    return values[0]


def _dim(view, dim: int, rank: int | None = None, what: str = "dim") -> int:
    rank = len(view.in_shape(0)) if rank is None else rank
    dim = dim + rank if dim < 0 else dim
    if dim == 0:
        raise Refuse(f"{what} 0 is the batch dim: the batch must stay first and whole")
    return dim


def _dims(view, dims, keep_negative: bool = False) -> int | tuple[int, ...]:
    rank = len(view.in_shape(0))
    values = [int(d) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if not values:
        raise Refuse("a reduction over every dim includes the batch")
    for d in values:
        _dim(view, d, rank)
    out = tuple(values)
    return out[0] if len(out) == 1 else out


# ---------------------------------------------------------------- layers with parameters


@maps("aten.conv2d.default", "aten.conv1d.default", "aten.conv2d.padding", "aten.conv1d.padding")
def conv(view):
    a = view.a
    if isinstance(a["padding"], str):
        a = dict(a, padding=_numeric_padding(view, a))
    weight = view.param_shape("weight")
    one_d = ".conv1d." in view.target
    size = single if one_d else pair
    return view.stmt(
        "conv1d" if one_d else "conv2d",
        [view.value("input")],
        layer=view.layer("weight", "bias"),
        out_channels=weight[0],
        kernel_size=size(weight[2:]),
        stride=size(a["stride"]),
        padding=size(a["padding"]),
        dilation=size(a["dilation"]),
        groups=int(a["groups"]),
        bias=a["bias"] is not None,
    )


def _numeric_padding(view, a) -> list[int]:
    """``padding='valid'`` is 0; ``'same'`` pads ``dilation * (kernel - 1)`` in all, torch
    putting the odd one on the right: the registry's symmetric padding equals it only where
    that total is even (an odd kernel, or an even dilation)."""
    kernel = view.param_shape("weight")[2:]
    if a["padding"] == "valid":
        return [0] * len(kernel)
    if a["padding"] != "same":
        raise Refuse(f"padding={a['padding']!r}: not 'valid' or 'same'")
    dilation = list(a["dilation"]) * (len(kernel) if len(a["dilation"]) == 1 else 1)
    totals = [int(d) * (int(k) - 1) for d, k in zip(dilation, kernel)]
    if any(t % 2 for t in totals):
        raise Refuse(
            f"padding='same' with kernel {tuple(kernel)} pads one more on the right than on "
            "the left, which no registry convolution does; pad with F.pad and padding=0"
        )
    return [t // 2 for t in totals]


@maps("aten.conv_transpose2d.input")
def conv_transpose2d(view):
    a = view.a
    weight = view.param_shape("weight")
    return view.stmt(
        "conv_transpose2d",
        [view.value("input")],
        layer=view.layer("weight", "bias"),
        out_channels=weight[1] * int(a["groups"]),
        kernel_size=pair(weight[2:]),
        stride=pair(a["stride"]),
        padding=pair(a["padding"]),
        output_padding=pair(a["output_padding"]),
        dilation=pair(a["dilation"]),
        groups=int(a["groups"]),
        bias=a["bias"] is not None,
    )


@maps("aten.linear.default")
def linear(view):
    weight = view.param_shape("weight")
    return view.stmt(
        "linear",
        [view.value("input")],
        layer=view.layer("weight", "bias"),
        out_features=weight[0],
        bias=view.a["bias"] is not None,
    )


@maps("aten.batch_norm.default")
def batch_norm(view):
    a = view.a
    if not a["training"]:
        raise Refuse(
            "batch norm in eval mode inside a training step (track_running_stats "
            "off with no batch statistics)"
        )
    if a["running_mean"] is not None and not isinstance(a["momentum"], float):
        raise Refuse("momentum=None (a cumulative average) is not supported")
    rank = len(view.in_shape("input"))
    if rank not in (2, 3, 4):
        raise Refuse(f"batch norm of a {rank}-D input")
    layer = view.layer("weight", "bias", running_mean="running_mean", running_var="running_var")
    tracking = a["running_mean"] is not None
    if tracking:
        view.expect_buffer(layer + ".num_batches_tracked")
    return view.stmt(
        "batchnorm2d" if rank == 4 else "batchnorm1d",
        [view.value("input")],
        layer=layer,
        eps=float(a["eps"]),
        momentum=float(a["momentum"]) if tracking else None,
        affine=a["weight"] is not None,
        track_running_stats=tracking,
    )


@maps("aten.layer_norm.default")
def layer_norm(view):
    a = view.a
    shape = tuple(int(d) for d in a["normalized_shape"])
    if a["weight"] is None and a["bias"] is not None:
        raise Refuse("a layer norm with a bias but no weight")
    layer = view.layer("weight", "bias") if a["weight"] is not None else None
    return view.stmt(
        "layernorm",
        [view.value("input")],
        layer=layer,
        normalized_shape=shape[0] if len(shape) == 1 else shape,
        eps=float(a["eps"]),
        elementwise_affine=a["weight"] is not None,
        bias=a["bias"] is not None,
    )


@maps("aten.rms_norm.default")
def rms_norm(view):
    a = view.a
    shape = tuple(int(d) for d in a["normalized_shape"])
    eps = a.get("eps")
    layer = view.layer("weight") if a.get("weight") is not None else None
    return view.stmt(
        "rmsnorm",
        [view.value("input")],
        layer=layer,
        normalized_shape=shape[0] if len(shape) == 1 else shape,
        eps=None if eps is None else float(eps),
        elementwise_affine=a.get("weight") is not None,
    )


@maps("aten.group_norm.default")
def group_norm(view):
    a = view.a
    if (a["weight"] is None) != (a["bias"] is None):
        raise Refuse("a group norm with only one of weight and bias")
    layer = view.layer("weight", "bias") if a["weight"] is not None else None
    return view.stmt(
        "groupnorm",
        [view.value("input")],
        layer=layer,
        num_groups=int(a["num_groups"]),
        eps=float(a["eps"]),
        affine=a["weight"] is not None,
    )


@maps("aten.embedding.default")
def embedding(view):
    a = view.a
    if a["scale_grad_by_freq"] or a["sparse"]:
        raise Refuse("scale_grad_by_freq / sparse embeddings")
    weight = view.param_shape("weight")
    padding = int(a["padding_idx"])
    ids = view.constant("indices")
    if ids is not None:
        return _embedding_rows(view, ids, weight, padding)
    return view.stmt(
        "embedding",
        [view.value("indices")],
        layer=view.layer("weight"),
        num_embeddings=weight[0],
        embedding_dim=weight[1],
        padding_idx=None if padding == -1 else padding,
    )


@maps("aten.index.Tensor")
def index_rows(view):
    """A table indexed by constant positions, ``weight[position_ids]`` (Whisper's learned
    positions): ``embedding_rows``, as the embedding of those ids; any other index is the
    fallback's (the call run as is) or refused."""
    indices = view.a["indices"]
    ids = None
    if len(indices) == 1 and view.is_tensor(indices[0]):
        view.a["ids"] = indices[0]
        ids = view.constant("ids")
    if ids is None or ids.is_floating_point() or ids.dtype == torch.bool:
        raise Refuse("index: the registry has no operator for it")
    view.a["weight"] = view.a["self"]  # the table, under the registry's parameter name
    weight = view.param_shape("weight")
    if len(weight) != 2:
        raise Refuse("index of a parameter that is not a 2-d table")
    return _embedding_rows(view, ids, weight, -1)


def _embedding_rows(view, ids, weight, padding: int):
    """A table looked up at constant positions (position ids, token-type ids): the same
    row range in every sample, as ``embedding_rows`` (a value without the batch dim that
    broadcasts where it is added)."""
    if ids.dim() == 0:
        raise Refuse("an embedding of a single constant index")
    rows = ids.reshape(-1, ids.shape[-1])
    first = rows[0]
    if not bool((rows == first).all()):
        raise Refuse("constant embedding ids that differ between samples")
    start = int(first[0])
    length = first.numel()
    if bool((first == start).all()) and length > 1:
        length = 1  # one row for every position: broadcast over the sequence
    elif not bool((first == torch.arange(start, start + length)).all()):
        raise Refuse("constant embedding ids that are not a contiguous range")
    if padding != -1 and start <= padding < start + length:
        raise Refuse("constant embedding ids that include padding_idx")
    return view.stmt(
        "embedding_rows",
        [],
        layer=view.layer("weight"),
        value_shape=(length, weight[1]),
        num_embeddings=weight[0],
        embedding_dim=weight[1],
        length=length,
        start=start,
    )


# ---------------------------------------------------------------- elementwise


def _unary(op: str, **fixed):
    def mapper(view):
        return view.stmt(op, [view.value("self")], **fixed)

    return mapper


for _name, _op in {
    "relu": "relu",
    "relu_": "relu",
    "sigmoid": "sigmoid",
    "sigmoid_": "sigmoid",
    "tanh": "tanh",
    "tanh_": "tanh",
    "silu": "silu",
    "silu_": "silu",
    "hardswish": "hardswish",
    "hardswish_": "hardswish",
    "hardsigmoid": "hardsigmoid",
    "hardsigmoid_": "hardsigmoid",
    "mish": "mish",
    "mish_": "mish",
    "relu6": "relu6",
    "relu6_": "relu6",
}.items():
    MAPPERS[f"aten.{_name}.default"] = _unary(_op)


@maps("aten.gelu.default", "aten.gelu_.default")
def gelu(view):
    return view.stmt("gelu", [view.value("self")], approximate=str(view.a["approximate"]))


@maps("aten.hardtanh.default", "aten.hardtanh_.default")
def hardtanh(view):
    low, high = float(view.a["min_val"]), float(view.a["max_val"])
    if (low, high) == (0.0, 6.0):
        return view.stmt("relu6", [view.value("self")])
    return view.stmt("hardtanh", [view.value("self")], min_val=low, max_val=high)


@maps("aten.neg.default")
def neg(view):
    """-x is x * -1.0, exactly (rotary embeddings' rotate_half)."""
    return view.stmt("scale", [view.value("self")], factor=-1.0)


@maps("aten.leaky_relu.default", "aten.leaky_relu_.default")
def leaky_relu(view):
    slope = float(view.a["negative_slope"])
    return view.stmt("leaky_relu", [view.value("self")], negative_slope=slope)


@maps("aten.elu.default", "aten.elu_.default")
def elu(view):
    a = view.a
    if float(a["scale"]) != 1.0 or float(a["input_scale"]) != 1.0:
        raise Refuse("elu with scale/input_scale (selu/celu) is not supported")
    return view.stmt("elu", [view.value("self")], alpha=float(a["alpha"]))


@maps("aten.softplus.default")
def softplus(view):
    a = view.a
    return view.stmt(
        "softplus", [view.value("self")], beta=float(a["beta"]), threshold=float(a["threshold"])
    )


def _binary(op: str):
    def mapper(view):
        a = view.a
        if float(a.get("alpha", 1)) != 1.0:
            raise Refuse("alpha != 1")
        other = a["other"]
        if not view.is_tensor(other):
            if op == "mul":
                return view.stmt("scale", [view.value("self")], factor=float(other))
            if op == "div":
                return view.stmt("scale", [view.value("self")], factor=1.0 / float(other))
            raise Refuse(f"{op} of a tensor and the constant {other!r}")
        if not view.is_tensor(a["self"]):
            raise Refuse(f"{op} of the constant {a['self']!r} and a tensor")
        constant = view.constant("other")
        if constant is not None and op in ("add", "sub") and not bool(constant.any()):
            if view.in_shape("self") == view.out_shape():
                return view.alias("self")  # an attention mask that masks nothing
        if constant is not None and op in ("mul", "div") and bool((constant == 1).all()):
            if view.in_shape("self") == view.out_shape():
                return view.alias("self")  # times a mask of ones (DeBERTa's, no padding)
        if op == "add":  # eager attention's scores plus the causal mask, either way round
            for key, mask in (("self", "other"), ("other", "self")):
                if view.is_tensor(a[key]) and _additive_causal(view, mask, key):
                    return view.stmt(
                        "causal_mask", [view.value(key)], value_shape=view.in_shape(key)
                    )
        if (
            constant is not None
            and op in ("mul", "div")
            and isinstance(constant, torch.Tensor)
            and constant.numel() == 1
            and constant.is_floating_point()
            and view.in_shape("self") == view.out_shape()
        ):  # a constant scalar tensor (Gemma's embedding scale, DeBERTa's score scale)
            c = float(constant.reshape(()))
            return view.stmt("scale", [view.value("self")], factor=c if op == "mul" else 1.0 / c)
        return view.stmt(op, [view.value("self"), view.value("other")])

    return mapper


def _additive_causal(view, mask: str, other: str) -> bool:
    """Whether argument ``mask`` is a constant additive causal mask for the scores
    ``other`` ([..., L, S]: 0 where key <= query + S - L, at most -1e30 elsewhere, something
    masked) that broadcasts over the scores' leading dims only, as Hugging Face builds it
    for eager attention."""
    value = view.constant(mask)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 2:
        return False
    if view.constant(other) is not None:
        return False
    shape, out = view.in_shape(other), view.out_shape()
    if len(shape) != len(out) or tuple(shape[-2:]) != tuple(out[-2:]):
        return False
    if tuple(value.shape[-2:]) != tuple(int(d) for d in shape[-2:]):
        return False
    rows, cols = value.shape[-2:]
    keep = torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)
    if bool(keep.all()):
        return False
    flat = value.reshape(-1, rows, cols)
    return bool((flat[:, keep] == 0).all()) and bool((flat[:, ~keep] <= -1e30).all())


for _op in ("add", "sub", "mul", "div"):
    for _form in ("Tensor", "Scalar"):
        MAPPERS[f"aten.{_op}.{_form}"] = _binary(_op)
        MAPPERS[f"aten.{_op}_.{_form}"] = _binary(_op)


@maps("aten.masked_fill.Scalar")
def masked_fill(view):
    """A fill under a constant mask that selects nothing (DeBERTa's attention mask when no
    padding is given) is the tensor itself; any other mask is the fallback's (the call run
    as is) or refused."""
    mask = view.constant("mask")
    if mask is not None and not bool(mask.any()) and view.in_shape("self") == view.out_shape():
        return view.alias("self")
    raise Refuse("masked_fill: the registry has no operator for it")


@maps("aten.div.Tensor_mode")
def div_mode(view):
    raise Refuse(f"division with rounding_mode={view.a['rounding_mode']!r} has no gradient")


# ---------------------------------------------------------------- pooling, resizing


def _window_pool(view, op: str):
    """A max or average pool's statement: 1-D sizes as ints, 2-D as pairs; an empty
    stride means the kernel size, as torch's functional form says."""
    a = view.a
    one_d = "pool1d" in view.target
    size = single if one_d else pair
    stride = a["stride"] if list(a["stride"]) else a["kernel_size"]
    return view.stmt(
        f"{op}1d" if one_d else f"{op}2d",
        [view.value("self")],
        kernel_size=size(a["kernel_size"]),
        stride=size(stride),
        padding=size(a["padding"]),
        ceil_mode=bool(a["ceil_mode"]),
    )


@maps("aten.max_pool2d.default", "aten.max_pool1d.default")
def max_pool(view):
    size = single if "pool1d" in view.target else pair
    if size(view.a["dilation"]) != 1:
        raise Refuse("max pooling with dilation")
    return _window_pool(view, "maxpool")


@maps("aten.avg_pool2d.default", "aten.avg_pool1d.default")
def avg_pool(view):
    if not view.a["count_include_pad"] or view.a.get("divisor_override") is not None:
        raise Refuse("average pooling with count_include_pad=False or divisor_override")
    return _window_pool(view, "avgpool")


@maps("aten.adaptive_avg_pool2d.default", "aten.adaptive_avg_pool1d.default")
def adaptive_avg_pool(view):
    one_d = "pool1d" in view.target
    size = (single if one_d else pair)(view.a["output_size"])
    op = "adaptive_avgpool1d" if one_d else "adaptive_avgpool2d"
    return view.stmt(op, [view.value("self")], output_size=size)


def _scale(view, mode: str) -> float | int:
    a = view.a
    factors = a.get("scale_factors")
    size_in = view.in_shape("input")[2:]
    if factors:
        if len(set(float(f) for f in factors)) != 1:
            raise Refuse(f"{mode} upsampling with different factors per dim {list(factors)}")
        factor = float(factors[0])
    else:
        size_out = [int(s) for s in a["output_size"]]
        ratios = {o / i for o, i in zip(size_out, size_in)}
        if len(ratios) != 1 or any(o % i for o, i in zip(size_out, size_in)):
            raise Refuse(f"{mode} resizing to {size_out} is not a whole scale factor")
        factor = ratios.pop()
    return int(factor) if factor.is_integer() else factor


@maps("aten.upsample_nearest2d.vec")
def upsample_nearest(view):
    return view.stmt(
        "upsample", [view.value("input")], scale_factor=_scale(view, "nearest"), mode="nearest"
    )


@maps("aten.upsample_bilinear2d.vec")
def upsample_bilinear(view):
    factor = _scale(view, "bilinear")
    if not view.a.get("scale_factors") and not view.a["align_corners"] and factor != int(factor):
        raise Refuse("bilinear resizing by size to a fractional scale")
    return view.stmt(
        "upsample",
        [view.value("input")],
        scale_factor=factor,
        mode="bilinear",
        align_corners=bool(view.a["align_corners"]),
    )


@maps("aten.pad.default")
def pad(view):
    if view.a["mode"] != "constant":
        raise Refuse(f"padding mode {view.a['mode']!r} (only constant padding is mapped)")
    value = view.a["value"]
    view.a["value"] = 0.0 if value is None else value
    return constant_pad(view)


@maps("aten.constant_pad_nd.default")
def constant_pad(view):
    pads = tuple(int(p) for p in view.a["pad"])
    if any(p < 0 for p in pads):
        raise Refuse(f"negative padding (cropping) {list(pads)}")
    if len(pads) // 2 >= len(view.in_shape("self")):
        raise Refuse("padding the batch dim")
    if not any(pads):
        return view.alias("self")
    value = float(view.a["value"])
    if not math.isfinite(value):
        raise Refuse(f"padding with {value} (the language has finite constants only)")
    return view.stmt("pad", [view.value("self")], pad=pads, value=value)


# ---------------------------------------------------------------- shapes


class Empty(str):
    """The value of a slice with nothing in it (Phi-3's pass-through part of a full-width
    rotary, ``x[..., D:]``): no statement; ``cat`` leaves it out, as torch's cat does, and
    any other reader is refused (``torch_frontend.value_of``)."""


@maps("aten.cat.default")
def cat(view):
    tensors = [t for t in view.a["tensors"] if not isinstance(view.m.values.get(t), Empty)]
    if len(tensors) == 1:  # DenseNet's first layer: the concat of one tensor is a copy
        return view.value_of(tensors[0])
    rank = len(view.shape_of(tensors[0]))
    dim = _dim(view, int(view.a["dim"]), rank, "concatenating along dim")
    return view.stmt("concat", [view.value_of(t) for t in tensors], dim=dim)


@maps("aten.flatten.using_ints")
def flatten(view):
    a = view.a
    if tuple(view.in_shape("input")) == tuple(view.out_shape()):  # a merge imported unmerged
        return view.alias("input")
    if view.node in view.m.merged.refused:  # batch_merge says why
        raise Refuse(view.m.merged.refused[view.node])
    rank = len(view.in_shape("input"))
    start = _dim(view, int(a["start_dim"]), rank, "flattening from dim")
    end = int(a["end_dim"]) % rank
    if end != rank - 1:
        return reshape(view)
    return view.stmt("flatten", [view.value("input")], start_dim=start)


@maps(
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.unflatten.int",
)
def reshape(view):
    source = view.in_shape(0)
    out = view.out_shape()
    if not out or out[0] != BATCH or not source or source[0] != BATCH:
        said = f"reshaping {shape_text(source)} to {shape_text(out)} moves or merges the batch dim"
        # batch_merge says why the rows it merges are refused
        raise Refuse(view.m.merged.refused.get(view.node, said))
    if tuple(source) == tuple(out):
        return view.alias(0)
    if len(out) == 1:  # [N, 1, ...] -> [N]: reshape keeps a dim after N, select drops one
        if any(d != 1 for d in source[1:]):
            raise Refuse(f"reshaping {shape_text(source)} to [N] merges the batch dim")
        value = view.value(0)
        for _ in source[1:]:
            value = view.stmt("select", [value], dim=1, index=0)
        return value
    return view.stmt("reshape", [view.value(0)], shape=tuple(out[1:]))


@maps("aten.transpose.int")
def transpose(view):
    rank = len(view.in_shape("self"))
    d0 = _dim(view, int(view.a["dim0"]), rank, "transposing dim")
    d1 = _dim(view, int(view.a["dim1"]), rank, "transposing dim")
    if d0 == d1:
        return view.alias("self")
    return view.stmt("transpose", [view.value("self")], dim0=d0, dim1=d1)


@maps("aten.t.default")
def t(view):
    raise Refuse("2-D transpose of a batch (swaps the batch dim)")


@maps("aten.permute.default")
def permute(view):
    dims = tuple(int(d) % len(view.in_shape("self")) for d in view.a["dims"])
    if dims[0] != 0:
        raise Refuse(f"permute {list(dims)} moves the batch dim")
    if dims == tuple(range(len(dims))):
        return view.alias("self")
    return view.stmt("permute", [view.value("self")], dims=dims)


@maps("aten.select.int")
def select(view):
    shape = view.in_shape("self")
    if shape and shape[0] != BATCH:  # an element of a free parameter (gammas[i]): no batch
        dim = int(view.a["dim"]) % len(shape)
    else:
        dim = _dim(view, int(view.a["dim"]), len(shape), "selecting along dim")
    return view.stmt("select", [view.value("self")], dim=dim, index=int(view.a["index"]))


@maps("aten.slice.Tensor")
def slice_(view):
    a = view.a
    shape = view.in_shape("self")
    dim = int(a["dim"]) % len(shape)
    start = 0 if a["start"] is None else int(a["start"])
    end = a["end"]
    step = int(a["step"])
    size = shape[dim]
    whole = (
        start == 0
        and step == 1
        and (
            end is None
            or (size != BATCH and int(end) >= size)
            or (size == BATCH and int(end) >= 2**62)
        )
    )
    if whole:
        return view.alias("self")
    if 0 in view.out_shape():
        return Empty("empty slice")
    if dim == 0:
        raise Refuse("slicing the batch dim")
    if end is not None and int(end) >= size:
        end = None
    return view.stmt(
        "slice",
        [view.value("self")],
        dim=dim,
        start=start,
        end=None if end is None else int(end),
        step=step,
    )


@maps("aten.expand.default")
def expand(view):
    size = view.sizes(view.a["size"])
    if size == tuple(view.in_shape("self")):
        return view.alias("self")
    if size[0] not in (BATCH, -1):
        raise Refuse(f"expanding to {shape_text(size)}: the first dim must be the batch")
    return view.stmt("expand", [view.value("self")], size=size)


@maps("aten.contiguous.default", "aten.clone.default", "aten.alias.default")
def identity(view):
    return view.alias("self")


@maps("aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default")
def to(view):
    source = view.a["self"]
    if source.meta["val"].dtype != view.node.meta["val"].dtype:
        raise Refuse(f"a cast to {view.node.meta['val'].dtype}")
    return view.alias("self")


@maps("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default")
def split(view):
    """A tuple of slices, taken apart by ``getitem`` (see ``torch_frontend``); ``chunk``
    is a split into pieces of ceil(size / chunks), as torch.chunk makes them."""
    shape = view.in_shape("self")
    dim = _dim(view, int(view.a["dim"]), len(shape), "splitting along dim")
    size = shape[dim]
    if "split_sizes" in view.a and view.a.get("split_sizes") is not None:
        sizes = [int(s) for s in view.a["split_sizes"]]
    else:
        if "chunks" in view.a:
            step = max(1, -(-size // int(view.a["chunks"])))
        else:
            step = int(view.a["split_size"])
        sizes = [min(step, size - start) for start in range(0, size, step)]
    parts, start = [], 0
    for length in sizes:
        parts.append((dim, start, start + length))
        start += length
    return Pieces(view.value("self"), tuple(parts), size)


class Pieces:
    """The value of a ``split``: its parts become ``slice`` statements when read."""

    def __init__(self, source: str, parts: tuple, size: int):
        self.source, self.parts, self.size = source, parts, size


@maps("aten.dropout.default", "aten.dropout_.default")
def dropout(view):
    p = float(view.a["p"])
    if not view.a["train"] or p == 0.0:
        return view.alias("input")
    return view.stmt("dropout", [view.value("input")], p=p)


@maps("aten.mean.dim", "aten.sum.dim_IntList")
def reduce(view):
    a = view.a
    if a.get("dtype") is not None:
        raise Refuse("a reduction with a dtype")
    op = "mean" if "mean" in view.target else "sum"
    return view.stmt(
        op, [view.value("self")], dim=_dims(view, a["dim"]), keepdim=bool(a["keepdim"])
    )


@maps("aten.softmax.int", "aten.log_softmax.int")
def softmax(view):
    a = view.a
    if a.get("dtype") is not None:
        raise Refuse("softmax with a dtype")
    op = "log_softmax" if "log_softmax" in view.target else "softmax"
    dim = _dim(view, int(a["dim"]), None, "softmax over dim")
    rank = len(view.in_shape("self"))
    return view.stmt(op, [view.value("self")], dim=dim - rank)


@maps("aten.matmul.default", "aten.bmm.default")
def matmul(view):
    a = view.a
    if (
        len(view.in_shape("self")) < 2
        or len(view.shape_of(a["mat2" if "mat2" in a else "other"])) < 2
    ):
        raise Refuse("matmul of a 1-D tensor")
    other = a["mat2"] if "mat2" in a else a["other"]
    return view.stmt("matmul", [view.value("self"), view.value_of(other)])


@maps("aten.baddbmm.default")
def baddbmm(view):
    """``beta * input + alpha * (batch1 @ batch2)``: the matmul, scaled by ``alpha``, plus
    the input, scaled by ``beta`` (the order of the sum aside, the same numbers). An input
    built from sizes alone has no statement of the language but one: BLOOM's ALiBi bias,
    matched value for value (``_alibi``), is one ``alibi`` statement on the scores."""
    a = view.a
    alpha, beta = float(a["alpha"]), float(a["beta"])
    bias = a["input"] if beta != 0.0 else None  # beta 0: torch ignores the input
    alibi = bias is not None and view.is_tensor(bias) and view.constant("input") is not None
    if alibi:
        _alibi(view, beta)
    elif bias is not None and not view.is_tensor(bias):
        raise Refuse(f"baddbmm of the constant {bias!r} and a product")
    if len(view.in_shape("batch1")) < 3 or len(view.in_shape("batch2")) < 3:
        raise Refuse("baddbmm of operands without a batch dim")
    operands = [view.value("batch1"), view.value("batch2")]
    added = None if bias is None or alibi else view.value("input")  # all read first
    scores = view.stmt("matmul", operands)
    if alpha != 1.0:
        scores = view.stmt("scale", [scores], factor=alpha)
    if bias is None:
        return scores
    if alibi:
        return view.stmt("alibi", [scores])
    if beta != 1.0:
        added = view.stmt("scale", [added], factor=beta, value_shape=view.in_shape("input"))
    return view.stmt("add", [scores, added])


def _alibi(view, beta: float) -> None:
    """Refuses a constant input of ``baddbmm`` that is not ALiBi's bias of the scores: on
    the shape the import gives them ([N, H, L, S]: the batch merged with the heads,
    unmerged), the constant (evaluated at the capture batch size, [N*H, 1 or L, S]) must be
    ``alibi_bias(H, S)`` in each sample, to the bit, and added once (beta 1)."""
    from unroller.runtime.positions import alibi_bias

    out = view.out_shape()
    value = view.constant("input")
    if beta != 1.0:
        raise Refuse(f"baddbmm of a constant input scaled by beta={beta}")
    if len(out) != 4 or out[0] != BATCH or not all(isinstance(d, int) for d in out[1:]):
        raise Refuse(
            "baddbmm of a constant input that is not ALiBi's bias of scores [N, H, L, S]: the "
            "language holds no other constant tensor"
        )
    heads, length, keys = out[1:]
    if value.dim() != 3 or value.shape[0] % heads or value.shape[1] not in (1, length):
        raise Refuse(f"baddbmm of a constant input {list(value.shape)}, not ALiBi's bias")
    if value.shape[2] != keys or not value.is_floating_point():
        raise Refuse(f"baddbmm of a constant input {list(value.shape)}, not ALiBi's bias")
    samples = value.reshape(-1, heads, *value.shape[1:])
    expected = alibi_bias(heads, keys, value.dtype).expand_as(samples)
    if not torch.equal(samples, expected):
        raise Refuse(
            "baddbmm of a constant input that is not ALiBi's bias (BLOOM's slopes times the "
            "key position, in float32): the language holds no other constant tensor"
        )


@maps("aten.scaled_dot_product_attention.default")
def sdpa(view):
    a = view.a
    causal = bool(a["is_causal"])
    bias = None
    if a["attn_mask"] is not None:
        causal, bias = view.attention_bias(a["attn_mask"], causal)
    scale = a.get("scale")
    gqa = {"enable_gqa": True} if a.get("enable_gqa") else {}  # grouped-query attention
    repeated = getattr(view.m, "repeated_kv", {}).get(view.node)  # repeat_kv undone
    if repeated is not None:
        key, value = (view.value_of(n) for n in repeated)
        gqa["enable_gqa"] = True
    else:
        key, value = view.value("key"), view.value("value")
    q_shape, k_shape = view.in_shape("query"), view.in_shape("key")
    if len(q_shape) == len(k_shape) == 4 and k_shape[1] == 1 and q_shape[1] != 1:
        # multi-query attention written as a broadcast of one key/value head (Falcon):
        # grouped-query attention with every query head in the one group, the same sums
        gqa["enable_gqa"] = True
    if float(a["dropout_p"]) != 0.0:
        gqa["dropout"] = float(a["dropout_p"])
    return view.stmt(
        "scaled_dot_product_attention",
        [view.value("query"), key, value] + ([bias] if bias is not None else []),
        is_causal=causal,
        scale=None if scale is None else float(scale),
        **gqa,
    )


# ---------------------------------------------------------------- recurrent layers


class Recurrent:
    """The value of ``aten.lstm`` / ``aten.gru``: (output, h_n[, c_n]), taken apart by
    ``getitem`` (see ``torch_frontend``). The language's ``lstm`` / ``gru`` give the output
    sequence only: h_n becomes a ``FinalState`` whose last layer's entries are read from
    it; c_n, which no output holds, is refused."""

    def __init__(
        self, output: str, op: str, hidden: int, layers: int, directions: int, length: int
    ):
        self.output, self.op, self.hidden = output, op, hidden
        self.layers, self.directions, self.length = layers, directions, length

    def part(self, index: int):
        if index == 0:
            return self.output
        if index == 1:
            return FinalState(self)
        raise Refuse(
            f"reads the final cell state c_n of nn.{self.op.upper()}: the language's "
            f"{self.op} gives the output sequence only, and c_n is in none of it; the last "
            "layer's h_n imports (h_n[-1], read from the output)"
        )


class FinalState:
    """h_n of an nn.LSTM / nn.GRU, ``[layers * directions, N, H]`` (the batch second, which
    the language cannot hold): an entry of the last layer is read from the output, the
    forward direction's as its last step, the reverse one's as its first step's second
    half; other reads (a lower layer's entry, h_n whole) are refused with the way out."""

    def __init__(self, recurrent: Recurrent) -> None:
        self.r = recurrent

    def read(self, view) -> str:
        r = self.r
        a = view.a
        count = r.layers * r.directions
        if view.target == "aten.select.int" and int(a["dim"]) == 0:
            index = int(a["index"]) % count
        elif view.target in ("aten.squeeze.dim", "aten.squeeze.dims") and count == 1:
            index = 0
        else:
            raise Refuse(
                f"reads h_n of nn.{r.op.upper()} ([layers * directions, N, H], the batch "
                "second) as a whole: the language keeps the batch first; read one entry, "
                "h_n[-1] (the last layer's final state), which imports"
            )
        layer, direction = divmod(index, r.directions)
        if layer != r.layers - 1:
            raise Refuse(
                f"reads h_n[{index}] of nn.{r.op.upper()}, the final state of layer {layer} "
                f"of {r.layers}: the language's {r.op} gives the last layer's outputs only; "
                "make that layer a module of its own and read its h_n[-1] (or its output)"
            )
        whole = (BATCH, r.directions * r.hidden)
        step = view.m.add_stmt(
            view.node,
            "select",
            [r.output],
            None,
            {"dim": 1, "index": r.length - 1 if direction == 0 else 0},
            whole,
        )
        if r.directions == 1:
            return step
        half = {"start": 0, "end": r.hidden} if direction == 0 else {"start": r.hidden}
        return view.stmt("slice", [step], dim=1, **half)


@maps("aten.lstm.input", "aten.gru.input")
def recurrent(view):
    """nn.LSTM / nn.GRU as one ``lstm`` / ``gru`` statement: batch first, initial states
    left out (nn.LSTM's zeros), no dropout between layers in training, no proj_size."""
    a = view.a
    op = "lstm" if "lstm" in view.target else "gru"
    name = f"nn.{op.upper()}"
    if not a["batch_first"]:
        raise Refuse(
            f"{name} with batch_first=False reads [L, N, E], and the language keeps the batch "
            "first: build it with batch_first=True (the same weights) and feed [N, L, E]"
        )
    layers = int(a["num_layers"])
    if float(a["dropout"]) > 0.0 and a["train"] and layers > 1:
        raise Refuse(
            f"{name} with dropout={a['dropout']} between its layers in training: the "
            f"language's {op} has none; use dropout=0, or one {name} per layer with "
            "nn.Dropout between them"
        )
    if layers > 4:
        raise Refuse(
            f"{name} with num_layers={layers}: a statement holds at most 4 layers; stack "
            "modules of at most 4 layers each"
        )
    states = a["hx"] if isinstance(a["hx"], (list, tuple)) else [a["hx"]]
    for index, state in enumerate(states):
        a[f"_state{index}"] = state
        value = view.constant(f"_state{index}")
        if value is None or bool(value.any()):
            raise Refuse(
                f"initial states passed to {name}: only its default (zeros, hx=None) "
                f"imports; the language's {op} takes h0 batch first ([N, S, H]): write it there"
            )
    keys = []
    for node in a["params"]:
        a_key = view.m.params.get(node.name, "") if hasattr(node, "name") else ""
        leaf = a_key.rpartition(".")[2]
        if leaf.startswith("weight_hr"):
            raise Refuse(f"{name} with proj_size > 0: the language's {op} has no projection")
        a[leaf] = node
        keys.append(leaf)
    hidden = int(view.param_shape("weight_hh_l0")[1])
    out = view.stmt(
        op,
        [view.value("input")],
        layer=view.layer(*keys),
        hidden_size=hidden,
        num_layers=layers,
        bias=bool(a["has_biases"]),
        bidirectional=bool(a["bidirectional"]),
    )
    directions = 2 if a["bidirectional"] else 1
    length = int(view.in_shape("input")[1])
    return Recurrent(out, op, hidden, layers, directions, length)


@maps("aten.lstm.data", "aten.gru.data")
def recurrent_packed(view):
    raise Refuse(
        "a packed sequence (pack_padded_sequence) through nn.LSTM / nn.GRU: pass the padded "
        "[N, L, E] tensor instead (batch_first=True)"
    )
