"""What autograd saves for backward in one forward pass, counted by storage.

The peers of the generated step keep what autograd decides to keep; this counts it with
``saved_tensors_hooks`` (each storage once, by kind), so their stashed bytes stand next
to the generated step's own ``stash_report``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


def count_autograd_saved(ref: nn.Module, batch: Sequence[Tensor]) -> dict[str, Any]:
    """Bytes autograd saves for backward during one forward of ``ref`` (which returns
    ``(loss, ...)``); runs the backward too, so nothing stays alive."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in ref.parameters()}
    buffer_ptrs = {b.untyped_storage().data_ptr() for b in ref.buffers()}
    input_ptrs = {t.untyped_storage().data_ptr() for t in batch}
    storages: dict[int, tuple[int, str]] = {}
    n_saved = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal n_saved
        n_saved += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if isinstance(t, nn.Parameter) or ptr in param_ptrs:
            kind = "param"
        elif ptr in buffer_ptrs:
            kind = "buffer"
        elif ptr in input_ptrs:
            kind = "batch"
        else:
            kind = "activation"
        if storage.nbytes() and ptr not in storages:
            storages[ptr] = (storage.nbytes(), kind)
        return t

    ref.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ref(*batch)[0]
    loss.backward()
    by_kind: dict[str, int] = {"param": 0, "buffer": 0, "batch": 0, "activation": 0}
    for nbytes, kind in storages.values():
        by_kind[kind] += nbytes
    total = sum(by_kind.values())
    return {
        "with_params_bytes": total,
        "without_params_bytes": total - by_kind["param"],
        "without_params_and_buffers_bytes": total - by_kind["param"] - by_kind["buffer"],
        "by_kind_bytes": by_kind,
        "saved_tensor_count": n_saved,
        "distinct_storages": len(storages),
    }
