"""The operator reference of docs/language.md, written from the registry.

The registry (``ops.toml``) is the one place an operator is described, so the language
reference lists what it holds rather than a copy that could drift: ``unroll ops
--markdown`` prints the table, ``unroll ops --update docs/language.md`` rewrites the part of
the file between the two markers, and a test fails when the checked-in page differs from
what the registry says now.
"""

from __future__ import annotations

from unroller.compiler.registry import ArgSpec, OpSpec, TensorSpec, load_registry

BEGIN = "<!-- operators: begin (unroll ops --update docs/language.md) -->"
END = "<!-- operators: end -->"


def _literal(value: object) -> str:
    """A default as the language writes it: true/false, double-quoted strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "(" + ", ".join(_literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def _argument(arg: ArgSpec) -> str:
    if arg.required:
        text = arg.name
    elif arg.default_from is not None:
        text = f"{arg.name}={arg.default_from}"
    elif arg.optional:
        text = f"{arg.name}=None"
    else:
        text = f"{arg.name}={_literal(arg.default)}"
    if arg.choices:
        text += " (" + " / ".join(_literal(c) for c in arg.choices) + ")"
    return f"`{text}`"


def _inputs(spec: OpSpec) -> str:
    if spec.variadic:
        return "`*inputs`"
    if not spec.inputs:
        return "none"
    names = [
        name if i < spec.required_inputs else f"[{name}]" for i, name in enumerate(spec.inputs)
    ]
    return "`" + ", ".join(names) + "`"


def _tensors(tensors: tuple[TensorSpec, ...]) -> list[str]:
    return [f"`{t.name}`" + (f" (if {t.when})" if t.when else "") for t in tensors]


def _cell(text: str) -> str:
    """Markdown table cell text: a ``|`` would end the cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def operator_table() -> str:
    """The markdown table of every registry operator, in registry order."""
    rows = [
        "| operator | tensor inputs ([optional]) | arguments (defaults) | parameters, buffers | mixed precision | what it computes |",
        "|---|---|---|---|---|---|",
    ]
    for name, spec in load_registry().items():
        args = ", ".join(_argument(a) for a in spec.args.values()) or "none"
        tensors = _tensors(spec.params) + [f"{t} (buffer)" for t in _tensors(spec.buffers)]
        cells = (
            f"`{name}`",
            _inputs(spec),
            args,
            ", ".join(tensors) or "",
            spec.precision,
            spec.doc,
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def with_table(page: str) -> str:
    """``page`` with the text between the markers replaced by ``operator_table()``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no operator section (markers {BEGIN!r} ... {END!r})")
    return page[: start + len(BEGIN)] + "\n\n" + operator_table() + "\n" + page[end:]
