"""The step plan's lowerings of the GEMMs and the table gathers (runtime/step_plan.py's LOWERINGS
holds them beside the other template ops'): `linear` over float panels, `qlinear` over quantized
panels or quads (kernels/panels.py; the codes' scales and mins inside them), `embedding` from a
table of rows or a tied float table kept as the LM head's panels, `qembedding` from the artifact's
int8 / int4 rows or a tied table kept as quantized panels or quads. Each takes the plan's
`_Lowering` (`lo`) and a node, and returns its encoded instruction, or raises `NotPlannable`
naming the node and what the plan does not take.
"""

from __future__ import annotations

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Node
from llmc.compiler.ops import operands_of
from llmc.kernels.gemv import PROMPT_CODES, GemvWeight
from llmc.kernels.panels import PANEL
from llmc.kernels.step_plan_isa import Encoded, encode


class NotPlannable(ValueError):
    """A graph the step plan cannot run; the message names the node and why."""


def _lower_embedding(lo, node: Node) -> Encoded:
    x = operands_of(node)
    ids, w = x.ids, lo.weight(x.table)
    if isinstance(w, GemvWeight) and w.format in ("f32", "bf16") and w.weight.dtype == lo.dtype:
        layout, table_id, (vocab, width) = 1, lo.panels(w)[0], (w.rows, w.in_features)
    elif isinstance(w, torch.Tensor) and w.dtype == lo.dtype and w.dim() == 2:
        layout, table_id, (vocab, width) = 0, lo.constant(w.contiguous()), w.shape
    else:
        raise NotPlannable(f"{node.name} (embedding) reads a table the plan does not take")
    return encode("embedding", out=lo.result(node), table=table_id, ids=lo.graph_input(ids, node), layout=layout,
                  vocab=vocab, width=width)


def _lower_qembedding(lo, node: Node) -> Encoded:
    x = operands_of(node)
    codes, scales, mins = lo.weight(x.codes), lo.weight(x.scales), lo.weight(x.mins) if "mins" in x else None
    bits, group = node.attrs["bits"], node.attrs["group_size"]
    vocab, width = lo.graph.type_of(x.codes).shape[0], node.type.shape[1]            # [V, ...] codes, [T, W] rows
    if to_torch(node.attrs["dtype"]) != lo.dtype:
        raise NotPlannable(f"{node.name} (qembedding) gives {node.attrs['dtype']} rows in a {lo.dtype} plan")
    # a tied table kept as the LM head's panels or quads (kernels/panels.py), told apart by their shape
    layouts = {(width * bits // 8, PANEL): 1, (width * bits // 32, PANEL, 4): 2}
    if isinstance(codes, GemvWeight) and codes.bits == bits and codes.weight.shape[1:] in layouts:
        layout, (codes_id, scales_id, mins_id) = layouts[codes.weight.shape[1:]], lo.panels(codes)
    elif all(isinstance(t, torch.Tensor) for t in (codes, scales, *([mins] if "mins" in x else []))):
        layout, codes_id, scales_id = 0, lo.constant(codes.contiguous()), lo.constant(scales.contiguous())
        mins_id = lo.constant(mins.contiguous()) if "mins" in x else -1
    else:
        raise NotPlannable(f"{node.name} (qembedding) reads a table the plan does not take")
    return encode("qembedding", out=lo.result(node), codes=codes_id, scales=scales_id, mins=mins_id,
                  ids=lo.graph_input(x.ids, node), layout=layout, vocab=vocab, width=width, bits=bits, group=group)


def linear_args(lo, node: Node) -> dict:
    """The args of instruction `linear` for `node` (and of `linear_epilogue` before its epilogue's)."""
    named = operands_of(node)
    x, bias = named.x, named.get("bias")
    w, b = lo.weight(named.weight), lo.weight(bias) if bias else None
    if not (isinstance(w, GemvWeight) and not w.bits and w.weight.dtype == lo.dtype):
        raise NotPlannable(f"{node.name} (linear) multiplies by a weight not prepared as {lo.dtype} panels")
    if bias and not (isinstance(b, torch.Tensor) and b.dtype == lo.dtype and b.shape == (w.out_features,)):
        raise NotPlannable(f"{node.name} (linear) has a bias that is not a {lo.dtype} weight [{w.out_features}]")
    if lo.width(x, node) != w.in_features:
        raise NotPlannable(f"{node.name} (linear) multiplies {lo.width(x, node)} inputs by a weight of {w.in_features}")
    bias_id = lo.constant(b.contiguous()) if bias else -1
    return dict(out=lo.result(node), x=lo.activation(x, node), panels=lo.panels(w)[0], bias=bias_id,
                k=w.in_features, n=w.out_features, num_panels=w.weight.shape[0])


def _lower_linear(lo, node: Node) -> Encoded:
    return encode("linear", **linear_args(lo, node), picks=lo.picks_for(node))


def qlinear_args(lo, node: Node) -> dict:
    """The args of instruction `qlinear` for `node` but its picks (and of `qlinear_epilogue` before its
    epilogue's)."""
    named = operands_of(node)
    x, bias, w = named.x, named.get("bias"), lo.weight(named.codes)   # its scales and mins are in the panels
    if not (isinstance(w, GemvWeight) and w.bits):
        raise NotPlannable(f"{node.name} (qlinear) multiplies by codes not prepared as quantized panels")
    b = lo.weight(bias) if bias else None
    if bias and not (isinstance(b, torch.Tensor) and b.dtype == lo.dtype and b.shape == (w.out_features,)):
        raise NotPlannable(f"{node.name} (qlinear) has a bias that is not a {lo.dtype} weight [{w.out_features}]")
    if lo.width(x, node) != w.in_features:
        raise NotPlannable(f"{node.name} (qlinear) multiplies {lo.width(x, node)} inputs by codes of {w.in_features}")
    out, x_id = lo.result(node), lo.activation(x, node)
    codes_id, scales, mins = lo.panels(w)
    return dict(out=out, x=x_id, codes=codes_id, scales=scales, mins=mins,
                bias=lo.constant(b.contiguous()) if bias else -1, k=w.in_features, n=w.out_features,
                num_panels=w.weight.shape[0], bits=w.bits, group=w.group_size,
                layout=int(w.layout == "quads"), prompts=PROMPT_CODES[w.prompts])


def _lower_qlinear(lo, node: Node) -> Encoded:
    return encode("qlinear", **qlinear_args(lo, node), picks=lo.picks_for(node))


GEMM_LOWERINGS = {"embedding": _lower_embedding, "qembedding": _lower_qembedding, "linear": _lower_linear,
                  "qlinear": _lower_qlinear}
