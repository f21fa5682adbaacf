"""Names in generated code: what templates reserve, and model names made identifiers.

A ``Namer`` turns model names (dotted, possibly Python keywords) and derived names
(``grad:x``) into unique, valid Python identifiers, in a deterministic order, never
one a template uses itself. The steps that use them live in ``unroller.compiler.ir``.
"""

from __future__ import annotations

import builtins
import keyword
import re

# Names the generated modules (every platform's template) use themselves, and every
# builtin (a template may call any of them, e.g. ``sum``): model names never take them.
# tests/adversarial/test_reserved_names.py checks this against every name each template emits.
TEMPLATE_NAMES = frozenset(
    {
        "self", "torch", "sys", "K", "P", "L", "C", "Model", "stash", "grads", "poptorch",
        "surrogate", "run_main", "terms", "total", "NUM_IPUS", "INPUTS", "_", "scaler",
    }
)  # fmt: skip
RESERVED = TEMPLATE_NAMES | frozenset(dir(builtins)) | frozenset(keyword.kwlist)
# Families the emitter numbers as it goes: kernel module aliases (K2, K3, ...) and codecs.
_RESERVED_PATTERN = re.compile(r"(K[0-9]+|CODEC_\w*)$")


class Namer:
    """Unique Python identifiers for model values, in a deterministic order."""

    def __init__(self, reserved: frozenset[str] = RESERVED):
        self.taken: set[str] = set(reserved)
        self.by_key: dict[str, str] = {}

    def __call__(self, key: str, base: str | None = None) -> str:
        """The identifier for ``key`` (a model name or a derived name like ``grad:x``)."""
        if key in self.by_key:
            return self.by_key[key]
        base = (base or key).replace(".", "_")
        if not base.isidentifier():
            base = "v_" + "".join(c if c.isalnum() or c == "_" else "_" for c in base)
        if keyword.iskeyword(base) or keyword.issoftkeyword(base) or _RESERVED_PATTERN.match(base):
            base += "_"
        ident, n = base, 1
        while ident in self.taken:
            n += 1
            ident = f"{base}_{n}"
        self.taken.add(ident)
        self.by_key[key] = ident
        return ident
