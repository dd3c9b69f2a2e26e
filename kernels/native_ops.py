"""The torch backend's op table with llmc's native CPU kernels (kernels/cpu/*.cpp) in place of
the torch refs for the template ops that dominate a step: GEMMs (linear, qlinear), paged
attention, RoPE + KV write and the embedding gathers. Every entry checks, per call, that its
kernel takes the inputs (dtype, block size, head_dim) and runs the op's torch ref where it does
not, so any artifact runs. The elementwise and row-wise ops (RMSNorm, SiLU-and-multiply, ...) are
not here: they run as the artifact's generated C++ (runtime/cpu_program.py), or their refs.

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
from llmc.compiler.ops import OPS, Operands, operands_of
from llmc.compiler.ops.attention import attention_options
from llmc.compiler.ops.rope import norm_rounding, qkv_columns

from .amx import describe_qgemm_path
from .attention import native_attention_fits, paged_attention_cpu, run_paged_decode_attention
from .gemv import (F32_PROMPT_MIN_TOKENS, PROMPT_MIN_TOKENS, GemvWeight, gemv_fits, gemv_ref, int8_activations_fit,
                   prepare_linear_weight, prepare_qlinear_weight, quantized_weight_rows, run_gemv)
from .native import NativeBuildError, load_native_kernels
from .panels import from_panels, panel_rows
from .quant import dequantize_weight
from .rope import RopeTables
from .rope_kv_write import native_rope_kv_write_fits, run_rope_kv_write
from .torch_ops import OpImpl


def native_op_impls() -> dict[str, OpImpl]:
    """The native kernels by op, each taking a node's inputs by name (kernels/torch_ops.py); ops
    not here run their reference. A fresh table (its RoPE tables are its own); load_native_kernels()
    must have run."""
    rope_tables: dict[tuple, RopeTables] = {}

    def linear(x, a):
        weight, bias = x.weight, x.get("bias")
        if type(weight) is GemvWeight and gemv_fits(x.x, weight, bias):
            return run_gemv(x.x, weight, bias)
        return F.linear(x.x, _plain(weight), bias)

    def qlinear(x, a):
        if type(x.codes) is GemvWeight:          # its scales and mins are in the prepared codes
            bias = x.get("bias")
            return run_gemv(x.x, x.codes, bias) if gemv_fits(x.x, x.codes, bias) else gemv_ref(x.x, x.codes, bias)
        return OPS["qlinear"].reference(x, a)

    def tables_for(a: dict) -> RopeTables:
        key = RopeTables.key(a)
        if key not in rope_tables:
            rope_tables[key] = RopeTables.for_attrs(a)
        return rope_tables[key]

    def rope_kv_write(x, a):
        q, k, v = qkv_columns(x, a)
        if not native_rope_kv_write_fits(x.kv_cache, q.dtype, a["head_dim"], a.get("rotary_dim")):
            return OPS["rope_kv_write"].reference(x, a)
        norm = ({"qk_norm": a["qk_norm"], "norm_eps": a["norm_eps"], "norm_rounding": norm_rounding(a)}
                if a.get("qk_norm") else {})
        return run_rope_kv_write(q, k, v, x.positions, x.kv_cache, x.slot_mapping, a["layer"], tables_for(a),
                                 x.get("q_norm"), x.get("k_norm"), **norm)

    def paged_attention(x, a):
        if not native_attention_fits(x.q, x.kv_cache):
            return OPS["paged_attention"].reference(x, a)
        return paged_attention_cpu(x.q, x.kv_cache, x.block_tables, x.seq_lens, x.query_start_loc, a["layer"],
                                   a["scale"], **attention_options(a))

    def paged_decode_attention(x, a):
        if not native_attention_fits(x.q, x.kv_cache):
            return OPS["paged_decode_attention"].reference(x, a)
        return run_paged_decode_attention(x.q, x.kv_cache, x.block_tables, x.seq_lens, a["layer"], a["scale"],
                                          **attention_options(a))

    return {"linear": linear, "qlinear": qlinear, "embedding": embedding_rows, "qembedding": qembedding_rows,
            "rope_kv_write": rope_kv_write, "paged_attention": paged_attention,
            "paged_decode_attention": paged_decode_attention}


def _plain(t: Any) -> torch.Tensor:
    """A float weight unpacked from its panels (for a ref; transient), or a plain tensor as it is."""
    return from_panels(t.weight, t.rows) if isinstance(t, GemvWeight) else t


def embedding_rows(x: Operands, a: dict) -> torch.Tensor:
    """The embedding op: rows `ids` of a plain table, or of a tied float table kept as panels."""
    return panel_rows(x.table.weight, x.ids) if isinstance(x.table, GemvWeight) else F.embedding(x.ids, x.table)


def qembedding_rows(x: Operands, a: dict) -> torch.Tensor:
    """The qembedding op; a tied table kept as panels gives its rows (codes, scales, mins) back in
    the artifact's layout, dequantized as qembedding_ref does."""
    codes = x.codes
    if not isinstance(codes, GemvWeight):
        return OPS["qembedding"].reference(x, a)
    rows = quantized_weight_rows(codes, x.ids.long())
    return dequantize_weight(*rows, codes.bits).to(to_torch(a["dtype"]))      # qembedding_ref's fp32 rounding


