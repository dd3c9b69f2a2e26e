"""merge_qkv: Q, K, V projections over one input become one linear and a split."""

from __future__ import annotations

import pytest

from llmc.passes.merge_qkv import merge_qkv
from pass_checks import (PREFILL_STEPS, TINY, TINY_QWEN, assert_same_numbers, hits, ir, printed, random_weights,
                         run_pass, steps_for, traced_before)

ROPE = "head_dim=12, theta=10000.0, scaling=None"
ATTN = "num_heads=6, num_kv_heads=3, head_dim=12, scale=0.25"

BEFORE = f"""
graph prefill {{
  %x = input() : f32[T,72]
  %positions = input() : i64[T]
  %query_start_loc = input() : i32[S+1]
  %w.q = weight() : f32[72,72]
  %w.k = weight() : f32[36,72]
  %w.v = weight() : f32[36,72]
  %0 = linear(%x, %w.q) : f32[T,72]
  %1 = rope(%0, %positions, {ROPE}) : f32[T,72]
  %2 = linear(%x, %w.k) : f32[T,36]
  %3 = rope(%2, %positions, {ROPE}) : f32[T,36]
  %4 = linear(%x, %w.v) : f32[T,36]
  %5 = attention(%1, %3, %4, %query_start_loc, {ATTN}) : f32[T,72]
  return %5
}}
"""

AFTER = f"""
graph prefill {{
  %x = input() : f32[T,72]
  %positions = input() : i64[T]
  %query_start_loc = input() : i32[S+1]
  %w.q = weight() : f32[72,72]
  %w.k = weight() : f32[36,72]
  %w.v = weight() : f32[36,72]
  %0 = concat(%w.q, %w.k, %w.v, dim=0) : f32[144,72]
  %1 = linear(%x, %0) : f32[T,144]
  %2 = split(%1, sizes=[72, 36, 36]) : f32[T,72], f32[T,36], f32[T,36]
  %3 = rope(%2, %positions, {ROPE}) : f32[T,72]
  %4 = rope(%2#1, %positions, {ROPE}) : f32[T,36]
  %5 = attention(%3, %4, %2#2, %query_start_loc, {ATTN}) : f32[T,72]
  return %5
}}
"""


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(merge_qkv, ir(BEFORE))
    assert str(after) == printed(AFTER)
    assert hits(ctx) == 3  # three projections replaced


def test_numbers_are_unchanged():
    before = ir(BEFORE)
    after, _ = run_pass(merge_qkv, before)
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS)


def test_projections_of_different_inputs_are_left_alone():
    """Near-miss: V reads another tensor than Q and K (as cross-attention would)."""
    text = BEFORE.replace("%4 = linear(%x, %w.v)", "%4 = linear(%x2, %w.v)").replace(
        "%positions = input()", "%x2 = input() : f32[T,72]\n  %positions = input()")
    graph = ir(text)
    after, ctx = run_pass(merge_qkv, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("config", [TINY, TINY_QWEN], ids=["llama", "qwen2_bias"])
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_keeps_its_numbers(config, entry):
    graph, weights = traced_before("merge_qkv", entry, config)
    after, ctx = run_pass(merge_qkv, graph)
    assert hits(ctx) == 3 * config.num_layers
    assert after.op_counts()["split"] == config.num_layers
    assert after.op_counts()["concat"] == (2 if config.qkv_bias else 1) * config.num_layers
    assert_same_numbers(graph, after, weights, steps_for(graph))


@pytest.mark.parametrize("op,extra,widths", [("head_rmsnorm", ", head_dim=12", (12, 12)), ("rmsnorm", "", (72, 36))])
def test_q_k_norms_between_projection_and_rope_still_merge(op, extra, widths):
    """Qwen3 / Gemma 3 (per head) and OLMo-2 (whole row): the norm reads the split's result."""
    norms = (f"  %w.qn = weight() : f32[{widths[0]}]\n  %w.kn = weight() : f32[{widths[1]}]\n"
             f"  %0 = linear(%x, %w.q) : f32[T,72]\n  %6 = {op}(%0, %w.qn, eps=1e-06{extra}) : f32[T,72]\n")
    before = ir(BEFORE.replace("  %0 = linear(%x, %w.q) : f32[T,72]\n", norms)
                .replace("rope(%0,", "rope(%6,")
                .replace("  %3 = rope(%2,", f"  %7 = {op}(%2, %w.kn, eps=1e-06{extra}) : f32[T,36]\n  %3 = rope(%7,"))
    after, ctx = run_pass(merge_qkv, before)
    assert hits(ctx) == 3
    text = str(after)
    assert f"= {op}(%2, %w.qn" in text and f"= {op}(%2#1, %w.kn" in text and "= split(%1," in text
    assert_same_numbers(before, after, random_weights(before), PREFILL_STEPS)
