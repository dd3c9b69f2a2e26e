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
    qgemm.py, takes no prologue: with it, its int8 and Q8_0 prefill tiles spilled registers on
    sm_90, 4 to 72 bytes a thread under aot_compile, and no one launch config fixed every bucket);
  - nothing else reads the normed row (it is never stored), and no node of the GEMM unit reads
    add_rmsnorm's sum (the pid_n == 0 programs write it while the others run);
  - the row's width is a multiple of ALIGNED_WIDTH (16): Triton then knows the rows (of x, the
    residual and the sum) start 16-aligned and loads them as vectors; at another width each element
    takes its own 64-bit address and the prologue spills registers on sm_90 (aot_compile: 760 to
    976 bytes a thread at width 72, none at 64, 128 or 576). Real models' hidden sizes qualify.
Then each QKV GEMM unit (a float `linear`, its norm prologue or none, no epilogue) merged with the
rope_kv_write unit launched right after it, as the epilogue of kernels/triton/qkv_rope.py, where
the rope reads the packed qkv that only it reads, turns whole heads (no partial rotary), has no
q/k norms (they need a whole head in one program) and writes a float cache (an int8 cache's
per-row scale needs the same).
Then each decode attention unit merged with the GEMM unit launched right after it, whose prologue
becomes the attention's merge stage (kernels/triton/gemm.py `merge_linear_triton`): a layer's
attention and O projection launch split + GEMM, 2 kernels, not split + merge + GEMM. Where:
  - the attention unit is one paged_decode_attention node (stage 1 handles windows and softcaps,
    so neither restricts the merge);
  - that unit starts with a float `linear` whose x is the attention output (the quantized
    template takes no prologue: see above), and nothing else reads the attention output;
  - the head_dim is a multiple of MERGE_K_TILE (16): the merge's K tiles lie inside one head and
    the GPU's smallest dot is 16 deep.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.dtypes import FLOAT_DTYPES
from llmc.compiler.ir import Graph, Node, Value, format_node
from llmc.compiler.ops import operands_of


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
MERGE_ATTENTION = "paged_decode_attention"       # the attention whose merge a GEMM takes as its prologue
MERGE_K_TILE = 16


def _takes_norm_prologue(norm_nodes: list[Node], gemm_nodes: list[Node], graph: Graph,
                         readers: dict[Value, set[str]]) -> bool:
    """Whether the GEMM unit may take the norm unit as its prologue (module docstring's rules)."""
    if len(norm_nodes) != 1 or norm_nodes[0].op not in PROLOGUE_NORMS:
        return False
    norm, gemm = norm_nodes[0], gemm_nodes[0]
    normed = norm.value(0)
    width = norm.types[0].shape[-1]
    if gemm.op != "linear" or gemm.inputs[0] != normed or normed in graph.outputs or width % ALIGNED_WIDTH:
        return False
    reads = [v for node in gemm_nodes for v in node.inputs]
    total = norm.value(1) if norm.op == "add_rmsnorm" else None
    return readers.get(normed) == {gemm.name} and reads.count(normed) == 1 and total not in reads


def _takes_rope_epilogue(gemm_nodes: list[Node], rope_nodes: list[Node], graph: Graph,
                         readers: dict[Value, set[str]]) -> bool:
    """Whether the rope_kv_write unit may become the epilogue of the GEMM unit (module docstring)."""
    gemm, rope = gemm_nodes[-1], rope_nodes[0]
    if len(rope_nodes) != 1 or rope.op != "rope_kv_write" or gemm.op != "linear" or len(gemm_nodes) > 2:
        return False
    if len(gemm_nodes) == 2 and gemm_nodes[0].op not in PROLOGUE_NORMS:
        return False
    x, a = operands_of(rope), rope.attrs
    if "qkv" not in x or x["qkv"] != gemm.value() or gemm.value() in graph.outputs:
        return False
    cache = graph.node_map()[x["kv_cache"].node].types[x["kv_cache"].index]
    whole_turn = a.get("rotary_dim", a["head_dim"]) == a["head_dim"]
    return (readers.get(gemm.value()) == {rope.name} and not a.get("qk_norm") and whole_turn
            and cache.dtype in FLOAT_DTYPES and x["qkv"] not in (x["positions"], x["slot_mapping"]))


def _takes_merge_prologue(attn_nodes: list[Node], gemm_nodes: list[Node], graph: Graph,
                          readers: dict[Value, set[str]]) -> bool:
    """Whether the GEMM unit may take the decode attention unit's merge as its prologue (module docstring)."""
    attn, gemm = attn_nodes[0], gemm_nodes[0]
    if len(attn_nodes) != 1 or attn.op != MERGE_ATTENTION or gemm.op != "linear":
        return False
    out = attn.value()
    reads = [v for node in gemm_nodes for v in node.inputs]
    return (gemm.inputs[0] == out and out not in graph.outputs and readers.get(out) == {gemm.name}
            and reads.count(out) == 1 and attn.attrs["head_dim"] % MERGE_K_TILE == 0)


def _merged(graph: Graph, parts: list[tuple[list[Node], int | None]], readers: dict[Value, set[str]],
            rule) -> list[tuple[list[Node], int | None]]:
    """`parts` (nodes, group) with each part that `rule(part, next part, graph, readers)` allows
    merged with the next one (which keeps its group)."""
    out, i = [], 0
    while i < len(parts):
        if i + 1 < len(parts) and rule(parts[i][0], parts[i + 1][0], graph, readers):
            out.append(([*parts[i][0], *parts[i + 1][0]], parts[i + 1][1] if parts[i + 1][1] is not None
                        else parts[i][1]))
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


def triton_units(graph: Graph) -> list[KernelUnit]:
    """kernel_units with each norm unit merged into the GEMM unit after it, then each QKV GEMM
    unit with the rope_kv_write after it, then each decode attention unit with the GEMM after it,
    where the rules allow (module docstring): the units the Triton target launches."""
    readers = _readers(graph)
    parts = [(list(u.nodes), u.group) for u in kernel_units(graph)]
    for rule in (_takes_norm_prologue, _takes_rope_epilogue, _takes_merge_prologue):
        parts = _merged(graph, parts, readers, rule)
    return [_unit(graph, index, nodes, readers, group) for index, (nodes, group) in enumerate(parts)]
