"""The compressor interface, parameter specifications and shared tensor helpers.

A compressor turns one saved activation ``t`` of shape ``(N, *shape)`` into a tuple of tensors
(its packed form, batch dimension first in every tensor) and back. The generated training code
calls ``compress`` right after the forward op that produced ``t`` and ``decompress`` right before
the backward step that reads it, both under ``torch.no_grad()``.

Each compressor has two formulations that give bit-identical packed forms and decompressed
tensors:

- the IPU-safe one, written with the operations that PopTorch can run on a Graphcore IPU
  (matmul, reshape, permute, gather/index_select, scatter, pad, cat, where, round, clamp,
  amax/amin, arithmetic, bitwise and/or, comparisons, casts): no Python loops over data, no
  data-dependent shapes and no autograd machinery. Bit packing uses multiplication and floor
  division by powers of two rather than shift operators, which PopTorch does not list;
- a fast one for CPU and CUDA tensors (``use_fast_path``): in-place arithmetic on cache-sized
  blocks, codes packed with shifts on wider integer views (numpy's packbits for 1-bit masks
  on the CPU), and on the CPU host-side checks that skip the steps for huge or non-finite
  values when no group needs them. Its functions are marked host-only for ``unroll lint``:
  they never run on an IPU.

While ``torch.compile`` traces (``Model(compile=True)``), a third formulation runs for CPU and
CUDA tensors (``use_compiled_path``): whole-tensor elementwise chains that the compiler fuses
into a few loops, with no host-side checks, numpy, in-place updates or buffers, written with
the operations its CPU code generator vectorises (codes unpacked with int32 shifts and masks,
packed with shifted slices, NaN tested as ``x != x``). It gives the same packed bytes and
decompressed values as the others.

The IPU-safe formulation runs for tensors on any other device (``ipu`` under PopTorch), while
``torch.jit`` traces, and everywhere when the module flag ``IPU_SAFE`` is True.
"""

from __future__ import annotations

import abc
import math
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "Compressor",
    "ParamError",
    "ParamSpec",
    "packed_nbytes",
    "work_dtype",
    "LOW_PRECISION",
    "WIDEN_ELEMENTS",
    "is_low_precision",
    "widen_elements",
    "widen_spans",
    "pack_codes",
    "unpack_codes",
    "packed_code_bytes",
    "cached_constant",
    "IPU_SAFE",
    "use_fast_path",
    "use_compiled_path",
    "pack_codes_compiled",
    "unpack_codes_compiled",
    "zero_nan_compiled",
    "float_constant_compiled",
    "host_constant",
    "is_compiling",
    "host_checks",
    "native_library",
    "native_path",
    "native_threads",
    "remember_plan",
    "skip_checks",
    "pack_codes_fast",
    "unpack_codes_fast",
    "pack_flat",
    "row_blocks",
    "saturate",
    "saturate_fast",
    "CHUNK_ELEMENTS",
    "CHECK_ELEMENTS",
    "THREAD_ELEMENTS",
]

IPU_SAFE = False
"""True: every compressor runs its IPU-safe formulation on every device (the one used for
tensors that are not on "cpu" or "cuda"). Read at each call; the results are bit-identical
either way, only the speed differs."""

