"""The step program: forward and unrolled backward as a list of steps, with liveness.

A ``Step`` is one statement of the model (or one gradient seed) turned into lines of
Python, plus the identifiers those lines read and write. ``release_dead`` walks the
program once and attaches to every step the identifiers whose last use it is, so the
generated code drops each activation, saved tensor and gradient as soon as nothing
later needs it. Identifiers come from a ``Namer`` that turns model names (dotted,
possibly Python keywords) into unique, valid Python names.
"""

from __future__ import annotations

import builtins
import keyword
import re
from dataclasses import dataclass, field

# Names the generated modules (every platform's template) use themselves, and every
# builtin (a template may call any of them, e.g. ``sum``): model names never take them.
# tests/test_reserved_names.py checks this against every name each template emits.
TEMPLATE_NAMES = frozenset(
    {
        "self", "torch", "sys", "K", "P", "C", "Model", "stash", "grads", "poptorch",
        "surrogate", "run_main", "terms", "total", "NUM_IPUS", "INPUTS", "_",
    }
)  # fmt: skip
RESERVED = TEMPLATE_NAMES | frozenset(dir(builtins)) | frozenset(keyword.kwlist)
# Families the emitter numbers as it goes: kernel module aliases (K2, K3, ...) and codecs.
_RESERVED_PATTERN = re.compile(r"(K[0-9]+|CODEC_\w*)$")


class Namer:
    """Unique Python identifiers for model values, in a deterministic order."""

    def __init__(self, reserved: frozenset[str] = RESERVED):
        self.taken: set[str] = set(reserved)
        self.by_key: dict[str, str] = {}

    def __call__(self, key: str, base: str | None = None) -> str:
        """The identifier for ``key`` (a model name or a derived name like ``grad:x``)."""
        if key in self.by_key:
            return self.by_key[key]
        base = (base or key).replace(".", "_")
        if not base.isidentifier():
            base = "v_" + "".join(c if c.isalnum() or c == "_" else "_" for c in base)
        if keyword.iskeyword(base) or keyword.issoftkeyword(base) or _RESERVED_PATTERN.match(base):
            base += "_"
        ident, n = base, 1
        while ident in self.taken:
            n += 1
            ident = f"{base}_{n}"
        self.taken.add(ident)
        self.by_key[key] = ident
        return ident


@dataclass
class Step:
    """Lines of code for one model statement, in the forward or backward section."""

    section: str  # "forward" or "backward"
    lines: list[str]
    reads: list[str]
    writes: list[str]
    comment: str = ""  # the model statement, shown above the lines
    blocks: tuple[str, ...] = ()  # enclosing block calls, outermost first
    stage: int = 0  # pipeline stage (IPU) the step runs on
    release: list[str] = field(default_factory=list)


def release_dead(steps: list[Step], keep: set[str]) -> None:
    """After each step, release what no later step reads (except ``keep``)."""
    last_use: dict[str, int] = {}
    order: dict[str, int] = {}
    for i, step in enumerate(steps):
        for ident in step.writes:
            order.setdefault(ident, len(order))
            last_use.setdefault(ident, i)
        for ident in step.reads:
            order.setdefault(ident, len(order))
            last_use[ident] = i
    dying: dict[int, list[str]] = {}
    for ident, last in last_use.items():
        if ident not in keep:
            dying.setdefault(last, []).append(ident)
    for i, step in enumerate(steps):
        step.release = sorted(dying.get(i, []), key=order.__getitem__)
