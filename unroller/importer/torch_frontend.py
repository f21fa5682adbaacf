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
"""

from __future__ import annotations

import contextlib
import keyword
import logging
import operator
import os
import re
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import fx

from unroller.graph import MAX_FLOAT
from unroller.importer import aten_ops, batch_merge, masks, rotary
from unroller.importer.aten_ops import Refuse, schema_arguments
from unroller.importer.hf_norms import is_hf_rmsnorm, rmsnorm_kwargs
from unroller.importer.model import (
    BATCH,
    EXAMPLE_BATCH,
    ImportedModel,
    ImportFailure,
    Stmt,
    Tensor,
    Unmapped,
    shape_text,
    valid_path,
)
from unroller.importer.source import FILE_MODULES, WRAPPER_PREFIX, Predictions, class_name
from unroller.runtime.positions import relative_buckets

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


def _strip(path: str) -> str:
    """A path or state-dict key of the wrapper -> the user's module's."""
    if path == WRAPPER_PREFIX[:-1]:
        return ""
    return path[len(WRAPPER_PREFIX) :] if path.startswith(WRAPPER_PREFIX) else path


def _qualname(cls) -> str:
    if isinstance(cls, str):
        module, _, rest = cls.partition(".")
        return f"{FILE_MODULES[module]}.{rest}" if module in FILE_MODULES else cls
    return class_name(cls)


# ---------------------------------------------------------------- the mapper


class _Poisoned(Refuse):
    """Reads a value that already failed: reported once, at its root."""


class _Mapper:
    """Walks the exported graph once, producing statements or unmapped records."""

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
        self.padding = masks.find(self, _target_name, _is_size_value)
        self.absorbed |= self.padding.absorbed
        self.absorbed |= masks.absorb_key_padding(self, _target_name)
        # mask input (and a size it is expanded to) -> its padding_mask statement
        self.padding_values: dict[object, str] = {}
        self._absorb_masked_biases()
        self.stochastic = self._stochastic_depth_sites()
        self.stochastic_told: set[int] = set()
        self.merged = batch_merge.find(self, _target_name)

    # ---- the graph's signature: which placeholder is what

    def _read_signature(self) -> None:
        kinds = torch.export.graph_signature.InputKind
        user = iter(self.inputs)
        for spec in self.program.graph_signature.input_specs:
            name = spec.arg.name
            if spec.kind == kinds.PARAMETER:
                self.params[name] = _strip(spec.target)
            elif spec.kind == kinds.BUFFER and spec.persistent is False:
                # not in the state dict: a constant of the code (position ids)
                self.constants.add(name)
                self.constant_values[name] = self.program.constants[spec.target]
            elif spec.kind == kinds.BUFFER:
                self.buffers[name] = _strip(spec.target)
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

    def collapser(self, path: str, cls: str) -> Callable | None:
        """The builder that maps the module at ``path`` (class ``cls``) as one statement
        (``COLLAPSED``, or a Hugging Face RMSNorm recognised by its source), else None."""
        found = COLLAPSED.get(cls)
        if found is None and cls.startswith("transformers.") and path:
            with contextlib.suppress(AttributeError):
                if is_hf_rmsnorm(type(self.module.get_submodule(path))):
                    found = _hf_rmsnorm
        return found

    def stack(self, node) -> list[tuple[str, str]]:
        """(path, class) from the outermost module call to the innermost, wrapper removed."""
        stack = node.meta.get("nn_module_stack") or {}
        out = []
        for path, cls in stack.values():
            path = _strip(path)
            if path.startswith("L['self']") or path.startswith("L__self__"):
                continue
            out.append((path, _qualname(cls)))
        return [(p, c) for p, c in out if p or True]

    def where(self, node) -> tuple[str, str]:
        stack = [(p, c) for p, c in self.stack(node) if p]
        if not stack:
            return "", _qualname(type(self.module))
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

    # ---- collapsed module calls (nn.MultiheadAttention)

    def _collapsed_groups(self) -> dict[fx.Node, str]:
        groups = {}
        for node in self.nodes:
            if node.op != "call_function":
                continue
            for path, cls in self.stack(node):
                if self.collapser(path, cls) is not None:
                    groups[node] = path
                    break
        return groups

    def _constant_nodes(self) -> set[fx.Node]:
        """Tensors computed from sizes and constants only (masks, ``zeros`` states):
        not statements; a consumer that accepts them (an attention mask) evaluates them."""
        constant: set[fx.Node] = set()
        for node in self.nodes:
            if node.op == "placeholder":
                if node.name in self.constants:
                    constant.add(node)
            elif node.op == "call_function" and not _is_size_value(node):
                if _target_name(node) == "aten.sym_size.int" or _random(node):
                    continue  # a random draw is not a constant of the code
                inputs = [a for a in node.all_input_nodes if not _is_size_value(a)]
                if all(a in constant for a in inputs):
                    constant.add(node)
                elif self._uniform_gather(node, constant):
                    constant.add(node)
        return constant

    def _uniform_gather(self, node: fx.Node, constant: set[fx.Node]) -> bool:
        """A gather from a constant tensor whose elements are all one value (RoBERTa's
        zero token types gathered at the position ids): that value everywhere, whatever
        the indices, so a constant of the index's shape (``self.uniform``)."""
        if _target_name(node) != "aten.gather.default" or node.args[0] not in constant:
            return False
        try:
            source = _constant_value(self, node.args[0])
        except Refuse:
            return False
        if not isinstance(source, torch.Tensor) or source.numel() == 0:
            return False
        first = source.reshape(-1)[0]
        if not bool((source == first).all()):
            return False
        self.uniform[node] = first.item()
        return True

    def _rotary_patterns(self) -> tuple[dict[fx.Node, rotary.Rotary], set[fx.Node]]:
        """Rotary embeddings (``rotary``): the final add of each -> the match; the nodes
        the matches replace, which are then not mapped one by one."""
        found: dict[fx.Node, rotary.Rotary] = {}
        absorbed: set[fx.Node] = set()
        tries = None
        for node in self.nodes:
            if (
                node not in self.live
                or node in self.groups
                or _target_name(node) != "aten.add.Tensor"
            ):
                continue
            if tries is None:
                tries = rotary.candidates(self.module)
            hit = rotary.match(
                node, _target_name, self.constant, lambda n: _constant_value(self, n), tries
            )
            if hit is None:
                continue
            inside = hit.nodes | {node}
            if any(u not in inside for n in hit.nodes for u in n.users if u in self.live):
                continue  # a part of it is read elsewhere: map the nodes one by one
            found[node] = hit
            absorbed |= hit.nodes
        return found, absorbed

    def _position_patterns(self) -> dict[fx.Node, tuple[fx.Node, int]]:
        """Position ids computed from the token ids (RoBERTa's
        ``create_position_ids_from_input_ids``): an integer tensor that an embedding looks
        up, computed from one integer input only, whose values equal ``padded_positions``
        of that input for the embedding's padding_idx on sample ids, padding included ->
        (the input, padding_idx). Its nodes are then not mapped one by one."""
        found: dict[fx.Node, tuple[fx.Node, int]] = {}
        for node in self.nodes:
            if node not in self.live or _target_name(node) != "aten.embedding.default":
                continue
            idx = node.args[1] if len(node.args) > 1 else None
            if not isinstance(idx, fx.Node) or idx.op == "placeholder" or idx in self.constant:
                continue
            hit = self._positions_of(node, idx)
            if hit is not None:
                found[idx] = hit
                self.absorbed |= hit[2]
        return {k: (ids, pad) for k, (ids, pad, _) in found.items()}

    def _relative_bias_patterns(self) -> dict[fx.Node, tuple[fx.Node, dict]]:
        """T5's relative position bias: a table (an embedding's weight) looked up at a
        constant [L, S] index table without the batch dim, permuted to [H, L, S] and
        unsqueezed to [1, H, L, S] -> the unsqueeze: (the embedding node, the
        ``relative_position_bias`` arguments). Taken only when the constant indices equal the
        op's buckets bit for bit, for a max_distance the module holds (T5Attention's
        ``relative_attention_max_distance``) and one direction or both; the nodes are then
        not mapped one by one."""
        found: dict[fx.Node, tuple[fx.Node, dict]] = {}
        for node in self.nodes:
            if node not in self.live or _target_name(node) != "aten.embedding.default":
                continue
            ids = node.args[1] if len(node.args) > 1 else None
            if ids not in self.constant or len(node.users) != 1:
                continue
            (permute,) = node.users
            if _target_name(permute) != "aten.permute.default" or len(permute.users) != 1:
                continue
            (unsqueeze,) = permute.users
            if (
                [int(d) for d in permute.args[1]] != [2, 0, 1]
                or _target_name(unsqueeze) != "aten.unsqueeze.default"
                or int(unsqueeze.args[1]) != 0
            ):
                continue
            kwargs = self._bucket_kwargs(node, ids)
            if kwargs is not None:
                found[unsqueeze] = (node, kwargs)
                self.absorbed |= {node, permute}
        return found

    def _absorb_masked_biases(self) -> None:
        """An attention's attn_mask written ``where(constant mask, bias, lowest)`` (and
        copies of it) is read whole by the attention statement (``attention_bias``): its
        nodes are not mapped one by one when nothing else reads them."""
        for node in self.nodes:
            if node not in self.live or node in self.groups:
                continue
            if _target_name(node) != "aten.scaled_dot_product_attention.default":
                continue
            mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            if not isinstance(mask, fx.Node) or mask in self.constant:
                continue
            chain, current = [], mask
            while _target_name(current) in _COPIES:
                chain.append(current)
                current = current.args[0]
            if _target_name(current) == "aten.where.ScalarOther" and (
                current.args[0] in self.constant
                or current.args[0] in self.padding.found
                or current.args[0] in self.padding.refused
            ):
                chain.append(current)
                inside = set(chain) | {node}
                if all(u in inside for n in chain for u in n.users if u in self.live):
                    self.absorbed |= set(chain)

    def _bucket_kwargs(self, embedding: fx.Node, ids: fx.Node) -> dict | None:
        try:
            table = _constant_value(self, ids)
        except Refuse:
            return None
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.long:
            return None
        buckets = int(embedding.args[0].meta["val"].shape[0])
        distances = []
        for path, _ in reversed(self.stack(embedding)):
            with contextlib.suppress(AttributeError):
                found = self.module.get_submodule(path).relative_attention_max_distance
                if isinstance(found, int):
                    distances.append(found)
        length, keys = (int(d) for d in table.shape)
        for distance in dict.fromkeys([*distances, 128]):
            for both in (True, False):
                kwargs = dict(
                    num_buckets=buckets,
                    query_length=length,
                    key_length=keys,
                    max_distance=distance,
                    bidirectional=both,
                )
                with contextlib.suppress(ValueError, ZeroDivisionError, RuntimeError):
                    ours = relative_buckets(length, keys, buckets, distance, both)
                    if distance > buckets // (2 if both else 1) // 2 and torch.equal(ours, table):
                        return kwargs
        return None

    def _positions_of(self, embedding: fx.Node, idx: fx.Node):
        val = idx.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.int64 or val.dim() != 2:
            return None
        inputs, inside = set(), []
        todo, seen = [idx], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            if current.op == "placeholder":
                if current.name not in self.user_inputs:
                    return None  # reads a parameter or buffer
                inputs.add(current)
                continue
            if _target_name(current) != "aten.sym_size.int":
                inside.append(current)
                todo.extend(current.all_input_nodes)
        if len(inputs) != 1:
            return None
        (ids,) = inputs
        if ids.meta["val"].dtype != torch.int64 or tuple(ids.meta["val"].shape[1:]) != tuple(
            val.shape[1:]
        ):
            return None
        inside_set = set(inside)
        if any(
            u not in inside_set and u is not embedding
            for n in inside
            for u in n.users
            if u in self.live and n is not idx
        ):
            return None  # a part of it is read elsewhere
        path, _ = self.where(embedding)
        pads = []
        with contextlib.suppress(AttributeError):
            pads.append(self.module.get_submodule(path).padding_idx)
        pads += [1, 0]
        for pad in dict.fromkeys(p for p in pads if isinstance(p, int) and p >= 0):
            if self._computes_positions(idx, ids, inside_set, pad):
                return ids, pad, inside_set - {idx}
        return None

    def _computes_positions(self, idx, ids, inside: set, pad: int) -> bool:
        """Whether the subgraph gives ``padded_positions(sample, pad)`` on sample ids (with
        padding tokens, rows of only padding and rows without any)."""
        from unroller.runtime.common import padded_positions

        length = int(ids.meta["val"].shape[1])
        generator = torch.Generator().manual_seed(0)
        for trial in range(4):
            sample = torch.randint(0, pad + 50, (EXAMPLE_BATCH, length), generator=generator)
            sample[:, ::3] = pad if trial % 2 else sample[:, ::3]
            if trial == 3:
                sample[0] = pad
            try:
                got = self._run_on(idx, ids, sample, inside)
            except Exception:  # noqa: BLE001 - not a computation of the ids alone
                return False
            if not isinstance(got, torch.Tensor) or not torch.equal(
                got, padded_positions(sample, padding_idx=pad)
            ):
                return False
        return True

    def _run_on(self, idx: fx.Node, ids: fx.Node, sample: torch.Tensor, inside: set) -> object:
        """The value of ``idx`` with the input ``ids`` set to ``sample``."""
        values: dict[fx.Node, object] = {ids: sample}
        for node in self.nodes:
            if _target_name(node) == "aten.sym_size.int":
                if node.args[0] is ids:
                    values[node] = sample.shape[int(node.args[1])]
                continue
            if node not in inside:
                continue
            args = fx.node.map_arg(node.args, values.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
            values[node] = node.target(*args, **kwargs)
        return values.get(idx)

    def padding_value(self, mask: fx.Node) -> str:
        """The ``padding_mask`` statement of the input a matched mask is computed from
        (``masks.find``): one per input, named by the first mask read."""
        ids, _ = self.padding.found[mask]
        if ids not in self.padding_values:
            length = self.dim(ids.meta["val"].shape[1])
            self.padding_values[ids] = self.add_stmt(
                mask, "padding_mask", [self.value_of(ids)], None, {}, (BATCH, 1, 1, length)
            )
        return self.padding_values[ids]

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
        target = _target_name(node)
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
        if node in self.values:
            return self.values[node]
        if node in self.poisoned:
            raise _Poisoned(node.name)
        if node in self.constant and node.op != "placeholder":
            raise Refuse(
                f"reads {node.name} ({_target_name(node)}), a tensor built from sizes and "
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
            target = _target_name(node)
            if target in _SIZE_OPS or _is_size_value(node) or node in self.constant:
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
            self._map(node, target)
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        results = output.args[0]
        results = list(results) if isinstance(results, (list, tuple)) else [results]
        predictions = []
        for result in results:
            try:
                predictions.append(self.value_of(result))
            except _Poisoned:
                continue
            except Refuse as exc:
                self._fail(
                    result,
                    _target_name(result) if isinstance(result, fx.Node) else "output",
                    str(exc),
                )
        self._hold_unused_owners()
        self._check_state()
        return predictions

    def _hold_unused_owners(self) -> None:
        """A tied tensor whose first key (its owner, which the others are tied to) belongs
        to a module the forward never calls (T5's ``shared`` embedding, read only through
        the encoder's and decoder's ``embed_tokens``): a ``parameter`` statement holds it
        under that key, so the state dict keeps every key torch's has."""
        keys: dict[str, torch.nn.Parameter] = dict(
            self.module.named_parameters(remove_duplicate=False)
        )
        tied_to = {key for ties in self.ties.values() for key in ties.values()}
        held = []
        for first in self.first_keys.values():
            if first in self.used_params or first not in tied_to:
                continue
            if not valid_path(first):
                continue  # reported by _check_state
            shape = tuple(int(d) for d in keys[first].shape)
            owner = first.rpartition(".")[0]
            held.append(
                Stmt(first, "parameter", [], {"shape": shape, "init": "zeros"}, owner, shape)
            )
            self.names.add(first)
            self.used_params[first] = first
        self.stmts[:0] = held

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

    def _map_rotary(self, node: fx.Node, hit: rotary.Rotary) -> None:
        """One ``rotary`` statement for a matched rotary embedding (``_rotary_patterns``)."""
        if hit.theta is None:
            self._fail(node, "rotary position embedding", hit.why)
            return
        try:
            view = NodeView(self, node, _target_name(node))
            kwargs = {"theta": hit.theta}
            if hit.scaling != 1.0:
                kwargs["scaling"] = hit.scaling
            self.values[node] = view.stmt("rotary", [self.value_of(hit.x)], **kwargs)
        except _Poisoned:
            self._poison(node)
        except Refuse as exc:
            self._fail(node, "rotary position embedding", str(exc))

    def _map_relative_bias(self, node: fx.Node, embedding: fx.Node, kwargs: dict) -> None:
        """One ``relative_position_bias`` statement for a matched T5 bias, named by its
        table's module (``_relative_bias_patterns``)."""
        try:
            view = NodeView(self, embedding, _target_name(embedding))
            layer = view.layer("weight")
            heads = int(embedding.args[0].meta["val"].shape[1])
            self.values[node] = view.stmt(
                "relative_position_bias",
                [],
                layer=layer,
                value_shape=self.shape(node),
                heads=heads,
                **kwargs,
            )
        except _Poisoned:
            self._poison(node)
        except Refuse as exc:
            self._fail(node, "relative position bias", str(exc))

    def _map(self, node, target: str) -> None:
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
        except _Poisoned:
            self._poison(node)
            return
        except Refuse as exc:
            self._fail(node, target, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - arguments no mapper expected: refuse them
            self._fail(node, target, f"its arguments could not be read ({_one_line(exc)})")
            return
        self.values[node] = result

    def _stochastic_depth_sites(self) -> dict[fx.Node, int]:
        """Stochastic depth (torchvision's StochasticDepth, timm's DropPath): a random draw
        of one value per sample (``[N, 1, ...]``), or per batch (all ones) in a module named
        so, which scales a residual branch. Each draw and the tensor it fills -> the draw's index: reported
        once, by name, rather than as its ``bernoulli_`` / ``new_empty`` parts."""

        def per_sample(node) -> bool:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() == 0:
                return False
            dims = [self.dim(d) for d in val.shape]
            return dims[0] in (BATCH, 1) and all(d == 1 for d in dims[1:])

        sites: dict[fx.Node, int] = {}
        for node in self.nodes:
            if node.op != "call_function" or not _random(node) or "dropout" in _short_name(node):
                continue
            if not per_sample(node) or node in sites:
                continue
            named = re.search(r"StochasticDepth|DropPath", self.where(node)[1])
            if self.dim(node.meta["val"].shape[0]) != BATCH and not named:
                continue  # one draw for the whole batch: stochastic depth only by name
            ident = self.order[node]
            sites[node] = ident
            for arg in node.all_input_nodes:  # the empty tensor the draw fills in place
                if _short_name(arg) in _FILLED and len(arg.users) == 1:
                    sites[arg] = ident
            todo = list(node.users)  # the mask's own arithmetic (floor_, div_ by keep)
            while todo:
                user = todo.pop()
                if user not in sites and user.op == "call_function" and per_sample(user):
                    sites[user] = ident
                    todo.extend(user.users)
        return sites

    def _refuse_stochastic_depth(self, node) -> None:
        """One line per stochastic depth, naming it, its module and the fix."""
        ident = self.stochastic[node]
        if ident in self.stochastic_told:
            self._poison(node)
            return
        self.stochastic_told.add(ident)
        draw = self.nodes[ident]
        path, _ = self.where(draw)
        prob = None
        with contextlib.suppress(AttributeError):
            sub = self.module.get_submodule(path) if path else self.module
            prob = next(
                (
                    getattr(sub, a)
                    for a in ("p", "drop_prob")
                    if isinstance(getattr(sub, a, None), float)
                ),
                None,
            )
        if prob is None and _short_name(draw) == "bernoulli" and len(draw.args) > 1:
            with contextlib.suppress(TypeError, ValueError):
                prob = 1.0 - float(draw.args[1])
        said = f" (drop probability {prob:g})" if prob is not None else ""
        self._fail(
            draw,
            "stochastic depth",
            f"a random drop of a residual branch, per sample{said}, which "
            "the import captures in training mode and no registry operator draws; build the "
            "network with its probability 0 (StochasticDepth(p=0.0), drop_path_rate=0.0), "
            "where it is the identity, as at inference",
        )
        for other, i in self.stochastic.items():
            if i == ident:
                self._poison(other)

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

    def _check_inplace(self, node) -> None:
        """An in-place op maps as its functional form only when it writes a tensor of its
        own (not a view of another: the write would reach the base, which the functional
        form drops) and nothing reads the old value afterwards; a mutated input,
        parameter or buffer is refused."""
        mutated = _written(node)
        if mutated is None:
            return
        if mutated.op == "placeholder":
            if mutated.name in self.user_inputs:
                raise Refuse("modifies the network's input in place")
            raise Refuse(f"modifies {self.params.get(mutated.name) or mutated.name} in place")
        family = self._view_family(mutated)  # the write reaches every view of its base
        for member in family:
            later = [
                u
                for u in member.users
                if u is not node and u not in family and self.order[u] > self.order[node]
            ]
            if later:
                what = mutated.name if member is mutated else f"{member.name} (a view of it)"
                raise Refuse(
                    f"in place on {mutated.name}, but {later[0].name} reads {what} " "afterwards"
                )

    def _view_family(self, node) -> set:
        """The tensor's base (followed back through view ops) and every view made of it."""
        base = node
        while (
            base.op == "call_function"
            and _short_name(base) in _VIEW_OPS
            and isinstance(base.args[0], fx.Node)
        ):
            base = base.args[0]
        family, todo = set(), [base]
        while todo:
            current = todo.pop()
            if current in family:
                continue
            family.add(current)
            todo.extend(
                u for u in current.users if u.op == "call_function" and _short_name(u) in _VIEW_OPS
            )
        return family

    def _check_dead(self, node) -> None:
        """A dead node still matters when it writes something (``h[:, 0] = 0`` writes
        through a view; a parameter clamped or a buffer updated after use) or is a region
        of other code (``torch.no_grad()`` blocks): the step would silently drop it. Only
        batch norm's num_batches_tracked is accounted for (the batch norm maps with it)."""
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            self._fail(
                node,
                _target_name(node),
                "a region of code (no_grad, a cond, ...) " "whose effects the step would drop",
            )
            return
        mutated = _written(node)
        if mutated is None:
            return
        if mutated.name in self.buffers and self.buffers[mutated.name].endswith(
            ".num_batches_tracked"
        ):
            return
        what = self.buffers.get(mutated.name) or self.params.get(mutated.name) or mutated.name
        self._fail(node, _target_name(node), f"writes {what} in place, which the step would drop")

    def _collapse(self, path: str) -> None:
        nodes = [n for n in self.nodes if self.groups.get(n) == path]
        members = set(nodes)
        cls = next(c for p, c in self.stack(nodes[0]) if p == path)
        external: list[fx.Node] = []
        for node in nodes:
            for arg in node.all_input_nodes:
                if (
                    arg in members
                    or _is_size_value(arg)
                    or arg.op == "placeholder"
                    and (arg.name in self.params or arg.name in self.buffers)
                ):
                    continue
                if arg not in external:
                    external.append(arg)
        escaping = [
            n
            for n in nodes
            if not _is_size_value(n) and any(u not in members and u in self.live for u in n.users)
        ]
        # a cast to the dtype a tensor already has is that tensor (Llama's RMSNorm casts its
        # input to float32, and the residual reads the cast): not an output of the module
        aliases = [n for n in escaping if _same_dtype_cast(n, external)]
        escaping = [n for n in escaping if n not in aliases]
        try:
            stmt = self.collapser(path, cls)(
                self, path, self.module.get_submodule(path), nodes, external, escaping
            )
        except _Poisoned:
            for node in nodes:
                self._poison(node)
            return
        except Refuse as exc:
            self._fail(nodes[0], cls, str(exc))
            for node in nodes:
                self._poison(node)
            return
        for node in escaping:
            self.values[node] = stmt
        for node in aliases:
            self.values[node] = self.values[node.args[0]]

    def _check_state(self) -> None:
        """Every parameter and buffer in the state dict has a statement that owns it."""
        state = self.module.state_dict(keep_vars=True)
        missing = [k for k in state if k not in self.used_params and k not in self.used_buffers]
        for key in missing:
            kind = "parameter" if isinstance(state[key], torch.nn.Parameter) else "buffer"
            path = key.rpartition(".")[0]
            cls = _qualname(type(self.module.get_submodule(path))) if path else ""
            self.unmapped.append(
                Unmapped(
                    f"{kind} {key}",
                    path,
                    cls,
                    reason="no mapped operator uses it, so the imported module could not "
                    "load the original's state_dict",
                )
            )

    # ---- what a NodeView asks for

    def add_stmt(
        self, node, op: str, args: list[str], layer: str | None, kwargs: dict, shape=None
    ) -> str:
        path, cls = self.where(node)
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
                self.classes.setdefault(layer, _qualname(type(self.module.get_submodule(layer))))
            except AttributeError:
                pass
        else:
            name = self.unique(self.functional_name(node))
            module_path = path
        self._record_classes(node)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
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

    def _record_classes(self, node) -> None:
        for path, cls in self.stack(node):
            if path:
                self.classes.setdefault(path, cls)


def unusable_name(path: str) -> str:
    """Why a module path cannot name a statement."""
    return (
        f"the module path {path!r} cannot be a model-language name (each part must be an "
        "identifier or an integer without leading zeros)"
    )


def _target_name(node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


#: ATen ops whose output shares its input's storage (an in-place write to it changes the
#: input too).
#: tensors made only to be filled by a random draw in place (``empty(...).bernoulli_(q)``)
_FILLED = frozenset({"empty", "new_empty", "empty_like", "zeros", "new_zeros", "zeros_like"})

_VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "select",
        "slice",
        "narrow",
        "transpose",
        "t",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "diagonal",
        "unflatten",
        "flatten",
        "split",
        "chunk",
        "unbind",
        "alias",
        "view_as",
        "expand_as",
        "unfold",
        "split_with_sizes",
        "movedim",
        "swapaxes",
        "real",
        "imag",
        "detach",
    }
)


def _random(node) -> bool:
    """Whether the op draws random numbers (bernoulli_, rand, dropout)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _short_name(node) -> str:
    """``aten.transpose.int`` -> ``transpose``."""
    parts = _target_name(node).split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _written(node) -> fx.Node | None:
    """The tensor an op writes in place (its first argument, when the schema says so)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return None
    first = schema.arguments[0].alias_info
    if first is None or not first.is_write:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def _is_size_value(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, (torch.SymInt, int, float, bool)) and not isinstance(val, torch.Tensor)


class NodeView:
    """What an ``aten_ops`` mapper sees of one node (see that module's docstring)."""

    def __init__(self, mapper: _Mapper, node: fx.Node, target: str):
        self.m = mapper
        self.node = node
        self.target = target
        self.a = schema_arguments(node)
        if node in mapper.merged.lead:  # dims counted on the unmerged shape
            self.a = batch_merge.unmerge_dims(self.a, mapper.merged.lead[node])
        self.keys = list(self.a)
        for one, other in (("self", "input"), ("input", "self")):
            if one in self.a and other not in self.a:  # mappers may say either
                self.a[other] = self.a[one]
        self.keys = list(self.a)

    def _arg(self, key):
        return self.a[self.keys[key]] if isinstance(key, int) else self.a[key]

    def is_tensor(self, value) -> bool:
        return isinstance(value, fx.Node) and not _is_size_value(value)

    def value(self, key) -> str:
        return self.m.value_of(self._arg(key))

    def value_of(self, node) -> str:
        return self.m.value_of(node)

    def in_shape(self, key) -> tuple:
        return self.m.shape(self._arg(key))

    def shape_of(self, node) -> tuple:
        return self.m.shape(node)

    def out_shape(self) -> tuple:
        return self.m.shape(self.node)

    def sizes(self, values) -> tuple:
        out = []
        for v in values:
            val = v.meta.get("val") if isinstance(v, fx.Node) else v
            d = self.m.dim(val)
            if isinstance(d, str) and d != BATCH:
                raise Refuse(f"a size that depends on the batch ({d[1:]})")
            out.append(d)
        return tuple(out)

    def param_key(self, key: str) -> str | None:
        node = self.a.get(key)
        if node is None:
            return None
        if not isinstance(node, fx.Node) or node.name not in self.m.params:
            raise Refuse(f"its {key} is computed, not a parameter")
        return self.m.params[node.name]

    def param_shape(self, key: str) -> tuple[int, ...]:
        self.param_key(key)
        return tuple(int(d) for d in self.a[key].meta["val"].shape)

    def layer(self, *param_keys: str, **buffer_keys: str) -> str:
        """The statement name of a layer whose tensors are these parameters and buffers:
        their common module path, each key named as the registry names it."""
        owner = None
        claims = []
        for key in param_keys:
            full = self.param_key(key)
            if full is None:
                continue
            claims.append((full, key, True))
        for key, arg in buffer_keys.items():
            node = self.a.get(arg)
            if node is None:
                continue
            if not isinstance(node, fx.Node) or node.name not in self.m.buffers:
                raise Refuse(f"its {arg} is not a buffer")
            claims.append((self.m.buffers[node.name], key, False))
        ties = {}
        for i, (full, key, is_param) in enumerate(claims):
            if is_param and self.m.shared_keys.get(full):
                full, tied_to = self._tied_claim(full, key)
                claims[i] = (full, key, is_param)
                if tied_to is not None:
                    ties[key] = tied_to
            path, _, leaf = full.rpartition(".")
            if leaf != key:
                raise Refuse(f"its {key} is the tensor {full}, not a module's '{key}'")
            if owner is not None and path != owner:
                raise Refuse(f"its tensors belong to different modules ({owner}, {path})")
            owner = path
        if owner is None:
            raise Refuse("no parameter or buffer names the layer")
        for full, _, _ in claims:
            if full in self.m.used_params or full in self.m.used_buffers:
                raise Refuse(f"{full} is used by two operators (shared weights)")
        if ties:
            self.m.ties[owner] = ties
        for full, _, is_param in claims:
            if is_param:
                self.m.used_params[full] = owner
            else:
                self.m.used_buffers.add(full)
        return owner

    def _tied_claim(self, full: str, key: str) -> tuple[str, str | None]:
        """(the key this node's layer holds the tensor ``full`` under, the key it is tied to
        or None). torch.export names a tensor that several modules share (tied weights) by
        one of its keys; the node's own module holds it as its ``key`` parameter, and the
        first key of the tensor in state-dict order owns it, the others are tied to it."""
        path, _ = self.m.where(self.node)
        try:
            theirs = self.m.module.get_parameter(full)
            mine = self.m.module.get_submodule(path)._parameters.get(key) if path else None
        except AttributeError:
            return full, None
        if mine is None or mine is not theirs:
            return full, None
        own = f"{path}.{key}"
        first = self.m.first_keys.get(id(theirs), own)
        return own, (first if first != own else None)

    def expect_buffer(self, key: str) -> None:
        if key not in self.m.buffers.values():
            raise Refuse(f"the module has no buffer {key}")
        self.m.used_buffers.add(key)

    def stmt(
        self, op: str, args: list[str], layer: str | None = None, value_shape=None, **kwargs
    ) -> str:
        """A statement for this node; ``value_shape`` when the registry op's output differs
        from the node's (a value without the batch dim that broadcasts like the node's)."""
        return self.m.add_stmt(self.node, op, args, layer, kwargs, value_shape)

    def alias(self, key) -> str:
        return self.m.value_of(self._arg(key))

    def constant(self, key):
        """The value of an argument computed from sizes and constants only (evaluated at
        the capture batch size), else None."""
        node = self._arg(key)
        if isinstance(node, fx.Node) and node in self.m.constant:
            return _constant_value(self.m, node)
        return None

    def causal_mask(self, mask, causal: bool) -> bool:
        return is_causal_mask(self.m, mask, causal)

    def attention_bias(self, mask, causal: bool) -> tuple[bool, str | None]:
        """(causal, the value of an additive score bias or None) for an attention's
        attn_mask: a constant mask is the causal one or nothing (``is_causal_mask``); one
        computed from the weights or inputs is a bias, where Hugging Face writes it as
        ``where(constant mask, bias, lowest float)``, the constant part read as the causal
        mask or nothing and the bias kept; a float mask as it is."""
        if not _reads_data(self.m, mask):
            return is_causal_mask(self.m, mask, causal), None
        node = _through_copies(mask)
        padding = self.m.padding
        if _target_name(node) == "aten.where.ScalarOther" and node.args[0] in padding.refused:
            raise Refuse(padding.refused[node.args[0]])
        if node in padding.refused:
            raise Refuse(padding.refused[node])
        if node in padding.found:  # a padding mask given as an input (masks.find)
            # [N, 1, 1, S] broadcast to the attention's [N, 1, L, S] (a view)
            size = (BATCH, 1, self.out_shape()[2], self.m.shape(node)[-1])
            key = (padding.found[node][0], size)
            if key not in self.m.padding_values:
                pad = self.m.padding_value(node)
                stmt = self.m.add_stmt(node, "expand", [pad], None, {"size": size}, size)
                self.m.padding_values[key] = stmt
            return causal or padding.found[node][1], self.m.padding_values[key]
        if _target_name(node) == "aten.where.ScalarOther" and node.args[0] in padding.found:
            lowest = node.args[2]
            if not isinstance(lowest, (int, float)) or lowest > -1e30:
                raise Refuse(f"an attention mask filled with {lowest!r}: expected a lowest float")
            # the bias where attended, and (near) lowest where padded: probabilities 0 there
            pad = self.m.padding_value(node.args[0])
            summed = self.m.add_stmt(node, "add", [self.m.value_of(node.args[1]), pad], None, {})
            return causal or padding.found[node.args[0]][1], summed
        if _target_name(node) == "aten.where.ScalarOther" and node.args[0] in self.m.constant:
            lowest = node.args[2]
            if not isinstance(lowest, (int, float)) or lowest > -1e30:
                raise Refuse(f"an attention mask filled with {lowest!r}: expected a lowest float")
            causal = is_causal_mask(self.m, node.args[0], causal)
            return causal, self.m.value_of(node.args[1])
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            raise Refuse("a boolean attention mask computed from the inputs or the weights")
        return causal, self.m.value_of(node)


# ---------------------------------------------------------------- masks


_COPIES = ("aten.contiguous.default", "aten.clone.default", "aten.alias.default")


def _through_copies(node: fx.Node) -> fx.Node:
    """The node a chain of contiguous / clone / alias copies reads."""
    while _target_name(node) in _COPIES:
        node = node.args[0]
    return node


def _dependencies(mapper: _Mapper, node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` is computed from, in graph order; a size read
    (``aten.sym_size.int``) is a leaf, so a mask built from the inputs' shapes only is
    constant. Refuse if it reads an input's values, a parameter or a buffer."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if current.name not in mapper.constants:
                raise Refuse("an attention mask computed from the inputs or the weights")
            continue
        if _target_name(current) == "aten.sym_size.int" or current in mapper.uniform:
            continue
        todo.extend(current.all_input_nodes)
    return [n for n in mapper.nodes if n in seen]


def _reads_data(mapper: _Mapper, node: fx.Node) -> bool:
    try:
        _dependencies(mapper, node)
    except Refuse:
        return True
    return False


def _constant_value(mapper: _Mapper, node: fx.Node) -> torch.Tensor:
    """The value of a node computed from sizes and constants only (a mask built with
    ``torch.triu``), evaluated at the capture batch size."""
    constants = mapper.constant_values
    values: dict[fx.Node, object] = {}
    for current in _dependencies(mapper, node):
        if current.op == "placeholder":
            values[current] = constants[current.name]
        elif current in mapper.uniform:
            shape = [
                EXAMPLE_BATCH if mapper.dim(d) == BATCH else int(d)
                for d in current.meta["val"].shape
            ]
            dtype = current.meta["val"].dtype
            values[current] = torch.full(shape, mapper.uniform[current], dtype=dtype)
        elif _target_name(current) == "aten.sym_size.int":
            dim = int(current.args[1])
            size = current.args[0].meta["val"].shape[dim]
            values[current] = EXAMPLE_BATCH if mapper.dim(size) == BATCH else int(size)
        else:
            args = fx.node.map_arg(current.args, lambda n: values[n])
            kwargs = fx.node.map_arg(current.kwargs, lambda n: values[n])
            values[current] = current.target(*args, **kwargs)
    return values[node]


# ---------------------------------------------------------------- masks


def is_causal_mask(mapper: _Mapper, mask: fx.Node, causal: bool, true_masks: bool = False) -> bool:
    """An attention mask is accepted only when it is exactly the causal mask or masks
    nothing; returns whether attention is causal. A boolean mask's True means "attend" for
    scaled_dot_product_attention and "masked" for nn.MultiheadAttention (``true_masks``);
    a float mask is added to the scores (0 attends, -inf masks)."""
    value = _constant_value(mapper, mask)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        raise Refuse("an attention mask that is not a 2-D (or broadcast) tensor")
    length, source = value.shape[-2:]
    allowed = torch.ones(length, source, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        keep = ~value if true_masks else value
    else:
        finite = torch.isfinite(value)
        if bool((value[finite] != 0).any()) or bool((value[~finite] > 0).any()):
            raise Refuse("an additive attention mask with values other than 0 and -inf")
        keep = finite
    keep = keep.reshape(-1, length, source)
    if bool(keep.all()):
        return causal
    if all(bool((k == allowed).all()) for k in keep):
        return True
    raise Refuse("an attention mask other than the causal one")


# ---------------------------------------------------------------- collapsed modules


def _multihead_attention(mapper, path, module, nodes, external, escaping) -> str:
    if not module.batch_first:
        raise Refuse("nn.MultiheadAttention without batch_first=True puts the batch in dim 1")
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise Refuse("kdim/vdim, add_bias_kv or add_zero_attn")
    if module.dropout != 0.0:
        raise Refuse(
            f"attention dropout {module.dropout}, whose random draws the import does not "
            "carry over: build nn.MultiheadAttention with dropout=0.0 to import it"
        )
    data = []
    padding = []  # key_padding_mask: a boolean input [N, S], True where padded
    causal = False
    for node in external:
        try:
            mapper.shape(node)
        except Refuse:
            continue
        source = masks.key_padding_source(mapper, node, _target_name)
        if source is not None:
            padding.append(source)
        elif _reads_data(mapper, node):
            data.append(node)
        else:
            causal = is_causal_mask(mapper, node, causal, true_masks=True)
    if len(data) != 1:
        raise Refuse(
            "query, key and value must be one tensor (self-attention); a key_padding_mask must "
            "be a boolean model input [N, S] (True pads), and an attn_mask the causal mask or "
            "one that masks nothing"
        )
    if len(escaping) != 1:
        raise Refuse("the attention weights are used (need_weights=True)")
    for node in nodes:
        if _target_name(node) == "aten.scaled_dot_product_attention.default":
            view = NodeView(mapper, node, _target_name(node))
            causal = causal or bool(view.a["is_causal"])
    shape = mapper.shape(data[0])
    if len(shape) != 3 or shape[0] != BATCH:
        raise Refuse(f"self-attention on {shape_text(shape)}: expected [N, L, E]")
    names = ("in_proj_weight", "out_proj.weight")
    if module.in_proj_bias is not None:  # bias= governs both projections
        names += ("in_proj_bias", "out_proj.bias")
    kwargs = {
        "num_heads": module.num_heads,
        "bias": module.in_proj_bias is not None,
        "is_causal": causal,
    }
    args = [mapper.value_of(data[0])]
    if padding:
        args.append(_key_padding_bias(mapper, path, padding[0], shape[1]))
    return _collapsed_stmt(
        mapper, path, module, nodes, escaping, "multihead_attention", args, kwargs, names
    )


def _key_padding_bias(mapper, path: str, mask: fx.Node, length: int) -> str:
    """``padding_mask(mask, invert=true)`` expanded to the scores' [N, 1, L, S]: the bias
    the attention adds, 0 where attended and float32's lowest where padded (torch's -inf
    gives the same probabilities wherever a row attends somewhere). One per input and L."""
    keys = int(mask.meta["val"].shape[1])
    if keys != length:
        raise Refuse(f"a key_padding_mask of {keys} keys for self-attention on {length}")
    key = ("key_padding", mask)
    if key not in mapper.padding_values:
        name = mapper.unique(f"{path}.padding_mask")
        stmt = Stmt(
            name,
            "padding_mask",
            [mapper.value_of(mask)],
            {"invert": True},
            path,
            (BATCH, 1, 1, keys),
        )
        mapper.stmts.append(stmt)
        mapper.padding_values[key] = name
    size = (BATCH, 1, length, keys)
    if (key, size) not in mapper.padding_values:
        name = mapper.unique(f"{path}.key_padding_bias")
        pad = mapper.padding_values[key]
        mapper.stmts.append(Stmt(name, "expand", [pad], {"size": size}, path, size))
        mapper.padding_values[(key, size)] = name
    return mapper.padding_values[(key, size)]


_CASTS = ("aten.to.dtype", "aten._to_copy.default", "aten.alias.default")


def _same_dtype_cast(node: fx.Node, external: list[fx.Node]) -> bool:
    """Whether ``node`` casts a tensor from outside its module to the dtype it has."""
    if _target_name(node) not in _CASTS or not node.args or node.args[0] not in external:
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
        and tuple(before.shape) == tuple(after.shape)
    )


def _one_input(mapper, path, external, escaping) -> fx.Node:
    """The single tensor a collapsed module reads, and the single value it returns."""
    data = [n for n in external if not _is_size_value(n) and n not in mapper.constant]
    if len(data) != 1 or len(escaping) != 1:
        raise Refuse(f"expected one input and one output, got {len(data)} and {len(escaping)}")
    return data[0]


def _collapsed_stmt(mapper, path, module, nodes, escaping, op, args, kwargs, params=()) -> str:
    for leaf in params:
        key = f"{path}.{leaf}" if path else leaf
        if key in mapper.used_params:
            raise Refuse(f"{key} is used by two operators (tied weights)")
        mapper.used_params[key] = path
    if path in mapper.names or not valid_path(path):
        raise Refuse(unusable_name(path) if not valid_path(path) else f"{path} is called twice")
    mapper.names.add(path)
    mapper.classes.setdefault(path, _qualname(type(module)))
    mapper._record_classes(nodes[0])
    kwargs = {**kwargs, **mapper.frozen_kwargs(path)}
    mapper.stmts.append(Stmt(path, op, args, kwargs, path, mapper.shape(escaping[0])))
    return path


def _hf_conv1d(mapper, path, module, nodes, external, escaping) -> str:
    """transformers' Conv1D (GPT-2): y = x @ weight + bias with weight [in, out]."""
    x = _one_input(mapper, path, external, escaping)
    if module.bias is None:
        raise Refuse("a Conv1D without a bias")
    kwargs = {"out_features": int(module.weight.shape[1])}
    return _collapsed_stmt(
        mapper,
        path,
        module,
        nodes,
        escaping,
        "transposed_linear",
        [mapper.value_of(x)],
        kwargs,
        ("weight", "bias"),
    )


def _gelu_tanh(mapper, path, module, nodes, external, escaping) -> str:
    """transformers' NewGELUActivation / GELUTanh: the tanh approximation of gelu written
    out (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), which is gelu(approximate="tanh")."""
    x = _one_input(mapper, path, external, escaping)
    return _collapsed_stmt(
        mapper,
        path,
        module,
        nodes,
        escaping,
        "gelu",
        [mapper.value_of(x)],
        {"approximate": "tanh"},
    )


def _hf_rmsnorm(mapper, path, module, nodes, external, escaping) -> str:
    """A Hugging Face RMSNorm (``hf_norms``): pow, mean, rsqrt and mul, in float32 inside,
    which is ``torch.nn.RMSNorm``: one ``rmsnorm`` statement."""
    x = _one_input(mapper, path, external, escaping)
    kwargs = rmsnorm_kwargs(module)
    return _collapsed_stmt(
        mapper, path, module, nodes, escaping, "rmsnorm", [mapper.value_of(x)], kwargs, ("weight",)
    )


#: Module classes mapped as one statement: qualified class name -> builder.
COLLAPSED: dict[str, Callable] = {
    "torch.nn.modules.activation.MultiheadAttention": _multihead_attention,
    "transformers.pytorch_utils.Conv1D": _hf_conv1d,
    "transformers.activations.NewGELUActivation": _gelu_tanh,
    "transformers.activations.GELUTanh": _gelu_tanh,
    "transformers.activations.PytorchGELUTanh": _gelu_tanh,
}


# ---------------------------------------------------------------- entry point


def import_torch(
    module: torch.nn.Module, inputs: Sequence[Tensor], name: str, source: str
) -> ImportedModel:
    """The network as an ImportedModel (no loss yet); ImportFailure lists what is unmapped."""
    _check_parameter_names(module, source)
    program, how = capture(module, inputs, f"SPEC {source!r}")
    mapper = _Mapper(program, module, inputs)
    predictions = mapper.run()
    if mapper.unmapped:
        raise ImportFailure(f"cannot import {source}", _name_the_cache(module, mapper.unmapped))
    _check_frozen(module, mapper.frozen_marked, source)
    _check_constants(mapper.stmts, source)
    if len(predictions) != 1:
        raise ImportFailure(f"{source}: forward must return one prediction tensor")
    mapper.classes.setdefault("", _qualname(type(module)))
    return ImportedModel(
        name=name,
        source=source,
        inputs=list(inputs),
        targets=[],
        stmts=mapper.stmts,
        predictions=predictions,
        classes=mapper.classes,
        notes=[f"captured with {how}"],
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
