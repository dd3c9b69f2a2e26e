"""The shard pass (--tp N): its printed IR, its counter, a near miss (N = 1), its refusals, and the
numbers: every rank's graph run in ONE process, in lockstep (tools/bisect_ranks.py's `run_ranks`, which
`llmc debug bisect --tp N` runs too: node by node on every rank, the collectives computed across the
ranks' values: the sum or the concatenation), on weights cut by the plan (compiler/tensor_parallel.py),
against the unsharded graph's logits.

Tolerance: the sharded graph sums each row-parallel GEMM's K products in N partial sums, then adds
them; the order of an fp32 reduction of length K changes, nothing else (OLMo-2's norm: the row's sum
of squares likewise), so tests/tolerances.py's rule for fp32 and K = the longest reduction (hidden
or intermediate size) at the logits' scale. Greedy tokens (each row's argmax) must be equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmc.compiler.frontend import trace
from llmc.compiler.ir import Graph, parse_graph, print_graph
from llmc.compiler.ops.collectives import all_reduce_ref
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.compiler.tensor_parallel import TensorParallelPlan, segments
from llmc.models.config import ModelConfig
from llmc.passes.pipeline import run_pipeline
from llmc.passes.rewrite import PassContext, PassError
from llmc.runtime.torch_backend import interpret
from llmc.tools.bisect_ranks import rank_feeds, run_ranks
from llmc.tools.feeds import Step, step_feeds
from tolerances import tolerance
from tp_gloo_child import gloo_rank

LLAMA = ModelConfig("LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)
CONFIGS = {
    "llama": LLAMA,
    "llama_kv1": dataclasses.replace(LLAMA, num_kv_heads=1),                  # fewer KV heads than ranks
    "smollm2_shapes": dataclasses.replace(LLAMA, hidden_size=72, num_heads=9, num_kv_heads=3, head_dim=8,
                                          tie_word_embeddings=True),          # 9 heads, 3 KV heads, tied
    "qwen2": dataclasses.replace(LLAMA, architecture="Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": dataclasses.replace(LLAMA, architecture="Qwen3ForCausalLM", qk_norm="head"),
    "olmo2": dataclasses.replace(LLAMA, architecture="Olmo2ForCausalLM", qk_norm="all", norm_rounding="product"),
    "gemma3": dataclasses.replace(LLAMA, architecture="Gemma3ForCausalLM", qk_norm="head", hidden_act="gelu_tanh",
                                  embed_scale=True, tie_word_embeddings=True, norm_rounding="product"),
    "gemma2": dataclasses.replace(LLAMA, architecture="Gemma2ForCausalLM", hidden_act="gelu_tanh", embed_scale=True,
                                  attn_softcap=5.0, final_softcap=3.0, tie_word_embeddings=True),
    "mistral": dataclasses.replace(LLAMA, architecture="MistralForCausalLM", sliding_window=6,
                                   layer_types=("sliding_attention",) * 2),
    "phi3": dataclasses.replace(LLAMA, architecture="Phi3ForCausalLM", rotary_dim=12),
}
CASES = [("llama", 2), ("llama_kv1", 2), ("smollm2_shapes", 3), ("qwen2", 2), ("qwen3", 2), ("olmo2", 2),
         ("gemma3", 2), ("gemma2", 2), ("mistral", 2), ("phi3", 2), ("llama", 4)]
STEPS = {"prefill": Step.after_context("5+1 after 9, 20 cached", [[(7 * i) % 300 for i in range(14)],
                                                                   [(11 * i + 3) % 300 for i in range(21)]], [5, 1]),
         "decode": Step.after_context("S=3 after 4, 17, 30 cached", [[(5 * i) % 300 for i in range(5)],
                                                                      [(13 * i + 1) % 300 for i in range(18)],
                                                                      [(3 * i + 2) % 300 for i in range(31)]],
                                      [1, 1, 1])}


def random_weights(graph: Graph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight the traced graph names: norms near 1, matrices and biases O(0.3) (as pass tests)."""
    g = torch.Generator().manual_seed(seed)
    return {n.name[2:]: torch.rand(n.type.shape, generator=g) + 0.5 if "norm" in n.name
            else torch.randn(n.type.shape, generator=g) * 0.3 for n in graph.weights()}


def compiled(config: ModelConfig, entry: str, tp: int, weights: dict | None = None,
             quant: QuantRecipe = QuantRecipe()) -> tuple[Graph, PassContext]:
    """The graph the whole pipeline makes for --tp `tp` (weights: random, or those given, which
    fold_weights and quantize_weights add to)."""
    graph = trace(config, entry)
    ctx = PassContext(options={"quant": quant, "tp": tp}, weights=random_weights(graph) if weights is None else weights)
    graph, _ = run_pipeline(graph, ctx)
    return graph, ctx


def sharded_logits(config: ModelConfig, entry: str, n: int, **kw) -> tuple[torch.Tensor, torch.Tensor, Graph]:
    """(unsharded logits, the N ranks' logits, the sharded graph) of one step."""
    full_graph, ctx = compiled(config, entry, 1, **kw)
    graph, tp_ctx = compiled(config, entry, n, weights=ctx.weights, **kw)
    plan = TensorParallelPlan(n, tp_ctx.records["shard"]["weights"])
    feeds = step_feeds(full_graph, STEPS[entry])
    with torch.inference_mode():
        (want,) = interpret(full_graph, ctx.weights, {k: v.clone() for k, v in feeds.items()})
        (got,) = run_ranks(graph, [plan.rank_weights(ctx.weights, r) for r in range(n)],
                           rank_feeds(feeds, config.num_kv_heads, n))
    return want, got, graph


