"""A ``torch.nn.Module`` -> ``ImportedModel``, through ``torch.export``.

``torch.export`` captures the module's forward as an ATen-level graph with the batch dim
symbolic (it follows code that ``torch.fx`` symbolic tracing cannot; where export fails,
the module is traced with ``torch.fx`` first and the traced module is exported). Every
node records the module-call stack it ran in (``nn_module_stack``) and every parameter
placeholder its state-dict key, which gives the statement names: the convolution whose
weight is ``layer1.0.conv1.weight`` is the statement ``layer1.0.conv1``, a functional
add inside ``layer1.0`` is ``layer1.0.add``, an ``nn.ReLU`` at ``layer1.0.relu`` is
``layer1.0.relu`` (``_1`` on its second call).

Nodes map one by one through ``aten_ops``. A few module classes decompose into long
ATen chains that are one registry operator (``nn.MultiheadAttention``): their nodes are
collapsed into one statement, read from the module's attributes (``COLLAPSED``).
Everything that cannot be mapped is collected, and the import fails listing all of it.

The mapper (``_Mapper``) holds the walk's state; its parts live beside it: single-node
helpers (``torch_nodes``), the view a mapper function gets (``torch_view``), collapsed
module calls (``torch_collapse``), multi-node Hugging Face patterns (``torch_patterns``)
and whole-graph refusals (``torch_checks``).
"""

from __future__ import annotations

import contextlib
import keyword
import logging
import os
import re
import warnings
from collections.abc import Sequence

import torch
from torch import fx

from unroller.compiler.graph import MAX_FLOAT
from unroller.importer import aten_ops, batch_merge, masks, torch_opaque
from unroller.importer.aten_ops import Refuse
from unroller.importer.hf_moe import traceable_experts
from unroller.importer.model import (
    BATCH,
    EXAMPLE_BATCH,
    ImportedModel,
    ImportFailure,
    Stmt,
    Tensor,
    Unmapped,
    valid_path,
)
from unroller.importer.source import Predictions
from unroller.importer.torch_checks import _Checks
from unroller.importer.torch_collapse import _Collapse
from unroller.importer.torch_nodes import (
    Poisoned,
    is_size_value,
    qualname,
    strip_wrapper,
    target_name,
    unusable_name,
)
from unroller.importer.torch_patterns import _Patterns
from unroller.importer.torch_view import NodeView

_DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "bool": torch.bool,
}
#: The batch ``diagnose`` runs the original at: rarer than 3 (RGB channels) as a leading
#: size, so that torch's shapes in its error can be rewritten with N (``_batch_as_n``).
DIAGNOSE_BATCH = 7
#: Node targets that compute sizes, not tensors, or only check things.
_SIZE_OPS = {
    "aten.sym_size.int",
    "aten.sym_numel.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_tensor_metadata.default",
}


def example_inputs(inputs: Sequence[Tensor], batch: int = EXAMPLE_BATCH) -> list[torch.Tensor]:
    """Capture-time inputs of the declared shapes: zeros (valid indices for any vocabulary)
    for integer inputs, seeded normal values for float ones."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for spec in inputs:
        shape = (batch, *spec.dims)
        dtype = _DTYPES[spec.dtype]
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            out.append(torch.zeros(shape, dtype=dtype))
    return out


class _Discard:
    """A text stream that drops what is written (and never grows)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def quiet():
    """No warning, log record or print while torch runs the user's code: export logs every
    failed fake-tensor kernel with its traceback (~40 lines before the one-line error), a
    traced module that fails prints its code to stderr, and a print in ``forward`` would
    land in the model text on stdout; what went wrong reaches the user as the error."""
    previous = logging.root.manager.disable
    sink = _Discard()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        try:
            with contextlib.redirect_stderr(sink):
                yield
        finally:
            logging.disable(previous)


def capture(module: torch.nn.Module, inputs: Sequence[Tensor], source: str = "the network"):
    """The exported program of ``Predictions(module)`` with a symbolic batch dim, and a
    note saying how it was captured. Export first; ``torch.fx`` then export as fallback."""
    with quiet():
        return _capture(module, inputs, source)


