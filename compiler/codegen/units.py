"""Kernel units: the fusion groups of a lowered graph, each with the values it reads and writes.

A unit is one kernel launch: the nodes that `fusion_grouping` gave one `group=N`, or a node
with no group by itself. Its inputs are the values its nodes read from outside it (graph inputs,
weights, other units' results), in first-use order; its outputs are the values of its nodes that
something outside reads (another unit or the graph's result), in graph order. Units come in
an order that launches each after every unit it reads from (the grouping keeps the kernel graph
acyclic), ties broken by graph order: a group's first node may come before a single node that
one of its later nodes reads.

`triton_units` is the Triton target's cut: the same units, then each RMSNorm unit merged into the
GEMM unit that reads its normed row, as that GEMM template's prologue (kernels/triton/gemm.py).
The merge is codegen's, not a pass's: the IR, its fusion groups and the CPU step plan (whose C++
units fuse differently, and are checked on their own) stay as they are; only the Triton kernels
launch fewer times. A norm unit is merged where all of these hold, else it launches on its own:
  - it is one rmsnorm or add_rmsnorm node, launched right before the GEMM unit;
  - that unit starts with a float `linear` whose x is the normed row (the int8/int4 template,
    qgemm.py, has no prologue: its int4 tile reads x as two gathers of nibble positions);
  - nothing else reads the normed row (it is never stored), and no node of the GEMM unit reads
    add_rmsnorm's sum (the pid_n == 0 programs write it while the others run);
  - the row's width is a multiple of ALIGNED_WIDTH (16): Triton then knows the rows (of x, the
    residual and the sum) start 16-aligned and loads them as vectors; at another width each element
    takes its own 64-bit address and the prologue spills registers on sm_90 (aot_compile: 760 to
    976 bytes a thread at width 72, none at 64, 128 or 576). Real models' hidden sizes qualify.
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


def _unit(graph: Graph, index: int, nodes: list[Node], readers: dict[Value, set[str]], group: int | None) -> KernelUnit:
    names = {n.name for n in nodes}
    returned = set(graph.outputs)
    inputs: list[Value] = []
    for node in nodes:
        inputs += [v for v in node.inputs if v.node not in names and v not in inputs]
    outputs = [node.value(i) for node in nodes for i in range(len(node.types))
               if node.value(i) in returned or readers.get(node.value(i), set()) - names]
    return KernelUnit(graph.name, index, group, tuple(nodes), tuple(inputs), tuple(outputs))


def kernel_units(graph: Graph) -> list[KernelUnit]:
    """The graph's op nodes cut into units (see module docstring)."""
    ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
    members: dict[object, list[Node]] = {}
    for node in ops:
        key = ("group", node.attrs["group"]) if "group" in node.attrs else ("node", node.name)
        members.setdefault(key, []).append(node)
    readers = _readers(graph)
    return [_unit(graph, index, nodes, readers, nodes[0].attrs.get("group"))
            for index, nodes in enumerate(_launch_order(list(members.values())))]


PROLOGUE_NORMS = ("rmsnorm", "add_rmsnorm")
ALIGNED_WIDTH = 16


def _takes_norm_prologue(norm_unit: KernelUnit, gemm_unit: KernelUnit, graph: Graph,
                         readers: dict[Value, set[str]]) -> bool:
    """Whether the GEMM unit may take the norm unit as its prologue (module docstring's rules)."""
    if len(norm_unit.nodes) != 1 or norm_unit.nodes[0].op not in PROLOGUE_NORMS:
        return False
    norm, gemm = norm_unit.nodes[0], gemm_unit.nodes[0]
    normed = norm.value(0)
    width = norm.types[0].shape[-1]
    if gemm.op != "linear" or gemm.inputs[0] != normed or normed in graph.outputs or width % ALIGNED_WIDTH:
        return False
    reads = [v for node in gemm_unit.nodes for v in node.inputs]
    total = norm.value(1) if norm.op == "add_rmsnorm" else None
    return readers.get(normed) == {gemm.name} and reads.count(normed) == 1 and total not in reads


def triton_units(graph: Graph) -> list[KernelUnit]:
    """kernel_units with each norm unit that may be merged into the GEMM unit after it merged
    (module docstring): the units the Triton target launches."""
    readers = _readers(graph)
    units = kernel_units(graph)
    merged: list[list[Node]] = []
    groups: list[int | None] = []
    i = 0
    while i < len(units):
        if i + 1 < len(units) and _takes_norm_prologue(units[i], units[i + 1], graph, readers):
            merged.append([*units[i].nodes, *units[i + 1].nodes])
            groups.append(units[i + 1].group)
            i += 2
        else:
            merged.append(list(units[i].nodes))
            groups.append(units[i].group)
            i += 1
    return [_unit(graph, index, nodes, readers, group) for index, (nodes, group) in enumerate(zip(merged, groups))]
