"""RMSNorm's references, from the op records (compiler/ops/norms.py), for the kernels' callers.

Contract: x [T, D] (f32/f16/bf16), weight [D] of the same dtype; returns [T, D] in x's dtype.
y = x / sqrt(mean(x^2, -1) + eps) * weight, with the mean and the scaling done in fp32 (float64
for float64 x, the reference runs of bisect) and the product with the weight taken after
casting back, as Hugging Face's Llama does, or (`rounding="product"`: Gemma, OLMo-2) taken in
fp32 and rounded once. On a CPU, rmsnorm and add_rmsnorm run as generated
C++ (compiler/codegen/cpp.py, from the records' formulas); on a GPU, as generated Triton.
"""

from __future__ import annotations

from llmc.compiler.ops.norms import add_rmsnorm_ref, rmsnorm_ref

__all__ = ["add_rmsnorm_ref", "rmsnorm_ref"]
