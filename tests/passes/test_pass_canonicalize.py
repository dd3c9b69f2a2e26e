"""canonicalize: identity casts dropped, commutative operands ordered by definition."""

from __future__ import annotations

from llmc.passes.canonicalize import canonicalize
from pass_checks import (PREFILL_STEPS, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %y = input() : f32[T,72]
  %0 = silu(%y) : f32[T,72]
  %1 = add(%0, %x) : f32[T,72]
  %2 = cast(%1, dtype='f32') : f32[T,72]
  %3 = mul(%x, %2) : f32[T,72]
  %4 = cast(%3, dtype='f16') : f16[T,72]
  return %4
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %y = input() : f32[T,72]
  %0 = silu(%y) : f32[T,72]
  %1 = add(%x, %0) : f32[T,72]
  %2 = mul(%x, %1) : f32[T,72]
  %3 = cast(%2, dtype='f16') : f16[T,72]
  return %3
}
"""


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(canonicalize, ir(BEFORE))
    assert str(after) == printed(AFTER)
    assert hits(ctx) == 2  # one swap, one identity cast


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    after, _ = run_pass(canonicalize, before)
    assert_same_numbers(before, after, {}, PREFILL_STEPS, exact=True)


def test_near_misses_are_left_alone():
    """A cast that changes the dtype and operands already in order stay as they are."""
    graph = ir(AFTER)
    after, ctx = run_pass(canonicalize, graph)
    assert str(after) == str(graph)
    assert hits(ctx) == 0


def test_traced_model_is_already_canonical():
    graph, _ = traced_before("canonicalize")
    after, ctx = run_pass(canonicalize, graph)
    assert hits(ctx) == 0 and str(after) == str(graph)
    assert_same_numbers(graph, after, random_weights(graph), PREFILL_STEPS, exact=True)
