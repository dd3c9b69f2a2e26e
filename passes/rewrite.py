"""Match/rewrite machinery that every pass is built from.

`rewrite(graph, rules, name, ctx)` walks the graph in order and builds a new one. For each node
it offers the node to every rule; a rule reads the *old* graph (through `RewriteState`) and
either returns None (declines) or emits replacement nodes into the new graph and returns the
values that stand for the node's results. A node no rule takes is copied. Nodes that a fusion
made dead are left for `dce`. Op nodes are renumbered %0, %1, ... in the new graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from llmc.compiler.ir import Graph, Node, TensorType, Value
from llmc.compiler.ops import infer_types


@dataclass
class PassContext:
    """What a pass may read (options) and the counters it bumps (hits per pass)."""

    options: dict[str, Any] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        self.hits[name] = self.hits.get(name, 0) + n


class RewriteState:
    """The old graph (to match against) and the new graph being built (to emit into)."""

    def __init__(self, old: Graph):
        self.old = old
        self.old_nodes = old.node_map()
        self.old_users = old.users()
        self.new = Graph(old.name)
        self.remap: dict[Value, Value] = {}
        self.types: dict[Value, TensorType] = {}
        self._next_id = 0

    def producer(self, value: Value) -> Node:
        """The old-graph node that produced `value`."""
        return self.old_nodes[value.node]

    def num_users(self, value: Value) -> int:
        """Readers of `value` in the old graph, counting a graph output as one."""
        return len(self.old_users.get(value, [])) + self.old.outputs.count(value)

    def get(self, value: Value) -> Value:
        """The new-graph value standing for an old-graph value."""
        return self.remap[value]

    def emit(self, op: str, inputs: list[Value], **attrs: Any) -> Node:
        """Append a new op node (inputs are new-graph values); types come from the op's rule."""
        types = infer_types(op, [self.types[v] for v in inputs], attrs)
        node = Node(str(self._next_id), op, tuple(inputs), attrs, types)
        self._next_id += 1
        self._append(node)
        return node

    def declare(self, name: str, op: str, ttype: TensorType) -> Value:
        """Add an `input` or `weight` node (kept ahead of the op nodes)."""
        node = Node(name, op, (), {}, (ttype,))
        first_op = next((i for i, n in enumerate(self.new.nodes) if n.op not in ("input", "weight")),
                        len(self.new.nodes))
        self.new.nodes.insert(first_op, node)
        self.types[node.value()] = ttype
        return node.value()

    def _append(self, node: Node) -> None:
        self.new.nodes.append(node)
        for i, t in enumerate(node.types):
            self.types[node.value(i)] = t

    def copy(self, node: Node) -> tuple[Value, ...]:
        if node.op in ("input", "weight"):
            return (self.declare(node.name, node.op, node.type),)
        new = self.emit(node.op, [self.get(v) for v in node.inputs], **node.attrs)
        return tuple(new.value(i) for i in range(len(new.types)))


Rule = Callable[[Node, RewriteState], "tuple[Value, ...] | None"]


def rewrite(graph: Graph, rules: list[Rule], name: str, ctx: PassContext) -> Graph:
    """Apply `rules` once over `graph` in order; count the hits under `name`."""
    state = RewriteState(graph)
    hits = 0
    for node in graph.nodes:
        results = None
        for rule in rules:
            results = rule(node, state)
            if results is not None:
                hits += 1
                break
        if results is None:
            results = state.copy(node)
        for i, value in enumerate(results):
            state.remap[node.value(i)] = value
    state.new.outputs = tuple(state.get(v) for v in graph.outputs)
    ctx.bump(name, hits)
    return state.new