_FAST_DEVICES = ("cpu", "cuda")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ParamError(ValueError):
    """A bad or unknown compressor parameter. ``param`` is its name (also in the message, in
    quotes), for callers that point at the offending config entry."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a compressor: its type, default, allowed values and a one-line doc.

    ``type`` is ``int``, ``bool`` or ``str``; ``choices`` (if given) lists the allowed values;
    ``min``/``max`` bound an ``int``; ``optional`` also allows ``None``. Checks that involve
    several parameters (``keep <= block``) live in ``Compressor.check_params``.

    Types are strict: an ``int`` parameter refuses bools, floats (8.0, NaN, inf), strings and
    other integer-like objects; a ``bool`` one refuses 0 and 1; a ``str`` one refuses
    anything but a ``str``. Every refusal is a ValueError whose message names the parameter
    in quotes (``'block'``), which the config loader maps back to the config line.
    """

    type: type
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    min: int | None = None
    max: int | None = None
    optional: bool = False

    def allowed(self) -> str:
        """The allowed values in words, e.g. ``one of 8, 4, 2`` or ``an int >= 1 or None``."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.type is bool:
            text = "True or False"
        elif self.type is int:
            parts = []
            if self.min is not None:
                parts.append(f">= {self.min}")
            if self.max is not None:
                parts.append(f"<= {self.max}")
            text = "an int" + (" " + " and ".join(parts) if parts else "")
        else:
            text = f"a {self.type.__name__}"
        return text + (" or None" if self.optional else "")

    def describe(self) -> str:
        """One line for generated docs: ``allowed values, default X: doc``."""
        return f"{self.allowed()}, default {self.default!r}: {self.doc}"

    def check(self, owner: str, name: str, value: Any) -> Any:
        """Return ``value`` if it is allowed, else raise a ValueError naming the parameter."""
        if value is None and self.optional:
            return None
        shown = repr(value)
        if len(shown) > 60:  # a huge string or number: enough to recognise it
            shown = shown[:40] + f"... ({len(shown)} characters)"
        bad = ParamError(
            f"{owner}: bad value {shown} for parameter {name!r}: expected {self.allowed()}", name
        )
        # bool is a subclass of int: keep True out of int parameters and 1 out of bool ones.
        if self.type is bool:
            if not isinstance(value, bool):
                raise bad
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad
            if self.min is not None and value < self.min:
                raise bad
            if self.max is not None and value > self.max:
                raise bad
        elif not isinstance(value, self.type):
            raise bad
        if self.choices is not None and value not in self.choices:
            raise bad
        return value


class Compressor(abc.ABC):
    """Abstract compressor of saved activations.

    Subclasses set ``name``, ``PARAMS`` and ``lossless`` and implement ``compress``,
    ``decompress`` and ``stored_bytes``:

    - ``compress(t)`` returns the packed form: a tuple of tensors, each with dim 0 = N.
    - ``decompress(packed, shape, dtype)`` takes the per-sample shape ``t.shape[1:]`` and
      returns a tensor of shape ``(N, *shape)`` and dtype ``dtype`` on packed's device.
    - ``stored_bytes(shape, dtype)`` takes the FULL shape and equals exactly
      ``packed_nbytes(self.compress(t))`` for any ``t`` of that shape and dtype.
    """

    name: ClassVar[str]
    PARAMS: ClassVar[dict[str, ParamSpec]] = {}
    lossless: ClassVar[bool] = False
    #: FLOPs per element one compress and one decompress spend together, for the IPU step
    #: estimate (``unroller.analysis.estimate``): a scale, round and clamp unless a codec says more
    flops: ClassVar[float] = 8.0

    def __init__(self, **params: Any) -> None:
        self.params: dict[str, Any] = type(self).validate_params(params)

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Check ``params`` (e.g. from a config file) and return them with defaults filled in,
        in ``PARAMS`` order. Raises ValueError naming any unknown or bad parameter."""
        unknown = [k for k in params if k not in cls.PARAMS]
        if unknown:
            known = ", ".join(cls.PARAMS) or "none"
            raise ParamError(
                f"{cls.__name__}: unknown parameter {unknown[0]!r}; allowed parameters: {known}",
                unknown[0],
            )
        out = {
            k: spec.check(cls.__name__, k, params.get(k, spec.default))
            for k, spec in cls.PARAMS.items()
        }
        cls.check_params(out)
        return out

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Checks between parameters; subclasses raise ValueError here."""
        return None

    @classmethod
    def param_docs(cls) -> list[str]:
        """Markdown bullet lines describing each parameter (for generated docs)."""
        return [f"- `{k}`: {spec.describe()}" for k, spec in cls.PARAMS.items()]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.params == self.params  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.params.items())))

    @abc.abstractmethod
    def compress(self, t: Tensor) -> tuple[Tensor, ...]:
        """The packed form of ``t``: tensors only, batch dimension first in each."""

    @abc.abstractmethod
    def decompress(
        self, packed: tuple[Tensor, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        """Rebuild a tensor of shape ``(N, *shape)`` and dtype ``dtype`` from ``packed``."""

    @abc.abstractmethod
    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes ``compress`` stores for a tensor of full shape ``shape`` and dtype ``dtype``."""

    # helpers for subclasses -------------------------------------------------------------

    def _float_input(self, t: Tensor) -> None:
        if not isinstance(t, Tensor):
            raise ValueError(f"{self!r}: expected a torch.Tensor, got {type(t).__name__}")
        self._float_dtype(t.dtype)
        if t.dim() < 1:
            raise ValueError(f"{self!r}: expected a batch dimension, got a 0-d tensor")

    def _float_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{self!r}: unsupported dtype {dtype}; expected one of "
                "float32, float64, float16, bfloat16"
            )


