"""quantize_kv: the paged KV cache becomes int8 rows with a scale per token per KV head."""

from __future__ import annotations

import copy

import pytest
import torch

from llmc.compiler.ops import verify
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.quant import dequantize_kv_rows
from llmc.passes.quantize_kv import quantize_kv
from llmc.passes.rewrite import PassContext
from llmc.runtime.torch_backend import interpret
from pass_checks import CONTEXT_STEPS, feeds, traced_before


def run(graph, kv_dtype="int8"):
    ctx = PassContext(options={"quant": QuantRecipe.parse(kv_dtype=kv_dtype)})
    out = quantize_kv(copy.deepcopy(graph), ctx)
    verify(out)
    return out, ctx


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_cache_type_and_counter(entry):
    graph, _ = traced_before("quantize_kv", entry)
    after, ctx = run(graph)
    assert ctx.hits["quantize_kv"] == 1
    assert str(after.node_map()["kv_cache"].type) == "i8[2,2,NB,3,BS,16]"            # head_dim 12 + 4 scale bytes
    rope = [n for n in after.nodes if n.op == "rope_kv_write"]
    assert rope and all(n.types[1].dtype == "i8" for n in rope)


def test_auto_leaves_the_graph_alone():
    graph, _ = traced_before("quantize_kv", "decode")
    after, ctx = run(graph, "auto")
    assert str(after) == str(graph) and ctx.hits["quantize_kv"] == 0


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_numbers_move_by_int8_rounding_of_k_and_v_only(entry):
    """The same cached context (quantized row by row for the int8 graph) and the same new tokens.
    Exact: every row layer 0 writes dequantizes to the float graph's K or V within half a step (1/254 of
    the row's largest magnitude). Loose: the logits of this random two-layer model (whose sharp
    softmax over a 3-sigma garbage cache amplifies K errors) stay within 1/16 of their range."""
    graph, weights = traced_before("quantize_kv", entry)
    after, _ = run(graph)
    for step in CONTEXT_STEPS[entry]:
        want_feeds, got_feeds = feeds(graph, step), feeds(after, step)
        want, cache_f = interpret(graph, weights, want_feeds)[0], want_feeds["kv_cache"]
        got, cache_q = interpret(after, weights, got_feeds)[0], got_feeds["kv_cache"]
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=scale / 16)
        assert not torch.equal(got, want)                 # the cache really is int8
        slots = got_feeds["slot_mapping"]
        block, offset = slots // cache_q.shape[4], slots % cache_q.shape[4]
        rows_q = cache_q[0, :, block, :, offset]            # layer 0 (its K/V inputs are the same): [2, T, KVH, D+4]
        rows_f = cache_f[0, :, block, :, offset]
        step_size = rows_f.abs().amax(-1, keepdim=True) / 254
        assert ((dequantize_kv_rows(rows_q) - rows_f).abs() <= step_size * 1.001 + 1e-7).all()
