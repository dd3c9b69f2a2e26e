"""fold_weights: weight-only nodes become new stored weights with canonical names."""

from __future__ import annotations

import pytest
import torch

from llmc.passes.fold_weights import fold_weights, merged_name
from pass_checks import (PREFILL_STEPS, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         steps_for, traced_before)

BEFORE = """
graph prefill {
  %x = input() : f32[T,72]
  %w.layers.0.gate_proj.weight = weight() : f32[120,72]
  %w.layers.0.up_proj.weight = weight() : f32[120,72]
  %0 = concat(%w.layers.0.gate_proj.weight, %w.layers.0.up_proj.weight, dim=0) : f32[240,72]
  %1 = linear(%x, %0) : f32[T,240]
  return %1
}
"""

AFTER = """
graph prefill {
  %x = input() : f32[T,72]
  %w.layers.0.gate_proj.weight = weight() : f32[120,72]
  %w.layers.0.up_proj.weight = weight() : f32[120,72]
  %w.layers.0.gate_up_proj.weight = weight() : f32[240,72]
  %0 = linear(%x, %w.layers.0.gate_up_proj.weight) : f32[T,240]
  return %0
}
"""


def test_printed_before_and_after_counter_and_tensor():
    before = ir(BEFORE)
    weights = random_weights(before)
    after, ctx = run_pass(fold_weights, before, weights)
    assert str(after) == printed(AFTER)  # the old weights are left for dce
    assert hits(ctx) == 1
    want = torch.cat([weights["layers.0.gate_proj.weight"], weights["layers.0.up_proj.weight"]])
    assert torch.equal(weights["layers.0.gate_up_proj.weight"], want)


def test_numbers_are_unchanged_exactly():
    before = ir(BEFORE)
    weights = random_weights(before)
    after, _ = run_pass(fold_weights, before, weights)
    assert_same_numbers(before, after, weights, PREFILL_STEPS, exact=True)


def test_without_weight_data_only_the_graph_changes():
    after, ctx = run_pass(fold_weights, ir(BEFORE), None)
    assert str(after) == printed(AFTER) and ctx.weights is None


def test_nodes_reading_an_input_are_left_alone():
    """Near-miss: the linear reads a weight but also an input, so it is not a constant."""
    graph = ir(AFTER)
    after, ctx = run_pass(fold_weights, graph, random_weights(graph))
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("names, want", [
    (["layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.v_proj.weight"], "layers.0.qkv_proj.weight"),
    (["layers.3.q_proj.bias", "layers.3.k_proj.bias", "layers.3.v_proj.bias"], "layers.3.qkv_proj.bias"),
    (["layers.10.gate_proj.weight", "layers.10.up_proj.weight"], "layers.10.gate_up_proj.weight"),
])
def test_merged_weights_get_canonical_names(names, want):
    assert merged_name(names) == want


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_keeps_its_numbers(entry):
    graph, weights = traced_before("fold_weights", entry)
    after, ctx = run_pass(fold_weights, graph, weights)
    assert hits(ctx) == 2 * 2  # per layer: qkv weight, gate_up weight
    assert "concat" not in after.op_counts()
    assert "layers.1.qkv_proj.weight" in weights
    assert_same_numbers(graph, after, weights, steps_for(graph), exact=True)
