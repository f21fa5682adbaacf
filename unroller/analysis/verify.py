"""``unroll verify``: a model text against the ``torch.nn.Module`` it claims to be.

Both networks are built in float64 with the same weights (the original's, carried through
the generated module's ``state_dict`` and back, strict both ways), run one training step on
the same seeded inputs of the declared shapes, and every number that step makes is
compared: the loss, every parameter's gradient, every buffer afterwards, and the
evaluation-mode predictions. The original (autograd) is the reference.

The original's ``forward`` returns predictions, not a loss, so the loss the model text
applies is replayed on them: the text must read ``prediction -> shape ops -> loss``
(``head -> permute -> cross_entropy`` in gpt_tiny.txt), and the same ops run in torch.

Dropout draws random masks. By default both sides are seeded with ``seed`` right before
their forward (as tests/networks/test_benchmark_models.py does with DROPOUT_SEED): the generated
kernel draws exactly what ``torch.nn.functional.dropout`` draws, so the masks agree when
both sides draw in the same order, and a pass is a real pass, masks included. When the
draw orders differ, that mode fails although the gradients may be right; ``dropout="off"``
then sets every dropout probability to 0 on both sides (the text's ``dropout`` statements,
the original's dropout modules) and checks everything except the masks. Either way the
report says what was done.

A step generated for a low ``--precision`` (bf16-mixed, fp16-mixed, bf16, fp16) cannot
match float64: verify then checks its accuracy contract instead, against the float64
original and torch's own step in that precision (``unroller.analysis.verify_precision``,
``_contract_step``), with dropout off on every side.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import math
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unroller.analysis.inputs import make_inputs
from unroller.analysis.report import value_table
from unroller.compiler.ast import Call, Const, KwArg, ModelAST
from unroller.compiler.graph import Graph, Node, Value, build_graph
from unroller.compiler.parser import parse, read_source
from unroller.errors import ModelError
from unroller.files import source_label
from unroller.materialize import model_class

if TYPE_CHECKING:
    import torch

    from unroller.analysis.verify_precision import ContractReport
    from unroller.compiler.options import Options

TOLERANCE = 1e-10  # float64, relative: the project's bound for "the same gradients"
TINY = 1e-300  # the floor of the relative error's denominator (see ``relative_error``)
#: Below this, a float64 reference is likely cancellation noise (a bias before batch norm
#: has a gradient of exactly zero in exact arithmetic): a FAIL row then says so.
ROUNDING_LEVEL = 1e-13
#: Statements verify replays between the returned prediction and the loss.
SHAPE_OPS = ("permute", "transpose", "reshape", "flatten")
#: Losses verify replays on the original's predictions (torch.nn.functional, mean).
LOSS_OPS = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "bce_with_logits", "bce_loss")
DROPOUT_MODES = ("seeded", "off")


class VerifyError(ModelError):
    """The model text cannot be verified as asked (not ``prediction -> shape ops -> loss``,
    an unknown dropout mode); carries the statement's location when there is one."""


# ---------------------------------------------------------------------------- the report


