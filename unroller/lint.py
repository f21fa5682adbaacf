"""Static check that generated code calls only operations its platform supports.

``lint_module(path)`` reads a generated module with :mod:`ast` (nothing is imported or run),
follows its imports into the kernel modules it calls (``unroller.runtime.<platform>``,
``unroller.compress``, and modules of operators added through ``UNROLLER_OPS``) and whatever
those import in turn, and lists every torch call it finds, each checked against the platform's
list of supported operations, ``unroller/<platform>_supported.toml`` (for ``ipu``: PopTorch's
list). An unsupported call reached through imports is reported at its own file and line, with
the chain that reaches it: the line of the linted module that names the kernel, then each
helper named on the way (``gen.py:57:17 K2.clip -> kern.py:5:12 _h -> kern.py:9:12
torch.ops.aten.hardtanh``).

What counts as a torch call (import aliases resolved per module: ``import torch as T``,
``import torch.nn.functional as F``, ``from torch import nn``, ``from torch import ops``,
``from torch.nn import functional as F``, ``from torch.nn.functional import pad``,
``from torch.ops import aten``, ``__import__("torch")``, ``importlib.import_module("torch")``,
and simple assignments such as ``_aten = torch.ops.aten``):

* ``torch.X(...)``, ``torch.linalg.X(...)``, ``torch.nn.functional.X(...)`` / ``F.X(...)``;
* ``torch.nn.X(...)``: a module constructor, allowed if the list names the module, with its
  argument restrictions (``MaxPool2d(return_indices=True)`` is an error);
* ``<expr>.X(...)`` where ``X`` is a ``torch.Tensor`` method (at lint time) and the receiver
  is not an imported module, ``self``/``cls``, ``super()``, a str/list/dict/tuple/set literal
  or a parameter annotated as one of those (``s: str`` makes ``s.split(",")`` no call).
  Names that are also str/list/dict/set methods (``split``, ``index``, ``sort``, ``values``,
  ``add``) are counted as tensor calls when they are on the list anyway; otherwise they are
  warnings ("unknown receiver, check by hand"), never errors;
* ``torch.ops.aten.X``, ``torch.ops.aten.X.default`` (and any ``torch.ops`` access) anywhere:
  always an error;
* a torch function or ``torch.nn`` module class named without being called (``acts =
  {"erf": torch.erf}``, ``F.gelu`` passed as an argument): checked as a call to it, since it
  may be called later through a variable (a restricted one, whose arguments are then unseen,
  is a warning); ``isinstance``/``issubclass``/``except`` class arguments and annotations do
  not count;
* a tensor method taken as a bound method (``f = x.erf``, ``getattr(x, "erf")``) on a
  receiver that may be a tensor: data attributes of other objects share these names
  (``device.type``), so only a name the platform does not support is reported, as a warning;
* ``getattr(torch..., "name")`` with a string literal is checked as the call it names;
  ``getattr(torch..., name)`` with anything else is an error (cannot be checked);
* a class derived from ``torch.autograd.Function``: an error (PopTorch has no custom
  backward).

Dynamic calls the linter cannot resolve are never passed silently. ``getattr`` with a
non-literal name on a torch object is an error (above); on a followed module (``getattr(K2,
name)``) all of that module is checked and the access is a warning; on any other object it is
a warning (it may yield a torch function or tensor method). ``__import__``/``importlib.
import_module`` with a non-literal name is a warning; so are ``eval``/``exec`` and a torch
module passed on as a value (``run(torch.nn.functional, x)``; assigning it to a name, ``F2 =
torch.nn.functional``, is an alias and followed). Calls through variables, containers and parameters (``fn(x)``,
``table[k](x)``) are not reported by themselves: every torch function or tensor method that
can end up in such a variable is reported where the code names it (the reference rules
above), and every function of a followed module that the checked code names is checked.

Argument restrictions (interpolate's mode, conv_transpose dilation, max_pool return_indices,
topk sorted, ...) are checked when the value is a literal in the call; a value the linter
cannot see is a warning.

Which code counts: all of the module linted. Its imports are resolved by name as Python
would at run time, without importing anything (the finders of ``sys.meta_path``, with the
linted module's folder first on ``sys.path``, as when it runs as a script; the folders of the
``UNROLLER_OPS`` registry files are searched last), and followed:

* modules of the ``unroller`` package (the package roots): all of a module imported as a
  module (``import unroller.runtime.ipu as K``, ``from unroller import compress``), whether
  or not it is reached at run time; from a module whose names are imported (``from
  unroller.runtime.gpu import accumulate, tensors``) only the top-level statements defining
  those names count, with the top-level definitions they use, transitively, and the top-level
  statements that bind nothing (they run at import); a name that is not bound at the top
  level makes the whole module count;
* any other module whose source is not part of Python or an installed library (stdlib,
  site-packages), or whose top-level package is named as kernels by the operator registry
  (user operator modules, their helpers, ``import X as K2``): only what the checked code
  names in it (``K2.clip``, ``getattr(K2, "clip")``, ``from X import clip``) counts, with
  what that uses, transitively, as for names imported from the package; a module used other
  than through a constant attribute (passed around, ``getattr`` with a variable) counts whole;
* ``torch``, ``poptorch`` (installed or not), the standard library and installed
  third-party libraries (``numpy``) are not followed.

A followed module that cannot be found, is not a Python source file (a compiled extension),
cannot be read or parsed, is not a regular file, is larger than ``MAX_SOURCE_BYTES`` or is not
text in its declared encoding (UTF-8 by default) is an error; so is an entry that cannot be
read. An import of a non-package module that cannot be found but is never used is a warning.
``importlib.import_module("literal")`` is not followed (the runtime uses it for PopTorch and
its emulation, on the host).

Excluded everywhere: the bodies of functions marked host-only (and, in a module checked in
part, the definitions only they use). The marker is a comment ``# unroller-lint: host-only``
on the function's ``def`` line (or any line of its header, up to the colon), or the text
``unroller-lint: host-only`` in its docstring. Use it only for code that runs on the host,
outside the traced graph (parameter bookkeeping, stash accounting, the runner). The report
lists every function excluded this way.

Not checked: Python operators on tensors (``a + b``, ``a @ b``, ``a >> 1``), builtins applied
to tensors (``abs(t)``, ``sum(ts)``), slice bounds, dtypes, torch classes named without being
called (other than ``torch.nn`` modules), and the values generated code passes to the
kernels. Parent packages of an imported module (``unroller/__init__.py``) are not scanned
unless imported by name.

Each module is read and parsed once per run, however many linted modules import it.
``unroll lint`` is a thin wrapper: ``report = lint_paths(paths, platform)``, print
``report.format()``, exit 1 unless ``report.ok``.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import functools
import importlib
import importlib.machinery
import inspect
import io
import os
import re
import site
import stat
import sys
import sysconfig
import tokenize
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "HOST_ONLY_TAG",
    "MAX_SOURCE_BYTES",
    "Hop",
    "HostOnly",
    "LintCall",
    "LintReport",
    "SupportedOps",
    "lint_module",
    "lint_paths",
    "supported_ops",
    "supported_ops_path",
]

HOST_ONLY_TAG = "unroller-lint: host-only"
_HOST_ONLY_RE = re.compile(r"#\s*unroller-lint:\s*host-only\b")
_PACKAGE_DIR = Path(__file__).resolve().parent
_DEFAULT_ROOTS = {"unroller": _PACKAGE_DIR}

# Call kinds, as LintCall.kind.
TORCH, FUNCTIONAL, TENSOR, MODULE = "torch", "functional", "tensor", "module"
ATEN, OPS, DYNAMIC, AUTOGRAD = "aten", "ops", "dynamic", "autograd"
OPS_REFERENCE = "ops-reference"  # torch.ops used other than by calling: `_aten = torch.ops.aten`
IMPORT, SYNTAX, READ = "import", "syntax", "read"
_NOT_CALLS = (IMPORT, SYNTAX, READ, OPS_REFERENCE)

MAX_SOURCE_BYTES = 16 * 1024 * 1024  # the most lint reads of one module

_NO_DEFAULT = object()
_UNKNOWN = object()

# Receivers that are certainly not tensors: literals, displays, comprehensions, f-strings.
_NON_TENSOR_NODES = (
    ast.JoinedStr,
    ast.List,
    ast.Tuple,
    ast.Dict,
    ast.Set,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
_NON_TENSOR_BUILTINS = frozenset(
    {"str", "bytes", "list", "dict", "tuple", "set", "frozenset", "sorted", "repr", "format"}
)
_BUILTIN_TYPES = (str, bytes, list, dict, tuple, set, frozenset, int, float)


def _public_routines(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and inspect.isroutine(getattr(cls, n))}


@functools.lru_cache(maxsize=1)
def _tensor_methods() -> tuple[frozenset[str], frozenset[str]]:
    """(torch.Tensor's public methods, those that are also str/list/dict/... methods)."""
    methods = _public_routines(torch.Tensor)
    container = set().union(*(_public_routines(t) for t in _BUILTIN_TYPES))
    return frozenset(methods), frozenset(methods & container)


# ---------------------------------------------------------------- the supported list


@dataclass(frozen=True)
class Restriction:
    """One argument restriction of ``[[restriction]]`` in the supported list."""

    calls: tuple[str, ...]
    reason: str
    arg: str = ""
    position: int | None = None
    allowed: tuple[Any, ...] | None = None
    forbidden: tuple[Any, ...] | None = None
    none_only: bool = False
    required: bool = False
    manual: bool = False
    default: Any = _NO_DEFAULT


@dataclass
class SupportedOps:
    """A platform's supported list, read from ``unroller/<platform>_supported.toml``.

    ``names[kind]`` maps each allowed name of a kind (torch, functional, tensor, module) to the
    reason it is allowed; ``listed[kind]`` holds the names the source document lists (with
    their group's title), the only ones whose in-place spelling ``X_`` is derived."""

    platform: str
    device: str
    source: str
    names: dict[str, dict[str, str]]
    listed: dict[str, dict[str, str]]
    restrictions: dict[str, list[Restriction]]
    inplace_variants: bool = True

    @property
    def not_listed(self) -> str:
        return f"not in the {self.source}"

    def lookup(self, kind: str, name: str) -> tuple[bool, str]:
        """(allowed, reason) for ``name`` of ``kind``."""
        reason = self.names[kind].get(name)
        if reason is not None:
            return True, reason
        if self.inplace_variants and name.endswith("_") and not name.endswith("__"):
            stem = name[:-1]
            title = self.listed[kind].get(stem)
            if title is not None:
                return True, f"in-place form of {_canonical(kind, stem)}, listed: {title}"
        return False, self.not_listed

    @classmethod
    def from_toml(cls, path: Path) -> SupportedOps:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        plat = data.get("platform", {})
        kinds = (TORCH, FUNCTIONAL, TENSOR, MODULE)
        names: dict[str, dict[str, str]] = {k: {} for k in kinds}
        listed: dict[str, dict[str, str]] = {k: {} for k in kinds}
        for group, spec in data.get("groups", {}).items():
            title = spec.get("title", group)
            for key, targets in (
                ("torch", (TORCH,)),
                ("functional", (FUNCTIONAL,)),
                ("tensor", (TENSOR,)),
                ("both", (TORCH, TENSOR)),
            ):
                for name in spec.get(key, []):
                    for kind in targets:
                        listed[kind].setdefault(name, title)
                        names[kind].setdefault(name, f"listed: {title}")
        for module, fn in data.get("nn", {}).items():
            via = f" (as torch.nn.functional.{fn})" if fn else ""
            listed[MODULE].setdefault(module, "torch.nn")
            names[MODULE].setdefault(module, f"listed torch.nn module{via}")
        extra = data.get("extra", {})
        for key, kind in (
            ("torch", TORCH),
            ("functional", FUNCTIONAL),
            ("tensor", TENSOR),
            ("nn", MODULE),
        ):
            for name, why in extra.get(key, {}).items():
                names[kind].setdefault(name, why)
        restrictions: dict[str, list[Restriction]] = {}
        for spec in data.get("restriction", []):
            r = Restriction(
                calls=tuple(spec["calls"]),
                reason=spec["reason"],
                arg=spec.get("arg", ""),
                position=spec.get("position"),
                allowed=tuple(spec["allowed"]) if "allowed" in spec else None,
                forbidden=tuple(spec["forbidden"]) if "forbidden" in spec else None,
                none_only=bool(spec.get("none_only", False)),
                required=bool(spec.get("required", False)),
                manual=bool(spec.get("manual", False)),
                default=spec.get("default", _NO_DEFAULT),
            )
            for call in r.calls:
                restrictions.setdefault(call, []).append(r)
        return cls(
            platform=plat.get("name", path.stem),
            device=plat.get("device", plat.get("name", path.stem)),
            source=plat.get("source", "supported list"),
            names=names,
            listed=listed,
            restrictions=restrictions,
            inplace_variants=bool(data.get("rules", {}).get("inplace_variants", True)),
        )


def supported_ops_path(platform: str) -> Path:
    """``unroller/<platform>_supported.toml``."""
    return _PACKAGE_DIR / f"{platform}_supported.toml"


@functools.cache
def supported_ops(platform: str = "ipu") -> SupportedOps:
    """The supported list of ``platform`` (ValueError if the platform has none)."""
    path = supported_ops_path(platform)
    if not path.is_file():
        have = sorted(
            p.name.removesuffix("_supported.toml") for p in _PACKAGE_DIR.glob("*_supported.toml")
        )
        raise ValueError(
            f"no list of supported operations for platform {platform!r} "
            f"(expected {path.name}); platforms with one: {', '.join(have) or 'none'}"
        )
    return SupportedOps.from_toml(path)


def _canonical(kind: str, name: str) -> str:
    return {
        TORCH: "torch.",
        FUNCTIONAL: "torch.nn.functional.",
        TENSOR: "Tensor.",
        MODULE: "torch.nn.",
    }.get(kind, "") + name


# ---------------------------------------------------------------- report


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

    def to_dict(self) -> dict:
        """A JSON-ready form (for ``unroll lint --json``)."""
        return {
            "platform": self.platform,
            "ok": self.ok,
            "summary": self.summary(),
            "files": [str(f) for f in self.files],
            "calls": [
                {
                    "file": str(c.file),
                    "line": c.line,
                    "col": c.col,
                    "name": c.name,
                    "kind": c.kind,
                    "allowed": c.allowed,
                    "severity": c.severity,
                    "reason": c.reason,
                    "detail": c.detail,
                    "chain": [
                        {"file": str(h.file), "line": h.line, "col": h.col, "name": h.name}
                        for h in c.chain
                    ],
                }
                for c in self.calls
            ],
            "host_only": [
                {"file": str(h.file), "line": h.line, "col": h.col, "name": h.name}
                for h in self.host_only
            ],
            "partial": {str(path): list(names) for path, names in self.partial.items()},
        }


def _order(c: LintCall) -> tuple:
    return (str(c.file), c.line, c.col, c.name)


# ---------------------------------------------------------------- one module

# How an import resolves (_Found.kind).
_ROOT, _USER, _LIBRARY, _MISSING, _UNREADABLE = "root", "user", "library", "missing", "unreadable"
_UNUSED = ""  # _Import.name of a module imported and never used by the checked code


@dataclass(frozen=True)
class _Found:
    """Where an imported module's source is, and whether it is followed."""

    kind: str
    path: Path | None = None  # None for a namespace package (no source of its own)
    module: str = ""
    is_package: bool = False
    why: str = ""  # for _MISSING and _UNREADABLE
    root: bool = False  # under the package roots


@dataclass(frozen=True)
class _Import:
    """A module the checked code imports: the name it uses in it (None: all of it;
    _UNUSED: none), and where (the import, or the use that names it)."""

    module: str
    name: str | None
    line: int
    col: int
    text: str
    found: _Found


@dataclass
class _Scan:
    calls: list[LintCall]
    host_only: list[HostOnly]
    imports: list[_Import]
    selection: frozenset[str] | None  # the top-level names checked, None: the whole module
    # (first line, last line) of each top-level statement, and why each selected one counts:
    # ("name", NAME) asked for from outside, ("use", STMT, NAME, LINE, COL) named by statement
    # STMT, ("import-time",) it binds nothing; None: the whole module counts
    spans: list[tuple[int, int]] = field(default_factory=list)
    reasons: dict[int, tuple] | None = None


class _ModuleScanner:
    """Finds the torch calls of one source file."""

    def __init__(
        self,
        path: Path,
        source: str,
        module: str | None,
        is_package: bool,
        ops: SupportedOps,
        roots: dict[str, Path],
        selection: frozenset[str] | None = None,
        resolve: Callable[[str], _Found] | None = None,
    ) -> None:
        self.path = path
        self.selection = selection
        self.source = source
        self.module = module
        self.is_package = is_package
        self.ops = ops
        self.roots = roots
        self.resolve = resolve or (
            lambda m: _find_in_roots(m, roots) if m.split(".")[0] in roots else _Found(_LIBRARY)
        )
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.calls: list[LintCall] = []
        self.host_only: list[HostOnly] = []
        self.imports: list[_Import] = []
        self.aliases: dict[str, str] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.consumed: set[int] = set()
        self.name_uses: dict[str, list[ast.Name]] = {}
        self.tensor_methods, self.ambiguous = _tensor_methods()

    # positions -------------------------------------------------------------------------

    def _col(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="replace")) + 1

    def _name_pos(self, node: ast.AST) -> tuple[int, int]:
        """Where the called name starts: the attribute of ``a.b.name``, else the node."""
        if isinstance(node, ast.Attribute) and node.end_lineno is not None:
            start = (node.end_col_offset or 0) - len(node.attr.encode("utf-8"))
            return node.end_lineno, self._col(node.end_lineno, start)
        return node.lineno, self._col(node.lineno, node.col_offset)

    def _add(
        self,
        node: ast.AST,
        name: str,
        kind: str,
        allowed: bool,
        reason: str,
        detail: str = "",
        warning: bool = False,
        at_start: bool = False,
    ) -> None:
        if at_start:
            line, col = node.lineno, self._col(node.lineno, node.col_offset)
        else:
            line, col = self._name_pos(node)
        self.calls.append(
            LintCall(self.path, line, col, name, kind, allowed, reason, detail, warning)
        )

    # names -----------------------------------------------------------------------------

    def _absolute(self, module: str | None, level: int) -> str | None:
        if level == 0:
            return module
        if self.module is None:
            return None
        parts = self.module.split(".")
        if not self.is_package:
            parts = parts[:-1]
        if level > 1:
            parts = parts[: len(parts) - (level - 1)]
        if not parts:
            return None
        return ".".join(parts + ([module] if module else []))

    def _qual(self, node: ast.AST) -> str | None:
        """The dotted name an expression stands for, through the aliases, or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._qual(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            return self._imported_by_call(node)
        return None

    def _imported_by_call(self, node: ast.Call) -> str | None:
        """``__import__("torch")`` -> torch, ``importlib.import_module("torch.nn")`` ->
        torch.nn (string literals only)."""
        if not node.args or not isinstance(node.args[0], ast.Constant):
            return None
        name = node.args[0].value
        if not isinstance(name, str) or not name or name.startswith("."):
            return None
        func = node.func
        if isinstance(func, ast.Name) and func.id == "__import__" and func.id not in self.aliases:
            fromlist = node.args[3] if len(node.args) > 3 else None
            for kw in node.keywords:
                if kw.arg == "fromlist":
                    fromlist = kw.value
            leaf = fromlist is not None and _literal(fromlist) not in (None, (), [])
            return name if leaf else name.split(".")[0]
        if self._qual(func) == "importlib.import_module":
            return name
        return None

    def _collect_aliases(self, nodes: list[ast.AST]) -> None:
        assigns: list[ast.Assign | ast.AnnAssign] = []
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                if base is not None:
                    for a in node.names:
                        if a.name != "*":
                            self.aliases[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                assigns.append(node)
        # simple assignments that rename a torch object: `_aten = torch.ops.aten`
        for _ in range(3):
            changed = False
            for node in assigns:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                q = self._qual(node.value)  # type: ignore[arg-type]
                if q and _is_torch(q):
                    for t in targets:
                        if isinstance(t, ast.Name) and self.aliases.get(t.id) != q:
                            self.aliases[t.id] = q
                            changed = True
            if not changed:
                break

    # imports ---------------------------------------------------------------------------

    def _imports(self, nodes: Iterable[ast.AST]) -> None:
        """The modules the checked code imports and what it uses of each (self.imports), and
        its torch imports that are errors by themselves (star imports, torch.ops)."""
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._import_module(a.name, a.asname or a.name.split(".")[0], node)
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)

    def _import_from(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module, node.level)
        if base is None:
            shown = "." * node.level + (node.module or "")
            found = _Found(
                _MISSING,
                why=f"cannot resolve the relative import 'from {shown} import ...': "
                "this module is not part of a package",
            )
            for a in node.names:
                self._unfollowed(shown, a.asname or a.name, node, found)
            return
        if _is_torch(base):
            if any(a.name == "*" for a in node.names):
                self._add(
                    node,
                    f"from {base} import *",
                    DYNAMIC,
                    False,
                    "a star import hides which torch names are called",
                )
            if base == "torch.ops" or base.startswith("torch.ops."):
                for a in node.names:
                    q = f"{base}.{a.name}"
                    self._add(node, q, OPS_REFERENCE, False, _ops_reason(q))
            return
        if base == "__future__":
            return
        found = self.resolve(base)
        if found.kind == _LIBRARY:
            return
        for a in node.names:
            local = a.asname or a.name
            if found.kind in (_MISSING, _UNREADABLE):
                self._unfollowed(base, local, node, found)
                continue
            if a.name == "*":
                self._record(base, None, node, f"from {base} import *", found)
                continue
            sub = f"{base}.{a.name}"
            sub_found = self.resolve(sub) if found.is_package else _Found(_MISSING)
            if sub_found.kind in (_ROOT, _USER, _UNREADABLE):  # a submodule
                self._import_module(sub, local, node, sub_found)
            else:
                self._record(base, a.name, node, f"from {base} import {a.name}", found)

    def _import_module(
        self, module: str, local: str, node: ast.stmt, found: _Found | None = None
    ) -> None:
        """``import module as local`` (or ``from package import module as local``)."""
        if _is_torch(module) or module == "__future__":
            return
        found = found or self.resolve(module)
        if found.kind == _LIBRARY:
            return
        text = ast.unparse(node)
        if found.kind in (_MISSING, _UNREADABLE):
            self._unfollowed(module, local, node, found)
        elif found.kind == _ROOT:
            self._record(module, None, node, text, found)  # package modules count whole
        else:
            uses = self._module_uses(module, local)
            if not uses:
                self._record(module, _UNUSED, node, text, found)
            for name, where, shown in uses:
                self._record(module, name, where, shown, found)

    def _module_uses(self, module: str, local: str) -> list[tuple[str | None, ast.AST, str]]:
        """(name used, where, how) for each use of the module bound to ``local`` in the
        checked code: ``K2.clip`` and ``getattr(K2, "clip")`` use clip; anything else (the
        module passed around, getattr with a variable) uses all of it (None)."""
        uses: list[tuple[str | None, ast.AST, str]] = []
        for name_node in self.name_uses.get(local, ()):
            outer: ast.AST = name_node
            while isinstance(parent := self.parents.get(outer), ast.Attribute):
                outer = parent
            q = self._qual(outer)
            if q is None:
                continue
            if q.startswith(module + "."):
                uses.append((q[len(module) + 1 :].split(".")[0], outer, ast.unparse(outer)))
                continue
            if q != module and not module.startswith(q + "."):
                continue  # another module under the same top-level package
            parent = self.parents.get(outer)
            if (
                isinstance(parent, ast.Call)
                and isinstance(parent.func, ast.Name)
                and parent.func.id == "getattr"
                and len(parent.args) >= 2
                and parent.args[0] is outer
            ):
                attr = parent.args[1]
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                    uses.append((attr.value, parent, ast.unparse(parent)))
                    continue
                self._add(
                    parent.func,
                    f"getattr({ast.unparse(outer)}, {ast.unparse(attr)})",
                    DYNAMIC,
                    True,
                    f"dynamic access to module {module}: all of it was checked",
                    warning=True,
                )
            uses.append((None, outer, ast.unparse(outer)))
        return uses

    def _record(
        self, module: str, name: str | None, node: ast.AST, text: str, found: _Found
    ) -> None:
        line = node.lineno  # type: ignore[attr-defined]
        col = self._col(line, node.col_offset)  # type: ignore[attr-defined]
        self.imports.append(_Import(module, name, line, col, text, found))

    def _unfollowed(self, module: str, local: str, node: ast.stmt, found: _Found) -> None:
        """An import that cannot be followed: an error where the checked code uses what it
        binds, else a warning."""
        used = found.root or bool(self.name_uses.get(local))
        self._record(module, None if used else _UNUSED, node, ast.unparse(node), found)

    # host-only ------------------------------------------------------------------------

    def _tokens(self) -> list[tokenize.TokenInfo]:
        try:
            return list(tokenize.generate_tokens(io.StringIO(self.source).readline))
        except (tokenize.TokenError, SyntaxError):  # pragma: no cover - ast parsed it
            return []

    def _host_only_marks(self) -> tuple[set[int], dict[int, int]]:
        """(lines with a host-only comment, def line -> line of the colon ending its header)."""
        if "host-only" not in self.source:  # no marker anywhere: skip tokenizing
            return set(), {}
        tokens = self._tokens()
        marked = {
            t.start[0]
            for t in tokens
            if t.type == tokenize.COMMENT and _HOST_ONLY_RE.search(t.string)
        }
        header_end: dict[int, int] = {}
        for i, t in enumerate(tokens):
            if t.type == tokenize.NAME and t.string == "def":
                depth = 0
                for u in tokens[i + 1 :]:
                    if u.type == tokenize.OP and u.string in ("(", "[", "{"):
                        depth += 1
                    elif u.type == tokenize.OP and u.string in (")", "]", "}"):
                        depth -= 1
                    elif u.type == tokenize.OP and u.string == ":" and depth == 0:
                        header_end.setdefault(t.start[0], u.start[0])
                        break
        return marked, header_end

    def _is_host_only(
        self,
        node: ast.FunctionDef | ast.AsyncFunctionDef,
        marks: tuple[set[int], dict[int, int]],
    ) -> bool:
        marked, header_end = marks
        last = header_end.get(node.lineno, node.lineno)
        if any(node.lineno <= ln <= last for ln in marked):
            return True
        doc = ast.get_docstring(node, clean=False)
        return bool(doc and HOST_ONLY_TAG in doc)

    def _walk(
        self, node: ast.AST, marks: tuple[set[int], dict[int, int]], scope: tuple[str, ...]
    ) -> Iterator[ast.AST]:
        """ast.walk that skips host-only functions (recording them)."""
        for child in ast.iter_child_nodes(node):
            self.parents[child] = node
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if self._is_host_only(child, marks):
                    self.host_only.append(
                        HostOnly(
                            self.path,
                            child.lineno,
                            self._col(child.lineno, child.col_offset),
                            ".".join((*scope, child.name)),
                        )
                    )
                    continue
                inner = (*scope, child.name)
            elif isinstance(child, ast.ClassDef):
                inner = (*scope, child.name)
            yield child
            yield from self._walk(child, marks, inner)

    # the scan --------------------------------------------------------------------------

    def scan(self) -> _Scan:
        try:
            return self._scan()
        except RecursionError:
            self.calls = [
                LintCall(
                    self.path,
                    1,
                    1,
                    "too deeply nested",
                    SYNTAX,
                    False,
                    "the code is nested too deeply to be checked (Python cannot compile it "
                    "either)",
                )
            ]
            return _Scan(self.calls, [], [], None)

    def _scan(self) -> _Scan:
        try:
            tree = ast.parse(self.source, filename=str(self.path))
        except (SyntaxError, ValueError, MemoryError) as exc:
            msg = exc.msg if isinstance(exc, SyntaxError) else str(exc) or type(exc).__name__
            line = getattr(exc, "lineno", None) or 1
            self.calls.append(
                LintCall(
                    self.path,
                    line,
                    getattr(exc, "offset", None) or 1,
                    "syntax error",
                    SYNTAX,
                    False,
                    f"syntax error: {msg}: the file cannot be checked",
                )
            )
            return _Scan(self.calls, self.host_only, self.imports, None)
        every = list(ast.walk(tree))
        self._collect_aliases(every)
        marks = self._host_only_marks()
        spans = [_span(stmt) for stmt in tree.body]
        body: list[ast.stmt] = tree.body
        reasons: dict[int, tuple] | None = None
        if self.selection is not None:
            picked = _select(tree.body, self.selection, lambda f: self._is_host_only(f, marks))
            if picked is None:  # a name not bound at the top level: check the whole module
                self.selection = None
            else:
                reasons = {
                    i: (*r[:4], self._col(r[3], r[4])) if r[0] == "use" else r
                    for i, r in picked.items()
                }
                body = [stmt for i, stmt in enumerate(tree.body) if i in picked]
        checked = ast.Module(body=body, type_ignores=[])
        nodes = list(self._walk(checked, marks, ()))
        for node in nodes:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                self.name_uses.setdefault(node.id, []).append(node)
            elif isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
                self._mark_consumed(node.annotation)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
                self._mark_consumed(node.returns)
        self._imports(every if reasons is None else ast.walk(checked))
        for node in nodes:
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.ClassDef):
                self._class(node)
        for node in nodes:
            if isinstance(node, (ast.Attribute, ast.Name)):
                self._reference(node)
        self.calls.sort(key=lambda c: (c.line, c.col))
        return _Scan(self.calls, self.host_only, self.imports, self.selection, spans, reasons)

    def _class(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            q = self._qual(base)
            if q in ("torch.autograd.Function", "torch.autograd.function.Function"):
                self._add(
                    base,
                    "subclass of torch.autograd.Function",
                    AUTOGRAD,
                    False,
                    "torch.autograd.Function with a custom backward is not there",
                    at_start=True,
                )
                self._mark_consumed(base)

    def _reference(self, node: ast.Attribute | ast.Name) -> None:
        """A torch object named other than by calling it: ``torch.ops`` anywhere (an error),
        a torch function or torch.nn module (checked as a call to it: it may be called
        through a variable), a tensor method taken as a bound method (``f = x.erf``)."""
        if id(node) in self.consumed or isinstance(node.ctx, (ast.Store, ast.Del)):
            return
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute):
            return  # the outermost attribute of the chain reports
        if isinstance(parent, ast.Call) and parent.func is node:
            return  # reported as a call
        q = self._qual(node)
        if q is None:
            if isinstance(node, ast.Attribute):
                self._method_reference(node, node.attr, node.value)
            return
        if not _is_torch(q):
            return
        if q == "torch.ops" or q.startswith("torch.ops."):
            self._add(node, q, OPS_REFERENCE, False, _ops_reason(q))
            return
        kind, short = _classify(q)
        obj = _torch_object(q)
        if isinstance(obj, type):
            if not (
                issubclass(obj, torch.nn.Module)
                and obj is not torch.nn.Module
                and kind == MODULE
                and not self._type_test(node)
            ):
                return
        elif isinstance(obj, type(torch)):
            if isinstance(parent, (ast.Assign, ast.AnnAssign)) and all(
                isinstance(t, ast.Name)
                for t in (parent.targets if isinstance(parent, ast.Assign) else [parent.target])
            ):
                return  # `F2 = torch.nn.functional`: an alias, followed like an import
            self._add(
                node,
                q,
                DYNAMIC,
                True,
                "a torch module used as a value: what is called through it elsewhere cannot "
                "be checked",
                warning=True,
            )
            return
        elif obj is _UNKNOWN or not callable(obj):
            return
        self._check_reference(node, kind, short)

    def _type_test(self, node: ast.AST) -> bool:
        """``node`` is (in) the class argument of isinstance/issubclass, or an except type."""
        parent = self.parents.get(node)
        while isinstance(parent, ast.Tuple):
            node, parent = parent, self.parents.get(parent)
        if isinstance(parent, ast.ExceptHandler):
            return True
        return (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id in ("isinstance", "issubclass")
            and node is not parent.func
        )

    def _method_reference(self, node: ast.AST, name: str, receiver: ast.AST) -> None:
        """``receiver.name`` taken without a call (or ``getattr(receiver, "name")``): if the
        receiver is a tensor, a bound method that may be called through a variable. Data
        attributes of other objects share these names (``device.type``, ``cfg.norm``), so
        only a name the platform does not support is reported, as a warning."""
        if name.startswith("_") or name not in self.tensor_methods:
            return
        if self._not_a_tensor(receiver) or self._annotated_not_tensor(receiver, strict=False):
            return
        allowed, reason = self.ops.lookup(TENSOR, name)
        if not allowed:
            self._add(
                node,
                _canonical(TENSOR, name),
                TENSOR,
                True,
                f"named without a call on an object of unknown type: if it is a tensor, "
                f"the method may be called through a variable and it is {reason}",
                warning=True,
            )

    def _check_reference(self, node: ast.AST, kind: str, short: str) -> None:
        canonical = _canonical(kind, short)
        allowed, reason = self.ops.lookup(kind, short)
        how = "named without a call (it may be called through a variable)"
        if allowed and self.ops.restrictions.get(canonical):
            args = ", ".join(_uniq(r.arg for r in self.ops.restrictions[canonical] if r.arg))
            self._add(
                node,
                canonical,
                kind,
                True,
                f"{how}: its arguments ({args or 'restricted'}) cannot be checked",
                warning=True,
            )
            return
        self._add(node, canonical, kind, allowed, f"{reason}; {how}")

    def _call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and "getattr" not in self.aliases:
            self._getattr(node)
            return
        q = self._qual(func)
        if q is not None:
            if _is_torch(q):
                self._torch_call(node, func, q)
            elif q == "importlib.import_module":
                self._dynamic_import(node)
            return  # a function of some other module (K.conv2d, math.prod, C.make)
        if isinstance(func, ast.Name) and func.id == "__import__" and func.id not in self.aliases:
            self._dynamic_import(node)
        elif (
            isinstance(func, ast.Name)
            and func.id in ("eval", "exec")
            and func.id not in self.aliases
        ):
            self._add(
                func,
                f"{func.id}(...)",
                DYNAMIC,
                True,
                "code run from a string cannot be checked",
                warning=True,
            )
        elif isinstance(func, ast.Attribute):
            self._method_call(node, func)

    def _dynamic_import(self, node: ast.Call) -> None:
        if self._imported_by_call(node) is None:
            self._add(
                node.func,
                f"{ast.unparse(node.func)}({', '.join(ast.unparse(a) for a in node.args)})",
                DYNAMIC,
                True,
                "a module imported by a computed name cannot be checked",
                warning=True,
            )

    def _getattr(self, node: ast.Call) -> None:
        if len(node.args) < 2:
            return
        receiver, name = node.args[0], node.args[1]
        target = self._qual(receiver)
        literal = name.value if isinstance(name, ast.Constant) else None
        if target and _is_torch(target):
            self._mark_consumed(receiver)
            if isinstance(literal, str):
                kind, short = _classify(f"{target}.{literal}")
                self._check(node, func_node=node.func, kind=kind, short=short, call=None)
            else:
                self._add(
                    node.func,
                    f"getattr({target}, {ast.unparse(name)})",
                    DYNAMIC,
                    False,
                    "dynamic access to torch cannot be checked",
                )
            return
        if target is not None:
            return  # a followed module (see _module_uses) or another module's object
        if isinstance(literal, str):
            self._method_reference(node.func, literal, receiver)
            return
        if _certainly_not_tensor(receiver):
            return
        self._add(
            node.func,
            f"getattr({ast.unparse(receiver)}, {ast.unparse(name)})",
            DYNAMIC,
            True,
            "an attribute got by a computed name: if it is a torch function or tensor "
            "method, that cannot be checked",
            warning=True,
        )

    def _mark_consumed(self, node: ast.AST) -> None:
        for sub in ast.walk(node):
            self.consumed.add(id(sub))

    def _torch_call(self, node: ast.Call, func: ast.AST, q: str) -> None:
        kind, short = _classify(q)
        self._check(
            node,
            func_node=func,
            kind=kind,
            short=short,
            call=node,
            offset=1 if q.startswith("torch.Tensor.") else 0,
        )

    def _not_a_tensor(self, receiver: ast.AST) -> bool:
        """Receivers that are certainly no tensor: self/cls, super(), literals, displays,
        parameters annotated str/list/dict/..."""
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            return True
        if _certainly_not_tensor(receiver) or self._annotated_not_tensor(receiver):
            return True
        return (
            isinstance(receiver, ast.Call)
            and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super"
        )

    def _method_call(self, node: ast.Call, func: ast.Attribute) -> None:
        name = func.attr
        if name.startswith("_") or name not in self.tensor_methods:
            return
        if self._not_a_tensor(func.value):
            return
        if name in self.ambiguous:
            allowed, reason = self.ops.lookup(TENSOR, name)
            if allowed:
                note = f"; receiver not known, .{name}() is also a str/list/dict/set method"
                self._check(node, func_node=func, kind=TENSOR, short=name, call=node, note=note)
            else:
                self._add(
                    func,
                    _canonical(TENSOR, name),
                    TENSOR,
                    True,
                    f"unknown receiver: .{name}() is also a str/list/dict/set method; "
                    f"as a tensor method it is {reason}",
                    warning=True,
                )
            return
        self._check(node, func_node=func, kind=TENSOR, short=name, call=node)

    def _annotated_not_tensor(self, receiver: ast.AST, strict: bool = True) -> bool:
        """A parameter of the enclosing function annotated str, list, dict, tuple or set
        (``strict=False``: annotated with anything that does not mention Tensor)."""
        if not isinstance(receiver, ast.Name):
            return False
        node: ast.AST | None = receiver
        while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = self.parents.get(node)
        if node is None:
            return False
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg == receiver.id:
                if not strict and arg.annotation is not None:
                    return "Tensor" not in ast.unparse(arg.annotation)
                return _non_tensor_annotation(arg.annotation)
        return False

    def _check(
        self,
        node: ast.Call,
        func_node: ast.AST,
        kind: str,
        short: str,
        call: ast.Call | None,
        offset: int = 0,
        note: str = "",
    ) -> None:
        if kind in (ATEN, OPS):
            self._add(func_node, short, kind, False, _ops_reason(short))
            return
        canonical = _canonical(kind, short)
        allowed, reason = self.ops.lookup(kind, short)
        if not allowed or call is None:
            self._add(func_node, canonical, kind, allowed, reason)
            return
        errors: list[tuple[str, str]] = []
        warnings: list[tuple[str, str]] = []
        for r in self.ops.restrictions.get(canonical, []):
            verdict = _check_restriction(r, call, offset)
            if verdict is not None:
                (errors if verdict[0] == "error" else warnings).append(verdict[1:])
        if errors:
            self._add(
                func_node,
                canonical,
                kind,
                False,
                "; ".join(_uniq(w for _, w in errors)),
                detail=", ".join(d for d, _ in errors if d),
            )
        elif warnings:
            self._add(
                func_node,
                canonical,
                kind,
                True,
                "; ".join(_uniq(w for _, w in warnings)),
                detail=", ".join(d for d, _ in warnings if d),
                warning=True,
            )
        else:
            self._add(func_node, canonical, kind, True, reason + note)


def _non_tensor_annotation(ann: ast.AST | None) -> bool:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a string annotation
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(ann, ast.Subscript):
        ann = ann.value
    if isinstance(ann, ast.Attribute):  # typing.List
        ann = ast.Name(ann.attr)
    return isinstance(ann, ast.Name) and ann.id.lower() in _NON_TENSOR_BUILTINS


def _bound_names(stmt: ast.stmt) -> set[str]:
    """The names a top-level statement binds in its module."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(a.asname or a.name.split(".")[0] for a in node.names if a.name != "*")
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp)):
            return
        if isinstance(node, ast.GeneratorExp):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(stmt)
    return out


