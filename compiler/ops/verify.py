"""The verifier: every op's type rule applied to every node, plus graph-level checks (names
unique, values defined before use, results as declared). Errors quote the node and the rule."""

from __future__ import annotations

from ..ir import Graph, IRError, Node, TensorType, format_node
from .record import Operands, bind
from .registry import OPS


def infer_types(op: str, input_types: list[TensorType], attrs: dict) -> tuple[TensorType, ...]:
    """Result types of `op` applied to inputs of these types (IRError if the rule fails)."""
    record = OPS.get(op)
    if record is None:
        raise IRError(f"unknown op {op!r}")
    missing = [a for a in record.attrs if a not in attrs]
    if missing:
        raise IRError(f"{op} is missing attribute(s) {missing}")
    return record.infer(bind(record, input_types, attrs), attrs)


def operands_of(node: Node) -> Operands:
    """A node's input values by operand name (its op's record decides them)."""
    return bind(OPS[node.op], node.inputs, node.attrs)


def _verify_node(node: Node, types: dict) -> None:
    for v in node.inputs:
        if (v.node, v.index) not in types:
            raise IRError(f"uses {v}, which is not defined before it")
    if node.op in ("input", "weight"):
        if node.inputs or len(node.types) != 1:
            raise IRError(f"{node.op} nodes take no inputs and have one type")
        return
    expected = infer_types(node.op, [types[(v.node, v.index)] for v in node.inputs], node.attrs)
    if tuple(expected) != tuple(node.types):
        raise IRError(f"declared type {', '.join(map(str, node.types))} but the {node.op} rule gives "
                      f"{', '.join(map(str, expected))}")


def verify(graph: Graph) -> None:
    """Check every node against its op's rule; raise IRError naming the node and the rule."""
    types: dict[tuple[str, int], TensorType] = {}
    for node in graph.nodes:
        try:
            if any((node.name, i) in types for i in range(len(node.types))):
                raise IRError(f"node name %{node.name} is defined twice")
            _verify_node(node, types)
        except IRError as exc:
            raise IRError(f"{exc} (in graph {graph.name}: {format_node(node)})") from None
        for i, t in enumerate(node.types):
            types[(node.name, i)] = t
    for v in graph.outputs:
        if (v.node, v.index) not in types:
            raise IRError(f"graph {graph.name} returns {v}, which is not defined")
