"""The torch backend's op table with llmc's native CPU kernels (kernels/cpu/*.cpp) in place of
the torch refs for the ops that dominate a step: GEMMs (linear, qlinear), paged attention, RoPE +
KV write, RMSNorm and SiLU-and-multiply. Every entry checks, per call, that its kernel takes the
inputs (dtype, block size, head_dim) and runs the op's torch ref where it does not, so any
artifact runs.

The GEMMs take their weights as `prepare_weights` left them when the executor was built: a
linear's weight, or a qlinear's codes with their scales and mins, become a kernels/gemv.py
`GemvWeight` holding them in column panels, which replace them (one resident copy per weight). A
GEMM given a plain tensor runs its ref; a tied embedding reads its rows out of the panels.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph

from .activation import native_silu_mul_fits, silu_mul_cpu
from .attention import native_attention_fits, paged_attention_cpu, run_paged_decode_attention
from .gemv import GemvWeight, gemv_fits, gemv_ref, prepare_linear_weight, prepare_qlinear_weight, run_gemv
from .native import NativeBuildError, load_native_kernels
from .panels import from_panels, panel_rows, quantized_rows
from .quant import dequantize_weight
from .rmsnorm import add_rmsnorm_cpu, native_norm_fits, rmsnorm_cpu
from .rope import RopeTables
from .rope_kv_write import native_rope_kv_write_fits, run_rope_kv_write, unpack_inputs
from .torch_ops import OP_IMPLS, OpImpl


def native_op_impls() -> dict[str, OpImpl]:
    """A fresh op table (its RoPE tables are its own); load_native_kernels() must have run."""
    rope_tables: dict[tuple, RopeTables] = {}

    def linear(x, a):
        weight, bias = x[1], (x[2] if len(x) > 2 else None)
        if type(weight) is GemvWeight and gemv_fits(x[0], weight, bias):
            return run_gemv(x[0], weight, bias)
        return F.linear(x[0], _plain(weight), bias)

    def qlinear(x, a):
        codes = x[1]
        if type(codes) is GemvWeight:          # x, codes, scales[, mins][, bias]: the bias comes after the mins;
            bias = x[-1] if len(x) > (4 if codes.bits == 4 else 3) else None   # scales and mins are in `codes`
            return run_gemv(x[0], codes, bias) if gemv_fits(x[0], codes, bias) else gemv_ref(x[0], codes, bias)
        return OP_IMPLS["qlinear"](x, a)

    def tables_for(a: dict) -> RopeTables:
        key = RopeTables.key(a)
        if key not in rope_tables:
            rope_tables[key] = RopeTables.for_attrs(a)
        return rope_tables[key]

    def rope_kv_write(x, a):
        q, k, v, positions, cache, slots = unpack_inputs(x, a["num_heads"], a["num_kv_heads"], a["head_dim"])
        if not native_rope_kv_write_fits(cache, q.dtype, a["head_dim"]):
            return OP_IMPLS["rope_kv_write"](x, a)
        return run_rope_kv_write(q, k, v, positions, cache, slots, a["layer"], tables_for(a))

    def paged_attention(x, a):
        if not native_attention_fits(x[0], x[1]):
            return OP_IMPLS["paged_attention"](x, a)
        return paged_attention_cpu(*x, a["layer"], a["scale"])

    def paged_decode_attention(x, a):
        if not native_attention_fits(x[0], x[1]):
            return OP_IMPLS["paged_decode_attention"](x, a)
        return run_paged_decode_attention(*x, a["layer"], a["scale"])

    def add_rmsnorm(x, a):
        fits = native_norm_fits(x[0]) and x[0].dtype == x[1].dtype == x[2].dtype
        return add_rmsnorm_cpu(*x, a["eps"]) if fits else OP_IMPLS["add_rmsnorm"](x, a)

    def rmsnorm(x, a):
        fits = native_norm_fits(x[0]) and x[0].dtype == x[1].dtype
        return rmsnorm_cpu(*x, a["eps"]) if fits else OP_IMPLS["rmsnorm"](x, a)

    def silu_mul(x, a):
        return silu_mul_cpu(*x) if native_silu_mul_fits(*x) else OP_IMPLS["silu_mul"](x, a)

    return {**OP_IMPLS, "linear": linear, "qlinear": qlinear, "embedding": embedding_rows,
            "qembedding": qembedding_rows,
            "rope_kv_write": rope_kv_write, "paged_attention": paged_attention,
            "paged_decode_attention": paged_decode_attention, "add_rmsnorm": add_rmsnorm, "rmsnorm": rmsnorm,
            "silu_mul": silu_mul}


def _plain(t: Any) -> torch.Tensor:
    """A float weight unpacked from its panels (for a ref; transient), or a plain tensor as it is."""
    return from_panels(t.weight, t.rows) if isinstance(t, GemvWeight) else t


def embedding_rows(x: list, a: dict) -> torch.Tensor:
    """The embedding op: rows `ids` of a plain table, or of a tied float table kept as panels."""
    table, ids = x
    return panel_rows(table.weight, ids) if isinstance(table, GemvWeight) else F.embedding(ids, table)


def qembedding_rows(x: list, a: dict) -> torch.Tensor:
    """The qembedding op; a tied table kept as panels gives its rows (codes, scales, mins) back in
    the artifact's layout, dequantized as qembedding_ref does."""
    codes = x[0]
    if not isinstance(codes, GemvWeight):
        return OP_IMPLS["qembedding"](x, a)
    rows = quantized_rows(codes.weight, codes.scales, codes.mins, x[-1].long(), codes.bits)
    return dequantize_weight(*rows, codes.bits).to(to_torch(a["dtype"]))      # qembedding_ref's fp32 rounding


