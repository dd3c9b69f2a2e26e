"""Common-subexpression elimination.

Matches: an op node with the same op, the same operands (after earlier rewrites in this walk)
  and the same attributes as a node before it; ops with side effects are never merged.
Produces: nothing new: readers of the duplicate read the first node's results.
Requires: canonicalize (so `add(a, b)` and `add(b, a)` look alike). Preserves: numerics exactly.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import OPS

from .rewrite import PassContext, RewriteState, rewrite


def _key(node: Node, state: RewriteState) -> tuple:
    attrs = repr(sorted(node.attrs.items()))  # attribute values may be dicts: compare their text
    return node.op, tuple(state.get(v) for v in node.inputs), attrs


def cse(graph: Graph, ctx: PassContext) -> Graph:
    """Reuse the first of several identical pure computations (see module docstring)."""
    first_seen: dict[tuple, Node] = {}

    def reuse_identical(node: Node, state: RewriteState):
        if node.op in ("input", "weight") or OPS[node.op].side_effects:
            return None
        first = first_seen.setdefault(_key(node, state), node)
        if first is node:
            return None
        return tuple(state.get(first.value(i)) for i in range(len(node.types)))

    return rewrite(graph, [reuse_identical], "cse", ctx)