def _loaded_names(node: ast.AST, host_only: Callable[[ast.AST], bool]) -> Iterator[ast.Name]:
    """Every name a statement mentions, outside the bodies of host-only functions."""
    todo = [node]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and host_only(node):
            continue
        if isinstance(node, ast.Name):
            yield node
        todo.extend(reversed(list(ast.iter_child_nodes(node))))


def _span(stmt: ast.stmt) -> tuple[int, int]:
    """First and last line of a top-level statement, decorators included."""
    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
    return first, stmt.end_lineno or stmt.lineno


def _select(
    body: list[ast.stmt], names: Iterable[str], host_only: Callable[[ast.AST], bool]
) -> dict[int, tuple] | None:
    """The top-level statements that define ``names`` and everything they use, transitively
    (not counting what host-only functions use), plus those that bind nothing (they run at
    import), each (by index) with why it counts: ("name", NAME) one of ``names``, ("use",
    INDEX, NAME, LINE, COL) statement INDEX mentions NAME there (the first such way, breadth
    first), ("import-time",); None if a name is not bound at the top level."""
    where: dict[str, list[int]] = {}
    binds = [_bound_names(stmt) for stmt in body]
    for i, bound in enumerate(binds):
        for name in bound:
            where.setdefault(name, []).append(i)
    names = list(names)
    if any(n not in where for n in names):
        return None
    chosen: dict[int, tuple] = {}
    todo: deque[tuple[str, tuple]] = deque((n, ("name", n)) for n in names)

    def take(i: int, reason: tuple) -> None:
        if i not in chosen:
            chosen[i] = reason
            todo.extend(
                (n.id, ("use", i, n.id, n.lineno, n.col_offset))
                for n in _loaded_names(body[i], host_only)
            )

    for i, bound in enumerate(binds):
        if not bound:
            take(i, ("import-time",))
    done: set[str] = set()
    while todo:
        name, reason = todo.popleft()
        if name not in done:
            done.add(name)
            for i in where.get(name, []):
                take(i, reason)
    return chosen


