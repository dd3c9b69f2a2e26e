"""`llmc bench-serve` against a live server: the work it reports is the work it asked for."""

from __future__ import annotations

import json

import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server import ServerConfig

from live_server import LiveServer
from test_bad_inputs import assert_process_error, run_llmc


@pytest.fixture(scope="module")
def server(tiny_family):
    live = LiveServer(Engine(tiny_family("llama_hd32")[2]), ServerConfig(api_key="k"))
    yield live
    live.stop()


def test_bench_serve_reports_both_phases_for_the_same_requests(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_llmc("bench-serve", server.url, "--num-requests", 6, "--prompt-words", "3:9", "--output-len", "4:12",
                    "--api-key", "k", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "6 at once" in proc.stdout and "one at a time" in proc.stdout and "x one at a time" in proc.stdout
    result = json.loads(out.read_text())
    asked = [r["max_tokens"] for r in result["requests"]]
    assert result["concurrent"]["output_tokens"] == sum(asked)            # EOS ignored: every token asked for
    assert result["one_at_a_time"]["output_tokens"] == sum(asked)         # every request in both rows
    assert result["concurrent"]["requests"] == result["one_at_a_time"]["requests"] == 6
    for phase in (result["concurrent"], result["one_at_a_time"]):
        assert 0 < phase["ttft_s"]["p50"] <= phase["ttft_s"]["p99"] and phase["tpot_s"]["p50"] > 0
    assert server.wait_idle()["llmc_kv_blocks_used"] == 0


def test_bench_serve_without_a_server_says_so_in_one_sentence():
    assert_process_error(run_llmc("bench-serve", "http://127.0.0.1:9", "--num-requests", 1),
                         "cannot reach the server", "llmc serve")


def test_bench_serve_with_a_wrong_key_reports_the_servers_answer(server):
    assert_process_error(run_llmc("bench-serve", server.url, "--num-requests", 1, "--api-key", "bad"),
                         "401", "API key")
