"""The operator token registry: ``ops.toml`` read into typed ``OpSpec`` records.

Everything the core knows about an operator comes from here: its arguments and their
validation, its parameters and buffers, what its backward step reads, which of those
are activations, and which runtime module holds its kernels where that is not the
platform's default (``unroller.compiler.platforms``). Extra
registry files (``UNROLLER_OPS``, os.pathsep-separated, or ``load_registry(extra)``)
add or replace entries, which is how an operator is added without touching the core.
"""

from __future__ import annotations

import ast as pyast
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUILTIN_REGISTRY = Path(__file__).with_name("ops.toml")
ARG_TYPES = ("int", "float", "bool", "str", "pair", "scale", "dims", "size")
KINDS = ("layer", "activation", "pool", "resample", "arith", "shape", "regularizer", "loss")
_MISSING = object()


class RegistryError(Exception):
    """The registry file itself is malformed (a developer error, not a model error)."""


@dataclass(frozen=True)
class ArgSpec:
    name: str
    type: str
    default: Any = _MISSING
    default_from: str | None = None
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    #: may be left out with no value at all: the kernel gets None (slice's end=None)
    optional: bool = False
    #: a ``dims`` that may be the empty tuple (parameter's shape=(): a learned scalar)
    empty: bool = False

    @property
    def required(self) -> bool:
        return self.default is _MISSING and self.default_from is None and not self.optional


@dataclass(frozen=True)
class TensorSpec:
    """A parameter or buffer: its name, shape expression, and when it exists."""

    name: str
    shape: str
    when: str | None = None
    dtype: str | None = None  # None: the model's float dtype

    def present(self, args: dict[str, Any]) -> bool:
        """``when`` names a bool argument or is an expression over the arguments
        (layernorm's bias exists only ``elementwise_affine and bias``)."""
        return self.when is None or bool(eval_expr(self.when, args))


@dataclass(frozen=True)
class LayerParams:
    """Parameters that repeat per layer and direction (the recurrent layers'): each row of
    ``rows`` once, named ``{row}_l{layer}`` and ``{row}_l{layer}_reverse`` in torch's order
    (layer by layer, the forward direction before the reverse one), present for the layers
    ``layers`` counts and, reversed, when ``reverse`` is true. A row's ``first`` is its shape
    at layer 0 (the input there is the statement's, above it the layer below's output).
    Rows are made for at least ``listed`` layers, so the backward's slot list (one per row)
    has one length for every statement of up to that many layers."""

    layers: str
    reverse: str
    listed: int
    rows: tuple[TensorSpec, ...]
    first: dict[str, str]

    def expand(self, count: int = 0) -> tuple[TensorSpec, ...]:
        """The rows of ``max(listed, count)`` layers, both directions."""
        made = []
        for layer in range(max(self.listed, count)):
            for reverse in (False, True):
                conditions = [f"{self.layers} > {layer}"] if layer else []
                conditions += [self.reverse] if reverse else []
                for row in self.rows:
                    when = " and ".join(conditions + ([row.when] if row.when else []))
                    shape = self.first.get(row.name, row.shape) if layer == 0 else row.shape
                    name = f"{row.name}_l{layer}{'_reverse' if reverse else ''}"
                    made.append(TensorSpec(name, shape, when or None, row.dtype))
        return tuple(made)


@dataclass(frozen=True)
class ExtraSpec:
    """An extra forward output kept for backward: shaped like a tensor, or a fixed size."""

    name: str
    like: str | None = None  # "output" or an input name
    shape: str | None = None  # expression for a fixed-size extra
    dtype: str | None = None  # None: the dtype of what it is like, or the model's float dtype
    when: str | None = None  # expression: the extra exists only then (else the kernel gives None)


@dataclass(frozen=True)
class MaskSpec:
    """A saved entry that may be kept as a 1-bit mask instead (lossless)."""

    entry: str
    kernel: str | None = None  # makes the bool mask; None: the entry is a bool tensor
    like: str | None = None  # the input whose shape the mask has (default: the entry's)
    when: str | None = None  # expression over args and derived values


