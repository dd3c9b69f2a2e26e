"""Row formulas: what an elementwise or row-wise op computes, written once and rendered by every
code generator (Triton on a GPU, C++ on a CPU) and by `evaluate` in torch.

A formula works on one row (one token) at a time. Its leaves are the op's operands: a row of a
[T, C] operand, a column range of one (`Row.cols`), or a 1-D per-column vector such as a norm
weight; constants broadcast. Every expression is a vector of one row's columns, or a per-row
scalar after `row_sum` (which broadcasts back). Arithmetic is fp32; `rounded(e, dtype)` rounds an
intermediate to an IR dtype where the op's reference rounds (e.g. RMSNorm rounds the normed row
before the weight product); each result of an op is rounded to its own IR dtype by the
generator, as the op-by-op reference rounds it.

    def gelu_tanh(x: Row, attrs: dict) -> tuple[Expr, ...]:
        v = x["x"]
        return (0.5 * v * (1 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))),)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from .dtypes import to_torch

Number = Union[int, float]
# primitive -> number of expression arguments; renderers cover every one (tests check)
PRIMITIVES = {"operand": 0, "const": 0, "add": 2, "sub": 2, "mul": 2, "div": 2, "neg": 1, "exp": 1, "tanh": 1,
              "sigmoid": 1, "rsqrt": 1, "sqrt": 1, "max": 2, "min": 2, "round": 1, "row_sum": 1}


@dataclass(frozen=True)
class Leaf:
    """An operand's columns [start, start + width) of this row; 1-D operands are per-column."""

    name: str
    start: int
    width: int


@dataclass(frozen=True, eq=False)
class Expr:
    """One node of a row formula: `op` one of PRIMITIVES; `value` the Leaf of an operand, the
    number of a const, the IR dtype of a round."""

    op: str
    args: tuple["Expr", ...] = ()
    value: object = None

    def __post_init__(self) -> None:
        assert self.op in PRIMITIVES and len(self.args) == PRIMITIVES[self.op], f"bad formula node {self.op}"

    @property
    def scalar(self) -> bool:
        """A per-row scalar (a row_sum, or built only from scalars and constants)."""
        if self.op == "row_sum":
            return True
        if self.op == "operand":
            return False
        return all(a.scalar for a in self.args)

    def __add__(self, o): return Expr("add", (self, lift(o)))
    def __radd__(self, o): return Expr("add", (lift(o), self))
    def __sub__(self, o): return Expr("sub", (self, lift(o)))
    def __rsub__(self, o): return Expr("sub", (lift(o), self))
    def __mul__(self, o): return Expr("mul", (self, lift(o)))
    def __rmul__(self, o): return Expr("mul", (lift(o), self))
    def __truediv__(self, o): return Expr("div", (self, lift(o)))
    def __rtruediv__(self, o): return Expr("div", (lift(o), self))
    def __neg__(self): return Expr("neg", (self,))


def lift(x: "Expr | Number") -> Expr:
    return x if isinstance(x, Expr) else Expr("const", (), float(x))


def exp(x: Expr) -> Expr: return Expr("exp", (lift(x),))
def tanh(x: Expr) -> Expr: return Expr("tanh", (lift(x),))
def sigmoid(x: Expr) -> Expr: return Expr("sigmoid", (lift(x),))
def rsqrt(x: Expr) -> Expr: return Expr("rsqrt", (lift(x),))
def sqrt(x: Expr) -> Expr: return Expr("sqrt", (lift(x),))
def maximum(a: Expr, b: "Expr | Number") -> Expr: return Expr("max", (lift(a), lift(b)))
def minimum(a: Expr, b: "Expr | Number") -> Expr: return Expr("min", (lift(a), lift(b)))
def row_sum(x: Expr) -> Expr: return Expr("row_sum", (lift(x),))
def rounded(x: Expr, dtype: str) -> Expr: return Expr("round", (lift(x),), dtype)


class Row:
    """The operands of one op application, by name, as formula leaves; `widths` are their last
    dims (a 1-D operand's only dim), `dtypes` their IR dtypes, `outs` the IR dtypes of the op's
    results."""

    def __init__(self, widths: dict[str, int], dtypes: dict[str, str], outs: list[str]):
        self.widths = widths
        self.dtypes = dtypes
        self.outs = outs

    def __getitem__(self, name: str) -> Expr:
        return Expr("operand", (), Leaf(name, 0, self.widths[name]))

    def cols(self, name: str, start: int, width: int) -> Expr:
        assert 0 <= start and start + width <= self.widths[name], f"columns outside operand {name}"
        return Expr("operand", (), Leaf(name, start, width))

    def __contains__(self, name: str) -> bool:
        return name in self.widths


Formula = Callable[[Row, dict], tuple[Expr, ...]]


def leaves(exprs: tuple[Expr, ...]) -> list[Leaf]:
    """Every operand leaf the expressions read, in first-use order."""
    found: dict[Leaf, None] = {}

    def walk(e: Expr) -> None:
        if e.op == "operand":
            found.setdefault(e.value)
        for a in e.args:
            walk(a)

    for e in exprs:
        walk(e)
    return list(found)


# ------------------------------------------------------------------------------ torch


_TORCH = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "neg": torch.neg,
          "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "rsqrt": torch.rsqrt, "sqrt": torch.sqrt,
          "max": torch.maximum, "min": torch.minimum}


def evaluate(exprs: tuple[Expr, ...], operands: dict[str, torch.Tensor], out_dtypes: list[str]) -> tuple:
    """The formula on whole tensors in torch (fp32 math, each result rounded to its dtype): what a
    generated kernel computes, for tests of a formula against its op's reference."""
    memo: dict[int, torch.Tensor] = {}

    def ev(e: Expr) -> torch.Tensor:
        if id(e) in memo:
            return memo[id(e)]
        if e.op == "operand":
            leaf, t = e.value, operands[e.value.name]
            r = t[..., leaf.start:leaf.start + leaf.width].float()
        elif e.op == "const":
            r = torch.tensor(e.value, dtype=torch.float32)
        elif e.op == "round":
            r = ev(e.args[0]).to(to_torch(e.value)).float()
        elif e.op == "row_sum":
            r = ev(e.args[0]).sum(-1, keepdim=True)
        else:
            r = _TORCH[e.op](*(ev(a) for a in e.args))
        memo[id(e)] = r
        return r

    return tuple(ev(e).to(to_torch(d)) for e, d in zip(exprs, out_dtypes))
