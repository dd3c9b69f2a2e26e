"""Fuse the gated MLP's activation: act(gate) times the up projection, act SiLU (SwiGLU: Llama,
Qwen, Mistral) or GELU with the tanh approximation (GeGLU: Gemma).

Matches: `mul(act(gate), up)` (operands in either order) with act one of GATED's activations,
  where the activation's result has no other reader.
Produces: the activation's gated op (`silu_mul`, `gelu_tanh_mul`): `op(x)` when gate and up are
  the two equal halves of one `split(x)` (after merge_gate_up), else `op(gate, up)`. The
  activation (and the split) are left for dce. The pass keeps its first name, fuse_silu_mul.
Requires: canonicalize. Preserves: numerics exactly.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node, Value

from .rewrite import PassContext, RewriteState, rewrite

# activation -> the op computing activation(gate) * up (compiler/ops/elementwise.py)
GATED = {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}


def _halves_of_one_split(gate: Value, up: Value, state: RewriteState) -> Value | None:
    """The split's input when gate and up are its results #0 and #1 of equal width."""
    split = state.producer(gate)
    if (split.op != "split" or up.node != split.name or (gate.index, up.index) != (0, 1)
            or len(split.types) != 2 or split.types[0] != split.types[1]):
        return None
    return split.inputs[0]


def fuse_gated_activation(node: Node, state: RewriteState):
    if node.op != "mul":
        return None
    a, b = node.inputs
    if state.producer(a).op not in GATED and state.producer(b).op in GATED:
        a, b = b, a
    act = state.producer(a)
    if act.op not in GATED or state.num_users(a) != 1:
        return None  # no gated activation, or its result is needed elsewhere too
    gate, up = act.inputs[0], b
    packed = _halves_of_one_split(gate, up, state)
    inputs = [packed] if packed is not None else [gate, up]
    return (state.emit(GATED[act.op], [state.get(v) for v in inputs]).value(),)


RULES = [fuse_gated_activation]


def fuse_silu_mul(graph: Graph, ctx: PassContext) -> Graph:
    """act(gate) * up -> one gated op, silu_mul or gelu_tanh_mul (see module docstring)."""
    return rewrite(graph, RULES, "fuse_silu_mul", ctx)