@dataclass(frozen=True)
class DerivativeSpec:
    """A saved entry that the backward reads only through f'(entry) (an elementwise
    activation's input): it may be kept as a ``bits``-bit code of the derivative of
    ``function`` (``unroller.compress.fewbit.DERIVATIVES``) when the scheme turns
    ``derivatives`` on. Lossy: the gradient uses the optimal piecewise-constant f'."""

    entry: str
    function: str
    bits: int = 3


LAYOUTS = ("rows",)
"""Values of an op's ``layout`` field."""

WEIGHTED = ("output", "input")
"""Values of an op's ``weighted`` field: whose elements each meet the weight's per-output
elements in a multiply-add (a transposed convolution spreads each input over the kernel)."""

TARGETS = ("classes", "probabilities")
"""Values of a loss's ``target`` field: what its second input holds."""

PRECISION_CLASSES = ("lower", "fp32", "input", "promote")
"""Values of an op's ``precision`` field, torch.autocast's lists: ``lower`` runs in the low
dtype under a mixed precision (its float inputs and parameters cast to it), ``fp32`` in
float32 (its float inputs cast up), ``input`` in its float inputs' dtype with its float32
parameters as they are (batch norm, whose kernels take both), ``promote`` (the default) in
the widest dtype of its float inputs and parameters."""


@dataclass(frozen=True)
class Workspace:
    """Working memory a kernel allocates beyond its outputs: multiples of its first
    input's bytes, of its output gradient's bytes and of its weight's bytes. Called with
    ``piece_bytes`` (registry ``backward_pieces``), the kernel runs on pieces of the batch
    (``unroller.runtime.gpu.piece_samples``), so the batch-sized parts are those of one
    piece; an input restored a piece at a time (``K.restore_in_pieces``) adds its piece,
    ``restored`` times the input's bytes, and the codec's decompression transient. The
    memory model (``unroller.analysis.memory``) reads it; the numbers are measurements, so they
    belong with the operator rather than with the model of memory."""

    input: float
    output: float
    weight: float = 0.0
    fixed: int = 0  # bytes whatever the sizes
    extra: tuple[str, float] | None = None  # (an extra output's name, multiple of its bytes)
    #: multiple of the largest score tile of an attention kernel (``_score_tile``)
    tiles: float = 0.0
    restored: float = 1.0  # a piece decompressed from a RestoredInPieces, beyond ``input``


@dataclass(frozen=True)
class WorkspaceSpec:
    """An op's kernels' working memory (``workspace``): the backward kernel's phases (the
    most over them counts), the backward run in pieces of the batch (per piece), and the
    forward kernel's phases; ``contiguous_input``: the forward copies an input with
    reordered dims into a contiguous tensor first; ``contiguous_grad``: the backward does
    so with such an output gradient."""

    backward: tuple[Workspace, ...] = ()
    pieces: Workspace | None = None
    forward: tuple[Workspace, ...] = ()
    contiguous_input: bool = False
    contiguous_grad: bool = False


@dataclass(frozen=True)
class RecomputeSpec:
    """How the backward may remake an op's output instead of keeping it (``recompute``):
    ``kernel`` (default: the op's forward kernel, whose extra outputs are then dropped) is
    called on the op's inputs, its layer if it has one, and ``kernel_args``. The kernel must
    be deterministic and change no state (batch norm's recompute kernel leaves the running
    statistics alone)."""

    kernel: str


