"""Block calls: a block's body inlined at each call, its names prefixed by the call's.

``out = block(x, k=3)`` binds the block's tensor parameters to the caller's values
(positionally) and its constant parameters to keyword values or their defaults, then
builds the body's statements in a scope of their own, so ``OUT.name`` is what the body
calls ``name``. Each node made inside remembers the chain of calls it sits in
(``BlockCall``), which generated code shows as comments. Calls nest at most
``MAX_BLOCK_DEPTH`` deep and never recursively.
"""

from __future__ import annotations

from collections.abc import Callable

from unroller.compiler.ast import Block, BlockParam, Call
from unroller.compiler.graph.args import render_const, statement_text
from unroller.compiler.graph.model import MAX_BLOCK_DEPTH, BlockCall, Value
from unroller.compiler.graph.scope import Scope
from unroller.compiler.registry import OpSpec
from unroller.errors import ModelError, did_you_mean


class BlockCalls:
    """The model's blocks by name, and their inlining.

    ``statement`` builds one statement in a scope: the builder's own dispatch, so a block
    body may call operators and other blocks alike.
    """

    def __init__(self, ops: dict[str, OpSpec], statement: Callable[[Call, Scope], None]):
        self.ops = ops
        self.statement = statement
        self.blocks: dict[str, Block] = {}

    def register(self, blocks: list[Block]) -> None:
        """Take the model's block definitions, refusing one named as an operator (a call
        could not tell them apart) or defined twice."""
        for block in blocks:
            if block.name in self.ops:
                raise ModelError(
                    f"block '{block.name}' has the name of an operator; choose another name",
                    block.loc,
                )
            if block.name in self.blocks:
                raise ModelError(f"block '{block.name}' is defined twice", block.loc)
            self.blocks[block.name] = block

    def __contains__(self, name: str) -> bool:
        return name in self.blocks

    def call(self, stmt: Call, scope: Scope) -> Value:
        """The value a statement calling a block defines: the body built, inlined, in a
        scope of its own, and the body's returned value."""
        block = self.blocks[stmt.op]
        _check_nesting(block, stmt, scope)
        inner = _bind(block, stmt, scope)
        inner.blocks = (*scope.blocks, _record(block, stmt, scope, inner))
        for body_stmt in block.body:
            self.statement(body_stmt, inner)
        return inner.lookup(block.ret)


def _check_nesting(block: Block, stmt: Call, scope: Scope) -> None:
    """Refuse a block calling itself (through any chain of calls), calls nested past
    ``MAX_BLOCK_DEPTH`` (inlining either would not end, or not soon), and a call with
    more values than the block has parameters."""
    if block.name in scope.stack:
        chain = _chain((*scope.stack, block.name))
        raise ModelError(
            f"recursive block call ({chain}); blocks cannot call themselves", stmt.op_loc
        )
    if len(scope.stack) >= MAX_BLOCK_DEPTH:
        raise ModelError(
            f"block calls nested more than {MAX_BLOCK_DEPTH} deep "
            f"({_chain((*scope.stack, block.name))})",
            stmt.op_loc,
        )
    params: tuple[BlockParam, ...] = block.params
    if len(stmt.args) > len(params):
        raise ModelError(
            f"block '{block.name}' takes at most {len(params)} argument(s) "
            f"({', '.join(p.name for p in params)}), got {len(stmt.args)} values",
            stmt.args[len(params)].loc,
        )


def _bind(block: Block, stmt: Call, scope: Scope) -> Scope:
    """The scope of the block's body: tensor parameters bound to the caller's values, in
    order; constant parameters to the call's keyword values, else their defaults
    (evaluated in the body's scope, so a default may use an earlier parameter)."""
    params: tuple[BlockParam, ...] = block.params
    inner = scope.inner(stmt.target, block.name)
    for param, ref in zip(params, stmt.args):
        inner.values[param.name] = scope.lookup(ref)
        inner.value_params.add(param.name)
    by_name = {p.name: p for p in params}
    for kw in stmt.kwargs:
        if kw.name not in by_name:
            raise ModelError(
                f"block '{block.name}' has no parameter '{kw.name}'"
                f"{did_you_mean(kw.name, by_name)}",
                kw.loc,
            )
        if kw.name in inner.values or kw.name in inner.consts:
            raise ModelError(f"parameter '{kw.name}' of '{block.name}' is bound twice", kw.loc)
        inner.consts[kw.name] = scope.constant(kw.value)
    for param in params:
        if param.name in inner.values or param.name in inner.consts:
            continue
        if param.default is None:
            raise ModelError(
                f"block '{block.name}' needs a value for parameter '{param.name}'",
                stmt.op_loc,
            )
        inner.consts[param.name] = inner.constant(param.default)
    return inner


def _record(block: Block, stmt: Call, scope: Scope, inner: Scope) -> BlockCall:
    """The call as the nodes of its body remember it (for comments in generated code):
    in full names, with constants as bound, and as written."""
    call_args = [scope.values[r.name].name for r in stmt.args]
    call_kw = [f"{k}={render_const(inner.consts[k])}" for k in (kw.name for kw in stmt.kwargs)]
    text = f"{scope.prefix}{stmt.target} = {block.name}({', '.join(call_args + call_kw)})"
    bound = tuple(
        (p.name, inner.values[p.name].name) for p in block.params if p.name in inner.values
    )
    return BlockCall(
        scope.prefix + stmt.target, block.name, text, bound, statement_text(stmt), stmt.loc
    )


def _chain(names: tuple[str, ...], limit: int = 8) -> str:
    """``a -> b -> c``, with the middle of a long chain left out."""
    if len(names) > limit:
        half = limit // 2
        skipped = len(names) - 2 * half
        names = (*names[:half], f"... {skipped} more ...", *names[-half:])
    return " -> ".join(names)
