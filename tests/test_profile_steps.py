"""`llmc profile`: the bytes and FLOPs it divides by agree with the model's config, counted another
way, time known to be spent in one kind of kernel is counted there, and the command reports every
part of a step."""

from __future__ import annotations

import dataclasses

import json
import math
import time

import pytest

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.ops import OPS
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.models.config import expected_weights
from llmc.runtime.artifact import load_artifact
from llmc.runtime.host_times import HOST_PHASES
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.memory_plan import kv_bytes_per_token
from llmc.tools.profile_hf import _own_dtype_line
from llmc.tools.profile_launches import waits_line
from llmc.tools.profile_steps import StepProfile, decode_bytes, prefill_flops, profile_decode, profile_prefill

from test_bad_inputs import assert_process_error, run_llmc


@pytest.mark.parametrize("family", ["llama_gqa", "llama_tied", "qwen2"])
def test_decode_bytes_are_every_parameter_once_but_the_embedding_table(tiny_family, family):
    art = load_artifact(tiny_family(family)[2])
    cfg, context = art.config, 40
    params = sum(math.prod(s) for s in expected_weights(cfg).values())
    table = cfg.vocab_size * cfg.hidden_size
    read = params - (0 if cfg.tie_word_embeddings else table) + cfg.hidden_size   # a tied table is the LM head
    assert decode_bytes(art.graphs["decode"], art, context) == 4 * read + context * kv_bytes_per_token(cfg, "float32")


def test_decode_bytes_read_one_row_of_a_quantized_table(tiny_family, tmp_path):
    """int8 tables (the quantized recipes' default): the tied LM head reads the codes and scales
    whole, the gather one row of each."""
    art = load_artifact(compile_model(tiny_family("llama_tied")[1], tmp_path / "art",
                                      CompileConfig(quant=QuantRecipe.parse("int8"))))
    assert "qembedding" in art.graphs["decode"].op_counts()
    cfg, context = art.config, 40
    stored = sum(t.numel() * t.element_size() for t in art.weights.values())
    row = cfg.hidden_size + 2                                       # one row's int8 codes and its fp16 scale
    kv = context * kv_bytes_per_token(cfg, "float32")
    assert decode_bytes(art.graphs["decode"], art, context) == stored + row + kv


def test_prefill_flops_are_every_gemm_over_every_token_but_the_lm_head_and_causal_attention(tiny_family):
    art = load_artifact(tiny_family("llama_gqa")[2])
    cfg, tokens = art.config, 50
    layer = dict(expected_weights(cfg))
    gemm = sum(math.prod(s) for name, s in layer.items() if name.startswith("layers.") and len(s) == 2)
    attention = cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * sum(range(1, tokens + 1))
    want = 2 * tokens * gemm + 2 * cfg.vocab_size * cfg.hidden_size + attention
    assert prefill_flops(art.graphs["prefill"], art, tokens) == want


