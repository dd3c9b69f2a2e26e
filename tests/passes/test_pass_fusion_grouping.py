"""fusion_grouping: ops partitioned into kernels, recorded as group=N; numbers untouched."""

from __future__ import annotations

import pytest

from llmc.compiler.ir import parse_graph, print_graph
from llmc.passes.fusion_grouping import fusion_grouping, partition
from pass_checks import (PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         steps_for, traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.o = weight() : f32[72,72]
  %w.n = weight() : f32[72]
  %0 = linear(%x, %w.o) : f32[T,72]
  %1 = add(%0, %r) : f32[T,72]
  %2 = silu(%1) : f32[T,72]
  %3 = rmsnorm(%2, %w.n, eps=1e-05) : f32[T,72]
  %4 = linear(%3, %w.o) : f32[T,72]
  %5 = mul(%4, %4) : f32[T,72]
  %6 = add(%5, %4) : f32[T,72]
  return %6
}
"""

# linear -> add -> silu is one kernel (GEMM + epilogue); the rmsnorm cannot join it (a GEMM
# and a row-wise op in one kernel); the second linear's result has two readers, so it stays
# alone, while mul -> add chain into one elementwise kernel.
AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.o = weight() : f32[72,72]
  %w.n = weight() : f32[72]
  %0 = linear(%x, %w.o, group=0) : f32[T,72]
  %1 = add(%0, %r, group=0) : f32[T,72]
  %2 = silu(%1, group=0) : f32[T,72]
  %3 = rmsnorm(%2, %w.n, eps=1e-05) : f32[T,72]
  %4 = linear(%3, %w.o) : f32[T,72]
  %5 = mul(%4, %4, group=1) : f32[T,72]
  %6 = add(%5, %4, group=1) : f32[T,72]
  return %6
}
"""


def test_printed_before_and_after_counter_and_round_trip():
    after, ctx = run_pass(fusion_grouping, ir(BEFORE))
    assert str(after) == printed(AFTER)
    assert hits(ctx) == 5
    assert parse_graph(print_graph(after)) == after


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    after, _ = run_pass(fusion_grouping, before)
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS, exact=True)


def test_a_gemm_whose_result_has_two_readers_is_not_grouped():
    """Near-miss: the add would fuse as an epilogue, but the linear result is read twice; the
    add and silu then become the prologue of the rmsnorm instead."""
    text = BEFORE.replace("return %6", "return %6, %0")
    groups = partition(ir(text))
    assert ["0"] in groups and ["1", "2", "3"] in groups


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_final_graph_keeps_its_numbers_exactly(entry):
    graph, weights = traced_before("fusion_grouping", entry)
    after, ctx = run_pass(fusion_grouping, graph)
    # per layer: the gate/up GEMM with its silu_mul epilogue
    assert hits(ctx) == 2 * TINY.num_layers
    assert_same_numbers(graph, after, weights, steps_for(graph), exact=True)
