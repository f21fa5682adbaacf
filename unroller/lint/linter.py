"""The run over many modules: scan the linted files whole, follow their imports (each module
read and parsed once, rescanned when more of its names are asked for), and attach to each
problem outside the linted files the chain of names that reaches it.

A scan is a function of the module's source, where it is, what is asked of it, and the
answers to the questions it asks on the way (where an imported module is, what a star
import binds). Each process keeps the latest scans with those answers (``_SCANS``): a
later run reuses one only when the source is the same text (by its digest) and every
answer, asked again in that run, is the same, so a reused scan is the one the run would
have made."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path

from unroller.compiler.platforms import LINTED

from .imports import _UNUSED, _Import
from .kinds import IMPORT, READ
from .report import Hop, LintCall, LintReport
from .resolve import (
    _DEFAULT_ROOTS,
    _LIBRARY,
    _MISSING,
    _UNREADABLE,
    _USER,
    _entry_module,
    _Found,
    _module_name,
    _Resolver,
)
from .scanner import _ModuleScanner, _Scan
from .selection import _statement_at
from .source import _read_source, _Unreadable
from .stars import star_names
from .supported import SupportedOps, supported_ops

# (platform, file, its source's digest, module name, is a package, selection) -> the scan and the
# answers it was given, in order: ("find", name, found) or ("star", found, names). The folder
# its imports resolve from is not in the key: the answers, asked again from this run's
# folder, stand for it.
_ScanKey = tuple[str, Path, bytes, str | None, bool, frozenset[str] | None]
_SCANS: OrderedDict[_ScanKey, tuple[SupportedOps, tuple[tuple, ...], _Scan]] = OrderedDict()
_MAX_SCANS = 256


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
        self.stars: dict[Path, dict[Path, frozenset[str] | None]] = {}  # by base, then module
        self.sources: dict[Path, str | _Unreadable] = {}  # each file read once

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
        problems: list[LintCall] = []
        while queue:
            path = queue.popleft()
            result = self.results[path] = self._scan(path, wanted[path])
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

    def _scan(self, path: Path, selection: frozenset[str] | None) -> _Scan:
        try:
            source = self._read(path)
        except _Unreadable as exc:
            why = f"{path.name} cannot be checked: {exc}"
            return _Scan([LintCall(path, 1, 1, "unreadable", READ, False, why)], [], [], None)
        module, is_package = self.module.get(path) or _module_name(path, self.roots)
        base = self.base.get(path, path.parent)
        digest = hashlib.blake2b(source.encode("utf-8", "surrogatepass")).digest()
        key: _ScanKey = (self.ops.platform, path, digest, module, is_package, selection)
        reused = self._reused(key, base)
        if reused is not None:
            return reused
        answers: list[tuple] = []

        def resolve(name: str) -> _Found:
            found = self.resolver.find(name, base)
            answers.append(("find", name, found))
            return found

        def stars(found: _Found) -> frozenset[str] | None:
            names = self._star_names(found, base)
            answers.append(("star", found, names))
            return names

        scanner = _ModuleScanner(
            path, source, module, is_package, self.ops, selection, resolve, stars
        )
        result = scanner.scan()
        _SCANS[key] = (self.ops, tuple(answers), result)
        _SCANS.move_to_end(key)
        while len(_SCANS) > _MAX_SCANS:
            _SCANS.popitem(last=False)
        return _copy(result)

    def _reused(self, key: _ScanKey, base: Path) -> _Scan | None:
        """An earlier scan of the same source asked the same of, when each of its questions
        gets the same answer in this run (asked in the order the scan asked them)."""
        kept = _SCANS.get(key)
        if kept is None:
            return None
        ops, answers, result = kept
        if ops is not self.ops:
            return None
        for kind, asked, answer in answers:
            if kind == "find":
                again = self.resolver.find(asked, base)
            else:
                again = self._star_names(asked, base)
            if again != answer:
                return None
        _SCANS.move_to_end(key)
        return _copy(result)

    def _star_names(self, found: _Found, base: Path) -> frozenset[str] | None:
        """What ``from <found> import *`` binds, imports resolved from ``base`` (once per
        module and base)."""
        cache = self.stars.setdefault(base, {})
        return star_names(found, lambda name: self.resolver.find(name, base), self._read, cache)

    def _read(self, path: Path) -> str:
        """The source of ``path``, read once per run (raises _Unreadable)."""
        if path not in self.sources:
            try:
                self.sources[path] = _read_source(path)
            except _Unreadable as exc:
                self.sources[path] = exc
        source = self.sources[path]
        if isinstance(source, _Unreadable):
            raise source
        return source

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


def _copy(scan: _Scan) -> _Scan:
    """A scan whose lists and maps are its own (a kept scan is never changed)."""
    return dataclasses.replace(
        scan,
        calls=list(scan.calls),
        host_only=list(scan.host_only),
        imports=list(scan.imports),
        spans=list(scan.spans),
        reasons=None if scan.reasons is None else dict(scan.reasons),
    )


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
    path: Path | str, platform: str = LINTED.name, package_roots: dict[str, Path] | None = None
) -> LintReport:
    """Every torch call reachable from the module at ``path``: its own code and, recursively,
    what it imports from the packages in ``package_roots`` (top-level package name -> its
    directory; default ``{"unroller": <this package's directory>}``): whole modules, or the
    definitions behind imported names. Each call is checked against ``platform``'s supported
    list (``unroller/<platform>_supported.toml``). Nothing is imported or executed."""
    return lint_paths([path], platform, package_roots)


def lint_paths(
    paths: Iterable[Path | str],
    platform: str = LINTED.name,
    package_roots: dict[str, Path] | None = None,
) -> LintReport:
    """``lint_module`` for many files and directories (``*.py`` below them, recursively);
    a module imported by several is scanned once."""
    return _Linter(platform, package_roots).run(_expand(paths))
