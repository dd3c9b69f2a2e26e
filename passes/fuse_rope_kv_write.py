"""Fuse the rotary embedding of Q and K with writing K and V into the paged KV cache.

Matches: `kv_write(cache, rope(k, pos), v, slots)` whose roped k has no other reader, and the
  paged attention of the same layer reading that cache, whose query is `rope(q, pos)` with the
  same positions and rope attributes; q must be computed before the kv_write.
Produces: `rope_kv_write(q, k, v, pos, cache, slots) -> (roped q, cache)`, or with a packed
  `rope_kv_write(qkv, pos, cache, slots)` when q, k, v are the three results of one `split(qkv)`
  (after merge_qkv). Readers of the roped q and of the cache read its results; the ropes (and
  the split) are left for dce. Where q and k are each normed before their rope by a
  `head_rmsnorm` (Qwen3, Gemma 3) or an `rmsnorm` over the row (OLMo-2) of one kind, eps and
  rounding, whose result only that rope reads, the norms are absorbed too: attrs
  qk_norm="head"|"all", norm_eps and (where the norms have one) norm_rounding, operands q_norm and
  k_norm (their weights); q and k are then the norms' inputs. A
  partial rotary's rotary_dim (both ropes alike) is carried over.
Requires: insert_paged_attention. Preserves: numerics exactly.
"""

from __future__ import annotations

from llmc.compiler.ir import Graph, Node, Value
from llmc.compiler.ops import operands_of

from .rewrite import PassContext, RewriteState, rewrite

PAGED = ("paged_attention", "paged_decode_attention")
ROPE_ATTRS = ("head_dim", "theta", "scaling", "rotary_dim")     # rotary_dim optional (partial rotary)
QK_NORMS = {"head_rmsnorm": "head", "rmsnorm": "all"}


def _qk_norms(q_rope: Node, k_rope: Node, state: RewriteState) -> tuple[Value, Value, dict, list] | None:
    """(q, k before any norms, the norm attrs, the norm weights) of the ropes' inputs; None where
    only one is normed, the two norms differ, or a normed value has another reader."""
    q, k = q_rope.inputs[0], k_rope.inputs[0]
    q_norm, k_norm = state.producer(q), state.producer(k)
    if q_norm.op not in QK_NORMS and k_norm.op not in QK_NORMS:
        return q, k, {}, []
    if q_norm.op != k_norm.op or any(q_norm.attrs.get(a) != k_norm.attrs.get(a) for a in ("eps", "rounding")):
        return None
    head_dims = {q_norm.attrs.get("head_dim"), k_norm.attrs.get("head_dim")}
    if q_norm.op == "head_rmsnorm" and head_dims != {q_rope.attrs["head_dim"]}:
        return None
    if state.num_users(q) != 1 or state.num_users(k) != 1:
        return None
    qx, kx = operands_of(q_norm), operands_of(k_norm)
    attrs = {"qk_norm": QK_NORMS[q_norm.op], "norm_eps": q_norm.attrs["eps"]}
    if "rounding" in q_norm.attrs:                      # optional, absent = "normed" (compiler/ops/norms.py)
        attrs["norm_rounding"] = q_norm.attrs["rounding"]
    return qx.x, kx.x, attrs, [qx.weight, kx.weight]


def _query_rope(kv_write: Node, k_rope: Node, state: RewriteState) -> tuple[Node, Node] | None:
    """(paged attention, rope of its query) of the kv_write's layer, if they match k's rope."""
    readers = [u for u in state.users(kv_write.value()) if u.op in PAGED
               and u.attrs["layer"] == kv_write.attrs["layer"]]
    if len(readers) != 1:
        return None
    q_rope = state.producer(readers[0].inputs[0])
    if q_rope.op != "rope" or q_rope.inputs[1] != k_rope.inputs[1]:
        return None
    if any(q_rope.attrs.get(a) != k_rope.attrs.get(a) for a in ROPE_ATTRS) or not state.has(q_rope.inputs[0]):
        return None
    return readers[0], q_rope


def _packed_qkv(q: Value, k: Value, v: Value, state: RewriteState) -> Value | None:
    """The split's input when q, k, v are its results #0, #1, #2."""
    split = state.producer(q)
    same = all(x.node == split.name for x in (k, v)) and (q.index, k.index, v.index) == (0, 1, 2)
    return split.inputs[0] if split.op == "split" and len(split.types) == 3 and same else None


def fuse_rope_into_kv_write(node: Node, state: RewriteState):
    if node.op != "kv_write":
        return None
    x = operands_of(node)
    cache, k, v, slots = x.kv_cache, x.k, x.v, x.slot_mapping
    k_rope = state.producer(k)
    if k_rope.op != "rope" or state.num_users(k) != 1:
        return None  # no rope, or the roped k is read elsewhere too
    found = _query_rope(node, k_rope, state)
    if found is None:
        return None
    attention, q_rope = found
    norms = _qk_norms(q_rope, k_rope, state)
    if norms is None or not all(state.has(w) for w in norms[3]):
        return None
    q, k_in, norm_attrs, norm_weights = norms
    positions = k_rope.inputs[1]
    packed = _packed_qkv(q, k_in, v, state)
    tensors = [packed] if packed is not None else [q, k_in, v]
    rope_attrs = {a: k_rope.attrs[a] for a in ROPE_ATTRS if a in k_rope.attrs}
    attrs = {"layer": node.attrs["layer"], "num_heads": attention.attrs["num_heads"],
             "num_kv_heads": node.attrs["num_kv_heads"], **rope_attrs, **norm_attrs}
    inputs = (*tensors, positions, cache, slots, *norm_weights)
    fused = state.emit("rope_kv_write", [state.get(x) for x in inputs], **attrs)
    state.replace(q_rope.value(), fused.value(0))
    return (fused.value(1),)


RULES = [fuse_rope_into_kv_write]


def fuse_rope_kv_write(graph: Graph, ctx: PassContext) -> Graph:
    """RoPE of Q and K + the KV-cache write -> one op (see module docstring)."""
    return rewrite(graph, RULES, "fuse_rope_kv_write", ctx)
