"""The quantized ops' meanings in torch: `qlinear` and `qembedding` over the weight formats.

The formats themselves (int8 / int4 weight layouts, packing, quantize / dequantize, QuantizedWeight,
the int8 KV cache rows and KV_SCALE_BYTES) are compiler/quant_format.py's; they are re-exported
here for the kernels and tools that read them beside these refs.
`qlinear` means x @ w.T for the dequantized fp32 weight w, accumulated in fp32 (float64 for
float64 inputs), rounded to x's dtype once; `qembedding` is rows of the dequantized table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmc.compiler.quant_format import (F16_MAX, INT4_BLOCK, INT4_MAX, INT8_MAX, KV_SCALE_BYTES, QuantizedWeight,
                                        cache_head_dim, concat_rows, dequantize_kv_rows, dequantize_weight,
                                        is_int8_cache, pack_int4, quantize_int4, quantize_int8, quantize_kv_rows,
                                        unpack_int4)

__all__ = ["F16_MAX", "INT4_BLOCK", "INT4_MAX", "INT8_MAX", "KV_SCALE_BYTES", "QuantizedWeight", "cache_head_dim",
           "concat_rows", "dequantize_kv_rows", "dequantize_weight", "is_int8_cache", "pack_int4", "quantize_int4",
           "quantize_int8", "quantize_kv_rows", "unpack_int4",
           "qembedding_ref", "qlinear_ref", "split_qlinear_inputs"]


# ------------------------------------------------------------------ the ops' meaning


def qlinear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """x [T, K] @ dequantized w [N, K].T (+ bias), accumulated in fp32 (f64 for f64 x) -> [T, N] in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w = dequantize_weight(codes, scales, mins, bits, acc)
    return F.linear(x.to(acc), w, None if bias is None else bias.to(acc)).to(x.dtype)


def qembedding_ref(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor, *,
                   bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized table [V, D], dequantized in fp32, as `dtype` [T, D]."""
    rows = ids.long()
    return dequantize_weight(codes[rows], scales[rows], None if mins is None else mins[rows], bits).to(dtype)


def split_qlinear_inputs(x: list[torch.Tensor], bits: int) -> tuple[torch.Tensor, ...]:
    """qlinear's IR inputs (x, codes, scales[, mins][, bias]) -> (x, codes, scales, mins, bias)."""
    head, rest = x[:3], x[3:]
    mins = rest.pop(0) if bits == 4 else None
    return (*head, mins, rest[0] if rest else None)