# (op, input position) of the reads a prepared weight serves: the GEMM's weight, and the table
# lookups of a tied embedding, which unwrap it
GEMM_WEIGHT_READS = {"linear": {("linear", 1), ("embedding", 0)}, "qlinear": {("qlinear", 1), ("qembedding", 0)}}
# the reads of a quantized weight's scales and mins, which its prepared weight serves too
PARAM_READS = {"scales": {("qlinear", 2), ("qembedding", 1)}, "mins": {("qlinear", 3), ("qembedding", 2)}}


def _weight_reads(graphs: Iterable[Graph]) -> dict[str, set[tuple[str, int]]]:
    """Weight name -> every (op, input position) that reads it."""
    reads: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for graph in graphs:
        for node in graph.nodes:
            for i, v in enumerate(node.inputs):
                if v.node.startswith("w."):
                    reads[v.node[2:]].add((node.op, i))
    return reads


def _gemm_weights(graphs: Iterable[Graph], reads: dict[str, set[tuple[str, int]]]) -> dict[str, tuple | None]:
    """Weight name -> (op, names of its weight operands, bits, group size) for every weight a GEMM
    multiplies by; None where it cannot be prepared: two different GEMMs over it, or another op
    (other than a tied embedding's lookup) reading it."""
    uses: dict[str, set[tuple]] = defaultdict(set)
    for node in (n for g in graphs for n in g.nodes if n.op in GEMM_WEIGHT_READS):
        if node.inputs[1].node.startswith("w."):
            operands = tuple(v.node[2:] if v.node.startswith("w.") else None for v in node.inputs[1:])
            uses[node.inputs[1].node[2:]].add((node.op, operands, node.attrs.get("bits"), node.attrs.get("group_size")))
    return {name: next(iter(u)) if len(u) == 1 and reads[name] <= GEMM_WEIGHT_READS[next(iter(u))[0]] else None
            for name, u in uses.items()}


def prepare_weights(graphs: Iterable[Graph], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`weights` as the native table's GEMMs take them, decided once for all of an executor's graphs.

    The weight each `linear` multiplies by, and each `qlinear`'s codes with their scales (and
    mins), become a GemvWeight holding them in column panels: new tensors in their place (the
    caller keeps the result, not `weights`, so one copy stays resident). Where only quantized GEMMs
    and the tied table's lookup read the scales and mins, their entries become that GemvWeight too
    (those ops read them from it). A weight that another op reads too, or one the kernels do not
    take, stays a plain tensor (its GEMM runs the ref). The reference table takes plain tensors only.
    """
    graphs = list(graphs)
    reads, prepared = _weight_reads(graphs), dict(weights)
    for name, use in _gemm_weights(graphs, reads).items():
        if use is None:
            continue
        op, operands, bits, group = use
        params = {"scales": operands[1], "mins": operands[2] if bits == 4 else None} if op == "qlinear" else {}
        if op == "linear":
            gemv_weight = prepare_linear_weight(weights[name])
        elif params["scales"] is None or (bits == 4 and params["mins"] is None):
            continue                       # scales or mins computed, not stored: not a layout to prepare
        else:
            gemv_weight = prepare_qlinear_weight(weights[name], weights[params["scales"]],
                                                 weights[params["mins"]] if bits == 4 else None,
                                                 bits=bits, group_size=group)
        if gemv_weight is None:
            continue
        prepared[name] = gemv_weight
        for kind, param in params.items():
            if param is not None and reads[param] <= PARAM_READS[kind]:
                prepared[param] = gemv_weight
    return prepared


KERNEL_CHOICES = ("auto", "native", "reference")


def choose_op_impls(kernels: str) -> tuple[dict[str, OpImpl], str]:
    """The op table for a kernel choice, and what it resolved to ('native' or 'reference').

    'reference' runs the torch refs; 'native' builds the C++ kernels or fails with
    NativeBuildError; 'auto' builds them and, where that fails, logs one warning and runs the refs.
    """
    if kernels == "reference":
        return dict(OP_IMPLS), "reference"
    try:
        load_native_kernels()
    except NativeBuildError as err:
        if kernels == "native":
            raise
        logging.getLogger("llmc").warning("%s; running the torch reference kernels instead", err)
        return dict(OP_IMPLS), "reference"
    return native_op_impls(), "native"
