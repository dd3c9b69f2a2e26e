"""fuse_silu_mul: silu(gate) * up -> silu_mul, packed when gate and up halve one split."""

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


@pytest.mark.parametrize("before, want", [(BEFORE, AFTER), (PACKED_BEFORE, PACKED_AFTER)], ids=["two", "packed"])
def test_printed_before_and_after_and_counter(before, want):
    after, ctx = run_pass(fuse_silu_mul, ir(before))
    assert str(after) == printed(want)
    assert hits(ctx) == 1


@pytest.mark.parametrize("before", [BEFORE, PACKED_BEFORE], ids=["two", "packed"])
def test_numbers_are_unchanged_exactly(before):
    graph = ir(before)
    after, _ = run_pass(fuse_silu_mul, graph)
    assert_same_numbers(graph, after, {}, PREFILL_STEPS, exact=True)


def test_a_silu_read_elsewhere_is_left_alone():
    """Near-miss: the silu result is also returned, so it must still be computed alone."""
    graph = ir(BEFORE.replace("return %1", "return %1, %0"))
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
