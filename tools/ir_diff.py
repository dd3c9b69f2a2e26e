"""`llmc debug diff A.ir B.ir`: a readable structural diff of two IR dumps.

Passes renumber op nodes, so two dumps differ in almost every `%N` even where the graph did
not change. Lines are therefore matched on a key in which each `%N` operand is replaced by the
op that produced it (`linear(%<rmsnorm>, %w.layers.0.q_proj.weight)`); inputs and weights keep
their names. difflib aligns the keys; the hunks show the original lines, and a summary gives
the change of every op's count.
"""

from __future__ import annotations

import difflib
import re

from llmc.compiler.ir import Graph, format_node, parse_graph

_OPERAND = re.compile(r"%(\d+)(#\d+)?")


def _keys(graph: Graph) -> list[str]:
    """One matching key per node line (see module docstring)."""
    producer = {n.name: n.op for n in graph.nodes}
    keys = []
    for node in graph.nodes:
        line = format_node(node)
        head, _, rest = line.partition(" = ")
        body = _OPERAND.sub(lambda m: f"%<{producer.get(m.group(1), '?')}>{m.group(2) or ''}", rest)
        keys.append(body if head[1:].isdigit() else f"{head} = {body}")
    return keys


def _op_count_changes(a: Graph, b: Graph) -> list[str]:
    ca, cb = a.op_counts(), b.op_counts()
    changes = []
    for op in sorted(set(ca) | set(cb)):
        before, after = ca.get(op, 0), cb.get(op, 0)
        if before != after:
            changes.append(f"{op} {before} -> {after} ({after - before:+d})")
    return changes


def _hunks(a: Graph, b: Graph, context: int) -> list[str]:
    la, lb = [format_node(n) for n in a.nodes], [format_node(n) for n in b.nodes]
    matcher = difflib.SequenceMatcher(None, _keys(a), _keys(b), autojunk=False)
    out = []
    for group in matcher.get_grouped_opcodes(context):
        first, last = group[0], group[-1]
        out.append(f"@@ a line {first[1] + 1}..{last[2]}, b line {first[3] + 1}..{last[4]} @@")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [f"  {line}" for line in lb[j1:j2]]
            else:
                out += _changed_lines(la[i1:i2], lb[j1:j2])
    return out


def _changed_lines(old: list[str], new: list[str]) -> list[str]:
    """A changed block; lines whose text is unchanged (only an operand's producer changed,
    which its own line shows) print as context."""
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            out += [f"  {line}" for line in new[j1:j2]]
            continue
        out += [f"- {line}" for line in old[i1:i2]]
        out += [f"+ {line}" for line in new[j1:j2]]
    return out


def diff_graphs(a: Graph, b: Graph, name_a: str = "a", name_b: str = "b", context: int = 1) -> str:
    """The diff as text: a header, op count changes, then hunks (empty hunks: 'no change')."""
    def size(g: Graph) -> str:
        return f"graph {g.name}: {sum(1 for n in g.nodes if n.op not in ('input', 'weight'))} ops, " \
               f"{len(g.weights())} weights"

    lines = [f"--- a: {name_a} ({size(a)})", f"+++ b: {name_b} ({size(b)})"]
    changes = _op_count_changes(a, b)
    lines.append("op counts: " + ("; ".join(changes) if changes else "unchanged"))
    if a.outputs != b.outputs:
        lines.append(f"returns: {', '.join(map(str, a.outputs))} -> {', '.join(map(str, b.outputs))}")
    hunks = _hunks(a, b, context)
    lines += hunks or ["no structural change"]
    return "\n".join(lines) + "\n"


def diff_ir_text(text_a: str, text_b: str, name_a: str = "a", name_b: str = "b", context: int = 1) -> str:
    """Parse two IR texts (IRError naming the bad line) and diff them."""
    return diff_graphs(parse_graph(text_a), parse_graph(text_b), name_a, name_b, context)
