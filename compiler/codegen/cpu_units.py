"""CPU units: what runs as one call on a CPU, in launch order, for the op-by-op path and the step plan.

A kernel unit (units.py: a fusion group, or a node by itself) is cut into maximal runs of nodes
whose op record has a formula (compiler/formula.py), each a *generated* unit that cpp.py writes
as one C++ function, and the other nodes (GEMMs, attention, RoPE + KV write, gathers), each a
*template* unit of one node that a hand-written kernel computes. A run is consecutive in the
kernel unit's node order. Every CPU unit's inputs and outputs are as KernelUnit states them for
its own nodes: values read from outside it in first-use order; values something outside it (another
unit, the graph's result) reads, in graph order. Units come kernel unit by kernel unit in
kernel_units' launch order, each one's parts in node order, so producers launch first.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node, Value
from llmc.compiler.ops import OPS

from .units import KernelUnit, kernel_units


def is_generated(unit: KernelUnit) -> bool:
    """A unit whose every op has a formula: codegen writes its C++ (cpp.py)."""
    return all(OPS[n.op].formula is not None for n in unit.nodes)


def unit_kind(unit: KernelUnit) -> str:
    """What a profile counts a unit as: its row-wise op's kind if it has one, else its first op's."""
    kinds = [OPS[n.op].kind for n in unit.nodes]
    return "rowwise" if "rowwise" in kinds else kinds[0]


def _runs(nodes: tuple[Node, ...]) -> list[list[Node]]:
    """`nodes` cut into maximal runs of formula ops and single other nodes, in order."""
    parts: list[list[Node]] = []
    for node in nodes:
        generated = OPS[node.op].formula is not None
        if generated and parts and OPS[parts[-1][-1].op].formula is not None:
            parts[-1].append(node)
        else:
            parts.append([node])
    return parts


def _part(unit: KernelUnit, index: int, nodes: list[Node], read_outside: set[Value]) -> KernelUnit:
    names = {n.name for n in nodes}
    inputs: list[Value] = []
    for node in nodes:
        inputs += [v for v in node.inputs if v.node not in names and v not in inputs]
    outputs = [node.value(i) for node in nodes for i in range(len(node.types))
               if node.value(i) in unit.outputs or node.value(i) in read_outside]
    return KernelUnit(unit.entry, index, unit.group, tuple(nodes), tuple(inputs), tuple(outputs))


def _reads(nodes: list[Node]) -> set[Value]:
    return {v for node in nodes for v in node.inputs}


def cpu_units(graph: Graph) -> list[KernelUnit]:
    """The graph's CPU units in launch order (see module docstring); `index` is the place in it."""
    units: list[KernelUnit] = []
    for unit in kernel_units(graph):
        parts = _runs(unit.nodes)
        for i, nodes in enumerate(parts):
            later = _reads([n for p in parts[i + 1:] for n in p])
            units.append(_part(unit, len(units), nodes, later))
    return units
