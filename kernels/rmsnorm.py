"""RMSNorm.

Contract: x [T, D] (f32/f16/bf16), weight [D] of the same dtype; returns [T, D] in x's dtype.
y = x / sqrt(mean(x^2, -1) + eps) * weight, with the mean and the scaling done in fp32 (float64
for float64 x, the reference runs of bisect) and the product with the weight taken after
casting back, as Hugging Face's Llama does.
"""

from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the norm after it: returns (rmsnorm(x + r), x + r).

    The sum is taken in x's dtype, exactly as an `add` followed by `rmsnorm` computes it.
    """
    total = x + residual
    return rmsnorm_ref(total, weight, eps), total


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
