"""Dead-code elimination.

Matches: nodes none of whose results reach a graph output (through any chain of readers),
  including unused `input` and `weight` nodes; ops with side effects (kv_write) are roots.
Produces: the same graph without them, op nodes renumbered.
Requires: nothing. Preserves: the graph's outputs and side effects exactly.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import OPS

from .rewrite import PassContext, RewriteState, rewrite


def _live_nodes(graph: Graph) -> set[str]:
    nodes = graph.node_map()
    stack = [v.node for v in graph.outputs]
    stack += [n.name for n in graph.nodes if OPS[n.op].side_effects]
    live: set[str] = set()
    while stack:
        name = stack.pop()
        if name not in live:
            live.add(name)
            stack.extend(v.node for v in nodes[name].inputs)
    return live


def dce(graph: Graph, ctx: PassContext) -> Graph:
    """Drop every node that cannot affect an output or a side effect."""
    live = _live_nodes(graph)

    def drop_dead(node: Node, state: RewriteState):
        return None if node.name in live else ()

    return rewrite(graph, [drop_dead], "dce", ctx)
