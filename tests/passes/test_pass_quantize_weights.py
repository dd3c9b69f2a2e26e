"""quantize_weights: linear -> qlinear over int8/int4 codes; GGUF blocks kept bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import math
from statistics import NormalDist

import pytest
import torch

from llmc.compiler.ops import verify
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.quant import QuantizedWeight, dequantize_weight, quantize_int4, quantize_int8
from llmc.passes.pipeline import PassError
from llmc.passes.quantize_weights import quantize_weights
from llmc.passes.rewrite import PassContext
from llmc.runtime.torch_backend import interpret
from pass_checks import TINY, assert_same_numbers, feeds, ir, printed, random_weights, steps_for, traced_before

# hidden 64 and intermediate 128: every K a multiple of 64, so int4-g32 and -g64 take every GEMM
TINY64 = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)

BEFORE = """
graph prefill {
  %x = input() : f32[T,64]
  %w.layers.0.o_proj.weight = weight() : f32[48,64]
  %w.layers.0.o_proj.bias = weight() : f32[48]
  %0 = linear(%x, %w.layers.0.o_proj.weight, %w.layers.0.o_proj.bias) : f32[T,48]
  return %0
}
"""

AFTER_INT4 = """
graph prefill {
  %x = input() : f32[T,64]
  %w.layers.0.o_proj.weight = weight() : f32[48,64]
  %w.layers.0.o_proj.bias = weight() : f32[48]
  %w.layers.0.o_proj.weight.codes = weight() : u4x2[48,32]
  %w.layers.0.o_proj.weight.scales = weight() : f16[48,2]
  %w.layers.0.o_proj.weight.mins = weight() : f16[48,2]
  %0 = qlinear(%x, %w.layers.0.o_proj.weight.codes, %w.layers.0.o_proj.weight.scales, %w.layers.0.o_proj.weight.mins, %w.layers.0.o_proj.bias, bits=4, group_size=32) : f32[T,48]
  return %0
}
"""


def run(graph, recipe: QuantRecipe, weights=None, quantized=None):
    ctx = PassContext(options={"quant": recipe}, weights=weights, quantized=quantized or {})
    out = quantize_weights(copy.deepcopy(graph), ctx)
    verify(out)
    return out, ctx


def with_dequantized(weights: dict, names) -> dict:
    """The float weights a quantized graph's codes stand for, under the original names."""
    out = dict(weights)
    for name in names:
        out[name] = dequantize_weight(weights[f"{name}.codes"], weights[f"{name}.scales"],
                                      weights.get(f"{name}.mins"), 4 if f"{name}.mins" in weights else 8)
    return out


def test_printed_int4_graph_counter_and_stored_codes():
    before = ir(BEFORE)
    weights = random_weights(before)
    after, ctx = run(before, QuantRecipe.parse("int4"), weights)
    assert str(after) == printed(AFTER_INT4)          # the float weight is left for dce
    assert ctx.hits["quantize_weights"] == 1
    codes, scales, mins = quantize_int4(weights["layers.0.o_proj.weight"], 32)
    assert torch.equal(weights["layers.0.o_proj.weight.codes"], codes)
    assert weights["layers.0.o_proj.weight.codes"].dtype == torch.uint8
    assert torch.equal(weights["layers.0.o_proj.weight.scales"], scales) and torch.equal(
        weights["layers.0.o_proj.weight.mins"], mins)
    assert ctx.records["quantize_weights"] == {"layers.0.o_proj.weight": "quantized to int4-g32"}


