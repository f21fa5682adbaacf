"""What lint found and how it is shown: calls, the chains that reach them, host-only
functions, and the report's text.

Kept apart from the scanning so that ``unroll lint``'s output format is defined in one
place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .hostonly import HOST_ONLY_TAG
from .kinds import _NOT_CALLS, AUTOGRAD, DYNAMIC, IMPORT, OPS_REFERENCE, READ, SYNTAX


@dataclass(frozen=True)
class Hop:
    """One step on the way from a linted module to a call: where the next callee is named
    (``K2.clip`` in the generated module, ``_helper`` in the kernel ``clip``)."""

    file: Path
    line: int
    col: int
    name: str

    def format(self, relative_to: Path | None = None) -> str:
        return f"{_show(self.file, relative_to)}:{self.line}:{self.col} {self.name}"


@dataclass(frozen=True)
class LintCall:
    """One torch call (or torch access) found in a scanned file.

    ``line`` and ``col`` (1-based, in characters) point at the called name: ``interpolate``
    in ``F.interpolate(...)``, ``view`` in ``x.view(...)``. ``name`` is canonical
    (``torch.cos``, ``torch.nn.functional.interpolate``, ``Tensor.view``, ``torch.nn.Conv2d``,
    ``torch.ops.aten.gelu``); ``detail`` is the offending argument of a restriction
    (``mode='bilinear'``). ``warning``: allowed as far as the linter can tell, but to be
    checked by hand. ``chain``: for a call outside the linted modules, how they reach it
    (the first way found), from the linted module's line to the place the call's function is
    named; empty for calls in the linted modules themselves and for allowed calls."""

    file: Path
    line: int
    col: int
    name: str
    kind: str
    allowed: bool
    reason: str
    detail: str = ""
    warning: bool = False
    chain: tuple[Hop, ...] = ()

    @property
    def severity(self) -> str:
        return "error" if not self.allowed else "warning" if self.warning else "ok"

    @property
    def display(self) -> str:
        if self.kind == IMPORT:
            return f"import {self.name}"
        if self.kind in (SYNTAX, READ, AUTOGRAD, DYNAMIC, OPS_REFERENCE):
            return self.name
        return f"{self.name}({self.detail})"

    def format(self, device: str = "IPU", relative_to: Path | None = None) -> str:
        """One line (two with a chain: ``    chain: A -> B -> this call``)."""
        where = f"{_show(self.file, relative_to)}:{self.line}:{self.col}"
        if self.kind in (IMPORT, SYNTAX, READ):
            text = f"{where}: {self.severity}: {self.reason}"
        elif self.severity == "error":
            text = (
                f"{where}: error: {self.display} is not supported on the {device} ({self.reason})"
            )
        elif self.severity == "warning":
            text = f"{where}: warning: {self.display}: check by hand ({self.reason})"
        else:
            text = f"{where}: ok: {self.display} ({self.reason})"
        if self.chain:
            hops = [h.format(relative_to) for h in self.chain] + [f"{where} {self.name}"]
            text += "\n    chain: " + " -> ".join(hops)
        return text


@dataclass(frozen=True)
class HostOnly:
    """A function excluded from the check by the host-only marker."""

    file: Path
    line: int
    col: int
    name: str


def _show(path: Path, base: Path | None) -> str:
    base = Path.cwd() if base is None else base
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


@dataclass
class LintReport:
    """Every torch call found in ``files``; ``errors`` are the calls not supported."""

    platform: str
    device: str
    calls: list[LintCall] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    host_only: list[HostOnly] = field(default_factory=list)
    # files imported by name only (`from M import a, b`): the top-level names checked there
    partial: dict[Path, tuple[str, ...]] = field(default_factory=dict)

    @property
    def errors(self) -> list[LintCall]:
        return [c for c in self.calls if not c.allowed]

    @property
    def warnings(self) -> list[LintCall]:
        return [c for c in self.calls if c.allowed and c.warning]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def torch_calls(self) -> list[LintCall]:
        """The calls proper (not unresolved imports, syntax errors or torch.ops references)."""
        return [c for c in self.calls if c.kind not in _NOT_CALLS]

    def summary(self) -> str:
        unchecked = [e for e in self.errors if e.kind in (IMPORT, SYNTAX, READ)]
        text = (
            f"{len(self.torch_calls)} torch calls in {len(self.files)} files, "
            f"{len(self.errors) - len(unchecked)} not supported"
        )
        if unchecked:
            text += f", {len(unchecked)} modules that cannot be found, read or parsed"
        if self.warnings:
            text += f", {len(self.warnings)} to check by hand"
        if self.host_only:
            text += f"; {len(self.host_only)} host-only functions not checked"
        return text

    def format(self, verbose: bool = False, relative_to: Path | None = None) -> str:
        """Error and warning lines (all calls with ``verbose``), host-only notes, summary."""
        shown = self.calls if verbose else [c for c in self.calls if c.severity != "ok"]
        lines = [c.format(self.device, relative_to) for c in sorted(shown, key=_order)]
        lines += [
            f"{_show(h.file, relative_to)}:{h.line}:{h.col}: note: {h.name} is host-only "
            f"({HOST_ONLY_TAG}): not checked"
            for h in self.host_only
        ]
        lines += [
            (
                f"{_show(path, relative_to)}: note: imported by name: only {', '.join(names)} "
                "and what they use were checked"
                if names
                else f"{_show(path, relative_to)}: note: only its statements that run at import "
                "were checked"
            )
            for path, names in self.partial.items()
        ]
        lines.append(self.summary())
        return "\n".join(lines)


def _order(c: LintCall) -> tuple:
    return (str(c.file), c.line, c.col, c.name)
