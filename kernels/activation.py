"""SiLU-and-multiply, the SwiGLU gate of the Llama MLP.

Contract: gate and up [T, N] of one float dtype, or one tensor x [T, 2N] whose halves are gate
and up (the output of a merged gate/up GEMM); returns [T, N] in the input dtype. silu is taken in
the input dtype, as `silu` followed by `mul` computes it.
"""

from __future__ import annotations

import torch

from llmc.compiler.ops.elementwise import silu_mul_ref

__all__ = ["native_silu_mul_fits", "silu_mul_cpu", "silu_mul_ref"]


def native_silu_mul_fits(x: torch.Tensor, up: torch.Tensor | None = None) -> bool:
    """Whether kernels/cpu/silu_mul.cpp takes these inputs (else use silu_mul_ref)."""
    width = x.shape[-1] if up is not None else x.shape[-1] // 2
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and width % 16 == 0


def silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher of the native kernel (kernels/cpu/silu_mul.cpp): silu_mul_ref's meaning, in fp32."""
    if not native_silu_mul_fits(gate, up):
        raise ValueError(f"native silu_mul takes f32/bf16 halves of a multiple of 16; got {gate.dtype} "
                         f"{tuple(gate.shape)}")
    if up is None:
        gate, up = gate.chunk(2, dim=-1)                                   # [T, N] views
    return torch.ops.llmc.silu_mul(gate, up)
