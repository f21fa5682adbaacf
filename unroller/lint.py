"""Static check that generated code calls only operations its platform supports.

``lint_module(path)`` reads a generated module with :mod:`ast` (nothing is imported or run),
follows its imports into the ``unroller`` package (``unroller.runtime.<platform>``,
``unroller.compress`` and whatever those import inside the package, recursively) and lists
every torch call it finds, each checked against the platform's list of supported operations,
``unroller/<platform>_supported.toml`` (for ``ipu``: PopTorch's list).

What counts as a torch call (import aliases resolved per module: ``import torch as T``,
``import torch.nn.functional as F``, ``from torch import nn``, ``from torch.nn import
functional as F``, ``from torch.nn.functional import pad``, and simple assignments such as
``_aten = torch.ops.aten``):

* ``torch.X(...)``, ``torch.linalg.X(...)``, ``torch.nn.functional.X(...)`` / ``F.X(...)``;
* ``torch.nn.X(...)``: a module constructor, allowed if the list names the module, with its
  argument restrictions (``MaxPool2d(return_indices=True)`` is an error);
* ``<expr>.X(...)`` where ``X`` is a ``torch.Tensor`` method (at lint time) and the receiver
  is not an imported module, ``self``/``cls``, ``super()``, a str/list/dict/tuple/set literal
  or a parameter annotated as one of those (``s: str`` makes ``s.split(",")`` no call).
  Names that are also str/list/dict/set methods (``split``, ``index``, ``sort``, ``values``,
  ``add``) are counted as tensor calls when they are on the list anyway; otherwise they are
  warnings ("unknown receiver, check by hand"), never errors;
* ``torch.ops.aten.X`` (and any ``torch.ops`` access) anywhere: always an error;
* ``getattr(torch, name)`` with a non-literal name: an error (cannot be checked); with a
  string literal it is checked as the call it names;
* a class derived from ``torch.autograd.Function``: an error (PopTorch has no custom
  backward).

Argument restrictions (interpolate's mode, conv_transpose dilation, max_pool return_indices,
topk sorted, ...) are checked when the value is a literal in the call; a value the linter
cannot see is a warning.

Which code counts: all of the module linted, and all of every package module imported as a
module (``import unroller.runtime.ipu as K``, ``from unroller import compress``), whether or
not it is reached at run time. From a module whose names are imported (``from
unroller.runtime.gpu import accumulate, tensors``) only the top-level statements defining
those names count, with the top-level definitions they use, transitively, and the top-level
statements that bind nothing (they run at import); a name that is not bound at the top level
makes the whole module count. The report notes each module checked in part.

Excluded everywhere: the bodies of functions marked host-only (and, in a module checked in
part, the definitions only they use). The marker is a comment ``# unroller-lint: host-only``
on the function's ``def`` line (or any line of its header, up to the colon), or the text
``unroller-lint: host-only`` in its docstring. Use it only for code that runs on the host,
outside the traced graph (parameter bookkeeping, stash accounting, the runner). The report
lists every function excluded this way.

Not checked: Python operators on tensors (``a + b``, ``a @ b``, ``a >> 1``), builtins applied
to tensors (``abs(t)``, ``sum(ts)``), slice bounds, dtypes, calls into modules outside the
package roots (``poptorch``, ``numpy``), and the values generated code passes to the kernels.
Parent packages of an imported module (``unroller/__init__.py``) are not scanned unless
imported by name.

``unroll lint`` is a thin wrapper: ``report = lint_paths(paths, platform)``, print
``report.format()``, exit 1 unless ``report.ok``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import tokenize
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
IMPORT, SYNTAX = "import", "syntax"

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
class LintCall:
    """One torch call (or torch access) found in a scanned file.

    ``line`` and ``col`` (1-based, in characters) point at the called name: ``interpolate``
    in ``F.interpolate(...)``, ``view`` in ``x.view(...)``. ``name`` is canonical
    (``torch.cos``, ``torch.nn.functional.interpolate``, ``Tensor.view``, ``torch.nn.Conv2d``,
    ``torch.ops.aten.gelu``); ``detail`` is the offending argument of a restriction
    (``mode='bilinear'``). ``warning``: allowed as far as the linter can tell, but to be
    checked by hand."""

    file: Path
    line: int
    col: int
    name: str
    kind: str
    allowed: bool
    reason: str
    detail: str = ""
    warning: bool = False

    @property
    def severity(self) -> str:
        return "error" if not self.allowed else "warning" if self.warning else "ok"

    @property
    def display(self) -> str:
        if self.kind == IMPORT:
            return f"import {self.name}"
        if self.kind in (SYNTAX, AUTOGRAD, DYNAMIC, OPS_REFERENCE):
            return self.name
        return f"{self.name}({self.detail})"

    def format(self, device: str = "IPU", relative_to: Path | None = None) -> str:
        where = f"{_show(self.file, relative_to)}:{self.line}:{self.col}"
        if self.kind in (IMPORT, SYNTAX):
            return f"{where}: error: {self.reason}"
        if self.severity == "error":
            return (
                f"{where}: error: {self.display} is not supported on the {device} ({self.reason})"
            )
        if self.severity == "warning":
            return f"{where}: warning: {self.display}: check by hand ({self.reason})"
        return f"{where}: ok: {self.display} ({self.reason})"


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
        return [c for c in self.calls if c.kind not in (IMPORT, SYNTAX, OPS_REFERENCE)]

    def summary(self) -> str:
        text = (
            f"{len(self.torch_calls)} torch calls in {len(self.files)} files, "
            f"{len(self.errors)} not supported"
        )
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
            f"{_show(path, relative_to)}: note: imported by name: only {', '.join(names)} "
            "and what they use were checked"
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


@dataclass
class _Scan:
    calls: list[LintCall]
    host_only: list[HostOnly]
    # (module to follow, the name imported from it or None for all of it, line, 1-based col)
    imports: list[tuple[str, str | None, int, int]]
    selection: frozenset[str] | None  # the top-level names checked, None: the whole module


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
    ) -> None:
        self.path = path
        self.selection = selection
        self.source = source
        self.module = module
        self.is_package = is_package
        self.ops = ops
        self.roots = roots
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.calls: list[LintCall] = []
        self.host_only: list[HostOnly] = []
        self.imports: list[tuple[str, str | None, int, int]] = []
        self.aliases: dict[str, str] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.consumed: set[int] = set()
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
        return None

    def _in_roots(self, module: str) -> bool:
        return module.split(".")[0] in self.roots

    def _collect_aliases(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
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
        # simple assignments that rename a torch object: `_aten = torch.ops.aten`
        for _ in range(3):
            changed = False
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    q = self._qual(node.value)
                    if q and _is_torch(q):
                        for t in targets:
                            if isinstance(t, ast.Name) and self.aliases.get(t.id) != q:
                                self.aliases[t.id] = q
                                changed = True
            if not changed:
                break

    def _imports(self, tree: ast.AST) -> None:
        """The package modules the checked code imports, and its torch imports that are
        errors by themselves (star imports, torch.ops)."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if self._in_roots(a.name):
                        self._import(a.name, None, node)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                if base is None:
                    continue
                if self._in_roots(base):
                    for a in node.names:
                        sub = f"{base}.{a.name}"
                        if a.name == "*":
                            self._import(base, None, node)
                        elif self._find(sub):
                            self._import(sub, None, node)  # a submodule: all of it
                        else:
                            self._import(base, a.name, node)
                if _is_torch(base) and any(a.name == "*" for a in node.names):
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

    def _import(self, module: str, name: str | None, node: ast.stmt) -> None:
        col = self._col(node.lineno, node.col_offset)
        self.imports.append((module, name, node.lineno, col))

    def _find(self, module: str) -> Path | None:
        return _module_file(module, self.roots)

    # host-only ------------------------------------------------------------------------

    def _tokens(self) -> list[tokenize.TokenInfo]:
        try:
            return list(tokenize.generate_tokens(io.StringIO(self.source).readline))
        except (tokenize.TokenError, SyntaxError):  # pragma: no cover - ast parsed it
            return []

    def _host_only_marks(self) -> tuple[set[int], dict[int, int]]:
        """(lines with a host-only comment, def line -> line of the colon ending its header)."""
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
            tree = ast.parse(self.source, filename=str(self.path))
        except SyntaxError as exc:
            self.calls.append(
                LintCall(
                    self.path,
                    exc.lineno or 1,
                    exc.offset or 1,
                    "syntax error",
                    SYNTAX,
                    False,
                    f"syntax error: {exc.msg}: the file cannot be checked",
                )
            )
            return _Scan(self.calls, self.host_only, self.imports, None)
        self._collect_aliases(tree)
        marks = self._host_only_marks()
        body: list[ast.stmt] | None = tree.body
        if self.selection is not None:
            body = _select(tree.body, self.selection, lambda f: self._is_host_only(f, marks))
        if body is None:  # a name not bound at the top level: check the whole module
            self.selection, body = None, tree.body
        checked = ast.Module(body=body, type_ignores=[])
        self._imports(checked)
        nodes = list(self._walk(checked, marks, ()))
        for node in nodes:
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.ClassDef):
                self._class(node)
        for node in nodes:
            if isinstance(node, (ast.Attribute, ast.Name)):
                self._ops_reference(node)
        self.calls.sort(key=lambda c: (c.line, c.col))
        return _Scan(self.calls, self.host_only, self.imports, self.selection)

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

    def _ops_reference(self, node: ast.Attribute | ast.Name) -> None:
        """A torch.ops object used other than by calling it: `_aten = torch.ops.aten`."""
        if id(node) in self.consumed or isinstance(node.ctx, (ast.Store, ast.Del)):
            return
        q = self._qual(node)
        if not q or not (q == "torch.ops" or q.startswith("torch.ops.")):
            return
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute):
            return  # the outermost attribute of the chain reports
        if isinstance(parent, ast.Call) and parent.func is node:
            return  # reported as a call
        self._add(node, q, OPS_REFERENCE, False, _ops_reason(q))

    def _call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and "getattr" not in self.aliases:
            self._getattr(node)
            return
        q = self._qual(func)
        if q is not None:
            if _is_torch(q):
                self._torch_call(node, func, q)
            return  # a function of some other module (K.conv2d, math.prod, C.make)
        if isinstance(func, ast.Attribute):
            self._method_call(node, func)

    def _getattr(self, node: ast.Call) -> None:
        if len(node.args) < 2:
            return
        target = self._qual(node.args[0])
        if not target or not _is_torch(target):
            return
        self._mark_consumed(node.args[0])
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            kind, short = _classify(f"{target}.{name.value}")
            self._check(node, func_node=node.func, kind=kind, short=short, call=None)
        else:
            self._add(
                node.func,
                f"getattr({target}, {ast.unparse(name)})",
                DYNAMIC,
                False,
                "dynamic access to torch cannot be checked",
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

    def _method_call(self, node: ast.Call, func: ast.Attribute) -> None:
        name = func.attr
        if name.startswith("_") or name not in self.tensor_methods:
            return
        receiver = func.value
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            return
        if _certainly_not_tensor(receiver) or self._annotated_not_tensor(receiver):
            return
        if (
            isinstance(receiver, ast.Call)
            and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super"
        ):
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

    def _annotated_not_tensor(self, receiver: ast.AST) -> bool:
        """A parameter of the enclosing function annotated str, list, dict, tuple or set."""
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


def _loaded_names(node: ast.AST, host_only: Callable[[ast.AST], bool]) -> Iterator[str]:
    """Every name a statement mentions, outside the bodies of host-only functions."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and host_only(node):
        return
    if isinstance(node, ast.Name):
        yield node.id
    for child in ast.iter_child_nodes(node):
        yield from _loaded_names(child, host_only)


def _select(
    body: list[ast.stmt], names: Iterable[str], host_only: Callable[[ast.AST], bool]
) -> list[ast.stmt] | None:
    """The top-level statements that define ``names`` and everything they use, transitively
    (not counting what host-only functions use), plus those that bind nothing (they run at
    import); None if a name is not bound at the top level."""
    where: dict[str, list[int]] = {}
    binds = [_bound_names(stmt) for stmt in body]
    for i, bound in enumerate(binds):
        for name in bound:
            where.setdefault(name, []).append(i)
    names = list(names)
    if any(n not in where for n in names):
        return None
    chosen: set[int] = set()
    todo = list(names)

    def take(i: int) -> None:
        if i not in chosen:
            chosen.add(i)
            todo.extend(_loaded_names(body[i], host_only))

    for i, bound in enumerate(binds):
        if not bound:
            take(i)
    done: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in done:
            done.add(name)
            for i in where.get(name, []):
                take(i)
    return [stmt for i, stmt in enumerate(body) if i in chosen]


def _uniq(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _ops_reason(name: str) -> str:
    if name == "torch.ops.aten" or name.startswith("torch.ops.aten."):
        return "a direct ATen operator: only the listed torch operations are supported"
    return "a torch.ops operator: only the listed torch operations are supported"


def _is_torch(q: str) -> bool:
    return q == "torch" or q.startswith("torch.")


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


class _Linter:
    def __init__(self, platform: str, package_roots: dict[str, Path] | None) -> None:
        self.ops = supported_ops(platform)
        roots = _DEFAULT_ROOTS if package_roots is None else package_roots
        self.roots = {k: Path(v) for k, v in roots.items()}

    def run(self, entries: Iterable[Path]) -> LintReport:
        """Scan the entries whole, then the package modules they import: whole when imported
        as modules, else only the names imported (rescanned when more names are asked for)."""
        wanted: dict[Path, frozenset[str] | None] = {}  # None: the whole module
        queue: list[Path] = []
        for entry in entries:
            path = Path(entry).resolve()
            if path not in wanted or wanted[path] is not None:
                wanted[path] = None
                queue.append(path)
        results: dict[Path, _Scan] = {}
        missing: list[LintCall] = []
        while queue:
            path = queue.pop(0)
            module, is_package = _module_name(path, self.roots)
            source = path.read_text(encoding="utf-8")
            scanner = _ModuleScanner(
                path, source, module, is_package, self.ops, self.roots, wanted[path]
            )
            result = results[path] = scanner.scan()
            wanted[path] = result.selection
            for name, imported, line, col in result.imports:
                target = _module_file(name, self.roots)
                if target is None:
                    missing.append(
                        LintCall(
                            path,
                            line,
                            col,
                            name,
                            IMPORT,
                            False,
                            f"cannot find module {name} under the package roots: "
                            "its torch calls cannot be checked",
                        )
                    )
                    continue
                old = wanted.get(target, frozenset())
                new = None if imported is None or old is None else old | {imported}
                if target not in wanted or new != old:
                    wanted[target] = new
                    if target not in queue:
                        queue.append(target)
        report = LintReport(self.ops.platform, self.ops.device)
        for path, result in results.items():
            report.files.append(path)
            report.calls.extend(result.calls)
            report.host_only.extend(result.host_only)
            if result.selection is not None:
                report.partial[path] = tuple(sorted(result.selection))
        report.calls.extend(_uniq_calls(missing))
        return report


def _uniq_calls(calls: list[LintCall]) -> list[LintCall]:
    return list(dict.fromkeys(calls))


def _expand(paths: Iterable[Path | str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(
                f for f in sorted(p.rglob("*.py")) if "__pycache__" not in f.parts and f.is_file()
            )
        elif p.is_file():
            out.append(p)
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
