"""KV sizing (`llmc plan`) and the serving benchmark (`llmc bench`) on tiny models."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmc.models.config import ModelConfig
from llmc.runtime.artifact import load_artifact
from llmc.runtime.backends import choose_backend
from llmc.runtime.memory_plan import kv_bytes_per_token, parse_bytes, plan_memory
from llmc.runtime.sampling_params import RequestError
from llmc.tools.bench import Workload, parse_range, percentiles
from llmc.tools.cli import app

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}


@pytest.fixture
def llama3_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_the_seeds_worked_example_llama3_8b_fp16_on_80gb(llama3_config):
    """128 KiB of KV per token; the ~65 GiB the fp16 weights leave of 80 GiB hold ~512K tokens."""
    result = CliRunner().invoke(app, ["plan", str(llama3_config), "--memory", "80GiB", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert plan["weight_bytes"] == 2 * 8_030_261_248            # LLaMA-3-8B's parameter count, fp16
    assert abs(plan["kv_tokens"] - 512 * 1024) / (512 * 1024) < 0.05
    assert plan["max_sequences"] == plan["kv_tokens"] // 8192


def test_plan_formula_scales_with_dtype_and_context():
    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, 4, 4, 2, 16, 1e-5, 1e4)
    assert kv_bytes_per_token(cfg, "float32") == 2 * 4 * 2 * 16 * 4
    plan = plan_memory(cfg, 10**7, "float32", "bfloat16", context=100)
    assert plan.kv_tokens == (10**7 - plan.weight_bytes) // (2 * 4 * 2 * 16 * 2)
    assert plan.max_sequences == plan.kv_tokens // 100


@pytest.mark.parametrize("text, value", [("80GiB", 80 * 2**30), ("16GB", 16 * 10**9), ("512 MiB", 512 * 2**20),
                                         ("1000", 1000), ("1.5kb", 1500)])
def test_memory_sizes_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("args, words", [
    (["--memory", "lots"], "not understood"),
    (["--memory", "1GB"], "weights alone"),
    (["--memory", "80GiB", "--kv-dtype", "int3"], "kv dtype"),
])
def test_plan_bad_input_is_one_sentence(llama3_config, args, words):
    result = CliRunner().invoke(app, ["plan", str(llama3_config), *args])
    assert result.exit_code == 1 and words in result.output and "Traceback" not in result.output


def test_workload_is_seeded_and_shares_its_prefix():
    a = Workload(num_requests=8, shared_prefix=5, seed=3).requests(300)
    b = Workload(num_requests=8, shared_prefix=5, seed=3).requests(300)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert len({tuple(r.prompt_ids[:5]) for r in a}) == 1
    assert all(32 + 5 <= len(r.prompt_ids) <= 256 + 5 and 16 <= r.max_tokens <= 192 for r in a)
    timed = Workload(num_requests=8, request_rate=4.0).requests(300)
    assert all(x.arrival < y.arrival for x, y in zip(timed, timed[1:]))


def test_ranges_and_percentiles():
    assert parse_range("128", "prompt length") == (128, 128)
    assert parse_range("32:256", "prompt length") == (32, 256)
    with pytest.raises(RequestError, match="low end first"):
        parse_range("9:3", "prompt length")
    assert percentiles([float(i) for i in range(101)]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_bench_against_transformers_on_a_tiny_model(tiny_family, tmp_path):
    _, _, artifact = tiny_family("llama_gqa")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", str(artifact), "--num-requests", "6", "--prompt-len", "4:20",
                                      "--output-len", "3:9", "--baseline", "hf", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    llmc = report["llmc"]
    expected_tokens = sum(r.max_tokens for r in Workload(6, (4, 20), (3, 9)).requests(300))
    static = report["baselines"]["hf_static"]
    assert llmc["output_tokens"] == expected_tokens == static["output_tokens"]      # counted on both sides
    assert static["path"] in [t["path"] for t in static["tried"]] and len(static["tried"]) >= 3   # a tuned path
    assert report["speedup"] == pytest.approx(llmc["output_tok_s"] / report["baselines"]["hf_static"]["output_tok_s"])
    assert llmc["ttft_s"]["p50"] <= llmc["ttft_s"]["p99"]
    assert "speedup" in result.output


def test_bench_rejects_a_baseline_with_a_request_rate(tiny_family):
    _, _, artifact = tiny_family("llama_gqa")
    result = CliRunner().invoke(app, ["bench", str(artifact), "--num-requests", "2", "--output-len", "2",
                                      "--request-rate", "5", "--baseline", "hf"])
    assert result.exit_code == 1 and "drop --request-rate" in result.output


GEMMA3_4B_TEXT = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208, "hidden_size": 2560,
                  "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
                  "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072}


def test_plan_counts_sliding_layers_kv_as_the_runtime_allocates_it(tmp_path, tiny_family):
    """Gemma 3 (29 of 34 layers sliding): every layer's row of every token, as the one block pool the
    runtime allocates for all layers holds them; the table says which layers slide."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_4B_TEXT))
    result = CliRunner().invoke(app, ["plan", str(path), "--memory", "80GiB", "--json"])
    plan = json.loads(result.output)
    assert plan["kv_bytes_per_token"] == 2 * 34 * 4 * 256 * 2
    assert (plan["sliding_layers"], plan["sliding_window"]) == (29, 1024)
    table = CliRunner().invoke(app, ["plan", str(path), "--memory", "80GiB"]).output
    assert "29 of 34 attend within 1,024 tokens; their KV keeps every token" in table

    art = load_artifact(tiny_family("gemma3")[2])
    cache_type = next(n.type for n in art.graphs["decode"].inputs() if n.name == "kv_cache")
    per_block = choose_backend("torch", art, "cpu").kv_bytes_per_block(cache_type, 16)
    assert per_block == 16 * kv_bytes_per_token(art.config, "float32")


