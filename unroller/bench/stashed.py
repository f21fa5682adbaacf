"""Reading a scheme's ``stash_report``: which tensors it compressed, and by how much.

"dct-dense stores 1/12 of nocompress" is a claim about the same activations; the
report's rows say, per kept tensor, which compressor stored it, so the ratio is taken
over the rows a lossy compressor holds. The suite's goals and the compress preset
both state it this way.
"""

from __future__ import annotations

from typing import Any


def lossy(label: str) -> bool:
    """Whether a stash_report compressor label holds a lossy compressor (not raw, not Bits)."""
    parts = [p.strip() for p in label.split(" + ")]
    return any(p != "raw" and not p.startswith("Bits(") for p in parts)


def same_activations(rows: list[dict], base_rows: dict[str, dict]) -> dict[str, Any]:
    """The scheme's lossy rows against the same keys of ``base_rows`` (nocompress's)."""
    keys = [r["tensor"] for r in rows if lossy(r["compressor"])]
    scheme_bytes = sum(r["stored_bytes"] for r in rows if r["tensor"] in keys)
    base_bytes = sum(base_rows[k]["stored_bytes"] for k in keys)
    return {
        "tensors": keys,
        "count": len(keys),
        "nocompress_stored_bytes": base_bytes,
        "scheme_stored_bytes": scheme_bytes,
        "ratio": scheme_bytes / base_bytes if base_bytes else None,
    }
