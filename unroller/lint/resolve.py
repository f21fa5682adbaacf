"""Following imports: where a module imported by name is, as Python would find it at run
time without importing anything, and whether lint follows it (the package roots, user and
kernel modules) or not (torch, the IPU stack, the standard library, installed libraries)."""

from __future__ import annotations

import functools
import importlib.machinery
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .supported import _PACKAGE_DIR

_DEFAULT_ROOTS = {"unroller": _PACKAGE_DIR}

# How an import resolves (_Found.kind).
_ROOT, _USER, _LIBRARY, _MISSING, _UNREADABLE = "root", "user", "library", "missing", "unreadable"


@dataclass(frozen=True)
class _Found:
    """Where an imported module's source is, and whether it is followed."""

    kind: str
    path: Path | None = None  # None for a namespace package (no source of its own)
    module: str = ""
    is_package: bool = False
    why: str = ""  # for _MISSING and _UNREADABLE
    root: bool = False  # under the package roots


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
        from unroller.compiler.registry import load_registry

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
