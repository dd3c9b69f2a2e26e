"""Speculative decoding's reports: `llmc bench-spec` (every source, its columns, the equal-output
check), `llmc bench --speculative` (the speculation lines) and /metrics (llmc_spec_* counters that
agree with each other), on tiny random models."""

from __future__ import annotations

import json

import httpx
import pytest

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.speculative.speculator import SpeculativeConfig

from live_server import LiveServer
from test_bad_inputs import run_llmc
from tiny_models import build_hf_model, write_hf_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """A 4-layer tiny llama with a self-speculative draft graph (1 layer skipped) and room for the
    built-in prompts, which its byte tokenizer makes a few hundred tokens long."""
    root = tmp_path_factory.mktemp("bench-spec")
    folder = write_hf_folder(build_hf_model("llama_gqa", num_hidden_layers=4, max_position_embeddings=1024),
                             root / "hf")
    return compile_model(folder, root / "artifact", CompileConfig(draft_skip=1))


def test_bench_spec_measures_every_source_and_checks_their_outputs_are_equal(drafted, tmp_path):
    out = tmp_path / "spec.json"
    proc = run_llmc("bench-spec", drafted, "--batch", "1,2", "--output-len", 6, "--num-prompts", 2,
                    "--num-draft-tokens", 3, "--draft", drafted, "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("prompts"))
    assert header.split() == ["prompts", "batch", "source", "tok/s", "vs", "none", "drafted", "accept", "mean", "len",
                              "draft", "tokens"]
    assert "equal output: every source gave each of its" in proc.stdout and "MISMATCH" not in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    sources = ["none", "ngram", "self", f"draft:{drafted}"]
    assert [(r["kind"], r["batch"], r["source"]) for r in rows] == [
        (kind, batch, source) for source in sources for kind in ("code", "chat") for batch in (1, 2)]
    for r in rows:
        assert len(r["outputs"]) == 2 and r["decode_tok_s"] > 0
        assert r["outputs"] == next(p["outputs"] for p in rows if p["source"] == "none"
                                    and (p["kind"], p["batch"]) == (r["kind"], r["batch"]))
        if r["source"] != "none":
            s = r["speculation"]
            assert 0 <= s["accepted"] <= s["drafted"] and sum(s["accepted_at"]) == s["accepted"]
    assert rows[-1]["source"] == f"draft:{drafted}" and f"draft:{drafted}" in proc.stdout
    assert "self: the draft graph skips layers [" in proc.stdout and "of 4; at compile time" in proc.stdout


def test_bench_with_ngram_speculation_reports_its_acceptance(tiny_family, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_llmc("bench", tiny_family("llama_gqa")[2], "--num-requests", 3, "--prompt-len", "8:16",
                    "--output-len", 12, "--speculative", "ngram", "--num-draft-tokens", 3, "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "speculation   ngram K <= 3: acceptance" in proc.stdout and "mean accepted length" in proc.stdout
    assert "accepted per position 1: " in proc.stdout and "verify" in proc.stdout
    spec = json.loads(out.read_text())["llmc"]["speculation"]
    assert spec["max_k"] == 3 and len(spec["accepted_at"]) == len(spec["drafted_at"]) == 3
    assert sum(spec["accepted_at"]) == spec["accepted"] <= spec["drafted"] == sum(spec["drafted_at"])


def test_metrics_of_a_speculating_server_count_consistently(drafted):
    server = LiveServer(Engine(drafted, EngineConfig(kv_cache_bytes=2**21, speculative=SpeculativeConfig("self", 3))))
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": "abcabcabcabc", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        m = server.wait_idle()
    finally:
        server.stop()
    drafted_tokens, accepted = m["llmc_spec_draft_tokens_total"], m["llmc_spec_accepted_tokens_total"]
    assert drafted_tokens > 0 and 0 <= accepted <= drafted_tokens
    per_position = [m[f'llmc_spec_accepted_tokens_per_position_total{{position="{i}"}}'] for i in range(3)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert m["llmc_spec_emitted_tokens_total"] == accepted + m["llmc_spec_verified_sequences_total"]
    assert m["llmc_spec_acceptance_rate"] == pytest.approx(accepted / drafted_tokens)
    assert m["llmc_spec_draft_seconds_total"] > 0 and m["llmc_spec_verify_seconds_total"] > 0
