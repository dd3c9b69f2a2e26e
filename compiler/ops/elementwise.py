"""Elementwise ops: add, mul, silu, cast, silu_mul (the SwiGLU gate) and split.

Each record's reference is the meaning (torch, in the operands' dtype as the traced model computes
it); its formula is what every generated kernel computes (fp32 math, rounded where the reference
rounds). tests/test_op_records.py checks every formula against its reference.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..dtypes import to_torch
from ..formula import Row, rounded, sigmoid
from ..ir import TensorType
from .checks import expect, float_, same
from .record import Operands, OpRecord, operands


def binary(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    same(ts.a, ts.b, "elementwise op")
    float_(ts.a, "elementwise operand")
    return (ts.a,)


def unary_float(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    float_(ts.x, "operand")
    return (ts.x,)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, silu taken in the input dtype as `silu` then `mul` compute it; with one
    input x [T, 2N], gate and up are its halves (a merged gate/up GEMM's output)."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)                                   # [T, N] each
    return F.silu(gate) * up


def _silu_mul_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    if "gate" in ts:
        return binary(Operands(a=ts.gate, b=ts.up), attrs)
    float_(ts.x, "silu_mul input")
    width = ts.x.shape[-1]
    expect(isinstance(width, int) and width % 2 == 0,
           f"one-input silu_mul needs an even last dim (gate and up halves), got {ts.x}")
    return (ts.x.with_shape(*ts.x.shape[:-1], width // 2),)


def _silu_mul_formula(row: Row, attrs: dict):
    if "x" in row:
        half = row.widths["x"] // 2
        gate, up = row.cols("x", 0, half), row.cols("x", half, half)
    else:
        gate, up = row["gate"], row["up"]
    return (rounded(gate * sigmoid(gate), row.outs[0]) * up,)


def _split_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    sizes, x = attrs["sizes"], ts.x
    expect(isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes),
           f"split sizes must be a list of positive ints, got {sizes!r}")
    expect(sum(sizes) == x.shape[-1], f"split sizes {sizes} do not add up to the last dim of {x}")
    return tuple(x.with_shape(*x.shape[:-1], s) for s in sizes)


def _split_formula(row: Row, attrs: dict):
    starts = [sum(attrs["sizes"][:i]) for i in range(len(attrs["sizes"]))]
    return tuple(row.cols("x", start, size) for start, size in zip(starts, attrs["sizes"]))


def _cast_types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
    return (TensorType(attrs["dtype"], ts.x.shape),)


RECORDS = [
    OpRecord("add", (operands("a", "b"),), (), binary, "elementwise", "a + b",
             reference=lambda x, a: x.a + x.b, formula=lambda r, a: (r["a"] + r["b"],), traced=(operator.add, torch.add)),
    OpRecord("mul", (operands("a", "b"),), (), binary, "elementwise", "a * b",
             reference=lambda x, a: x.a * x.b, formula=lambda r, a: (r["a"] * r["b"],), traced=(operator.mul, torch.mul)),
    OpRecord("silu", (operands("x"),), (), unary_float, "elementwise", "x * sigmoid(x)",
             reference=lambda x, a: F.silu(x.x), formula=lambda r, a: (r["x"] * sigmoid(r["x"]),), traced=(F.silu,)),
    OpRecord("cast", (operands("x"),), ("dtype",), _cast_types, "elementwise", "convert element type",
             reference=lambda x, a: x.x.to(to_torch(a["dtype"])), formula=lambda r, a: (r["x"],)),
    OpRecord("silu_mul", (operands("x"), operands("gate", "up")), (), _silu_mul_types, "elementwise",
             "silu(gate) * up; with one input x [T, 2N], gate and up are its two halves",
             reference=lambda x, a: silu_mul_ref(x.x) if "x" in x else silu_mul_ref(x.gate, x.up),
             formula=_silu_mul_formula),
    OpRecord("split", (operands("x"),), ("sizes",), _split_types, "elementwise",
             "x cut along its last dim into parts of these widths",
             reference=lambda x, a: tuple(torch.split(x.x, a["sizes"], dim=-1)), formula=_split_formula),
]
