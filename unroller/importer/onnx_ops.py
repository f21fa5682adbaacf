"""ONNX operator -> registry operator: one small function per ONNX op type, side by side.

A mapper receives a ``NodeView`` (``onnx_frontend``): the node's attributes, which inputs
are data (computed from the network's inputs) and which are constants (evaluated), the
initializer behind each weight input, and shapes with ``N`` for the batch. It returns a
statement (``view.stmt``), an identity (``view.alias``), or refuses with the exact reason
(``Refuse``): only attribute combinations whose value and gradient the registry operator
computes exactly as torch does are mapped. Adding an ONNX op is one decorated function here.

ONNX stores float attributes as float32: ``eps=1e-5`` arrives as 9.99999974e-06. They are
read back as the shortest decimal that float32 value prints as (``decimal32``), which is
what the exporting code wrote; BatchNormalization's ``momentum`` is the running-average
weight of the old value, so torch's momentum is ``1 - momentum`` (computed in decimal).
"""

from __future__ import annotations

from decimal import Decimal

import numpy as np

from unroller.importer.aten_ops import Refuse, pair, single
from unroller.importer.model import BATCH
from unroller.importer.registry import op_table

#: ONNX op type -> mapper.
MAPPERS, maps = op_table()


def decimal32(value) -> float:
    """A float32 number as the shortest decimal it prints as (9.99999974e-06 -> 1e-05);
    other numpy numbers unchanged. Attributes arrive as Python floats holding float32s."""
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value).reshape(())
        if array.dtype != np.float32:
            return float(array)
        value = array[()]
    return float(str(np.float32(value)))


def _scalar(view, i: int, what: str) -> float:
    """A constant scalar input (float32 read as ``decimal32``)."""
    value = np.asarray(view.const(i, what))
    if value.size != 1:
        raise Refuse(f"its {what} is not a scalar ({list(value.shape)})")
    return decimal32(value)


def _axis(axis: int, rank: int, what: str) -> int:
    axis = int(axis) + rank if int(axis) < 0 else int(axis)
    if not 0 <= axis < rank:
        raise Refuse(f"{what} {axis} of a {rank}-D tensor")
    if axis == 0:
        raise Refuse(f"{what} 0 is the batch dim: the batch must stay first and whole")
    return axis


def _ints(view, name: str, count: int, default: int) -> tuple[int, ...]:
    values = view.attr(name)
    if values is None:
        return (default,) * count
    values = tuple(int(v) for v in values)
    if len(values) != count:
        raise Refuse(f"{name} {list(values)} for {count} spatial dims")
    return values


def _pads(view, count: int) -> tuple[int, ...]:
    """Symmetric padding per spatial dim, from ``auto_pad`` and ``pads``."""
    auto = view.attr("auto_pad", "NOTSET")
    if auto == "VALID":
        return (0,) * count
    if auto != "NOTSET":
        raise Refuse(f"auto_pad={auto!r}: give the padding as numbers")
    pads = _ints(view, "pads", 2 * count, 0)
    begin, end = pads[:count], pads[count:]
    if begin != end:
        raise Refuse(f"asymmetric padding {list(pads)} (begin {list(begin)}, end {list(end)})")
    if any(p < 0 for p in begin):
        raise Refuse(f"negative padding {list(pads)}")
    return begin


def _bias(view, i: int, leaf: str = "bias") -> bool:
    """Whether a layer has a bias: an initializer (True; ``view.layer`` checks that its name
    is a module's bias), none or a computed zero (False: the dynamo exporter's bias of a
    bias-free conv)."""
    if not view.has(i):
        return False
    if view.is_initializer(i):
        return True
    if view.is_data(i):
        raise Refuse(f"its {leaf} is computed from the input, not an initializer")
    if np.any(view.const(i, leaf)):
        raise Refuse(f"its {leaf} is a computed constant, not an initializer")
    return False


def _size(values: tuple[int, ...], one_d: bool):
    return single(values) if one_d else pair(values)


# ---------------------------------------------------------------- layers with parameters


@maps("Conv")
def conv(view):
    weight = view.param_shape(1, "weight")
    spatial = len(weight) - 2
    if spatial not in (1, 2):
        raise Refuse(f"a {spatial}-D convolution")
    x = view.in_shape(0)
    if len(x) != spatial + 2:
        raise Refuse(f"a {spatial}-D convolution of a {len(x)}-D input")
    kernel = tuple(weight[2:])
    if view.attr("kernel_shape") is not None and tuple(view.attr("kernel_shape")) != kernel:
        raise Refuse(f"kernel_shape {view.attr('kernel_shape')} but the weight is {list(weight)}")
    groups = int(view.attr("group", 1))
    if x[1] != weight[1] * groups:
        raise Refuse(f"{x[1]} input channels for a weight {list(weight)} in {groups} groups")
    bias = _bias(view, 2)
    layer = view.layer(weight=1, bias=2) if bias else view.layer(weight=1)
    one_d = spatial == 1
    return view.stmt(
        "conv1d" if one_d else "conv2d",
        [view.value(0)],
        layer=layer,
        out_channels=weight[0],
        kernel_size=_size(kernel, one_d),
        stride=_size(_ints(view, "strides", spatial, 1), one_d),
        padding=_size(_pads(view, spatial), one_d),
        dilation=_size(_ints(view, "dilations", spatial, 1), one_d),
        groups=groups,
        bias=bias,
    )