def diagnose(module: torch.nn.Module, inputs: Sequence[Tensor], source: str) -> None:
    """After a failed capture or text: run the original eagerly on example inputs of the
    declared shapes and dtypes. Where that fails (an ``i64`` input into a Linear, a wrong
    shape) the fault is the network's or the declaration's, and the ImportFailure says so;
    where it runs, the caller reports its own error. Only on failure: on success the
    capture never allocates real activations."""
    declared = ", ".join(f"{t.name}: {t.text()}" for t in inputs)
    try:
        with quiet(), torch.no_grad(), torch.random.fork_rng(devices=[]):
            example = example_inputs(inputs, DIAGNOSE_BATCH)
            Predictions(module, [t.name for t in inputs]).train()(*example)
    except Exception as exc:  # noqa: BLE001 - the user's forward on the declared inputs
        raise ImportFailure(
            f"{source}: the network fails on inputs of the declared shapes and dtypes "
            f"({declared}): {_batch_as_n(_one_line(exc), DIAGNOSE_BATCH)}"
        ) from None


def _batch_as_n(text: str, batch: int) -> str:
    """torch's shapes in ``text`` with the example ``batch`` leading them written N
    (``(7x8 and 5x8)``, ``[7, 3, 32, 32]``), as the declared inputs are."""
    return re.sub(rf"(?<=[\[(]){batch}(?=x\d|, ?\d|\])", BATCH, text)