@dataclass(frozen=True)
class ModuleSpec:
    """The torch.nn class that holds an op's parameters and buffers, and how to build it.

    ``args`` are passed positionally, ``kwargs`` by name; both name op arguments or
    values the shape rule derives. A keyword equal to its registry default is left out
    of the generated constructor call, so those defaults must be the class's own.
    """

    cls: str  # "torch.nn.Conv2d"
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    #: constant keywords always passed, whatever the op's arguments: the class's form that
    #: matches the op (``batch_first = true`` for torch.nn.MultiheadAttention)
    fixed: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class OpSpec:
    name: str
    doc: str
    kind: str
    inputs: tuple[str, ...]
    variadic: bool
    args: dict[str, ArgSpec]
    shape: str
    params: tuple[TensorSpec, ...] = ()
    #: parameters that repeat per layer (their rows for ``listed`` layers end ``params``)
    layer_params: LayerParams | None = None
    buffers: tuple[TensorSpec, ...] = ()
    module: ModuleSpec | None = None
    extras: tuple[ExtraSpec, ...] = ()
    saved: tuple[str, ...] = ()
    activations: tuple[str, ...] = ()
    masks: dict[str, MaskSpec] = field(default_factory=dict)
    kernel_args: tuple[str, ...] = ()
    backward_args: tuple[str, ...] = ()
    has_eval: bool = False
    grad_aliases: bool = False
    #: the forward returns a view of its input (or parameter): it allocates nothing, which
    #: the memory model (unroller.analysis.memory) needs to know
    view: bool = False
    kernels: dict[str, str] = field(default_factory=dict)  # platform -> module, if not default
    #: a free parameter (``parameter(...)``): no tensor inputs, one parameter whose state-dict
    #: key is the statement's own name, held by the module at the name's parent path
    free: bool = False
    derivative: dict[str, DerivativeSpec] = field(default_factory=dict)
    #: a saved entry only some gradients read: entry -> those gradients (input or parameter
    #: names); when none of them is needed (a frozen weight) it is not kept (passed as None)
    saved_for: dict[str, tuple[str, ...]] = field(default_factory=dict)
    layout: str | None = None  # "rows": its 4-D tensors are rows, not image maps
    #: the backward may remake the output from the inputs (``--recompute``); None: never
    recompute: RecomputeSpec | None = None
    #: the backward kernel takes ``piece_bytes=B``: it may run on pieces of the batch of
    #: about B bytes (the platform's ``piece_bytes``, under lossy schemes) to shrink its
    #: working buffers, and read its first saved entry restored one piece at a time
    backward_pieces: bool = False
    #: a sample's output depends on other samples (batch norm's batch statistics): a segment
    #: holding it cannot be recomputed in pieces of the batch (``--segment-pieces``)
    batch_coupled: bool = False
    #: the backward kernel takes ``in_place=True``: it may write its first input's gradient
    #: into the output gradient, passed when the code generator owns that gradient
    backward_in_place: bool = False
    #: the backward kernel takes ``add_into=T``: it adds its first input's gradient into T
    #: (the gradient so far, the code generator's own) and returns T
    backward_add_into: bool = False
    #: saved extras of the op's own forward that the backward kernel may overwrite
    #: (``consume=True``): nothing else reads them, so the first input's gradient can be
    #: written into their storage instead of a new tensor (cross entropy's log_probs)
    backward_consumes: tuple[str, ...] = ()
    #: the backward's parameter gradients are new tensors nothing else holds (matmul and
    #: reduction results): the first one becomes the parameter's ``.grad`` as it is
    #: (``K.accumulate_fresh``), as autograd's AccumulateGrad takes a gradient only it holds
    fresh_param_grads: bool = False
    #: the backward kernel takes ``accumulate=True`` on a platform whose parameter gradients
    #: go into ``.grad``: it then adds them into each ``.grad`` itself (a matmul in place)
    #: and returns None for them; passed inside segments run in pieces of the batch
    backward_accumulates: bool = False
    #: how many of the last ``inputs`` a call may leave out (an attention's additive bias):
    #: the kernels then receive None for them, and no gradient is made for them
    optional_inputs: int = 0
    #: a weighted layer (``weighted``): "output" or "input", whose elements each take the
    #: weight's per-output elements in multiply-adds (the FLOPs estimate), and whose input
    #: gradient reads the weight alone, never the saved input x; None: not weighted
    weighted: str | None = None
    #: a loss's target (``target``): "classes" (indices in [0, C), C the first input's dim
    #: 1) or "probabilities" (values in [0, 1]); None: any value of its dtype
    target: str | None = None
    #: the kernels' working memory beyond their outputs (``workspace``)
    workspace: WorkspaceSpec = field(default_factory=WorkspaceSpec)
    #: the output is a view of the input with its dims reordered (``reorders``)
    reorders: bool = False
    #: what a mixed precision runs it in (``precision``): "lower", "fp32" or "promote"
    precision: str = "promote"
    #: the op a mixed precision calls instead when the first input arrives in its low dtype
    #: (``low_precision``: the same inputs and arguments, computing in float32 inside
    #: without a float32 copy of that input): cross entropy on bf16 logits
    low_precision: str | None = None

    def params_for(self, args: dict[str, Any]) -> tuple[TensorSpec, ...]:
        """The parameters of a call with these arguments: ``params``, with the repeating
        rows made for as many layers as the call has (when that is more than are listed)."""
        repeat = self.layer_params
        if repeat is None or int(args.get(repeat.layers, 0)) <= repeat.listed:
            return self.params
        fixed = self.params[: len(self.params) - len(repeat.expand())]
        return fixed + repeat.expand(int(args[repeat.layers]))

    @property
    def is_loss(self) -> bool:
        return self.kind == "loss"

    def input_names(self, count: int) -> tuple[str, ...]:
        """Names of the tensor inputs for a call with ``count`` positional values."""
        if self.variadic:
            return tuple(f"input{i}" for i in range(count))
        return self.inputs[: max(count, len(self.inputs) - self.optional_inputs)]

    @property
    def required_inputs(self) -> int:
        """How many tensor inputs a call must give (all but the optional trailing ones)."""
        return len(self.inputs) - self.optional_inputs