@maps("ConvTranspose")
def conv_transpose(view):
    weight = view.param_shape(1, "weight")
    if len(weight) != 4:
        raise Refuse(f"a {len(weight) - 2}-D transposed convolution (conv_transpose2d is 2-D)")
    x = view.in_shape(0)
    groups = int(view.attr("group", 1))
    if len(x) != 4 or x[1] != weight[0]:
        raise Refuse(f"a transposed convolution of {list(x)} by a weight {list(weight)}")
    if view.attr("output_shape") is not None:
        raise Refuse("output_shape given instead of padding")
    kernel, pads = tuple(weight[2:]), _pads(view, 2)
    strides, dilations = _ints(view, "strides", 2, 1), _ints(view, "dilations", 2, 1)
    extra = _ints(view, "output_padding", 2, 0)
    want = tuple(
        (n - 1) * s - 2 * p + d * (k - 1) + e + 1
        for n, s, p, d, k, e in zip(x[2:], strides, pads, dilations, kernel, extra)
    )
    if want != tuple(view.out_shape()[2:]):
        raise Refuse(f"ONNX computes {list(view.out_shape())}, torch's conv_transpose2d {want}")
    bias = _bias(view, 2)
    return view.stmt(
        "conv_transpose2d",
        [view.value(0)],
        layer=view.layer(weight=1, bias=2) if bias else view.layer(weight=1),
        out_channels=weight[1] * groups,
        kernel_size=pair(kernel),
        stride=pair(strides),
        padding=pair(pads),
        output_padding=pair(extra),
        dilation=pair(dilations),
        groups=groups,
        bias=bias,
    )


def _affine(view) -> bool:
    """BatchNorm scale and bias: initializers (affine) or the computed constants 1 and 0."""
    if view.is_initializer(1) or view.is_initializer(2):
        return True  # view.layer checks both are named X.weight and X.bias
    if view.is_data(1) or view.is_data(2):
        raise Refuse("its scale or bias is computed from the input")
    if np.all(view.const(1, "scale") == 1) and not np.any(view.const(2, "bias")):
        return False
    raise Refuse("its scale and bias are computed constants other than 1 and 0")


@maps("BatchNormalization")
def batch_norm(view):
    x = view.in_shape(0)
    if len(x) not in (2, 3, 4):
        raise Refuse(f"batch norm of a {len(x)}-D input")
    if int(view.attr("spatial", 1)) != 1:
        raise Refuse("spatial=0 (per-position statistics)")
    for i, leaf in ((3, "running_mean"), (4, "running_var")):
        if not view.is_initializer(i):
            raise Refuse(f"its {leaf} is not an initializer (no running statistics to keep)")
    affine = _affine(view)
    roles = {"running_mean": 3, "running_var": 4}
    if affine:
        roles = {"weight": 1, "bias": 2, **roles}
    layer = view.layer(**roles)
    if view.param_shape(3, "running_mean") != (x[1],):
        raise Refuse(f"running statistics of shape {list(view.param_shape(3, 'running_mean'))}")
    view.buffer(f"{layer}.num_batches_tracked", ())
    momentum = float(Decimal(1) - Decimal(str(decimal32(view.attr("momentum", 0.9)))))
    return view.stmt(
        "batchnorm2d" if len(x) == 4 else "batchnorm1d",
        [view.value(0)],
        layer=layer,
        eps=decimal32(view.attr("epsilon", 1e-5)),
        momentum=momentum,
        affine=affine,
        track_running_stats=True,
    )


@maps("LayerNormalization")
def layer_norm(view):
    """torch's ``layer_norm`` as the exporters write it: statistics over the dims from
    ``axis`` on, in float32 (``stash_type`` 1, what torch computes for float32 and half
    inputs); the scale and bias are the module's weight and bias initializers, or the
    constants 1 and 0 (or none) of a LayerNorm without them."""
    x = view.in_shape(0)
    axis = _axis(int(view.attr("axis", -1)), len(x), "normalizing from dim")
    normalized = tuple(int(d) for d in x[axis:])
    if int(view.attr("stash_type", 1)) != 1:
        raise Refuse(f"stash_type={view.attr('stash_type')}: statistics not in float32")
    affine = view.is_initializer(1)
    if not affine:
        if view.is_data(1):
            raise Refuse("its scale is computed from the input, not an initializer")
        if not np.all(view.const(1, "scale") == 1):
            raise Refuse("its scale is a computed constant other than 1, not an initializer")
    bias = _bias(view, 2)
    if bias and not affine:
        raise Refuse("a bias without a weight (torch.nn.LayerNorm has both or neither)")
    if affine:
        roles = {"weight": 1, "bias": 2} if bias else {"weight": 1}
        for i, leaf in ((1, "weight"), (2, "bias")):
            if leaf in roles and view.param_shape(i, leaf) != normalized:
                shape = list(view.param_shape(i, leaf))
                raise Refuse(f"a {leaf} of shape {shape} normalizing {list(normalized)}")
        layer = view.layer(**roles)
    else:
        layer = None
    return view.stmt(
        "layernorm",
        [view.value(0)],
        layer=layer,
        normalized_shape=normalized[0] if len(normalized) == 1 else normalized,
        eps=decimal32(view.attr("epsilon", 1e-5)),
        elementwise_affine=affine,
        bias=bias or not affine,
    )