def _uniq(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _ops_reason(name: str) -> str:
    if name == "torch.ops.aten" or name.startswith("torch.ops.aten."):
        return "a direct ATen operator: only the listed torch operations are supported"
    return "a torch.ops operator: only the listed torch operations are supported"


def _is_torch(q: str) -> bool:
    return q == "torch" or q.startswith("torch.")


@functools.lru_cache(maxsize=4096)
def _torch_object(q: str) -> Any:
    """What a torch-qualified dotted name stands for, looked up without running any import
    or module ``__getattr__`` hook; _UNKNOWN if torch has no such attribute loaded."""
    obj: Any = torch
    for part in q.split(".")[1:]:
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            return _UNKNOWN
    return obj


def _classify(q: str) -> tuple[str, str]:
    """(kind, name) of a torch-qualified dotted name."""
    rest = q[len("torch.") :] if q.startswith("torch.") else ""
    if rest == "ops" or rest.startswith("ops."):
        return (ATEN if rest == "ops.aten" or rest.startswith("ops.aten.") else OPS), q
    if rest.startswith("nn.functional."):
        return FUNCTIONAL, rest[len("nn.functional.") :]
    if rest.startswith("Tensor."):
        return TENSOR, rest[len("Tensor.") :]
    if rest.startswith("nn.") and "." not in rest[3:]:
        return MODULE, rest[3:]
    return TORCH, rest or "torch"


def _certainly_not_tensor(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, _NON_TENSOR_NODES):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _NON_TENSOR_BUILTINS
    )


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNKNOWN


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps bools and ints apart and treats tuples as lists."""
    seqs = (list, tuple)
    if isinstance(a, seqs) or isinstance(b, seqs):
        return (
            isinstance(a, seqs)
            and isinstance(b, seqs)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _argument(r: Restriction, call: ast.Call, offset: int) -> ast.AST | None | object:
    """The node passed for r.arg, None if absent, _UNKNOWN if hidden behind * or **."""
    for kw in call.keywords:
        if kw.arg == r.arg:
            return kw.value
    if r.position is not None:
        pos = r.position + offset
        for i, a in enumerate(call.args):
            if isinstance(a, ast.Starred):
                return _UNKNOWN
            if i == pos:
                return a
    if any(kw.arg is None for kw in call.keywords):
        return _UNKNOWN
    return None


def _check_restriction(r: Restriction, call: ast.Call, offset: int) -> tuple[str, str, str] | None:
    """None if fine, else (severity, detail, reason)."""
    if r.manual:
        return "warning", "", r.reason
    node = _argument(r, call, offset)
    if node is _UNKNOWN:
        return "warning", f"{r.arg}=?", f"{r.reason}; {r.arg} is not visible in the call"
    if node is None:
        if r.required:
            return "error", f"{r.arg} missing", r.reason
        if r.default is _NO_DEFAULT:
            return None
        value, shown = r.default, f"{r.arg}={r.default!r} (default)"
    else:
        assert isinstance(node, ast.AST)
        value, shown = _literal(node), f"{r.arg}={ast.unparse(node)}"
        if value is _UNKNOWN:
            if r.required:
                return None  # a tensor expression: given
            return "warning", shown, f"{r.reason}; {r.arg} is not a literal"
    if r.required and value is None:
        return "error", shown, r.reason
    if r.none_only and value is not None:
        return "error", shown, r.reason
    if r.allowed is not None and not any(_same(value, a) for a in r.allowed):
        return "error", shown, r.reason
    if r.forbidden is not None and any(_same(value, f) for f in r.forbidden):
        return "error", shown, r.reason
    return None


# ---------------------------------------------------------------- following imports


def _module_file(module: str, roots: dict[str, Path]) -> Path | None:
    parts = module.split(".")
    root = roots.get(parts[0])
    if root is None:
        return None
    base = Path(root).joinpath(*parts[1:])
    for candidate in (base / "__init__.py", base.with_suffix(".py") if parts[1:] else None):
        if candidate is not None and candidate.is_file():
            return candidate.resolve()
    return None


def _module_name(path: Path, roots: dict[str, Path]) -> tuple[str | None, bool]:
    """(dotted module name, is a package) of a file under one of the roots."""
    for top, root in roots.items():
        try:
            rel = path.resolve().relative_to(Path(root).resolve())
        except ValueError:
            continue
        parts = [top, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            return ".".join(parts[:-1]), True
        return ".".join(parts), False
    return None, False


# Never followed, installed or not: torch itself, and the IPU software stack (absent where
# the IPU code is only generated and linted; what it does is not a torch call).
_NOT_FOLLOWED = frozenset({"torch", "poptorch", "popart", "poplar"})


def _find_in_roots(module: str, roots: dict[str, Path]) -> _Found:
    path = _module_file(module, roots)
    if path is None:
        return _Found(
            _MISSING,
            module=module,
            root=True,
            why=f"cannot find module {module} under the package roots: its torch calls "
            "cannot be checked",
        )
    return _Found(_ROOT, path, module, path.name == "__init__.py", root=True)


def _entry_module(path: Path) -> tuple[str, bool, Path]:
    """(dotted name, is a package, folder it is imported from) of a linted file outside the
    package roots, from the folders above it that hold an ``__init__.py``."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    if not parts:  # an __init__.py with no package folder above: its own folder
        return path.parent.name, True, path.parent.parent
    return ".".join(parts), path.name == "__init__.py", folder


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[Path, ...]:
    """Where Python's own modules and installed libraries live: not followed."""
    found: set[str] = set()
    paths = sysconfig.get_paths()
    found.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    try:
        found.update(site.getsitepackages())
        found.add(site.getusersitepackages())
    except (AttributeError, TypeError):  # pragma: no cover - a stripped-down site module
        pass
    found.update(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))
    found.add(os.path.dirname(os.__file__))  # the standard library, whatever the layout
    found.add(os.path.dirname(os.path.dirname(torch.__file__)))  # where torch is installed
    return tuple(sorted({Path(p).resolve() for p in found if p}))