# (op, operand) of the reads a prepared weight serves: the GEMM's weight, and the table lookups
# of a tied embedding, which unwrap it
GEMM_WEIGHT_READS = {"linear": {("linear", "weight"), ("embedding", "table")},
                     "qlinear": {("qlinear", "codes"), ("qembedding", "codes")}}
# the reads of a quantized weight's scales and mins, which its prepared weight serves too
PARAM_READS = {"scales": {("qlinear", "scales"), ("qembedding", "scales")},
               "mins": {("qlinear", "mins"), ("qembedding", "mins")}}


def _weight_reads(graphs: Iterable[Graph]) -> dict[str, set[tuple[str, str]]]:
    """Weight name -> every (op, operand name) that reads it."""
    reads: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for node in (n for g in graphs for n in g.nodes if n.op not in ("input", "weight")):
        for name, v in operands_of(node).items():
            for value in (v if isinstance(v, list) else [v]):
                if value.node.startswith("w."):
                    reads[value.node[2:]].add((node.op, name))
    return reads


def _stored(v) -> str | None:
    return v.node[2:] if v is not None and v.node.startswith("w.") else None


def _gemm_weights(graphs: Iterable[Graph], reads: dict[str, set[tuple[str, str]]]) -> dict[str, tuple | None]:
    """Weight name -> (op, {scales, mins: stored weight names or None}, bits, group size) for every
    weight a GEMM multiplies by; None where it cannot be prepared: two different GEMMs over it, or
    another op (other than a tied embedding's lookup) reading it."""
    uses: dict[str, set[tuple]] = defaultdict(set)
    for node in (n for g in graphs for n in g.nodes if n.op in GEMM_WEIGHT_READS):
        x = operands_of(node)
        weight = _stored(x.weight if node.op == "linear" else x.codes)
        if weight is not None:
            params = () if node.op == "linear" else (("scales", _stored(x.scales)), ("mins", _stored(x.get("mins"))))
            uses[weight].add((node.op, params, node.attrs.get("bits"), node.attrs.get("group_size")))
    return {name: next(iter(u)) if len(u) == 1 and reads[name] <= GEMM_WEIGHT_READS[next(iter(u))[0]] else None
            for name, u in uses.items()}


def prepare_weights(graphs: Iterable[Graph], weights: dict[str, torch.Tensor],
                    activations: str = "float") -> dict[str, Any]:
    """`weights` as the native table's GEMMs take them, decided once for all of an executor's graphs.

    The weight each `linear` multiplies by, and each `qlinear`'s codes with their scales (and
    mins), become a GemvWeight holding them in column panels: new tensors in their place (the
    caller keeps the result, not `weights`, so one copy stays resident). Where only quantized GEMMs
    and the tied table's lookup read the scales and mins, their entries become that GemvWeight too
    (those ops read them from it). A weight that another op reads too, or one the kernels do not
    take, stays a plain tensor (its GEMM runs the ref). The reference table takes plain tensors only.
    activations "int8" (or "bf16" / "f32": the same, a prompt's GEMMs in bf16 on AMX / in fp32): the
    quantized weights whose groups are whole blocks of 32 inputs become quads for the int8-activation
    kernel; any other keeps float activations, said once at INFO.
    """
    graphs = list(graphs)
    reads, prepared, kept_float = _weight_reads(graphs), dict(weights), []
    for name, use in _gemm_weights(graphs, reads).items():
        if use is None:
            continue
        op, params, bits, group = use
        params = dict(params)
        if op == "linear":
            gemv_weight = prepare_linear_weight(weights[name])
        elif params["scales"] is None or (bits == 4 and params["mins"] is None):
            continue                       # scales or mins computed, not stored: not a layout to prepare
        else:
            k = weights[name].shape[1] * (2 if bits == 4 else 1)
            quads = activations != "float"
            fits = quads and int8_activations_fit(k, group)
            if quads and not fits:
                kept_float.append(f"{name} (groups of {group})")
            gemv_weight = prepare_qlinear_weight(weights[name], weights[params["scales"]],
                                                 weights[params["mins"]] if bits == 4 else None,
                                                 bits=bits, group_size=group,
                                                 activations=activations if fits else "float")
        if gemv_weight is None:
            continue
        prepared[name] = gemv_weight
        for kind, param in params.items():
            if param is not None and reads[param] <= PARAM_READS[kind]:
                prepared[param] = gemv_weight
    if kept_float:
        logging.getLogger("llmc").info("%d quantized GEMMs keep float activations (int8 activations take groups of "
                                       "a multiple of 32 inputs): %s", len(kept_float), ", ".join(kept_float[:3]))
    return prepared


