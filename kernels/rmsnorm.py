"""RMSNorm: the native CPU launchers; the references are the op records' (compiler/ops/norms.py).

Contract: x [T, D] (f32/f16/bf16), weight [D] of the same dtype; returns [T, D] in x's dtype.
y = x / sqrt(mean(x^2, -1) + eps) * weight, with the mean and the scaling done in fp32 (float64
for float64 x, the reference runs of bisect) and the product with the weight taken after
casting back, as Hugging Face's Llama does.
"""

from __future__ import annotations

import torch

from llmc.compiler.ops.norms import add_rmsnorm_ref, rmsnorm_ref

__all__ = ["add_rmsnorm_cpu", "add_rmsnorm_ref", "native_norm_fits", "rmsnorm_cpu", "rmsnorm_ref"]


def native_norm_fits(x: torch.Tensor) -> bool:
    """Whether kernels/cpu/rmsnorm.cpp takes x (else use the refs above)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 16 == 0


def add_rmsnorm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of the native kernel (kernels/cpu/rmsnorm.cpp): add_rmsnorm_ref's meaning, with
    the weight product in fp32 (the ref rounds first: at most one ulp of x's dtype apart)."""
    if not native_norm_fits(x):
        raise ValueError(f"native rmsnorm takes f32/bf16 rows of a multiple of 16; got {x.dtype} {tuple(x.shape)}")
    return torch.ops.llmc.add_rmsnorm(x, residual, weight, eps)


def rmsnorm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher of the native kernel (kernels/cpu/rmsnorm.cpp): rmsnorm_ref's meaning."""
    if not native_norm_fits(x):
        raise ValueError(f"native rmsnorm takes f32/bf16 rows of a multiple of 16; got {x.dtype} {tuple(x.shape)}")
    return torch.ops.llmc.rmsnorm(x, weight, eps)