def test_llmc_profile_reports_decode_and_prefill_against_measured_floors(tiny_family, tmp_path):
    out = tmp_path / "profile.json"
    proc = run_llmc("profile", tiny_family("llama_hd32")[2], "--decode-tokens", 4, "--decode-context", 40,
                    "--prompt-len", 64, "--json", out, "--baseline", "hf", "--no-hf-compile")
    assert proc.returncode == 0, proc.stderr
    assert "batch-1 decode, 4 tokens after a 40-token prompt: " in proc.stdout
    assert "of the read bandwidth" in proc.stdout and "of the matmul peak" in proc.stdout
    assert "transformers, same run, same boundaries: decode" in proc.stdout
    result = json.loads(out.read_text())
    assert sorted(result["step_plans"]) == ["decode", "prefill"] and "step plans: " in proc.stdout
    hf = result["hf"]
    assert hf["decode_s"] == min(t["seconds"] for t in hf["decode_tried"] if "seconds" in t) > 0   # its best path
    assert len(hf["decode_tried"]) >= 3 and hf["prefill_s"] == min(hf["prefill_tried"].values()) > 0
    own_dtype = {path: s for path, s in hf["prefill_tried"].items() if "autocast" not in path}
    assert hf["prefill_own_dtype_s"] == min(own_dtype.values()) and hf["prefill_own_dtype_path"] in own_dtype
    assert ("prefill without autocast" in proc.stdout) == ("autocast" in hf["prefill_path"])
    # llmc's prefill timed right after each of transformers' timed prefills, the fastest in the ratios
    assert hf["llmc_prefill_runs"] == 2 * len(hf["prefill_tried"]) and hf["llmc_prefill_s"] > 0
    assert f"llmc's prefill in those ratios: {1000 * hf['llmc_prefill_s']:.0f} ms" in proc.stdout
    assert f"(llmc takes {hf['llmc_prefill_s'] / hf['prefill_s']:.2f}x its time" in proc.stdout
    assert result["served_decode_s"] > 0 and "as served" in proc.stdout and "same boundaries" in proc.stdout
    served = result["served_decode_s"] / result["decode"]["seconds"]            # streamed, beside the step
    assert f"{1000 * result['served_decode_s']:.1f} ms/token = {served:.2f}x the step above" in proc.stdout
    per_step = result["served_per_step"]                                  # the engine's own clocks, that run
    assert per_step["compute"] > 0 and per_step["host"] == pytest.approx(sum(per_step[p] for p in HOST_PHASES))
    assert f"the forward {1000 * per_step['compute']:.2f} ms, the host {1000 * per_step['host']:.2f} ms" in proc.stdout
    art = load_artifact(tiny_family("llama_hd32")[2])              # each step reads the K/V of the mean context
    assert result["decode"]["bytes"] == decode_bytes(art.graphs["decode"], art, 40 + 1 + 4)
    assert result["floor_kernel"].startswith("native read_floor")
    assert result["bandwidth"] > 0 and result["matmul_peak"] > 0
    assert len(result["decode"]["rounds"]) == len(result["decode"]["floors"]) == 1     # 4 tokens: one round
    assert result["decode"]["of_bandwidth"] == pytest.approx(
        result["decode"]["bytes"] / result["decode"]["rounds"][0] / result["decode"]["floors"][0])
    assert len(result["decode"]["paired"]) == 1 and result["decode"]["paired"][0] > 0
    assert result["decode"]["of_paired_read"] == pytest.approx(result["decode"]["paired"][0] / result["decode"]["rounds"][0])
    assert f"right after each step (the same neighbours' load): {100 * result['decode']['of_paired_read']:.0f}%" \
        in proc.stdout
    waits = result["decode"]["waits"]                                     # the step plan's team, thread by thread
    assert set(waits) == {"GEMM/GEMV", "attention", "other kernels"}
    assert all(len(w) == result["threads"] and min(w) >= 0 for w in waits.values())
    assert "the team's balance: each thread's wait at the barriers of a timed step" in proc.stdout
    assert "GEMM/GEMV by weight in a timed step" in proc.stdout and "o_proj" in result["decode"]["by_weight"]
    for step in (result["decode"], result["prefill"]):
        parts = step["by_category"]
        assert parts["GEMM/GEMV"] > 0 and parts["attention"] > 0 and parts["other kernels"] > 0



def test_the_prefill_in_the_models_own_dtype_is_shown_where_autocast_won():
    hf = {"prefill_path": "batch 1, sdpa, dynamic cache, bf16 autocast", "prefill_own_dtype_s": 0.8,
          "prefill_own_dtype_path": "batch 1, sdpa, dynamic cache"}
    (line,) = _own_dtype_line(hf, {"seconds": 0.4})
    assert "without autocast" in line and "800 ms" in line and "0.50x" in line and "sdpa, dynamic cache)" in line
    assert _own_dtype_line({**hf, "prefill_path": hf["prefill_own_dtype_path"]}, {"seconds": 0.4}) == []


ATTENTION_DELAY = 0.05       # seconds added to every attention launch (the tiny model's step: ~1 ms)