def test_bench_against_itself_without_async_scheduling(tiny_family, tmp_path):
    _, _, artifact = tiny_family("llama_gqa")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", str(artifact), "--num-requests", "4", "--prompt-len", "4:12",
                                      "--output-len", "3:6", "--async-scheduling", "--baseline", "sync",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    llmc, sync = report["llmc"], report["baselines"]["llmc_sync"]
    assert llmc["async_scheduling"] and not sync["async_scheduling"]
    assert llmc["output_tokens"] == sync["output_tokens"] == sum(r.max_tokens for r in Workload(4, (4, 12), (3, 6))
                                                                 .requests(300))
    for run in (llmc, sync):
        ms = run["ms_per_step"]
        assert ms["host"] == pytest.approx(sum(ms[p] for p in ("schedule", "build", "sample", "commit", "output")))
        assert ms["compute"] > 0
    assert "ms per step: host" in result.output and "llmc_sync" in result.output


def test_a_sampled_workload_seeds_each_request_and_says_how_it_samples(tiny_family, tmp_path):
    a, b = (Workload(4, (4, 12), (3, 6), seed=2, temperature=0.8, top_p=0.9).requests(300) for _ in range(2))
    assert [r.params() for r in a] == [r.params() for r in b]
    assert len({r.seed for r in a}) == 4 and all(r.params().temperature == 0.8 for r in a)
    assert all(r.seed is None and r.params().greedy for r in Workload(2).requests(300))
    _, _, artifact = tiny_family("llama_gqa")
    result = CliRunner().invoke(app, ["bench", str(artifact), "--num-requests", "3", "--prompt-len", "4:12",
                                      "--output-len", "3:6", "--temperature", "0.8", "--top-p", "0.9"])
    assert result.exit_code == 0, result.output
    assert "sampled at temperature 0.8, top-p 0.9" in result.output


@pytest.mark.parametrize("args, words", [
    (["--temperature", "0.7", "--baseline", "hf"], "decodes greedily"),
    (["--top-p", "1.5"], "top_p=1.5"),
])
def test_bench_refuses_bad_sampling_in_one_sentence(tiny_family, args, words):
    result = CliRunner().invoke(app, ["bench", str(tiny_family("llama_gqa")[2]), *args])
    assert result.exit_code == 1 and words in result.output and "Traceback" not in result.output
