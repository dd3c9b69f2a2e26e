"""Generated kernels in a step plan (instruction `generated`, runtime/step_plan.py states the ABI):
tiny C functions compiled here (out = x * w + 1 over a 1-D weight read with stride 0, then a
product with a 2-D constant read row by row) run in a plan built by hand through the encoder, and
through `lower_generated` in a lowered graph, equal to torch bit for bit at T = 1, 5 and 64 on one
thread and on two (the team splits the first output's rows); a constant with fewer rows than the
outputs, and inputs a generated kernel cannot take, are refused."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import textwrap

import pytest
import torch

from llmc.compiler.ir import parse_graph
from llmc.kernels.native import load_native_kernels
from llmc.kernels.step_plan_isa import encode
from llmc.runtime.plan_generated import lower_generated
from llmc.runtime.step_plan import LOWERINGS, NotPlannable, lower_step_plan

WIDTH = 48                               # not a power of two; baked into the kernels, as codegen does
SOURCE = """
#include <cstdint>
// ptrs/strides: the unit's inputs, then its outputs; rows [first, last) of the output.
extern "C" void scale_add_one(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const float* x = reinterpret_cast<const float*>(ptrs[0]) + r * strides[0];
    const float* w = reinterpret_cast<const float*>(ptrs[1]) + r * strides[1];
    float* out = reinterpret_cast<float*>(ptrs[2]) + r * strides[2];
    for (int j = 0; j < WIDTH; ++j) out[j] = x[j] * w[j] + 1.0f;
  }
}
extern "C" void mul_rows(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const float* a = reinterpret_cast<const float*>(ptrs[0]) + r * strides[0];
    const float* b = reinterpret_cast<const float*>(ptrs[1]) + r * strides[1];
    float* out = reinterpret_cast<float*>(ptrs[2]) + r * strides[2];
    for (int j = 0; j < WIDTH; ++j) out[j] = a[j] * b[j];
  }
}
"""


class Kernels:
    """The compiled library and its functions' addresses."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def address(self, name: str) -> int:
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> Kernels:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    load_native_kernels()
    folder = tmp_path_factory.mktemp("generated")
    (folder / "unit.cpp").write_text(SOURCE)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-ffp-contract=off", f"-DWIDTH={WIDTH}", "-o",
                    str(folder / "unit.so"), str(folder / "unit.cpp")], check=True)
    return Kernels(ctypes.CDLL(str(folder / "unit.so")))


def hand_built_plan(kernels: Kernels, w: torch.Tensor, m: torch.Tensor):
    """x -> (x * w + 1) into a register -> times m's rows into the output."""
    plan = torch.classes.llmc.StepPlan(False, False)
    x = plan.input(0, torch.empty(0))
    w_id, m_id = plan.constant(w), plan.constant(m)
    tmp, out = plan.temporary(0, WIDTH, False), plan.output(WIDTH, False)
    for instruction in (encode("generated", fn=kernels.address("scale_add_one"), num_inputs=2, values=[x, w_id, tmp]),
                        encode("generated", fn=kernels.address("mul_rows"), num_inputs=2, values=[tmp, m_id, out])):
        plan.add(instruction.opcode, instruction.args, instruction.f)
    return plan


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_a_hand_built_plan_runs_generated_kernels_as_torch_computes(kernels, tokens, threads):
    g = torch.Generator().manual_seed(tokens)
    w, m = torch.randn(WIDTH, generator=g), torch.randn(64, WIDTH, generator=g)
    x = torch.randn(tokens, WIDTH, generator=g)
    (out,) = hand_built_plan(kernels, w, m).run([x], tokens, tokens)
    assert torch.equal(out, (x * w + 1) * m[:tokens])
    assert tokens == 1 or not torch.equal(out, (x * w + 1) * m[0])      # m read row by row, w once for all


def test_a_constant_with_fewer_rows_than_the_outputs_is_refused(kernels):
    plan = hand_built_plan(kernels, torch.ones(WIDTH), torch.ones(64, WIDTH))
    with pytest.raises(RuntimeError, match="input 1 of a generated kernel has 64 rows, fewer than its outputs' 65"):
        plan.run([torch.ones(65, WIDTH)], 65, 65)


GRAPH = f"""\
    graph g {{
      %x = input() : f32[T,{WIDTH}]
      %w.norm = weight() : f32[{WIDTH}]
      %0 = rmsnorm(%x, %w.norm, eps=1e-05) : f32[T,{WIDTH}]
      %1 = mul(%0, %x) : f32[T,{WIDTH}]
      return %1
    }}
    """


def generated_lowerings(kernels: Kernels) -> dict:
    """LOWERINGS with rmsnorm run by a stand-in generated kernel (x * w + 1: the plan does not know
    what a generated kernel computes) and mul by another."""
    def unit(name):
        return lambda lo, node: lower_generated(lo, kernels.address(name), list(node.inputs), [node.value()],
                                                kernels.lib)
    return dict(LOWERINGS, rmsnorm=unit("scale_add_one"), mul=unit("mul_rows"))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_lower_generated_runs_a_graphs_units_in_the_plan(kernels, tokens, threads):
    graph = parse_graph(textwrap.dedent(GRAPH))
    w = torch.randn(WIDTH, generator=torch.Generator().manual_seed(1))
    program = lower_step_plan(graph, {"norm": w}, 16, generated_lowerings(kernels))
    assert program.keepalive == (kernels.lib, kernels.lib)           # the code stays mapped while the plan lives
    x = torch.randn(tokens, WIDTH, generator=torch.Generator().manual_seed(tokens))
    (out,) = program({"x": x})
    assert torch.equal(out, (x * w + 1) * x)
    outputs, times = program.timed({"x": x})
    assert torch.equal(outputs[0], out) and [t.label for t in times] == ["rmsnorm", "mul"]
    assert all(len(t.waits) == threads and min(t.waits) >= 0 for t in times)      # each thread's, at each barrier


def test_lower_generated_refuses_a_weight_it_cannot_read_by_rows(kernels):
    graph = parse_graph(textwrap.dedent(GRAPH))
    with pytest.raises(NotPlannable, match=r"0 \(rmsnorm\) reads %w.norm, not a 1-D or 2-D tensor"):
        lower_step_plan(graph, {"norm": torch.ones(2, 2, WIDTH)}, 16, generated_lowerings(kernels))
