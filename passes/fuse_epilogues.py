"""Fold the elementwise op that follows a GEMM into the GEMM as its epilogue.

Matches: `add(linear(x, w [, b]), r)` (operands in either order) where the linear result has
  no other reader and is not a graph output. (A bias is already part of `linear`.)
Produces: `linear_add(x, w [, b], r)`: one GEMM whose epilogue adds the residual. The original
  linear is left for dce.
Requires: canonicalize; runs after fuse_add_rmsnorm, which takes the residual adds that an
  RMSNorm reads (so in a Llama-family graph this pass finds the adds no norm follows).
Preserves: numerics exactly (the reference adds after the GEMM, as before).
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node, Value

from .rewrite import PassContext, RewriteState, rewrite


def _sole_linear(value: Value, state: RewriteState) -> Node | None:
    node = state.producer(value)
    if node.op != "linear" or state.num_users(value) != 1:
        return None
    return node


def fuse_residual_epilogue(node: Node, state: RewriteState):
    if node.op != "add":
        return None
    a, b = node.inputs
    gemm, residual = _sole_linear(a, state), b
    if gemm is None:
        gemm, residual = _sole_linear(b, state), a
    if gemm is None:
        return None
    inputs = [state.get(v) for v in (*gemm.inputs, residual)]
    return (state.emit("linear_add", inputs).value(),)


RULES = [fuse_residual_epilogue]


def fuse_epilogues(graph: Graph, ctx: PassContext) -> Graph:
    """GEMM + following residual add -> GEMM with an epilogue (see module docstring)."""
    return rewrite(graph, RULES, "fuse_epilogues", ctx)
