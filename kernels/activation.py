"""SiLU-and-multiply, the SwiGLU gate of the Llama MLP.

Contract: gate and up [T, N] of one float dtype, or one tensor x [T, 2N] whose halves are gate
and up (the output of a merged gate/up GEMM); returns [T, N] in the input dtype. silu is taken in
the input dtype, as `silu` followed by `mul` computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        gate, up = gate.chunk(2, dim=-1)                                   # [T, N] each
    return F.silu(gate) * up
