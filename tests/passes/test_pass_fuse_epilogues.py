"""fuse_epilogues: linear + following residual add -> linear_add (a GEMM epilogue)."""

from __future__ import annotations

import pytest

from llmc.passes.fuse_epilogues import fuse_epilogues
from pass_checks import (PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         steps_for, traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.o = weight() : f32[72,72]
  %w.b = weight() : f32[72]
  %0 = linear(%x, %w.o, %w.b) : f32[T,72]
  %1 = add(%r, %0) : f32[T,72]
  return %1
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.o = weight() : f32[72,72]
  %w.b = weight() : f32[72]
  %0 = linear(%x, %w.o, %w.b) : f32[T,72]
  %1 = linear_add(%x, %w.o, %w.b, %r) : f32[T,72]
  return %1
}
"""


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(fuse_epilogues, ir(BEFORE))
    assert str(after) == printed(AFTER)
    assert hits(ctx) == 1


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    after, _ = run_pass(fuse_epilogues, before)
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS, exact=True)


def test_a_gemm_result_read_elsewhere_is_left_alone():
    """Near-miss: the linear's own result is returned too, so it cannot vanish into the add."""
    graph = ir(BEFORE.replace("return %1", "return %1, %0"))
    after, ctx = run_pass(fuse_epilogues, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_without_add_rmsnorm_fusion_gets_epilogues(entry):
    """With fuse_add_rmsnorm on, every residual add is taken by a norm; without it, by a GEMM."""
    graph, weights = traced_before("fuse_epilogues", entry, disabled=("fuse_add_rmsnorm",))
    after, ctx = run_pass(fuse_epilogues, graph)
    assert hits(ctx) == 2 * TINY.num_layers
    assert_same_numbers(graph, after, weights, steps_for(graph), exact=True)
    fused, _ = traced_before("fuse_epilogues", entry)
    assert hits(run_pass(fuse_epilogues, fused)[1]) == 0