def _registry_dirs() -> tuple[Path, ...]:
    """The folders of the ``UNROLLER_OPS`` registry files (searched after sys.path)."""
    env = [p for p in os.environ.get("UNROLLER_OPS", "").split(os.pathsep) if p]
    return tuple(dict.fromkeys(Path(p).resolve().parent for p in env))


def _kernel_tops() -> frozenset[str]:
    """Top-level packages the operator registry names as kernels (followed wherever they
    are installed)."""
    try:
        from unroller.registry import load_registry

        ops = load_registry()
    except Exception:  # noqa: BLE001 - a broken registry is generate's error, not lint's
        return frozenset()
    return frozenset(m.split(".")[0] for spec in ops.values() for m in spec.kernels.values())


class _Resolver:
    """Finds modules by import name as Python would at run time, importing nothing: the
    finders of ``sys.meta_path`` in order, the path-based one searching the importing
    module's folder first and then ``sys.path``; then the ``UNROLLER_OPS`` folders."""

    def __init__(self, roots: dict[str, Path]) -> None:
        self.roots = roots
        self.extra = _registry_dirs()
        self.library = _library_dirs()
        self.kernel_tops = _kernel_tops() - set(roots)
        self.cache: dict[tuple[str, Path | None], _Found] = {}

    def find(self, module: str, base: Path | None) -> _Found:
        key = (module, base)
        if key not in self.cache:
            self.cache[key] = self._find(module, base)
        return self.cache[key]

    def _where(self, base: Path | None) -> str:
        places = (["the linted module's folder"] if base else []) + ["sys.path"]
        if self.extra:
            places.append("the UNROLLER_OPS folders")
        return ", ".join(places)

    def _find(self, module: str, base: Path | None) -> _Found:
        top = module.split(".")[0]
        if top in self.roots:
            return _find_in_roots(module, self.roots)
        if top in _NOT_FOLLOWED:
            return _Found(_LIBRARY, module=module)
        try:
            spec = self._spec(module, base)
        except Exception as exc:  # noqa: BLE001 - a finder that fails: the module is not found
            spec, failed = None, f" ({type(exc).__name__}: {exc})"
        else:
            failed = ""
        if spec is None:
            return _Found(
                _MISSING,
                module=module,
                why=f"cannot find module {module} (searched as Python would: "
                f"{self._where(base)}){failed}: its torch calls cannot be checked",
            )
        if spec.origin in (None, "namespace") and spec.submodule_search_locations is not None:
            return _Found(_USER, None, module, True)  # a namespace package: no code of its own
        if not spec.has_location or not spec.origin:
            return _Found(_LIBRARY, module=module)  # built-in or frozen
        path = Path(spec.origin).resolve()
        if top not in self.kernel_tops and any(path.is_relative_to(d) for d in self.library):
            return _Found(_LIBRARY, module=module)
        if path.suffix != ".py":
            return _Found(
                _UNREADABLE,
                path,
                module,
                why=f"module {module} is {path.name}, not Python source: its torch calls "
                "cannot be checked",
            )
        return _Found(_USER, path, module, spec.submodule_search_locations is not None)

    def _spec(self, module: str, base: Path | None) -> importlib.machinery.ModuleSpec | None:
        parts = module.split(".")
        spec = self._top_spec(parts[0], base)
        for i in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(
                ".".join(parts[: i + 1]), list(spec.submodule_search_locations)
            )
        return spec

    def _top_spec(self, top: str, base: Path | None) -> importlib.machinery.ModuleSpec | None:
        path_finder = importlib.machinery.PathFinder
        search = ([str(base)] if base else []) + sys.path
        finders = list(sys.meta_path)
        if path_finder not in finders:  # pragma: no cover - an unusual interpreter
            finders.append(path_finder)
        for finder in finders:
            if finder is path_finder:
                spec = path_finder.find_spec(top, search)
            else:
                find_spec = getattr(finder, "find_spec", None)
                spec = find_spec(top, None) if find_spec is not None else None
            if spec is not None:
                return spec
        if self.extra:
            return path_finder.find_spec(top, [str(d) for d in self.extra])
        return None