def _capture(module: torch.nn.Module, inputs: Sequence[Tensor], source: str):
    names = [t.name for t in inputs]
    wrapper = Predictions(module, names).train()
    try:
        example = tuple(example_inputs(inputs))
    except (RuntimeError, MemoryError) as exc:
        raise ImportFailure(
            f"cannot make example inputs of the declared shapes: {_one_line(exc)}"
        ) from None
    batch = torch.export.Dim("N", min=2, max=2**31 - 1)
    dynamic = (tuple({0: batch} for _ in example),)  # forward(*args): one tuple
    try:
        with traceable_experts(module):
            program = torch.export.export(wrapper, example, dynamic_shapes=dynamic, strict=False)
        return program, f"torch.export (torch {torch.__version__})"
    except Exception as first:  # noqa: BLE001 - any capture failure: try fx, then report
        export_error = _one_line(first)
    diagnose(module, inputs, source)  # a forward that fails eagerly fails under fx too
    try:
        traced = Predictions(fx.symbolic_trace(module), names).train()
        program = torch.export.export(traced, example, dynamic_shapes=dynamic, strict=False)
        return program, f"torch.fx symbolic trace, then torch.export (torch {torch.__version__})"
    except Exception as second:  # noqa: BLE001
        raise ImportFailure(
            "cannot capture the network: torch.export failed: "
            f"{export_error}; torch.fx fallback failed: {_one_line(second)}"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 400 else text[:397] + "..."


# ---------------------------------------------------------------- the mapper


class _Mapper(_Collapse, _Patterns, _Checks):
    """Walks the exported graph once, producing statements or unmapped records; the
    state lives here, the collapsed calls, patterns and checks in the mixins."""

    def __init__(self, program, module: torch.nn.Module, inputs: Sequence[Tensor]):
        self.program = program
        self.module = module
        self.graph = program.graph_module.graph
        self.nodes = list(self.graph.nodes)
        self.order = {node: i for i, node in enumerate(self.nodes)}
        self.inputs = list(inputs)
        self.params: dict[str, str] = {}  # placeholder name -> state-dict key
        self.buffers: dict[str, str] = {}
        self.constants: set[str] = set()
        self.constant_values: dict[str, object] = {}
        self.user_inputs: dict[str, str] = {}  # placeholder -> model input name
        self._read_signature()
        self.batch = self._batch_symbol()
        self.merged = batch_merge.Merged()  # rows merged with the batch (batch_merge.find)
        self.values: dict[fx.Node, str] = {}  # node -> value name in the model text
        self.stmts: list[Stmt] = []
        self.names: set[str] = set(t.name for t in self.inputs)
        self.used_params: dict[str, str] = {}  # state-dict key -> statement
        # layer statement -> the keys it claimed, its op and keywords: what a later call of
        # the same module must match to be written ``shares="LAYER"`` (``shared_call``)
        self.layer_claims: dict[str, frozenset[str]] = {}
        self.layer_calls: dict[str, tuple[str, dict]] = {}
        self.ties: dict[str, dict[str, str]] = {}  # statement -> its param -> the key it is
        self.frozen_marked: set[str] = set()  # parameters written frozen (requires_grad off)
        # tensors held under several keys (tied weights): each key -> True, and the first key
        # of each such tensor in state-dict order (by id), which owns it
        self.first_keys: dict[int, str] = {}
        self.shared_keys: dict[str, bool] = {}
        seen: dict[int, list[str]] = {}
        for key, param in module.named_parameters(remove_duplicate=False):
            seen.setdefault(id(param), []).append(key)
        for ident, keys in seen.items():
            if len(keys) > 1:
                self.first_keys[ident] = keys[0]
                self.shared_keys.update(dict.fromkeys(keys, True))
        self.used_buffers: set[str] = set()
        self.fallback = True  # an ATen node no mapper handles: an ``aten`` statement
        self.opaque: list[str] = []  # one line per such statement
        self.unmapped: list[Unmapped] = []
        self.poisoned: set[fx.Node] = set()
        self.classes: dict[str, str] = {}
        self.leaf_paths = {
            name for name, sub in module.named_modules() if not any(True for _ in sub.children())
        }
        self.uniform: dict[fx.Node, object] = {}  # uniform gathers (_uniform_gather)
        self.groups = self._collapsed_groups()
        self.live = self._live_nodes()
        self.constant = self._constant_nodes()
        self.rotary, self.absorbed = self._rotary_patterns()
        self.positions = self._position_patterns()
        self.relative_bias = self._relative_bias_patterns()
        self.padding = masks.find(self, target_name, is_size_value)
        self.absorbed |= self.padding.absorbed
        self.absorbed |= masks.absorb_key_padding(self, target_name)
        # mask input (and a size it is expanded to) -> its padding_mask statement
        self.padding_values: dict[object, str] = {}
        self._absorb_masked_biases()
        self.repeated_kv = self._repeated_kv_patterns()
        self._find_stochastic_depth()
        self.merged = batch_merge.find(self, target_name)

    # ---- the graph's signature: which placeholder is what

    def _read_signature(self) -> None:
        kinds = torch.export.graph_signature.InputKind
        user = iter(self.inputs)
        for spec in self.program.graph_signature.input_specs:
            name = spec.arg.name
            if spec.kind == kinds.PARAMETER:
                self.params[name] = strip_wrapper(spec.target)
            elif spec.kind == kinds.BUFFER and spec.persistent is False:
                # not in the state dict: a constant of the code (position ids)
                self.constants.add(name)
                self.constant_values[name] = self.program.constants[spec.target]
            elif spec.kind == kinds.BUFFER:
                self.buffers[name] = strip_wrapper(spec.target)
            elif spec.kind in (kinds.CONSTANT_TENSOR, kinds.CUSTOM_OBJ):
                self.constants.add(name)
                self.constant_values[name] = self.program.constants[spec.target]
            elif spec.kind == kinds.USER_INPUT:
                self.user_inputs[name] = next(user).name

    def _batch_symbol(self):
        for node in self.nodes:
            if node.op == "placeholder" and node.name in self.user_inputs:
                return node.meta["val"].shape[0]
        raise ImportFailure("the network takes no tensor input")

    # ---- shapes

    def dim(self, value) -> int | str:
        if isinstance(value, torch.SymInt):
            if str(value) == str(self.batch):
                return BATCH
            # imported here: sympy (and what it imports) loads only once a capture needs it
            from torch.fx.experimental.symbolic_shapes import is_concrete_int

            if not is_concrete_int(value):  # 2*N: int() would give the example batch's 6
                return "?" + re.sub(rf"\b{re.escape(str(self.batch))}\b", BATCH, str(value))
            try:
                return int(value)
            except (TypeError, ValueError, RuntimeError):
                return f"?{value}"
        return int(value)

    def shape(self, node) -> tuple:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise Refuse(f"{getattr(node, 'name', node)} is not a tensor")
        if node in self.merged.shapes:  # rows merged with the batch, imported unmerged
            return self.merged.shapes[node]
        return tuple(self.dim(d) for d in val.shape)

    # ---- module paths

    def stack(self, node) -> list[tuple[str, str]]:
        """(path, class) from the outermost module call to the innermost, wrapper removed."""
        stack = node.meta.get("nn_module_stack") or {}
        out = []
        for path, cls in stack.values():
            path = strip_wrapper(path)
            if path.startswith("L['self']") or path.startswith("L__self__"):
                continue
            out.append((path, qualname(cls)))
        return [(p, c) for p, c in out if p or True]

    def where(self, node) -> tuple[str, str]:
        stack = [(p, c) for p, c in self.stack(node) if p]
        if not stack:
            return "", qualname(type(self.module))
        return stack[-1]

    def location(self, node) -> str:
        trace = node.meta.get("stack_trace") or ""
        found = re.findall(r'File "([^"]+)", line (\d+)', trace)
        if not found:
            return ""
        path, line = found[-1]
        try:
            path = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        except ValueError:  # another drive
            pass
        return f"{path}:{line}"

    # ---- liveness and split pieces

    def _live_nodes(self) -> set[fx.Node]:
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        live: set[fx.Node] = set()
        todo = [output]
        while todo:
            node = todo.pop()
            if node in live:
                continue
            live.add(node)
            todo.extend(node.all_input_nodes)
        # a collapsed group is live as a whole when any of it is
        for node, path in list(self.groups.items()):
            if node in live:
                continue
            if any(m in live and p == path for m, p in self.groups.items()):
                live.add(node)
        return live

    def _piece(self, node) -> str:
        """Part ``index`` of a split: a ``slice`` along the split dim."""
        pieces = self.values[node.args[0]]
        dim, start, end = pieces.parts[int(node.args[1])]
        if start == 0 and end == pieces.size:
            return pieces.source
        kwargs = {"dim": dim, "start": start, "end": None if end == pieces.size else end}
        return self.add_stmt(node, "slice", [pieces.source], None, kwargs)

    def _holds_state(self, path: str) -> bool:
        sub = self.module.get_submodule(path)
        return any(True for _ in sub.parameters(recurse=False)) or any(
            True for _ in sub.buffers(recurse=False)
        )

    # ---- naming

    def unique(self, base: str) -> str:
        base = base.strip(".") or "value"
        name, k = base, 0
        while name in self.names or not valid_path(name):
            if not valid_path(base):
                raise Refuse(unusable_name(base))
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def functional_name(self, node) -> str:
        path, _ = self.where(node)
        if path and path in self.leaf_paths and not self._holds_state(path):
            return path  # an nn.ReLU at layer1.0.relu is the statement layer1.0.relu
        target = target_name(node)
        short = target.split(".")[1] if target.startswith("aten.") else "value"
        if node in self.rotary:
            short = "rotary"  # the add that ends a rotary embedding (_rotary_patterns)
        elif node in self.positions:
            short = "positions"  # position ids from the token ids (_position_patterns)
        elif node in self.padding.found:
            short = "padding_mask"  # a mask input's padding mask (masks.find)
        elif target == "aten.where.ScalarOther" and node.args[0] in self.padding.found:
            short = "masked_bias"  # an attention's bias plus a padding mask (attention_bias)
        if target == "getitem":
            short = "split"
        short = short.rstrip("_") or "value"
        return f"{path}.{short}" if path else short

    # ---- values

    def value_of(self, node) -> str:
        if not isinstance(node, fx.Node):
            raise Refuse(f"expected a tensor, got the constant {node!r}")
        if isinstance(self.values.get(node), aten_ops.Empty):
            raise Refuse(f"reads {node.name}, an empty slice, which no statement holds")
        if node in self.values:
            return self.values[node]
        if node in self.poisoned:
            raise Poisoned(node.name)
        if node in self.constant and node.op != "placeholder":
            raise Refuse(
                f"reads {node.name} ({target_name(node)}), a tensor built from sizes and "
                "constants only, which no statement of the language holds"
            )
        if node.op == "placeholder":
            if node.name in self.user_inputs:
                return self.user_inputs[node.name]
            if node.name in self.params:
                return self._free_parameter(node)
            if node.name in self.buffers:
                return self._read_only_buffer(node)
            raise Refuse(f"reads a tensor constant ({node.name}) captured from the code")
        raise Refuse(f"reads {node.name}, which could not be mapped")

    def _read_only_buffer(self, node) -> str:
        """A persistent buffer read as data and never written (BART's final_logits_bias): a
        frozen ``parameter`` statement under its key, loaded from the same state-dict
        entry, with no gradient, as the buffer has none."""
        key = self.buffers[node.name]
        written = self.program.graph_signature.buffers_to_mutate.values()
        if not valid_path(key) or key in self.names or key in written:
            raise Refuse(f"reads the buffer {key} as data")
        shape = tuple(int(d) for d in node.meta["val"].shape)
        self.names.add(key)
        self.used_buffers.add(key)
        owner = key.rpartition(".")[0]
        kwargs = {"shape": shape, "init": "zeros", "frozen": True}
        self.stmts.append(Stmt(key, "parameter", [], kwargs, owner, shape))
        self.values[node] = key
        return key

    def _free_parameter(self, node) -> str:
        key = self.params[node.name]
        if key in self.used_params:
            raise Refuse(f"the parameter {key} is used by two operators (tied weights)")
        if not valid_path(key):
            raise Refuse(unusable_name(key))
        shape = tuple(int(d) for d in node.meta["val"].shape)  # () for a learned scalar
        self.names.add(key)
        owner = key.rpartition(".")[0]
        stmt = Stmt(key, "parameter", [], {"shape": shape, "init": "zeros"}, owner, shape)
        self.stmts.append(stmt)
        self.used_params[key] = key
        self.values[node] = key
        return key

    # ---- the walk

    def run(self) -> list[str]:
        done_groups: set[str] = set()
        for node in self.nodes:
            if node.op != "call_function" or node not in self.live:
                if node.op == "call_function":
                    self._check_dead(node)
                continue
            target = target_name(node)
            if target in _SIZE_OPS or is_size_value(node) or node in self.constant:
                continue
            if node in self.groups:
                path = self.groups[node]
                if path not in done_groups:
                    done_groups.add(path)
                    self._collapse(path)
                continue
            if node in self.padding.refused and node not in self.absorbed:
                self._fail(node, "attention mask", self.padding.refused[node])
                continue
            if node in self.absorbed:
                continue
            if node in self.padding.found:  # a float padding mask that scores are added to
                try:
                    self.values[node] = self.padding_value(node)
                except Refuse as exc:
                    self._fail(node, "attention mask", str(exc))
                continue
            if node in self.positions:
                ids, pad = self.positions[node]
                view = NodeView(self, node, target)
                self.values[node] = view.stmt(
                    "padded_positions", [self.value_of(ids)], padding_idx=pad
                )
                continue
            if node in self.rotary:
                self._map_rotary(node, self.rotary[node])
                continue
            if node in self.relative_bias:
                self._map_relative_bias(node, *self.relative_bias[node])
                continue
            if node in self.stochastic:
                self._refuse_stochastic_depth(node)
                continue
            if node in self.stochastic_plans:
                self._map_stochastic_depth(node, self.stochastic_plans[node])
                continue
            self._map(node, target)
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        results = output.args[0]
        results = list(results) if isinstance(results, (list, tuple)) else [results]
        predictions = []
        for result in results:
            try:
                predictions.append(self.value_of(result))
            except Poisoned:
                continue
            except Refuse as exc:
                self._fail(
                    result,
                    target_name(result) if isinstance(result, fx.Node) else "output",
                    str(exc),
                )
        self._hold_unused_owners()
        self._hold_unread_parameters()
        self._check_state()
        return predictions

    def frozen_kwargs(self, statement: str) -> dict[str, bool]:
        """``frozen=true`` (every parameter of the statement) or ``frozen_PARAM=true`` for
        the statement's parameters that do not require gradients; recorded as marked."""
        keys = [k for k, owner in self.used_params.items() if owner == statement]
        frozen = [k for k in keys if not self.module.get_parameter(k).requires_grad]
        self.frozen_marked.update(frozen)
        if not frozen:
            return {}
        if len(frozen) == len(keys):
            return {"frozen": True}
        return {f"frozen_{k.rpartition('.')[2]}": True for k in frozen}

    def _map(self, node, target: str) -> None:
        if target == "getitem" and isinstance(self.values.get(node.args[0]), torch_opaque.Parts):
            torch_opaque.fallback(self, node, target)
            return
        if target == "getitem" and isinstance(self.values.get(node.args[0]), aten_ops.Pieces):
            self.values[node] = self._piece(node)
            return
        if target == "getitem" and isinstance(self.values.get(node.args[0]), aten_ops.Recurrent):
            try:  # the output sequence, or h_n (read from it); c_n is refused
                self.values[node] = self.values[node.args[0]].part(int(node.args[1]))
            except Refuse as exc:
                self._fail(node, target, str(exc))
            return
        states = [
            n for n in node.all_input_nodes if isinstance(self.values.get(n), aten_ops.FinalState)
        ]
        if states:  # a read of h_n: its last layer's entries come from the output
            try:
                self.values[node] = self.values[states[0]].read(NodeView(self, node, target))
            except Refuse as exc:
                self._fail(node, target, str(exc))
            return
        mapper = aten_ops.mapper_for(target)
        after_failure = any(arg in self.poisoned for arg in node.all_input_nodes)
        if mapper is None and not after_failure and self.fallback:
            torch_opaque.fallback(self, node, target)
            return
        if mapper is None and not (after_failure and target == "getitem"):
            # a root cause too: an op no operator computes is a gap whatever it reads
            self._fail(node, target, "no registry operator computes it")
            return
        if after_failure:
            self._poison(node)  # what it reads is reported at its root
            return
        try:
            self._check_inplace(node)
            view = NodeView(self, node, target)
            result = mapper(view)
        except Poisoned:
            self._poison(node)
            return
        except Refuse as exc:
            if not (self.fallback and torch_opaque.instead(self, node, target, str(exc))):
                self._fail(node, target, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - arguments no mapper expected: refuse them
            self._fail(node, target, f"its arguments could not be read ({_one_line(exc)})")
            return
        self.values[node] = result

    def _poison(self, node) -> None:
        self.poisoned.add(node)
        for arg in node.all_input_nodes:  # its weights are not "unused" (said once)
            if arg.op == "placeholder" and arg.name in self.params:
                self.used_params.setdefault(self.params[arg.name], "")
            if arg.op == "placeholder" and arg.name in self.buffers:
                key = self.buffers[arg.name]
                self.used_buffers.add(key)
                owner = key.rpartition(".")[0]
                counter = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
                if counter in self.buffers.values():
                    self.used_buffers.add(counter)

    def _fail(self, node, target: str, reason: str) -> None:
        if isinstance(node, fx.Node):
            self._poison(node)
        path, cls = self.where(node) if isinstance(node, fx.Node) else ("", "")
        loc = self.location(node) if isinstance(node, fx.Node) else ""
        self.unmapped.append(Unmapped(target, path, cls, loc, reason))

    # ---- what a NodeView asks for

    def add_stmt(
        self, node, op: str, args: list[str], layer: str | None, kwargs: dict, shape=None
    ) -> str:
        path, cls = self.where(node)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if layer is not None and layer in self.layer_calls:  # a later call of the module
            name = self.shared_call(layer, op, kwargs)
            self._record_classes(node)
            if shape is None:
                try:
                    shape = self.shape(node)
                except Refuse:
                    shape = None
            self.stmts.append(Stmt(name, op, args, {**kwargs, "shares": layer}, layer, shape))
            return name
        if layer is not None:
            name = layer
            if name in {t.name for t in self.inputs}:
                raise Refuse(
                    f"the input name {name!r} is also this module's path: rename the input"
                )
            if name in self.names:
                raise Refuse(f"the module {layer} is called twice (shared weights)")
            if not valid_path(name):
                raise Refuse(unusable_name(name))
            self.names.add(name)
            module_path = layer
            try:
                self.classes.setdefault(layer, qualname(type(self.module.get_submodule(layer))))
            except AttributeError:
                pass
        else:
            name = self.unique(self.functional_name(node))
            module_path = path
        self._record_classes(node)
        if layer is not None:
            self.layer_calls[layer] = (op, dict(kwargs))
        for param, key in self.ties.get(name, {}).items() if layer is not None else ():
            kwargs[f"tied_{param}"] = key
        if layer is not None:
            kwargs.update(self.frozen_kwargs(layer))
        if shape is None:
            try:
                shape = self.shape(node)
            except Refuse:
                shape = None
        self.stmts.append(Stmt(name, op, args, kwargs, module_path, shape))
        return name

    def shared_call(self, layer: str, op: str, kwargs: dict) -> str:
        """The name of a later call of the module ``layer`` (ALBERT's one layer per hidden
        layer, a module run twice): ``layer_1``, ..., written ``shares="LAYER"`` so that it
        adds no state-dict key. Refused unless it is the same operator with the same
        keywords, which is what the language accepts as one layer."""
        first_op, first_kwargs = self.layer_calls[layer]
        if (op, kwargs) != (first_op, first_kwargs):
            raise Refuse(
                f"the module {layer} is called again as another operator or with other "
                "arguments (shared weights)"
            )
        return self.unique(layer)

    def _record_classes(self, node) -> None:
        for path, cls in self.stack(node):
            if path:
                self.classes.setdefault(path, cls)


# ---------------------------------------------------------------- entry point


def import_torch(
    module: torch.nn.Module,
    inputs: Sequence[Tensor],
    name: str,
    source: str,
    fallback: bool = True,
) -> ImportedModel:
    """The network as an ImportedModel (no loss yet); ImportFailure lists what is unmapped.
    ``fallback``: an ATen node no mapper handles becomes an ``aten`` statement (listed in
    the notes) instead of being refused."""
    _check_parameter_names(module, source)
    program, how = capture(module, inputs, f"SPEC {source!r}")
    mapper = _Mapper(program, module, inputs)
    mapper.fallback = fallback
    predictions = mapper.run()
    if mapper.unmapped:
        raise ImportFailure(f"cannot import {source}", _name_the_cache(module, mapper.unmapped))
    _check_frozen(module, mapper.frozen_marked, source)
    _check_constants(mapper.stmts, source)
    if len(predictions) != 1:
        raise ImportFailure(f"{source}: forward must return one prediction tensor")
    mapper.classes.setdefault("", qualname(type(module)))
    return ImportedModel(
        name=name,
        source=source,
        inputs=list(inputs),
        targets=[],
        stmts=mapper.stmts,
        predictions=predictions,
        classes=mapper.classes,
        notes=[f"captured with {how}", *(f"opaque: {line}" for line in mapper.opaque)],
    )


def _check_frozen(module: torch.nn.Module, marked: set[str], source: str) -> None:
    """Every parameter that does not require gradients is written frozen; one the import
    could not mark (a free parameter) would train: refused, with the fix."""
    frozen = [
        name for name, p in module.named_parameters() if not p.requires_grad and name not in marked
    ]
    if frozen:
        shown = ", ".join(frozen[:6]) + (
            f", ... ({len(frozen) - 6} more)" if len(frozen) > 6 else ""
        )
        raise ImportFailure(
            f"{source}: {len(frozen)} parameters do not require gradients ({shown}) and are "
            "not a layer's, which the text can freeze: the imported model would train them; "
            "unfreeze them (requires_grad_(True)) to import"
        )


def _caching_config(module: torch.nn.Module) -> object | None:
    """The Hugging Face config with ``use_cache=True`` in ``module``, else None."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            return config
    return None


def _name_the_cache(module: torch.nn.Module, unmapped: list[Unmapped]) -> list[Unmapped]:
    """Failures that read a key/value cache (``detach_`` of an empty tensor that later steps
    of generation would fill) become one line that names the cache and the fix: the other
    messages would name ``detach_``, a consequence, not the cause."""
    if _caching_config(module) is None:
        return unmapped
    cache = [u for u in unmapped if "detach_" in u.reason or "DynamicCache" in u.reason]
    if not cache:
        return unmapped
    paths = sorted({u.module_path for u in cache})
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    line = Unmapped(
        "use_cache=True",
        paths[0],
        cache[0].module_class,
        reason=(
            f"the key/value cache for generation (written in {shown}): a training step "
            "has no use for it; build the model with use_cache=False in its config (or "
            "pass use_cache=False to forward)"
        ),
    )
    return [line] + [u for u in unmapped if u not in cache]


def _check_parameter_names(module: torch.nn.Module, source: str) -> None:
    """A parameter named ``class`` / ``None`` / ``lambda``: the generated module holds a
    free parameter as an attribute of that name, which Python cannot write, and renaming
    it would break ``load_state_dict(strict=True)`` with the original: refused up front."""
    for key, _ in module.named_parameters():
        last = key.rpartition(".")[2]
        if keyword.iskeyword(last):
            raise ImportFailure(
                f"SPEC {source!r}: the parameter {key!r} is named after the Python keyword {last!r}, "
                "which a generated module cannot hold as an attribute; rename it in the "
                "original network"
            )


def _check_constants(stmts: Sequence[Stmt], source: str) -> None:
    """A float constant of the user's code outside float32 (``x * 1e300``, ``* inf``) is
    the network overflowing, not an importer gap: one line naming the statement."""
    for stmt in stmts:
        for key, value in stmt.kwargs.items():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, float) and not abs(item) <= MAX_FLOAT:
                    where = stmt.module_path or "<root>"
                    raise ImportFailure(
                        f"SPEC {source!r}: the network uses the constant {item!r} ({stmt.op} "
                        f"{key}= at {where}), outside the float32 range the generated module "
                        f"computes in (magnitude at most {MAX_FLOAT:g}): the network "
                        "overflows there; change the constant"
                    )