def packed_nbytes(packed: tuple[Tensor, ...]) -> int:
    """Bytes held by a packed form: the sum of numel * element_size over its tensors."""
    return sum(p.numel() * p.element_size() for p in packed)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype compressors compute in: float64 for float64 data, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


LOW_PRECISION = (torch.float16, torch.bfloat16)
"""The 2-byte float dtypes (``--precision bf16-mixed`` and the like save activations in
them). Their work dtype is float32; the codecs never widen a whole tensor of them to it."""

WIDEN_ELEMENTS = 1 << 20
"""Elements of a float16 / bfloat16 tensor that a codec widens to float32 at once, where its
arithmetic must run in float32: the native kernels read and write float32, and the DCT's
matrix products run in float32 (in bfloat16 every partial transform would be rounded to 8
bits, far more than the input's own rounding). Such work goes a span of at most this many
elements at a time (4 MiB of float32; times the threads a native kernel runs, each of which
gets about this many), so no float32 copy of a whole large activation is ever alive: the
low-precision tensor is read where it lies. A span never splits a DCT plane (one larger
than this is widened alone) nor a quantisation group (a group larger than this skips the
native kernel: the PyTorch fast path reads it as it is, min and max first, then blocks).
Read at each call (the tests make it small); the results do not depend on it (the DCT's
products are taken per span, whose sizes all formulations share)."""


def widen_elements() -> int:
    """``WIDEN_ELEMENTS`` as it is now (read at each call, so that tests can make it small)."""
    return WIDEN_ELEMENTS


