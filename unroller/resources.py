"""Where the grammar and templates live: in the checkout, or inside the installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """``grammars`` or ``templates``: the wheel's copy, else the checkout's top-level folder."""
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"unroller: cannot find the {name}/ folder next to {_PACKAGE}")
