"""An ``ImportedModel`` as model text, with a ``block`` for every repeated submodule.

Block recovery: a module path P is an *instance* when its statements (names under
``P.``) run contiguously, read values from outside only as arguments and leave exactly
one value to the rest of the network. Instances of one module class whose statements
have the same operators, names, wiring and keyword names form one block; keyword
values that differ between the instances become the block's parameters. Paths are
tried outermost first, so a ResNet's BasicBlock becomes a block and its ``downsample``
Sequential stays inside it. Instances of one class that differ in structure give one
block per variant (``basic_block``, ``basic_block_2``) when a variant repeats.

Every user-derived string that reaches the text is a validated name, a literal written
by ``literal`` or a comment cleaned by ``comment``: the text parses as what it shows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from unroller.importer.model import BatchDim, ImportedModel, Literal, Stmt

_INDENT = "    "

#: Module classes never made blocks: plain containers (their subclasses may be).
CONTAINERS = frozenset(
    {
        "torch.nn.modules.container.Sequential",
        "torch.nn.modules.container.ModuleList",
        "torch.nn.modules.container.ModuleDict",
    }
)


def comment(text: str) -> str:
    """A comment body: printable characters only, on one line, at most 160 of them."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in str(text))
    cleaned = " ".join(cleaned.split())
    return cleaned if len(cleaned) <= 160 else cleaned[:157] + "..."


