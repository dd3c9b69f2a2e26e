"""fuse_rope_kv_write: rope of q and k + kv_write -> rope_kv_write (packed after merge_qkv)."""

from __future__ import annotations

import pytest

from llmc.passes.fuse_rope_kv_write import fuse_rope_kv_write
from pass_checks import (PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, run_pass, steps_for,
                         traced_before)

ROPE = "head_dim=12, theta=10000.0, scaling=None"
KV = "layer=0, num_kv_heads=3, head_dim=12"
ATTN = "layer=0, num_heads=6, num_kv_heads=3, head_dim=12, scale=0.25"
CACHE = "f32[1,2,NB,3,BS,12]"
INPUTS = f"""
  %positions = input() : i64[T]
  %query_start_loc = input() : i32[S+1]
  %kv_cache = input() : {CACHE}
  %slot_mapping = input() : i64[T]
  %block_tables = input() : i32[S,MB]
  %seq_lens = input() : i32[S]
  %qkv = input() : f32[T,144]"""

BEFORE = f"""
graph prefill {{{INPUTS}
  %0 = split(%qkv, sizes=[72, 36, 36]) : f32[T,72], f32[T,36], f32[T,36]
  %1 = rope(%0, %positions, {ROPE}) : f32[T,72]
  %2 = rope(%0#1, %positions, {ROPE}) : f32[T,36]
  %3 = kv_write(%kv_cache, %2, %0#2, %slot_mapping, {KV}) : {CACHE}
  %4 = paged_attention(%1, %3, %block_tables, %seq_lens, %query_start_loc, {ATTN}) : f32[T,72]
  return %4, %3
}}
"""

AFTER = f"""
graph prefill {{{INPUTS}
  %0 = split(%qkv, sizes=[72, 36, 36]) : f32[T,72], f32[T,36], f32[T,36]
  %1 = rope(%0, %positions, {ROPE}) : f32[T,72]
  %2 = rope(%0#1, %positions, {ROPE}) : f32[T,36]
  %3 = rope_kv_write(%qkv, %positions, %kv_cache, %slot_mapping, layer=0, num_heads=6, num_kv_heads=3, \
head_dim=12, theta=10000.0, scaling=None) : f32[T,72], {CACHE}
  %4 = paged_attention(%3, %3#1, %block_tables, %seq_lens, %query_start_loc, {ATTN}) : f32[T,72]
  return %4, %3#1
}}
"""


def _unpacked(text: str) -> str:
    """The same graph with q, k, v as separate inputs (no merge_qkv)."""
    return (text.replace("  %qkv = input() : f32[T,144]", "  %q = input() : f32[T,72]\n  %k = input() : f32[T,36]\n"
                         "  %v = input() : f32[T,36]")
            .replace("  %0 = split(%qkv, sizes=[72, 36, 36]) : f32[T,72], f32[T,36], f32[T,36]\n", "")
            .replace("rope(%0,", "rope(%q,").replace("rope(%0#1,", "rope(%k,").replace("%0#2", "%v"))


def test_printed_before_and_after_and_counter():
    after, ctx = run_pass(fuse_rope_kv_write, ir(BEFORE))
    assert str(after) == printed(AFTER)
    assert hits(ctx) == 1


@pytest.mark.parametrize("before", [BEFORE, _unpacked(BEFORE)], ids=["packed", "separate"])
def test_numbers_and_cache_contents_are_unchanged_exactly(before):
    graph = ir(before)
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert hits(ctx) == 1
    inputs = 4 if "%qkv" in before else 6
    assert [len(n.inputs) for n in after.nodes if n.op == "rope_kv_write"] == [inputs]
    assert_same_numbers(graph, after, {}, PREFILL_STEPS, exact=True)


def test_a_roped_key_read_elsewhere_is_left_alone():
    """Near-miss: the roped k is also returned, so it must still exist on its own."""
    graph = ir(BEFORE.replace("return %4, %3", "return %4, %3, %2"))
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_keeps_its_numbers(entry):
    graph, weights = traced_before("fuse_rope_kv_write", entry)
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert hits(ctx) == TINY.num_layers
    assert "kv_write" not in after.op_counts()
    assert_same_numbers(graph, after, weights, steps_for(graph), exact=True)
