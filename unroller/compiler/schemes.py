"""Compression schemes: which compressor each saved activation gets.

A scheme is a ``CompressionConfig``: a default compressor (or none), rules that match
the op type and/or a glob on the name of the node that saves the tensor (later rules
win), and whether lossless 1-bit masks are used. The four built-in schemes are
configs too; ``--compress-config FILE`` reads one from TOML:

    masks = true                  # optional, default true
    derivatives = false           # optional: few-bit derivative codes (gelu, silu), default false
    recompute = false             # optional: remake cheap ops' outputs in the backward
    recompute_keep = ["bn1"]      # optional: saved tensors (globs) recompute keeps instead
    recompute_segments = "blocks" # optional: block instances re-run in the backward
                                  # ("blocks": all that can be; or a list of name globs)
    [default]
    compressor = "dct"            # "dct", "quant", ... or "none"
    keep = 4                      # the compressor's parameters
    min_size = 8                  # only tensors whose H and W are at least this
    [[rule]]
    op = "conv2d"                 # optional: the op that saves the tensor
    name = "layer4.*"             # optional: glob on that node's name
    compressor = "quant"
    bits = 4

What a config may hold is checked before anything is built from it: ``compressor`` is an
activation compressor (``dct``, ``quant``) or ``"none"`` (``bits``, the 1-bit mask codec, is
``masks``'s business); ``op`` is an op of the registry; ``name`` is a glob of at most 200
letters, digits, ``_ . * ? [ ] ! -``; ``min_size`` and integer parameters are at most 2**16
in size; parameter values are booleans, integers, finite floats or short words, then checked
by the compressor itself; there are at most 1000 rules. The file is a regular UTF-8 file (a
byte-order mark is allowed) of at most 1 MiB.

Every problem is a ``ConfigError`` formatted like an error in a model file: ``FILE:LINE:COL:
error: message``, then the source line and a caret under the offending key or value (TOML
syntax errors and bytes that are not UTF-8 too); a file that cannot be read at all (missing,
a directory, a FIFO, too big) is ``FILE: error: message``.
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import math
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unroller.compiler.ast import Loc
from unroller.errors import ConfigError, ConfigFileError, did_you_mean
from unroller.files import FileTooLarge, NotRegularFile, read_bounded

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCHEMES = ("nocompress", "dct-first", "dct-dense", "quant", "auto")
AUTO = "auto"  # planned per model (unroller.analysis.search.auto_config): needs the graph


MAP = "map"
"""Layout of a 4-D tensor that is an image map [N, C, H, W] (the default for rank 4)."""
ROWS = "rows"
"""Layout of a tensor whose last dim is a row of features: token tensors [N, L, E],
attention maps [N, H, L, L], features [N, F]. An op declares that the tensors it saves
or makes are rows with ``layout = "rows"`` in the registry."""


def describe_shape(shape: tuple, layout: str = MAP) -> str:
    """A tensor's shape in words for messages: ``[N, L, E] = [N, 16, 32]``."""
    dims = ", ".join(str(d) for d in shape)
    names = {2: "[N, F]", 3: "[N, L, E]"}.get(len(shape))
    if len(shape) == 4:
        if layout == MAP:
            names = "[N, C, H, W]"
        else:
            names = "[N, H, L, L]" if shape[-1] == shape[-2] else "[N, H, L, E]"
    if names is None:
        return f"a rank-{len(shape)} tensor [{dims}]"
    return f"{names} = [{dims}]"


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

    def fit(self, shape: tuple, layout: str = MAP) -> tuple[Codec | None, str]:
        """This codec as it applies to one tensor, or None and why it does not.

        ``layout`` says what a 4-D tensor is (``layout_of``): an image map [N, C, H, W]
        (``MAP``) or rows along the last dim (``ROWS``: attention maps [N, H, L, L], heads
        [N, H, L, E]); tensors of other ranks are rows anyway. dct needs a map. quant keeps
        its default groups (per channel of a map, per token of [N, L, E], per sample of
        [N, F]: always per last-dim row except for maps) and on a 4-D rows tensor groups per
        row (``group_size`` = the last dim), not per head: one softmax row may be flat
        (values near 1/L) and the next peaked (near 1), and one scale for both would wipe
        out the flat one."""
        if self.name == "dct" and (len(shape) != 4 or layout != MAP):
            return (
                None,
                f"dct needs a 4-D map [N, C, H, W]; this is {describe_shape(shape, layout)}",
            )
        if self.min_size and len(shape) < 3:
            return None, (
                f"min_size={self.min_size} needs H and W of at least {self.min_size}; "
                f"this is {describe_shape(shape, layout)}"
            )
        if self.min_size and min(shape[-2:]) < self.min_size:
            return None, (
                f"min_size={self.min_size}: H x W is {shape[-2]} x {shape[-1]}, "
                f"below {self.min_size}"
            )
        params = dict(self.params)
        if self.name == "quant" and layout == ROWS and len(shape) >= 4:
            if params.get("group_size") is None:
                params["group_size"] = shape[-1]
                return make_codec(self.name, params, self.min_size), ""
        return self, ""


