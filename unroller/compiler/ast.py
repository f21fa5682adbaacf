"""Typed syntax tree of a model file.

The parser (``unroller.compiler.parser``) turns Lark's parse tree into these dataclasses; the
graph builder (``unroller.compiler.graph``) turns them into a node graph. Every node keeps the
``Loc`` of the text it came from, so that any later error can point at the source.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Loc:
    """A position in the model file: 1-based line and column, and the span length."""

    line: int
    col: int
    length: int = 1


@dataclass(frozen=True)
class Const:
    """A literal keyword value: int, float, bool, str, or a tuple of values."""

    value: ConstValue
    loc: Loc


@dataclass(frozen=True)
class Ref:
    """An identifier: a value name when positional, a block parameter when a keyword value."""

    name: str
    loc: Loc


@dataclass(frozen=True)
class TupleExpr:
    """A tuple literal whose items may be block-parameter references, e.g. ``(stride, 1)``."""

    items: tuple[Expr, ...]
    loc: Loc


@dataclass(frozen=True)
class BinOp:
    """Integer arithmetic in a keyword value: ``planes * 4``, ``k // 2``, ``-pad``.

    ``op`` is one of ``+ - * //``, or ``neg`` (then ``left`` is None). The graph builder
    evaluates it once the block parameters are bound, and refuses non-integers.
    """

    op: str
    left: Expr | None
    right: Expr
    loc: Loc  # the operator (for a unary minus: the sign)


Expr = Const | Ref | TupleExpr | BinOp
ConstValue = int | float | bool | str | tuple


@dataclass(frozen=True)
class KwArg:
    name: str
    value: Expr
    loc: Loc  # location of the keyword name


@dataclass(frozen=True)
class Call:
    """``target = op(positional..., key=value...)`` inside a model or a block."""

    target: str  # dotted value name, e.g. "layer1.0"
    op: str  # operator or block name
    args: tuple[Ref, ...]
    kwargs: tuple[KwArg, ...]
    loc: Loc  # location of the statement (its target)
    op_loc: Loc  # location of the op name


@dataclass(frozen=True)
class TensorDecl:
    """``input x: f32[N, 3, 32, 32]`` or ``target y: i64[N]``."""

    kind: str  # "input" or "target"
    name: str
    dtype: str
    dims: tuple[str | int, ...]  # the first is "N"; dims as written
    loc: Loc  # location of the name
    dtype_loc: Loc
    dims_loc: tuple[Loc, ...]


@dataclass(frozen=True)
class BlockParam:
    name: str
    default: Expr | None
    loc: Loc


@dataclass(frozen=True)
class Block:
    name: str
    params: tuple[BlockParam, ...]
    body: tuple[Call, ...]
    ret: Ref
    loc: Loc  # location of the block name


@dataclass(frozen=True)
class Return:
    values: tuple[Ref, ...]
    loc: Loc  # location of the `return` keyword


@dataclass
class ModelAST:
    name: str
    decls: list[TensorDecl]
    blocks: list[Block]
    stmts: list[Call]
    ret: Return
    loc: Loc
    filename: str = "<string>"
    source: str = field(default="", repr=False)
