"""The table from an operator's name to the function that maps it, as ``aten_ops`` and
``onnx_ops`` each keep one: a decorator registers a function under one or more names."""

from __future__ import annotations

from collections.abc import Callable


def op_table() -> tuple[dict[str, Callable], Callable]:
    """An empty table and its decorator: ``@maps("A", "B")`` enters the function under
    both names and returns it unchanged."""
    table: dict[str, Callable] = {}

    def maps(*names: str):
        def register(fn: Callable) -> Callable:
            for name in names:
                table[name] = fn
            return fn

        return register

    return table, maps