@pytest.mark.parametrize("entry", ["prefill", "decode"])
@pytest.mark.parametrize("family,n", CASES)
def test_ranks_in_lockstep_give_the_unsharded_logits(family, n, entry):
    config = CONFIGS[family]
    want, got, _ = sharded_logits(config, entry, n)
    reduction = max(config.hidden_size, config.intermediate_size)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, reduction, scale=float(want.abs().max())))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_printed_ir_shows_the_collectives_and_the_counter_fires():
    graph, ctx = compiled(CONFIGS["olmo2"], "decode", 2)
    text = print_graph(graph)
    assert text.count("= all_reduce(") == 2 * 2 + 2          # o_proj, down_proj, the q/k norm's squares: 2 layers
    assert "all_gather(" in text and "qk_rms_norm(" in text and "qk_norm=" not in text
    assert "num_heads=2, num_kv_heads=1" in text and "%kv_cache = input() : f32[2,2,NB,1,BS,16]" in text
    assert ctx.hits["shard"] > 0


def test_a_sharded_graph_prints_and_parses_back():
    graph, _ = compiled(CONFIGS["olmo2"], "prefill", 2)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)


def test_one_rank_is_a_near_miss_left_alone():
    graph, ctx = compiled(LLAMA, "decode", 1)
    text = print_graph(graph)
    assert "all_reduce" not in text and "all_gather" not in text
    assert ctx.hits.get("shard", 0) == 0 and "shard" not in ctx.records


def test_fewer_kv_heads_than_ranks_replicates_them():
    graph, ctx = compiled(CONFIGS["llama_kv1"], "decode", 2)
    rule = ctx.records["shard"]["weights"]["layers.0.qkv_proj.weight"]
    assert rule == segments(0, [64, 16, 16], [4, 1, 1])
    assert "%kv_cache = input() : f32[2,2,NB,1,BS,16]" in print_graph(graph)


def test_a_tied_table_stays_whole_for_the_embedding_and_splits_for_the_lm_head():
    graph, ctx = compiled(CONFIGS["smollm2_shapes"], "decode", 3)
    rules = ctx.records["shard"]["weights"]
    assert rules["embed_tokens.weight"] == {"rule": "replicate"}
    assert rules["embed_tokens.weight.vocab_split"] == {"rule": "split", "dim": 0, "source": "embed_tokens.weight"}
    assert "%w.embed_tokens.weight.vocab_split = weight() : f32[100,72]" in print_graph(graph)


@pytest.mark.parametrize("family,n,words", [
    ("smollm2_shapes", 4, "--tp 4 does not divide the model's 9 attention heads; choose a --tp that divides 9 (3, 9)"),
    ("llama", 3, "--tp 3 does not divide the model's 4 attention heads"),
])
def test_head_counts_n_does_not_divide_are_refused(family, n, words):
    with pytest.raises(PassError, match=words.replace("(", r"\(").replace(")", r"\)")):
        compiled(CONFIGS[family], "decode", n)


def test_an_intermediate_size_n_does_not_divide_is_refused():
    with pytest.raises(PassError, match="--tp 4 does not divide the model's 90 intermediate"):
        compiled(dataclasses.replace(LLAMA, intermediate_size=90), "decode", 4)


def test_int4_row_parallel_groups_split_when_n_divides_them():
    config = dataclasses.replace(LLAMA, intermediate_size=128)     # down_proj: 4 groups of 32, 2 a rank
    want, got, graph = sharded_logits(config, "decode", 2, quant=QuantRecipe.parse("int4-g32"))
    assert "qlinear(" in print_graph(graph)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 128, scale=float(want.abs().max())))


def test_int8_per_channel_scales_stay_whole_on_row_parallel_ranks():
    want, got, graph = sharded_logits(LLAMA, "decode", 2, quant=QuantRecipe.parse("int8"))
    assert "group_size=32" in print_graph(graph)                 # o_proj's 64 input features, per rank
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 96, scale=float(want.abs().max())))


def test_a_tied_int8_table_splits_its_codes_and_scales_for_the_lm_head():
    quant = QuantRecipe.parse("int8", embeddings=True)
    want, got, graph = sharded_logits(CONFIGS["smollm2_shapes"], "decode", 3, quant=quant)
    text = print_graph(graph)
    assert "qembedding(%w.embed_tokens.weight.codes," in text and "%w.embed_tokens.weight.codes.vocab_split" in text
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 96, scale=float(want.abs().max())))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_quantization_group_the_ranks_would_cut_is_refused():
    config = dataclasses.replace(LLAMA, intermediate_size=128)     # o_proj: 64 features, one group of 64
    with pytest.raises(PassError, match="--tp 2 would cut the quantization groups of layers.0.o_proj.weight: its 64 "
                                        "input features hold 1 groups of 64"):
        compiled(config, "decode", 2, quant=QuantRecipe.parse("int4-g64"))


def test_the_collectives_references_run_on_the_default_group(tmp_path):
    """The references as a sharded graph runs them: two gloo processes (7 s on the shared 2-core machine,
    mostly spawning)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(gloo_rank, args=(2, port, str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for r in range(2):
        assert torch.equal(got[r]["sum"], got[0]["x"] + got[1]["x"])
        assert torch.equal(got[r]["joined"], torch.cat([got[0]["x"], got[1]["x"]], dim=-1))


def test_a_sharded_graph_outside_its_process_group_says_how_to_run_it():
    with pytest.raises(ValueError, match="this graph is sharded for 2 ranks but the process group has 1: run it "
                                         "with --tp 2"):
        all_reduce_ref(torch.ones(2), 2)
