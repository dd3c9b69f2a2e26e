"""Shared machinery of merge_qkv and merge_gate_up: several GEMMs of one input become one.

`merge_linears(graph, groups, name, ctx)` takes groups of `linear` node names (old graph), each
in the order their outputs are to sit in the merged result. Where the first member of a group
is met in the walk, it emits `concat` of the weights (and biases) along dim 0, one `linear`
over the shared input, and a `split` whose results stand for the members in group order.
The concats read only weights: fold_weights turns them into new stored weights.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import operands_of

from .rewrite import PassContext, RewriteState, rewrite


def mergeable(nodes: list[Node], graph_nodes: dict[str, Node]) -> bool:
    """Linear nodes over one input, with weights (and biases, all or none) that are weight nodes."""
    if len({n.name for n in nodes}) != len(nodes) or any(n.op != "linear" for n in nodes):
        return False
    named = [operands_of(n) for n in nodes]
    if len({x.x for x in named}) != 1 or len({"bias" in x for x in named}) != 1:
        return False
    params = [v for x in named for v in (x.weight, *([x.bias] if "bias" in x else []))]
    return all(graph_nodes[v.node].op == "weight" and v.index == 0 for v in params)


def _emit_merged(state: RewriteState, members: list[Node]):
    named = [operands_of(m) for m in members]
    x = state.get(named[0].x)
    params = [state.emit("concat", [state.get(n[part]) for n in named], dim=0).value()
              for part in ("weight", "bias") if part in named[0]]
    merged = state.emit("linear", [x, *params])
    return state.emit("split", [merged.value()], sizes=[m.type.shape[1] for m in members])


def merge_linears(graph: Graph, groups: list[tuple[str, ...]], name: str, ctx: PassContext) -> Graph:
    """Replace each group of linears by one linear + split (see module docstring)."""
    nodes = graph.node_map()
    member_of: dict[str, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        if not any(m in member_of for m in group):  # a linear joins one group at most
            member_of |= {m: (g, i) for i, m in enumerate(group)}
    splits: dict[int, Node] = {}

    def merge_sibling_linears(node: Node, state: RewriteState):
        if node.name not in member_of:
            return None
        group, index = member_of[node.name]
        if group not in splits:
            splits[group] = _emit_merged(state, [nodes[m] for m in groups[group]])
        return (splits[group].value(index),)

    return rewrite(graph, [merge_sibling_linears], name, ctx)
