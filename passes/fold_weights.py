"""Fold computations over weights alone into new weights (the last data-changing phase).

Matches: an op this pass can evaluate (FOLDABLE: concat) all of whose operands are weights (such
  as the `concat(%w.layers.0.q_proj.weight, %w.layers.0.k_proj.weight, ...)` that merge_qkv emits).
Produces: a `weight` node with a canonical name built from its operands' names
  (`layers.0.qkv_proj.weight`, `layers.0.gate_up_proj.weight`), whose tensor is computed once, at
  compile time, into `ctx.weights` (when the context carries weights); rows stacked from weights
  the file stores quantized (`ctx.quantized`) are stacked there too. The operands are left for
  dce, which also drops weights nobody reads any more.
Requires: nothing. Preserves: numerics exactly (the same op, evaluated earlier).
"""

from __future__ import annotations

import hashlib
import os

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph, Node
from llmc.compiler.quant_format import concat_rows

from .rewrite import PassContext, RewriteState, rewrite


def merged_name(names: list[str]) -> str:
    """`layers.0.q_proj.weight` + `...k_proj.weight` + `...v_proj.weight` -> `layers.0.qkv_proj.weight`."""
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind(".") + 1]                       # whole dotted components
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    suffix = suffix[suffix.find("_"):] if "_" in suffix else suffix[suffix.find("."):]
    middles = [n[len(prefix): len(n) - len(suffix)] for n in names]
    joiner = "" if all(len(m) == 1 for m in middles) else "_"
    return prefix + joiner.join(middles) + suffix


def folded_name(node: Node, operand_names: list[str]) -> str:
    """Canonical name of the weight that replaces `node`."""
    if node.op == "concat" and node.attrs["dim"] == 0 and len(set(operand_names)) == len(operand_names) > 1:
        return merged_name(operand_names)
    digest = hashlib.sha1(repr((node.op, operand_names, sorted(node.attrs.items()))).encode()).hexdigest()
    return f"{operand_names[0]}.{node.op}_{digest[:8]}"


# op -> its value over weight tensors, as the op means it
FOLDABLE = {"concat": lambda operands, attrs: torch.cat(operands, dim=attrs["dim"])}


def _evaluate(node: Node, operand_names: list[str], weights: dict) -> torch.Tensor:
    operands = [weights[n] for n in operand_names]
    return FOLDABLE[node.op](operands, node.attrs).to(to_torch(node.type.dtype)).contiguous()


def _merge_quantized(node: Node, name: str, operand_names: list[str], quantized: dict) -> None:
    """Rows stacked from weights the file stores quantized stay quantized too (same codes, same scales)."""
    if node.op == "concat" and node.attrs["dim"] == 0 and all(n in quantized for n in operand_names):
        merged = concat_rows([quantized[n] for n in operand_names])
        if merged is not None:
            quantized[name] = merged


def _make_rule(ctx: PassContext):
    def fold_weight_expression(node: Node, state: RewriteState):
        if node.op not in FOLDABLE:
            return None
        new_operands = [state.new_producer(state.get(v)) for v in node.inputs]
        if not new_operands or any(n.op != "weight" for n in new_operands):
            return None
        operand_names = [n.name[2:] for n in new_operands]
        name = folded_name(node, operand_names)
        if f"w.{name}" in state.new_nodes:  # the same expression, folded earlier in this graph
            return (state.new_nodes[f"w.{name}"].value(),)
        if ctx.weights is not None and name not in ctx.weights:
            ctx.weights[name] = _evaluate(node, operand_names, ctx.weights)
            _merge_quantized(node, name, operand_names, ctx.quantized)
        return (state.declare(f"w.{name}", "weight", node.type),)

    return fold_weight_expression


def fold_weights(graph: Graph, ctx: PassContext) -> Graph:
    """Evaluate weight-only nodes at compile time (see module docstring)."""
    return rewrite(graph, [_make_rule(ctx)], "fold_weights", ctx)
