"""The quantized ops' meanings (`qlinear`, `qembedding`: their op records' references, compiler/ops/)
beside the weight formats, for the kernels and tools that read both.

The formats themselves (int8 / int4 weight layouts, packing, quantize / dequantize, QuantizedWeight,
the int8 KV cache rows and KV_SCALE_BYTES) are compiler/quant_format.py's; they are re-exported
here for the kernels and tools that read them beside these refs.
`qlinear` means x @ w.T for the dequantized fp32 weight w, accumulated in fp32 (float64 for
float64 inputs), rounded to x's dtype once; `qembedding` is rows of the dequantized table.
`qlinear_int8act_ref` is what the CPU's int8-activation kernels compute instead (kernels/cpu/
qdot_gemm.cpp): x quantized per token per block of 32 inputs (llama.cpp's Q8_0 blocks), exact
integer products, the block's scale and then the weight group's scale. `qlinear_bf16_ref` is what
they compute for a prompt on AMX-BF16 (kernels/cpu/amx_dequant_gemm.h): x and the dequantized weight
rounded to bf16, their products summed in fp32.
"""

from __future__ import annotations

import torch

from llmc.compiler.quant_format import (F16_MAX, INT4_BLOCK, INT4_MAX, INT8_MAX, KV_SCALE_BYTES, QuantizedWeight,
                                        cache_head_dim, concat_rows, dequantize_kv_rows, dequantize_weight,
                                        is_int8_cache, pack_int4, quantize_int4, quantize_int8, quantize_kv_rows,
                                        unpack_int4)
from llmc.compiler.ops.gathers import qembedding_ref
from llmc.compiler.ops.gemm import qlinear_ref

__all__ = ["F16_MAX", "INT4_BLOCK", "INT4_MAX", "INT8_MAX", "KV_SCALE_BYTES", "QuantizedWeight", "cache_head_dim",
           "concat_rows", "dequantize_kv_rows", "dequantize_weight", "is_int8_cache", "pack_int4", "quantize_int4",
           "quantize_int8", "quantize_kv_rows", "unpack_int4",
           "qembedding_ref", "qlinear_ref", "ACT_BLOCK", "quantize_activations", "qlinear_int8act_ref",
           "qlinear_bf16_ref"]

ACT_BLOCK = 32        # activation inputs per int8 scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (K a multiple of 32) -> (codes int8 [T, K/32, 32], scales fp32 [T, K/32]): per block,
    d = max|x| / 127 and codes round(x * (1 / d)) (ties to even; 0 where d is 0), all in fp32."""
    blocks = x.float().reshape(x.shape[0], -1, ACT_BLOCK)                          # [T, K/32, 32]
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    return torch.round(blocks * inv[..., None]).to(torch.int8), d


def qlinear_int8act_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """qlinear with x quantized (`quantize_activations`) -> [T, N] in x's dtype. Per block b of 32
    inputs the integer dot of x's codes and the weight's codes, times d_b; per weight group (a
    multiple of 32 inputs) their sum times the group's scale, and int4's min times the group's sum
    of d_b x (block b's code sum); bias added; computed in float64 (exact integer part), rounded once."""
    q, d = quantize_activations(x)                                                 # [T, B, 32], [T, B]
    w = (unpack_int4(codes) if bits == 4 else codes).double()
    n, k, groups = w.shape[0], w.shape[1], scales.shape[1]
    dots = torch.einsum("tbi,nbi->tnb", q.double(), w.view(n, k // ACT_BLOCK, ACT_BLOCK)) * d.double()[:, None]
    y = (dots.view(*dots.shape[:2], groups, -1).sum(-1) * scales.double()).sum(-1)   # [T, N]
    if mins is not None:
        block_sums = (d.double() * q.double().sum(-1)).view(len(q), groups, -1).sum(-1)   # [T, groups]
        y = y + block_sums @ mins.double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)


def qlinear_bf16_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """qlinear with x and the weight rounded to bf16 -> [T, N] in x's dtype: the fp32 dequantized weight
    (dequantize_weight) and x each rounded to bf16 (nearest even), their products summed in float64
    (the kernel's fp32 sums differ from it by their rounding), bias added, rounded once."""
    w = dequantize_weight(codes, scales, mins, bits).to(torch.bfloat16)
    y = x.to(torch.bfloat16).double() @ w.double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)
