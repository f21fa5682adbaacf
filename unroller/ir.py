"""The step IR: the statements of a generated method as values, rendered to text last.

An argument is what it stands for (a tensor variable, a layer handle, a constant, a
name defined by the module), not text, so liveness asks each statement which variables
it reads and writes instead of parsing lines, and the only place Python source is made
is ``render_*`` below, from validated identifiers and ``repr()``'d literals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unroller import safe


@dataclass(frozen=True)
class Var:
    """A local variable of the generated method (an activation, gradient, packed form)."""

    name: str


@dataclass(frozen=True)
class Layer:
    """The module holding one node's parameters and buffers: ``L["layer1.0.conv1"]``."""

    path: str


@dataclass(frozen=True)
class Const:
    """A literal: int, float, bool, str, None, or tuples and lists of them."""

    value: Any


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
    """``func(*args, **kwargs)``; ``func`` is a module-level name (``K.conv2d``)."""

    func: Global
    args: tuple[Expr, ...] = ()
    kwargs: tuple[tuple[str, Expr], ...] = ()


@dataclass(frozen=True)
class TupleExpr:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class DictExpr:
    items: tuple[tuple[str, Expr], ...]  # str keys, rendered as literals


Expr = Var | Layer | Const | Global | Attr | CallExpr | TupleExpr | DictExpr


@dataclass(frozen=True)
class Assign:
    """``a, b = expr``; a None target is ``_``; ``unpack`` makes one target ``(a,) = ``."""

    targets: tuple[Var | None, ...]
    value: Expr
    unpack: bool = False


@dataclass(frozen=True)
class AddTo:
    """``total += part`` (in place) or ``total = total + part`` (``total`` may alias)."""

    total: Var
    part: Var
    in_place: bool


@dataclass(frozen=True)
class Do:
    """An expression evaluated for its effect (``K.accumulate(...)``)."""

    value: Expr


Statement = Assign | AddTo | Do


@dataclass
class Step:
    """The statements of one model statement (or gradient seed, stash, restore)."""

    section: str  # "forward" or "backward"
    statements: list[Statement]
    comment: str = ""  # the model statement, shown above the code
    blocks: tuple[str, ...] = ()  # enclosing block calls, outermost first
    stage: int = 0  # pipeline stage (device) the step runs on
    release: list[str] = field(default_factory=list)  # variables dead after this step

    def reads(self) -> list[str]:
        found: list[str] = []
        for statement in self.statements:
            if isinstance(statement, AddTo):
                found += [statement.total.name, statement.part.name]
            else:
                found += _vars(statement.value)
        return found

    def writes(self) -> list[str]:
        found: list[str] = []
        for statement in self.statements:
            if isinstance(statement, Assign):
                found += [t.name for t in statement.targets if t is not None]
        return found


def _vars(expr: Expr) -> list[str]:
    if isinstance(expr, Var):
        return [expr.name]
    if isinstance(expr, Attr):
        return [expr.var.name]
    if isinstance(expr, CallExpr):
        found = [name for arg in expr.args for name in _vars(arg)]
        return found + [name for _, arg in expr.kwargs for name in _vars(arg)]
    if isinstance(expr, TupleExpr):
        return [name for item in expr.items for name in _vars(item)]
    if isinstance(expr, DictExpr):
        return [name for _, item in expr.items for name in _vars(item)]
    return []


def release_dead(steps: list[Step], keep: set[str]) -> None:
    """After each step, release what no later step reads (except ``keep``)."""
    last_use: dict[str, int] = {}
    order: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.writes():
            order.setdefault(name, len(order))
            last_use.setdefault(name, i)
        for name in step.reads():
            order.setdefault(name, len(order))
            last_use[name] = i
    dying: dict[int, list[str]] = {}
    for name, last in last_use.items():
        if name not in keep:
            dying.setdefault(last, []).append(name)
    for i, step in enumerate(steps):
        step.release = sorted(dying.get(i, []), key=order.__getitem__)


# -- rendering ---------------------------------------------------------------------------

LAYERS = "L"  # the generated method's dict of layer handles (K.layers(self))


def render_expr(expr: Expr) -> str:
    if isinstance(expr, Var):
        return safe.identifier(expr.name)
    if isinstance(expr, Layer):
        return f"{LAYERS}[{safe.literal(expr.path)}]"
    if isinstance(expr, Const):
        return safe.literal(expr.value)
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
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(expr, DictExpr):
        return "{" + ", ".join(f"{safe.literal(k)}: {render_expr(v)}" for k, v in expr.items) + "}"
    raise TypeError(f"not an IR expression: {expr!r}")


def render_statement(statement: Statement) -> str:
    if isinstance(statement, Assign):
        names = [safe.identifier(t.name) if t is not None else "_" for t in statement.targets]
        targets = f"({names[0]},)" if statement.unpack else ", ".join(names)
        return f"{targets} = {render_expr(statement.value)}"
    if isinstance(statement, AddTo):
        total, part = safe.identifier(statement.total.name), safe.identifier(statement.part.name)
        return f"{total} += {part}" if statement.in_place else f"{total} = {total} + {part}"
    if isinstance(statement, Do):
        return render_expr(statement.value)
    raise TypeError(f"not an IR statement: {statement!r}")


def render_steps(steps: list[Step], stage_block: str | None = None) -> list[safe.Code]:
    """Lines of a method body: block and statement comments, code, and releases.

    With ``stage_block`` (a format string with {section} and {stage}), consecutive steps
    of one pipeline stage go inside that ``with`` statement, so the platform places
    them on that stage's device.
    """
    lines: list[str] = []
    current_blocks: tuple[str, ...] = ()
    section = ""
    stage = None
    indent = ""
    for step in steps:
        if step.section != section or (stage_block and step.stage != stage):
            if step.section != section:
                section = step.section
                lines.append("")
                lines.append(f"# ---- {section} " + "-" * 60)
            if stage_block:
                stage = step.stage
                lines.append(stage_block.format(section=section, stage=stage))
                indent = "    "
            current_blocks = ()
        start = len(lines)
        if step.blocks != current_blocks:
            common = 0
            while (
                common < min(len(step.blocks), len(current_blocks))
                and step.blocks[common] == current_blocks[common]
            ):
                common += 1
            for depth, text in enumerate(step.blocks[common:], start=common):
                lines.append(f"# {'  ' * depth}[block] {safe.comment_text(text)}")
            current_blocks = step.blocks
        if step.comment:
            prefix = "  " * len(step.blocks)
            lines.append(f"# {prefix}{safe.comment_text(step.comment)}")
        lines.extend(render_statement(s) for s in step.statements)
        if step.release:
            lines.append(f"del {', '.join(safe.identifier(name) for name in step.release)}")
        lines[start:] = [indent + line if line else line for line in lines[start:]]
    return [safe.Code(line) for line in lines]
