"""GEMM ops: linear (x @ w.T + b) and qlinear (the same over int8 or int4 weight codes with
per-group scales; the formats are compiler/quant_format.py's). References accumulate in fp32
(float64 for float64 x, the reference runs of bisect)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir import TensorType
from ..quant_format import dequantize_weight
from .checks import expect, float_
from .record import Lowered, Operand, Operands, OpRecord, operands


def qlinear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """x [T, K] @ dequantized w [N, K].T (+ bias), accumulated in fp32 (f64 for f64 x) -> [T, N] in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w = dequantize_weight(codes, scales, mins, bits, acc)
    return F.linear(x.to(acc), w, None if bias is None else bias.to(acc)).to(x.dtype)


def _linear_types(ts: Operands, attrs: dict):
    x, w = ts.x, ts.weight
    float_(x, "linear input")
    expect(len(x.shape) == 2 and len(w.shape) == 2, f"linear takes [T,K] x [N,K], got {x} x {w}")
    expect(x.shape[1] == w.shape[1], f"linear reduction dims differ: {x} x {w}")
    if "bias" in ts:
        expect(ts.bias.shape == (w.shape[0],), f"linear bias {ts.bias} does not match weight {w}")
    return (TensorType(x.dtype, (x.shape[0], w.shape[0])),)


def quantized_weight(ts: Operands, attrs: dict) -> tuple:
    """(N, K) of a quantized weight's codes, scales and (int4) mins, checked."""
    bits, group = attrs["bits"], attrs["group_size"]
    expect(bits in (8, 4), f"bits must be 8 or 4, got {bits!r}")
    codes, scales = ts.codes, ts.scales
    expect(codes.dtype == ("i8" if bits == 8 else "u4x2") and len(codes.shape) == 2,
           f"{bits}-bit codes must be {'i8' if bits == 8 else 'u4x2'}[N,{'K' if bits == 8 else 'K/2'}], got {codes}")
    n, k = codes.shape[0], codes.shape[1] * (1 if bits == 8 else 2)
    expect(isinstance(group, int) and group > 0 and isinstance(k, int) and k % group == 0,
           f"group_size={group!r} does not divide the {k} input features")
    expect(bits == 8 or group % 32 == 0, f"int4 group_size={group} is not a multiple of 32")
    expect(scales == TensorType("f16", (n, k // group)), f"scales must be f16[{n},{k // group}], got {scales}")
    if bits == 4:
        expect(ts.mins == scales, f"int4 mins must be f16[{n},{k // group}], got {ts.mins}")
    return n, k


def _qlinear_types(ts: Operands, attrs: dict):
    float_(ts.x, "qlinear input")
    n, k = quantized_weight(ts, attrs)
    expect(len(ts.x.shape) == 2 and ts.x.shape[1] == k, f"qlinear input {ts.x} does not have the weight's {k} features")
    if "bias" in ts:
        expect(ts.bias.shape == (n,), f"qlinear bias {ts.bias} does not match {n} outputs")
    return (TensorType(ts.x.dtype, (ts.x.shape[0], n)),)


def int4(attrs: dict) -> bool:
    return attrs["bits"] == 4


QUANTIZED = (Operand("codes"), Operand("scales"), Operand("mins", when=int4))

RECORDS = [
    OpRecord("linear", (operands("x", "weight", "bias?"),), (), _linear_types, "gemm", "x @ w.T (+ b)",
             reference=lambda x, a: F.linear(x.x, x.weight, x.get("bias")),
             backends={"native": Lowered("kernels/cpu/panel_gemm.cpp (weights in column panels)"),
                       "step_plan": Lowered("instruction linear"), "triton": Lowered("template kernels/triton/gemm.py")}),
    OpRecord("qlinear", ((Operand("x"), *QUANTIZED, Operand("bias", optional=True)),), ("bits", "group_size"),
             _qlinear_types, "gemm",
             "x @ dequant(w).T (+ b): int8 or int4 weight codes with per-group scales (compiler/quant_format.py)",
             reference=lambda x, a: qlinear_ref(x.x, x.codes, x.scales, x.get("mins"), x.get("bias"), bits=a["bits"]),
             backends={"native": Lowered("kernels/cpu/qpanel_gemm.cpp (codes in column panels)"),
                       "step_plan": Lowered("instruction qlinear"), "triton": Lowered("template kernels/triton/qgemm.py")}),
]
