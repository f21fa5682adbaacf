"""One node's backward step: its backward kernel call, the gradient sums where a value
has several consumers, and its parameter gradients handed where the platform wants them.

``owned`` maps each value that already has a gradient to whether that tensor is
exclusively this code's (then later contributions are added in place, as autograd's
input buffers do) or may alias another gradient (then the sum is out of place).
"""

from __future__ import annotations

from unroller.compiler.graph import Node, explicit_kwargs
from unroller.compiler.ir import (
    AddTo,
    Assign,
    CallExpr,
    Const,
    Do,
    Expr,
    Global,
    Layer,
    ModelName,
    Statement,
    Step,
    Var,
)
from unroller.compiler.precision import get as get_precision

from .context import LoweringContext, const_kwargs, defaults, off
from .restore import saved_arg


def needs_implied(node: Node) -> bool:
    """Can the backward call leave ``needs`` out? When every gradient is wanted: every
    backward kernel takes ``needs=None`` to mean all of them."""
    return all(node.needs)


def backward_step(
    ctx: LoweringContext, node: Node, owned: dict[int, bool], pieces: bool = False
) -> Step:
    """One backward kernel call, gradient sums for fan-out, parameter gradients.

    ``pieces``: the call runs once per piece of the batch (a segment run in pieces); an op
    whose kernel can add its parameter gradients into ``.grad`` itself (registry
    ``backward_accumulates``) is then asked to (``accumulate=True``), so that no piece
    makes parameter-sized gradients only to add them.
    """
    op = node.op
    lean = ctx.plan.lean
    into_grad = (  # not through a cast view of the layer: its .grad is the layer's own
        pieces
        and op.backward_accumulates
        and ctx.platform.grads == "accumulate"
        and not node.cast_params
    )
    in_place = (  # the input's gradient may overwrite g: g is ours, and dead after this
        lean
        and op.backward_in_place
        and owned.get(id(node.output), False)
        and bool(node.inputs)
        and node.inputs[0].requires_grad
        and node.inputs[0].type == node.output.type
    )
    targets, sums, add_into = input_grad_targets(ctx, node, owned, lean)
    param_targets, param_grads = param_grad_targets(ctx, node, into_grad)
    targets += param_targets
    kwargs = const_kwargs(explicit_kwargs(op, node.backward_kwargs))
    if op.backward_pieces and lean:
        kwargs += (("piece_bytes", Const(ctx.platform.piece_bytes)),)
    if add_into is not None:
        kwargs += (("add_into", add_into),)
    elif in_place:
        kwargs += (("in_place", Const(True)),)
    if lean and node.inputs and node.inputs[0].requires_grad and ctx.plan.node(node).consumable:
        kwargs += (("consume", Const(True)),)
    if into_grad and any(p.present for p in node.params):
        kwargs += (("accumulate", Const(True)),)
    call = CallExpr(
        ctx.kernel(node, f"{op.name}_backward"),
        (ctx.grad(node.output), *(saved_arg(ctx, node, a) for a in node.saved)),
        (*kwargs, *(() if needs_implied(node) else (("needs", Const(node.needs)),))),
        (*defaults(op, node.backward_kwargs), *off(kwargs)),
    )
    statements: list[Statement] = [Assign(tuple(targets), call, unpack=len(targets) == 1)]
    statements += sums
    for owner, grads in param_grads.items():
        statements.append(Do(hand_param_grads(ctx, owner, tuple(grads), op.fresh_param_grads)))
    return ctx.observed(node, ctx.node_step("backward", statements, node))


