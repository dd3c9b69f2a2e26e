"""Replace the traced, cache-less attention with paged-KV-cache attention.

Matches: every `attention(q, k, v, query_start_loc)` node; the i-th one (in graph order) is
  layer i, or, where ctx.options["kv_layers"] lists them (the draft graph: passes/skip_layers.py),
  layer kv_layers[i] of a cache with ctx.options["kv_cache_layers"] layers (the target's), so a
  graph without some layers still writes and reads each kept layer's own part of the cache.
Produces: `kv_write(cache, k, v, slot_mapping, layer=i)`, which stores this step's K/V into
  the paged block pool and returns the cache (threaded from layer to layer so the order of
  writes and reads is explicit), then, reading that cache through block tables,
  `paged_attention(q, cache, block_tables, seq_lens, query_start_loc)` in the prefill graph or
  `paged_decode_attention(q, cache, block_tables, seq_lens)` in the decode graph, with the
  attention's attrs (window and softcap too, where it has them).
  New graph inputs: kv_cache [L, 2, NB, KVH, BS, D] (dtype of q), slot_mapping i64[tokens],
  block_tables i32[S, MB], seq_lens i32[S].
Requires: canonicalize. Preserves: numerics of a step whose sequences start with an empty cache
  (then the cached context is exactly the chunk itself); with a filled cache the graph now
  computes what the model computes on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.ir import Graph, Node, TensorType, Value
from llmc.compiler.ops.attention import ATTN_OPTIONS

from .rewrite import PassContext, RewriteState, rewrite

ATTN_ATTRS = ("num_heads", "num_kv_heads", "head_dim", "scale")


@dataclass
class _CacheThread:
    """Per-invocation state: the metadata inputs and the cache value the next layer reads."""

    layers: int
    kv_layers: tuple[int, ...]      # the cache layer of the i-th attention
    next_layer: int = 0
    cache: Value | None = None
    slot_mapping: Value | None = None
    block_tables: Value | None = None
    seq_lens: Value | None = None

    def declare_inputs(self, state: RewriteState, q_type: TensorType, attrs: dict) -> None:
        cache_shape = (self.layers, 2, "NB", attrs["num_kv_heads"], "BS", attrs["head_dim"])
        self.cache = state.declare("kv_cache", "input", TensorType(q_type.dtype, cache_shape))
        self.slot_mapping = state.declare("slot_mapping", "input", TensorType("i64", (q_type.shape[0],)))
        self.block_tables = state.declare("block_tables", "input", TensorType("i32", ("S", "MB")))
        self.seq_lens = state.declare("seq_lens", "input", TensorType("i32", ("S",)))


def _make_rule(thread: _CacheThread):
    def paged_attention(node: Node, state: RewriteState):
        if node.op != "attention":
            return None
        q, k, v, qsl = (state.get(x) for x in node.inputs)
        attrs = {a: node.attrs[a] for a in ATTN_ATTRS}
        options = {a: node.attrs[a] for a in ATTN_OPTIONS if a in node.attrs}     # optional: as given
        if thread.cache is None:
            thread.declare_inputs(state, state.types[q], attrs)
        layer, thread.next_layer = thread.kv_layers[thread.next_layer], thread.next_layer + 1
        thread.cache = state.emit("kv_write", [thread.cache, k, v, thread.slot_mapping], layer=layer,
                                  num_kv_heads=attrs["num_kv_heads"], head_dim=attrs["head_dim"]).value()
        context = [thread.cache, thread.block_tables, thread.seq_lens]
        if state.new.name == "decode":
            out = state.emit("paged_decode_attention", [q, *context], layer=layer, **attrs, **options)
        else:
            out = state.emit("paged_attention", [q, *context, qsl], layer=layer, **attrs, **options)
        return (out.value(),)

    return paged_attention


def insert_paged_attention(graph: Graph, ctx: PassContext) -> Graph:
    """Route every attention through the paged KV cache (see module docstring)."""
    count = graph.op_counts().get("attention", 0)
    kv_layers = tuple(ctx.options.get("kv_layers", range(count)))
    assert len(kv_layers) == count, f"kv_layers {kv_layers} name {len(kv_layers)} layers, the graph has {count}"
    thread = _CacheThread(layers=ctx.options.get("kv_cache_layers", count), kv_layers=kv_layers)
    return rewrite(graph, [_make_rule(thread)], "insert_paged_attention", ctx)