def literal(value: Literal) -> str:
    """A keyword value in the model language's syntax."""
    if isinstance(value, BatchDim):
        return "N"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} has no literal")
        text = repr(value)
        return text if ("." in text or "e" in text) else text + ".0"
    if isinstance(value, str):
        if not all(ch.isprintable() for ch in value):
            raise ValueError(f"string {value!r} has unprintable characters")
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        inner = ", ".join(literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise ValueError(f"no literal for {type(value).__name__}")


def snake(name: str) -> str:
    """``BasicBlock`` -> ``basic_block``; ``Conv2dNormActivation`` -> ``conv2d_norm_activation``."""
    name = name.rsplit(".", 1)[-1]
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    name = re.sub(r"[^a-z0-9_]", "_", name).strip("_") or "block"
    return name if not name[0].isdigit() else f"m_{name}"


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape is not None else ""


# ---------------------------------------------------------------- block recovery


@dataclass
class _Instance:
    path: str
    start: int  # index of its first statement
    stmts: list[Stmt]
    inputs: list[str]  # outside values read, in order of first use
    output: str  # the one value used outside
    signature: tuple = ()
    values: list[tuple] = field(default_factory=list)  # per statement: kwarg values


@dataclass
class _Block:
    name: str
    cls: str
    instances: list[_Instance]
    params: list[str]  # keyword parameter names
    slots: dict[tuple[int, str], str]  # (statement index, kwarg) -> parameter name


def _instance(model: ImportedModel, path: str, users: dict[str, list[int]]) -> _Instance | None:
    prefix = path + "."
    index = [i for i, s in enumerate(model.stmts) if s.name.startswith(prefix)]
    if len(index) < 2 or index != list(range(index[0], index[-1] + 1)):
        return None
    stmts = [model.stmts[i] for i in index]
    if any(s.name == path for s in model.stmts):
        return None  # the module computes something itself besides its children (LoRA)
    if not all(s.module_path == path or s.module_path.startswith(prefix) for s in stmts):
        return None
    local = {s.name for s in stmts}
    inputs: list[str] = []
    for stmt in stmts:
        for arg in stmt.args:
            if arg not in local and arg not in inputs:
                inputs.append(arg)
    outside = set(index)
    escaping = [
        s.name
        for s in stmts
        if any(u not in outside for u in users.get(s.name, [])) or s.name in model.predictions
    ]
    if len(escaping) != 1 or not inputs:
        return None
    inst = _Instance(path, index[0], stmts, inputs, escaping[0])
    names = {name: ("in", k) for k, name in enumerate(inputs)}
    rows = []
    for stmt in stmts:
        wiring = tuple(names.get(a, ("local", a[len(prefix) :])) for a in stmt.args)
        rows.append((stmt.name[len(prefix) :], stmt.op, wiring, tuple(sorted(stmt.kwargs))))
        inst.values.append(tuple(stmt.kwargs[k] for k in sorted(stmt.kwargs)))
    inst.signature = (tuple(rows), escaping[0][len(prefix) :], len(inputs))
    return inst


def _users(model: ImportedModel) -> dict[str, list[int]]:
    users: dict[str, list[int]] = {}
    for i, stmt in enumerate(model.stmts):
        for arg in stmt.args:
            users.setdefault(arg, []).append(i)
    return users


def _parameterise(instances: list[_Instance], taken: set[str]) -> tuple[list[str], dict]:
    """The keyword slots whose values differ between instances, as named parameters
    (slots that always hold equal values share one parameter)."""
    first = instances[0]
    vectors: dict[tuple, list[tuple[int, str]]] = {}
    for i, stmt in enumerate(first.stmts):
        for j, key in enumerate(sorted(stmt.kwargs)):
            column = tuple(inst.values[i][j] for inst in instances)
            if len({(type(v), repr(v)) for v in column}) > 1:
                # keyed by type and text: (1, 2) == (1.0, 2.0) and 1 == True in Python
                typed = tuple((type(v).__name__, repr(v)) for v in column)
                vectors.setdefault(typed, []).append((i, key))
    keys = [sorted({key for _, key in slots}) for slots in vectors.values()]
    counts: dict[str, int] = {}
    for names in keys:
        for key in names:
            counts[key] = counts.get(key, 0) + 1
    params: list[str] = []
    slots: dict[tuple[int, str], str] = {}
    for slot_list, names in zip(vectors.values(), keys):
        i, key = slot_list[0]
        if len(names) == 1 and counts[key] == 1:
            name = key
        else:
            rel = first.stmts[i].name[len(first.path) + 1 :].replace(".", "_")
            name = f"{rel}_{key}"
        name = re.sub(r"[^A-Za-z0-9_]", "_", name)
        if name[0].isdigit():
            name = f"{key}_{name[: -len(key) - 1]}"
        while name in params or name in taken:
            name += "_"
        params.append(name)
        for slot in slot_list:
            slots[slot] = name
    return params, slots


def recover_blocks(model: ImportedModel, reserved: set[str]) -> list[_Block]:
    """The blocks worth writing (see the module docstring). Depth by depth from the root:
    first the instances of one class at that depth are grouped among themselves (a U-Net's
    four ``Up`` modules); then a class left with one instance there may join deeper,
    still free instances of its class (``inc`` with ``up1.conv``, if ``Up`` did not take
    them)."""
    users = _users(model)
    consumed: set[int] = set()
    blocks: list[_Block] = []
    taken = set(reserved)
    variants: dict[str, int] = {}
    instances: dict[str, _Instance] = {}
    for path in model.classes:
        if path:
            inst = _instance(model, path, users)
            if inst is not None:
                instances[path] = inst
    for path in [p for p in instances if model.classes[p] in CONTAINERS]:
        del instances[path]  # a plain container's structure is incidental: its children
    depths = sorted({p.count(".") for p in instances})

    def free(path: str) -> bool:
        inst = instances[path]
        return not set(range(inst.start, inst.start + len(inst.stmts))) & consumed

    def commit(cls: str, group: list[_Instance]) -> None:
        variants[cls] = variants.get(cls, 0) + 1
        base = snake(cls)
        if base in reserved:
            base += "_block"
        name = base if variants[cls] == 1 else f"{base}_{variants[cls]}"
        while name in taken:
            name += "_"
        taken.add(name)
        params, slots = _parameterise(group, set(_input_names(group[0])))
        blocks.append(_Block(name, cls, group, params, slots))
        for inst in group:
            consumed.update(range(inst.start, inst.start + len(inst.stmts)))

    def group_and_commit(cls: str, paths: list[str], need: set[str]) -> None:
        groups: dict[tuple, list[_Instance]] = {}
        for path in paths:
            groups.setdefault(instances[path].signature, []).append(instances[path])
        for group in groups.values():
            if len(group) >= 2 and any(inst.path in need for inst in group):
                spans = [set(range(i.start, i.start + len(i.stmts))) for i in group]
                if not any(a & b for k, a in enumerate(spans) for b in spans[k + 1 :]):
                    commit(cls, group)

    for depth in depths:
        level = [p for p in instances if p.count(".") == depth]
        by_class: dict[str, list[str]] = {}
        for path in level:
            by_class.setdefault(model.classes[path], []).append(path)
        for cls, paths in by_class.items():
            group_and_commit(cls, [p for p in paths if free(p)], set(paths))
        for cls, paths in by_class.items():
            left = [p for p in paths if free(p)]
            if not left:
                continue
            deeper = [
                p for p in instances if p.count(".") > depth and model.classes[p] == cls and free(p)
            ]
            group_and_commit(cls, left + deeper, set(left))
    return blocks


def _input_names(inst: _Instance) -> list[str]:
    """The block's value parameters: x (or x0, x1, ...), avoiding its statements' names."""
    count = len(inst.inputs)
    local = {s.name[len(inst.path) + 1 :].split(".")[0] for s in inst.stmts}
    base = "x"
    while base in local or any(f"{base}{k}" in local for k in range(count)):
        base += "_"
    return [base] if count == 1 else [f"{base}{k}" for k in range(count)]


# ---------------------------------------------------------------- text


def _stmt_line(stmt: Stmt, name: str, args: list[str], kwargs: dict[str, str], note: str) -> str:
    parts = list(args) + [f"{k}={v}" for k, v in kwargs.items()]
    line = f"{name} = {stmt.op}({', '.join(parts)})"
    return f"{line}  # {comment(note)}" if note else line


def _note(model: ImportedModel, stmt: Stmt) -> str:
    """``Conv2d [N, 64, 16, 16]``: the class whose call made the statement, its shape."""
    cls = model.classes.get(stmt.module_path, "") if stmt.module_path else ""
    shape = _shape_text(stmt.shape) if stmt.shape else ""
    return f"{cls.rsplit('.', 1)[-1]} {shape}".strip()


def _defaults() -> dict[str, dict[str, object]]:
    from unroller.compiler.registry import load_registry

    out: dict[str, dict[str, object]] = {}
    for name, op in load_registry().items():
        out[name] = {
            key: arg.default
            for key, arg in op.args.items()
            if isinstance(arg.default, (bool, int, float, str, tuple))
        }
    return out


_DEFAULTS: dict[str, dict[str, object]] = {}


def is_default(op: str, key: str, value: Literal) -> bool:
    """Whether ``key=value`` is what the registry operator assumes when it is left out."""
    if not _DEFAULTS:
        _DEFAULTS.update(_defaults())
    default = _DEFAULTS.get(op, {}).get(key, _MISSING)
    if default is _MISSING:
        return False
    return (
        type(default) is type(value)
        and default == value
        or (isinstance(value, float) and isinstance(default, float) and value == default)
    )


_MISSING = object()


def _kwargs(stmt: Stmt) -> dict[str, str]:
    return {
        k: literal(v)
        for k, v in stmt.kwargs.items()
        if v is not None and not is_default(stmt.op, k, v)
    }


def _block_text(model: ImportedModel, block: _Block) -> list[str]:
    first = block.instances[0]
    inputs = _input_names(first)
    prefix = first.path + "."
    local = {a: b for a, b in zip(first.inputs, inputs)}
    count = len(block.instances)
    paths = ", ".join(inst.path for inst in block.instances[:6])
    more = ", ..." if count > 6 else ""
    lines = [
        f"# {comment(block.cls)}: {count} instances ({comment(paths)}{more})",
        f"block {block.name}({', '.join(inputs + block.params)}) {{",
    ]
    for i, stmt in enumerate(first.stmts):
        rel = stmt.name[len(prefix) :]
        args = [local.get(a, a[len(prefix) :] if a.startswith(prefix) else a) for a in stmt.args]
        kwargs = {}
        for key in stmt.kwargs:
            if (i, key) in block.slots:
                kwargs[key] = block.slots[(i, key)]
            elif stmt.kwargs[key] is not None and not is_default(stmt.op, key, stmt.kwargs[key]):
                kwargs[key] = literal(stmt.kwargs[key])
        cls = model.classes.get(stmt.module_path, "")
        note = cls.rsplit(".", 1)[-1] if cls and stmt.module_path != first.path else ""
        lines.append(_INDENT + _stmt_line(stmt, rel, args, kwargs, note))
    lines.append(f"{_INDENT}return {first.output[len(prefix):]}")
    lines.append("}")
    return lines


def emit_text(model: ImportedModel, reserved: set[str] | None = None) -> str:
    """The model text (blocks recovered) for ``model``."""
    blocks = recover_blocks(model, set(reserved or ()))
    starts: dict[int, tuple[_Block, _Instance]] = {}
    skip: set[int] = set()
    rename: dict[str, str] = {}
    for block in blocks:
        for inst in block.instances:
            starts[inst.start] = (block, inst)
            skip |= set(range(inst.start, inst.start + len(inst.stmts)))
            rename[inst.output] = inst.path
    lines = [f"# {comment(note)}" for note in model.notes]
    lines.append(f"model {model.name} {{")
    for tensor in model.inputs:
        lines.append(f"{_INDENT}input {tensor.name}: {tensor.text()}")
    for tensor in model.targets:
        lines.append(f"{_INDENT}target {tensor.name}: {tensor.text()}")
    for block in blocks:
        lines.append("")
        lines += [_INDENT + line for line in _block_text(model, block)]
    lines.append("")
    for i, stmt in enumerate(model.stmts):
        if i in starts:
            block, inst = starts[i]
            args = [rename.get(a, a) for a in inst.inputs]
            kwargs = {}
            for (j, key), param in block.slots.items():
                kwargs[param] = literal(inst.stmts[j].kwargs[key])
            out = next(s for s in inst.stmts if s.name == inst.output)
            cls = model.classes.get(inst.path, "")
            note = f"{cls.rsplit('.', 1)[-1]} {_shape_text(out.shape)}".strip()
            lines.append(
                _INDENT
                + _stmt_line(out, inst.path, args, kwargs, note).replace(
                    f"= {out.op}(", f"= {block.name}(", 1
                )
            )
            continue
        if i in skip:
            continue
        args = [rename.get(a, a) for a in stmt.args]
        lines.append(_INDENT + _stmt_line(stmt, stmt.name, args, _kwargs(stmt), _note(model, stmt)))
    returns = [model.loss] if model.loss else []
    returns += [rename.get(p, p) for p in model.predictions]
    lines.append(f"{_INDENT}return {', '.join(returns)}")
    lines.append("}")
    return "\n".join(lines) + "\n"