@dataclass
class Row:
    """One compared tensor: the generated module's value against the original's."""

    name: str  # "loss", "grad layer1.0.conv1.weight", "buffer bn1.running_mean", ...
    shape: tuple[int, ...]
    ref_max: float  # max |ref|
    abs_diff: float  # max |got - ref|
    rel: float  # abs_diff / max(ref_max, TINY)
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    """What ``verify`` found. ``problems`` are mismatches that stop the comparison before
    numbers exist (state-dict keys, a forward that fails); ``notes`` say how it ran."""

    model: str
    against: str
    tolerance: float
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.rows) and all(row.ok for row in self.rows)

    @property
    def failed(self) -> list[Row]:
        return [row for row in self.rows if not row.ok]

    def table(self) -> str:
        """The rows as a fixed-width table (empty when nothing was compared)."""
        if not self.rows:
            return ""
        head = ("name", "shape", "max |ref|", "max abs diff", "rel. error", "")
        body = [
            (
                row.name,
                "[" + ", ".join(map(str, row.shape)) + "]",
                f"{row.ref_max:.3e}",
                f"{row.abs_diff:.3e}",
                f"{row.rel:.3e}",
                ("ok" if row.ok else "FAIL") + (f"  ({row.note})" if row.note else ""),
            )
            for row in self.rows
        ]
        return value_table(head, body)

    def summary(self) -> str:
        """One line: ok or FAIL, how many values, the worst or the failing ones."""
        if self.problems:
            return f"FAIL: {len(self.problems)} mismatch(es) before any step could be compared"
        if not self.rows:
            return "FAIL: nothing was compared"
        noise = [row for row in self.rows if row.note.startswith(NOISE_NOTE)]
        measured = [row for row in self.rows if row not in noise] or self.rows
        worst = max(measured, key=lambda row: (not math.isnan(row.rel), row.rel))
        if self.ok:
            extra = f"; {len(noise)} gradients zero in exact arithmetic" if noise else ""
            return (
                f"ok: {len(self.rows)} values match within {self.tolerance:g} relative "
                f"(largest error {worst.rel:.1e}, {worst.name}{extra})"
            )
        names = [row.name for row in self.failed]
        shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
        return (
            f"FAIL: {len(names)} of {len(self.rows)} values differ by more than "
            f"{self.tolerance:g} relative: {shown}"
        )

    def render(self) -> str:
        """Notes, problems, the table and the summary: what ``unroll verify`` prints."""
        parts = [f"verify {self.model} against {self.against}"]
        parts += [f"note: {note}" for note in self.notes]
        parts += [f"mismatch: {problem}" for problem in self.problems]
        if self.rows:
            parts.append(self.table())
        parts.append(self.summary())
        return "\n".join(parts)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(max |ref|, max |got - ref|, max |got - ref| / max(max |ref|, TINY)).

    Relative to the largest magnitude of the whole reference tensor, not element by
    element: a gradient entry that cancels to 1e-18 would make an elementwise ratio blow
    up on rounding noise, while the tensor's scale is what a difference must be small
    against. The TINY floor keeps an all-zero reference finite: an exact zero then still
    compares as 0, and any difference from it as huge. Equal entries (infinities, NaNs in
    the same place) count as no difference."""
    import torch

    a, b = got.detach().double(), ref.detach().double()
    if a.numel() == 0:
        return 0.0, 0.0, 0.0
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    ref_max, abs_diff = float(b.abs().max()), float(diff.max())
    return ref_max, abs_diff, abs_diff / max(ref_max, TINY)


def compare(name: str, got: Any, ref: Any, tolerance: float, note: str = "") -> Row:
    """A row for ``got`` (generated) against ``ref`` (original); integer tensors must be
    equal, float ones within ``tolerance`` relative."""
    if tuple(got.shape) != tuple(ref.shape):
        shapes = f"shape {list(got.shape)} here, {list(ref.shape)} in the original"
        nan = float("nan")
        return Row(name, tuple(ref.shape), nan, nan, nan, False, _join(note, shapes))
    ref_max, abs_diff, rel = relative_error(got, ref)
    if got.is_floating_point() or ref.is_floating_point():
        ok = rel <= tolerance
    else:
        ok = bool((got == ref).all())
    if not ok and ref_max < ROUNDING_LEVEL and abs_diff < ROUNDING_LEVEL:
        note = _join(
            note, "the reference is rounding noise: a value that is zero in exact arithmetic?"
        )
    return Row(name, tuple(ref.shape), ref_max, abs_diff, rel, ok, note)


def _join(*parts: str) -> str:
    return "; ".join(part for part in parts if part)


# ---------------------------------------------------------------------------- the loss


@dataclass
class LossPlan:
    """How the model text turns its returned prediction into its loss."""

    prediction: Value  # the first value returned after the loss
    pred_ops: list[Node]  # shape ops from the prediction to the loss's first argument
    loss: Node
    other: Value  # the declared input or target behind the loss's second argument
    other_ops: list[Node]  # shape ops from it to the loss's second argument

    def describe(self) -> str:
        ops = [*(_describe(node) for node in self.pred_ops), _describe(self.loss)]
        return f"{self.prediction.name} -> " + " -> ".join(ops)


def _describe(node: Node) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in node.args.items())
    return f"{node.op.name}({args})"


def _chain(value: Value, stop: Callable[[Value], bool]) -> list[Node] | Node:
    """The shape ops from where ``stop`` holds down to ``value``, in execution order; or
    the first node on the way that is not a shape op (the reason there is no chain)."""
    ops: list[Node] = []
    while not stop(value):
        node = value.producer
        if node is None or node.op.name not in SHAPE_OPS:
            return node  # type: ignore[return-value]
        ops.append(node)
        value = node.inputs[0]
    return ops[::-1]


def loss_plan(graph: Graph) -> LossPlan:
    """The ``prediction -> shape ops -> loss`` form of the model text, or VerifyError."""
    node = graph.loss.producer
    assert node is not None  # the graph builder requires a loss op
    if node.op.name not in LOSS_OPS:
        raise VerifyError(
            f"verify replays the loss on the original's predictions and knows "
            f"{', '.join(LOSS_OPS)}; the model's loss is {node.op.name}",
            node.loc,
        )
    if not graph.preds:
        raise VerifyError(
            "verify needs the prediction the loss is computed from: the model returns only "
            "its loss (return loss, PREDICTION)",
            node.loc,
        )
    prediction = graph.preds[0]
    pred_ops = _chain(node.inputs[0], lambda v: v is prediction)
    if not isinstance(pred_ops, list):
        raise VerifyError(_not_a_chain(node, prediction.name, pred_ops), node.loc)
    other_ops = _chain(node.inputs[1], lambda v: v.kind in ("input", "target"))
    if not isinstance(other_ops, list):
        raise VerifyError(_not_a_chain(node, "a declared target", other_ops, 1), node.loc)
    other = other_ops[0].inputs[0] if other_ops else node.inputs[1]
    return LossPlan(prediction, pred_ops, node, other, other_ops)


def _not_a_chain(loss: Node, source: str, culprit: Node | None, arg: int = 0) -> str:
    where = loss.inputs[arg].name
    why = f"'{culprit.name}' = {culprit.op.name}(...) is on the way" if culprit else "it is not"
    return (
        f"verify needs the model text in the form prediction -> shape ops -> loss: argument "
        f"{arg + 1} of {loss.op.name} ('{where}') must come from {source} through "
        f"{', '.join(SHAPE_OPS)} only, and {why}"
    )


def replay_loss(plan: LossPlan, prediction: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The text's loss computed with torch on the original's prediction."""
    for node in plan.pred_ops:
        prediction = _shape_op(node, prediction)
    for node in plan.other_ops:
        other = _shape_op(node, other)
    return _loss_op(plan.loss, prediction, other)


def _shape_op(node: Node, x: torch.Tensor) -> torch.Tensor:
    """The runtime's semantics: reshape keeps N and takes the dims after it, flatten runs
    from ``start_dim`` to the end."""
    import torch

    op, args = node.op.name, node.args
    if op == "permute":
        return x.permute(*args["dims"])
    if op == "transpose":
        return x.transpose(args["dim0"], args["dim1"])
    if op == "reshape":
        return x.reshape(x.shape[0], *args["shape"])
    if op == "flatten":
        return torch.flatten(x, args.get("start_dim", 1))
    raise AssertionError(op)  # loss_plan admits SHAPE_OPS only


