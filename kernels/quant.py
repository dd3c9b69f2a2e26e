"""The quantized ops' meanings (`qlinear`, `qembedding`: their op records' references, compiler/ops/)
beside the weight formats, for the kernels and tools that read both.

The formats themselves (int8 / int4 weight layouts, packing, quantize / dequantize, QuantizedWeight,
the int8 KV cache rows and KV_SCALE_BYTES) are compiler/quant_format.py's; they are re-exported
here for the kernels and tools that read them beside these refs.
`qlinear` means x @ w.T for the dequantized fp32 weight w, accumulated in fp32 (float64 for
float64 inputs), rounded to x's dtype once; `qembedding` is rows of the dequantized table.
"""

from __future__ import annotations

from llmc.compiler.quant_format import (F16_MAX, INT4_BLOCK, INT4_MAX, INT8_MAX, KV_SCALE_BYTES, QuantizedWeight,
                                        cache_head_dim, concat_rows, dequantize_kv_rows, dequantize_weight,
                                        is_int8_cache, pack_int4, quantize_int4, quantize_int8, quantize_kv_rows,
                                        unpack_int4)
from llmc.compiler.ops.gathers import qembedding_ref
from llmc.compiler.ops.gemm import qlinear_ref

__all__ = ["F16_MAX", "INT4_BLOCK", "INT4_MAX", "INT8_MAX", "KV_SCALE_BYTES", "QuantizedWeight", "cache_head_dim",
           "concat_rows", "dequantize_kv_rows", "dequantize_weight", "is_int8_cache", "pack_int4", "quantize_int4",
           "quantize_int8", "quantize_kv_rows", "unpack_int4",
           "qembedding_ref", "qlinear_ref"]