def make_codec(name: str, params: dict[str, Any], min_size: int = 0) -> Codec:
    """Validate through the compressor itself and keep its normalized parameters."""
    from unroller.compress import make

    compressor = make(name, **params)  # ValueError names the bad parameter
    return Codec(name, tuple(sorted(compressor.params.items())), min_size)


@dataclass(frozen=True)
class Rule:
    codec: Codec | None  # None: keep raw
    op: str | None = None
    name: str | None = None  # a glob on the name of the node whose backward reads it
    line: int = 0
    tensor: str | None = None  # a glob on the saved tensor's own name (what made it)

    def matches(self, op: str, node: str, tensor: str | None = None) -> bool:
        return (
            (self.op is None or self.op == op)
            and (self.name is None or fnmatch.fnmatchcase(node, self.name))
            and (
                self.tensor is None
                or (
                    tensor is not None
                    # a saved extra output ("self_attn:q") matches by its own key or by its
                    # node's value name (a rule for "self_attn" covers all its extras)
                    and any(
                        fnmatch.fnmatchcase(t, self.tensor) for t in {tensor, tensor.split(":")[0]}
                    )
                )
            )
        )


@dataclass
class CompressionConfig:
    default: Codec | None = None
    rules: list[Rule] = field(default_factory=list)
    masks: bool = True
    first_only: bool = False  # dct-first: only the first compressible activation
    source: str | None = None  # the config file, if any
    sha256: str | None = None
    derivatives: bool = False  # few-bit derivative codes where the registry offers them
    #: remake the outputs of cheap ops (registry ``recompute``) in the backward from what is
    #: kept anyway, instead of keeping them (unroller.compiler.stash.plan_recompute)
    recompute: bool = False
    #: saved tensors (globs on their names) that ``recompute`` keeps as the scheme says
    #: instead of remaking them: those whose remaking would raise the step's predicted peak
    #: (``unroller.analysis.recompute_guard`` chooses them), or what a config file names
    recompute_keep: tuple[str, ...] = ()
    #: segment recompute: the top-level block instances whose forward runs again in the
    #: backward, keeping only their inputs from the forward pass (``"blocks"``: all that
    #: can be; else globs on instance names; unroller.compiler.stash.plan_segments)
    segments: tuple[str, ...] = ()
    #: the recomputed segments run in pieces of at most this many samples (0: whole, or
    #: as --segment-pieces / --segment-piece-size say; those win over the config)
    segment_piece_size: int = 0
    #: selective segment recompute: statements of the recomputed segments whose forward is
    #: not run again (``"matmuls"``: the matrix products, ``stash.MATMUL_FLOPS``; else globs
    #: on node names): the forward keeps what they make in the scheme's forms, and the
    #: recompute starts from it (unroller.compiler.stash.kept_statements)
    segment_keep: tuple[str, ...] = ()

    @property
    def lossy(self) -> bool:
        """Whether any activation may be kept lossily (a default or rule compressor, or
        derivative codes): then bit-identity with autograd is not promised."""
        return (
            self.default is not None
            or self.derivatives
            or any(rule.codec is not None for rule in self.rules)
        )

    def choose(self, op: str, node: str, shape: tuple, tensor: str | None = None) -> Codec | None:
        codec = self.default
        for rule in self.rules:
            if rule.matches(op, node, tensor):
                codec = rule.codec
        return codec if codec is not None and codec.applies_to(shape) else None

    def choose_why(
        self, op: str, node: str, shape: tuple, layout: str = MAP, tensor: str | None = None
    ) -> tuple[Codec | None, str]:
        """The codec for one saved activation as it applies to it (``Codec.fit``), or None
        and why it stays raw, in words for ``unroll graph``'s stash table."""
        codec, why = self.default, "the scheme compresses no activations"
        if self.default is None and (self.rules or self.source):
            why = "no compressor for it (the config's default is none)"
        for rule in self.rules:
            if rule.matches(op, node, tensor):
                codec = rule.codec
                why = f"compressor none (rule at line {rule.line})"
        if codec is None:
            return None, why
        return codec.fit(shape, layout)


