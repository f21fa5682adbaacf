"""The step IR: the statements of a generated method as values, rendered to text last.

An argument is what it stands for (a tensor variable, a layer handle, a constant, a
name defined by the module), not text, so liveness asks each statement which variables
it reads and writes instead of parsing lines, and the only place Python source is made
is ``render_*`` below, from validated identifiers and ``repr()``'d literals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from unroller.compiler import safe
from unroller.compiler.dtypes import TORCH_DTYPE_NAMES
from unroller.compiler.graph import BlockCall


@dataclass(frozen=True)
class Var:
    """A local variable of the generated method (an activation, gradient, packed form)."""

    name: str


@dataclass(frozen=True)
class Layer:
    """The module holding one node's parameters and buffers: ``L["layer1.0.conv1"]``; with a
    ``dtype`` (a mixed precision's low-dtype op), its view with the float parameters in that
    dtype, cast once per step: ``L.cast("layer1.0.conv1", torch.bfloat16)``."""

    path: str
    dtype: str = ""


@dataclass(frozen=True)
class Const:
    """A literal: int, float, bool, str, None, or tuples and lists of them."""

    value: Any


@dataclass(frozen=True)
class ModelName:
    """A model name as a string (a stash key, a layer name): block-relative inside a
    block function, where the scoped ``stash`` and ``L`` add the instance's prefix."""

    name: str


@dataclass(frozen=True)
class Global:
    """A name the module defines or imports (``CODEC_DCT``, ``torch.bool``, ``K``)."""

    dotted: str


@dataclass(frozen=True)
class Attr:
    """An attribute of a variable (``grad_x.dtype``)."""

    var: Var
    name: str


@dataclass(frozen=True)
class CallExpr:
    """``func(*args, **kwargs)``; ``func`` is a module-level name (``K.conv2d``).
    ``defaults``: keyword arguments left out because they equal the registry default (not
    rendered): instances of a block that differ in one share a function that takes it as a
    parameter (``unroller.compiler.outline``)."""

    func: Global | Attr
    args: tuple[Expr, ...] = ()
    kwargs: tuple[tuple[str, Expr], ...] = ()
    defaults: tuple[tuple[str, Expr], ...] = ()


@dataclass(frozen=True)
class TupleExpr:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class ListExpr:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class DictExpr:
    items: tuple[tuple[str, Expr], ...]  # str keys, rendered as literals


@dataclass(frozen=True)
class Starred:
    """``*value`` as an argument: a call's results passed as several arguments."""

    value: CallExpr


Expr = (
    Var | Layer | Const | ModelName | Global | Attr | CallExpr | TupleExpr | ListExpr | DictExpr
) | Starred


@dataclass(frozen=True)
class Assign:
    """``a, b = expr``; a None target is ``_``; ``unpack`` makes one target ``(a,) = ``."""

    targets: tuple[Var | None, ...]
    value: Expr
    unpack: bool = False


@dataclass(frozen=True)
class AddTo:
    """``total += part`` (in place), ``total = total + part`` (``total`` may alias), or with
    ``into_part`` ``total = part.add_(total)`` (``total`` may alias, ``part`` is a new tensor
    of the step's own: no third full-size tensor; addition commutes, so the same bits)."""

    total: Var
    part: Var
    in_place: bool
    into_part: bool = False


@dataclass(frozen=True)
class Do:
    """An expression evaluated for its effect (``K.accumulate(...)``)."""

    value: Expr


@dataclass(frozen=True)
class RecordRaw:
    """``K.stash_raw(stash, {key: tensor, ...})`` for tensors kept as they are, rendered as
    a few calls of about one line each rather than one dict entry per line."""

    log: Var
    items: tuple[tuple[ModelName, Var], ...]


@dataclass(frozen=True)
class Yield:
    """``a, b = yield (x, y)``: a pipeline stage hands its boundary values to the driver
    (``unroller.parallel.pipeline``) and is resumed with their gradients."""

    targets: tuple[Var | None, ...]
    values: tuple[Var, ...]


@dataclass(frozen=True)
class Return:
    """``return (a, b)``: a pipeline stage's last statement, the gradients of what it
    received (None where no gradient flows)."""

    values: tuple[Expr, ...]


Statement = Assign | AddTo | Do | RecordRaw | Yield | Return

RECOMPUTE_SECTION = "recompute"
"""The section of a segment's recompute steps (its forward again, in the backward): a run
of its own for the outliner, rendered inside the backward."""

ACCUMULATORS = ("K.accumulate", "K.accumulate_fresh")
"""The calls that add parameter gradients into ``.grad`` (``Platform.grads == "accumulate"``)."""


def called_name(expr: Any) -> str:
    """The dotted name a statement's call calls (``K.accumulate``); "" for anything else."""
    return expr.func.dotted if isinstance(expr, CallExpr) and isinstance(expr.func, Global) else ""


@dataclass
class Step:
    """The statements of one model statement (or gradient seed, stash, restore)."""

    section: str  # "forward" or "backward"
    statements: list[Statement]
    comment: str = ""  # the model statement, shown above the code
    calls: tuple[BlockCall, ...] = ()  # enclosing block calls, outermost first
    local_comment: str = ""  # the comment inside a block function (block-relative names)
    stage: int = 0  # pipeline stage (device) the step runs on
    release: list[str] = field(default_factory=list)  # variables dead after this step

    def reads(self) -> list[str]:
        return [name for name, kind in self.events() if kind == "r"]

    def writes(self) -> list[str]:
        return [name for name, kind in self.events() if kind == "w"]

    def text(self) -> list[str]:
        """The statements as Python lines (no comments, no releases)."""
        return [line for s in self.statements for line in render_statement(s).split("\n")]

    def events(self) -> list[tuple[str, str]]:
        """(variable, "r" or "w") in execution order; ``total += part`` reads, then writes."""
        found: list[tuple[str, str]] = []
        for statement in self.statements:
            if isinstance(statement, AddTo):
                found += [(statement.total.name, "r"), (statement.part.name, "r")]
                found.append((statement.total.name, "w"))
            elif isinstance(statement, RecordRaw):
                found += [(statement.log.name, "r"), *((v.name, "r") for _, v in statement.items)]
            elif isinstance(statement, Yield):
                found += [(v.name, "r") for v in statement.values]
                found += [(t.name, "w") for t in statement.targets if t is not None]
            elif isinstance(statement, Return):
                found += [(name, "r") for v in statement.values for name in _vars(v)]
            else:
                found += [(name, "r") for name in _vars(statement.value)]
                if isinstance(statement, Assign):
                    found += [(t.name, "w") for t in statement.targets if t is not None]
        return found


def _vars(expr: Expr) -> list[str]:
    if isinstance(expr, Var):
        return [expr.name]
    if isinstance(expr, Attr):
        return [expr.var.name]
    if isinstance(expr, CallExpr):
        found = _vars(expr.func) + [name for arg in expr.args for name in _vars(arg)]
        return found + [name for _, arg in expr.kwargs for name in _vars(arg)]
    if isinstance(expr, (TupleExpr, ListExpr)):
        return [name for item in expr.items for name in _vars(item)]
    if isinstance(expr, DictExpr):
        return [name for _, item in expr.items for name in _vars(item)]
    if isinstance(expr, Starred):
        return _vars(expr.value)
    return []


def walk(expr: Expr) -> Iterator[Expr]:
    """``expr`` and every expression inside it (arguments, items, keyword values)."""
    yield expr
    if isinstance(expr, CallExpr):
        for inner in (expr.func, *expr.args, *(v for _, v in expr.kwargs)):
            yield from walk(inner)
    elif isinstance(expr, (TupleExpr, ListExpr)):
        for inner in expr.items:
            yield from walk(inner)
    elif isinstance(expr, DictExpr):
        for _, inner in expr.items:
            yield from walk(inner)
    elif isinstance(expr, Starred):
        yield from walk(expr.value)


def release_dead(steps: list[Step], keep: set[str]) -> None:
    """After each step, release what no later step reads (except ``keep``).

    Liveness is per definition: a name written again (the per-parameter gradient
    temporaries ``grad_weight``, reused by every layer) is released after the last read of
    each value it holds, so the allocator can reuse that memory before the next kernel
    runs. A value last read by the step that writes the name again needs no release: the
    new binding frees it (``grad_a = block_backward(..., grad_a)``).
    """
    last_read: dict[str, int] = {}  # the step of the last read of the name's current value
    order: dict[str, int] = {}
    dying: dict[int, list[str]] = {}
    for i, step in enumerate(steps):
        for name, kind in step.events():
            order.setdefault(name, len(order))
            if kind == "w" and name in last_read and last_read[name] < i and name not in keep:
                dying.setdefault(last_read[name], []).append(name)
            last_read[name] = i
    for name, last in last_read.items():
        if name not in keep:
            dying.setdefault(last, []).append(name)
    for i, step in enumerate(steps):
        step.release = sorted(dict.fromkeys(dying.get(i, [])), key=order.__getitem__)


# -- rendering ---------------------------------------------------------------------------

LAYERS = "L"  # the generated method's dict of layer handles (K.layers(self))


def render_expr(expr: Expr) -> str:
    if isinstance(expr, Var):
        return safe.identifier(expr.name)
    if isinstance(expr, Layer):
        if expr.dtype:
            dtype = safe.dotted(f"torch.{TORCH_DTYPE_NAMES[expr.dtype]}")
            return f"{LAYERS}.cast({safe.literal(expr.path)}, {dtype})"
        return f"{LAYERS}[{safe.literal(expr.path)}]"
    if isinstance(expr, Const):
        return safe.literal(expr.value)
    if isinstance(expr, ModelName):
        return safe.literal(expr.name)
    if isinstance(expr, Global):
        return safe.dotted(expr.dotted)
    if isinstance(expr, Attr):
        return f"{safe.identifier(expr.var.name)}.{safe.identifier(expr.name)}"
    if isinstance(expr, CallExpr):
        parts = [render_expr(a) for a in expr.args]
        parts += [f"{safe.identifier(k)}={render_expr(v)}" for k, v in expr.kwargs]
        return f"{render_expr(expr.func)}({', '.join(parts)})"
    if isinstance(expr, TupleExpr):
        items = [render_expr(i) for i in expr.items]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"  # () if none
    if isinstance(expr, ListExpr):
        return "[" + ", ".join(render_expr(i) for i in expr.items) + "]"
    if isinstance(expr, DictExpr):
        return "{" + ", ".join(f"{safe.literal(k)}: {render_expr(v)}" for k, v in expr.items) + "}"
    if isinstance(expr, Starred):
        return f"*{render_expr(expr.value)}"
    raise TypeError(f"not an IR expression: {expr!r}")


RECORD_WIDTH = 100  # what one K.stash_raw line may take, indent not counted
RELEASE_WIDTH = 96  # what the names of one `del` line in a method may take


def render_statement(statement: Statement) -> str:
    """One statement as Python (``RecordRaw`` may take several lines)."""
    if isinstance(statement, Assign):
        names = [safe.identifier(t.name) if t is not None else "_" for t in statement.targets]
        targets = f"({names[0]},)" if statement.unpack else ", ".join(names)
        return f"{targets} = {render_expr(statement.value)}"
    if isinstance(statement, AddTo):
        total, part = safe.identifier(statement.total.name), safe.identifier(statement.part.name)
        if statement.in_place:
            return f"{total} += {part}"
        return (
            f"{total} = {part}.add_({total})"
            if statement.into_part
            else f"{total} = {total} + {part}"
        )
    if isinstance(statement, Do):
        return render_expr(statement.value)
    if isinstance(statement, Yield):
        names = [safe.identifier(t.name) if t is not None else "_" for t in statement.targets]
        return f"({', '.join(names)},) = yield {render_expr(TupleExpr(statement.values))}"
    if isinstance(statement, Return):
        return f"return {render_expr(TupleExpr(statement.values))}"
    if isinstance(statement, RecordRaw):
        log = safe.identifier(statement.log.name)
        calls: list[str] = []
        chunk: list[str] = []
        for key, var in statement.items:
            item = f"{safe.literal(key.name)}: {safe.identifier(var.name)}"
            if chunk and len(f"K.stash_raw({log}, {{{', '.join([*chunk, item])}}})") > RECORD_WIDTH:
                calls.append(f"K.stash_raw({log}, {{{', '.join(chunk)}}})")
                chunk = []
            chunk.append(item)
        calls.append(f"K.stash_raw({log}, {{{', '.join(chunk)}}})")
        return "\n".join(calls)
    raise TypeError(f"not an IR statement: {statement!r}")


def render_steps(
    steps: list[Step],
    stage_block: str | None = None,
    block_text: Callable[[BlockCall], str] = lambda call: call.text,
    depth: int = 0,
) -> list[safe.Code]:
    """Lines of a method body: block and statement comments, code, and releases.

    With ``stage_block`` (a format string with {section} and {stage}), consecutive steps
    of one pipeline stage go inside that ``with`` statement, so the platform places
    them on that stage's device. Inside a block function (``depth`` 1) the outermost
    block is the function itself: comments start below it and use the block's names.
    """
    lines: list[str] = []
    current: tuple[BlockCall, ...] = ()
    section = ""
    stage = None
    indent = ""
    for step in steps:
        calls = step.calls[depth:]
        if depth == 0 and (step.section != section or (stage_block and step.stage != stage)):
            if step.section != section:
                section = step.section
                lines.append("")
                lines.append(f"# ---- {section} " + "-" * 60)
            if stage_block:
                stage = step.stage
                lines.append(stage_block.format(section=section, stage=stage))
                indent = "    "
            current = ()
        start = len(lines)
        if calls != current:
            common = 0
            while common < min(len(calls), len(current)) and calls[common] is current[common]:
                common += 1
            for level, call in enumerate(calls[common:], start=common):
                lines.append(f"# {'  ' * level}[block] {safe.comment_text(block_text(call))}")
            current = calls
        comment = step.local_comment if depth and step.local_comment else step.comment
        if comment:
            lines.append(f"# {'  ' * len(calls)}{safe.comment_text(comment)}")
        lines.extend(line for s in step.statements for line in render_statement(s).split("\n"))
        names = [safe.identifier(name) for name in step.release]
        width = RELEASE_WIDTH + (12 if depth else 0)  # a function body is indented less
        while names:  # lines of a few names each rather than black's one name per line
            count = 1
            while count < len(names) and len(", ".join(names[: count + 1])) <= width:
                count += 1
            lines.append(f"del {', '.join(names[:count])}")
            names = names[count:]
        lines[start:] = [indent + line if line else line for line in lines[start:]]
    return [safe.Code(line) for line in lines]
