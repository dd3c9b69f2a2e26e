"""Canonicalize what tracing produced, so later patterns have one form to match.

Matches: (1) `cast` to the dtype its input already has; (2) a commutative op (`add`, `mul`)
  whose first operand was produced after its second.
Produces: (1) the input itself; (2) the same op with operands swapped, so the operand defined
  first (for a residual add: the residual stream) always comes first.
Requires: nothing. Preserves: numerics exactly (a + b == b + a in IEEE arithmetic).
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node

from .rewrite import PassContext, RewriteState, rewrite

COMMUTATIVE = ("add", "mul")


def drop_identity_cast(node: Node, state: RewriteState):
    if node.op != "cast":
        return None
    (x,) = node.inputs
    if state.old.type_of(x).dtype != node.attrs["dtype"]:
        return None
    return (state.get(x),)


def order_commutative_operands(node: Node, state: RewriteState):
    if node.op not in COMMUTATIVE:
        return None
    a, b = node.inputs
    position = {n.name: i for i, n in enumerate(state.old.nodes)}
    if position[a.node] <= position[b.node]:
        return None
    return (state.emit(node.op, [state.get(b), state.get(a)], **node.attrs).value(),)


RULES = [drop_identity_cast, order_commutative_operands]


def canonicalize(graph: Graph, ctx: PassContext) -> Graph:
    """Normalise casts and operand order (see module docstring)."""
    return rewrite(graph, RULES, "canonicalize", ctx)
