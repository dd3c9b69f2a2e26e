"""Elementwise ops: add, mul, silu, cast, split; gelu_tanh, the gated MLP activations silu_mul
(SwiGLU) and gelu_tanh_mul (GeGLU, Gemma's), scale (times a constant) and softcap (Gemma 2's
logit soft-capping).

Each record's reference is the meaning (torch, in the operands' dtype as the traced model computes
it); its formula is what every generated kernel computes (fp32 math, rounded where the reference
rounds). tests/test_op_records.py checks every formula against its reference.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from ..dtypes import to_torch
from ..formula import Expr, Row, rounded, sigmoid, tanh
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


def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up (GeGLU), as silu_mul_ref with torch's tanh-approximated GELU."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)                                   # [T, N] each
    return F.gelu(gate, approximate="tanh") * up


def _gelu_tanh(v: Expr) -> Expr:
    """0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))): torch's gelu(approximate="tanh")."""
    return 0.5 * v * (1 + tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v * v * v)))


def _gated_types(name: str):
    """The type rule of a gated activation `name`: (gate, up) of one type, or x [T, 2N] -> [T, N]."""
    def types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
        if "gate" in ts:
            return binary(Operands(a=ts.gate, b=ts.up), attrs)
        float_(ts.x, f"{name} input")
        width = ts.x.shape[-1]
        expect(isinstance(width, int) and width % 2 == 0,
               f"one-input {name} needs an even last dim (gate and up halves), got {ts.x}")
        return (ts.x.with_shape(*ts.x.shape[:-1], width // 2),)
    return types


def _gated_formula(activation):
    """The formula of activation(gate) * up, the activation rounded to the result's dtype as the
    unfused activation op rounds it; with one input x, gate and up are its halves."""
    def formula(row: Row, attrs: dict):
        if "x" in row:
            half = row.widths["x"] // 2
            gate, up = row.cols("x", 0, half), row.cols("x", half, half)
        else:
            gate, up = row["gate"], row["up"]
        return (rounded(activation(gate), row.outs[0]) * up,)
    return formula


def _gated_record(name: str, ref, activation, doc: str) -> OpRecord:
    return OpRecord(name, (operands("x"), operands("gate", "up")), (), _gated_types(name), "elementwise",
                    f"{doc}; with one input x [T, 2N], gate and up are its two halves",
                    reference=lambda x, a: ref(x.x) if "x" in x else ref(x.gate, x.up),
                    formula=_gated_formula(activation))


def in_dtype(value: float, dtype: str) -> float:
    """`value` as the nearest value of the IR float dtype (Gemma's normalizer is a tensor of x's dtype)."""
    return float(torch.tensor(value, dtype=to_torch(dtype)))


def scale_ref(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor, the factor first rounded to x's dtype: transformers' Gemma embedding scale
    `x * torch.tensor(hidden ** 0.5, dtype=x.dtype)`."""
    return x * torch.tensor(factor, dtype=x.dtype, device=x.device)


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype, rounded after each step as transformers' Gemma 2 computes
    its final logits (`x / cap`, `tanh`, `* cap`)."""
    return torch.tanh(x / cap) * cap


def _scalar_attr(name: str, positive: bool = False):
    """The type rule of a float unary op with one number attribute `name` (positive if asked)."""
    def types(ts: Operands, attrs: dict) -> tuple[TensorType, ...]:
        value = attrs[name]
        expect(isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 or not positive),
               f"{name} must be a {'positive ' * positive}number, got {value!r}")
        return unary_float(ts, attrs)
    return types


def _softcap_formula(row: Row, attrs: dict):
    dtype, cap = row.dtypes["x"], attrs["cap"]
    return (rounded(tanh(rounded(row["x"] / cap, dtype)), dtype) * cap,)


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
    _gated_record("silu_mul", silu_mul_ref, lambda g: g * sigmoid(g), "silu(gate) * up"),
    _gated_record("gelu_tanh_mul", gelu_tanh_mul_ref, _gelu_tanh, "gelu_tanh(gate) * up"),
    OpRecord("split", (operands("x"),), ("sizes",), _split_types, "elementwise",
             "x cut along its last dim into parts of these widths",
             reference=lambda x, a: tuple(torch.split(x.x, a["sizes"], dim=-1)), formula=_split_formula),
    OpRecord("gelu_tanh", (operands("x"),), (), unary_float, "elementwise",
             "x * Phi(x), Phi by its tanh approximation (torch's gelu(approximate='tanh'))",
             reference=lambda x, a: F.gelu(x.x, approximate="tanh"), formula=lambda r, a: (_gelu_tanh(r["x"]),),
             traced=(F.gelu,), traced_kwargs={"approximate": "tanh"}),
    OpRecord("scale", (operands("x"),), ("factor",), _scalar_attr("factor"), "elementwise",
             "x * factor, the factor rounded to x's dtype",
             reference=lambda x, a: scale_ref(x.x, a["factor"]),
             formula=lambda r, a: (r["x"] * in_dtype(a["factor"], r.dtypes["x"]),), traced=(operator.mul, torch.mul)),
    OpRecord("softcap", (operands("x"),), ("cap",), _scalar_attr("cap", positive=True), "elementwise",
             "cap * tanh(x / cap), rounded to x's dtype after each step",
             reference=lambda x, a: softcap_ref(x.x, a["cap"]), formula=_softcap_formula),
]
