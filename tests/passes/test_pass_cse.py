"""cse: identical pure computations computed once; attributes and side effects respected."""

from __future__ import annotations

from llmc.passes.cse import cse
from pass_checks import (PREFILL_STEPS, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %w.n = weight() : f32[72]
  %0 = silu(%x) : f32[T,72]
  %1 = silu(%x) : f32[T,72]
  %2 = add(%0, %1) : f32[T,72]
  %3 = rmsnorm(%2, %w.n, eps=1e-05) : f32[T,72]
  %4 = rmsnorm(%2, %w.n, eps=1e-06) : f32[T,72]
  %5 = add(%3, %4) : f32[T,72]
  return %5
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %w.n = weight() : f32[72]
  %0 = silu(%x) : f32[T,72]
  %1 = add(%0, %0) : f32[T,72]
  %2 = rmsnorm(%1, %w.n, eps=1e-05) : f32[T,72]
  %3 = rmsnorm(%1, %w.n, eps=1e-06) : f32[T,72]
  %4 = add(%2, %3) : f32[T,72]
  return %4
}
"""

SIDE_EFFECTS = """
graph prefill {
  %kv_cache = input() : f32[1,2,NB,3,BS,12]
  %k = input() : f32[T,36]
  %slot_mapping = input() : i64[T]
  %0 = kv_write(%kv_cache, %k, %k, %slot_mapping, layer=0, num_kv_heads=3, head_dim=12) : f32[1,2,NB,3,BS,12]
  %1 = kv_write(%kv_cache, %k, %k, %slot_mapping, layer=0, num_kv_heads=3, head_dim=12) : f32[1,2,NB,3,BS,12]
  return %1
}
"""


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(cse, ir(BEFORE))
    assert str(after) == printed(AFTER)  # the eps=1e-06 norm differs in an attribute: kept
    assert hits(ctx) == 1


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    after, _ = run_pass(cse, before)
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS, exact=True)


def test_ops_with_side_effects_are_never_merged():
    graph = ir(SIDE_EFFECTS)
    after, ctx = run_pass(cse, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


def test_traced_model_has_nothing_to_merge_and_keeps_its_numbers():
    graph, weights = traced_before("cse")
    after, ctx = run_pass(cse, graph)
    assert hits(ctx) == 0
    assert_same_numbers(graph, after, weights, PREFILL_STEPS, exact=True)
