"""fuse_add_rmsnorm: residual add + RMSNorm -> add_rmsnorm returning (normed, sum)."""

from __future__ import annotations

import pytest

from llmc.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from pass_checks import (PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         steps_for, traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.norm = weight() : f32[72]
  %0 = add(%x, %r) : f32[T,72]
  %1 = rmsnorm(%0, %w.norm, eps=1e-05) : f32[T,72]
  %2 = mul(%1, %0) : f32[T,72]
  return %2, %0
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.norm = weight() : f32[72]
  %0 = add(%x, %r) : f32[T,72]
  %1 = add_rmsnorm(%x, %r, %w.norm, eps=1e-05) : f32[T,72], f32[T,72]
  %2 = mul(%1, %1#1) : f32[T,72]
  return %2, %1#1
}
"""

TWO_NORMS = """
graph prefill {
  %x = input() : f32[T,72]
  %r = input() : f32[T,72]
  %w.a = weight() : f32[72]
  %w.b = weight() : f32[72]
  %0 = add(%x, %r) : f32[T,72]
  %1 = rmsnorm(%0, %w.a, eps=1e-05) : f32[T,72]
  %2 = rmsnorm(%0, %w.b, eps=1e-05) : f32[T,72]
  %3 = mul(%1, %2) : f32[T,72]
  return %3
}
"""


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(fuse_add_rmsnorm, ir(BEFORE))
    assert str(after) == printed(AFTER)  # the old add is dead, left for dce
    assert hits(ctx) == 1


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    after, _ = run_pass(fuse_add_rmsnorm, before)
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS, exact=True)


def test_a_sum_that_two_norms_read_is_left_alone():
    """Near-miss: fusing both norms would compute the add twice."""
    graph = ir(TWO_NORMS)
    after, ctx = run_pass(fuse_add_rmsnorm, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_keeps_its_numbers(entry):
    graph, weights = traced_before("fuse_add_rmsnorm", entry)
    after, ctx = run_pass(fuse_add_rmsnorm, graph)
    assert hits(ctx) == 2 * TINY.num_layers  # every residual add is read by a norm
    assert after.op_counts()["rmsnorm"] == 1   # only the first layer's norm of the embedding
    assert_same_numbers(graph, after, weights, steps_for(graph), exact=True)


def test_a_norms_rounding_is_carried():
    """rmsnorm's optional attr rounding (Gemma, OLMo-2: "product") reaches the fused op."""
    with_rounding = BEFORE.replace("eps=1e-05)", "eps=1e-05, rounding='product')")
    after, ctx = run_pass(fuse_add_rmsnorm, ir(with_rounding))
    assert str(after) == printed(AFTER.replace("eps=1e-05)", "eps=1e-05, rounding='product')"))
    assert hits(ctx) == 1
