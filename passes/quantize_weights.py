"""Quantize GEMM weights to int8 or int4, and (the recipe's `embeddings`, on by default) the token
embedding and LM head to int8.

Matches: `linear(x, %w.W[, b])` with a float weight W [N, K]; with the recipe's `embeddings`,
  also `embedding(%w.E, ids)` and the linear that reads E (a tied LM head) or `lm_head.weight`,
  which quantize as int8 per row whatever the recipe's width (`QuantRecipe.embedding_recipe`:
  int4 tables cost SmolLM2-135M 5.8% perplexity, int8 ones nothing where the file's Q8_0 is kept).
Produces: `qlinear(x, %w.W.codes, %w.W.scales[, %w.W.mins][, b], bits, group_size)` and
  `qembedding(...)` over new weights, computed once into `ctx.weights`: int8 symmetric per output
  channel, or int4 asymmetric per group of 32/64/128, round to nearest (compiler/quant_format.py). A
  weight the source file already stores in a format of the recipe's width (`ctx.quantized`: GGUF
  Q8_0 for int8, Q4_0/Q4_1 for int4; merged QKV and gate/up stacks of them too) keeps the file's
  codes and scales bit for bit (unless the recipe says requantize). `ctx.records["quantize_weights"]`
  says, per weight, which way it went.
Requires: fold_weights (so merged weights quantize as one). Preserves: numerics within the
  quantization step of each weight (not exactly: this is the pass that trades accuracy for bytes).
Off unless `ctx.options["quant"]` is a QuantRecipe with bits.
"""

from __future__ import annotations

from llmc.compiler.dtypes import FLOAT_DTYPES
from llmc.compiler.ir import Graph, Node, Value
from llmc.compiler.ops import operands_of
from llmc.compiler.quant_format import INT4_BLOCK, QuantizedWeight, quantize_int4, quantize_int8, weight_format
from llmc.compiler.quant_recipe import QuantRecipe

from .rewrite import PassContext, PassError, RewriteState, rewrite

EMBEDDING_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")


def _check_shape(name: str, k: int, recipe: QuantRecipe) -> None:
    if recipe.bits == 4 and k % INT4_BLOCK:
        raise PassError(f"--quant {recipe.weights} cannot take {name}: int4 needs input features in multiples of "
                        f"{INT4_BLOCK}, it has {k}; use --quant int8")
    group = recipe.group_size or k
    if k % group:
        fits = [f"int4-g{g}" for g in (32, 64, 128) if k % g == 0]
        raise PassError(f"--quant {recipe.weights}: its group of {group} does not divide the {k} input features of "
                        f"{name}; choose --quant {' or '.join(fits)}")


def _make(name: str, n: int, k: int, recipe: QuantRecipe, ctx: PassContext) -> QuantizedWeight | None:
    """The quantized weight `name` stands for: the file's blocks when they fit the recipe, else RTN."""
    kept = ctx.quantized.get(name)
    if kept is not None and kept.bits == recipe.bits and not recipe.requantize:
        ctx.records.setdefault("quantize_weights", {})[name] = f"kept {kept.source}"
        return kept
    _check_shape(name, k, recipe)
    how = f"requantized from {kept.source}" if kept is not None else "quantized"
    ctx.records.setdefault("quantize_weights", {})[name] = f"{how} to {recipe.weights}"
    if ctx.weights is None:
        return None
    if f"{name}.codes" in ctx.weights:         # the other entry graph of this compile rounded it already
        return _stored(name, k, ctx.weights)
    w = ctx.weights[name]
    if recipe.bits == 8:
        return QuantizedWeight(8, k, *quantize_int8(w), source=recipe.weights)
    return QuantizedWeight(4, recipe.group_size, *quantize_int4(w, recipe.group_size), source=recipe.weights)


def _stored(name: str, k: int, weights: dict) -> QuantizedWeight:
    """The quantized weight an earlier run of this pass put into `weights`."""
    codes, scales, mins = weights[f"{name}.codes"], weights[f"{name}.scales"], weights.get(f"{name}.mins")
    return QuantizedWeight(4 if mins is not None else 8, k // scales.shape[1], codes, scales, mins, "stored")


def _declare(name: str, n: int, k: int, recipe: QuantRecipe, state: RewriteState, ctx: PassContext,
             formats: dict[str, dict]) -> tuple[list[Value], dict]:
    """Weight nodes for codes, scales (and mins) of `name`, declared once per graph; the op's attrs."""
    if name not in formats:
        qw = _make(name, n, k, recipe, ctx)
        bits = qw.bits if qw is not None else recipe.bits
        group = qw.group_size if qw is not None else (recipe.group_size or k)
        parts = weight_format(bits).part_types(n, k, group)
        for part, ttype in parts.items():
            state.declare(f"w.{name}.{part}", "weight", ttype)
            if qw is not None and ctx.weights is not None:
                ctx.weights[f"{name}.{part}"] = getattr(qw, part).contiguous()
        formats[name] = {"bits": bits, "group_size": group, "parts": list(parts)}
    fmt = formats[name]
    values = [state.new_nodes[f"w.{name}.{p}"].value() for p in fmt["parts"]]
    return values, {"bits": fmt["bits"], "group_size": fmt["group_size"]}


def _float_weight(value: Value, state: RewriteState) -> tuple[str, int, int] | None:
    w = state.producer(value)
    if w.op != "weight" or w.type.dtype not in FLOAT_DTYPES or len(w.type.shape) != 2:
        return None
    n, k = w.type.shape
    return w.name[2:], n, k


def _embedding_weights(graph: Graph) -> set[str]:
    """Weights an `embedding` reads (the LM head reads the same one when embeddings are tied)."""
    nodes = graph.node_map()
    return {nodes[operands_of(n).table.node].name[2:] for n in graph.nodes if n.op == "embedding"}


def _make_rule(recipe: QuantRecipe, ctx: PassContext, embeddings: set[str]):
    formats: dict[str, dict] = {}      # weight name -> bits, group size, parts (this graph's declarations)

    def quantize_weight(node: Node, state: RewriteState):
        if node.op not in ("linear", "embedding"):
            return None
        x = operands_of(node)
        found = _float_weight(x.weight if node.op == "linear" else x.table, state)
        if found is None:
            return None
        name, n, k = found
        table = node.op == "embedding" or name in embeddings
        if table and not recipe.embeddings:
            return None
        weight, attrs = _declare(name, n, k, recipe.embedding_recipe if table else recipe, state, ctx, formats)
        if node.op == "embedding":
            return (state.emit("qembedding", [*weight, state.get(x.ids)],
                               dtype=node.type.dtype, **attrs).value(),)
        inputs = [state.get(x.x), *weight, *([state.get(x.bias)] if "bias" in x else [])]
        return (state.emit("qlinear", inputs, **attrs).value(),)

    return quantize_weight


def quantize_weights(graph: Graph, ctx: PassContext) -> Graph:
    """linear -> qlinear (and embedding -> qembedding) per the recipe (see module docstring)."""
    recipe = ctx.options.get("quant")
    if recipe is None or not recipe.bits:
        ctx.bump("quantize_weights", 0)
        return graph
    embeddings = _embedding_weights(graph) | set(EMBEDDING_WEIGHTS)
    return rewrite(graph, [_make_rule(recipe, ctx, embeddings)], "quantize_weights", ctx)
