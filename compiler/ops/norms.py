"""Row-wise ops: rmsnorm, add_rmsnorm (the residual add fused with the norm after it), and
head_rmsnorm (each head of a packed [T, H*D] row normed on its own, one weight [D] for all heads:
Qwen3's and Gemma 3's q/k norms).

The references are the meaning: the mean and the scaling in fp32 (float64 for float64 x, the
reference runs of bisect), the normed row rounded to x's dtype before the product with the weight,
as Hugging Face's Llama does.
"""

from __future__ import annotations

import torch

from ..formula import Row, rounded, row_sum, rsqrt
from ..ir import TensorType
from .checks import expect, float_, same
from .record import Declined, Lowered, Operands, OpRecord, operands

_FUSED = "fused into rope_kv_write; keep the fuse_rope_kv_write pass"


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight; x [T, D] (f32/f16/bf16), weight [D] of its dtype."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def head_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """rmsnorm_ref of every head of x [T, H*D] over its head_dim values, weight [D] shared by the heads."""
    heads = x.view(x.shape[0], -1, head_dim)                          # [T, H, D]
    return rmsnorm_ref(heads, weight, eps).reshape(x.shape)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + r), x + r), the sum taken in x's dtype exactly as an `add` then `rmsnorm` take it."""
    total = x + residual
    return rmsnorm_ref(total, weight, eps), total


def _rmsnorm_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    float_(ts.x, "rmsnorm input")
    expect(ts.weight.shape == (ts.x.shape[-1],), f"rmsnorm weight {ts.weight} does not match hidden size of {ts.x}")
    return (ts.x,)


def _head_rmsnorm_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    float_(ts.x, "head_rmsnorm input")
    head_dim = attrs["head_dim"]
    expect(isinstance(ts.x.shape[1], int) and ts.x.shape[1] % head_dim == 0,
           f"head_rmsnorm input width {ts.x.shape[1]} is not a multiple of head_dim={head_dim}")
    expect(ts.weight.shape == (head_dim,), f"head_rmsnorm weight {ts.weight} is not [head_dim={head_dim}]")
    return (ts.x,)


def _add_rmsnorm_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    same(ts.x, ts.residual, "add_rmsnorm")
    (normed,) = _rmsnorm_types(Operands(x=ts.x, weight=ts.weight), attrs)
    return (normed, ts.x)


def normed(row: Row, x, eps: float, dtype: str):
    """The RMSNorm of row expression `x` (width of operand "weight") before the weight, rounded."""
    width = row.widths["weight"]
    return rounded(x * rsqrt(row_sum(x * x) / width + eps), dtype)


def _rmsnorm_formula(row: Row, attrs: dict):
    return (normed(row, row["x"], attrs["eps"], row.outs[0]) * row["weight"],)


def _add_rmsnorm_formula(row: Row, attrs: dict):
    total = rounded(row["x"] + row["residual"], row.outs[1])
    return (normed(row, total, attrs["eps"], row.outs[0]) * row["weight"], total)


RECORDS = [
    OpRecord("rmsnorm", (operands("x", "weight"),), ("eps",), _rmsnorm_types, "rowwise",
             "x / sqrt(mean(x^2) + eps) * w, in fp32",
             reference=lambda x, a: rmsnorm_ref(x.x, x.weight, a["eps"]), formula=_rmsnorm_formula),
    OpRecord("add_rmsnorm", (operands("x", "residual", "weight"),), ("eps",), _add_rmsnorm_types, "rowwise",
             "s = x + r; returns (rmsnorm(s, w), s): the residual add fused with the next norm",
             reference=lambda x, a: add_rmsnorm_ref(x.x, x.residual, x.weight, a["eps"]),
             formula=_add_rmsnorm_formula),
    OpRecord("head_rmsnorm", (operands("x", "weight"),), ("eps", "head_dim"), _head_rmsnorm_types, "rowwise",
             "rmsnorm of each head_dim-wide head of x, one weight [head_dim] for every head",
             reference=lambda x, a: head_rmsnorm_ref(x.x, x.weight, a["eps"], a["head_dim"]),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(_FUSED),
                       "triton": Declined(_FUSED)}),
]