def input_grad_targets(
    ctx: LoweringContext, node: Node, owned: dict[int, bool], lean: bool
) -> tuple[list[Var | None], list[Statement], Var | None]:
    """Where a backward call puts each input's gradient: the gradient itself when it is
    the first, else a partial summed into it afterwards (or, for a kernel that can, the
    total it adds into). Returns the targets (None: no gradient), the sums and the
    add-into variable; ``owned`` is updated as in ``backward_step``."""
    op = node.op
    targets: list[Var | None] = []
    sums: list[Statement] = []
    add_into: Var | None = None  # the kernel adds the input's gradient into the total
    for position, value in enumerate(node.inputs):
        if not value.requires_grad:
            targets.append(None)
        elif id(value) not in owned:
            owned[id(value)] = not op.grad_aliases
            targets.append(ctx.grad(value))
        elif position == 0 and lean and owned[id(value)] and op.backward_add_into:
            add_into = ctx.grad(value)
            targets.append(add_into)
        else:
            partial = ctx.name("partial", value.name, node.output.name, str(position))
            targets.append(partial)
            mine = owned[id(value)]  # else: add into the part when it is a new tensor
            into = lean and not mine and not op.grad_aliases
            sums.append(AddTo(ctx.grad(value), partial, in_place=mine, into_part=into))
            owned[id(value)] = True
    return targets, sums, add_into


def param_grad_targets(
    ctx: LoweringContext, node: Node, into_grad: bool
) -> tuple[list[Var | None], dict[str, list[tuple[str, Expr]]]]:
    """Where a backward call puts each parameter's gradient (None: absent, or added into
    ``.grad`` by the kernel), and those gradients by the module holding them (a
    parameter "out_proj.weight" is held by the node's submodule out_proj; a free
    parameter by its parent)."""
    targets: list[Var | None] = []
    param_grads: dict[str, list[tuple[str, Expr]]] = {}
    for p in node.params:
        if not p.present or into_grad:  # none, or the kernel adds it into .grad itself
            targets.append(None)
            continue
        # One name per parameter kind (grad_weight, grad_bias), reused by every layer:
        # each is handed over on the next line, so a per-layer name would only be noise.
        grad = ctx.name("pgrad", p.name)
        targets.append(grad)
        owner, _, attr = p.key.rpartition(".")
        param_grads.setdefault(owner, []).append((attr, grad))
    return targets, param_grads


def hand_param_grads(
    ctx: LoweringContext, owner: str, grads: tuple[tuple[str, Expr], ...], fresh: bool = False
) -> CallExpr:
    """Where the platform wants the gradients of the parameters module ``owner`` holds;
    ``fresh``: the kernel made them and nothing else holds them (the registry's
    ``fresh_param_grads``), so the first becomes ``.grad`` without a copy."""
    if ctx.platform.grads == "accumulate":  # into each parameter's .grad
        kernel = "K.accumulate_fresh" if fresh else "K.accumulate"
        return CallExpr(Global(kernel), (Layer(owner),), grads)
    # "collect": into the step's dict, by state-dict name, for the surrogate loss
    return CallExpr(Global("K.collect"), (Var("grads"), Var("L"), ModelName(owner)), grads)


# What multiplies the seed, by ``Platform.loss_scaler`` (the seed step's comment)
_LOSS_SCALERS = {"grad_scaler": "a GradScaler's scale", "optimizer": "the optimizer's loss scaling"}


def seed_step(ctx: LoweringContext) -> Step:
    """``grad_loss = torch.ones_like(loss)``: where the backward starts; under a mixed
    precision ``K.loss_seed(loss, scaler)``, the GradScaler's scale when the caller gives
    one (``scaler.scale(loss).backward()``'s seed). Where the optimizer scales the loss
    (``Platform.loss_scaler``, PopTorch's ``loss_scaling``) a plain low precision's seed is
    ``K.loss_seed`` too: a half model's gradients underflow as a mixed one's do."""
    loss = ctx.graph.loss
    chosen = get_precision(ctx.graph.precision)
    by = ctx.platform.loss_scaler
    scaled = chosen.mixed or (by == "optimizer" and chosen.dtype is not None)
    if scaled:
        seed = CallExpr(Global("K.loss_seed"), (ctx.var(loss), Var("scaler")))
    else:
        seed = CallExpr(Global("torch.ones_like"), (ctx.var(loss),))
    return Step(
        "backward",
        [Assign((ctx.grad(loss),), seed)],
        comment="d loss / d loss = 1" + (f" (times {_LOSS_SCALERS[by]})" if scaled else ""),
        stage=ctx.stage(loss.producer),
    )
