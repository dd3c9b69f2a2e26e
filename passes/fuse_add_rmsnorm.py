"""Fuse a residual add with the RMSNorm that reads it.

Matches: `rmsnorm(add(x, r), w)` where that rmsnorm is the only rmsnorm reading the sum (other
  readers, such as the next residual add, are fine: the fused op returns the sum too).
Produces: `add_rmsnorm(x, r, w) -> (normed, sum)`; readers of the add read result #1, readers of
  the rmsnorm result #0. The original add is left for dce.
Requires: canonicalize. Preserves: numerics exactly (the same sum, then the same norm).
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node

from .rewrite import PassContext, RewriteState, rewrite


def fuse_residual_add(node: Node, state: RewriteState):
    if node.op != "rmsnorm":
        return None
    total, weight = node.inputs
    add = state.producer(total)
    if add.op != "add":
        return None
    if sum(1 for user in state.users(total) if user.op == "rmsnorm") != 1:
        return None  # two norms of one sum: fusing both would compute the add twice
    x, r = (state.get(v) for v in add.inputs)
    fused = state.emit("add_rmsnorm", [x, r, state.get(weight)], **node.attrs)
    state.replace(total, fused.value(1))
    return (fused.value(0),)


RULES = [fuse_residual_add]


def fuse_add_rmsnorm(graph: Graph, ctx: PassContext) -> Graph:
    """Residual add + RMSNorm -> one op returning both (see module docstring)."""
    return rewrite(graph, RULES, "fuse_add_rmsnorm", ctx)
