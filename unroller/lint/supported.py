"""A platform's list of supported operations, read from ``unroller/<platform>_supported.toml``.

Kept apart from the scanner so that the list's format (groups, ``nn`` modules, extras,
argument restrictions, in-place spellings) is read and looked up in one place."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unroller.compiler.platforms import LINTED

from .kinds import FUNCTIONAL, MODULE, TENSOR, TORCH

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# The unroller package (the parent of this subpackage): where the supported lists live, and
# the default package root that lint follows imports into.
_PACKAGE_DIR = Path(__file__).resolve().parent.parent

_NO_DEFAULT = object()


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
def supported_ops(platform: str = LINTED.name) -> SupportedOps:
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
