"""What a front end hands to ``emit``: the imported network as typed statements.

A statement is one registry operator call, named by the module path that produced it
(``layer1.0.conv1``: its parameters get the state-dict keys ``layer1.0.conv1.weight``,
...). ``module_path`` is where in the module tree the call happened, which may be the
parent of the name (a functional ``add`` in ``layer1.0`` is named ``layer1.0.add``);
``classes`` maps every module path to its class, which ``emit`` uses to recover blocks
and to write comments naming the source.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


class BatchDim(str):
    """The symbolic batch dim ``N`` (in shapes, and in an ``expand`` size)."""

    __slots__ = ()


#: The batch dim: equal to "N", and written as N (not "N") in keyword values.
BATCH = BatchDim("N")
#: The example batch size used for capture: > 1 so export keeps the dim symbolic.
EXAMPLE_BATCH = 3

#: A keyword value as the model language writes it (None: left out).
Literal = int | float | bool | str | tuple | None

_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")


def shape_text(shape) -> str:
    """A shape as messages write it, ``[N, 8]``: the batch as N (a size derived from it
    as ``?2*N``), never the example batch the capture ran with."""
    return "[" + ", ".join(str(d).lstrip("?") for d in shape) + "]"


@dataclass
class Stmt:
    """``name = op(args..., kwargs...)``: one registry operator call."""

    name: str
    op: str
    args: list[str]
    kwargs: dict[str, Literal] = field(default_factory=dict)
    module_path: str = ""
    shape: tuple[int | str, ...] | None = None  # the output's shape, "N" for the batch


@dataclass
class Tensor:
    """A declared input or target: ``NAME: DTYPE[N, dims...]``."""

    name: str
    dtype: str  # "f32", "i64", ...
    dims: tuple[int, ...]  # after N

    def text(self) -> str:
        return f"{self.dtype}[{', '.join(['N', *map(str, self.dims)])}]"


@dataclass
class ImportedModel:
    """An imported network: inputs, statements in execution order, predictions, loss."""

    name: str
    source: str  # what was imported (SPEC as given), for the header comment
    inputs: list[Tensor]
    targets: list[Tensor]
    stmts: list[Stmt]
    predictions: list[str]  # value names the model returns after the loss
    loss: str | None = None  # the loss statement's name (added by ``add_loss``)
    classes: dict[str, str] = field(default_factory=dict)  # module path -> class
    notes: list[str] = field(default_factory=list)  # header lines (how it was captured)

    def producer(self) -> dict[str, Stmt]:
        return {stmt.name: stmt for stmt in self.stmts}


@dataclass
class Unmapped:
    """One node that has no exact registry equivalent."""

    op: str  # "aten.unfold.default", "onnx::Resize", "torch.nn.LSTM"
    module_path: str  # where in the module tree ("" = the root module)
    module_class: str = ""
    location: str = ""  # source file:line if known
    reason: str = ""

    def line(self) -> str:
        """One line; every field cleaned (class names, ONNX op types and file paths are
        the user's or a third party's: no newline or escape sequence reaches the terminal)."""
        where = _clean(self.module_path) or "<root>"
        if self.module_class:
            where += f" ({_clean(self.module_class)})"
        text = f"{where}: {_clean(self.op)}"
        if self.reason:
            text += f": {_clean(self.reason)}"
        if self.location:
            text += f" [{_clean(self.location)}]"
        return text


def _clean(text: str, limit: int = 300) -> str:
    """Printable characters only, on one line."""
    cleaned = " ".join("".join(ch if ch.isprintable() else " " for ch in str(text)).split())
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


class ImportFailure(Exception):
    """The network cannot be imported; ``unmapped`` lists every node at fault, or
    ``message`` says what else went wrong (a SPEC that does not load, an input spec)."""

    def __init__(self, message: str, unmapped: list[Unmapped] | None = None):
        self.unmapped = list(unmapped or [])
        self.message = message
        super().__init__(self.format())

    def format(self) -> str:
        if not self.unmapped:
            return _clean(self.message, 2000)
        lines = [f"{_clean(self.message, 2000)} ({len(self.unmapped)} unmapped):"]
        lines += [f"  {item.line()}" for item in self.unmapped]
        return "\n".join(lines)


def valid_path(name: str) -> bool:
    """Whether a dotted module path can be a statement name: parts are identifiers or
    integers without leading zeros (``features.0``, or ``0.weight``'s ``0`` of a root
    nn.Sequential)."""
    return all(
        _PART.fullmatch(part) and (not part.isdigit() or part == str(int(part)))
        for part in name.split(".")
    )


#: Input spec form: ``x: f32[N, 3, 224, 224]``.
_INPUT = re.compile(
    r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([a-z0-9]+)\s*\[\s*N\s*((?:,\s*\d+\s*)*)\]\s*"
)
DTYPES = ("f32", "f64", "f16", "bf16", "i64", "i32", "bool")
#: Bounds on a declared input, checked before anything is allocated or traced: the spec's
#: length, its dims after N (2,000 dims once kept torch.export busy for minutes), and its
#: elements per sample (the capture makes example inputs of a few samples).
MAX_SPEC_CHARS = 1000
MAX_INPUT_DIMS = 8
MAX_INPUT_ELEMENTS = 2**26


def parse_tensor_spec(text: str, what: str = "--input") -> Tensor:
    """``NAME: DTYPE[N, d1, ...]`` as a Tensor; ImportFailure with the expected form."""
    if len(text) > MAX_SPEC_CHARS:
        raise ImportFailure(
            f"{what}: {len(text):,} characters, more than the limit of {MAX_SPEC_CHARS:,}"
        )
    match = _INPUT.fullmatch(text)
    if not match or match.group(2) not in DTYPES:
        raise ImportFailure(
            f"{what} {text!r}: expected NAME: DTYPE[N, d1, ...] with DTYPE one of "
            f"{', '.join(DTYPES)} (e.g. \"x: f32[N, 3, 224, 224]\")"
        )
    dims = tuple(int(d) for d in re.findall(r"\d+", match.group(3)))
    if any(d <= 0 or d > 2**31 for d in dims):
        raise ImportFailure(f"{what} {text!r}: dims after N must be positive integers")
    if len(dims) > MAX_INPUT_DIMS:
        raise ImportFailure(
            f"{what} {match.group(1)!r}: {len(dims)} dims after N, more than the limit of "
            f"{MAX_INPUT_DIMS}"
        )
    check_elements([Tensor(match.group(1), match.group(2), dims)], what)
    return Tensor(match.group(1), match.group(2), dims)


def check_elements(tensors: list[Tensor], what: str = "--input") -> None:
    """The declared tensors together hold at most MAX_INPUT_ELEMENTS per sample."""
    total = sum(math.prod(t.dims) for t in tensors)
    if total > MAX_INPUT_ELEMENTS:
        names = ", ".join(repr(t.name) for t in tensors[:4])
        raise ImportFailure(
            f"{what} {names}: {total:,} elements per sample, more than the limit of "
            f"{MAX_INPUT_ELEMENTS:,} (2**26)"
        )
