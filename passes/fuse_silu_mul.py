"""Fuse the SwiGLU gate: SiLU of the gate times the up projection.

Matches: `mul(silu(gate), up)` (operands in either order) where the silu result has no other
  reader.
Produces: `silu_mul(x)` when gate and up are the two equal halves of one `split(x)` (after
  merge_gate_up), else `silu_mul(gate, up)`. The silu (and the split) are left for dce.
Requires: canonicalize. Preserves: numerics exactly.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node, Value

from .rewrite import PassContext, RewriteState, rewrite


def _halves_of_one_split(gate: Value, up: Value, state: RewriteState) -> Value | None:
    """The split's input when gate and up are its results #0 and #1 of equal width."""
    split = state.producer(gate)
    if (split.op != "split" or up.node != split.name or (gate.index, up.index) != (0, 1)
            or len(split.types) != 2 or split.types[0] != split.types[1]):
        return None
    return split.inputs[0]


def fuse_silu_gate(node: Node, state: RewriteState):
    if node.op != "mul":
        return None
    a, b = node.inputs
    if state.producer(a).op != "silu" and state.producer(b).op == "silu":
        a, b = b, a
    silu = state.producer(a)
    if silu.op != "silu" or state.num_users(a) != 1:
        return None  # no silu, or its result is needed elsewhere too
    gate, up = silu.inputs[0], b
    packed = _halves_of_one_split(gate, up, state)
    inputs = [packed] if packed is not None else [gate, up]
    return (state.emit("silu_mul", [state.get(v) for v in inputs]).value(),)


RULES = [fuse_silu_gate]


def fuse_silu_mul(graph: Graph, ctx: PassContext) -> Graph:
    """SiLU(gate) * up -> one op (see module docstring)."""
    return rewrite(graph, RULES, "fuse_silu_mul", ctx)