@maps("Gemm")
def gemm(view):
    if int(view.attr("transA", 0)):
        raise Refuse("transA=1 transposes the batch")
    if decimal32(view.attr("alpha", 1.0)) != 1.0 or (
        view.has(2) and decimal32(view.attr("beta", 1.0)) != 1.0
    ):
        raise Refuse(f"alpha={view.attr('alpha', 1.0)}, beta={view.attr('beta', 1.0)}")
    # transB=0 stores the weight [in, out] (a Keras Dense, torch.addmm of a raw matrix):
    # ``transposed_linear`` (x @ weight + bias) holds it as stored, so the state dict keeps
    # the file's values and shape, and nothing is transposed to fit torch.nn.Linear
    stored = not int(view.attr("transB", 0))
    weight = view.param_shape(1, "weight")
    out_features, in_features = (weight[1], weight[0]) if stored else weight
    x = view.in_shape(0)
    if len(weight) != 2 or len(x) != 2 or x[1] != in_features:
        raise Refuse(f"a linear map of {list(x)} by a weight {list(weight)}")
    bias = _bias(view, 2)
    if bias and view.param_shape(2, "bias") != (out_features,):
        raise Refuse(f"a bias of shape {list(view.param_shape(2, 'bias'))}")
    layer = view.layer(weight=1, bias=2) if bias else view.layer(weight=1)
    op = "transposed_linear" if stored else "linear"
    return view.stmt(op, [view.value(0)], layer=layer, out_features=out_features, bias=bias)


def _bias_add(view, out_features: int):
    """The ``Add`` of a module's bias that alone reads this MatMul's output, if any."""
    users = view.users(0)
    if len(users) != 1 or users[0].op != "Add":
        return None, None
    add = users[0]
    k = 1 if add.input_name(0) == view.node.output[0] else 0
    if not add.is_weight(k, "bias"):
        return None, None
    if add.initializer_shape(add.input_name(k)) != (out_features,):
        return None, None
    return add, add.input_name(k)


@maps("MatMul")
def matmul(view):
    if view.is_data(0) and view.is_data(1):
        a, b = view.in_shape(0), view.in_shape(1)
        if len(a) < 2 or len(b) < 2:
            raise Refuse("matmul of a 1-D tensor")
        return view.stmt("matmul", [view.value(0), view.value(1)])
    if not view.is_data(0):
        raise Refuse("a constant times the data (the weight on the left)")
    source = view.transposed_weight(1)
    if source is None:
        raise Refuse(
            "MatMul by a constant that is not Transpose(W) of a module's weight W "
            f"({view.input_name(1)}): its values are not a torch.nn.Linear weight"
        )
    weight = view.initializer_shape(source)
    x = view.in_shape(0)
    if x[-1] != weight[1]:
        raise Refuse(f"a linear map of {list(x)} by a weight {list(weight)}")
    add, bias = _bias_add(view, weight[0])
    roles = {"weight": source, "bias": bias} if add is not None else {"weight": source}
    layer = view.layer(**roles)
    name = view.stmt(
        "linear", [view.value(0)], layer=layer, out_features=weight[0], bias=add is not None
    )
    if add is not None:
        view.absorb(add, name)
    return name


# ---------------------------------------------------------------- elementwise


def _unary(op: str):
    def mapper(view):
        return view.stmt(op, [view.value(0)])

    return mapper


for _onnx_op, _op in {
    "Relu": "relu",
    "Sigmoid": "sigmoid",
    "Tanh": "tanh",
    "HardSwish": "hardswish",
    "Mish": "mish",
}.items():
    MAPPERS[_onnx_op] = _unary(_op)


@maps("LeakyRelu")
def leaky_relu(view):
    slope = decimal32(view.attr("alpha", 0.01))
    return view.stmt("leaky_relu", [view.value(0)], negative_slope=slope)


@maps("Elu")
def elu(view):
    return view.stmt("elu", [view.value(0)], alpha=decimal32(view.attr("alpha", 1.0)))


@maps("HardSigmoid")
def hard_sigmoid(view):
    alpha, beta = np.float32(view.attr("alpha", 0.2)), np.float32(view.attr("beta", 0.5))
    if alpha != np.float32(1 / 6) or beta != np.float32(0.5):
        raise Refuse(f"alpha={alpha}, beta={beta}: torch's hardsigmoid is alpha=1/6, beta=0.5")
    return view.stmt("hardsigmoid", [view.value(0)])


@maps("Gelu")
def gelu(view):
    approximate = view.attr("approximate", "none")
    return view.stmt("gelu", [view.value(0)], approximate=approximate)


def _clip_bounds(view) -> tuple[float | None, float | None]:
    if view.opset < 11:
        low, high = view.attr("min"), view.attr("max")
        low = None if low is None or low <= -3.4e38 else decimal32(low)
        high = None if high is None or high >= 3.4e38 else decimal32(high)
        return low, high
    low = _scalar(view, 1, "min") if view.has(1) else None
    high = _scalar(view, 2, "max") if view.has(2) else None
    return low, high