def _loss_op(node: Node, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    op, args = node.op.name, node.args
    if op == "cross_entropy":
        return F.cross_entropy(
            a,
            b,
            ignore_index=args.get("ignore_index", -100),
            label_smoothing=args.get("label_smoothing", 0.0),
        )
    if op == "nll_loss":
        return F.nll_loss(a, b, ignore_index=args.get("ignore_index", -100))
    functions = {
        "mse_loss": F.mse_loss,
        "l1_loss": F.l1_loss,
        "bce_with_logits": F.binary_cross_entropy_with_logits,
        "bce_loss": F.binary_cross_entropy,
    }
    return functions[op](a, b)


# ---------------------------------------------------------------------------- inputs


#: The most input and target elements one verify step makes, all together (1 GiB in
#: float64): the language admits 2**34 per sample, and --batch-size is unbounded.
MAX_VERIFY_ELEMENTS = 2**27


def check_input_size(graph: Graph, batch_size: int) -> None:
    """VerifyError at the largest declaration when the step's inputs would exceed
    MAX_VERIFY_ELEMENTS (checked before anything is built or allocated)."""
    sizes = [(batch_size * math.prod(v.type.shape[1:]), v) for v in graph.inputs]
    total = sum(size for size, _ in sizes)
    if total > MAX_VERIFY_ELEMENTS:
        largest = max(sizes, key=lambda pair: pair[0])[1]
        raise VerifyError(
            f"verify's inputs at --batch-size {batch_size} would hold {total:,} elements, "
            f"more than the limit of {MAX_VERIFY_ELEMENTS:,} (2**27; '{largest.name}' is "
            f"{largest.type}); use a smaller --batch-size or smaller declared shapes",
            largest.loc,
        )


# ---------------------------------------------------------------------------- dropout


def text_dropouts(graph: Graph) -> list[str]:
    """'name (p=0.2)' for every dropout statement of the text that draws a mask."""
    return [
        f"{node.name} (p={node.args[key]:g})"
        for node in graph.nodes
        for key in DROPOUT_ARGS.get(node.op.name, ())
        if node.args.get(key, 0.0) > 0
    ]


#: operator -> its dropout probability argument (attention drops its probabilities,
#: stochastic depth whole samples)
DROPOUT_ARGS = {
    "dropout": ("p",),
    "scaled_dot_product_attention": ("dropout",),
    "drop_path": ("p",),
}


def module_dropouts(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The original's submodules that drop with p > 0: dropout modules, and attention
    modules with a float ``dropout`` (torch.nn.MultiheadAttention)."""
    import torch

    from unroller.importer.torch_nodes import stochastic_depth_attr

    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            found.append((name, sub))
        elif isinstance(sub, torch.nn.MultiheadAttention) and sub.dropout > 0:
            found.append((name, sub))
        elif (attr := stochastic_depth_attr(sub)) and getattr(sub, attr) > 0:
            found.append((name, sub))
    return found


def probability_attr(sub: Any) -> str:
    """The attribute holding a dropping module's probability (``p``, ``dropout`` of
    nn.MultiheadAttention, ``drop_prob`` of a stochastic depth module)."""
    from unroller.importer.torch_nodes import stochastic_depth_attr

    return stochastic_depth_attr(sub) or ("p" if hasattr(sub, "p") else "dropout")


def _module_dropout_text(name: str, sub: Any) -> str:
    return f"{name or '(root)'} ({type(sub).__name__}, p={getattr(sub, probability_attr(sub)):g})"


def dropout_off(model: ModelAST) -> ModelAST:
    """The model with ``p=0.0`` in every ``dropout`` statement and ``dropout=0.0`` in every
    attention, blocks included."""

    def fix(call: Call) -> Call:
        if call.op not in DROPOUT_ARGS:
            return call
        (key,) = DROPOUT_ARGS[call.op]
        kwargs = [kw for kw in call.kwargs if kw.name != key]
        kwargs.append(KwArg(key, Const(0.0, call.op_loc), call.op_loc))
        return replace(call, kwargs=tuple(kwargs))

    blocks = [replace(b, body=tuple(fix(c) for c in b.body)) for b in model.blocks]
    return replace(model, blocks=blocks, stmts=[fix(c) for c in model.stmts])


def _switch_off(modules: Sequence[tuple[str, Any]]) -> None:
    for _, sub in modules:
        setattr(sub, probability_attr(sub), 0.0)


def _dropout_notes(mode: str, text: list[str], original: list[str], seed: int) -> list[str]:
    if not text and not original:
        return []
    where = _join(
        f"in the text: {', '.join(text)}" if text else "",
        f"in the original: {', '.join(original)}" if original else "",
    )
    if mode == "off":
        return [
            f"dropout off: p set to 0 on both sides ({where}); everything but the dropout "
            "masks is checked (dropout the original's forward calls through "
            "torch.nn.functional with its own p is not switched off)"
        ]
    return [
        f"dropout with p > 0 ({where}): both sides are seeded with {seed} right before "
        "their forward and draw the same masks when they draw them in the same order (one "
        "draw per dropout, in statement order, as torch.nn.functional.dropout); a FAIL may "
        "then come from another draw order, not a gradient: --dropout off checks the rest"
    ]


# ---------------------------------------------------------------------------- building


def build_original(spec: Any, kwargs: dict | None) -> torch.nn.Module:
    """The original in train mode: SPEC built with ``kwargs``; from Python code also a
    factory (``spec(**kwargs)``) or a module, which is copied (verify moves it to float64
    and needs two independent instances)."""
    import torch

    from unroller.importer.model import ImportFailure
    from unroller.importer.source import build_module

    if isinstance(spec, str):
        return build_module(spec, kwargs)
    if isinstance(spec, torch.nn.Module):
        return copy.deepcopy(spec).train()
    module = spec(**(kwargs or {}))
    if not isinstance(module, torch.nn.Module):
        raise ImportFailure(f"{spec!r} built a {type(module).__name__}, not a torch.nn.Module")
    return module.train()


def key_problems(original: dict, generated: dict) -> list[str]:
    """Every state-dict key or shape that differs, each on its own line, naming the
    nearest key on the other side where one is close."""
    problems = []
    for key in original:
        if key not in generated:
            near = difflib.get_close_matches(key, [k for k in generated if k not in original], 1)
            hint = f" (the generated module has '{near[0]}')" if near else ""
            shape = list(original[key].shape)
            problems.append(f"'{key}' {shape} is in the original only{hint}")
    for key in generated:
        if key not in original:
            shape = list(generated[key].shape)
            problems.append(f"'{key}' {shape} is in the generated module only")
    for key in original:
        if key in generated and original[key].shape != generated[key].shape:
            problems.append(
                f"'{key}': shape {list(generated[key].shape)} in the generated module, "
                f"{list(original[key].shape)} in the original"
            )
    return problems


def _load_both_ways(original, generated, fresh) -> list[str]:
    """Load the original's state into the generated module and the result into a fresh
    original, strict=True; a refusal the key check did not foresee is a problem."""
    problems = []
    for source, target, what in (
        (original, generated, "the generated module"),
        (generated, fresh, "a fresh original"),
    ):
        try:
            target.load_state_dict(source.state_dict(), strict=True)
        except RuntimeError as exc:
            problems.append(f"loading into {what} failed: {exc}")
    return problems


# ---------------------------------------------------------------------------- verify


@dataclass
class _Setup:
    graph: Graph  # as written (declarations, loss form, dropout statements)
    run_graph: Graph  # what is generated (dropout off: with p=0)
    plan: LossPlan


def _setup(text: str, label: str, dropout: str, precision: str = "fp32") -> _Setup:
    """The text's graph as written, and as generated: dropout off (``dropout="off"``, and
    always under a low ``precision``), built for ``precision`` (its casts written)."""
    if dropout not in DROPOUT_MODES:
        raise VerifyError(f"unknown dropout mode {dropout!r} (known: {', '.join(DROPOUT_MODES)})")
    model = parse(text, label)
    graph = build_graph(model)
    plan = loss_plan(graph)
    run_graph = graph
    off = (dropout == "off" or precision != "fp32") and text_dropouts(graph)
    if off or precision != "fp32":
        run_graph = build_graph(dropout_off(model) if off else model, precision=precision)
    return _Setup(graph, run_graph, plan)


def verify(
    model_path: str | Path,
    spec: Any,
    kwargs: dict | None = None,
    batch_size: int = 2,
    seed: int = 0,
    tolerance: float = TOLERANCE,
    dropout: str = "seeded",
    options: Options | None = None,
) -> VerifyReport | ContractReport:
    """Verify the model file at ``model_path`` against ``spec`` (``package.module:Name``,
    ``path/file.py:Name``, or a callable returning the module). ModelError (VerifyError)
    for a model text that cannot be verified, ImportFailure for a SPEC that does not load;
    a mismatch is in the report (``ok`` False), never an exception. ``options``: the
    generated step's (``verify_text``; a low precision: the accuracy contract's report)."""
    text = read_source(model_path)
    return verify_text(
        text,
        spec,
        kwargs,
        batch_size,
        seed,
        tolerance,
        dropout,
        label=source_label(model_path),
        options=options,
    )


def verify_text(
    text: str,
    spec: Any,
    kwargs: dict | None = None,
    batch_size: int = 2,
    seed: int = 0,
    tolerance: float = TOLERANCE,
    dropout: str = "seeded",
    label: str = "<string>",
    options: Options | None = None,
) -> VerifyReport | ContractReport:
    """``verify`` for a model text held in memory; ``options``: the generated side's
    (gpu; recompute, segments, pieces, a scheme, a precision), by default uncompressed.

    A low ``options.precision`` (not ``fp32``) checks the accuracy contract instead of
    float64 equality (``unroller.analysis.verify_precision``): the report is a
    ``ContractReport``, dropout is off on every side, and ``tolerance`` (the float64
    check's bound) is not used; another value than the default is refused."""
    import torch

    from unroller.analysis.verify_precision import ContractReport, contract_precision
    from unroller.importer.source import user_code

    precision = contract_precision(options)
    if precision is not None and tolerance != TOLERANCE:
        raise VerifyError(
            f"tolerance={tolerance:g} is the float64 check's bound; under precision="
            f"{precision.name!r} the accuracy contract decides (ours <= 2 x the error of "
            "torch's own step in that precision + a floor): leave tolerance out"
        )
    setup = _setup(text, label, dropout, precision.name if precision else "fp32")
    check_input_size(setup.graph, batch_size)
    against = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
    report: VerifyReport | ContractReport = (
        VerifyReport(label, against, tolerance)
        if precision is None
        else ContractReport(label, against, precision)
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        with user_code(against, "building or running it"):  # sys.exit in forward: exit 2
            _run(report, setup, spec, kwargs, batch_size, seed, dropout, options)
    return report


def _run(report, setup: _Setup, spec, kwargs, batch_size, seed, dropout, options=None) -> None:
    """Build both sides, check their keys, step them and compare, into ``report``: in
    float64, or under a low precision its accuracy contract (``_contract_step``: the
    original and the generated module in float32, the generated one holding the
    precision's parameters, so all sides start from the weights it holds)."""
    import torch

    from unroller.analysis.verify_precision import contract_precision, criterion

    precision = contract_precision(options)
    torch.manual_seed(seed)
    original = _in_dtype(build_original(spec, kwargs), precision)
    generated = _generated_class(setup, report.model, options)()
    if precision is None:
        generated = generated.double()
    report.problems = key_problems(original.state_dict(), generated.state_dict())
    if report.problems:
        return
    fresh = _in_dtype(build_original(spec, kwargs), precision)
    report.problems = _load_both_ways(original, generated, fresh)
    if report.problems:
        return
    if precision is not None:
        report.notes.append(criterion(precision))
    if options is not None:
        report.notes.append(options_note(options))
    if precision is not None:
        _note_setup(report, setup, fresh, "off", seed)
        inputs = make_inputs(setup.graph, batch_size, seed)
        _contract_step(report, setup, fresh, generated, inputs, precision, seed)
        return
    _note_setup(report, setup, fresh, dropout, seed)
    _float64_twins(report, fresh)
    _float64_experts(report, fresh)
    inputs = make_inputs(setup.graph, batch_size, seed)
    _step_and_compare(report, setup, fresh, generated, inputs, seed, dropout)
    require_finite(report, fresh)


def _in_dtype(module, precision):
    """The original in float64 for the float64 check, in float32 for a precision's."""
    return module.double() if precision is None else module.float()


def _contract_step(report, setup: _Setup, original, generated, inputs, precision, seed) -> None:
    """The accuracy contract's three steps (``verify_precision``) and its rows, into
    ``report``: ours (the generated step), the reference (``original`` in float64, as the
    float64 check steps it) and the peer (``original`` as torch runs it in ``precision``),
    each on the seeded ``inputs`` in its own dtype, torch's stream seeded before each."""
    import torch

    from unroller.analysis import verify_precision as vp
    from unroller.analysis.lifted_casts import LiftedCasts, lifted_note
    from unroller.importer.hf_moe import eager_experts

    ref, peer = copy.deepcopy(original).double(), vp.peer_module(original, precision)
    _float64_twins(report, ref)
    _float64_experts(report, ref)
    eager_experts(peer)  # the same arithmetic per token, as the reference's
    low = vp.side_inputs(inputs, precision)
    try:
        torch.manual_seed(seed)
        loss = generated(*low)
    except Exception as exc:  # noqa: BLE001 - a generator bug: reported, not raised
        report.problems.append(f"the generated module's step failed: {exc!r}")
        return
    lift, what = LiftedCasts(), "the reference, in float64"
    try:
        torch.manual_seed(seed)
        with attention_dropout_as_generated("off"), lift:
            ref_loss = _original_loss(ref, setup.plan, *_split_inputs(setup, inputs))
            ref_loss.backward()
        what = f"the peer, {vp.peer_text(precision)}"
        torch.manual_seed(seed)
        with attention_dropout_as_generated("off"), vp.peer_context(precision):
            peer_loss = _original_loss(peer, setup.plan, *_split_inputs(setup, low))
        peer_loss.backward()
    except Exception as exc:  # noqa: BLE001 - the user's module on the declared inputs
        report.problems.append(
            f"the original's step on inputs of the declared shapes failed ({what}): {exc!r}"
        )
        return
    compare_row = vp.PeerComparer(peer, precision, vp.largest_gradient_norm(ref))
    compare_row.add("loss", peer_loss)
    replayed = f"replayed: {setup.plan.describe()}"
    report.rows.append(compare_row("loss", loss, ref_loss, None, replayed))
    report.rows += map(vp.as_contract_row, _state_rows(ref, generated, None, compare_row))
    report.rows.append(_contract_predictions(ref, peer, generated, setup, inputs, compare_row))
    if lift.lifted:
        report.notes.append(lifted_note(lift.lifted))
    require_finite(report, ref)


def _split_inputs(setup: _Setup, inputs) -> tuple[Any, Any]:
    """(the model inputs, named, in the text's order; the tensor the loss compares with)."""
    graph = setup.graph
    model_inputs = _NamedInputs(t for t, v in zip(inputs, graph.inputs) if v.kind == "input")
    model_inputs.names = [v.name for v in graph.inputs if v.kind == "input"]
    return model_inputs, inputs[graph.inputs.index(setup.plan.other)]


def _contract_predictions(ref, peer, generated, setup, inputs, compare_row):
    """The evaluation-mode predictions' contract row (the peer's in its precision)."""
    import torch

    from unroller.analysis import verify_precision as vp
    from unroller.importer.source import call_with_inputs, predictions

    low, _ = _split_inputs(setup, vp.side_inputs(inputs, compare_row.precision))
    peer.eval()
    try:  # with autograd on, as the reference's eval forward runs
        with torch.enable_grad(), vp.peer_context(compare_row.precision):
            found = predictions(call_with_inputs(peer, low.names, low))
    except Exception as exc:  # noqa: BLE001 - the user's module in eval mode
        nan = float("nan")
        why = f"the peer's eval forward failed: {exc!r}"
        return vp.ContractRow("predictions (eval)", (), nan, nan, nan, nan, nan, False, why)
    compare_row.add("predictions (eval)", found.detach())
    model_inputs, _ = _split_inputs(setup, inputs)
    row = _prediction_row(ref, generated, model_inputs, None, compare_row, low)
    return vp.as_contract_row(row)


def _generated_class(setup: _Setup, label: str, options: Options | None) -> type:
    """The generated side: uncompressed, or as ``options`` make it, on the default platform
    (the one whose step runs on this machine's PyTorch, as verify steps it)."""
    if options is None:
        return model_class(setup.run_graph, label)
    from unroller.api import compression_config
    from unroller.compiler.options import Options as Defaults

    if options.platform != Defaults().platform:
        raise ValueError(
            f"verify: platform={options.platform!r}: verify steps the default platform's "
            f"step ({Defaults().platform!r})"
        )

    config = compression_config(options, setup.run_graph)
    return model_class(setup.run_graph, label, config, options=options)


def options_note(options: Options) -> str:
    """verify's note naming the generated side's options that differ from the defaults."""
    import dataclasses

    from unroller.compiler.options import Options as Defaults

    default = Defaults()
    changed = [
        f"{f.name}={getattr(options, f.name)!r}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != getattr(default, f.name)
    ]
    return f"the generated step was made with {', '.join(changed) or 'the default options'}"


def _float64_twins(report: VerifyReport, original) -> None:
    """Modules that compute in float32 inside whatever the input's dtype (Hugging Face's
    RMSNorm, OLMo's LayerNorm: ``unroller.importer.hf_norms``) are compared as what they
    compute without that cast: in float64 the cast would round where the generated code
    does not."""
    from unroller.importer.hf_norms import swap_float64_twins, twins_note

    swapped = swap_float64_twins(original)
    if swapped:
        report.notes.append(twins_note(original, swapped))


def _float64_experts(report: VerifyReport, original) -> None:
    """Hugging Face's mixture-of-experts blocks run their experts by ``grouped_mm`` by
    default, which takes no float64: the original steps with the eager experts instead."""
    from unroller.importer.hf_moe import eager_experts

    switched = eager_experts(original)
    if switched:
        report.notes.append(
            f"the original's experts run transformers' eager implementation, not "
            f"{', '.join(switched)} (which takes no float64): the same arithmetic per token"
        )


def require_finite(report: VerifyReport, original) -> None:
    """The original's loss and gradients on the seeded inputs are finite, or ImportFailure
    (exit 2): a network that overflows (``x * 1e300``) or divides by zero gives inf/nan,
    which no comparison can judge; the fault is the network's, not the model text's."""
    import torch

    from unroller.importer.model import ImportFailure

    loss = next((row for row in report.rows if row.name == "loss"), None)
    bad = ["loss"] if loss is not None and not math.isfinite(loss.ref_max) else []
    bad += [
        f"grad {name}"
        for name, p in original.named_parameters()
        if p.grad is not None and not torch.isfinite(p.grad).all()
    ]
    if bad:
        shown = ", ".join(bad[:4]) + (f", ... ({len(bad) - 4} more)" if len(bad) > 4 else "")
        raise ImportFailure(
            f"SPEC {report.against!r}: the original's step on seeded inputs gives inf or nan "
            f"({shown}): the network overflows or divides by zero in float64, so there is "
            "nothing to compare; fix the network"
        )


def _note_setup(report: VerifyReport, setup: _Setup, original, dropout: str, seed: int) -> None:
    found = module_dropouts(original)
    in_module = [_module_dropout_text(name, sub) for name, sub in found]
    report.notes.append(f"loss replayed on the original's predictions: {setup.plan.describe()}")
    report.notes += _dropout_notes(dropout, text_dropouts(setup.graph), in_module, seed)
    if dropout == "off":
        _switch_off(found)


def _step_and_compare(
    report: VerifyReport, setup: _Setup, original, generated, inputs, seed, dropout="seeded"
):
    """One training step on both sides, then every comparison, into ``report``."""
    import torch

    from unroller.analysis.lifted_casts import LiftedCasts, lifted_note

    plan = setup.plan
    model_inputs, other = _split_inputs(setup, inputs)
    try:
        torch.manual_seed(seed)
        loss = generated(*inputs)
    except Exception as exc:  # noqa: BLE001 - a generator bug: reported, not raised
        report.problems.append(f"the generated module's step failed: {exc!r}")
        return
    twin = copy.deepcopy(original)  # the same step on the batch given twice: rounding noise
    lift = LiftedCasts()
    try:
        torch.manual_seed(seed)
        with (
            attention_dropout_as_generated(dropout),
            stochastic_depth_as_generated(original),
            lift,
        ):
            ref_loss = _original_loss(original, plan, model_inputs, other)
            ref_loss.backward()
    except Exception as exc:  # noqa: BLE001 - the user's module on the declared inputs
        report.problems.append(
            f"the original's step on inputs of the declared shapes failed: {exc!r}"
        )
        return
    # which loss was replayed is in the table, not only in the notes: a default target
    # that is not the one meant shows here (see importer.loss.default_target)
    replayed = f"replayed: {plan.describe()}"
    report.rows.append(compare("loss", loss, ref_loss, report.tolerance, replayed))
    noise = _rounding_noise(original, twin, plan, model_inputs, other, seed)
    report.rows += _noise_checked(_state_rows(original, generated, report.tolerance), noise)
    report.rows.append(_prediction_row(original, generated, model_inputs, report.tolerance))
    if lift.lifted:
        report.notes.append(lifted_note(lift.lifted))


#: A gradient whose reference and difference are both below this fraction of the step's
#: largest gradient is rounding noise on both sides (see ``_noise_checked``).
NOISE_FRACTION = 1e-13
NOISE_NOTE = "zero in exact arithmetic"


#: A gradient whose reference does not reproduce on the doubled batch to this fraction of
#: itself is rounding noise (a real gradient reproduces to ~1e-15 of itself, noise to ~1).
NOISE_SPREAD = 1e-3


def _rounding_noise(original, twin, plan, model_inputs, other, seed) -> dict[str, float]:
    """Per parameter, max |g - g'| where g' is the original's gradient on the batch given
    twice (reversed the second time): the same value in exact arithmetic (the loss is a
    mean over the batch, batch statistics are the same), summed in another order and
    grouping, so the difference is what rounding alone does. Empty when the twin step
    fails (then no gradient passes as noise)."""
    import torch

    from unroller.analysis import lifted_casts

    if other.dim() == 0:
        return {}
    order = torch.arange(other.shape[0] - 1, -1, -1)

    def twice(t):
        return torch.cat([t, t[order]])

    try:
        torch.manual_seed(seed)
        doubled = _NamedInputs(twice(t) for t in model_inputs)
        doubled.names = model_inputs.names
        with lifted_casts.LiftedCasts():
            loss = _original_loss(twin, plan, doubled, twice(other))
            loss.backward()
    except Exception:  # noqa: BLE001 - no estimate: the strict comparison stands
        return {}
    ref = dict(original.named_parameters())
    noise = {}
    for name, p in twin.named_parameters():
        a, b = ref[name].grad, p.grad
        if a is not None and b is not None:
            noise[f"grad {name}"] = float((a.double() - b.double()).abs().max())
    return noise


def _noise_checked(rows: list[Row], noise: dict[str, float]) -> list[Row]:
    """Gradients that are zero in exact arithmetic pass when both sides are noise.

    A key projection's bias under softmax (it shifts every score of a row alike) or a
    convolution's bias before batch norm has gradient exactly 0; both sides compute it as
    rounding noise (~1e-22 where the step's gradients are ~1), whose relative difference
    means nothing and whose size depends on the CPU's summation order and vector width.
    Such a row passes when (1) its reference and (2) its difference are both below
    NOISE_FRACTION of the step's largest gradient (a scale every machine computes alike,
    ~450 units in the last place of that gradient), and (3) the reference is noise: exactly
    0, or it does not reproduce when the original's step runs on the batch given twice
    (``_rounding_noise`` differs by at least NOISE_SPREAD of it). (3) keeps a small but
    real gradient (a branch scaled by 1e-15: its doubled-batch twin agrees to ~1e-16 of it)
    compared relatively, so dropping or changing it fails; it asks only whether the noise
    is of the reference's own size, never how large this CPU's noise is."""
    grads = [row for row in rows if row.name.startswith("grad ") and row.ref_max == row.ref_max]
    scale = max((row.ref_max for row in grads), default=0.0)
    if scale <= 0.0:
        return rows
    floor = NOISE_FRACTION * scale
    out = []
    for row in rows:
        spread = noise.get(row.name, 0.0)
        is_noise = row.ref_max == 0.0 or spread >= NOISE_SPREAD * row.ref_max
        if (
            not row.ok
            and row in grads
            and row.ref_max <= floor
            and row.abs_diff <= floor
            and is_noise
        ):
            note = (
                f"{NOISE_NOTE}: the reference ({row.ref_max:.1e}, {spread:.1e} apart on the "
                f"doubled batch) and the difference ({row.abs_diff:.1e}) are below "
                f"{NOISE_FRACTION:g} x the step's largest gradient ({scale:.3e})"
            )
            row = replace(row, ok=True, note=note)
        out.append(row)
    return out


@contextlib.contextmanager
def attention_dropout_as_generated(mode: str):
    """While the original steps: ``F.scaled_dot_product_attention`` with dropout_p > 0 draws
    its mask as the generated kernel does (``seeded``: one draw of torch's random stream
    seeds a generator whose uniform draws >= p are kept; gpu.seeded_keep) and computes
    the attention by the math formula under autograd; ``off``: with dropout_p = 0, as the
    generated side then runs. torch's own kernels draw their masks otherwise, so without
    this no attention dropout could be compared."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if not dropout_p:
            return real(query, key, value, attn_mask, 0.0, is_causal, **kw)
        if mode == "off":
            return real(query, key, value, attn_mask, 0.0, is_causal, **kw)
        return reference_dropped_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            kw.get("scale"),
            kw.get("enable_gqa", False),
        )

    F.scaled_dot_product_attention = patched
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


@contextlib.contextmanager
def stochastic_depth_as_generated(module: Any):
    """While the original steps: each stochastic depth submodule (``stochastic_depth_attr``)
    in training with p > 0 draws its per-sample mask as the generated ``drop_path`` kernel
    does (one draw of torch's random stream seeds a generator, gpu.drop_path_factor) under
    autograd. Its own draw (``torch.rand`` or ``bernoulli_`` of torch's stream) is another
    stream, so without this no stochastic depth could be compared."""
    from unroller.importer.torch_nodes import stochastic_depth_attr
    from unroller.runtime.gpu import drop_path_factor, random_seed

    def reference(sub, attr):
        def forward(x, *args, **kwargs):
            p = getattr(sub, attr)
            if not sub.training or p == 0 or x.numel() == 0:
                return x
            scale = bool(getattr(sub, "scale_by_keep", True))
            return x * drop_path_factor(random_seed(), x, p, scale)

        return forward

    patched = []
    for _, sub in module.named_modules():
        attr = stochastic_depth_attr(sub)
        if attr is not None:
            patched.append((sub, sub.__dict__.get("forward")))
            sub.forward = reference(sub, attr)
    try:
        yield
    finally:
        for sub, own in patched:
            if own is None:
                del sub.forward
            else:
                sub.forward = own


def reference_dropped_attention(q, k, v, attn_mask, p, is_causal, scale, enable_gqa):
    """softmax(q k^T * scale + mask) with dropout (the generated kernel's mask) @ v, under
    autograd: the reference the generated attention dropout is compared with."""
    import torch

    from unroller.runtime.gpu import random_seed, seeded_keep

    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * softmax_scale
    if is_causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        s = (
            s.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else s + attn_mask
        )
    probs = torch.softmax(s, dim=-1)
    keep = seeded_keep(random_seed(), probs.shape, p, probs.device)
    return torch.matmul(probs * keep / (1 - p), v)


class _NamedInputs(list):
    """The model inputs of a step, in the text's order, with their declared ``names``: the
    original takes each by keyword or position as the import passed it
    (``importer.source.call_with_inputs``)."""

    names: list[str] | None = None


def _original_loss(original, plan: LossPlan, model_inputs, other):
    from unroller.importer.source import call_with_inputs, predictions

    prediction = predictions(call_with_inputs(original, model_inputs.names, model_inputs))
    want = tuple(plan.prediction.type.shape[1:])
    if tuple(prediction.shape[1:]) != want:
        raise ValueError(
            f"its prediction has shape {list(prediction.shape)}, the model text's "
            f"'{plan.prediction.name}' is [N, {', '.join(map(str, want))}]"
        )
    return replay_loss(plan, prediction, other)


def _state_rows(original, generated, tolerance, compare_row: Callable = compare) -> list:
    """A gradient row per parameter and a buffer row per buffer, by state-dict key, in the
    original's order. A missing gradient counts as zeros (what it means), and says so.
    ``compare_row``: ``compare`` or the accuracy contract's (``PeerComparer``)."""
    import torch

    params = dict(original.named_parameters(remove_duplicate=False))
    gen_params = dict(generated.named_parameters(remove_duplicate=False))
    gen_state = generated.state_dict()
    rows = []
    for key, value in original.state_dict().items():
        if key not in params and key in gen_params and not gen_params[key].requires_grad:
            # a buffer read as data is a frozen parameter there: compared as a buffer
            rows.append(compare_row(f"buffer {key}", gen_state[key], value, tolerance))
        elif key in params or key in gen_params:
            if key not in params or key not in gen_params:
                where = "the original" if key in params else "the generated module"
                nan = float("nan")
                note = f"a parameter in {where} only (a buffer on the other side)"
                rows.append(Row(f"grad {key}", tuple(value.shape), nan, nan, nan, False, note))
                continue
            ref, got = params[key].grad, gen_params[key].grad
            note = _join(
                "no gradient in the original" if ref is None else "",
                "no gradient in the generated module" if got is None else "",
            )
            zeros = torch.zeros_like(params[key])
            got, ref = (zeros if g is None else g for g in (got, ref))
            rows.append(compare_row(f"grad {key}", got, ref, tolerance, note))
        else:
            rows.append(compare_row(f"buffer {key}", gen_state[key], value, tolerance))
    return rows


def _prediction_row(
    original, generated, model_inputs, tolerance, compare_row: Callable = compare, here=None
) -> Any:
    """The evaluation-mode predictions' row; ``here``: the generated side's inputs when they
    are not ``model_inputs`` (the accuracy contract's, in the precision's dtype)."""
    import torch

    from unroller.analysis import lifted_casts
    from unroller.importer.source import call_with_inputs, predictions

    original.eval()
    nan = float("nan")
    try:  # with autograd on (nothing is stepped), so that the same casts are lifted
        with torch.enable_grad(), lifted_casts.LiftedCasts():
            ref = predictions(call_with_inputs(original, model_inputs.names, model_inputs))
        ref = ref.detach()
    except Exception as exc:  # noqa: BLE001 - the user's module in eval mode
        return Row(
            "predictions (eval)",
            (),
            nan,
            nan,
            nan,
            False,
            f"the original's eval forward failed: {exc!r}",
        )
    try:
        got = generated.predict(*(model_inputs if here is None else here))
    except Exception as exc:  # noqa: BLE001 - a generator bug: a row, not a traceback
        return Row(
            "predictions (eval)",
            tuple(ref.shape),
            nan,
            nan,
            nan,
            False,
            f"the generated predict failed: {exc!r}",
        )
    if isinstance(got, (tuple, list)):
        got = got[0]
    return compare_row("predictions (eval)", got, ref, tolerance)


def verify_module(
    module: Any,
    inputs: Any,
    target: Any = None,
    *,
    loss: str | None = None,
    name: str | None = None,
    scheme: str = "nocompress",
    options: Options | None = None,
    **kwargs: Any,
) -> VerifyReport | ContractReport:
    """One float64 step of a built torch ``module``, imported on example ``inputs`` (and
    ``target``: ``importer.api.module_text``; or a Hugging Face keyword batch with
    ``labels``, its loss the model's own: ``importer.hf_batch``), against the module itself:
    the report (``.ok``, ``.table()``). ``module``, its mode and buffers and torch's random
    state are left as they were (a copy is stepped). What ``unroller.analysis.verify(...)``
    and ``unroller.oneshot.verify`` run. Generation options are keywords as for
    ``unroller.unroll`` (``recompute_segments="blocks"``, ``segment_pieces=2``, ``scheme=``,
    ``options=``): the step checked is the one they make; the rest are ``verify_text``'s."""
    from collections.abc import Mapping

    from unroller.compiler.options import from_keywords, option_names
    from unroller.importer.api import module_text, python_words
    from unroller.stepcache import preserved

    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names()}
    if settings or options is not None or scheme != "nocompress":
        kwargs["options"] = from_keywords(options, scheme, settings, "verify")

    if isinstance(inputs, Mapping) and "labels" in inputs:
        from unroller.importer.hf_batch import batch_plan

        if target is not None:
            raise ValueError("verify: a batch with 'labels' is its own target; leave target out")
        plan = batch_plan(module, inputs["labels"])
        inputs, target = plan.split(module, inputs)
        loss = loss or plan.loss
    with preserved(module):
        text = python_words(module_text, module, inputs, target, loss or "cross_entropy", name)
        return verify_text(text, module, **kwargs)


class _CallableModule(types.ModuleType):
    """This module, callable: ``unroller.analysis.verify(module, inputs, target)`` is
    ``verify_module`` (as is ``unroller.oneshot.verify``; the package attribute ``verify``
    is this module once it is imported, so a function of that name in the package would be
    shadowed)."""

    def __call__(self, *args: Any, **kwargs: Any):
        return verify_module(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
