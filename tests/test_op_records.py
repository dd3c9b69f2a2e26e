"""Every op's formula (what generated kernels compute) against its reference (the meaning), in
torch: f32 within fp32 rounding, bf16 within one bf16 ulp of the result where the formula's fp32
math and the reference's rounding order differ."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.formula import PRIMITIVES, Row, evaluate, leaves
from llmc.compiler.ops import OPS, bind

# op -> (operands as (name, shape), attrs, result dtypes given the operands' dtype)
SAMPLES = {
    "add": ([("a", (5, 72)), ("b", (5, 72))], {}),
    "mul": ([("a", (5, 72)), ("b", (5, 72))], {}),
    "silu": ([("x", (5, 100))], {}),
    "cast": ([("x", (5, 24))], {"dtype": "f32"}),
    "silu_mul": ([("x", (5, 144))], {}),
    "gelu_tanh": ([("x", (5, 100))], {}),
    "gelu_tanh_mul": ([("x", (5, 144))], {}),
    "scale": ([("x", (5, 72))], {"factor": 2304 ** 0.5}),
    "softcap": ([("x", (5, 72))], {"cap": 2.5}),
    "split": ([("x", (5, 96))], {"sizes": [40, 56]}),
    "rmsnorm": ([("x", (5, 72)), ("weight", (72,))], {"eps": 1e-5}),
    "add_rmsnorm": ([("x", (5, 72)), ("residual", (5, 72)), ("weight", (72,))], {"eps": 1e-5}),
}


def test_every_formula_op_has_a_sample():
    assert set(SAMPLES) == {name for name, r in OPS.items() if r.formula is not None}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_formula_equals_reference(op, dtype):
    record, (shapes, attrs) = OPS[op], SAMPLES[op]
    g = torch.Generator().manual_seed(1)
    tensors = {name: torch.randn(shape, generator=g).to(to_torch(dtype)) for name, shape in shapes}
    want = record.reference(bind(record, list(tensors.values()), attrs), attrs)
    want = want if isinstance(want, tuple) else (want,)
    outs = [str(t.dtype).removeprefix("torch.") for t in want]
    outs = [{"float32": "f32", "bfloat16": "bf16"}[o] for o in outs]
    row = Row({k: t.shape[-1] for k, t in tensors.items()}, {k: dtype for k in tensors}, outs)
    exprs = record.formula(row, attrs)
    assert {leaf.name for leaf in leaves(exprs)} <= set(tensors)
    got = evaluate(exprs, tensors, outs)
    for g_, w in zip(got, want, strict=True):
        ulp = torch.finfo(w.dtype).eps
        torch.testing.assert_close(g_.float(), w.float(), rtol=2 * ulp, atol=4 * ulp)


def test_evaluate_knows_every_primitive():
    from llmc.compiler import formula
    assert set(PRIMITIVES) - {"operand", "const", "round", "row_sum"} <= set(formula._TORCH)
