"""The shared pass check can fail: on the decode graph a RoPE-theta or attention-scale bug is
invisible to a decode with nothing cached (attention over one token returns V) and caught by the
steps over cached context that every cache-taking graph is now run on."""

from __future__ import annotations

import pytest

from llmc.passes.fuse_rope_kv_write import fuse_rope_kv_write
from pass_checks import CONTEXT_STEPS, DECODE_STEPS, assert_same_numbers, run_pass, steps_for, traced_before


def theta_off_by_1_percent(node):
    if node.op == "rope_kv_write":
        node.attrs["theta"] *= 1.01


def scale_off_by_1_percent(node):
    if node.op == "paged_decode_attention":
        node.attrs["scale"] *= 1.01


@pytest.mark.parametrize("bug", [theta_off_by_1_percent, scale_off_by_1_percent])
def test_only_the_decode_over_cached_context_sees_the_bug(bug):
    graph, weights = traced_before("fuse_rope_kv_write", "decode")
    fused, _ = run_pass(fuse_rope_kv_write, graph)
    assert_same_numbers(graph, fused, weights, steps_for(graph), exact=True)
    broken, _ = run_pass(fuse_rope_kv_write, graph)
    for node in broken.nodes:
        bug(node)
    assert_same_numbers(graph, broken, weights, DECODE_STEPS)
    with pytest.raises(AssertionError):
        assert_same_numbers(graph, broken, weights, CONTEXT_STEPS["decode"])
