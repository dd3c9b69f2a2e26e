"""Row-wise ops: rmsnorm, add_rmsnorm (the residual add fused with the norm after it), and
head_rmsnorm (each head of a packed [T, H*D] row normed on its own, one weight [D] for all heads:
Qwen3's and Gemma 3's q/k norms).

The references are the meaning: the mean and the scaling in fp32 (float64 for float64 x, the
reference runs of bisect), then one of two roundings to x's dtype, the optional attr `rounding`
(absent = "normed"):
  "normed"   the normed row rounded before the product with the weight, the product rounded again
             (Hugging Face's Llama, Qwen3: `weight * normed.to(dtype)`);
  "product"  the product with the weight in fp32, rounded once (Gemma 2/3: `(normed * (1 + w)).type_as(x)`,
             OLMo-2: `(weight * normed).to(dtype)`).
In fp32 the two agree; in bf16 they differ by an ulp on about a quarter of the values. The weight
has x's dtype in an artifact (Gemma's 1 + w rounded to it: models/families/gemma.py says what
that leaves); the references take an fp32 weight too (then "product" is Gemma's module exactly).
"""

from __future__ import annotations

import torch

from ..formula import Row, rounded, row_sum, rsqrt
from ..ir import TensorType
from .checks import expect, float_, same
from .record import Declined, Lowered, Operands, OpRecord, operands

_FUSED = "fused into rope_kv_write; keep the fuse_rope_kv_write pass"
ROUNDINGS = ("normed", "product")     # attr `rounding` (module docstring); absent = "normed"


def rounding_of(attrs: dict) -> str:
    """A norm node's rounding: its attr `rounding`, "normed" where absent."""
    return attrs.get("rounding", "normed")


def rounding_attr(rounding: str) -> dict:
    """The attrs that say `rounding`: none for the default, so graphs without the choice print as before."""
    return {} if rounding == "normed" else {"rounding": rounding}


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, rounding: str = "normed") -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight; x [T, D] (f32/f16/bf16), weight [D] of its dtype;
    rounded to x's dtype as `rounding` says (module docstring)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if rounding == "product":
        return (normed * weight.to(x32.dtype)).to(x.dtype)
    return weight * normed.to(x.dtype)


def head_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int,
                     rounding: str = "normed") -> torch.Tensor:
    """rmsnorm_ref of every head of x [T, H*D] over its head_dim values, weight [D] shared by the heads."""
    heads = x.view(x.shape[0], -1, head_dim)                          # [T, H, D]
    return rmsnorm_ref(heads, weight, eps, rounding).reshape(x.shape)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float, rounding: str = "normed") -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + r), x + r), the sum taken in x's dtype exactly as an `add` then `rmsnorm` take it."""
    total = x + residual
    return rmsnorm_ref(total, weight, eps, rounding), total


def _check_rounding(attrs: dict) -> None:
    expect(rounding_of(attrs) in ROUNDINGS, f"norm rounding={rounding_of(attrs)!r} is not one of {ROUNDINGS}")


def _rmsnorm_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    _check_rounding(attrs)
    float_(ts.x, "rmsnorm input")
    expect(ts.weight.shape == (ts.x.shape[-1],), f"rmsnorm weight {ts.weight} does not match hidden size of {ts.x}")
    return (ts.x,)


def _head_rmsnorm_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    _check_rounding(attrs)
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


def normed(row: Row, x, attrs: dict, dtype: str):
    """The RMSNorm of row expression `x` (width of operand "weight") times the weight; the normed
    row rounded to `dtype` before the product where the rounding is "normed" (the generator rounds
    the product, the op's result, in either case)."""
    width = row.widths["weight"]
    scaled = x * rsqrt(row_sum(x * x) / width + attrs["eps"])
    return (scaled if rounding_of(attrs) == "product" else rounded(scaled, dtype)) * row["weight"]


def _rmsnorm_formula(row: Row, attrs: dict):
    return (normed(row, row["x"], attrs, row.outs[0]),)


def _add_rmsnorm_formula(row: Row, attrs: dict):
    total = rounded(row["x"] + row["residual"], row.outs[1])
    return (normed(row, total, attrs, row.outs[0]), total)


# The three norms also take the optional attr `rounding` (ROUNDINGS; absent = "normed").
RECORDS = [
    OpRecord("rmsnorm", (operands("x", "weight"),), ("eps",), _rmsnorm_types, "rowwise",
             "x / sqrt(mean(x^2) + eps) * w, in fp32",
             reference=lambda x, a: rmsnorm_ref(x.x, x.weight, a["eps"], rounding_of(a)), formula=_rmsnorm_formula),
    OpRecord("add_rmsnorm", (operands("x", "residual", "weight"),), ("eps",), _add_rmsnorm_types, "rowwise",
             "s = x + r; returns (rmsnorm(s, w), s): the residual add fused with the next norm",
             reference=lambda x, a: add_rmsnorm_ref(x.x, x.residual, x.weight, a["eps"], rounding_of(a)),
             formula=_add_rmsnorm_formula),
    OpRecord("head_rmsnorm", (operands("x", "weight"),), ("eps", "head_dim"), _head_rmsnorm_types, "rowwise",
             "rmsnorm of each head_dim-wide head of x, one weight [head_dim] for every head",
             reference=lambda x, a: head_rmsnorm_ref(x.x, x.weight, a["eps"], a["head_dim"], rounding_of(a)),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(_FUSED),
                       "triton": Declined(_FUSED)}),
]