def builtin(scheme: str) -> CompressionConfig:
    if scheme == "nocompress":
        return CompressionConfig()
    if scheme == "dct-dense":
        return CompressionConfig(default=make_codec("dct", {}, min_size=8))
    if scheme == "dct-first":
        return CompressionConfig(default=make_codec("dct", {}), first_only=True)
    if scheme == "quant":
        return CompressionConfig(default=make_codec("quant", {"bits": 8}), derivatives=True)
    if scheme == AUTO:
        raise ConfigError(
            "the auto scheme is planned per model: "
            "unroller.api.compression_config(options, graph) or unroller.analysis.search.auto_config(graph)"
        )
    raise ConfigError(f"unknown scheme '{scheme}' (known: {', '.join(SCHEMES)})")


def disabled() -> CompressionConfig:
    """--opt-level 0: no compression and no masks, whatever the scheme or config."""
    return CompressionConfig(masks=False)


# -- config files ----------------------------------------------------------------------

MAX_CONFIG_BYTES = 1 << 20
"""A compression config is a few lines; anything above 1 MiB is refused unread."""
MAX_INT = 1 << 16
"""The largest magnitude an integer in a config may have (parameters, ``min_size``)."""
MAX_NAME = 200
"""The longest ``name`` glob a rule may have."""
MAX_WORD = 64
"""The longest string value a compressor parameter may have."""
MAX_RULES = 1000
"""The most rules a config may have (each one is described in the generated module)."""
MASK_CODECS = frozenset({"bits"})
"""Registered compressors that are not for activations: ``bits`` is the lossless 1-bit codec
of boolean masks, turned on by ``masks = true``."""
DERIVATIVE_CODECS = frozenset({"fewbit"})
"""Registered compressors that keep an activation's derivative, not the activation: only for
the ops whose registry entry offers it (``derivative``), turned on by ``derivatives = true``."""

_TOP_KEYS = (
    "masks",
    "derivatives",
    "recompute",
    "recompute_keep",
    "recompute_segments",
    "segment_piece_size",
    "segment_keep",
    "default",
    "rule",
)
_GLOB_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.*?[]!-")
_WORD = re.compile(r"[A-Za-z0-9_.+-]*\Z")
_SIMPLE = re.compile(r"[A-Za-z0-9_.*?\[\]!+ -]{0,60}\Z")
_TOML_POSITION = re.compile(r"(?s)(.*) \(at (?:line (\d+), column (\d+)|end of document)\)\Z")


def activation_compressors() -> tuple[str, ...]:
    """The compressor names a config may use, ``"none"`` last."""
    from unroller.compress import COMPRESSORS

    special = MASK_CODECS | DERIVATIVE_CODECS
    return (*(n for n in COMPRESSORS if n not in special), "none")


def _show(value: Any) -> str:
    """A user string (or other value) for a message: quoted, escaped if unusual, cut short."""
    if isinstance(value, str) and _SIMPLE.match(value):
        return f"'{value}'"
    text = ascii(value)
    return text if len(text) <= 64 else text[:60] + "...'"