ACTIVATION_CHOICES = ("auto", "int8", "bf16", "f32", "float")


def choose_activations(activations: str) -> str:
    """What a quantized GEMM's activations are with the native kernels loaded: 'int8', 'bf16' (int8,
    but a prompt's GEMMs on bf16: kernels/cpu/amx_dequant_gemm.h), 'f32' (int8, but a prompt's GEMMs
    in fp32: kernels/cpu/f32_dequant_gemm.h) or 'float'. auto: bf16 where the CPU has AMX-BF16 (usable)
    and AVX512-VNNI; int8 where it has AVX512-VNNI or AVX2's integer dot products (vpmaddubsw: there
    the int8 tiles outrun the fp32 panel GEMM f32 prompts run, at every token count); else float (said
    at INFO); bf16 where AMX-BF16 is not usable is int8 (said at INFO, with why); int8 or f32 without integer
    dot products runs the portable ones below the prompt's token count (slower than float: said at INFO)."""
    log, isa = logging.getLogger("llmc"), torch.ops.llmc.qdot_isa()
    if activations == "float" or (activations == "auto" and isa == "portable"):
        if activations == "auto":
            log.info("this CPU has no AVX512-VNNI or AVX2: quantized GEMMs keep float activations")
        return "float"
    if isa == "portable":
        log.info("int8 activations without AVX512-VNNI or AVX2 run portable integer dot products")
    if activations in ("auto", "bf16"):
        path, why = torch.ops.llmc.cpu_prompt_qgemm_path()
        if path == "amx-bf16":
            return "bf16"
        if activations == "bf16":
            log.info("a prompt's quantized GEMMs keep int8 activations: %s", why)
    return "f32" if activations == "f32" else "int8"


def described_kernels(weights: dict[str, Any], activations: str) -> str:
    """'native', or with quantized GEMMs 'native, int8 activations (amx-int8 from 32 tokens, avx512-vnni
    below)', 'native, bf16 prompts (amx-bf16 from 32 tokens), int8 activations below (avx512-vnni)', the
    same with 'f32 prompts (fp32 from 16 tokens)' or
    '..., float activations' (and how many keep float activations where int8 was asked for)."""
    quantized = {id(w): w for w in weights.values() if isinstance(w, GemvWeight) and w.bits}.values()
    if not quantized:
        return "native"
    if activations == "float":
        return "native, float activations"
    kept = sum(w.layout != "quads" for w in quantized)
    prompts = {"bf16": f"bf16 prompts (amx-bf16 from {PROMPT_MIN_TOKENS} tokens)",
               "f32": f"f32 prompts (fp32 from {F32_PROMPT_MIN_TOKENS} tokens)"}
    said = (f"{prompts[activations]}, int8 activations below ({torch.ops.llmc.qdot_isa()})" if activations in prompts
            else f"int8 activations ({describe_qgemm_path()})")
    return f"native, {said}" + (f", {kept} GEMMs float activations" if kept else "")


KERNEL_CHOICES = ("auto", "native", "reference")


def choose_op_impls(kernels: str) -> tuple[dict[str, OpImpl], str]:
    """The op table for a kernel choice (ops not in it run their reference), and what it resolved
    to ('native' or 'reference').

    'reference' runs the torch refs; 'native' builds the C++ kernels or fails with
    NativeBuildError; 'auto' builds them and, where that fails, logs one warning and runs the refs.
    """
    if kernels == "reference":
        return {}, "reference"
    try:
        load_native_kernels()
    except NativeBuildError as err:
        if kernels == "native":
            raise
        logging.getLogger("llmc").warning("%s; running the torch reference kernels instead", err)
        return {}, "reference"
    return native_op_impls(), "native"
