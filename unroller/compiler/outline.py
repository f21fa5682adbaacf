"""Block instances as calls of shared functions.

The emitter lays out one flat step program per method, with its liveness. The steps
of one top-level block instance form a contiguous run in each section: its forward
kernels with the stash steps right after them, its backward kernels with the restores
right before them, its predict kernels. Each run becomes a function whose parameters
are the variables the run reads before writing and whose results are the variables
read after it, named as the block names them (``layer1.0.conv1`` -> ``conv1``, the value
bound to block parameter ``x`` -> ``x``). Instances whose functions come out as the same
text share one function: a ResNet's thirteen ``basic`` blocks call one ``basic_forward``
and one ``basic_backward``. Instances whose functions differ only in literal numbers
(a depthwise conv's ``groups``, the shape a saved tensor is restored to) share one function
too: each number in which they differ becomes a parameter named after its role (the
keyword it is passed as, ``shape`` for a positional tuple), passed by keyword at each call
(``finish``, once every program is outlined). A keyword one instance passes and another
leaves at its registry default (a conv's ``stride``) counts as such a number, as does a
flag passed by keyword (``in_place``); other booleans, strings and None stay literals.

A recomputed segment (segment recompute) has a third run in the training program, its
forward again at the start of its backward (section ``recompute``): it becomes a call of the
block's recompute function, whose saved list the backward function empties, while the
forward run, which then keeps nothing for the backward, returns what the rest reads.

Memory stays what the flat program holds: what a forward run makes only for its own
backward run travels in one list (``saved``) that the backward function empties on
entry (``K.take``), and what the caller would delete right after a call is handed over in
that list (or in ``handed``) first, so each tensor is still freed right after its last use.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from unroller.compiler import safe
from unroller.compiler.graph import BlockCall
from unroller.compiler.ir import (
    AddTo,
    Assign,
    Attr,
    CallExpr,
    Const,
    DictExpr,
    Do,
    Expr,
    Layer,
    ListExpr,
    ModelName,
    RecordRaw,
    Starred,
    Statement,
    Step,
    TupleExpr,
    Var,
    release_dead,
    render_steps,
)
from unroller.compiler.ir import Global as GlobalName
from unroller.compiler.names import Namer

#: Variables the templates define in each method; functions take them scoped.
SCOPED = ("stash",)
#: ... and as they are.
SHARED = ("grads",)


@dataclass
class Function:
    """One generated function: a block run with block-relative names."""

    name: str
    block: str
    section: str  # "forward", "backward", "predict" or "recompute"
    params: list[str]  # after L, the method variables it uses, and `saved`
    context: list[str]  # method variables it uses (stash, grads)
    returns: list[str]
    saved_out: list[str] = field(default_factory=list)  # forward: for its backward
    saved_in: list[str] = field(default_factory=list)  # what it owns: forward's saved + handed
    owner: str = "saved"  # the parameter holding them: "saved", or "handed" (no saved list)
    steps: list[Step] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    body: list[safe.Code] = field(default_factory=list)  # lines(), kept once rendered
    names: Namer | None = None  # the names its locals took (lifted parameters avoid them)

    def signature(self) -> list[str]:
        return ["L", *self.context, *([self.owner] if self.saved_in else []), *self.params]

    def lines(self) -> list[safe.Code]:
        """The body: unpack what the forward function saved, the steps, the return."""
        out: list[str] = []
        if self.saved_in:
            out += _unpack([safe.identifier(n) for n in self.saved_in], self.owner)
        out += render_steps(self.steps, block_text=_local_text, depth=1)
        results = [safe.identifier(n) for n in self.returns]
        if self.saved_out:
            saved = [safe.identifier(n) for n in self.saved_out]
            listed = "[" + ", ".join(saved) + "]"
            if len(f"return {', '.join([*results, listed])}") <= WIDTH:
                results.append(listed)
            else:  # a line per few names, not black's one per line
                chunks = _chunks(saved, WIDTH - len("saved += []"))
                out += [f"saved {'=' if i == 0 else '+='} [{c}]" for i, c in enumerate(chunks)]
                results.append("saved")
        if results:
            out.append(f"return {', '.join(results)}")
        while out and not out[0].strip():
            out.pop(0)
        return [safe.Code(line) for line in out or ["pass"]]


#: What one line of a function body may take (indent not counted) before it is split into
#: lines of a few names each.
WIDTH = 100


def _chunks(names: list[str], width: int) -> list[str]:
    """``names`` joined by ", " into pieces of at most ``width`` characters (one name may be
    longer)."""
    pieces: list[list[str]] = [[]]
    for name in names:
        if pieces[-1] and len(", ".join([*pieces[-1], name])) > width:
            pieces.append([])
        pieces[-1].append(name)
    return [", ".join(piece) for piece in pieces]


def _unpack(names: list[str], owner: str) -> list[str]:
    """``a, b, c = K.take(saved)`` (the list emptied: the caller let go, so each is freed
    after its last use), or for a long list one slice per line: ``a, b = saved[0:2]``, ...,
    ``y, z = K.take(saved)[7:]``."""
    targets = f"({names[0]},)" if len(names) == 1 else ", ".join(names)
    if len(f"{targets} = K.take({owner})") <= WIDTH:
        return [f"{targets} = K.take({owner})"]
    lines = []
    start = 0
    chunks = _chunks(names, WIDTH - len(f" = {owner}[00:00]"))
    for i, chunk in enumerate(chunks):
        count = chunk.count(", ") + 1
        target = chunk if count > 1 else f"({chunk},)"
        if i == len(chunks) - 1:
            lines.append(f"{target} = K.take({owner})[{start}:]")
        else:
            lines.append(f"{target} = {owner}[{start}:{start + count}]")
        start += count
    return lines


def _local_text(call: BlockCall) -> str:
    return call.local_text or call.text


@dataclass
class _Run:
    instance: BlockCall
    start: int
    end: int  # exclusive


class Outliner:
    """Replaces the block runs of step programs by calls of shared functions.

    ``key_of`` gives each variable's structured key and ``base_name`` the readable name
    of a key (both from the emitter), so a variable is renamed by what it is, not by
    rewriting its text; ``global_name`` hands out module-level and method-level names
    that cannot clash with the model's.
    """

    def __init__(
        self,
        key_of: dict[str, tuple[str, ...]],
        base_name: Callable[[tuple[str, ...], Callable[[str], str]], str],
        global_name: Callable[[tuple[str, ...], str], str],
        reserved: frozenset[str],
    ):
        self.key_of = key_of
        self.base_name = base_name
        self.global_name = global_name
        self.reserved = reserved
        self.functions: list[Function] = []
        self._by_text: dict[str, Function] = {}
        self._saved: dict[str, tuple[str, list[str]]] = {}  # instance -> (list var, names)
        self._lists: set[str] = set()  # the handed and saved lists of the calls
        self._function_names: dict[tuple[str, str, int], str] = {}
        self._local_reserved = reserved  # and the function names, once reserved
        # each call of a function: its step and the literals of its instance
        self._sites: list[tuple[Step, Function, list[tuple[str, Any]]]] = []
        # id of each step an outlined run held -> the call step that now runs it
        self._replaced: dict[int, Step] = {}

    def stand_in(self, step: Step) -> Step:
        """The step of an outlined program that runs ``step``: the call of its block's
        function when ``step`` was in an outlined run, else ``step`` itself. Callers that
        marked steps of the flat program (a pieces loop's first and last step) find them
        here."""
        return self._replaced.get(id(step), step)

    def reserve(
        self, blocks: list[str], counts: dict[str, int], extra: tuple[str, ...] = ()
    ) -> None:
        """Claim every function name that may be needed before any local is named
        (``extra``: sections besides forward, backward and predict, e.g. recompute)."""
        for block in blocks:
            for section in ("forward", "backward", "predict", *extra):
                for variant in range(1, counts[block] + 1):
                    base = f"{block}_{section}" + (f"_v{variant}" if variant > 1 else "")
                    key = ("function", block, section, str(variant))
                    self._function_names[(block, section, variant)] = self.global_name(key, base)
        self._local_reserved = self.reserved | set(self._function_names.values())

    # -- one program -------------------------------------------------------------------

    def outline(
        self,
        steps: list[Step],
        keep: set[str],
        predict: bool = False,
        split: frozenset[str] = frozenset(),
    ) -> list[Step]:
        """The program with each top-level block run replaced by a call (liveness redone).
        ``split``: instances to keep inline anyway (a ``--pipeline`` stage program holds
        only its part of an instance split over stages)."""
        self._saved = {}  # a saved list lives in one program
        runs = _runs(steps)
        # An instance split over pipeline stages stays inline: one run per section each.
        count: dict[tuple[str, str], int] = {}
        for r in runs:
            key = (r.instance.name, steps[r.start].section)
            count[key] = count.get(key, 0) + 1
        inline = {name for (name, _), n in count.items() if n > 1} | set(split)
        # ... and so does one whose code names something outside it (a forward run is
        # outlined only together with its backward run: they share the saved list).
        inline |= {
            r.instance.name for r in runs if not _outlinable(steps[r.start : r.end], r.instance)
        }
        runs = [r for r in runs if r.instance.name not in inline]
        events = _events(steps)
        backward = {r.instance.name: r for r in runs if steps[r.start].section == "backward"}
        # a recomputed instance's backward reads what its recompute run made, not its forward's
        recomputed = {r.instance.name for r in runs if steps[r.start].section == "recompute"}
        out: list[Step] = []
        previous = 0
        for run in runs:
            out += steps[previous : run.start]
            previous = run.end
            section = "predict" if predict else steps[run.start].section
            later = None
            if section == "recompute" or (
                section == "forward" and run.instance.name not in recomputed
            ):
                later = backward.get(run.instance.name)
            out += self._call(steps, run, events, keep, section, later)
        out += steps[previous:]
        # a handed or saved list is empty once its function returns: no `del` for it
        release_dead(out, keep | self._lists)
        return out

    def _call(
        self,
        steps: list[Step],
        run: _Run,
        events: dict[str, list[tuple[int, str]]],
        keep: set[str],
        section: str,
        backward: _Run | None,
    ) -> list[Step]:
        """The call of the run's function, after handing over what dies inside it."""
        body = steps[run.start : run.end]
        free_in, written = _free_and_written(body)
        context = [n for n in (*SCOPED, *SHARED) if n in free_in]
        free_in = [n for n in free_in if n not in context and n != "L"]
        live_out = [n for n in written if n in keep or _read_after(events, n, run.end)]
        saved_out: list[str] = []
        if backward is not None:
            saved_out = [
                n for n in live_out if n not in keep and _read_only_in(events, n, run, backward)
            ]
        returns = [n for n in live_out if n not in saved_out]
        saved_in: list[str] = []
        saved_var = None
        if section == "backward" and run.instance.name in self._saved:
            saved_var, saved_in = self._saved[run.instance.name]
            free_in = [n for n in free_in if n not in saved_in]
        # What the caller would delete right after the call is handed over in the list the
        # function empties, so it is freed inside at its last use, as in the flat program.
        handed = [n for n in free_in if n not in keep and not _read_after(events, n, run.end)]
        free_in = [n for n in free_in if n not in handed]
        before: list[Step] = []
        owner = "saved" if saved_var is not None else "handed"
        if handed:
            items = tuple(Var(n) for n in handed)
            if saved_var is None:
                saved_var = self.global_name(("handed",), "handed")
                self._lists.add(saved_var)
                hand = Assign((Var(saved_var),), ListExpr(items))
            else:
                hand = Do(CallExpr(Attr(Var(saved_var), "extend"), (ListExpr(items),)))
            before.append(Step(body[0].section, [hand], stage=body[0].stage))
        function, literals = self._function(
            run.instance,
            section,
            body,
            free_in,
            context,
            returns,
            saved_out,
            [*saved_in, *handed],
            owner,
        )
        where = ModelName(run.instance.name)
        # L and the stash log as the instance names them: L.within("layer1.0"), or both at
        # once, *K.within("layer1.0", L, stash), so a call takes a line
        scoped = [Var(n) for n in ("L", *SCOPED) if n == "L" or n in context]
        args: list[Expr] = [CallExpr(Attr(Var("L"), "within"), (where,))]
        if len(scoped) > 1:
            args = [Starred(CallExpr(GlobalName("K.within"), (where, *scoped)))]
        args += [Var(name) for name in context if name not in SCOPED]
        if saved_var is not None:
            args.append(Var(saved_var))
        args += [Var(n) for n in free_in]
        targets: list[Var | None] = [Var(n) for n in returns]
        if saved_out:
            saved_var = self.global_name(("saved", run.instance.name), "")
            self._lists.add(saved_var)
            self._saved[run.instance.name] = (saved_var, saved_out)
            targets.append(Var(saved_var))
        call = CallExpr(GlobalName(function.name), tuple(args))
        statement: Statement = Assign(tuple(targets), call) if targets else Do(call)
        steps_out = [*before, Step(body[0].section, [statement], stage=body[0].stage)]
        self._sites.append((steps_out[-1], function, literals))
        self._replaced.update((id(step), steps_out[-1]) for step in body)
        label = "[recompute]" if section == "recompute" else "[block]"
        steps_out[0].comment = f"{label} {run.instance.text}"
        return steps_out

    def _function(
        self,
        instance: BlockCall,
        section: str,
        body: list[Step],
        free_in: list[str],
        context: list[str],
        returns: list[str],
        saved_out: list[str],
        saved_in: list[str],
        owner: str,
    ) -> tuple[Function, list[tuple[str, Any]]]:
        """The shared function of this run (new, or one whose text differs at most in
        liftable literals), and the run's literals in reading order."""
        rename = _Renamer(instance, self.key_of, self.base_name, self._local_reserved)
        for name in [*saved_in, *free_in]:  # parameters first: they get the plain names
            rename(name)
        local = [_rename_step(step, rename) for step in body]
        params = [rename(n) for n in free_in]
        results = [rename(n) for n in returns] + [rename(n) for n in saved_out]
        release_dead(local, {*params, *results, *context, "L"})
        candidate = Function(
            name="",
            block=instance.block,
            section=section,
            params=params,
            context=context,
            returns=[rename(n) for n in returns],
            saved_out=[rename(n) for n in saved_out],
            saved_in=[rename(n) for n in saved_in],
            owner=owner,
            steps=local,
        )
        literals: list[tuple[str, Any]] = []
        hole = _collect(literals)
        holed = [_map_literals(step, hole, canonical=True) for step in local]
        shape = replace(candidate, steps=holed)  # the text with every liftable literal a hole
        text = "\n".join([section, instance.block, *shape.signature(), *shape.lines()])
        found = self._by_text.get(text)
        if found is None:
            candidate.body = candidate.lines()
            candidate.names = rename.names
            variant = 1 + sum(
                1 for f in self.functions if f.block == instance.block and f.section == section
            )
            candidate.name = self._function_names[(instance.block, section, variant)]
            self._by_text[text] = candidate
            self.functions.append(candidate)
            found = candidate
        found.instances.append(instance.name)
        return found, literals

    # -- literals that differ between instances ----------------------------------------

    def finish(self) -> None:
        """Turn the literals in which the calls of one function differ into parameters.

        Call once every program is outlined, before any is rendered. Positions whose values
        agree at every call share one parameter (``shape`` for the six restores of a
        ResNet block), named after their role; each call passes its values by keyword."""
        sites: dict[int, list[tuple[Step, list[tuple[str, Any]]]]] = {}
        for step, function, literals in self._sites:
            sites.setdefault(id(function), []).append((step, literals))
        self._sites = []
        for function in self.functions:
            calls = sites.get(id(function), [])
            lifted = _lifted_positions([literals for _, literals in calls])
            if not lifted:
                continue
            names: dict[tuple, str] = {}
            param_of: dict[int, str] = {}
            for position, group in lifted.items():
                if group not in names:
                    role = calls[0][1][position][0]
                    assert function.names is not None
                    names[group] = function.names("\0literal\0" + repr(group), role)
                param_of[position] = names[group]
            lift = _parameter(param_of)  # one count over the whole body
            function.steps = [_map_literals(s, lift) for s in function.steps]
            function.params += list(names.values())
            function.body = function.lines()
            first = {name: position for position, name in reversed(param_of.items())}
            for step, literals in calls:
                extra = tuple((n, Const(literals[first[n]][1])) for n in names.values())
                step.statements = [_with_kwargs(s, extra) for s in step.statements]


def _liftable(value: Any) -> bool:
    """A number, or a non-empty tuple or list of numbers (bools, strings, None stay)."""
    if type(value) in (int, float):
        return True
    items = value if type(value) in (tuple, list) else ()
    return bool(items) and all(type(v) in (int, float) for v in items)


_HOLE = Const("\0literal")  # stands for a liftable literal when texts are compared


def _collect(found: list[tuple[str, Any]]) -> Callable[[Const, str], Expr]:
    """Records each liftable literal with its role and leaves a hole in its place."""

    def hole(const: Const, role: str) -> Expr:
        found.append((role, const.value))
        return _HOLE

    return hole


def _parameter(param_of: dict[int, str]) -> Callable[[Const, str], Expr]:
    """The n-th liftable literal becomes its parameter where it has one."""
    count = itertools.count()

    def lift(const: Const, role: str) -> Expr:
        name = param_of.get(next(count))
        return Var(name) if name is not None else const

    return lift


def _lifted_positions(calls: list[list[tuple[str, Any]]]) -> dict[int, tuple]:
    """Position -> (role, its values at each call) for the literals that differ between
    calls (compared as written: ``1`` and ``1.0`` differ)."""
    lifted: dict[int, tuple] = {}
    for position, (role, _) in enumerate(calls[0] if calls else []):
        values = tuple(safe.literal(literals[position][1]) for literals in calls)
        if len(set(values)) > 1:
            lifted[position] = (role, values)
    return lifted


def _map_literals(step: Step, fn: Callable[[Const, str], Expr], canonical: bool = False) -> Step:
    """``step`` with each liftable literal replaced by ``fn(literal, role)``, in reading
    order; the role is the keyword it is passed as, else ``shape`` for a tuple or list
    and ``size`` for a number. Keyword arguments are read by name, those a call leaves
    out as defaults (``CallExpr.defaults``) among them, so instances that pass ``stride``
    and those that leave it out read the same; one that ``fn`` replaces is passed. With
    ``canonical`` (texts to compare) every keyword is passed, sorted by name. A bool passed
    by keyword (``in_place``) is liftable too; other bools, strings and None are not."""

    def call(e: CallExpr) -> CallExpr:
        args = tuple(expr(a, None) for a in e.args)
        every = sorted((*e.kwargs, *e.defaults), key=lambda item: item[0])
        new = {k: expr(v, k, flag=True) for k, v in every}  # a keyword's bool: a flag
        if canonical:
            return CallExpr(e.func, args, tuple(new.items()))
        kwargs = [(k, new[k]) for k, _ in e.kwargs]
        kwargs += [(k, new[k]) for k, v in e.defaults if new[k] is not v]
        defaults = tuple((k, v) for k, v in e.defaults if new[k] is v)
        return CallExpr(e.func, args, tuple(kwargs), defaults)

    def expr(e: Expr, role: str | None, flag: bool = False) -> Expr:
        if isinstance(e, Const) and (_liftable(e.value) or (flag and type(e.value) is bool)):
            default = "size" if type(e.value) in (int, float) else "shape"
            return fn(e, role or default)
        if isinstance(e, CallExpr):
            return call(e)
        if isinstance(e, TupleExpr):
            return TupleExpr(tuple(expr(i, role) for i in e.items))
        if isinstance(e, ListExpr):
            return ListExpr(tuple(expr(i, role) for i in e.items))
        if isinstance(e, DictExpr):
            return DictExpr(tuple((k, expr(v, role)) for k, v in e.items))
        return e

    def statement(s: Statement) -> Statement:
        if isinstance(s, (Assign, Do)):
            return replace(s, value=expr(s.value, None))
        return s

    return replace(step, statements=[statement(s) for s in step.statements])


def _with_kwargs(statement: Statement, extra: tuple[tuple[str, Expr], ...]) -> Statement:
    """A call statement with keyword arguments added to its call."""
    if isinstance(statement, (Assign, Do)) and isinstance(statement.value, CallExpr):
        call = statement.value
        return replace(statement, value=replace(call, kwargs=(*call.kwargs, *extra)))
    return statement


def relative(name: str, call: BlockCall) -> str:
    """A model name (or stash key ``node:extra``) as block instance ``call`` names it: its
    own names without the instance prefix, a value bound to a parameter by that name."""
    value, colon, extra = name.partition(":")
    prefix = call.name + "."
    if value == call.name:  # the instance's own module (holding a free parameter)
        value = ""
    elif value.startswith(prefix):
        value = value[len(prefix) :]
    else:
        value = next((param for param, bound in call.inputs if bound == value), value)
    return value + colon + extra


class _Renamer:
    """Method variable -> the name it has inside one block function."""

    def __init__(self, instance, key_of, base_name, reserved):
        self.instance = instance
        self.key_of = key_of
        self.base_name = base_name
        self.names = Namer(frozenset(reserved) | {"L", "saved", "handed", *SCOPED, *SHARED})

    def model_name(self, name: str) -> str:
        return relative(name, self.instance)

    def __call__(self, name: str) -> str:
        key = self.key_of.get(name)
        if key is None:  # a method variable the template defines (stash, grads)
            return name
        return self.names("\0".join(key), self.base_name(key, self.model_name))


def _rename_step(step: Step, rename: _Renamer) -> Step:
    def expr(e: Expr) -> Expr:
        if isinstance(e, Var):
            return Var(rename(e.name))
        if isinstance(e, Layer):
            return Layer(rename.model_name(e.path), e.dtype)
        if isinstance(e, ModelName):
            return ModelName(rename.model_name(e.name))
        if isinstance(e, Attr):
            return Attr(expr(e.var), e.name)
        if isinstance(e, CallExpr):
            kwargs = tuple((k, expr(v)) for k, v in e.kwargs)
            defaults = tuple((k, expr(v)) for k, v in e.defaults)
            return CallExpr(e.func, tuple(expr(a) for a in e.args), kwargs, defaults)
        if isinstance(e, TupleExpr):
            return TupleExpr(tuple(expr(i) for i in e.items))
        if isinstance(e, DictExpr):
            return DictExpr(tuple((rename.model_name(k), expr(v)) for k, v in e.items))
        return e

    def statement(s: Statement) -> Statement:
        if isinstance(s, Assign):
            targets = tuple(Var(rename(t.name)) if t is not None else None for t in s.targets)
            return Assign(targets, expr(s.value), s.unpack)
        if isinstance(s, AddTo):
            return replace(s, total=Var(rename(s.total.name)), part=Var(rename(s.part.name)))
        if isinstance(s, RecordRaw):
            items = tuple(
                (ModelName(rename.model_name(k.name)), Var(rename(v.name))) for k, v in s.items
            )
            return RecordRaw(Var(rename(s.log.name)), items)
        return Do(expr(s.value))

    return replace(step, statements=[statement(s) for s in step.statements], release=[])


class _Mapping:
    """Renames the variables of a mapping, model names left alone (``rename_vars``)."""

    def __init__(self, mapping: dict[str, str]):
        self.mapping = mapping

    def model_name(self, name: str) -> str:
        return name

    def __call__(self, name: str) -> str:
        return self.mapping.get(name, name)


def rename_vars(step: Step, mapping: dict[str, str]) -> Step:
    """``step`` with its variables renamed by ``mapping`` (the rest as they are), releases
    dropped (liveness is redone over the whole program): how a segment's steps are turned
    into the steps of one piece of the batch."""
    return _rename_step(step, _Mapping(mapping))  # type: ignore[arg-type]


def _outlinable(body: list[Step], instance: BlockCall) -> bool:
    """A run can become a function when every model name it spells (stash keys, layer
    names) is the instance's own, so the scoped ``L`` and ``stash`` restore them."""
    prefix = instance.name + "."

    def own(name: str) -> bool:  # the instance's module itself holds its free parameters
        return name.startswith(prefix) or name == instance.name

    def names(e: Expr) -> list[str]:
        if isinstance(e, (ModelName, Layer)):
            return [e.name if isinstance(e, ModelName) else e.path]
        if isinstance(e, CallExpr):
            return [n for a in (*e.args, *(v for _, v in e.kwargs)) for n in names(a)]
        if isinstance(e, TupleExpr):
            return [n for i in e.items for n in names(i)]
        if isinstance(e, DictExpr):
            return [k for k, _ in e.items] + [n for _, v in e.items for n in names(v)]
        return []

    for step in body:
        for statement in step.statements:
            if isinstance(statement, AddTo):
                continue
            if isinstance(statement, RecordRaw):
                if not all(k.name.startswith(prefix) for k, _ in statement.items):
                    return False
                continue
            if not all(own(n) for n in names(statement.value)):
                return False
    return True


def _runs(steps: list[Step]) -> list[_Run]:
    """Maximal runs of consecutive steps of one top-level block instance, section, stage."""
    found: list[_Run] = []
    for i, step in enumerate(steps):
        if not step.calls:
            continue
        last = found[-1] if found else None
        if (
            last is not None
            and last.end == i
            and last.instance is step.calls[0]
            and steps[last.start].section == step.section
            and steps[last.start].stage == step.stage
        ):
            last.end = i + 1
        else:
            found.append(_Run(step.calls[0], i, i + 1))
    return found


def _events(steps: list[Step]) -> dict[str, list[tuple[int, str]]]:
    """Per variable, (step index, "r" or "w") in program order."""
    found: dict[str, list[tuple[int, str]]] = {}
    for i, step in enumerate(steps):
        for name, kind in step.events():
            found.setdefault(name, []).append((i, kind))
    return found


def _free_and_written(body: list[Step]) -> tuple[list[str], list[str]]:
    """Variables read before any write in ``body`` (in order), and every one it writes."""
    free: dict[str, None] = {}
    written: dict[str, None] = {}
    for step in body:
        for name, kind in step.events():
            if kind == "r" and name not in written:
                free.setdefault(name)
            elif kind == "w":
                written.setdefault(name)
    return list(free), list(written)


def _read_after(events: dict[str, list[tuple[int, str]]], name: str, end: int) -> bool:
    """Does a step from ``end`` on read ``name`` before writing it again?"""
    for index, kind in events.get(name, []):
        if index >= end:
            return kind == "r"
    return False


def _read_only_in(events, name: str, run: _Run, backward: _Run) -> bool:
    """Is every use of ``name`` after ``run`` a read inside ``backward``?"""
    after = [(i, k) for i, k in events.get(name, []) if i >= run.end]
    return bool(after) and all(k == "r" and backward.start <= i < backward.end for i, k in after)
