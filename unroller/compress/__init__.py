"""Compressors for activations saved between a forward op and its backward step.

``make("dct", keep=4)`` builds one from a name and parameters (validated against the class's
``PARAMS``: a bad or unknown parameter raises ``ParamError``, a ValueError whose ``param`` is
the parameter's name, also quoted in the message); ``COMPRESSORS`` maps names to classes. Adding a compressor: one module with a
``Compressor`` subclass, one line in ``COMPRESSORS``. See docs/compressors.md.
"""

from __future__ import annotations

from typing import Any

from .base import Compressor, ParamError, ParamSpec, packed_nbytes
from .bits import Bits
from .dct import Dct
from .fewbit import FewBit
from .quant import Quant

__all__ = [
    "COMPRESSORS",
    "Bits",
    "Compressor",
    "Dct",
    "FewBit",
    "ParamError",
    "ParamSpec",
    "Quant",
    "get",
    "make",
    "packed_nbytes",
]

COMPRESSORS: dict[str, type[Compressor]] = {
    "dct": Dct,
    "quant": Quant,
    "bits": Bits,
    "fewbit": FewBit,
}


def get(name: str) -> type[Compressor]:
    """The compressor class registered under ``name`` (ValueError listing the known names)."""
    try:
        return COMPRESSORS[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(k) for k in COMPRESSORS)
        raise ValueError(f"unknown compressor {name!r}; known compressors: {known}") from None


def make(name: str, **params: Any) -> Compressor:
    """An instance of compressor ``name`` with ``params`` validated and defaults filled in."""
    return get(name)(**params)