@maps("Clip")
def clip(view):
    low, high = _clip_bounds(view)
    if (low, high) == (0.0, 6.0):
        return view.stmt("relu6", [view.value(0)])
    if low == 0.0 and high is None:
        return view.stmt("relu", [view.value(0)])
    if low is None or high is None:
        raise Refuse(f"clipping to [{low}, {high}]: only both bounds (hardtanh) or min 0 (relu)")
    return view.stmt("hardtanh", [view.value(0)], min_val=low, max_val=high)


def _with_constant(view, op: str, k: int) -> str:
    """``op`` of data input ``k`` and a constant: a scalar factor, or an exact no-op."""
    x = view.value(k)  # a failed input: reported at its root, not here
    if op == "add" or (op == "sub" and k == 0):
        # a zero tensor built from sizes (an attention mask that masks nothing, at any
        # batch size) that does not broadcast the data: x + 0 is x, value and gradient
        zero = not any(np.any(a) for a in view.const_pair(1 - k))
        if zero and tuple(view.out_shape()) == tuple(view.in_shape(k)):
            return x
    value = np.asarray(view.const(1 - k, "operand"))
    name = view.input_name(1 - k)
    if value.size != 1 or value.ndim > len(view.in_shape(k)):
        raise Refuse(
            f"{op} with the constant tensor {name} {list(value.shape)}: no registry operator "
            "takes a constant operand (an initializer that is not a module's parameter?)"
        )
    number = _scalar(view, 1 - k, "operand")
    if op in ("add", "sub") and number == 0.0 and (op == "add" or k == 0):
        return x
    if op == "mul":
        return x if number == 1.0 else view.stmt("scale", [x], factor=number)
    if op == "div" and k == 0 and number != 0.0:
        return x if number == 1.0 else view.stmt("scale", [x], factor=1.0 / number)
    side = f"{name} {op} x" if k == 1 else f"x {op} {name}"
    raise Refuse(f"{side} with the constant {number}: no registry operator computes it")


def _with_parameter(view, op: str, flat: list) -> str:
    """``op`` of a batched value and a parameter without the batch dim (a position table
    [1, L, E], rows [L, E]): torch's broadcasting, which must leave the batched operand's
    shape as it is (the parameter stretches, never the data)."""
    args = [view.value(0), view.value(1)]
    if flat[0] is not None and flat[1] is not None:
        raise Refuse(f"{op} of two parameters: no batch dim")
    k = 0 if flat[0] is None else 1
    x, p = view.in_shape(k), flat[1 - k]
    fits = len(p) < len(x) or (len(p) == len(x) and p[0] == 1)
    fits = fits and all(d in (1, e) for d, e in zip(p[::-1], x[::-1]))
    if not fits or tuple(view.out_shape()) != tuple(x):
        shown = "[" + ", ".join("N" if d is BATCH else str(d) for d in x) + "]"
        raise Refuse(f"{op} of {shown} and the parameter {list(p)} does not keep {shown}")
    return view.stmt(op, args)


def _binary(op: str):
    def mapper(view):
        data = [view.is_data(0), view.is_data(1)]
        if all(data):
            flat = [view.unbatched(0), view.unbatched(1)]
            if flat != [None, None]:
                return _with_parameter(view, op, flat)
            args = [view.value(0), view.value(1)]  # a failed input: reported at its root
            a, b = view.in_shape(0), view.in_shape(1)
            if len(a) != len(b):
                raise Refuse(
                    f"{op} of {list(a)} and {list(b)}: broadcasting tensors of different "
                    "ranks would not line up their batch dims"
                )
            return view.stmt(op, args)
        if not any(data):
            raise Refuse(f"{op} of two constants")
        return _with_constant(view, op, 0 if data[0] else 1)

    return mapper


for _onnx_op, _op in {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}.items():
    MAPPERS[_onnx_op] = _binary(_op)


# ---------------------------------------------------------------- pooling, resizing


