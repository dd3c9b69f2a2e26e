"""dce: nodes that reach no output or side effect are removed; kv writes always stay."""

from __future__ import annotations

from llmc.passes.dce import dce
from pass_checks import PREFILL_STEPS, assert_same_numbers, hits, ir, printed, run_pass

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %unused = input() : f32[T,72]
  %kv_cache = input() : f32[1,2,NB,3,BS,12]
  %k = input() : f32[T,36]
  %slot_mapping = input() : i64[T]
  %0 = silu(%x) : f32[T,72]
  %1 = mul(%0, %0) : f32[T,72]
  %2 = kv_write(%kv_cache, %k, %k, %slot_mapping, layer=0, num_kv_heads=3, head_dim=12) : f32[1,2,NB,3,BS,12]
  %3 = add(%x, %x) : f32[T,72]
  return %3
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %kv_cache = input() : f32[1,2,NB,3,BS,12]
  %k = input() : f32[T,36]
  %slot_mapping = input() : i64[T]
  %0 = kv_write(%kv_cache, %k, %k, %slot_mapping, layer=0, num_kv_heads=3, head_dim=12) : f32[1,2,NB,3,BS,12]
  %1 = add(%x, %x) : f32[T,72]
  return %1
}
"""


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(dce, ir(BEFORE))
    assert str(after) == printed(AFTER)
    assert hits(ctx) == 3  # silu, mul, the unused input


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    after, _ = run_pass(dce, before)
    assert_same_numbers(before, after, {}, PREFILL_STEPS, exact=True)


def test_a_live_graph_is_left_alone():
    """Near-miss: a kv_write whose result nobody reads is still live (it writes the cache)."""
    graph = ir(AFTER)
    after, ctx = run_pass(dce, graph)
    assert str(after) == str(graph) and hits(ctx) == 0
