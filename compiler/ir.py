"""llmc IR: one `Node` type, one `Graph`, a printer whose text parses back.

A graph is a topologically ordered list of nodes. Graph inputs are `input` nodes, model
parameters are `weight` nodes (named `w.<canonical weight name>`), and every other node is an
op from `compiler.ops`. A node may have several results; `%7` refers to result 0 and `%7#1`
to result 1. Dims are ints or symbols (`T` tokens, `S` sequences, `R` logit rows, `NB` KV blocks, ...).

Text form, one node a line:

    graph prefill {
      %input_ids = input() : i64[T]
      %w.norm.weight = weight() : f32[576]
      %7 = rmsnorm(%6, %w.norm.weight, eps=1e-05) : f32[T,576]
      return %9
    }
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

# The element types (compiler/dtypes.py): i8 signed 8-bit codes (int8 weights, the int8 KV cache);
# u4x2 two unsigned 4-bit codes per byte (packed int4 weights; a u4x2 shape counts bytes, so
# [N, K/2] holds N rows of K codes).
from .dtypes import DTYPES

Dim = int | str


class IRError(Exception):
    """An IR text or graph that is not well formed; the message names the line or node."""


@dataclass(frozen=True)
class TensorType:
    """Element type and shape; a dim is an int or a symbol such as `T`."""

    dtype: str
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    def with_shape(self, *shape: Dim) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))


@dataclass(frozen=True)
class Value:
    """One result of a node: `%name` (index 0) or `%name#index`."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return f"%{self.node}" if self.index == 0 else f"%{self.node}#{self.index}"


@dataclass
class Node:
    """One operation: `name = op(inputs, attrs) : types`."""

    name: str
    op: str
    inputs: tuple[Value, ...]
    attrs: dict[str, Any]
    types: tuple[TensorType, ...]

    def value(self, index: int = 0) -> Value:
        return Value(self.name, index)

    @property
    def type(self) -> TensorType:
        assert len(self.types) == 1, f"{self.name} has {len(self.types)} results"
        return self.types[0]


@dataclass
class Graph:
    """An entry graph (`prefill` or `decode`): ordered nodes and the returned values."""

    name: str
    nodes: list[Node] = field(default_factory=list)
    outputs: tuple[Value, ...] = ()

    def node_map(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def type_of(self, value: Value) -> TensorType:
        return self.node_map()[value.node].types[value.index]

    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "input"]

    def weights(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "weight"]

    def users(self) -> dict[Value, list[Node]]:
        """Map each value to the nodes that read it (outputs are not nodes)."""
        out: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                out.setdefault(v, []).append(node)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts

    def __str__(self) -> str:
        return print_graph(self)


# ----------------------------------------------------------------------------- printer


def _format_attr(value: Any) -> str:
    return repr(value)


def format_node(node: Node) -> str:
    args = [str(v) for v in node.inputs]
    args += [f"{k}={_format_attr(v)}" for k, v in node.attrs.items()]
    types = ", ".join(str(t) for t in node.types)
    return f"%{node.name} = {node.op}({', '.join(args)}) : {types}"


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name} {{"]
    lines += [f"  {format_node(n)}" for n in graph.nodes]
    lines.append(f"  return {', '.join(str(v) for v in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ parser

_NAME = r"[A-Za-z0-9_.]+"
_NODE_RE = re.compile(rf"^%({_NAME}) = (\w+)\((.*)\) : (.+)$")
_VALUE_RE = re.compile(rf"^%({_NAME})(?:#(\d+))?$")
_TYPE_RE = re.compile(r"(\w+)\[([^\]]*)\]")


def parse_value(text: str) -> Value:
    m = _VALUE_RE.match(text.strip())
    if not m:
        raise IRError(f"expected a value like %name or %name#1, got {text!r}")
    return Value(m.group(1), int(m.group(2) or 0))


def parse_type(text: str) -> TensorType:
    m = _TYPE_RE.fullmatch(text.strip())
    if not m or m.group(1) not in DTYPES:
        raise IRError(f"expected a type like f32[T,576], got {text!r}")
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    return TensorType(m.group(1), tuple(int(d) if d.lstrip("-").isdigit() else d for d in dims))


def _split_args(text: str) -> list[str]:
    """Split on commas that are not nested in brackets, braces, parentheses or quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    tail = text[start:]
    if tail.strip():
        parts.append(tail)
    return [p.strip() for p in parts]


def parse_node(line: str) -> Node:
    m = _NODE_RE.match(line.strip())
    if not m:
        raise IRError(f"cannot parse IR line {line.strip()!r}")
    name, op, args_text, types_text = m.groups()
    inputs: list[Value] = []
    attrs: dict[str, Any] = {}
    for arg in _split_args(args_text):
        if arg.startswith("%"):
            if attrs:
                raise IRError(f"value {arg} after attributes in {line.strip()!r}")
            inputs.append(parse_value(arg))
            continue
        key, eq, literal = arg.partition("=")
        if not eq:
            raise IRError(f"argument {arg!r} is neither a %value nor key=value in {line.strip()!r}")
        try:
            attrs[key.strip()] = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError) as exc:
            raise IRError(f"attribute {key.strip()} has an unreadable value {literal.strip()!r} "
                          f"in {line.strip()!r}") from exc
    try:
        types = tuple(parse_type(t) for t in _split_args(types_text))
    except IRError as exc:
        raise IRError(f"{exc} in {line.strip()!r}") from None
    return Node(name, op, tuple(inputs), attrs, types)


def parse_graph(text: str) -> Graph:
    """Parse the printer's text form back into a Graph (structure only; call verify())."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines or not re.fullmatch(r"graph \w+ \{", lines[0]) or lines[-1] != "}":
        raise IRError("IR text must start with 'graph NAME {' and end with '}'")
    graph = Graph(lines[0].split()[1])
    body = lines[1:-1]
    if not body or not body[-1].startswith("return "):
        raise IRError(f"graph {graph.name} has no 'return' line")
    graph.nodes = [parse_node(ln) for ln in body[:-1]]
    graph.outputs = tuple(parse_value(v) for v in _split_args(body[-1][len("return "):]))
    return graph
