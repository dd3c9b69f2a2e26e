"""fuse_rope_kv_write: rope of q and k + kv_write -> rope_kv_write (packed after merge_qkv)."""

from __future__ import annotations

import pytest

from llmc.compiler.ir import format_node
from llmc.passes.fuse_rope_kv_write import fuse_rope_kv_write
from pass_checks import (PREFILL_STEPS, TINY, assert_same_numbers, hits, ir, printed, random_weights, run_pass,
                         steps_for, traced_before)

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


# q/k norms before RoPE: per head (Qwen3, Gemma 3: head_rmsnorm) or over the whole row (OLMo-2: rmsnorm)
NORM_WEIGHTS = {"head": ("f32[12]", "f32[12]"), "all": ("f32[72]", "f32[36]")}
NORM_OPS = {"head": ("head_rmsnorm", ", head_dim=12"), "all": ("rmsnorm", "")}


def normed(kind: str) -> str:
    """BEFORE with q and k normed between the split and their ropes."""
    op, extra = NORM_OPS[kind]
    qw, kw = NORM_WEIGHTS[kind]
    weights = f"\n  %w.q_norm = weight() : {qw}\n  %w.k_norm = weight() : {kw}"
    return (BEFORE.replace("%qkv = input() : f32[T,144]", "%qkv = input() : f32[T,144]" + weights)
            .replace("  %1 = rope(%0, %positions", f"  %5 = {op}(%0, %w.q_norm, eps=1e-06{extra}) : f32[T,72]\n"
                     f"  %6 = {op}(%0#1, %w.k_norm, eps=1e-06{extra}) : f32[T,36]\n  %1 = rope(%5, %positions")
            .replace("%2 = rope(%0#1,", "%2 = rope(%6,"))


@pytest.mark.parametrize("kind", ["head", "all"])
def test_norms_before_rope_are_absorbed(kind):
    graph = ir(normed(kind))
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert hits(ctx) == 1
    fused = [format_node(n) for n in after.nodes if n.op == "rope_kv_write"]
    assert fused == [f"%5 = rope_kv_write(%qkv, %positions, %kv_cache, %slot_mapping, %w.q_norm, %w.k_norm, layer=0, "
                     f"num_heads=6, num_kv_heads=3, head_dim=12, theta=10000.0, scaling=None, qk_norm='{kind}', "
                     f"norm_eps=1e-06) : f32[T,72], {CACHE}"]
    assert_same_numbers(graph, after, random_weights(graph), PREFILL_STEPS, exact=True)


@pytest.mark.parametrize("kind", ["head", "all"])
def test_norms_before_separate_q_k_v_are_absorbed(kind):
    graph = ir(_unpacked(normed(kind)).replace(f"{NORM_OPS[kind][0]}(%0,", f"{NORM_OPS[kind][0]}(%q,")
               .replace(f"{NORM_OPS[kind][0]}(%0#1,", f"{NORM_OPS[kind][0]}(%k,"))
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert hits(ctx) == 1
    assert [len(n.inputs) for n in after.nodes if n.op == "rope_kv_write"] == [8]
    assert_same_numbers(graph, after, random_weights(graph), PREFILL_STEPS, exact=True)


@pytest.mark.parametrize("change", ["q only", "normed k read elsewhere", "eps differs"])
def test_a_norm_near_miss_is_left_alone(change):
    text = normed("head")
    if change == "q only":
        text = text.replace("%2 = rope(%6,", "%2 = rope(%0#1,")
    elif change == "normed k read elsewhere":
        text = text.replace("return %4, %3", "return %4, %3, %6")
    else:
        text = text.replace("%6 = head_rmsnorm(%0#1, %w.k_norm, eps=1e-06", "%6 = head_rmsnorm(%0#1, %w.k_norm, "
                            "eps=1e-05")
    graph = ir(text)
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert after.op_counts() == graph.op_counts() and hits(ctx) == 0   # copied (renumbered)


def test_a_partial_rotary_is_carried_over():
    """Phi-4-mini: both ropes turn rotary_dim values a head; the fused op does too."""
    graph = ir(BEFORE.replace("scaling=None", "scaling=None, rotary_dim=6"))
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert hits(ctx) == 1 and "rotary_dim=6" in str(after).split("rope_kv_write(")[1]
    assert_same_numbers(graph, after, {}, PREFILL_STEPS, exact=True)


def test_ropes_turning_different_widths_are_left_alone():
    graph = ir(BEFORE.replace("%2 = rope(%0#1, %positions, head_dim=12, theta=10000.0, scaling=None)",
                              "%2 = rope(%0#1, %positions, head_dim=12, theta=10000.0, scaling=None, rotary_dim=6)"))
    after, ctx = run_pass(fuse_rope_kv_write, graph)
    assert hits(ctx) == 0 and "rope_kv_write" not in str(after)


@pytest.mark.parametrize("kind", ["head", "all"])
def test_the_norms_rounding_is_carried(kind):
    """Norms that round once after the weight (Gemma, OLMo-2) fuse with norm_rounding='product';
    q and k norms that round differently are left alone."""
    text = normed(kind).replace("eps=1e-06", "eps=1e-06, rounding='product'")
    after, ctx = run_pass(fuse_rope_kv_write, ir(text))
    assert hits(ctx) == 1
    (fused,) = [n for n in after.nodes if n.op == "rope_kv_write"]
    assert fused.attrs["norm_rounding"] == "product" and format_node(fused).endswith(
        f"norm_eps=1e-06, norm_rounding='product') : f32[T,72], {CACHE}")
    mixed = text.replace(f"%6 = {NORM_OPS[kind][0]}(%0#1, %w.k_norm, eps=1e-06, rounding='product'",
                         f"%6 = {NORM_OPS[kind][0]}(%0#1, %w.k_norm, eps=1e-06")
    assert mixed != text
    after, ctx = run_pass(fuse_rope_kv_write, ir(mixed))
    assert hits(ctx) == 0
