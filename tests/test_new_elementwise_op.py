"""A new elementwise op is one definition: `mish` (an activation llmc has no op for) is registered
here, in one record with its reference and formula, and nothing else in llmc changes. A tiny
graph that uses it runs on the torch backend, in Triton's interpreter from the generated kernel,
and as a CPU step plan with a generated C++ kernel; each equals the op's reference, which is
torch's own `F.mish`."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.formula import exp
from llmc.compiler.ops import OpRecord, operands, registered
from llmc.compiler.ops.elementwise import unary_float
from llmc.runtime.torch_backend import interpret
from test_codegen_kernels import graph_of, inputs_for, run_generated
from tolerances import assert_as_close_as_ref, tolerance


def mish_formula(row, attrs):
    """x tanh(softplus(x)) = x n / (n + 2), n = e^x (e^x + 2): tanh(log(1 + e^x)) without a log."""
    x = row["x"]
    n = exp(x) * (exp(x) + 2)
    return (x * n / (n + 2),)


MISH = OpRecord("mish", (operands("x"),), (), unary_float, "elementwise", "x * tanh(softplus(x))",
                reference=lambda x, a: F.mish(x.x), formula=mish_formula)


CASES = {"mish": """
        %x = input() : {dt}[T,100]
        %y = input() : {dt}[T,100]
        %0 = mish(%x) : {dt}[T,100]
        %1 = mul(%0, %y) : {dt}[T,100]
        return %1"""}


@pytest.fixture
def mish_op():
    with registered(MISH) as record:
        yield record


def _reference(feeds, dtype):
    return F.mish(feeds["x"]) * feeds["y"]


@pytest.mark.parametrize("tokens", [1, 5])
def test_torch_backend_runs_the_new_op_as_its_reference(mish_op, tokens):
    graph = graph_of("mish", "f32", CASES)
    feeds, weights = inputs_for(graph, tokens)
    (got,) = interpret(graph, weights, feeds)
    assert torch.equal(got, _reference(feeds, torch.float32))


@pytest.mark.parametrize("tokens", [1, 5])
def test_triton_kernel_generated_from_the_formula_equals_the_reference(mish_op, tokens, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    os.environ["TRITON_INTERPRET"] = "1"
    graph = graph_of("mish", "f32", CASES)
    feeds, weights = inputs_for(graph, tokens)
    (got,), lowering = run_generated(graph, weights, feeds, tmp_path)
    assert any("mish" in name for name in lowering.modules)
    torch.testing.assert_close(got, _reference(feeds, torch.float32), **tolerance(torch.float32, 1))


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_step_plan_runs_the_generated_cpp_kernel_and_equals_the_reference(mish_op, tokens, dtype):
    from llmc.compiler.codegen.cpu_lowering import lower_cpu
    from llmc.kernels.generated import load_generated
    from llmc.kernels.native import load_native_kernels
    from llmc.runtime.cpu_program import CpuKernels
    from llmc.runtime.step_plan import lower_step_plan

    load_native_kernels()
    graph = graph_of("mish", dtype, CASES)
    lowering = lower_cpu({graph.name: graph})
    assert "mish" in lowering.source()
    kernels = CpuKernels({graph.name: graph}, lowering, load_generated(lowering.source()))
    feeds, weights = inputs_for(graph, tokens)
    (got,) = lower_step_plan(graph, weights, 16, kernels=kernels)(feeds)
    exact = _reference({k: v.double() for k, v in feeds.items()}, torch.float64)
    want = (F.mish(feeds["x"]) * feeds["y"])              # the reference, op by op in dtype
    assert_as_close_as_ref(got, want, exact, want.dtype, "max")
