"""Export an IR graph for graph viewers: Graphviz DOT text, or an ONNX model that Netron opens.

DOT: one box per op (op, attributes, result types), ellipses for inputs, notes for weights,
and a dashed cluster per fusion group (`group=N`) whose ops are filled with that group's colour
(one kernel, one colour; an op with no group is its own kernel and stays white).

ONNX: every op becomes a node of the custom domain `llmc` (its attributes carried over:
ints, floats, strings and their lists as such, anything else as its Python text); values keep
their IR names (`%7`, `%7#1`). Graph inputs and weights are typed graph inputs (symbolic dims
as dim_param, so `T` and `S+1` show as such); weights carry no data, which keeps the file small
and the viewer fast. Every intermediate value has a value_info with its type: the ONNX type of
its IR element type (compiler/dtypes.py); packed int4 codes (u4x2) are UINT8 bytes, two codes
each, and say so in their doc_string. The model passes `onnx.checker.check_model`; it is for
looking at, not for running in an ONNX runtime.
"""

from __future__ import annotations

from typing import Any

from llmc.compiler.dtypes import dtype_info
from llmc.compiler.ir import Graph, Node, TensorType

ONNX_DOMAIN = "llmc"
GROUP_COLOURS = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#fccde5")


# ---------------------------------------------------------------------------------- DOT


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_label(node: Node) -> str:
    lines = [f"%{node.name} = {node.op}"]
    lines += [f"{k}={v!r}"[:48] for k, v in node.attrs.items() if k != "group"]
    lines.append(", ".join(str(t) for t in node.types))
    return "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in lines)


def _dot_node(node: Node) -> str:
    if node.op == "input":
        return f'  {_quote(node.name)} [shape=ellipse, label="%{node.name}\\n{node.type}"];'
    if node.op == "weight":
        return (f'  {_quote(node.name)} [shape=note, style=filled, fillcolor="#eeeeee", '
                f'label="%{node.name}\\n{node.type}"];')
    fill = ""
    if "group" in node.attrs:
        fill = f', style=filled, fillcolor="{GROUP_COLOURS[node.attrs["group"] % len(GROUP_COLOURS)]}"'
    return f'  {_quote(node.name)} [label="{_dot_label(node)}"{fill}];'


def to_dot(graph: Graph) -> str:
    """Graphviz DOT text of the graph (render with `dot -Tsvg`)."""
    lines = [f"digraph {_quote(graph.name)} {{", '  node [shape=box, fontname="monospace", fontsize=10];']
    groups: dict[int, list[str]] = {}
    for node in graph.nodes:
        lines.append(_dot_node(node))
        if "group" in node.attrs:
            groups.setdefault(node.attrs["group"], []).append(node.name)
    for number, members in groups.items():
        lines.append(f'  subgraph "cluster_group_{number}" {{ label="group {number}"; style=dashed; '
                     + " ".join(f"{_quote(m)};" for m in members) + " }")
    for node in graph.nodes:
        for v in node.inputs:
            label = f' [label="#{v.index}"]' if v.index else ""
            lines.append(f"  {_quote(v.node)} -> {_quote(node.name)}{label};")
    lines.append('  "return" [shape=doublecircle, label="return"];')
    lines += [f'  {_quote(v.node)} -> "return";' for v in graph.outputs]
    lines.append("}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- ONNX


def _value_info(name: str, ttype: TensorType):
    from onnx import TensorProto, helper

    dtype = dtype_info(ttype.dtype)
    return helper.make_tensor_value_info(name, getattr(TensorProto, dtype.onnx),
                                         [d if isinstance(d, int) else str(d) for d in ttype.shape],
                                         doc_string=f"llmc {dtype.name}: {dtype.note}" if dtype.note else "")


def _onnx_attr(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, list) and value and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                 for x in value):
        return value
    return repr(value)


def to_onnx(graph: Graph):
    """An onnx.ModelProto of the graph, custom-domain ops (see module docstring)."""
    from onnx import helper

    ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
    nodes = [helper.make_node(n.op, [str(v) for v in n.inputs], [str(n.value(i)) for i in range(len(n.types))],
                              name=f"%{n.name}", domain=ONNX_DOMAIN,
                              **{k: _onnx_attr(v) for k, v in n.attrs.items()}) for n in ops]
    inputs = [_value_info(str(n.value()), n.type) for n in graph.nodes if n.op in ("input", "weight")]
    outputs = [_value_info(str(v), graph.type_of(v)) for v in graph.outputs]
    returned = set(map(str, graph.outputs))
    infos = [_value_info(str(n.value(i)), t) for n in ops for i, t in enumerate(n.types)
             if str(n.value(i)) not in returned]
    onnx_graph = helper.make_graph(nodes, graph.name, inputs, outputs, value_info=infos)
    return helper.make_model(onnx_graph, producer_name="llmc", opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(ONNX_DOMAIN, 1)])
