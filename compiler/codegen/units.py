"""Kernel units: the fusion groups of a lowered graph, each with the values it reads and writes.

A unit is one kernel launch: the nodes that `fusion_grouping` gave one `group=N`, or a node
with no group by itself. Its inputs are the values its nodes read from outside it (graph inputs,
weights, other units' results), in first-use order; its outputs are the values of its nodes that
something outside reads (another unit or the graph's result), in graph order. Units come in
graph order, which is a valid launch order (the grouping keeps the kernel graph acyclic).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.ir import Graph, Node, Value, format_node


@dataclass(frozen=True)
class KernelUnit:
    entry: str                    # the graph: "prefill" or "decode"
    index: int                    # position among the graph's units
    group: int | None             # the fusion group, None for a single ungrouped node
    nodes: tuple[Node, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]

    @property
    def label(self) -> str:
        where = f"group {self.group}" if self.group is not None else f"node %{self.nodes[0].name}"
        return f"{self.entry} unit {self.index} ({where})"

    def ir_lines(self) -> list[str]:
        return [format_node(n) for n in self.nodes]


def _readers(graph: Graph) -> dict[Value, set[str]]:
    readers: dict[Value, set[str]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers.setdefault(v, set()).add(node.name)
    return readers


def kernel_units(graph: Graph) -> list[KernelUnit]:
    """The graph's op nodes cut into units (see module docstring)."""
    ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
    members: dict[object, list[Node]] = {}
    for node in ops:
        key = ("group", node.attrs["group"]) if "group" in node.attrs else ("node", node.name)
        members.setdefault(key, []).append(node)
    readers, returned = _readers(graph), set(graph.outputs)
    units = []
    for index, (key, nodes) in enumerate(members.items()):
        names = {n.name for n in nodes}
        inputs: list[Value] = []
        for node in nodes:
            inputs += [v for v in node.inputs if v.node not in names and v not in inputs]
        outputs = [node.value(i) for node in nodes for i in range(len(node.types))
                   if node.value(i) in returned or readers.get(node.value(i), set()) - names]
        group = key[1] if key[0] == "group" else None
        units.append(KernelUnit(graph.name, index, group, tuple(nodes), tuple(inputs), tuple(outputs)))
    return units