def eval_expr(expr: str, env: dict[str, Any]) -> Any:
    """Evaluate a registry shape expression: names, numbers, tuples, indexing, arithmetic."""
    tree = pyast.parse(expr, mode="eval")
    allowed = (
        pyast.Expression,
        pyast.Tuple,
        pyast.Name,
        pyast.Load,
        pyast.Constant,
        pyast.Subscript,
        pyast.BinOp,
        pyast.UnaryOp,
        pyast.Add,
        pyast.Sub,
        pyast.Mult,
        pyast.FloorDiv,
        pyast.USub,
        pyast.Compare,
        pyast.Lt,
        pyast.LtE,
        pyast.Gt,
        pyast.GtE,
        pyast.Eq,
        pyast.NotEq,
        pyast.BoolOp,
        pyast.And,
        pyast.Or,
    )
    for node in pyast.walk(tree):
        if not isinstance(node, allowed):
            raise RegistryError(f"expression {expr!r}: {type(node).__name__} is not allowed")
    return eval(compile(tree, "<registry>", "eval"), {"__builtins__": {}}, dict(env))  # noqa: S307


def _tensor_specs(op: str, raw: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    specs = []
    for item in raw:
        unknown = set(item) - {"name", "shape", "when", "dtype"}
        if unknown or "name" not in item or "shape" not in item:
            raise RegistryError(f"{op}: bad parameter/buffer entry {item!r}")
        specs.append(TensorSpec(item["name"], item["shape"], item.get("when"), item.get("dtype")))
    return tuple(specs)


def _layer_params(where: str, raw: Any) -> LayerParams | None:
    """An entry's ``layer_params`` table: the rows of one layer and direction, what counts
    the layers and turns the reverse direction on, and how many layers are always listed."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"layers", "reverse", "listed", "rows"}:
        raise RegistryError(f"{where}: layer_params needs exactly layers, reverse, listed, rows")
    rows = raw["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise RegistryError(f"{where}: layer_params.rows must be a list of tables")
    plain = [{k: v for k, v in r.items() if k != "first"} for r in rows]
    first = {r["name"]: r["first"] for r in rows if "first" in r}
    listed = raw["listed"]
    if not isinstance(listed, int) or isinstance(listed, bool) or listed < 1:
        raise RegistryError(f"{where}: layer_params.listed must be a positive integer")
    specs = _tensor_specs(where, plain)
    return LayerParams(str(raw["layers"]), str(raw["reverse"]), listed, specs, first)


def _expanded(layer_params: LayerParams | None) -> tuple[TensorSpec, ...]:
    return () if layer_params is None else layer_params.expand()


def _extra_specs(op: str, raw: list[dict[str, Any]]) -> list[ExtraSpec]:
    specs = []
    for item in raw:
        if set(item) - {"name", "like", "shape", "dtype", "when"} or ("like" in item) == (
            "shape" in item
        ):
            raise RegistryError(f"{op}: extra {item!r} needs a name and one of like/shape")
        specs.append(
            ExtraSpec(
                item["name"],
                item.get("like"),
                item.get("shape"),
                item.get("dtype"),
                item.get("when"),
            )
        )
    return specs


OP_FIELDS = frozenset(
    {
        "doc",
        "kind",
        "inputs",
        "variadic",
        "args",
        "shape",
        "params",
        "layer_params",
        "buffers",
        "module",
        "extras",
        "saved",
        "saved_for",
        "activations",
        "masks",
        "kernel_args",
        "backward_args",
        "eval",
        "grad_aliases",
        "view",
        "kernels",
        "free",
        "derivative",
        "layout",
        "recompute",
        "backward_pieces",
        "batch_coupled",
        "backward_in_place",
        "backward_add_into",
        "backward_consumes",
        "fresh_param_grads",
        "backward_accumulates",
        "optional_inputs",
        "weighted",
        "target",
        "workspace",
        "reorders",
        "precision",
        "low_precision",
    }
)
"""The fields an ops.toml entry may have (anything else is a typo, refused)."""


def _op_spec(name: str, raw: dict[str, Any], source: Path) -> OpSpec:
    """One ops.toml entry as an OpSpec, every field checked against the others."""
    where = f"{source}: [{name}]"
    _check_op_fields(where, raw)
    args = _arg_specs(where, raw.get("args", {}))
    layer_params = _layer_params(where, raw.get("layer_params"))
    spec = OpSpec(
        name=name,
        doc=raw["doc"],
        kind=raw["kind"],
        inputs=tuple(raw.get("inputs", ())),
        variadic=bool(raw.get("variadic", False)),
        args=args,
        shape=raw["shape"],
        params=_tensor_specs(name, raw.get("params", [])) + _expanded(layer_params),
        layer_params=layer_params,
        buffers=_tensor_specs(name, raw.get("buffers", [])),
        module=_module_spec(where, raw.get("module")),
        extras=tuple(_extra_specs(name, raw.get("extras", []))),
        saved=tuple(raw.get("saved", ())),
        saved_for={k: tuple(v) for k, v in raw.get("saved_for", {}).items()},
        activations=tuple(raw.get("activations", ())),
        masks={
            entry: MaskSpec(entry, m.get("kernel"), m.get("like"), m.get("when"))
            for entry, m in raw.get("masks", {}).items()
        },
        kernel_args=tuple(raw.get("kernel_args", ())),
        backward_args=tuple(raw.get("backward_args", raw.get("kernel_args", ()))),
        has_eval=bool(raw.get("eval", False)),
        grad_aliases=bool(raw.get("grad_aliases", False)),
        view=bool(raw.get("view", False)),
        kernels=_kernels(where, raw.get("kernels", {})),
        free=bool(raw.get("free", False)),
        derivative=_derivative_specs(where, raw),
        layout=raw.get("layout"),
        recompute=_recompute_spec(where, name, raw.get("recompute")),
        backward_pieces=bool(raw.get("backward_pieces", False)),
        batch_coupled=bool(raw.get("batch_coupled", False)),
        backward_in_place=bool(raw.get("backward_in_place", False)),
        backward_add_into=bool(raw.get("backward_add_into", False)),
        backward_consumes=tuple(raw.get("backward_consumes", ())),
        fresh_param_grads=bool(raw.get("fresh_param_grads", False)),
        backward_accumulates=bool(raw.get("backward_accumulates", False)),
        optional_inputs=int(raw.get("optional_inputs", 0)),
        weighted=_choice(where, raw, "weighted", WEIGHTED),
        target=_choice(where, raw, "target", TARGETS),
        workspace=_workspace_spec(where, raw.get("workspace", {})),
        reorders=raw.get("reorders", False) is True,
        precision=_choice(where, raw, "precision", PRECISION_CLASSES) or "promote",
        low_precision=raw.get("low_precision"),
    )
    _check_op_consistency(where, spec, raw)
    return spec


def _check_op_fields(where: str, raw: dict[str, Any]) -> None:
    """Refuse an entry with unknown or missing fields, an unknown kind, or no inputs."""
    if unknown := set(raw) - OP_FIELDS:
        raise RegistryError(f"{where}: unknown field(s) {sorted(unknown)}")
    for required in ("doc", "kind", "shape"):
        if required not in raw:
            raise RegistryError(f"{where}: missing field '{required}'")
    if raw["kind"] not in KINDS:
        raise RegistryError(f"{where}: kind must be one of {KINDS}")
    if raw.get("free"):
        if raw.get("inputs") or raw.get("variadic") or len(raw.get("params", [])) != 1:
            raise RegistryError(f"{where}: a free op has no inputs and exactly one parameter")
    elif not raw.get("variadic") and not raw.get("inputs") and not raw.get("params"):
        # no inputs is allowed only for a layer made from its parameters (embedding_rows)
        raise RegistryError(f"{where}: needs 'inputs', 'variadic = true' or 'params'")


def _arg_specs(where: str, raw_args: dict[str, Any]) -> dict[str, ArgSpec]:
    """An entry's keyword arguments (``args``), each with its type, default and bounds."""
    args: dict[str, ArgSpec] = {}
    for arg_name, arg in raw_args.items():
        if arg.get("type") not in ARG_TYPES:
            raise RegistryError(f"{where}: arg {arg_name}: type must be one of {ARG_TYPES}")
        args[arg_name] = ArgSpec(
            name=arg_name,
            type=arg["type"],
            # optional = true: the default is None (TOML has no null), as padding_idx=None
            default=None if arg.get("optional") else arg.get("default", _MISSING),
            default_from=arg.get("default_from"),
            min=arg.get("min"),
            max=arg.get("max"),
            choices=tuple(arg["choices"]) if "choices" in arg else None,
            optional=bool(arg.get("optional", False)),
            empty=bool(arg.get("empty", False)),
        )
        if args[arg_name].optional and "default" in arg:
            raise RegistryError(f"{where}: arg {arg_name}: optional means the default is None")
    return args


def _check_op_consistency(where: str, spec: OpSpec, raw: dict[str, Any]) -> None:
    """Refuse an entry whose fields contradict each other: saved entries that name
    nothing, masks or derivatives of what is not saved, a weighted op without a weight."""
    if spec.target is not None and (spec.kind != "loss" or len(spec.inputs) < 2):
        raise RegistryError(f"{where}: target is for a loss with a target input")
    if spec.weighted is not None and "weight" not in {p.name for p in spec.params}:
        raise RegistryError(f"{where}: a weighted op needs a parameter named weight")
    if not isinstance(raw.get("reorders", False), bool) or (spec.reorders and not spec.view):
        raise RegistryError(f"{where}: reorders is true only for a view")
    if not 0 <= spec.optional_inputs <= len(spec.inputs) or (
        spec.optional_inputs and spec.variadic
    ):
        raise RegistryError(f"{where}: optional_inputs must count some of the last inputs")
    readable = set(spec.inputs) | {"output"} | {e.name for e in spec.extras}
    readable |= {p.name for p in spec.params} | {b.name for b in spec.buffers}
    for saved in spec.saved:
        if saved not in readable and not spec.variadic:
            raise RegistryError(f"{where}: saved '{saved}' is not an input, output, param or extra")
    for entry, mask in raw.get("masks", {}).items():
        if entry not in spec.saved or set(mask) - {"kernel", "like", "when"}:
            raise RegistryError(
                f"{where}: masks.{entry} must name a saved entry; keys kernel/like/when"
            )
    grads = set(spec.inputs) | {p.name for p in spec.params}
    for entry, readers in spec.saved_for.items():
        if entry not in spec.saved or not readers or not set(readers) <= grads:
            raise RegistryError(
                f"{where}: saved_for.{entry} must name a saved entry and the inputs or "
                "parameters whose gradients read it"
            )
    for entry in spec.derivative:
        if entry not in spec.activations:
            raise RegistryError(f"{where}: derivative.{entry} must name a saved activation")
    if spec.layout is not None and spec.layout not in LAYOUTS:
        raise RegistryError(f"{where}: layout must be one of {LAYOUTS}")
    extras = {e.name for e in spec.extras}
    if any(e not in spec.saved or e not in extras for e in spec.backward_consumes):
        raise RegistryError(f"{where}: backward_consumes must name saved extras")
    if not set(spec.activations) <= set(spec.saved):
        raise RegistryError(f"{where}: every activation must also be saved")
    if (spec.params or spec.buffers) and not spec.module:
        raise RegistryError(f"{where}: an op with parameters needs 'module'")


def _choice(where: str, raw: dict[str, Any], key: str, values: tuple[str, ...]) -> str | None:
    """A field holding one of ``values`` or left out (None)."""
    value = raw.get(key)
    if value is not None and value not in values:
        raise RegistryError(f"{where}: {key} must be one of {values}")
    return value


WORKSPACE_KEYS = ("input", "output", "weight", "fixed", "extra", "tiles", "restored")


def _phase(where: str, raw: Any) -> Workspace:
    """One ``{ input = 1.0, output = 0.0, ... }`` working-memory entry, checked for form:
    multiples are non-negative numbers, ``fixed`` bytes an integer, ``extra`` a pair."""
    ok = isinstance(raw, dict) and {"input", "output"} <= set(raw) <= set(WORKSPACE_KEYS)
    numbers = [raw.get(k, 0) for k in WORKSPACE_KEYS if k != "extra"] if ok else []
    ok = ok and all(
        isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in numbers
    )
    ok = ok and isinstance(raw.get("fixed", 0), int)
    extra = raw.get("extra") if ok else None
    if extra is not None and not (
        isinstance(extra, list)
        and len(extra) == 2
        and isinstance(extra[0], str)
        and isinstance(extra[1], (int, float))
    ):
        ok = False
    if not ok:
        raise RegistryError(
            f"{where}: a workspace entry is {{ input = X, output = Y }} with optional "
            f"{', '.join(WORKSPACE_KEYS[2:])}: non-negative numbers (fixed: bytes, an "
            'integer; extra: ["EXTRA", X])'
        )
    values = {k: raw[k] for k in WORKSPACE_KEYS if k in raw and k != "extra"}
    return Workspace(**values, extra=tuple(extra) if extra is not None else None)


def _workspace_spec(where: str, raw: Any) -> WorkspaceSpec:
    """``workspace = { backward = [...], pieces = {...}, forward = [...], contiguous_* }``."""
    keys = {"backward", "pieces", "forward", "contiguous_input", "contiguous_grad"}
    if not isinstance(raw, dict) or set(raw) - keys:
        raise RegistryError(f"{where}: workspace keys are {sorted(keys)}")
    phases = {}
    for key in ("backward", "forward"):
        if not isinstance(raw.get(key, []), list):
            raise RegistryError(f"{where}: workspace.{key} is a list of entries")
        phases[key] = tuple(_phase(where, item) for item in raw.get(key, []))
    flags = {k: raw.get(k, False) for k in ("contiguous_input", "contiguous_grad")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise RegistryError(f"{where}: workspace's contiguous_input and contiguous_grad are bools")
    pieces = _phase(where, raw["pieces"]) if "pieces" in raw else None
    return WorkspaceSpec(phases["backward"], pieces, phases["forward"], **flags)


def _recompute_spec(where: str, name: str, raw: Any) -> RecomputeSpec | None:
    """``recompute = true`` (the forward kernel) or ``recompute = { kernel = "NAME" }``."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return RecomputeSpec(name)
    if isinstance(raw, dict) and set(raw) == {"kernel"} and isinstance(raw["kernel"], str):
        return RecomputeSpec(raw["kernel"])
    raise RegistryError(f'{where}: recompute must be true or {{ kernel = "NAME" }}')


def _derivative_specs(where: str, raw: dict[str, Any]) -> dict[str, DerivativeSpec]:
    """``derivative.ENTRY = { function = "gelu", bits = 3 }`` entries, checked for form."""
    found = {}
    for entry, item in raw.get("derivative", {}).items():
        if (
            not isinstance(item, dict)
            or set(item) - {"function", "bits"}
            or not isinstance(item.get("function"), str)
            or not isinstance(item.get("bits", 3), int)
        ):
            raise RegistryError(
                f'{where}: derivative.{entry} must be {{ function = "NAME", bits = INT }}'
            )
        found[entry] = DerivativeSpec(entry, item["function"], item.get("bits", 3))
    return found


def _module_spec(where: str, raw: Any) -> ModuleSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("class"), str):
        raise RegistryError(f'{where}: module must be {{ class = "torch.nn.X", args, kwargs }}')
    if set(raw) - {"class", "args", "kwargs", "fixed"}:
        raise RegistryError(f"{where}: module keys are class, args, kwargs and fixed")
    names = [*raw.get("args", []), *raw.get("kwargs", [])]
    if not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise RegistryError(f"{where}: module args and kwargs are argument names")
    fixed = raw.get("fixed", {})
    if not isinstance(fixed, dict) or not all(
        isinstance(k, str) and k.isidentifier() and isinstance(v, (bool, int, float, str))
        for k, v in fixed.items()
    ):
        raise RegistryError(f"{where}: module fixed maps keyword names to constants")
    return ModuleSpec(
        raw["class"],
        tuple(raw.get("args", ())),
        tuple(raw.get("kwargs", ())),
        tuple(fixed.items()),
    )


def _kernels(where: str, raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise RegistryError(f"{where}: kernels must map platform names to module names")
    return dict(raw)


def _read(path: Path) -> dict[str, OpSpec]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RegistryError(f"{path}: {exc}") from exc
    return {name: _op_spec(name, raw, path) for name, raw in data.items()}


@lru_cache(maxsize=8)
def _load(paths: tuple[str, ...]) -> dict[str, OpSpec]:
    ops: dict[str, OpSpec] = {}
    for path in paths:
        ops.update(_read(Path(path)))
    for spec in ops.values():
        _check_low_precision(spec, ops)
    return ops


def _check_low_precision(spec: OpSpec, ops: dict[str, OpSpec]) -> None:
    """An op's ``low_precision`` names an op that takes the same inputs and arguments (the
    graph builder swaps one for the other) and has none of its own."""
    if spec.low_precision is None:
        return
    other = ops.get(spec.low_precision)
    where = f"[{spec.name}] low_precision"
    if other is None:
        raise RegistryError(f"{where}: no op named {spec.low_precision!r}")
    same = other.inputs == spec.inputs and list(other.args) == list(spec.args)
    if not same or other.kind != spec.kind or other.low_precision is not None:
        raise RegistryError(
            f"{where}: {other.name} must take the same inputs and arguments, be a "
            f"{spec.kind} too and have no low_precision of its own"
        )


def load_registry(extra: tuple[str, ...] | list[str] = ()) -> dict[str, OpSpec]:
    """The built-in registry plus ``UNROLLER_OPS`` files plus ``extra`` files, later winning."""
    env = tuple(p for p in os.environ.get("UNROLLER_OPS", "").split(os.pathsep) if p)
    return _load((str(BUILTIN_REGISTRY), *env, *(str(p) for p in extra)))
