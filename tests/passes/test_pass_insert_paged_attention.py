"""insert_paged_attention: attention -> kv_write + paged attention; same numbers from an empty cache."""

from __future__ import annotations

import re

import pytest

from llmc.passes.insert_paged_attention import insert_paged_attention
from pass_checks import TINY, assert_same_numbers, hits, ir, run_pass, steps_for, traced_before

NO_ATTENTION = """
graph prefill {
  %x = input() : f32[T,72]
  %0 = silu(%x) : f32[T,72]
  return %0
}
"""


@pytest.mark.parametrize("entry, paged", [("prefill", "paged_attention"), ("decode", "paged_decode_attention")])
def test_printed_lowering_counter_and_numbers(entry, paged):
    graph, weights = traced_before("insert_paged_attention", entry)
    after, ctx = run_pass(insert_paged_attention, graph)
    assert hits(ctx) == TINY.num_layers
    text = str(after)
    assert f"%kv_cache = input() : f32[{TINY.num_layers},2,NB,3,BS,12]" in text
    assert "%block_tables = input() : i32[S,MB]" in text
    assert "layer=1, num_kv_heads=3, head_dim=12)" in text       # the second layer's kv_write
    assert after.op_counts()[paged] == TINY.num_layers and "attention" not in after.op_counts()
    assert_same_numbers(graph, after, weights, steps_for(graph))


def test_a_graph_without_attention_is_left_alone():
    """Near-miss: no attention, so no cache inputs are added either."""
    graph = ir(NO_ATTENTION)
    after, ctx = run_pass(insert_paged_attention, graph)
    assert str(after) == str(graph) and hits(ctx) == 0


@pytest.mark.parametrize("entry, paged", [("prefill", "paged_attention"), ("decode", "paged_decode_attention")])
def test_window_and_softcap_are_carried(entry, paged):
    """The optional attrs of a windowed, soft-capped attention (Gemma's) reach the paged op; the
    numbers from an empty cache stay the cache-less attention's."""
    graph, weights = traced_before("insert_paged_attention", entry)
    options = "window=3, softcap=0.5"
    graph = ir(re.sub(r"(= attention\(.*?)\)( :)", rf"\1, {options})\2", str(graph)))
    assert str(graph).count(options) == TINY.num_layers
    after, ctx = run_pass(insert_paged_attention, graph)
    assert hits(ctx) == TINY.num_layers
    assert len(re.findall(rf"= {paged}\(.*, {options}\) :", str(after))) == TINY.num_layers
    assert_same_numbers(graph, after, weights, steps_for(graph))