def _kind(value: Any) -> str:
    """What a TOML value is, in words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date or time"


def _position(line_starts: list[int], offset: int, length: int = 1) -> Loc:
    """The ``Loc`` of a character offset, given the offsets at which lines start."""
    line = bisect.bisect_right(line_starts, offset)
    return Loc(line, offset - line_starts[line - 1] + 1, max(1, length))


class _Locator:
    """Where the keys, values and table headers of a TOML document are.

    tomllib gives no positions, so this scans the source (which tomllib has accepted) once
    and records, for each path of keys and array indices (``("rule", 2, "bits")``), the
    offset and length of its key and of its value. ``[[rule]]`` headers count the array
    elements; dotted keys, quoted keys, inline tables, arrays (of inline tables too),
    multi-line strings and comments are understood. Lookups fall back to the closest
    enclosing key or header, and to line 1, column 1."""

    def __init__(self, text: str):
        self.text = text
        self.keys: dict[tuple, tuple[int, int]] = {}
        self.values: dict[tuple, tuple[int, int]] = {}
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.complete = False  # whether the scan understood the whole document
        try:
            self._document()
            self.complete = True
        except (ValueError, IndexError, KeyError, RecursionError, tomllib.TOMLDecodeError):
            pass  # a scanner bug costs precision, never the error itself

    # lookups -----------------------------------------------------------------------------

    def loc(self, offset: int, length: int = 1) -> Loc:
        return _position(self.line_starts, offset, length)

    def key(self, path: tuple) -> Loc:
        """The key (or table header) at ``path``, else the closest enclosing one."""
        for end in range(len(path), 0, -1):
            found = self.keys.get(path[:end]) or self.values.get(path[:end])
            if found:
                return self.loc(*found)
        return Loc(1, 1)

    def value(self, path: tuple) -> Loc:
        """The value at ``path``, else its key, else the closest enclosing key or header."""
        found = self.values.get(path)
        return self.loc(*found) if found else self.key(path)

    # scanning ----------------------------------------------------------------------------

    def _skip(self, i: int, newlines: bool = True) -> int:
        """Past blanks (and line breaks and comments if ``newlines``)."""
        text, n = self.text, len(self.text)
        while i < n:
            c = text[i]
            if c in " \t" or (newlines and c in "\r\n"):
                i += 1
            elif c == "#" and newlines:
                j = text.find("\n", i)
                i = n if j < 0 else j + 1
            else:
                break
        return i

    @staticmethod
    def _progress(before: int, after: int) -> int:
        """``after``, which must be past ``before`` (a scan that stands still is a bug)."""
        if after <= before:
            raise ValueError("the scan does not advance")
        return after

    def _record(self, table: dict, path: tuple, span: tuple[int, int]) -> None:
        table.setdefault(path, span)

    def _document(self) -> None:
        text, n = self.text, len(self.text)
        prefix: tuple = ()
        arrays: dict[tuple, int] = {}  # array-of-tables path -> elements so far
        i = self._skip(0)
        while i < n:
            if text[i] == "[":
                array = text.startswith("[[", i)
                parts, j = self._key(self._skip(i + (2 if array else 1), False))
                j = self._skip(j, False)
                if not text.startswith("]]" if array else "]", j):
                    raise ValueError("expected the end of a table header")
                j += 2 if array else 1
                span = (i, j - i)
                path: tuple = ()
                for index, (name, _start, _end) in enumerate(parts):
                    path += (name,)
                    last = index == len(parts) - 1
                    if last and array:
                        self._record(self.keys, path, span)
                        self._record(self.values, path, span)
                        arrays[path] = arrays.get(path, 0) + 1
                        path += (arrays[path] - 1,)
                    elif path in arrays:
                        path += (arrays[path] - 1,)
                    self._record(self.keys, path, span)
                self._record(self.values, path, span)
                prefix = path
                i = j
            else:
                i = self._progress(i, self._pair(i, prefix))
            i = self._skip(i)

    def _pair(self, i: int, prefix: tuple) -> int:
        """``key = value`` at ``i`` inside the table at ``prefix``; returns the offset after."""
        parts, i = self._key(i)
        path = prefix
        for name, start, end in parts:
            path += (name,)
            self._record(self.keys, path, (start, end - start))
        i = self._skip(i, False)
        if self.text[i] != "=":
            raise ValueError("expected '='")
        return self._value(self._skip(i + 1, False), path)

    def _key(self, i: int) -> tuple[list[tuple[str, int, int]], int]:
        """A dotted key at ``i``: its parts as (name, start, end), and the offset after."""
        text = self.text
        parts = []
        while True:
            start = i
            if text[i] in "\"'":
                i = self._string(i)
                name = tomllib.loads(f"k = {text[start:i]}")["k"]
            else:
                while i < len(text) and (
                    text[i].isascii() and (text[i].isalnum() or text[i] in "_-")
                ):
                    i += 1
                if i == start:
                    raise ValueError("expected a key")
                name = text[start:i]
            parts.append((name, start, i))
            j = self._skip(i, False)
            if j < len(text) and text[j] == ".":
                i = self._skip(j + 1, False)
            else:
                return parts, i

    def _string(self, i: int) -> int:
        """The offset after the string (any of the four kinds) that starts at ``i``."""
        text = self.text
        quote = text[i]
        if text.startswith(quote * 3, i):
            j = i + 3
            while j < len(text):
                if quote == '"' and text[j] == "\\":
                    j += 2
                elif text.startswith(quote * 3, j):
                    end = j + 3
                    while end < min(len(text), j + 5) and text[end] == quote:
                        end += 1  # up to two quotes may end the content
                    return end
                else:
                    j += 1
            raise ValueError("an unterminated string")
        j = i + 1
        while text[j] != quote:
            j += 2 if quote == '"' and text[j] == "\\" else 1
        return j + 1

    def _value(self, i: int, path: tuple) -> int:
        """The value at ``i`` (recorded under ``path``, its parts too); the offset after."""
        text = self.text
        c = text[i]
        if c in "\"'":
            end = self._string(i)
        elif c == "[":
            end, index = self._skip(i + 1), 0
            while text[end] != "]":
                end = self._skip(self._progress(end, self._value(end, path + (index,))))
                index += 1
                if text[end] == ",":
                    end = self._skip(end + 1)
            end += 1
        elif c == "{":
            end = self._skip(i + 1)
            while text[end] != "}":
                end = self._skip(self._progress(end, self._pair(end, path)))
                if text[end] == ",":
                    end = self._skip(end + 1)
            end += 1
        else:
            end = i
            while end < len(text) and text[end] not in ",]}#\n":
                end += 1
            end = len(text[i:end].rstrip()) + i
        self._record(self.values, path, (i, end - i))
        return end


def _read(path: Path) -> bytes:
    """The bytes of a config file, refusing what is not a small regular file (never blocking
    on a FIFO or a device: ``unroller.files.read_bounded``), in the config's own words."""
    label = str(path)

    def fail(message: str) -> ConfigFileError:
        return ConfigFileError(message, None, label, "")

    try:
        return read_bounded(path, MAX_CONFIG_BYTES, label)
    except NotRegularFile as exc:
        if exc.opened:  # swapped for something else after the check
            raise fail("not a regular file; expected a TOML file") from None
        if stat.S_ISDIR(exc.mode):
            raise fail("this is a directory, not a compression config file") from None
        raise fail("not a regular file (a FIFO, socket or device?); expected a TOML file") from None
    except FileTooLarge as exc:
        if exc.size is None:  # grew past the limit while read
            raise fail(f"the compression config is over {MAX_CONFIG_BYTES} bytes") from None
        raise fail(
            f"the compression config is {exc.size} bytes; at most {MAX_CONFIG_BYTES} are read"
        ) from None
    except FileNotFoundError:
        raise fail("no such compression config file") from None
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise fail(f"cannot read the compression config: {why}") from None


