"""Partition the op nodes into kernels for code generation, recorded as a `group` attribute.

Matches: chains that one kernel can compute: a GEMM and the elementwise ops after it (its
  epilogue), runs of elementwise ops, and elementwise ops before or after a row-wise op
  (rmsnorm, add_rmsnorm, rope). An edge joins two nodes only when the producer's results have
  no reader outside the consumer and the joined group holds at most one GEMM or row-wise op.
Produces: the same graph with `group=N` on every node of a group of two or more (numbered in
  graph order); an op without `group` is a kernel by itself. The hit counter counts grouped nodes.
Requires: the fusions and dce (it runs last). Preserves: numerics exactly (attributes only).
"""

from __future__ import annotations

import networkx as nx

from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import OPS

from .rewrite import PassContext, RewriteState, rewrite

# producer kind -> consumer kinds it may fuse into (kinds are the ops' OpDef.kind)
FUSABLE = {"gemm": ("elementwise",), "elementwise": ("elementwise", "rowwise"), "rowwise": ("elementwise",)}
ANCHOR_KINDS = ("gemm", "rowwise")       # a group holds at most one of these


def kind(op: str) -> str:
    """The op's kind, from its OpDef: gemm, elementwise, rowwise, attention, data_movement or leaf."""
    return OPS[op].kind


def dataflow(graph: Graph) -> nx.DiGraph:
    """Op nodes and the edges between them (inputs and weights left out)."""
    flow = nx.DiGraph()
    ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
    flow.add_nodes_from(n.name for n in ops)
    for node in ops:
        flow.add_edges_from((v.node, node.name) for v in node.inputs if v.node in flow)
    return flow


def _fusable(producer: Node, consumer: Node, flow: nx.DiGraph, outputs: set[str]) -> bool:
    only_reader = set(flow.successors(producer.name)) == {consumer.name} and producer.name not in outputs
    return only_reader and kind(consumer.op) in FUSABLE.get(kind(producer.op), ())


def partition(graph: Graph) -> list[list[str]]:
    """Kernel groups (node names in graph order), groups in graph order; singletons included."""
    flow, nodes = dataflow(graph), graph.node_map()
    outputs = {v.node for v in graph.outputs}
    groups = nx.utils.UnionFind(flow.nodes)
    anchors = {n: int(kind(nodes[n].op) in ANCHOR_KINDS) for n in flow.nodes}  # per group root
    for producer, consumer in flow.edges:  # edges in graph order of their producers
        a, b = groups[producer], groups[consumer]
        if a == b or not _fusable(nodes[producer], nodes[consumer], flow, outputs):
            continue
        if anchors[a] + anchors[b] > 1:
            continue
        total = anchors[a] + anchors[b]
        groups.union(a, b)
        anchors[groups[a]] = total
    order = {name: i for i, name in enumerate(flow.nodes)}
    parts = sorted((sorted(s, key=order.__getitem__) for s in groups.to_sets()), key=lambda s: order[s[0]])
    _check_acyclic(flow, parts)
    return parts


def _check_acyclic(flow: nx.DiGraph, parts: list[list[str]]) -> None:
    part_of = {name: i for i, part in enumerate(parts) for name in part}
    kernels = nx.DiGraph((part_of[u], part_of[v]) for u, v in flow.edges if part_of[u] != part_of[v])
    assert nx.is_directed_acyclic_graph(kernels), "fusion groups must form a DAG of kernels"


def fusion_grouping(graph: Graph, ctx: PassContext) -> Graph:
    """Record the kernel partition as `group=N` attributes (see module docstring)."""
    group_of = {}
    for number, part in enumerate(p for p in partition(graph) if len(p) > 1):
        group_of |= {name: number for name in part}

    def mark_group(node: Node, state: RewriteState):
        if node.name not in group_of:
            return None
        attrs = {**node.attrs, "group": group_of[node.name]}
        new = state.emit(node.op, [state.get(v) for v in node.inputs], **attrs)
        return tuple(new.value(i) for i in range(len(new.types)))

    return rewrite(graph, [mark_group], "fusion_grouping", ctx)
