"""Kernel units: the fusion groups of a lowered graph, each with the values it reads and writes.

A unit is one kernel launch: the nodes that `fusion_grouping` gave one `group=N`, or a node
with no group by itself. Its inputs are the values its nodes read from outside it (graph inputs,
weights, other units' results), in first-use order; its outputs are the values of its nodes that
something outside reads (another unit or the graph's result), in graph order. Units come in
an order that launches each after every unit it reads from (the grouping keeps the kernel graph
acyclic), ties broken by graph order: a group's first node may come before a single node that
one of its later nodes reads.
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


def _launch_order(parts: list[list[Node]]) -> list[list[Node]]:
    """`parts` (in order of their first node) sorted so that producers launch before readers."""
    part_of = {node.name: i for i, nodes in enumerate(parts) for node in nodes}
    needs = [{part_of[v.node] for n in nodes for v in n.inputs if v.node in part_of} - {i}
             for i, nodes in enumerate(parts)]
    order: list[int] = []
    done: set[int] = set()
    while len(order) < len(parts):   # the first part (in graph order) whose producers have launched
        ready = next(i for i in range(len(parts)) if i not in done and needs[i] <= done)
        order.append(ready)
        done.add(ready)
    return [parts[i] for i in order]


def kernel_units(graph: Graph) -> list[KernelUnit]:
    """The graph's op nodes cut into units (see module docstring)."""
    ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
    members: dict[object, list[Node]] = {}
    for node in ops:
        key = ("group", node.attrs["group"]) if "group" in node.attrs else ("node", node.name)
        members.setdefault(key, []).append(node)
    readers, returned = _readers(graph), set(graph.outputs)
    units = []
    for index, nodes in enumerate(_launch_order(list(members.values()))):
        names = {n.name for n in nodes}
        inputs: list[Value] = []
        for node in nodes:
            inputs += [v for v in node.inputs if v.node not in names and v not in inputs]
        outputs = [node.value(i) for node in nodes for i in range(len(node.types))
                   if node.value(i) in returned or readers.get(node.value(i), set()) - names]
        group = nodes[0].attrs.get("group")
        units.append(KernelUnit(graph.name, index, group, tuple(nodes), tuple(inputs), tuple(outputs)))
    return units
