"""Store the paged KV cache as int8 codes with one fp32 scale per token per KV head.

Matches: the `kv_cache` graph input, a float [L, 2, NB, KVH, BS, D].
Produces: `kv_cache` as i8 [L, 2, NB, KVH, BS, D + 4], each row D codes and its scale
  (compiler/quant_format.py); every op that reads or returns the cache is re-typed by its rule. The cache
  writers (rope_kv_write, kv_write) quantize each row as they store it and the paged attention
  ops dequantize rows as they read them, so nothing dequantizes the whole cache.
Requires: insert_paged_attention (the cache exists). Preserves: numerics within int8 rounding of
  K and V (a relative error of at most 1/254 of each row's largest magnitude).
Off unless `ctx.options["quant"]` is a QuantRecipe with kv_dtype "int8".
"""

from __future__ import annotations

from llmc.compiler.dtypes import FLOAT_DTYPES
from llmc.compiler.ir import Graph, Node, TensorType
from llmc.compiler.quant_format import KV_CODES_DTYPE, kv_row_width

from .rewrite import PassContext, RewriteState, rewrite


def int8_cache_type(cache: TensorType) -> TensorType:
    *outer, head_dim = cache.shape
    return TensorType(KV_CODES_DTYPE, (*outer, kv_row_width(head_dim, int8=True)))


def quantize_cache_input(node: Node, state: RewriteState):
    if node.op != "input" or node.name != "kv_cache" or node.type.dtype not in FLOAT_DTYPES:
        return None
    return (state.declare(node.name, "input", int8_cache_type(node.type)),)


def quantize_kv(graph: Graph, ctx: PassContext) -> Graph:
    """The KV cache input -> int8 rows with scales (see module docstring)."""
    recipe = ctx.options.get("quant")
    if recipe is None or recipe.kv_dtype != "int8":
        ctx.bump("quantize_kv", 0)
        return graph
    return rewrite(graph, [quantize_cache_input], "quantize_kv", ctx)
