"""The torch mapper's refusals that need more than one node: stochastic depth, in-place
writes that would reach another tensor, dead nodes that still write something, and a
parameter or buffer that no statement owns. Each is reported once, at its module."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import fx

from unroller.importer.aten_ops import Refuse
from unroller.importer.model import BATCH, Stmt, Unmapped, valid_path
from unroller.importer.torch_nodes import (
    FILLED,
    STOCHASTIC_DEPTH,
    VIEW_OPS,
    draws_random,
    qualname,
    short_name,
    stochastic_depth_attr,
    target_name,
    writes_in_place,
)
from unroller.importer.torch_view import NodeView


@dataclass(frozen=True)
class DropPath:
    """A stochastic depth the registry's ``drop_path`` computes: ``apply`` (``x * mask``)
    becomes ``drop_path(x, p=prob, scale=scale)``; ``ident`` is its draw's index."""

    ident: int
    apply: fx.Node
    x: fx.Node
    prob: float
    scale: bool
    divided: fx.Node | None = None  # ``x / keep`` before the product, absorbed


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
            named = STOCHASTIC_DEPTH.search(self.where(node)[1])
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

    def _find_stochastic_depth(self) -> None:
        """The stochastic depth sites, those the registry's ``drop_path`` takes (their draws
        and mask arithmetic then map to nothing, Hugging Face's ``x / keep`` absorbed) and
        the ones refused so far."""
        self.stochastic = self._stochastic_depth_sites()
        self.stochastic_told: set[int] = set()
        self.stochastic_plans = self._stochastic_depth_plans()
        self.stochastic_taken = {plan.ident for plan in self.stochastic_plans.values()}
        self.absorbed |= {p.divided for p in self.stochastic_plans.values() if p.divided}

    def _stochastic_depth_prob(self, ident: int) -> float | None:
        """The drop probability of the stochastic depth drawn at node ``ident``: its
        module's ``p`` / ``drop_prob``, else 1 - a bernoulli draw's keep probability."""
        draw = self.nodes[ident]
        path, _ = self.where(draw)
        with contextlib.suppress(AttributeError):
            sub = self.module.get_submodule(path) if path else self.module
            attr = stochastic_depth_attr(sub)
            if attr is not None:
                return getattr(sub, attr)
        if short_name(draw) in ("bernoulli", "bernoulli_") and len(draw.args) > 1:
            with contextlib.suppress(TypeError, ValueError):
                return 1.0 - float(draw.args[1])
        return None

    def _stochastic_depth_plans(self) -> dict[fx.Node, DropPath]:
        """The stochastic depths that are the registry's ``drop_path``, by the node that
        applies the mask (``x * mask``). Recognised are the three ways libraries write it,
        nothing else: ``keep + rand([N, 1, ...])`` floored (Hugging Face, whose ``x / keep``
        before the product stays its own statement), and ``bernoulli_(keep)`` of an empty
        ``[N, 1, ...]`` tensor (timm, torchvision), either divided by keep (scaled) or not."""
        chains: dict[int, list[fx.Node]] = {}
        for node, ident in self.stochastic.items():
            chains.setdefault(ident, []).append(node)
        plans = {}
        for ident, chain in chains.items():
            plan = self._stochastic_depth_plan(ident, set(chain))
            if plan is not None:
                plans[plan.apply] = plan
        return plans

    def _stochastic_depth_plan(self, ident: int, chain: set) -> DropPath | None:
        """Its plan when the draw is a stochastic depth module's (``stochastic_depth_attr``:
        verify makes exactly those draw as the kernel does), one value per sample."""
        draw = self.nodes[ident]
        path, _ = self.where(draw)
        try:
            sub = self.module.get_submodule(path) if path else self.module
        except AttributeError:
            return None
        attr = stochastic_depth_attr(sub)
        if attr is None or self.dim(draw.meta["val"].shape[0]) != BATCH:
            return None
        prob = getattr(sub, attr)
        if not 0.0 < prob < 1.0:
            return None
        keep = 1.0 - prob
        outside = {u for n in chain for u in n.users if u not in chain}
        if len(outside) != 1:
            return None
        (apply,) = outside
        mask = [a for a in apply.args if a in chain]
        rest = [a for a in apply.args if a not in chain]
        if target_name(apply) != "aten.mul.Tensor" or len(mask) != 1 or len(rest) != 1:
            return None
        if not isinstance(rest[0], fx.Node) or rest[0] in self.constant:
            return None
        steps = [short_name(n) for n in sorted(chain, key=self.order.__getitem__)]
        scalars = [
            float(a)
            for n in chain
            for a in n.args[1:]
            if isinstance(a, (int, float)) and not isinstance(a, bool)
        ]
        if not all(math.isclose(c, keep, rel_tol=1e-12) for c in scalars):
            return None
        scaled = steps[-1] in ("div", "div_")
        core = steps[:-1] if scaled else steps
        if core not in (["rand", "add", "floor"], ["rand", "add", "floor_"]) and not (
            core[-1:] in (["bernoulli"], ["bernoulli_"])
            and all(step in FILLED for step in core[:-1])
        ):
            return None
        x, divided = rest[0], None
        if (  # Hugging Face's x.div(keep) * mask: the division is drop_path's scaling
            target_name(x) == "aten.div.Tensor"
            and len(x.users) == 1
            and isinstance(x.args[0], fx.Node)
            and isinstance(x.args[1], float)
            and math.isclose(x.args[1], keep, rel_tol=1e-12)
        ):
            if scaled:
                return None
            x, divided, scaled = x.args[0], x, True
        return DropPath(ident, apply, x, prob, scaled, divided)

    def _map_stochastic_depth(self, node, plan: DropPath) -> None:
        """``x * mask`` as ``drop_path(x, p=..., scale=...)`` (poisoned, as any node, when
        x is: x's own refusal is the one reported)."""
        if plan.x in self.poisoned:
            self._poison(node)
            return
        view = NodeView(self, node, target_name(node))
        kwargs = {"p": plan.prob} if plan.scale else {"p": plan.prob, "scale": False}
        try:
            self.values[node] = view.stmt("drop_path", [self.value_of(plan.x)], **kwargs)
        except Refuse as exc:
            self._fail(node, "stochastic depth", str(exc))

    def _refuse_stochastic_depth(self, node) -> None:
        """One line per stochastic depth the registry's ``drop_path`` does not take (see
        ``_stochastic_depth_plans``), naming it, its module and the fix."""
        ident = self.stochastic[node]
        if ident in self.stochastic_taken:
            return  # its draw and mask arithmetic: drop_path makes the mask itself
        if ident in self.stochastic_told:
            self._poison(node)
            return
        self.stochastic_told.add(ident)
        draw = self.nodes[ident]
        prob = self._stochastic_depth_prob(ident)
        said = f" (drop probability {prob:g})" if prob is not None else ""
        if prob is not None and not prob < 1.0:
            why = (
                ": every sample dropped, which the registry's drop_path does not take (p "
                "below 1); build the network with a probability below 1"
            )
        else:
            why = (
                ", which the registry's drop_path takes only from a stochastic depth module (a "
                "class whose name holds DropPath or StochasticDepth, one draw per sample: keep "
                "+ rand floored, or bernoulli_ of keep, times the branch); build the network "
                "with its probability 0 (StochasticDepth(p=0.0), drop_path_rate=0.0), where it "
                "is the identity, as at inference"
            )
        self._fail(draw, "stochastic depth", f"a random drop of a residual branch{said}{why}")
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