@pytest.mark.usefixtures("one_torch_thread")
def test_time_spent_in_attention_is_counted_as_attention_and_in_the_step(tiny_family, monkeypatch):
    """What the split claims, against a known time: every attention launch is made ATTENTION_DELAY
    longer (a sleep, never shorter). The profile must put that time, attention launches x delay
    per step, into attention and not into GEMM/GEMV or the other kernels, and its step time (the
    decode's from untimed steps) must hold it too, leaving python/dispatch smaller than it."""
    def slowed(fn):
        return lambda *args, **kwargs: (time.sleep(ATTENTION_DELAY), fn(*args, **kwargs))[1]

    for op in [name for name, d in OPS.items() if d.kind == "attention"]:
        monkeypatch.setitem(OPS, op, dataclasses.replace(OPS[op], reference=slowed(OPS[op].reference)))
    options = {"kernels": "reference", "step_plans": False, "cuda_graphs": False}     # op by op: one launch each
    engine = Engine(tiny_family("llama_hd32")[2], EngineConfig(backend_options=options))
    for entry, profile in (("decode", profile_decode(engine, 4)[0]), ("prefill", profile_prefill(engine, 32))):
        added = ATTENTION_DELAY * sum(OPS[n.op].kind == "attention" for n in engine.artifact.graphs[entry].nodes)
        parts = profile.by_category
        assert added > 0 and parts["attention"] >= added, (entry, parts)
        assert parts["GEMM/GEMV"] + parts["other kernels"] < added / 2, (entry, parts)
        assert profile.seconds >= added and abs(parts["python/dispatch"]) < added / 2, (entry, profile)


def test_a_profile_longer_than_the_context_is_one_sentence(tiny_family):
    assert_process_error(run_llmc("profile", tiny_family("llama_hd32")[2], "--prompt-len", 100_000),
                         "100000 tokens", "--prompt-len")
    assert_process_error(run_llmc("profile", tiny_family("llama_hd32")[2], "--decode-context", 100_000),
                         "100066 tokens", "--decode-context")
    assert_process_error(run_llmc("profile", tiny_family("llama_hd32")[2], "--decode-context", 0),
                         "--decode-context", "at least 1")


def test_the_fraction_of_bandwidth_pairs_each_round_with_its_own_floor():
    # rounds at 1, 1 and 0.5 of the bandwidth beside them: a faster round on a busier floor counts as it is
    profile = StepProfile(0.15, {}, rounds=(0.1, 0.2, 0.1), floors=(10.0, 5.0, 20.0))
    assert profile.of_bandwidth(1) == pytest.approx(1.0)
    assert StepProfile(0.15, {}, rounds=(0.1, 0.2), floors=(10.0, 20.0)).of_bandwidth(1) == pytest.approx(0.625)


def test_the_balance_line_sums_each_threads_waits_over_the_kinds():
    (line,) = waits_line({"GEMM/GEMV": [0.001, 0.003], "other kernels": [0.002, 0.0]})
    assert line.endswith("thread 0 / 1: 3.00 / 3.00 ms (GEMM/GEMV 1.00 / 3.00 | other kernels 2.00 / 0.00)")
    assert waits_line({}) == []                            # op by op: no team, no line


def test_the_paired_read_is_each_rounds_read_over_its_step():
    # reads of a step's bytes that took 0.09, 0.1 and 0.04 s beside steps of 0.1, 0.2 and 0.05 s
    profile = StepProfile(0.15, {}, rounds=(0.1, 0.2, 0.05), paired=(0.09, 0.1, 0.04))
    assert profile.of_paired_read() == pytest.approx(0.8)


PREFILL_DELAY = 0.3          # seconds added to the prefill step (the tiny model's decode step: ~1 ms)


@pytest.mark.usefixtures("one_torch_thread")
def test_served_decode_time_runs_from_the_first_token_out_to_the_last(tiny_family, monkeypatch):
    """The figure compared with transformers' streamer timing leaves the prefill (and the first
    token's wait) out on llmc's side too: a slow prefill does not move it, nor the engine step's
    phases shown beside it."""
    from llmc.tools.profile_hf import decode_prompt, served_decode

    engine = Engine(tiny_family("llama_hd32")[2], EngineConfig(backend_options={"cuda_graphs": False}))
    run = engine.runner.run_step
    monkeypatch.setattr(engine.runner, "run_step", lambda entry, step: (
        time.sleep(PREFILL_DELAY if entry == "prefill" else 0), run(entry, step))[1])
    tokens = 8
    start = time.perf_counter()
    per_token, per_step = served_decode(engine, decode_prompt(engine.artifact.config.vocab_size), tokens)
    assert time.perf_counter() - start >= PREFILL_DELAY                    # the prefill was slowed
    assert 0 < per_token < PREFILL_DELAY / tokens / 4
    assert 0 < per_step["compute"] < PREFILL_DELAY / tokens / 4            # the engine's steps after it
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
