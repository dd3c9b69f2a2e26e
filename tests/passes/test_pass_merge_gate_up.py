"""merge_gate_up: the gated MLP's (SwiGLU, GeGLU) gate and up projections become one linear and a split."""

from __future__ import annotations

import pytest

from llmc.passes.merge_gate_up import merge_gate_up
from pass_checks import (PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         steps_for, traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %w.gate = weight() : f32[120,72]
  %w.up = weight() : f32[120,72]
  %0 = linear(%x, %w.gate) : f32[T,120]
  %1 = silu(%0) : f32[T,120]
  %2 = linear(%x, %w.up) : f32[T,120]
  %3 = mul(%1, %2) : f32[T,120]
  return %3
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %w.gate = weight() : f32[120,72]
  %w.up = weight() : f32[120,72]
  %0 = concat(%w.gate, %w.up, dim=0) : f32[240,72]
  %1 = linear(%x, %0) : f32[T,240]
  %2 = split(%1, sizes=[120, 120]) : f32[T,120], f32[T,120]
  %3 = silu(%2) : f32[T,120]
  %4 = mul(%3, %2#1) : f32[T,120]
  return %4
}
"""


ACTIVATIONS = {"silu": lambda text: text, "gelu_tanh": lambda text: text.replace("silu(", "gelu_tanh(")}


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_printed_before_and_after_and_counter(act):
    after, ctx = run_pass(merge_gate_up, ir(ACTIVATIONS[act](BEFORE)))
    assert str(after) == printed(ACTIVATIONS[act](AFTER))
    assert hits(ctx) == 2


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_numbers_are_unchanged(act):
    before = ir(ACTIVATIONS[act](BEFORE))
    after, _ = run_pass(merge_gate_up, before)
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS)


def test_operands_in_the_other_order_merge_the_same_way():
    graph = ir(BEFORE.replace("mul(%1, %2)", "mul(%2, %1)"))
    after, ctx = run_pass(merge_gate_up, graph)
    assert "concat(%w.gate, %w.up, dim=0)" in str(after) and hits(ctx) == 2


def test_projection_with_a_bias_the_other_lacks_is_left_alone():
    """Near-miss: the up projection has a bias, the gate none: one GEMM cannot hold both."""
    text = BEFORE.replace("%2 = linear(%x, %w.up)", "%2 = linear(%x, %w.up, %w.up_bias)").replace(
        "%w.up = weight() : f32[120,72]", "%w.up = weight() : f32[120,72]\n  %w.up_bias = weight() : f32[120]")
    graph = ir(text)
    after, ctx = run_pass(merge_gate_up, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_keeps_its_numbers(entry):
    graph, weights = traced_before("merge_gate_up", entry)
    after, ctx = run_pass(merge_gate_up, graph)
    assert hits(ctx) == 2 * TINY.num_layers
    assert_same_numbers(graph, after, weights, steps_for(graph))
