"""fuse_silu_mul: silu(gate) * up -> silu_mul and gelu_tanh(gate) * up -> gelu_tanh_mul, packed
when gate and up halve one split."""

from __future__ import annotations

import pytest

from llmc.passes.fuse_silu_mul import fuse_silu_mul
from pass_checks import PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, run_pass, steps_for, traced_before

BEFORE = """
graph prefill {
  %g = input() : f32[T,120]
  %u = input() : f32[T,120]
  %0 = silu(%g) : f32[T,120]
  %1 = mul(%u, %0) : f32[T,120]
  return %1
}
"""

AFTER = """
graph prefill {
  %g = input() : f32[T,120]
  %u = input() : f32[T,120]
  %0 = silu(%g) : f32[T,120]
  %1 = silu_mul(%g, %u) : f32[T,120]
  return %1
}
"""

PACKED_BEFORE = """
graph prefill {
  %x = input() : f32[T,240]
  %0 = split(%x, sizes=[120, 120]) : f32[T,120], f32[T,120]
  %1 = silu(%0) : f32[T,120]
  %2 = mul(%1, %0#1) : f32[T,120]
  return %2
}
"""

PACKED_AFTER = """
graph prefill {
  %x = input() : f32[T,240]
  %0 = split(%x, sizes=[120, 120]) : f32[T,120], f32[T,120]
  %1 = silu(%0) : f32[T,120]
  %2 = silu_mul(%x) : f32[T,120]
  return %2
}
"""




def gelu(text: str) -> str:
    """The SwiGLU case as GeGLU (Gemma's MLP): gelu_tanh for silu, gelu_tanh_mul for silu_mul."""
    return text.replace("silu(", "gelu_tanh(").replace("silu_mul(", "gelu_tanh_mul(")


CASES = {"two": (BEFORE, AFTER), "packed": (PACKED_BEFORE, PACKED_AFTER),
         "gelu_two": (gelu(BEFORE), gelu(AFTER)), "gelu_packed": (gelu(PACKED_BEFORE), gelu(PACKED_AFTER))}


@pytest.mark.parametrize("case", list(CASES))
def test_printed_before_and_after_and_counter(case):
    before, want = CASES[case]
    after, ctx = run_pass(fuse_silu_mul, ir(before))
    assert str(after) == printed(want)
    assert hits(ctx) == 1


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_numbers_are_unchanged_exactly(case, dtype):
    graph = ir(CASES[case][0].replace("f32[", f"{dtype}["))
    after, _ = run_pass(fuse_silu_mul, graph)
    assert_same_numbers(graph, after, {}, PREFILL_STEPS, exact=True)


@pytest.mark.parametrize("case", ["two", "gelu_two"])
def test_an_activation_read_elsewhere_is_left_alone(case):
    """Near-miss: the activation's result is also returned, so it must still be computed alone."""
    graph = ir(CASES[case][0].replace("return %1", "return %1, %0"))
    after, ctx = run_pass(fuse_silu_mul, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


def test_an_activation_without_a_gated_op_is_left_alone():
    """Near-miss: scale(gate) * up has no gated op, so the mul stays."""
    graph = ir(BEFORE.replace("silu(%g)", "scale(%g, factor=2.0)"))
    after, ctx = run_pass(fuse_silu_mul, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_keeps_its_numbers(entry):
    graph, weights = traced_before("fuse_silu_mul", entry)
    after, ctx = run_pass(fuse_silu_mul, graph)
    assert hits(ctx) == TINY.num_layers
    fused = [n for n in after.nodes if n.op == "silu_mul"]
    assert all(len(n.inputs) == 1 for n in fused)  # merge_gate_up ran: the packed form
    assert_same_numbers(graph, after, weights, steps_for(graph), exact=True)
