"""Match/rewrite machinery that every pass is built from.

`rewrite(graph, rules, name, ctx)` walks the graph in order and builds a new one. For each node
it offers the node to every rule; a rule reads the *old* graph (through `RewriteState`) and
either returns None (declines) or emits replacement nodes into the new graph and returns the
values that stand for the node's results. A node no rule takes is copied. Nodes that a fusion
made dead are left for `dce`. Op nodes are renumbered %0, %1, ... in the new graph.

A fusion that absorbs a node met earlier (an `add` already copied when its `rmsnorm` is matched)
calls `state.replace(old, new)`: later readers of the old value then read the new one, and a
node whose results were all replaced before it is reached is not copied at all.

`ctx.value_map` records which new value stands for each old one (composed over the rewrites of
one pass), so `llmc debug bisect` can compare intermediate values across a pass. A rule that
builds an ill-typed node raises an `IRError` naming the rule, the node it was rewriting and the
type rule it broke.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from llmc.compiler.ir import Graph, IRError, Node, TensorType, Value, format_node
from llmc.compiler.ops import infer_types


class PassError(Exception):
    """A pass broke the graph or a pass option is wrong; the message names the pass."""


@dataclass
class PassContext:
    """What a pass may read and the counters it bumps.

    options: pass options by name. hits: nodes the rules of each pass took. weights: the model's
    tensors by canonical name, when a pass needs data (fold_weights adds what it computes), else
    None. quantized: weights the source file stores quantized (compiler/quant_format.py's
    QuantizedWeight by name; fold_weights merges them too). records: facts a pass reports into
    report.json.
    value_map: old value -> new value over the last pass (None until a rewrite sets it).
    """

    options: dict[str, Any] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    weights: dict[str, Any] | None = None
    quantized: dict[str, Any] = field(default_factory=dict)
    records: dict[str, Any] = field(default_factory=dict)
    value_map: dict[Value, Value] | None = None

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
        self.replaced: dict[Value, Value] = {}
        self.types: dict[Value, TensorType] = {}
        self.new_nodes: dict[str, Node] = {}
        self._next_id = 0

    def producer(self, value: Value) -> Node:
        """The old-graph node that produced `value`."""
        return self.old_nodes[value.node]

    def num_users(self, value: Value) -> int:
        """Readers of `value` in the old graph, counting a graph output as one."""
        return len(self.old_users.get(value, [])) + self.old.outputs.count(value)

    def users(self, value: Value) -> list[Node]:
        """The old-graph nodes that read `value`."""
        return self.old_users.get(value, [])

    def get(self, value: Value) -> Value:
        """The new-graph value standing for an old-graph value."""
        return self.remap[value]

    def has(self, value: Value) -> bool:
        """Whether the old-graph value already has a stand-in (its node was visited)."""
        return value in self.remap

    def new_producer(self, value: Value) -> Node:
        """The new-graph node that produced a new-graph value."""
        return self.new_nodes[value.node]

    def replace(self, old: Value, new: Value) -> None:
        """From now on, old-graph readers of `old` read the new-graph value `new`."""
        self.remap[old] = new
        self.replaced[old] = new

    def emit(self, op: str, inputs: list[Value], **attrs: Any) -> Node:
        """Append a new op node (inputs are new-graph values); types come from the op's rule."""
        try:
            types = infer_types(op, [self.types[v] for v in inputs], attrs)
        except IRError as exc:
            args = ", ".join([str(v) for v in inputs] + [f"{k}={v!r}" for k, v in attrs.items()])
            raise IRError(f"{exc} (emitting %{self._next_id} = {op}({args}))") from None
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
        self.new_nodes[name] = node
        return node.value()

    def _append(self, node: Node) -> None:
        self.new.nodes.append(node)
        self.new_nodes[node.name] = node
        for i, t in enumerate(node.types):
            self.types[node.value(i)] = t

    def copy(self, node: Node) -> tuple[Value, ...]:
        if node.op in ("input", "weight"):
            return (self.declare(node.name, node.op, node.type),)
        new = self.emit(node.op, [self.get(v) for v in node.inputs], **node.attrs)
        return tuple(new.value(i) for i in range(len(new.types)))


Rule = Callable[[Node, RewriteState], "tuple[Value, ...] | None"]


def _apply_rules(node: Node, state: RewriteState, rules: list[Rule]) -> tuple[Value, ...] | None:
    for rule in rules:
        try:
            results = rule(node, state)
        except IRError as exc:
            raise IRError(f"rule {rule.__name__}, rewriting {format_node(node)}: {exc}") from None
        if results is not None:
            return results
    return None


def _record_value_map(ctx: PassContext, remap: dict[Value, Value]) -> None:
    if ctx.value_map is None:
        ctx.value_map = dict(remap)
    else:  # a second rewrite in the same pass: compose
        ctx.value_map = {old: remap[mid] for old, mid in ctx.value_map.items() if mid in remap}


def rewrite(graph: Graph, rules: list[Rule], name: str, ctx: PassContext) -> Graph:
    """Apply `rules` once over `graph` in order; count the hits under `name`."""
    state = RewriteState(graph)
    hits = 0
    for node in graph.nodes:
        absorbed = [node.value(i) in state.replaced for i in range(len(node.types))]
        if absorbed and all(absorbed):
            continue  # a fusion earlier in the walk already stands for every result
        results = _apply_rules(node, state, rules)
        if results is not None:
            hits += 1
        else:
            try:
                results = state.copy(node)
            except IRError as exc:  # an earlier rewrite changed the type of an operand
                raise IRError(f"copying {format_node(node)}: {exc}") from None
        for i, value in enumerate(results):
            if node.value(i) not in state.replaced:  # a replacement outranks the copy
                state.remap[node.value(i)] = value
    state.new.outputs = tuple(state.get(v) for v in graph.outputs)
    ctx.bump(name, hits)
    _record_value_map(ctx, state.remap)
    return state.new