def _decode(data: bytes, label: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped, CRLF line ends made LF)."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        loc = Loc(
            data.count(b"\n", 0, exc.start) + 1,
            len(data[line_start : exc.start].decode("utf-8")) + 1,
        )
        bad = data[exc.start : exc.end].hex(" ")
        raise ConfigFileError(
            f"the compression config is not UTF-8 text: bytes {bad} ({exc.reason})",
            loc,
            label,
            _displayable(data.decode("utf-8", "replace")),
        ) from None
    return text.replace("\r\n", "\n")


def _displayable(text: str) -> str:
    """``text`` with every character Python does not call printable (controls, bidi marks,
    line separators, unassigned code points...) but tab and newline replaced by U+FFFD, one
    for one so that columns stay right: a diagnostic's source line must not drive the
    terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\t\n" else "\ufffd" for c in text)


def _parse(text: str, label: str) -> dict[str, Any]:
    def fail(message: str, loc: Loc) -> ConfigFileError:
        return ConfigFileError(message, loc, label, _displayable(text))

    def near(pattern: str) -> Loc:
        found = re.search(pattern, text)
        if not found:
            return Loc(1, 1)
        return _position([0] + [m.end() for m in re.finditer("\n", text)], found.start())

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_POSITION.match(str(exc))
        message = match.group(1) if match else str(exc)
        message = f"invalid TOML: {message[:1].lower()}{message[1:]}"
        lines = text.split("\n")
        if match and match.group(2):
            line, col = int(match.group(2)), int(match.group(3))
        else:  # at the end of the document: just after the last non-blank line
            line = len(text.rstrip().split("\n"))
            col = len(lines[line - 1]) + 1
        if message.startswith("invalid TOML: unescaped '\\'") and col > 2:
            col -= 2  # tomllib points just past the bad escape
        elif message.startswith(("invalid TOML: cannot overwrite", "invalid TOML: cannot declare")):
            if line <= len(lines):  # tomllib points at the line's end: show its key
                col = len(lines[line - 1]) - len(lines[line - 1].lstrip(" \t")) + 1
        loc = Loc(line, col)
        raise fail(message, loc) from None
    except RecursionError:
        raise fail("arrays or tables nested too deeply", near(r"[\[{](\s*[\[{]){15}")) from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        message = f"invalid TOML: {str(exc).split(';')[0]}"
        raise fail(message, near(r"[0-9_]{100}")) from None


class _Checker:
    """Turns parsed TOML into a ``CompressionConfig``; every problem is a ``ConfigFileError``
    at the offending key or value."""

    def __init__(self, label: str, text: str):
        self.label = label
        self.text = text
        self.where = _Locator(text)

    def fail_at(self, message: str, loc: Loc, hint: str | None = None) -> ConfigFileError:
        return ConfigFileError(message, loc, self.label, _displayable(self.text), hint)

    def at_key(self, path: tuple, message: str, hint: str | None = None) -> ConfigFileError:
        return self.fail_at(message, self.where.key(path), hint)

    def at_value(self, path: tuple, message: str, hint: str | None = None) -> ConfigFileError:
        return self.fail_at(message, self.where.value(path), hint)

    def unknown(self, path: tuple, known: tuple[str, ...], expected: str) -> ConfigFileError:
        key = path[-1]
        return self.at_key(path, f"unknown key {_show(key)}{did_you_mean(key, known)}; {expected}")

    def config(self, data: dict[str, Any]) -> CompressionConfig:
        if not data:
            raise self.fail_at(
                "the compression config sets nothing; expected masks, [default] or [[rule]]",
                Loc(1, 1),
            )
        for key in data:
            if key not in _TOP_KEYS:
                raise self.unknown((key,), _TOP_KEYS, "expected masks, [default] or [[rule]]")
        masks = data.get("masks", True)
        if not isinstance(masks, bool):
            raise self.at_value(("masks",), f"'masks' must be true or false, not {_kind(masks)}")
        derivatives = data.get("derivatives", False)
        if not isinstance(derivatives, bool):
            raise self.at_value(
                ("derivatives",), f"'derivatives' must be true or false, not {_kind(derivatives)}"
            )
        recompute = data.get("recompute", False)
        if not isinstance(recompute, bool):
            raise self.at_value(
                ("recompute",), f"'recompute' must be true or false, not {_kind(recompute)}"
            )
        segments = self.segments(data.get("recompute_segments", []))
        keep = self.globs(data.get("recompute_keep", []), "recompute_keep", "saved tensor")
        piece_size = data.get("segment_piece_size", 0)
        if isinstance(piece_size, bool) or not isinstance(piece_size, int):
            raise self.at_value(
                ("segment_piece_size",),
                f"'segment_piece_size' must be a whole number of samples, not {_kind(piece_size)}",
            )
        if not 0 <= piece_size <= 4096 or (piece_size and not segments):
            raise self.at_value(
                ("segment_piece_size",),
                f"'segment_piece_size' is {piece_size}: from 1 to 4096 samples, with "
                "recompute_segments (0: whole segments)",
            )
        segment_keep = self.segment_keep(data.get("segment_keep", []), segments)
        default = None
        if "default" in data:
            table = data["default"]
            if not isinstance(table, dict):
                raise self.at_value(
                    ("default",), f"'default' must be a table ([default]), not {_kind(table)}"
                )
            default = self.codec(table, ("default",), ())
        raw_rules = data.get("rule", [])
        if not isinstance(raw_rules, list):
            raise self.at_value(
                ("rule",),
                f"rules are written [[rule]] (an array of tables), not {_kind(raw_rules)}",
            )
        if len(raw_rules) > MAX_RULES:
            raise self.at_key(
                ("rule", MAX_RULES), f"too many rules: {len(raw_rules)} (at most {MAX_RULES})"
            )
        rules = [self.rule(table, ("rule", i)) for i, table in enumerate(raw_rules)]
        return CompressionConfig(
            default=default,
            rules=rules,
            masks=masks,
            derivatives=derivatives,
            recompute=recompute,
            recompute_keep=keep,
            segments=segments,
            segment_piece_size=piece_size,
            segment_keep=segment_keep,
            source=self.label,
            sha256=hashlib.sha256(self.text.encode("utf-8")).hexdigest(),
        )

    def segments(self, value: Any) -> tuple[str, ...]:
        """``recompute_segments``: "blocks", or a list of globs on block instance names."""
        path = ("recompute_segments",)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise self.at_value(
                path,
                "'recompute_segments' must be \"blocks\" or a list of block instance names "
                f"(globs), not {_kind(value)}",
            )
        if len(items) > MAX_RULES:
            raise self.at_value(path, f"too many segments: {len(items)} (at most {MAX_RULES})")
        for item in items:
            if item == "auto":
                raise self.at_value(
                    path,
                    "recompute_segments 'auto' is for --scheme auto and unroll plan; a config "
                    "names the block instances",
                )
            if not item or len(item) > MAX_NAME or not set(item) <= _GLOB_CHARS:
                raise self.at_value(
                    path,
                    f"bad segment {_show(item)}: a block instance name or glob of at most "
                    f"{MAX_NAME} letters, digits and _ . * ? [ ] ! -",
                )
        return tuple(dict.fromkeys(items))

    def segment_keep(self, value: Any, segments: tuple[str, ...]) -> tuple[str, ...]:
        """``segment_keep``: "matmuls", or a list of globs on node names (which may hold
        "matmuls"), only beside ``recompute_segments``."""
        items = self.globs([value] if isinstance(value, str) else value, "segment_keep", "node")
        if items and not segments:
            raise self.at_key(
                ("segment_keep",),
                "'segment_keep' names statements inside recomputed segments: it needs "
                "recompute_segments",
            )
        return items

    def globs(self, value: Any, key: str, what: str) -> tuple[str, ...]:
        """A list of name globs (``recompute_keep``): at most ``MAX_RULES``, each a glob of
        the characters a rule's ``name`` may hold."""
        path = (key,)
        if not isinstance(value, list) or not all(isinstance(i, str) for i in value):
            raise self.at_value(
                path, f"'{key}' must be a list of {what} names (globs), not {_kind(value)}"
            )
        if len(value) > MAX_RULES:
            raise self.at_value(path, f"too many names: {len(value)} (at most {MAX_RULES})")
        for item in value:
            if not item or len(item) > MAX_NAME or not set(item) <= _GLOB_CHARS:
                raise self.at_value(
                    path,
                    f"bad {what} name {_show(item)}: a name or glob of at most {MAX_NAME} "
                    "letters, digits and _ . * ? [ ] ! -",
                )
        return tuple(dict.fromkeys(value))

    def rule(self, table: Any, path: tuple) -> Rule:
        if not isinstance(table, dict):
            raise self.at_value(
                path, f"each rule must be a table ([[rule]] or {{...}}), not {_kind(table)}"
            )
        op = table.get("op")
        if op is not None:
            self.check_op(op, path + ("op",))
        name = table.get("name")
        if name is not None:
            self.check_glob(name, path + ("name",))
        tensor = table.get("tensor")
        if tensor is not None:
            self.check_glob(tensor, path + ("tensor",), "tensor")
        codec = self.codec(table, path, ("op", "name", "tensor"))
        line = self.where.key(path + ("compressor",)).line
        return Rule(codec, op, name, line, tensor)

    def check_op(self, op: Any, path: tuple) -> None:
        if not isinstance(op, str):
            raise self.at_value(path, f"'op' must be a string (an op name), not {_kind(op)}")
        from unroller.compiler.registry import load_registry

        ops = load_registry()
        if op not in ops:
            raise self.at_value(path, f"unknown op {_show(op)} in a rule{did_you_mean(op, ops)}")

    def check_glob(self, name: Any, path: tuple, key: str = "name") -> None:
        what = "node" if key == "name" else "tensor"
        if not isinstance(name, str):
            raise self.at_value(
                path, f"'{key}' must be a string (a glob on {what} names), not {_kind(name)}"
            )
        if not name:
            raise self.at_value(path, f"'{key}' is empty; expected a glob such as \"layer4.*\"")
        if len(name) > MAX_NAME:
            raise self.at_value(path, f"'{key}' is {len(name)} characters long; at most {MAX_NAME}")
        # a saved tensor's key may name an extra output of its node ("self_attn:q"), which
        # unroll plan writes for attention's q, k, v
        allowed = _GLOB_CHARS | {":"} if key == "tensor" else _GLOB_CHARS
        bad = next((c for c in name if c not in allowed), None)
        if bad is not None:
            raise self.at_value(
                path,
                f"'{key}' {_show(name)} contains {ascii(bad)}, which no {what} name has",
                "a name glob has letters, digits, '_' and '.', and the glob characters "
                "'*', '?', '[', ']', '!' and '-'"
                + (" (a tensor's also ':')" if key == "tensor" else ""),
            )

    def codec(self, table: dict[str, Any], path: tuple, extra: tuple[str, ...]) -> Codec | None:
        from unroller.compress import get

        names = activation_compressors()
        if "compressor" not in table:
            raise self.at_key(
                path, f"missing 'compressor' (one of {', '.join(repr(n) for n in names)})"
            )
        name = table["compressor"]
        where = path + ("compressor",)
        if not isinstance(name, str):
            raise self.at_value(where, f"'compressor' must be a string, not {_kind(name)}")
        if name in MASK_CODECS:
            raise self.at_value(
                where,
                f"{_show(name)} is the 1-bit codec of boolean masks, not a compressor of "
                f"activations; use one of {', '.join(names)}",
                "'masks = true' (the default) already packs masks into bits",
            )
        if name in DERIVATIVE_CODECS:
            raise self.at_value(
                where,
                f"{_show(name)} keeps an activation's derivative, not the activation; use one "
                f"of {', '.join(names)}",
                "'derivatives = true' turns it on for the ops whose registry entry offers it",
            )
        if name not in names:
            raise self.at_value(
                where,
                f"unknown compressor {_show(name)}{did_you_mean(name, names)}; "
                f"known: {', '.join(names)}",
            )
        spec = {} if name == "none" else get(name).PARAMS
        allowed = (*extra, "compressor", *(() if name == "none" else ("min_size",)), *spec)
        params: dict[str, Any] = {}
        min_size = 0
        for key, value in table.items():
            at = path + (key,)
            if key in extra or key == "compressor":
                continue
            if key not in allowed:
                if name == "none":
                    raise self.at_key(
                        at, f'unknown key {_show(key)} (compressor "none" takes no parameters)'
                    )
                raise self.unknown(at, allowed, f"allowed here: {', '.join(allowed)}")
            if key == "min_size":
                min_size = self.check_min_size(value, at)
            else:
                params[key] = self.check_param(key, value, at)
        if name == "none":
            return None
        try:
            return make_codec(name, params, min_size)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            bad = getattr(exc, "param", None)  # compress.ParamError names its parameter
            if bad not in params:
                bad = next((k for k in params if f"'{k}'" in message), None)
            if bad is None:
                raise self.at_value(where, message) from None
            raise self.at_value(path + (bad,), message) from None

    def check_min_size(self, value: Any, path: tuple) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.at_value(path, f"'min_size' must be an integer, not {_kind(value)}")
        if not 0 <= value <= MAX_INT:
            raise self.at_value(path, f"'min_size' must be between 0 and {MAX_INT}, not {value}")
        return value

    def check_param(self, key: str, value: Any, path: tuple) -> Any:
        """A parameter value as plain data: a boolean, a bounded integer, a finite float or a
        short word; the compressor checks the rest."""
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            if abs(value) > MAX_INT:
                which = "large" if value > 0 else "small"
                raise self.at_value(
                    path, f"{_show(key)} = {value} is too {which} (at most {MAX_INT} in size)"
                )
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise self.at_value(path, f"{_show(key)} must be a finite number, not {value}")
            return value
        if isinstance(value, str):
            if len(value) > MAX_WORD or not _WORD.match(value):
                raise self.at_value(
                    path,
                    f"{_show(key)} = {_show(value)} is not a parameter value "
                    f"(a word of at most {MAX_WORD} letters, digits, '_', '.', '+', '-')",
                )
            return value
        raise self.at_value(
            path,
            f"{_show(key)} must be a boolean, an integer, a float or a string, not {_kind(value)}",
        )


def load_config(path: str | Path) -> CompressionConfig:
    """Read and check a compression config (TOML). Every problem is a ``ConfigFileError``
    (a ``ConfigError``) formatted ``FILE:LINE:COL: error: ...`` with the source line and a
    caret, like an error in a model file; problems with the file as a whole (missing, a
    directory, too big) are ``FILE: error: ...``."""
    path = Path(path)
    label = str(path)
    text = _decode(_read(path), label)
    data = _parse(text, label)  # first: the locator scans only documents tomllib accepts
    return _Checker(label, text).config(data)


def resolve(scheme: str, config: str | Path | None = None, opt_level: int = 1) -> CompressionConfig:
    """The compression config for a scheme name, a config file, and an opt level."""
    if opt_level not in (0, 1):
        raise ConfigError(f"--opt-level must be 0 or 1, got {opt_level}")
    chosen = load_config(config) if config is not None else builtin(scheme)
    return disabled() if opt_level == 0 else chosen
