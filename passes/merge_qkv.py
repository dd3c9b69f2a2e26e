"""Merge the Q, K and V projections of every attention into one GEMM.

Matches: `attention(q, k, v, qsl)` where q and k are `rope(linear(x, w))` (or plain linears;
  a q/k norm, `head_rmsnorm` or `rmsnorm`, may sit between linear and rope) and v is
  `linear(x, w)`, all three over the same x, with weight (and, for Qwen2, bias) operands that
  are weight nodes.
Produces: `linear(x, concat(wq, wk, wv, dim=0) [, concat(bq, bk, bv, dim=0)])` and a `split`
  into q, k, v widths, whose results replace the three projections.
Requires: runs before insert_paged_attention (it matches the traced `attention`).
Preserves: numerics up to the GEMM's accumulation order (exact in practice on CPU).
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node, Value

from .merge_linears import merge_linears, mergeable
from .rewrite import PassContext


QK_NORMS = ("head_rmsnorm", "rmsnorm")


def _projection(value: Value, nodes: dict[str, Node]) -> Node:
    """The GEMM behind a q or k operand: through a `rope` and a q/k norm before it, if there are."""
    node = nodes[value.node]
    node = nodes[node.inputs[0].node] if node.op == "rope" else node
    return nodes[node.inputs[0].node] if node.op in QK_NORMS else node


def qkv_groups(graph: Graph) -> list[tuple[str, ...]]:
    """(q, k, v) linear node names of every attention whose projections can merge."""
    nodes = graph.node_map()
    groups = []
    for node in graph.nodes:
        if node.op != "attention":
            continue
        q, k, v = (_projection(x, nodes) for x in node.inputs[:3])
        if mergeable([q, k, v], nodes):
            groups.append((q.name, k.name, v.name))
    return groups


def merge_qkv(graph: Graph, ctx: PassContext) -> Graph:
    """One GEMM for Q, K and V (see module docstring)."""
    return merge_linears(graph, qkv_groups(graph), "merge_qkv", ctx)
