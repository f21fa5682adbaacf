"""Module calls an exporter decomposed into many ONNX nodes, mapped as one statement:
leaf classes in ``COLLAPSED`` (checked by running their nodes on random input), and
decompositions recognised by their shape (``DECOMPOSED``: attention as MatMul, Softmax,
MatMul); plus the mapper's part that finds these groups and maps them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from unroller.importer.aten_ops import Refuse, pair
from unroller.importer.model import BATCH, Stmt, valid_path
from unroller.importer.onnx_nodes import (
    B1,
    FOLDED,
    MAX_CHECK_ELEMENTS,
    Poisoned,
    elem_of,
    np_dtype_of,
    one_line,
)


def _adaptive_avg_pool(mapper, path: str, nodes: list[int], x: str, out: str) -> str:
    import torch.nn.functional as F

    shape_in, shape_out = mapper.shape(x), mapper.shape(out)
    rank = len(shape_in)
    if rank not in (3, 4) or len(shape_out) != rank or shape_out[:2] != shape_in[:2]:
        raise Refuse(f"adaptive pooling of {list(shape_in)} to {list(shape_out)}")
    size = tuple(int(d) for d in shape_out[2:])
    if rank == 4:
        mapper.check_linear(nodes, x, out, lambda t: F.adaptive_avg_pool2d(t, size))
        op, output_size = "adaptive_avgpool2d", pair(size)
    else:
        mapper.check_linear(nodes, x, out, lambda t: F.adaptive_avg_pool1d(t, size))
        op, output_size = "adaptive_avgpool1d", size[0]
    args = [mapper.value_of(x)]
    return mapper.add_group_stmt(path, op, args, {"output_size": output_size}, out)


#: Leaf module classes mapped as one statement whatever the exporter decomposed them into:
#: qualified class name -> builder (linear maps only: ``check_linear`` proves them).
COLLAPSED: dict[str, Callable] = {
    "torch.nn.modules.pooling.AdaptiveAvgPool2d": _adaptive_avg_pool,
    "torch.nn.modules.pooling.AdaptiveAvgPool1d": _adaptive_avg_pool,
}


def _fx_bool(text: str | None) -> bool:
    if text in (None, "False"):
        return False
    if text == "True":
        return True
    raise Refuse(f"a flag written {text!r}, not True or False")


def _attention(mapper, nodes: list[int], external: list[str], out: str) -> str:
    """``F.scaled_dot_product_attention(q, k, v, mask, scale=s)`` as the dynamo exporter
    decomposes it (q and k scaled by sqrt(s), MatMul, the mask added, Softmax, rows of NaN
    zeroed, MatMul by v). The recorded call names q, k, v and the scale; the nodes must
    compute torch's attention with no mask or with the causal one (a mask built from
    sizes that masks nothing, as Hugging Face models pass without an attention mask), on
    random q, k, v with the file's constants: any other mask, scale or wiring differs by
    far more than a rounding and is refused."""
    import torch.nn.functional as F

    call = mapper.fx[nodes[-1]]
    args = call.args
    if len(args) < 3 or not all(a.startswith("%") for a in args[:3]):
        raise Refuse("its recorded call does not name q, k and v")
    q, k, v = (a[1:] for a in args[:3])
    if sorted(external) != sorted({q, k, v}):
        raise Refuse(f"its nodes read {external}, not the recorded q, k, v ({q}, {k}, {v})")
    extra = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:]))
    extra.update(call.kwargs)
    if float(extra.get("dropout_p", "0.0")) != 0.0:
        raise Refuse("attention dropout in the file (export in eval mode)")
    if _fx_bool(extra.get("enable_gqa")):
        raise Refuse("grouped-query attention (enable_gqa) is not read from ONNX files yet")
    causal = _fx_bool(extra.get("is_causal"))
    scale = float(extra["scale"]) if "scale" in extra else None
    shapes = [mapper.shape(name) for name in (q, k, v)]
    if any(len(s) != 4 for s in shapes) or shapes[0][1] != shapes[1][1]:
        raise Refuse(f"attention of q, k, v {[list(s) for s in shapes]}: expected [N, H, L, E]")
    tries = [True] if causal else ([False, True] if "attn_mask" in extra else [False])
    reason = None
    for mask in tries:
        try:
            mapper.check_nodes(
                nodes,
                [q, k, v],
                out,
                lambda a, b, c, m=mask: F.scaled_dot_product_attention(
                    a, b, c, is_causal=m, scale=scale
                ),
                "torch's attention without a mask" if not mask else "causal attention",
                products=True,
            )
        except Refuse as exc:
            reason = exc
            continue
        where = mapper.where[nodes[-1]]
        name = mapper.unique(mapper.functional_name(nodes[-1]))
        kwargs: dict[str, Any] = {"is_causal": True} if mask else {}
        if scale is not None:
            kwargs["scale"] = scale
        mapper.names.add(name)
        values = [mapper.value_of(n) for n in (q, k, v)]
        mapper.stmts.append(
            Stmt(
                name, "scaled_dot_product_attention", values, kwargs, where.path, mapper.shape(out)
            )
        )
        return name
    if "attn_mask" in extra and len(tries) > 1:
        raise Refuse(
            f"its attention mask masks more than the causal mask ({reason}): only a mask "
            "that masks nothing or the causal one is imported"
        )
    raise Refuse(str(reason))


#: ATen calls the dynamo exporter decomposes into many ONNX nodes, read back as one
#: statement: recorded target -> builder (it checks the nodes compute the call).
DECOMPOSED: dict[str, Callable] = {
    "aten.scaled_dot_product_attention.default": _attention,
}


class _Collapse:
    """The ONNX mapper's collapsed module calls: finding each group of nodes, checking
    it computes the operator, and writing its one statement."""

    def _collapsed_groups(self) -> dict[int, str]:
        """Data nodes of one call of a leaf module in COLLAPSED: one input, one output."""
        members: dict[str, list[int]] = {}
        for i in self.order():
            where = self.where[i]
            if where.cls in COLLAPSED and where.path in self.leaves:
                if self.is_data_node(i):
                    members.setdefault(where.path, []).append(i)
        groups = {}
        for path, nodes in members.items():
            if self._group_ends(nodes) is not None:
                groups.update({i: path for i in nodes})
        calls: dict[str, list[int]] = {}
        for i in self.order():
            call = self.fx[i]
            op = call.target if call is not None else ""
            if op in DECOMPOSED and self.is_data_node(i) and i not in groups:
                key = f"{self.where[i].path}#{call.name}"
                self.decomposed[key] = op
                calls.setdefault(key, []).append(i)
        for key, nodes in calls.items():
            groups.update({i: key for i in nodes})
        return groups

    def _group_ends(self, nodes: list[int]) -> tuple[str, str] | None:
        inside = {out for i in nodes for out in self.nodes[i].output if out}
        external = []
        for i in nodes:
            for name in self.nodes[i].input:
                if name and name in self.data and name not in inside and name not in external:
                    external.append(name)
        escaping = [  # read outside by a data node (Shape and CastLike read no values)
            out
            for out in inside
            if out == self.output
            or any(j not in nodes and self.is_data_node(j) for j in self.live_users(out))
        ]
        if len(external) != 1 or len(escaping) != 1:
            return None
        return external[0], escaping[0]

    def _collapse(self, path: str) -> None:
        nodes = [i for i in self.order() if self.groups.get(i) == path]
        if path in self.decomposed:
            self._recompose(path, nodes)
            return
        x, out = self._group_ends(nodes)
        cls = self.where[nodes[0]].cls
        try:
            name = COLLAPSED[cls](self, path, nodes, x, out)
        except Poisoned:
            for i in nodes:
                self._poison(i)
            return
        except Refuse as exc:
            self._fail(nodes[0], f"{cls} as exported: {exc}")
            for i in nodes:
                self._poison(i)
            return
        self.values[out] = name

    def _recompose(self, key: str, nodes: list[int]) -> None:
        """The nodes the exporter decomposed one ATen call into, as one statement (see
        ``DECOMPOSED``), or one unmapped entry saying why not."""
        op = self.decomposed[key]
        inside = {out for i in nodes for out in self.nodes[i].output if out}
        escaping = [
            out
            for out in inside
            if out == self.output
            or any(j not in nodes and self.is_data_node(j) for j in self.live_users(out))
        ]
        try:
            if len(escaping) != 1:
                raise Refuse(f"its nodes have {len(escaping)} outputs read elsewhere, not one")
            external = []
            for i in nodes:
                for name in self.nodes[i].input:
                    if name in self.data and name not in inside and name not in external:
                        external.append(name)
            for name in external:
                self.value_of(name)  # a failed input: reported once, at its root
            name = DECOMPOSED[op](self, nodes, external, escaping[0])
        except Poisoned:
            for i in nodes:
                self._poison(i)
            return
        except Refuse as exc:
            self._fail(nodes[-1], f"{op} as exported: {exc}")
            for i in nodes:
                self._poison(i)
            return
        self.values[escaping[0]] = name

    def check_linear(self, nodes: list[int], x: str, out: str, reference: Callable) -> None:
        """The nodes compute ``reference`` (a linear map, run in float64) on random input,
        up to the rounding of the file's element type: a different linear map (other
        windows, other weights) differs by the size of the values, not by a rounding."""
        self.check_nodes(nodes, [x], out, reference, "torch's module")

    def check_nodes(
        self,
        nodes: list[int],
        xs: list[str],
        out: str,
        reference: Callable,
        what: str,
        products: bool = False,
    ) -> None:
        """The nodes, run by ``onnx.reference`` on random inputs ``xs``, compute what
        ``reference`` (torch, in float64) computes on them, up to the file's rounding;
        ``products``: the nodes may multiply matrices (attention), each bounded in cost."""
        import torch

        helper = self.onnx.helper
        elem = self.dtypes.get(xs[0], 1)
        batch = self.batch or B1
        shapes = [[batch if d is BATCH else d for d in self.shape(x)] for x in xs]
        inside = {o for i in nodes for o in self.nodes[i].output}
        self._bound_check(nodes, [*xs, *inside], products)
        consts = {}
        for i in nodes:
            for name in self.nodes[i].input:
                if name and name not in xs and name not in inside:
                    if name not in self.pairs and name not in self.inits:
                        raise Refuse(f"reads {name}, which is not a constant")
                    consts[name] = self.pair(name)[0]
        ins = [helper.make_tensor_value_info(x, elem, shape) for x, shape in zip(xs, shapes)]
        ins += [
            helper.make_tensor_value_info(n, elem_of(self.onnx, v), v.shape)
            for n, v in consts.items()
        ]
        outs = [helper.make_tensor_value_info(out, elem, None)]
        graph = helper.make_graph([self.nodes[i] for i in nodes], "check", ins, outs)
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        rng = np.random.default_rng(0)
        samples = [rng.standard_normal(s).astype(np_dtype_of(self.onnx, elem)) for s in shapes]
        try:
            evaluator = self.onnx.reference.ReferenceEvaluator(model)
            got = evaluator.run(None, {**dict(zip(xs, samples)), **consts})[0]
            got = np.asarray(got, np.float64)
        except Exception as exc:  # noqa: BLE001
            raise Refuse(f"cannot evaluate the nodes to check them: {one_line(exc)}") from None
        want = reference(*(torch.from_numpy(a.astype(np.float64)) for a in samples)).numpy()
        tolerance = 1e-12 if elem == 11 else 1e-5
        scale = float(np.abs(want).max()) or 1.0
        if got.shape != want.shape or not np.allclose(
            got, want, rtol=tolerance, atol=tolerance * scale
        ):
            raise Refuse(f"its nodes do not compute what {what} computes")

    def _check_dims(self, name: str) -> tuple | None:
        if name in self.first_run:
            return self.first_run[name]
        return self.pair(name)[0].shape if self.is_constant(name) else None

    def _bound_check(self, nodes: list[int], values: list[str], products: bool = False) -> None:
        """The check runs only cheap ops on values of known, bounded size (the file's
        metadata chose these nodes: it must not make the check a memory or time bomb);
        with ``products`` also MatMul, at most ``MAX_CHECK_ELEMENTS`` multiplications of
        a row by a column each."""
        for i in nodes:
            op = self.nodes[i].op_type
            if op == "MatMul" and products:
                a, b = (self._check_dims(n) for n in self.nodes[i].input[:2])
                if not a or not b or None in a or None in b:
                    raise Refuse(f"the shapes of {self.nodes[i].input[0]} are not known")
                if math.prod(a) * b[-1] > MAX_CHECK_ELEMENTS:
                    raise Refuse("a matrix product in the check would cost too much")
            elif op not in FOLDED:
                raise Refuse(f"it computes {op}, which the check does not run")
        for name in values:
            dims = self.first_run.get(name)
            if dims is None or any(d is None for d in dims):
                raise Refuse(f"the shape of {name} is not known")
            count = math.prod(int(d) for d in dims)
            if count > MAX_CHECK_ELEMENTS:
                raise Refuse(f"{name} would hold {count} elements in the check")

    def add_group_stmt(self, path: str, op: str, args: list[str], kwargs: dict, out: str) -> str:
        if path in self.names or not valid_path(path):
            raise Refuse(f"the module {path} is called twice or has an unusable name")
        self.names.add(path)
        self.stmts.append(Stmt(path, op, args, kwargs, path, self.shape(out)))
        return path