def is_low_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (see ``LOW_PRECISION``)."""
    return dtype in LOW_PRECISION


def widen_spans(  # unroller-lint: host-only (native path)
    n: int, m: int, step: int, budget: int
) -> list[tuple[int, int, int, int]]:
    """(i0, i1, j0, j1): spans of an [n, m] tensor (samples i0..i1, elements j0..j1 of each)
    of at most ``budget`` elements each, in row-major order, to widen to float32 one at a
    time. Whole samples while one fits the budget; else pieces of one sample whose lengths
    are multiples of ``step`` (a whole number of groups and of code bytes: every span's
    codes start at a byte of the packed form), only the last piece shorter. ``step`` must
    be at most ``budget``."""
    if m <= budget:
        rows = max(1, budget // max(m, 1))
        return [(i, min(n, i + rows), 0, m) for i in range(0, n, rows)]
    width = budget // step * step
    return [(i, i + 1, j, min(m, j + width)) for i in range(n) for j in range(0, m, width)]


_CONSTANTS: dict[Hashable, Tensor] = {}


def cached_constant(key: Hashable, build: Callable[[], Tensor]) -> Tensor:
    """A small constant tensor built once per key (the key should include dtype and device).

    Built outside inference mode so that the cached tensor is an ordinary tensor whichever
    mode the first call happened to run in. While torch.compile traces, ``build`` runs in
    the graph instead (a constant there): a lookup would become a guard on the cache's
    contents, which the first call changes, and every compiled step would compile twice.
    So ``build`` must be traceable and give the same values both ways: integers, or
    floats computed on the host (Python's math) and handed to ``torch.tensor``."""
    if _is_compiling():
        return build()
    value = _CONSTANTS.get(key)
    if value is None:
        with torch.inference_mode(False), torch.no_grad():
            value = build()
        _CONSTANTS[key] = value
    return value


def _place_values(bits: int, device: torch.device) -> Tensor:
    """int32 [8 // bits]: 2**(bits*i), the weight of the i-th code inside one byte."""
    per = 8 // bits
    return cached_constant(
        ("place_values", bits, device),
        lambda: torch.stack(
            [torch.full((), 1 << (bits * i), dtype=torch.int32, device=device) for i in range(per)]
        ),
    )


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a dtype, without making a tensor (planning runs on the host)."""
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.bits // 8


def packed_code_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits take when packed: ceil(count * bits / 8)."""
    per = 8 // bits
    return -(-count // per)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes [N, M] with values in [0, 2**bits) into uint8 [N, ceil(M*bits/8)].

    ``bits`` is 1, 2, 4 or 8; code ``i`` of a byte sits in bits ``bits*i .. bits*i+bits-1``.
    The per-sample count is padded with zero codes to a whole number of bytes. Uses
    multiplication by powers of two and a sum (the bit fields do not overlap) in int32."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    n, m = codes.shape
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    nbytes = packed_code_bytes(m, bits)
    c = codes.to(torch.int32)
    if nbytes * per != m:
        c = torch.nn.functional.pad(c, (0, nbytes * per - m))
    c = c.reshape(n, nbytes, per) * _place_values(bits, c.device)
    return c.sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def _packed_code_shape(packed: Tensor, bits: int, count: int) -> tuple[int, int]:
    """(N, bytes per sample) of packed codes, checked against ``bits`` and ``count``."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    n, nbytes = packed.shape
    if nbytes != packed_code_bytes(count, bits):
        raise ValueError(
            f"packed codes hold {nbytes} bytes per sample, expected "
            f"{packed_code_bytes(count, bits)} for {count} codes of {bits} bits"
        )
    return n, nbytes


def unpack_codes(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of ``pack_codes``: uint8 [N, B] -> int32 codes [N, count]."""
    n, nbytes = _packed_code_shape(packed, bits, count)
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    per = 8 // bits
    fields = torch.div(p.unsqueeze(-1), _place_values(bits, p.device), rounding_mode="floor")
    codes = torch.bitwise_and(fields, (1 << bits) - 1).reshape(n, nbytes * per)
    return codes[:, :count]


def saturate(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` with its finite values clamped to the finite range of ``dtype`` (the output dtype
    it is about to be cast to), so that the cast makes no inf from a finite value; NaN, +inf
    and -inf stay as they are. A no-op (``x`` itself) unless ``dtype`` is narrower than
    ``x``'s dtype (float16 or bfloat16 from float32 work)."""
    top = torch.finfo(dtype).max
    if top >= torch.finfo(x.dtype).max:
        return x
    return torch.where(torch.abs(x) < math.inf, torch.clamp(x, -top, top), x)


def prod(values: tuple[int, ...] | list[int]) -> int:
    """Product of ints (1 for an empty sequence)."""
    return math.prod(values)


# fast cpu/cuda path ----------------------------------------------------------------------


def is_compiling() -> bool:  # unroller-lint: host-only (dispatch)
    """Whether torch.compile is tracing the caller."""
    return _is_compiling()


def _is_compiling() -> bool:  # unroller-lint: host-only (dispatch)
    return bool(torch.compiler.is_compiling())


def use_fast_path(*tensors: Tensor) -> bool:  # unroller-lint: host-only (dispatch)
    """True when the fast formulation may run: ``IPU_SAFE`` is off, no ``torch.jit`` trace or
    ``torch.compile`` graph is being recorded (the fast path branches on values and calls
    numpy) and every tensor is on "cpu" or "cuda". Otherwise the IPU-safe formulation runs;
    both give bit-identical results."""
    if IPU_SAFE or sys.byteorder != "little" or torch.jit.is_tracing() or _is_compiling():
        return False
    return all(t.device.type in _FAST_DEVICES for t in tensors)


def use_compiled_path(*tensors: Tensor) -> bool:  # unroller-lint: host-only (dispatch)
    """True while ``torch.compile`` traces (and no ``torch.jit`` trace), ``IPU_SAFE`` is off and
    every tensor is on "cpu" or "cuda": the compiled formulation runs."""
    if IPU_SAFE or torch.jit.is_tracing() or not _is_compiling():
        return False
    return all(t.device.type in _FAST_DEVICES for t in tensors)


_HOST_SHORTCUTS = True  # tests switch it off to run the CUDA formulation on the CPU
NATIVE = True
"""True: on the CPU the fast path runs the compiled kernels of ``compress/native`` where a
compressor has them and they can be had (built on first use; see that package), else its
PyTorch formulation. Read at each call; the results are bit-identical either way (tests
switch it off to compare)."""
CHUNK_ELEMENTS = 1 << 20
"""Elements per block of the fast path's elementwise chains on the CPU: each block's
temporaries stay in the cache and are reused, instead of full-size buffers."""
CHECK_ELEMENTS = 1 << 16
"""From this many elements on, the fast path on the CPU reads small per-group tensors back to
skip steps that no element needs (below, the read-back costs more than the steps)."""


def host_checks(t: Tensor) -> bool:  # unroller-lint: host-only (dispatch)
    """Whether the fast path may use host-side shortcuts for ``t``: process the data in
    cache-sized blocks, call numpy, and (with ``skip_checks``) read small tensors back to skip
    work that no element needs. True on the CPU; on CUDA a read-back would wait for the
    device, so the work is done unconditionally there, in whole-tensor kernels."""
    return _HOST_SHORTCUTS and t.device.type == "cpu"


def native_path(*tensors: Tensor) -> Any:  # unroller-lint: host-only (native path)
    """``native_library(*tensors)`` where the fast path may run (``use_fast_path``, which
    also means no ``torch.compile`` trace, so not the compiled path), else None: the checks
    of the three, each asked once, cheapest first. A codec asks this first on every call;
    only when it is None does it tell the compiled, fast and IPU-safe paths apart."""
    if not NATIVE or not _HOST_SHORTCUTS or IPU_SAFE or "cpu" not in _FAST_DEVICES:
        return None
    if sys.byteorder != "little":
        return None
    for t in tensors:
        if not t.is_cpu:  # not t.device.type: a device object per call costs more
            return None
    if torch.jit.is_tracing() or _is_compiling():
        return None
    return _native_module().library()


def _native_module() -> Any:  # unroller-lint: host-only (native path)
    """``unroller.compress.native``, imported on first use (an import statement per codec
    call cost a microsecond)."""
    global _NATIVE_MODULE
    if _NATIVE_MODULE is None:
        from . import native

        _NATIVE_MODULE = native
    return _NATIVE_MODULE


_NATIVE_MODULE: Any = None


def native_library(*tensors: Tensor) -> Any:  # unroller-lint: host-only (native path)
    """The loaded native kernels (a ``ctypes.CDLL``) when ``NATIVE`` is on, every tensor is on
    the CPU with host shortcuts allowed, and the kernels can be had (``native.library()``
    builds them on first use); else None: then the PyTorch fast path runs."""
    if not NATIVE or not _HOST_SHORTCUTS or any(t.device.type != "cpu" for t in tensors):
        return None  # host_checks of every tensor, inlined (this runs on every codec call)
    return _native_module().library()


THREAD_ELEMENTS = 1 << 21
"""A native kernel starts one thread per this many elements at most (up to torch's intra-op
thread count). Threads are started per call and joined, so a thread that waits for a core
(torch's own workers spin on it after each parallel region; other processes hold it) stalls
the call by a scheduling slice: measured on 2 cores, 2 threads on [8, 64, 32, 32] took 8-20
ms against 0.5-1.2 ms on one. Below 2**21 elements (8 MiB of float32) one thread runs."""


def cpu_path_state() -> tuple[bool, bool, bool, int]:  # unroller-lint: host-only (dispatch)
    """What decides which implementation a codec call on the CPU runs, and so what it
    allocates: the native kernels available and on, host shortcuts, the IPU-safe
    formulation, torch's thread count. A measurement of a codec (its working memory) holds
    for the state it was taken in."""
    native = native_path() is not None
    return native, _HOST_SHORTCUTS, IPU_SAFE, torch.get_num_threads()


def native_threads(elements: int) -> int:  # unroller-lint: host-only (native path)
    """Threads a native kernel uses on ``elements`` elements (see ``THREAD_ELEMENTS``)."""
    if elements < 2 * THREAD_ELEMENTS:  # the common case, without asking torch
        return 1
    return max(1, min(torch.get_num_threads(), elements // THREAD_ELEMENTS))


def remember_plan(plans: dict[tuple, tuple], key: tuple, plan: tuple) -> None:
    """Keep a codec's native-call plan (what a repeated call of one shape needs, so that it
    checks its inputs and calls the kernel, nothing else: a small step makes tens of codec
    calls, where the general dispatch cost as much as the kernel). At most 256 per table:
    many shapes (variable lengths) start it again."""
    if len(plans) >= 256:
        plans.clear()
    plans[key] = plan


def skip_checks(t: Tensor) -> bool:  # unroller-lint: host-only (dispatch)
    """``host_checks`` and ``t`` has at least ``CHECK_ELEMENTS`` elements."""
    return host_checks(t) and t.numel() >= CHECK_ELEMENTS


def row_blocks(  # unroller-lint: host-only (fast path)
    rows: int, cols: int, blocked: bool, multiple: int = 1
) -> list[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) blocks of about ``CHUNK_ELEMENTS`` elements covering a [rows, cols]
    matrix in row-major order (one block if not ``blocked``); column splits (only for rows
    longer than a block) fall on multiples of ``multiple``."""
    if not blocked or rows * cols <= CHUNK_ELEMENTS:
        return [(0, rows, 0, cols)]
    if cols <= CHUNK_ELEMENTS:
        step = max(1, CHUNK_ELEMENTS // cols)
        return [(r, min(rows, r + step), 0, cols) for r in range(0, rows, step)]
    width = max(multiple, CHUNK_ELEMENTS // multiple * multiple)
    return [(r, r + 1, c, min(cols, c + width)) for r in range(rows) for c in range(0, cols, width)]


def _unpack_table(bits: int, device: torch.device) -> Tensor:  # unroller-lint: host-only
    """[256] integers whose little-endian bytes are the 8 // bits codes of each byte value
    (int64 for 1 bit, int32 for 2): the lookup table of ``unpack_codes_fast``."""
    per = 8 // bits
    dtype = {1: torch.int64, 2: torch.int32}[bits]

    def build() -> Tensor:
        mask = (1 << bits) - 1
        values = []
        for v in range(256):
            word = sum(((v >> (bits * i)) & mask) << (8 * i) for i in range(per))
            values.append(word)  # at most 0x0101..01: positive in the signed dtype
        return torch.tensor(values, dtype=dtype).to(device)

    return cached_constant(("unpack_table", bits, device), build)


def pack_flat(  # unroller-lint: host-only (fast cpu/cuda path)
    codes: Tensor, bits: int, out: Tensor | None = None
) -> Tensor:
    """Pack contiguous uint8 (or bool) codes [K] into uint8 [K * bits // 8] (into ``out`` if
    given), code i of a byte in bits bits*i..; K a multiple of 8 // bits and, for bits < 8,
    the start aligned to 8 // bits bytes. Shifts on wider integer views: the 8 // bits codes
    of one output byte sit in one int16 / int32 / int64 word (little-endian, code i in byte
    i), a few shift-ORs gather them into byte 0, and the cast to uint8 keeps byte 0. Every
    word stays non-negative (codes < 2**bits leave the top bits clear), so the right shifts
    bring in zeros."""
    c = codes.view(torch.uint8) if codes.dtype == torch.bool else codes
    if bits == 8:
        return c.clone() if out is None else out.copy_(c)
    # (word dtype, shifts): each step ORs in the word shifted right by that many bits
    word, steps = {
        4: (torch.int16, (4,)),
        2: (torch.int32, (6, 12)),
        1: (torch.int64, (7, 14, 28)),
    }[bits]
    w = c.view(word)
    w = torch.bitwise_or(w, torch.bitwise_right_shift(w, steps[0]))
    for step in steps[1:]:
        w.bitwise_or_(torch.bitwise_right_shift(w, step))
    return w.to(torch.uint8) if out is None else out.copy_(w)


def saturate_fast(x: Tensor, dtype: torch.dtype) -> Tensor:  # unroller-lint: host-only (fast)
    """``saturate(x, dtype).to(dtype).contiguous()`` with the same bits: on the CPU the clamp
    runs only when the plain cast made an inf (a finite value past ``dtype``'s max, or a
    non-finite one); on CUDA always (no read-back). Casting a value below the overflow
    threshold gives what casting it clamped gives, so skipping is exact."""
    if torch.finfo(dtype).max >= torch.finfo(x.dtype).max:
        return x.to(dtype).contiguous()
    if host_checks(x):
        out = x.to(dtype).contiguous()
        if not bool(torch.isinf(out).any()):
            return out
    return saturate(x, dtype).to(dtype).contiguous()


def pack_codes_fast(codes: Tensor, bits: int) -> Tensor:  # unroller-lint: host-only (fast path)
    """``pack_codes`` for uint8 or bool codes [N, M] (values in [0, 2**bits)) on CPU or CUDA:
    the same bytes, computed with shifts on uint8 (numpy's packbits for 1 bit on the CPU)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    n, m = codes.shape
    if bits == 1 and host_checks(codes):
        packed = np.packbits(codes.numpy(), axis=-1, bitorder="little")
        return torch.from_numpy(packed)
    per = 8 // bits
    nbytes = packed_code_bytes(m, bits)
    c = codes.view(torch.uint8) if codes.dtype == torch.bool else codes.to(torch.uint8)
    if nbytes * per != m:
        c = torch.nn.functional.pad(c, (0, nbytes * per - m))
    elif not c.is_contiguous() or c.storage_offset() % per:
        c = c.clone(memory_format=torch.contiguous_format)
    return pack_flat(c.reshape(-1), bits).view(n, nbytes)


def unpack_codes_fast(  # unroller-lint: host-only (fast path)
    packed: Tensor, bits: int, count: int
) -> Tensor:
    """``unpack_codes`` on CPU or CUDA, as uint8 codes [N, count] (0/1 for 1 bit): a lookup
    table from each byte to its codes (numpy's unpackbits for 1 bit on the CPU)."""
    n, nbytes = _packed_code_shape(packed, bits, count)
    if bits == 8:
        return packed
    if bits == 1 and host_checks(packed):
        codes = np.unpackbits(packed.numpy(), axis=-1, count=count, bitorder="little")
        return torch.from_numpy(codes)
    per = 8 // bits
    if bits == 4:  # byte p -> int16 word p | p << 4, masked: bytes (p & 15, p >> 4)
        w = packed.to(torch.int16)
        codes = w.bitwise_or_(torch.bitwise_left_shift(w, 4)).bitwise_and_(0x0F0F)
    else:  # a table of the 256 words whose bytes are a byte's codes
        idx = packed.reshape(-1).to(torch.int32)
        codes = torch.index_select(_unpack_table(bits, packed.device), 0, idx)
    codes = codes.view(torch.uint8).view(n, nbytes * per)
    return codes if nbytes * per == count else codes[:, :count]


# compiled path (torch.compile) -----------------------------------------------------------


def _shifts(bits: int, device: torch.device) -> Tensor:  # unroller-lint: host-only (compiled)
    """int32 [8 // bits]: bits * i, the position of the i-th code inside one byte."""
    per = 8 // bits
    return cached_constant(
        ("shifts", bits, device),
        lambda: torch.tensor([bits * i for i in range(per)], dtype=torch.int32, device=device),
    )


def pack_codes_compiled(  # unroller-lint: host-only (compiled path)
    codes: Tensor, bits: int
) -> Tensor:
    """``pack_codes`` for integer or bool codes [N, M] while torch.compile traces: the same
    bytes, each the OR of its ``8 // bits`` codes shifted into place (one fused loop over the
    output bytes; a sum over the codes would compile to a slow horizontal reduction)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    n, m = codes.shape
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    nbytes = packed_code_bytes(m, bits)
    c = codes.to(torch.int32)
    if nbytes * per != m:
        c = torch.nn.functional.pad(c, (0, nbytes * per - m))
    c = c.reshape(n, nbytes, per)
    out = c[..., 0]
    for i in range(1, per):
        out = torch.bitwise_or(out, torch.bitwise_left_shift(c[..., i], bits * i))
    return out.to(torch.uint8)


def unpack_codes_compiled(  # unroller-lint: host-only (compiled path)
    packed: Tensor, bits: int, count: int
) -> Tensor:
    """``unpack_codes`` while torch.compile traces: int32 codes [N, count], each byte shifted
    right by its codes' positions and masked, in int32 (shifts of narrower lanes, and integer
    division, compile to scalar loops), so that the consumer fuses the unpacking."""
    n, nbytes = _packed_code_shape(packed, bits, count)
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    per = 8 // bits
    fields = torch.bitwise_right_shift(p.unsqueeze(-1), _shifts(bits, p.device))
    codes = torch.bitwise_and(fields, (1 << bits) - 1).reshape(n, nbytes * per)
    return codes[:, :count]


def host_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn``, a pure function of hashable arguments that computes Python values (floats,
    tuples) on the host, so that torch.compile calls it while tracing and takes its result
    as a constant instead of tracing its Python code (a numeric solver does not trace): what
    ``torch.compiler.assume_constant_result`` does, its attribute set here without importing
    torch._dynamo, which takes seconds (tests/runtime/test_compiled_step.py checks the two agree).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def float_constant_compiled(  # unroller-lint: host-only (compiled path)
    rows: list[list[float]], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Python floats as a float64 tensor cast to ``dtype``, while torch.compile traces: one
    constant in the graph (the same values ``cached_constant`` would hold, built there from
    one ``torch.full`` per element: thousands of graph nodes in a large step)."""
    return torch.tensor(rows, dtype=torch.float64, device=device).to(dtype)


def zero_nan_compiled(x: Tensor) -> Tensor:  # unroller-lint: host-only (compiled path)
    """``x`` with NaN replaced by +0 while torch.compile traces: ``x != x`` vectorises where
    ``torch.isnan`` compiles to a scalar loop."""
    return torch.where(x != x, torch.zeros_like(x), x)
