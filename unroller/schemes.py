"""Compression schemes: which compressor each saved activation gets.

A scheme is a ``CompressionConfig``: a default compressor (or none), rules that match
the op type and/or a glob on the name of the node that saves the tensor (later rules
win), and whether lossless 1-bit masks are used. The four built-in schemes are
configs too; ``--compress-config FILE`` reads one from TOML:

    masks = true                  # optional, default true
    [default]
    compressor = "dct"            # "dct", "quant", ... or "none"
    keep = 4                      # the compressor's parameters
    min_size = 8                  # only tensors whose H and W are at least this
    [[rule]]
    op = "conv2d"                 # optional: the op that saves the tensor
    name = "layer4.*"             # optional: glob on that node's name
    compressor = "quant"
    bits = 4

Unknown keys, compressors or parameter values are errors that name the file's line.
"""

from __future__ import annotations

import fnmatch
import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unroller.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCHEMES = ("nocompress", "dct-first", "dct-dense", "quant")


@dataclass(frozen=True)
class Codec:
    """A compressor with its parameters, as the generated code instantiates it."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    min_size: int = 0  # only tensors whose last two dims are both at least this

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def label(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.name}({inner})"

    def instance(self):
        from unroller.compress import make

        return make(self.name, **self.kwargs)

    def applies_to(self, shape: tuple) -> bool:
        if self.name == "dct" and len(shape) != 4:
            return False
        if self.min_size and (len(shape) < 3 or min(shape[-2:]) < self.min_size):
            return False
        return True


def make_codec(name: str, params: dict[str, Any], min_size: int = 0) -> Codec:
    """Validate through the compressor itself and keep its normalized parameters."""
    from unroller.compress import make

    compressor = make(name, **params)  # ValueError names the bad parameter
    return Codec(name, tuple(sorted(compressor.params.items())), min_size)


@dataclass(frozen=True)
class Rule:
    codec: Codec | None  # None: keep raw
    op: str | None = None
    name: str | None = None
    line: int = 0

    def matches(self, op: str, node: str) -> bool:
        return (self.op is None or self.op == op) and (
            self.name is None or fnmatch.fnmatchcase(node, self.name)
        )


@dataclass
class CompressionConfig:
    default: Codec | None = None
    rules: list[Rule] = field(default_factory=list)
    masks: bool = True
    first_only: bool = False  # dct-first: only the first compressible activation
    source: str | None = None  # the config file, if any
    sha256: str | None = None

    def choose(self, op: str, node: str, shape: tuple) -> Codec | None:
        codec = self.default
        for rule in self.rules:
            if rule.matches(op, node):
                codec = rule.codec
        return codec if codec is not None and codec.applies_to(shape) else None


def builtin(scheme: str) -> CompressionConfig:
    if scheme == "nocompress":
        return CompressionConfig()
    if scheme == "dct-dense":
        return CompressionConfig(default=make_codec("dct", {}, min_size=8))
    if scheme == "dct-first":
        return CompressionConfig(default=make_codec("dct", {}), first_only=True)
    if scheme == "quant":
        return CompressionConfig(default=make_codec("quant", {"bits": 8}))
    raise ConfigError(f"unknown scheme '{scheme}' (known: {', '.join(SCHEMES)})")


def disabled() -> CompressionConfig:
    """--opt-level 0: no compression and no masks, whatever the scheme or config."""
    return CompressionConfig(masks=False)


# -- config files ----------------------------------------------------------------------


def _line_of(lines: list[str], key: str, section: str | None, index: int = 0) -> int:
    """The 1-based line of ``key =`` inside the ``index``-th ``section`` (best effort)."""
    start, seen = 0, -1
    if section is not None:
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped in (f"[{section}]", f"[[{section}]]"):
                seen += 1
                if seen == index:
                    start = i
                    break
    for i in range(start, len(lines)):
        stripped = lines[i].strip()
        if i > start and stripped.startswith("[") and section is not None:
            break
        if section is None and stripped.startswith("["):
            break
        if stripped.split("=", 1)[0].strip() == key:
            return i + 1
    return start + 1


def load_config(path: str | Path) -> CompressionConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the compression config: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    lines = text.splitlines()

    def fail(message: str, key: str, section: str | None = None, index: int = 0) -> ConfigError:
        return ConfigError(f"{path}:{_line_of(lines, key, section, index)}: error: {message}")

    for key in data:
        if key not in ("masks", "default", "rule"):
            raise fail(f"unknown key '{key}' (expected masks, [default], [[rule]])", key)
    masks = data.get("masks", True)
    if not isinstance(masks, bool):
        raise fail("'masks' must be true or false", "masks")

    def codec_of(
        table: dict[str, Any], section: str, index: int, allowed: set[str]
    ) -> Codec | None:
        name = table.get("compressor")
        if not isinstance(name, str):
            raise fail(
                "missing 'compressor' (a compressor name or \"none\")", "compressor", section, index
            )
        params = {k: v for k, v in table.items() if k not in allowed | {"compressor", "min_size"}}
        if name == "none":
            if params or "min_size" in table:
                key = next(iter(params), "min_size")
                raise fail(
                    f"unknown key '{key}' (compressor \"none\" takes no parameters)",
                    key,
                    section,
                    index,
                )
            return None
        min_size = table.get("min_size", 0)
        if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
            raise fail("'min_size' must be a non-negative integer", "min_size", section, index)
        try:
            return make_codec(name, params, min_size)
        except ValueError as exc:
            bad = next((k for k in params if f"'{k}'" in str(exc)), "compressor")
            raise fail(str(exc), bad, section, index) from None

    default = None
    if "default" in data:
        if not isinstance(data["default"], dict):
            raise fail("[default] must be a table", "default")
        default = codec_of(data["default"], "default", 0, set())
    rules = []
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise fail("rules are written [[rule]]", "rule")
    for i, table in enumerate(raw_rules):
        codec = codec_of(table, "rule", i, {"op", "name"})
        for key in ("op", "name"):
            if key in table and not isinstance(table[key], str):
                raise fail(f"'{key}' must be a string", key, "rule", i)
        op = table.get("op")
        if op is not None:
            from unroller.registry import load_registry

            if op not in load_registry():
                raise fail(f"unknown op '{op}' in a rule", "op", "rule", i)
        rules.append(Rule(codec, op, table.get("name"), _line_of(lines, "compressor", "rule", i)))
    return CompressionConfig(
        default=default,
        rules=rules,
        masks=masks,
        source=str(path),
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def resolve(scheme: str, config: str | Path | None = None, opt_level: int = 1) -> CompressionConfig:
    """The compression config for a scheme name, a config file, and an opt level."""
    if opt_level not in (0, 1):
        raise ConfigError(f"--opt-level must be 0 or 1, got {opt_level}")
    chosen = load_config(config) if config is not None else builtin(scheme)
    return disabled() if opt_level == 0 else chosen
