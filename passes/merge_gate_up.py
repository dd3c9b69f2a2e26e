"""Merge the gate and up projections of every gated MLP (SwiGLU, GeGLU) into one GEMM.

Matches: `mul(act(linear(x, wg)), linear(x, wu))` (operands in either order, act silu or
  gelu_tanh: fuse_silu_mul's GATED), or `silu_mul | gelu_tanh_mul(linear(x, wg), linear(x, wu))`,
  both linears over the same x with weight operands.
Produces: `linear(x, concat(wg, wu, dim=0))` and a `split` into gate and up halves, whose
  results replace the two projections (fuse_silu_mul then reads the merged output directly).
Requires: canonicalize. Preserves: numerics up to the GEMM's accumulation order.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import operands_of

from .fuse_silu_mul import GATED
from .merge_linears import merge_linears, mergeable
from .rewrite import PassContext


def _gate_and_up(node: Node, nodes: dict[str, Node]) -> tuple[Node, Node] | None:
    if node.op in GATED.values() and "gate" in operands_of(node):
        x = operands_of(node)
        return nodes[x.gate.node], nodes[x.up.node]
    if node.op != "mul":
        return None
    a, b = (nodes[v.node] for v in node.inputs)
    if a.op not in GATED and b.op in GATED:
        a, b = b, a
    if a.op not in GATED:
        return None
    return nodes[a.inputs[0].node], b


def gate_up_groups(graph: Graph) -> list[tuple[str, ...]]:
    """(gate, up) linear node names of every gated MLP whose projections can merge."""
    nodes = graph.node_map()
    groups = []
    for node in graph.nodes:
        pair = _gate_and_up(node, nodes)
        if pair and mergeable(list(pair), nodes):
            groups.append((pair[0].name, pair[1].name))
    return groups


def merge_gate_up(graph: Graph, ctx: PassContext) -> Graph:
    """One GEMM for the MLP's gate and up projections (see module docstring)."""
    return merge_linears(graph, gate_up_groups(graph), "merge_gate_up", ctx)
