"""The frontend's elementwise tracing and Gemma's elementwise ops: `F.gelu(x, approximate="tanh")`
becomes gelu_tanh (an exact-erf gelu is refused in one sentence), a tensor times a Python number
becomes `scale` (a tensor times a tensor stays `mul`), the `softcap` leaf becomes softcap; scale
rounds its factor to x's dtype as Gemma's normalizer does, and softcap rounds as transformers'
Gemma 2 computes its logits."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from llmc.compiler.formula import Row, evaluate
from llmc.compiler.frontend import _Builder, _lower_node
from llmc.compiler.ir import IRError, TensorType
from llmc.compiler.ops import OPS
from llmc.compiler.ops.elementwise import scale_ref, softcap_ref
from llmc.models import blocks


class Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


def lowered(fn) -> list[tuple[str, dict]]:
    """(op, attrs) of every IR node `fn(x, y)` traces into, x and y f32[T, 8]."""
    fx_graph = torch.fx.Tracer().trace(Calls(fn))
    builder = _Builder("prefill", Calls(fn))
    types = {"x": TensorType("f32", ("T", 8)), "y": TensorType("f32", ("T", 8))}
    for node in fx_graph.nodes:
        _lower_node(builder, node, types)
    return [(n.op, n.attrs) for n in builder.graph.nodes if n.op != "input"]


@pytest.mark.parametrize("fn, want", [
    (lambda x, y: F.gelu(x, approximate="tanh"), [("gelu_tanh", {})]),
    (lambda x, y: x * 2.5, [("scale", {"factor": 2.5})]),
    (lambda x, y: 3 * x, [("scale", {"factor": 3.0})]),
    (lambda x, y: torch.mul(x, 0.5), [("scale", {"factor": 0.5})]),
    (lambda x, y: x * y, [("mul", {})]),
    (lambda x, y: blocks.softcap(x, 30.0), [("softcap", {"cap": 30.0})]),
    (lambda x, y: F.gelu(x, approximate="tanh") * y, [("gelu_tanh", {}), ("mul", {})]),
], ids=["gelu_tanh", "tensor_times_float", "int_times_tensor", "torch_mul_float", "tensor_times_tensor",
        "softcap", "geglu"])
def test_calls_trace_into_their_ops(fn, want):
    assert lowered(fn) == want


@pytest.mark.parametrize("fn, words", [
    (lambda x, y: F.gelu(x), "approximate"),
    (lambda x, y: F.gelu(x, approximate="none"), "approximate"),
    (lambda x, y: x + 1.0, "add takes tensors only"),
])
def test_calls_without_an_op_are_one_sentence(fn, words):
    with pytest.raises(IRError, match=words) as caught:
        lowered(fn)
    assert caught.value.args[0].count(". ") == 0


def test_scale_rounds_its_factor_to_x_dtype_exactly_as_gemma_does():
    """bf16: the formula (fp32 math, one rounding) equals x * torch.tensor(factor, bf16) bit for
    bit; x * the unrounded factor differs, so the rounding is what the op claims."""
    factor = math.sqrt(3072)                                   # Gemma 7B's hidden; 55.43 -> 55.5 in bf16
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    gemma = x * torch.tensor(factor, dtype=torch.bfloat16)
    exprs = OPS["scale"].formula(Row({"x": 256}, {"x": "bf16"}, ["bf16"]), {"factor": factor})
    (got,) = evaluate(exprs, {"x": x}, ["bf16"])
    assert torch.equal(scale_ref(x, factor), gemma) and torch.equal(got, gemma)
    assert not torch.equal((x.float() * factor).bfloat16(), gemma)


def test_softcap_rounds_each_step_as_transformers_gemma2():
    x = (torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * 40).bfloat16()
    logits = x / 30.0
    logits = torch.tanh(logits)
    logits = logits * 30.0
    assert torch.equal(softcap_ref(x, 30.0), logits)
    exprs = OPS["softcap"].formula(Row({"x": 300}, {"x": "bf16"}, ["bf16"]), {"cap": 30.0})
    (got,) = evaluate(exprs, {"x": x}, ["bf16"])
    assert torch.equal(got, logits) and got.abs().max() <= 30.0


@pytest.mark.parametrize("op, attrs", [("scale", {"factor": "2"}), ("softcap", {"cap": 0.0}),
                                       ("softcap", {"cap": True})])
def test_a_bad_number_attribute_is_refused(op, attrs):
    from llmc.compiler.ops import infer_types
    with pytest.raises(IRError, match="must be a"):
        infer_types(op, [TensorType("f32", ("T", 8))], attrs)


def test_operator_mul_lists_both_of_its_ops():
    assert [name for name, r in OPS.items() if operator.mul in r.traced] == ["mul", "scale"]