def _torch_pool_size(size: int, kernel: int, stride: int, pad: int, ceil: bool) -> int:
    """The output length torch's pooling computes (dilation 1)."""
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _pool_args(view):
    x = view.in_shape(0)
    spatial = len(x) - 2
    if spatial not in (1, 2):
        raise Refuse(f"pooling a {len(x)}-D tensor")
    kernel = _ints(view, "kernel_shape", spatial, 1)
    strides = _ints(view, "strides", spatial, 1)
    pads = _pads(view, spatial)
    if any(p > k // 2 for p, k in zip(pads, kernel)):
        raise Refuse(f"padding {list(pads)} more than half the kernel {list(kernel)}")
    if any(d != 1 for d in _ints(view, "dilations", spatial, 1)):
        raise Refuse("pooling with dilation")
    ceil = bool(int(view.attr("ceil_mode", 0)))
    want = tuple(
        _torch_pool_size(n, k, s, p, ceil) for n, k, s, p in zip(x[2:], kernel, strides, pads)
    )
    got = tuple(view.out_shape()[2:])
    if got != want:
        raise Refuse(f"ONNX pools to {list(got)}, torch's pooling to {list(want)}")
    return spatial == 1, kernel, strides, pads, ceil


def _pool_stmt(view, op: str, one_d: bool, kernel, strides, pads, ceil: bool):
    return view.stmt(
        f"{op}1d" if one_d else f"{op}2d",
        [view.value(0)],
        kernel_size=_size(kernel, one_d),
        stride=_size(strides, one_d),
        padding=_size(pads, one_d),
        ceil_mode=ceil,
    )


@maps("MaxPool")
def max_pool(view):
    return _pool_stmt(view, "maxpool", *_pool_args(view))


@maps("AveragePool")
def avg_pool(view):
    one_d, kernel, strides, pads, ceil = _pool_args(view)
    if any(pads) and not int(view.attr("count_include_pad", 0)):
        raise Refuse("average pooling that leaves the padding out of the count")
    if ceil:
        x = view.in_shape(0)
        floor = tuple(
            _torch_pool_size(n, k, s, p, False) for n, k, s, p in zip(x[2:], kernel, strides, pads)
        )
        if floor != tuple(view.out_shape()[2:]):
            raise Refuse("average pooling whose ceil_mode windows run past the border")
        ceil = False
    return _pool_stmt(view, "avgpool", one_d, kernel, strides, pads, ceil)


@maps("GlobalAveragePool")
def global_avg_pool(view):
    rank = len(view.in_shape(0))
    if rank not in (3, 4):
        raise Refuse(f"global pooling of a {rank}-D tensor")
    op = "adaptive_avgpool2d" if rank == 4 else "adaptive_avgpool1d"
    return view.stmt(op, [view.value(0)], output_size=1)


def _reduce_axes(view, since: int) -> list[int] | None:
    if view.opset >= since:
        if not view.has(1):
            return None
        return [int(a) for a in np.asarray(view.const(1, "axes")).reshape(-1)]
    axes = view.attr("axes")
    return None if axes is None else [int(a) for a in axes]


def _reduce(op: str, since: int):
    def mapper(view):
        x = view.in_shape(0)
        axes = _reduce_axes(view, since)
        if not axes:
            if int(view.attr("noop_with_empty_axes", 0)):
                return view.alias(0)
            raise Refuse("a reduction over every dim includes the batch")
        dims = sorted({_axis(a, len(x), "reducing dim") for a in axes})
        keep = bool(int(view.attr("keepdims", 1)))
        if op == "mean" and keep and dims == list(range(2, len(x))) and len(x) in (3, 4):
            pool = "adaptive_avgpool2d" if len(x) == 4 else "adaptive_avgpool1d"
            return view.stmt(pool, [view.value(0)], output_size=1)
        dim = dims[0] if len(dims) == 1 else tuple(dims)
        return view.stmt(op, [view.value(0)], dim=dim, keepdim=keep)

    return mapper


MAPPERS["ReduceMean"] = _reduce("mean", 18)
MAPPERS["ReduceSum"] = _reduce("sum", 13)


def _resize_factors(view, x: tuple, out: tuple) -> tuple[float, float]:
    """The spatial scale factors, exact: from ``scales`` or from ``sizes`` / input sizes."""
    scales = np.asarray(view.const(2, "scales")).reshape(-1) if view.has(2) else np.array([])
    if scales.size:
        if scales.size != len(x) or scales[0] != 1 or scales[1] != 1:
            raise Refuse(f"scales {scales.tolist()} resize the batch or channel dims")
        factors = tuple(float(s) for s in scales[2:])
        if any(decimal32(s) != f for s, f in zip(scales[2:], factors)):
            raise Refuse(f"scales {scales.tolist()} are not exact in float32")
    elif view.has(3):
        sizes = view.sizes(3, "sizes")
        if len(sizes) != len(x) or sizes[0] is not BATCH or sizes[1] != x[1]:
            raise Refuse(f"sizes {list(sizes)} resize the batch or channel dims")
        factors = tuple(o / i for o, i in zip(sizes[2:], x[2:]))
    else:
        raise Refuse("neither scales nor sizes")
    if any(int(n * f) != o for n, f, o in zip(x[2:], factors, out[2:])):
        raise Refuse(f"resizing {list(x)} to {list(out)} by {list(factors)} is not a whole scale")
    return factors


def _factor(factors: tuple[float, float]):
    values = [int(f) if float(f).is_integer() else float(f) for f in factors]
    return values[0] if values[0] == values[1] else tuple(values)


@maps("Resize")
def resize(view):
    if view.opset < 11:
        raise Refuse("Resize before opset 11 (no coordinate transformation mode)")
    x, out = view.in_shape(0), view.out_shape()
    if len(x) != 4:
        raise Refuse(f"resizing a {len(x)}-D tensor (upsample is 2-D)")
    if int(view.attr("antialias", 0)):
        raise Refuse("antialiased resizing")
    axes = view.attr("axes")
    if axes is not None and sorted(int(a) % 4 for a in axes) != [0, 1, 2, 3]:
        raise Refuse(f"resizing only axes {list(axes)}")
    if view.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise Refuse(f"keep_aspect_ratio_policy={view.attr('keep_aspect_ratio_policy')!r}")
    mode = view.attr("mode", "nearest")
    coord = view.attr("coordinate_transformation_mode", "half_pixel")
    factors = _resize_factors(view, x, out)
    if mode == "nearest":
        nearest = view.attr("nearest_mode", "round_prefer_floor")
        if coord != "asymmetric" or nearest != "floor":
            raise Refuse(
                f"nearest resizing with coordinate_transformation_mode={coord!r} and "
                f"nearest_mode={nearest!r}: torch's 'nearest' is 'asymmetric' with 'floor'"
            )
        if not all(float(f).is_integer() for f in factors):
            raise Refuse(f"nearest resizing by the fractional factors {list(factors)}")
        return view.stmt("upsample", [view.value(0)], scale_factor=_factor(factors), mode="nearest")
    if mode != "linear":
        raise Refuse(f"{mode} resizing")
    if coord == "align_corners":
        align = True
    elif coord in ("half_pixel", "pytorch_half_pixel") and all(o > 1 for o in out[2:]):
        align = False
    else:
        raise Refuse(f"linear resizing with coordinate_transformation_mode={coord!r}")
    return view.stmt(
        "upsample",
        [view.value(0)],
        scale_factor=_factor(factors),
        mode="bilinear",
        align_corners=align,
    )


def _pad_amounts(view, rank: int) -> tuple[list[int], list[int], float]:
    """Per-dim (begin, end) padding and the fill value, whatever the opset."""
    if view.opset < 11:
        pads = [int(p) for p in view.attr("pads", [])]
        value = decimal32(view.attr("value", 0.0))
        axes = list(range(rank))
    else:
        pads = [int(p) for p in np.asarray(view.const(1, "pads")).reshape(-1)]
        value = _scalar(view, 2, "constant_value") if view.has(2) else 0.0
        axes = list(range(rank))
        if view.has(3):
            axes = [int(a) % rank for a in np.asarray(view.const(3, "axes")).reshape(-1)]
    if len(pads) != 2 * len(axes):
        raise Refuse(f"pads {pads} for {len(axes)} axes")
    begin, end = [0] * rank, [0] * rank
    for k, axis in enumerate(axes):
        begin[axis], end[axis] = pads[k], pads[k + len(axes)]
    return begin, end, value


@maps("Pad")
def pad(view):
    mode = view.attr("mode", "constant")
    if mode != "constant":
        raise Refuse(f"{mode} padding")
    rank = len(view.in_shape(0))
    begin, end, value = _pad_amounts(view, rank)
    if begin[0] or end[0]:
        raise Refuse("padding the batch dim")
    if any(p < 0 for p in begin + end):
        raise Refuse(f"negative padding (cropping) {begin + end}")
    if not any(begin + end):
        return view.alias(0)
    first = next(d for d in range(1, rank) if begin[d] or end[d])
    amounts: list[int] = []
    for d in range(rank - 1, first - 1, -1):
        amounts += [begin[d], end[d]]
    return view.stmt("pad", [view.value(0)], pad=tuple(amounts), value=value)


# ---------------------------------------------------------------- shapes


@maps("Concat")
def concat(view):
    inputs = view.inputs()
    if not all(view.is_data(i) for i in inputs):
        raise Refuse("concatenating a constant tensor")
    rank = len(view.in_shape(inputs[0]))
    dim = _axis(int(view.attr("axis", 0)), rank, "concatenating along dim")
    if len(inputs) == 1:
        return view.alias(inputs[0])
    return view.stmt("concat", [view.value(i) for i in inputs], dim=dim)


@maps("Flatten")
def flatten(view):
    x = view.in_shape(0)
    axis = int(view.attr("axis", 1))
    axis = axis + len(x) if axis < 0 else axis
    if axis == 0:
        raise Refuse("Flatten(axis=0) merges the batch dim")
    if any(d != 1 for d in x[1:axis]):
        raise Refuse(f"Flatten(axis={axis}) of {list(x)} merges dims into the batch dim")
    if len(x) == 2 and axis == 1:
        return view.alias(0)
    if axis == 1:
        return view.stmt("flatten", [view.value(0)], start_dim=1)
    return _reshape_to(view, x, tuple(view.out_shape()[1:]))


def _reshape_to(view, x: tuple, rest: tuple) -> str:
    if int(np.prod(rest)) != int(np.prod(x[1:])):
        raise Refuse(f"reshaping {list(x)} to [N, {', '.join(map(str, rest))}] moves the batch")
    if tuple(rest) == tuple(x[1:]):
        return view.alias(0)
    return view.stmt("reshape", [view.value(0)], shape=tuple(int(d) for d in rest))


@maps("Reshape")
def reshape(view):
    x = view.in_shape(0)
    target = list(view.sizes(1, "shape"))
    shown = ["N" if d is BATCH else str(d) for d in target]
    allowzero = bool(int(view.attr("allowzero", 0)))
    for k, size in enumerate(target):
        if size == 0 and not allowzero and k < len(x):
            target[k] = x[k]
        elif size == 0:
            raise Refuse(f"reshaping to a zero size [{', '.join(shown)}]")
    rest = target[1:]
    if any(d is BATCH for d in rest) or rest.count(-1) > 1:
        raise Refuse(f"reshaping {list(x)} to [{', '.join(shown)}] moves the batch")
    known = int(np.prod([d for d in rest if d != -1]))
    total = int(np.prod(x[1:]))
    if target[0] == -1 and -1 not in rest and known == total:
        target[0] = BATCH
    if target[0] is not BATCH:
        raise Refuse(f"reshaping {list(x)} to [{', '.join(shown)}]: the batch must stay first")
    if -1 in rest:
        if known == 0 or total % known:
            raise Refuse(f"reshaping {list(x)} to [{', '.join(shown)}]")
        rest[rest.index(-1)] = total // known
    return _reshape_to(view, x, tuple(rest))


def _squeeze_axes(view) -> list[int] | None:
    if view.opset >= 13:
        return None if not view.has(1) else list(np.asarray(view.const(1, "axes")).reshape(-1))
    axes = view.attr("axes")
    return None if axes is None else list(axes)


@maps("Squeeze", "Unsqueeze")
def squeeze(view):
    x, out = view.in_shape(0), view.out_shape()
    axes = _squeeze_axes(view)
    if axes is None:
        raise Refuse(f"{view.op} without axes (which dims go depends on the batch size)")
    rank = len(out) if view.op == "Unsqueeze" else len(x)
    for axis in axes:
        _axis(int(axis), rank, f"{view.op.lower()} dim")
    return _reshape_to(view, x, tuple(out[1:]))


@maps("Transpose")
def transpose(view):
    rank = len(view.in_shape(0))
    perm = [int(p) for p in view.attr("perm", list(range(rank))[::-1])]
    if perm[0] != 0:
        raise Refuse(f"perm {perm} moves the batch dim")
    if perm == list(range(rank)):
        return view.alias(0)
    moved = [k for k in range(rank) if perm[k] != k]
    if len(moved) == 2:
        return view.stmt("transpose", [view.value(0)], dim0=moved[0], dim1=moved[1])
    return view.stmt("permute", [view.value(0)], dims=tuple(perm))


def _int_list(view, i: int, what: str) -> list[int]:
    return [int(v) for v in np.asarray(view.const(i, what)).reshape(-1)]


def _slice_args(view, rank: int) -> list[tuple[int, int, int, int]]:
    """(axis, start, end, step) per sliced axis, whatever the opset."""
    if view.opset < 10:
        starts, ends = view.attr("starts", []), view.attr("ends", [])
        axes, steps = view.attr("axes", list(range(len(starts)))), [1] * len(starts)
    else:
        starts, ends = _int_list(view, 1, "starts"), _int_list(view, 2, "ends")
        axes = _int_list(view, 3, "axes") if view.has(3) else list(range(len(starts)))
        steps = _int_list(view, 4, "steps") if view.has(4) else [1] * len(starts)
    return [
        (int(a) % rank, int(b), int(e), int(s)) for a, b, e, s in zip(axes, starts, ends, steps)
    ]


@maps("Slice")
def slice_(view):
    x = view.in_shape(0)
    cuts = []
    for axis, start, end, step in _slice_args(view, len(x)):
        if step <= 0:
            raise Refuse(f"slicing with step {step}")
        size = x[axis]
        if axis == 0:
            if start in (0, -(2**63)) and end >= 2**31:
                continue  # the whole batch: x[:, ...]
            raise Refuse("slicing the batch dim")
        start = min(max(start + size if start < 0 else start, 0), size)
        end = min(max(end + size if end < 0 else end, 0), size)
        if (start, end, step) != (0, size, 1):
            cuts.append((axis, start, end, step))
    if not cuts:
        return view.alias(0)
    if len(cuts) > 1:
        raise Refuse(f"slicing several dims at once {[c[0] for c in cuts]}")
    axis, start, end, step = cuts[0]
    stop = None if end == x[axis] else end
    return view.stmt("slice", [view.value(0)], dim=axis, start=start, end=stop, step=step)


@maps("SplitToSequence")
def split_to_sequence(view):
    """The sequence is its source: each ``SequenceAt`` at a constant position slices it
    (``split_piece``); any other reader of the sequence is refused here."""
    others = [u.op for u in view.users(0) if u.op != "SequenceAt"]
    if others or view.node.output[0] == view.m.output:
        raise Refuse(f"its sequence is read by {others or ['the graph output']}, not SequenceAt")
    return view.value(0)


@maps("SequenceAt")
def sequence_at(view):
    x = view.value(0)  # the source, or Poisoned where the split failed
    source, axis, start, end, squeezed = view.m.split_piece(view.node, view.m.shapes)
    size = view.m.shape(source)[axis]
    if squeezed:
        return view.stmt("select", [x], dim=axis, index=start)
    if (start, end) == (0, size):
        return x
    stop = None if end == size else end
    return view.stmt("slice", [x], dim=axis, start=start, end=stop)


def _embedding_padding(view) -> int | None:
    """``padding_idx`` from the dynamo exporter's record of ``aten.embedding`` (its row gets
    no gradient); ONNX itself does not carry it, so a file without the record trains
    every row (said in a note)."""
    call = view.fx_call()
    if call is None or call.target != "aten.embedding.default":
        view.note(
            "padding_idx is not in ONNX files and this file does not record the embedding "
            "call: every row of its embeddings trains"
        )
        return None
    args = call.args
    if any(a == "True" for a in args[3:]) or any(
        call.kwargs.get(k) == "True" for k in ("scale_grad_by_freq", "sparse")
    ):
        raise Refuse("scale_grad_by_freq / sparse embeddings")
    padding = int(args[2]) if len(args) > 2 else int(call.kwargs.get("padding_idx", "-1"))
    return None if padding == -1 else padding


def _rows(ids: np.ndarray, padding: int | None) -> tuple[int, int]:
    """(start, length) of constant embedding ids that look up the same contiguous rows in
    every sample (position ids), or one row everywhere (token-type ids of zeros)."""
    if ids.ndim == 0 or ids.size == 0:
        raise Refuse("an embedding of a single constant index")
    rows = ids.reshape(-1, ids.shape[-1]).astype(np.int64)
    first = rows[0]
    if not (rows == first).all():
        raise Refuse("constant embedding ids that differ between samples")
    start, length = int(first[0]), int(first.size)
    if (first == start).all() and length > 1:
        length = 1  # one row for every position: broadcast over the sequence
    elif not (first == np.arange(start, start + length)).all():
        raise Refuse("constant embedding ids that are not a contiguous range")
    if padding is not None and start <= padding < start + length:
        raise Refuse("constant embedding ids that include padding_idx")
    return start, length


def _embedding(view):
    """``Gather`` of a module's ``weight`` table along dim 0: ``embedding`` of the ids, or,
    at constant ids, ``embedding_rows`` (a value without the batch dim that broadcasts
    where it is added, as the torch importer writes it)."""
    table = view.param_shape(0, "weight")
    if len(table) != 2:
        raise Refuse(f"a lookup in a table of shape {list(table)} (an embedding is 2-D)")
    padding = _embedding_padding(view)
    if padding is not None and not 0 <= padding < table[0]:
        raise Refuse(f"padding_idx {padding} outside the table's {table[0]} rows")
    layer = view.layer(weight=0)
    if view.is_data(1):
        return view.stmt(
            "embedding",
            [view.value(1)],
            layer=layer,
            num_embeddings=table[0],
            embedding_dim=table[1],
            padding_idx=padding,
        )
    spans = {_rows(np.asarray(ids), padding) for ids in view.const_pair(1)}
    if len(spans) != 1:
        raise Refuse("constant embedding ids whose rows depend on the batch size")
    start, length = spans.pop()
    if start + length > table[0]:
        raise Refuse(f"rows {start}..{start + length - 1} of a table of {table[0]}")
    view.set_unbatched((length, table[1]))
    return view.stmt(
        "embedding_rows",
        [],
        layer=layer,
        num_embeddings=table[0],
        embedding_dim=table[1],
        length=length,
        start=start,
    )


@maps("Expand")
def expand(view):
    """A parameter (a class token [1, 1, E]) or a batched value broadcast to the shape ONNX
    infers, which must keep the batch first: ``expand`` with -1 where a dim stays."""
    flat = view.unbatched(0)
    x = flat if flat is not None else view.in_shape(0)
    out = view.out_shape()
    lead = len(out) - len(x)
    if lead < 0 or any(d not in (1, e) for d, e in zip(x[::-1], out[::-1])):
        raise Refuse(f"expanding {list(x)} to {list(out)}")
    if flat is None and tuple(out) == tuple(x):
        return view.alias(0)
    size = [BATCH]
    for j in range(1, len(out)):
        size.append(-1 if j >= lead and x[j - lead] == out[j] else int(out[j]))
    return view.stmt("expand", [view.value(0)], size=tuple(size))


@maps("Gather")
def gather(view):
    if view.is_weight(0, "weight") and int(view.attr("axis", 0)) == 0:
        return _embedding(view)
    x = view.in_shape(0)
    if view.is_data(1):
        raise Refuse("gathering at indices computed from the input")
    index = np.asarray(view.const(1, "indices"))
    axis = _axis(int(view.attr("axis", 0)), len(x), "gathering along dim")
    if index.ndim != 0:
        raise Refuse(f"gathering {index.size} indices: only one index (select) is mapped")
    value = int(index)
    value = value + x[axis] if value < 0 else value
    return view.stmt("select", [view.value(0)], dim=axis, index=value)


@maps("Softmax", "LogSoftmax")
def softmax(view):
    rank = len(view.in_shape(0))
    axis = _axis(int(view.attr("axis", -1 if view.opset >= 13 else 1)), rank, "softmax over dim")
    if view.opset < 13 and axis != rank - 1:
        raise Refuse(f"{view.op} over axis {axis} before opset 13 flattens the dims from axis on")
    op = "softmax" if view.op == "Softmax" else "log_softmax"
    return view.stmt(op, [view.value(0)], dim=axis - rank)


@maps("Identity")
def identity(view):
    if "Dropout" in view.module_class():
        view.note(
            f"{view.where()} ({view.module_class().rsplit('.', 1)[-1]}) was exported as an "
            "identity (eval mode): its probability is not in the file, so no dropout there"
        )
    return view.alias(0)


@maps("Dropout")
def dropout(view):
    if view.opset >= 12:
        ratio = _scalar(view, 1, "ratio") if view.has(1) else 0.5
    else:
        ratio = decimal32(view.attr("ratio", 0.5))
    if ratio == 0.0:
        return view.alias(0)
    return view.stmt("dropout", [view.value(0)], p=ratio)


@maps("Cast")
def cast(view):
    to, source = int(view.attr("to", 0)), view.dtype(0)
    if to != source:
        raise Refuse(f"a cast from ONNX element type {source} to {to}")
    return view.alias(0)
