"""The model language's dtypes: their names, sizes and torch equivalents, in one place.

Everything that needs a fact about a dtype (the parser's list, shape rules, byte counts
for the stash plan and the pipeline split, synthetic data) asks here, so a new dtype is
one line in each table below.
"""

from __future__ import annotations

from typing import Any

FLOAT_DTYPES: tuple[str, ...] = ("f32", "f16", "bf16", "f64")
INT_DTYPES: tuple[str, ...] = ("i64", "i32")
#: A boolean input: a mask (nn.MultiheadAttention's key_padding_mask), read as integers.
MASK_DTYPES: tuple[str, ...] = ("bool",)
#: What a declaration may use, in the order error messages list them.
DTYPES: tuple[str, ...] = FLOAT_DTYPES + INT_DTYPES + MASK_DTYPES
#: Bytes per element, including the bool of 1-bit masks before packing.
DTYPE_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i64": 8, "i32": 4}
DTYPE_BYTES["bool"] = 1
#: The attribute of ``torch`` each dtype is (``torch.bfloat16``), for generated code.
TORCH_DTYPE_NAMES: dict[str, str] = {
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
    "i64": "int64",
    "i32": "int32",
    "bool": "bool",
}


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def torch_dtype(name: str) -> Any:
    """The torch.dtype of a model dtype name (torch imported only when asked)."""
    import torch

    return {
        "f32": torch.float32,
        "f16": torch.float16,
        "bf16": torch.bfloat16,
        "f64": torch.float64,
        "i64": torch.int64,
        "i32": torch.int32,
        "bool": torch.bool,
    }[name]
