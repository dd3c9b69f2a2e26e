"""SiLU-and-multiply, the SwiGLU gate of the Llama MLP: its reference, from the op record
(compiler/ops/elementwise.py), for the kernels' callers.

Contract: gate and up [T, N] of one float dtype, or one tensor x [T, 2N] whose halves are gate
and up (the output of a merged gate/up GEMM); returns [T, N] in the input dtype. silu is taken in
the input dtype, as `silu` followed by `mul` computes it. On a CPU it runs as generated C++
(compiler/codegen/cpp.py, from the record's formula); on a GPU, as generated Triton.
"""

from __future__ import annotations

from llmc.compiler.ops.elementwise import silu_mul_ref

__all__ = ["silu_mul_ref"]