class _Unreadable(Exception):
    """A file lint does not read, and why."""


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _read_source(path: Path, limit: int | None = None) -> str:
    """The text of the regular file at ``path`` (a link is followed), at most ``limit``
    bytes (default MAX_SOURCE_BYTES), decoded as Python decodes source (a BOM or coding
    declaration, else UTF-8). A FIFO or device is never opened for reading."""
    limit = MAX_SOURCE_BYTES if limit is None else limit
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _Unreadable(f"it is {_file_kind(mode)}, not a regular file")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as handle:
            mode = os.fstat(fd).st_mode  # the file opened, should it have changed meanwhile
            if not stat.S_ISREG(mode):
                raise _Unreadable(f"it is {_file_kind(mode)}, not a regular file")
            data = handle.read(limit + 1)
    except OSError as exc:
        raise _Unreadable(f"it cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        size = f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit} bytes"
        raise _Unreadable(f"it is larger than {size}, the most lint reads of one module")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except SyntaxError as exc:  # detect_encoding: undecodable first lines, a bad declaration
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise _Unreadable(_not_text(bad)) from None
        raise _Unreadable(f"its encoding declaration is not valid ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise _Unreadable(_not_text(exc)) from None


def _not_text(exc: UnicodeDecodeError) -> str:
    return (
        f"it is not {exc.encoding} text (byte {exc.start}: {exc.reason}); Python source is "
        "UTF-8 unless it declares another encoding"
    )


def _statement_at(spans: list[tuple[int, int]], line: int) -> int | None:
    i = bisect.bisect_right([start for start, _ in spans], line) - 1
    return i if i >= 0 and spans[i][1] >= line else None


class _Linter:
    def __init__(self, platform: str, package_roots: dict[str, Path] | None) -> None:
        self.ops = supported_ops(platform)
        roots = _DEFAULT_ROOTS if package_roots is None else package_roots
        self.roots = {k: Path(v) for k, v in roots.items()}
        self.resolver = _Resolver(self.roots)
        # per file reached: the folder its imports resolve from (its entry's), its module name
        # and whether it is a package, and how it was reached (name wanted -> where)
        self.base: dict[Path, Path] = {}
        self.module: dict[Path, tuple[str | None, bool]] = {}
        self.origins: dict[Path, dict[str | None, Hop]] = {}
        self.results: dict[Path, _Scan] = {}
        self.entries: set[Path] = set()

    def run(self, entries: Iterable[Path]) -> LintReport:
        """Scan the entries whole, then the modules they import: package modules whole when
        imported as modules, else only the names used (rescanned when more are asked for)."""
        importlib.invalidate_caches()  # the finders look afresh at folders written meanwhile
        wanted: dict[Path, frozenset[str] | None] = {}  # None: the whole module
        queue: deque[Path] = deque()
        for entry in entries:
            path = Path(entry).resolve()
            if path not in wanted or wanted[path] is not None:
                wanted[path] = None
                queue.append(path)
            self.entries.add(path)
            if path not in self.module:
                name, is_package = _module_name(path, self.roots)
                if name is None:
                    name, is_package, base = _entry_module(path)
                else:  # a package module: imported from the folder above its package
                    base = self.roots[name.split(".")[0]].resolve().parent
                self.module[path], self.base[path] = (name, is_package), base
        sources: dict[Path, str | _Unreadable] = {}
        problems: list[LintCall] = []
        while queue:
            path = queue.popleft()
            result = self.results[path] = self._scan(path, wanted[path], sources)
            wanted[path] = result.selection
            for imp in result.imports:
                target = self._follow(path, imp, problems)
                if target is None:
                    continue
                old = wanted.get(target, frozenset())
                new = None if imp.name is None or old is None else old | {imp.name}
                if target not in wanted or new != old:
                    wanted[target] = new
                    if target not in queue:
                        queue.append(target)
        report = LintReport(self.ops.platform, self.ops.device)
        for path, result in self.results.items():
            report.files.append(path)
            report.calls.extend(self._with_chain(c) for c in result.calls)
            report.host_only.extend(result.host_only)
            if result.selection is not None:
                report.partial[path] = tuple(sorted(result.selection))
        report.calls.extend(self._with_chain(c) for c in _uniq_calls(problems))
        return report

    def _scan(
        self, path: Path, selection: frozenset[str] | None, sources: dict[Path, str | _Unreadable]
    ) -> _Scan:
        if path not in sources:
            try:
                sources[path] = _read_source(path)
            except _Unreadable as exc:
                sources[path] = exc
        source = sources[path]
        if isinstance(source, _Unreadable):
            why = f"{path.name} cannot be checked: {source}"
            return _Scan([LintCall(path, 1, 1, "unreadable", READ, False, why)], [], [], None)
        module, is_package = self.module.get(path) or _module_name(path, self.roots)
        base = self.base.get(path, path.parent)
        scanner = _ModuleScanner(
            path,
            source,
            module,
            is_package,
            self.ops,
            self.roots,
            selection,
            resolve=lambda name: self.resolver.find(name, base),
        )
        return scanner.scan()

    def _follow(self, path: Path, imp: _Import, problems: list[LintCall]) -> Path | None:
        """The file to scan for an import (None: nothing to scan); problems get an import
        that cannot be followed."""
        found = imp.found
        if found.kind in (_MISSING, _UNREADABLE):
            used = imp.name != _UNUSED
            why = found.why if used else f"{found.why} (imported, not used by the checked code)"
            problems.append(
                LintCall(path, imp.line, imp.col, imp.module, IMPORT, not used, why, warning=True)
            )
            return None
        if found.kind == _LIBRARY or found.path is None or imp.name == _UNUSED:
            return None
        target = found.path
        self.origins.setdefault(target, {}).setdefault(
            imp.name, Hop(path, imp.line, imp.col, imp.text)
        )
        self.base.setdefault(target, self.base.get(path, path.parent))
        if found.kind == _USER:
            self.module.setdefault(target, (found.module, found.is_package))
        return target

    def _with_chain(self, call: LintCall) -> LintCall:
        if call.severity == "ok" or call.file in self.entries:
            return call
        return dataclasses.replace(call, chain=self._chain(call.file, call.line))

    def _chain(self, path: Path, line: int) -> tuple[Hop, ...]:
        """How the entries reach ``line`` of ``path``, as hops from an entry's line on."""
        hops: list[Hop] = []
        seen: set[tuple[Path, int]] = set()
        while path not in self.entries and (path, line) not in seen:
            seen.add((path, line))
            result = self.results.get(path)
            key: str | None = None
            if result is not None and result.reasons is not None:
                i = _statement_at(result.spans, line)
                reason = result.reasons.get(i) if i is not None else None
                while reason is not None and reason[0] == "use":
                    _, j, name, ln, col = reason
                    hops.append(Hop(path, ln, col, name))
                    reason = result.reasons.get(j)
                if reason is not None and reason[0] == "name":
                    key = reason[1]
            known = self.origins.get(path, {})
            origin = known.get(key) or known.get(None) or next(iter(known.values()), None)
            if origin is None:
                break
            hops.append(origin)
            path, line = origin.file, origin.line
        return tuple(reversed(hops))


def _uniq_calls(calls: list[LintCall]) -> list[LintCall]:
    return list(dict.fromkeys(calls))


def _expand(paths: Iterable[Path | str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(
                f
                for f in sorted(p.rglob("*.py"))
                if "__pycache__" not in f.parts and not f.is_dir()
            )
        elif os.path.lexists(p):
            out.append(p)  # not a regular file, a dangling link: a lint error when read
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def lint_module(
    path: Path | str, platform: str = "ipu", package_roots: dict[str, Path] | None = None
) -> LintReport:
    """Every torch call reachable from the module at ``path``: its own code and, recursively,
    what it imports from the packages in ``package_roots`` (top-level package name -> its
    directory; default ``{"unroller": <this package's directory>}``): whole modules, or the
    definitions behind imported names. Each call is checked against ``platform``'s supported
    list (``unroller/<platform>_supported.toml``). Nothing is imported or executed."""
    return lint_paths([path], platform, package_roots)


def lint_paths(
    paths: Iterable[Path | str],
    platform: str = "ipu",
    package_roots: dict[str, Path] | None = None,
) -> LintReport:
    """``lint_module`` for many files and directories (``*.py`` below them, recursively);
    a module imported by several is scanned once."""
    return _Linter(platform, package_roots).run(_expand(paths))