@pytest.mark.parametrize("quant", ["int8", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_traced_model_computes_with_its_dequantized_weights(quant, entry):
    """After the pass the graph computes exactly what the unquantized graph computes on the
    dequantized weights (to fp32 rounding), so the only change is the weights' rounding: the GEMMs',
    and by default the embedding's and the (untied) LM head's, int8 at every recipe."""
    graph, weights = traced_before("quantize_weights", entry, TINY64)
    after, ctx = run(graph, QuantRecipe.parse(quant), weights)
    quantized = list(ctx.records["quantize_weights"])
    assert ctx.hits["quantize_weights"] == len(quantized) == 2 * 4 + 2   # qkv, o, gate_up, down per layer; tables
    assert ctx.records["quantize_weights"]["lm_head.weight"] == "quantized to int8"
    assert after.op_counts()["qlinear"] == 9 and after.op_counts()["qembedding"] == 1
    assert "linear" not in after.op_counts() and "embedding" not in after.op_counts()
    assert_same_numbers(graph, after, with_dequantized(weights, quantized), steps_for(graph), reduction=128)


ROUNDING_SAMPLES = 64         # random roundings whose logits give each logit's spread
FALSE_ALARM = 1e-3            # chance that a correct quantization fails the logit check


def feed_all(graph, weights: dict, steps) -> torch.Tensor:
    """Logits [rows, V] of `graph` on every step, stacked."""
    return torch.cat([interpret(graph, weights, feeds(graph, step))[0] for step in steps])


def rounded_at_random(weights: dict, names, g: torch.Generator) -> dict:
    """The float weights, each quantized one moved as rounding to its int8 grid moves it: by a
    random amount uniform within half its scale."""
    out = dict(weights)
    for name in names:
        half_step = weights[f"{name}.scales"].float() / 2                   # [N, 1] per output channel
        out[name] = weights[name] + (2 * torch.rand(weights[name].shape, generator=g) - 1) * half_step
    return out


@pytest.fixture(scope="module")
def int8_decode():
    """The decode graph quantized to int8, and each logit's spread under random rounding within
    half a scale of every quantized weight (the graph's own propagation of that error)."""
    graph, weights = traced_before("quantize_weights", "decode", TINY64)
    after, ctx = run(graph, QuantRecipe.parse("int8"), weights)
    names, steps = list(ctx.records["quantize_weights"]), steps_for(graph)
    want = feed_all(graph, weights, steps)
    g = torch.Generator().manual_seed(0)
    noise = torch.stack([feed_all(graph, rounded_at_random(weights, names, g), steps) - want
                         for _ in range(ROUNDING_SAMPLES)])                    # [samples, rows, V]
    return graph, after, weights, names, want, noise.pow(2).mean(0).sqrt()


def assert_logits_explained_by_rounding(int8_decode, weights: dict) -> None:
    """Each int8 logit is off the float logit by at most what rounding explains: a logit's error
    is a sum of many small independent roundings, so Gaussian with the spread `sigma`; the limit
    is the Gaussian bound for FALSE_ALARM over all logits, widened by three standard errors of a
    spread estimated from ROUNDING_SAMPLES samples."""
    graph, after, _, _, want, sigma = int8_decode
    z = (feed_all(after, weights, steps_for(graph)) - want) / sigma            # [rows, V]
    limit = NormalDist().inv_cdf(1 - FALSE_ALARM / (2 * z.numel())) * (1 + 3 / math.sqrt(2 * ROUNDING_SAMPLES))
    worst = int(z.abs().argmax())
    assert z.abs().max() <= limit, (f"logit {divmod(worst, z.shape[1])} is off by {float(z.flatten()[worst]):+.1f} "
                                    f"sigma of rounding error (limit {limit:.1f})")


def test_int8_logits_stay_within_what_rounding_explains(int8_decode):
    """Against the float graph's logits on every decode step (with cached context too)."""
    _, _, weights, names, _, sigma = int8_decode
    deq = with_dequantized(weights, names)
    for name in names:                           # the premise: each weight within half its row's scale
        half_step = weights[f"{name}.scales"].float() / 2
        assert ((deq[name] - weights[name]).abs() <= half_step * (1 + 2**-10)).all(), name   # fp16 scale rounding
    assert (sigma > 0).all()                     # every logit depends on the quantized weights
    assert_logits_explained_by_rounding(int8_decode, weights)


@pytest.mark.parametrize("plant", ["codes off by one", "scales 5% large"])
def test_a_planted_quantization_bug_fails_the_logit_check(int8_decode, plant):
    """The check bites: every code one step up, or every scale 5% too large, moves the logits
    beyond rounding (a scale 2% off stays within it on this tiny model: about 5 sigma)."""
    _, _, weights, names, _, _ = int8_decode
    wrong = dict(weights)
    for name in names:
        if plant == "codes off by one":
            wrong[f"{name}.codes"] = (weights[f"{name}.codes"].int() + 1).clamp(-127, 127).to(torch.int8)
        else:
            wrong[f"{name}.scales"] = (weights[f"{name}.scales"].float() * 1.05).half()
    with pytest.raises(AssertionError, match="sigma of rounding error"):
        assert_logits_explained_by_rounding(int8_decode, wrong)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_embeddings_are_int8_by_default_unless_kept_and_tied_head_shares_the_codes(quant):
    """The table and its tied LM head quantize as int8 per row whatever the recipe's width (int4
    tables cost SmolLM2 5.8% perplexity), or stay float with embeddings=False (--no-quant-embeddings)."""
    tied = dataclasses.replace(TINY64, tie_word_embeddings=True)
    graph, weights = traced_before("quantize_weights", "prefill", tied)
    after, _ = run(graph, QuantRecipe.parse(quant, embeddings=False), dict(weights))
    assert "qembedding" not in after.op_counts() and after.op_counts()["linear"] == 1
    after, ctx = run(graph, QuantRecipe.parse(quant), weights)
    assert after.op_counts()["qembedding"] == 1 and "linear" not in after.op_counts()
    embed = [n for n in after.weights() if n.name.startswith("w.embed_tokens.weight.")]
    assert len(embed) == 2                                                # one codes + scales, read twice
    assert {n.type.dtype for n in embed} == {"i8", "f16"} and embed[1].type.shape[1] == 1   # a scale a row
    assert ctx.records["quantize_weights"]["embed_tokens.weight"] == "quantized to int8"
    assert_same_numbers(graph, after, with_dequantized(weights, ctx.records["quantize_weights"]),
                        steps_for(graph)[:1], reduction=128)


def test_gguf_blocks_of_the_recipe_width_are_kept_bit_for_bit():
    before = ir(BEFORE)
    weights = random_weights(before)
    name = "layers.0.o_proj.weight"
    codes, scales, mins = quantize_int4(torch.randn(48, 64), 32)
    source = QuantizedWeight(4, 32, codes, scales, mins, "Q4_1")
    run(before, QuantRecipe.parse("int4-g64"), weights, {name: source})
    assert weights[f"{name}.codes"] is codes and weights[f"{name}.scales"] is scales   # not requantized
    _, ctx = run(before, QuantRecipe.parse("int8"), dict(weights), {name: source})
    assert ctx.records["quantize_weights"][name] == "requantized from Q4_1 to int8"


def test_no_recipe_leaves_the_graph_alone():
    before = ir(BEFORE)
    after, ctx = run(before, QuantRecipe.parse("none", kv_dtype="int8"), random_weights(before))
    assert str(after) == str(before) and ctx.hits["quantize_weights"] == 0


@pytest.mark.parametrize("hidden, quant, words", [
    (72, "int4-g32", ["int4 needs input features in multiples of 32, it has 72", "--quant int8"]),
    (96, "int4-g64", ["group of 64 does not divide the 96 input features", "choose --quant int4-g32"]),
])
def test_bad_group_sizes_are_one_sentence(hidden, quant, words):
    config = dataclasses.replace(TINY, hidden_size=hidden, head_dim=hidden // TINY.num_heads)
    graph, weights = traced_before("quantize_weights", "decode", config)
    with pytest.raises(PassError) as err:
        run(graph, QuantRecipe.parse(quant), weights)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_int8_recipe_is_per_output_channel():
    before = ir(BEFORE)
    weights = random_weights(before)
    after, _ = run(before, QuantRecipe.parse("int8"), weights)
    (node,) = [n for n in after.nodes if n.op == "qlinear"]
    assert node.attrs == {"bits": 8, "group_size": 64}
    want_codes, want_scales = quantize_int8(weights["layers.0.o_proj.weight"])
    assert torch.equal(weights["layers.0.o_proj.weight.codes"], want_codes)
    assert weights["layers.0.o_proj.weight.scales"].shape == (48, 1)
