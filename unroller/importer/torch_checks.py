"""The torch mapper's refusals that need more than one node: stochastic depth, in-place
writes that would reach another tensor, dead nodes that still write something, and a
parameter or buffer that no statement owns. Each is reported once, at its module."""

from __future__ import annotations

import contextlib
import re

import torch
from torch import fx

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH, Stmt, Unmapped, valid_path
from unroller.importer.torch_nodes import (
    FILLED,
    VIEW_OPS,
    draws_random,
    qualname,
    short_name,
    target_name,
    writes_in_place,
)


class _Checks:
    """The torch mapper's whole-graph checks (see the module docstring)."""

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
            if (
                node.op != "call_function"
                or not draws_random(node)
                or "dropout" in short_name(node)
            ):
                continue
            if not per_sample(node) or node in sites:
                continue
            named = re.search(r"StochasticDepth|DropPath", self.where(node)[1])
            if self.dim(node.meta["val"].shape[0]) != BATCH and not named:
                continue  # one draw for the whole batch: stochastic depth only by name
            ident = self.order[node]
            sites[node] = ident
            for arg in node.all_input_nodes:  # the empty tensor the draw fills in place
                if short_name(arg) in FILLED and len(arg.users) == 1:
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
        if prob is None and short_name(draw) == "bernoulli" and len(draw.args) > 1:
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

    def _check_inplace(self, node) -> None:
        """An in-place op maps as its functional form only when it writes a tensor of its
        own (not a view of another: the write would reach the base, which the functional
        form drops) and nothing reads the old value afterwards; a mutated input,
        parameter or buffer is refused."""
        mutated = writes_in_place(node)
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
            and short_name(base) in VIEW_OPS
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
                u for u in current.users if u.op == "call_function" and short_name(u) in VIEW_OPS
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
                target_name(node),
                "a region of code (no_grad, a cond, ...) " "whose effects the step would drop",
            )
            return
        mutated = writes_in_place(node)
        if mutated is None:
            return
        if mutated.name in self.buffers and self.buffers[mutated.name].endswith(
            ".num_batches_tracked"
        ):
            return
        what = self.buffers.get(mutated.name) or self.params.get(mutated.name) or mutated.name
        self._fail(node, target_name(node), f"writes {what} in place, which the step would drop")

    def _hold_unread_parameters(self) -> None:
        """A parameter that ``forward`` never reads (DINOv2's ``mask_token``, read only when
        ``bool_masked_pos`` is given): a ``parameter`` statement under its key that nothing
        reads, so the state dict keeps every key and its gradient stays None, as under
        autograd (``frozen=true`` where it does not require one)."""
        for key, param in self.module.named_parameters():
            if key in self.used_params or key in self.names or not valid_path(key):
                continue  # read, tied (held by ``_hold_unused_owners``) or reported
            shape = tuple(int(d) for d in param.shape)
            kwargs = {"shape": shape, "init": "zeros"}
            if not param.requires_grad:
                kwargs["frozen"] = True
                self.frozen_marked.add(key)
            self.names.add(key)
            self.used_params[key] = key
            self.stmts.append(Stmt(key, "parameter", [], kwargs, key.rpartition(".")[0], shape))

    def _check_state(self) -> None:
        """Every parameter and buffer in the state dict has a statement that owns it."""
        state = self.module.state_dict(keep_vars=True)
        missing = [k for k in state if k not in self.used_params and k not in self.used_buffers]
        for key in missing:
            kind = "parameter" if isinstance(state[key], torch.nn.Parameter) else "buffer"
            path = key.rpartition(".")[0]
            cls = qualname(type(self.module.get_submodule(path))) if path else ""
            self.unmapped.append(
                Unmapped(
                    f"{kind} {key}",
                    path,
                    cls,
                    reason="no mapped operator uses it, so the imported module could not "
                    "load the original's state_dict",
                )
            )
