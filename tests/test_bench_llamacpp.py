"""tools/bench_llamacpp.py without llama.cpp: the one-line skip where the peer's interpreter cannot
import llama_cpp (this venv's, which never has it), a bad interpreter refused in one line, and the
measuring, ratio and printing path against a fake peer (an executable that answers the peer's
protocol with fixed JSON) and a tiny artifact."""

from __future__ import annotations

import json
import subprocess
import sys

from llmc.tools.bench_llamacpp import format_result

FAKE_PEER = """#!/bin/sh
# argv: -I llamacpp_peer.py probe | -I llamacpp_peer.py decode GGUF THREADS TOKENS PROMPT_IDS REPEATS
if [ "$3" = probe ]; then echo '{"version": "fake-1"}'; exit 0; fi
printf '%s\t' "$@" >> "$(dirname "$0")/calls"; echo >> "$(dirname "$0")/calls"
echo '{"version": "fake-1", "runs": [{"decode_s": 0.5, "tokens": 3, "token_ids": [5, 6, 7, 8], "prefill_s": 4.0}]}'
"""


def bench(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc.tools.bench_llamacpp", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def test_without_llama_cpp_it_says_skipped_in_one_line_and_exits_0():
    proc = bench("--llama-python", sys.executable)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llama.cpp peer skipped: llama_cpp is not importable by")
    assert "--llama-python" in lines[0] and "llama-cpp-python==0.3.36" in lines[0]


def test_an_interpreter_that_does_not_run_is_one_line_and_exit_1(tmp_path):
    proc = bench("--llama-python", tmp_path / "no-such-python")
    assert proc.returncode == 1 and "could not run the llama.cpp peer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_fake_peer_gives_the_ratio_of_both_sides(tiny_family, tmp_path):
    """llmc decodes the tiny artifact; the fake peer reports 3 tokens in 0.5 s (6 tok/s) after its
    prompt in 4 s; the table and the JSON hold both sides' decode and prompt and their ratios, and the
    peer got llmc's thread count and prompt ids."""
    _, _, art = tiny_family("llama_hd32")
    peer = tmp_path / "python"
    peer.write_text(FAKE_PEER)
    peer.chmod(0o755)
    out = tmp_path / "result.json"
    proc = bench("--llama-python", peer, "--artifact", art, "--gguf", tmp_path / "model.gguf", "--decode-tokens", 5,
                 "--repeats", 2, "--json", out)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["llama.cpp"]["tok_s"] == 6.0 and result["llmc"]["tokens"] == 4 and result["llmc"]["tok_s"] > 0
    ratio, prompt = result["llmc"]["tok_s"] / 6.0, 4.0 / result["llmc"]["prefill_s"]
    assert result["llama.cpp"]["prompt_tok_s"] == result["prompt_tokens"] / 4.0
    assert 0 < result["llmc"]["prefill_s"] < 4.0
    assert f"llmc / llama.cpp: {ratio:.2f}x (different greedy tokens); the prompt {prompt:.2f}x" in proc.stdout
    assert "llama.cpp fake-1" in proc.stdout and "llmc float" in proc.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2                                                   # one peer run per repeat
    isolated, _, command, gguf, threads, tokens, prompt, repeats = calls[0].rstrip("\t").split("\t")
    assert isolated == "-I" and command == "decode"
    assert gguf == str(tmp_path / "model.gguf") and int(threads) == result["threads"] and tokens == "5"
    assert len(json.loads(prompt)) == result["prompt_tokens"] and repeats == "1"


def test_the_table_names_the_faster_side_by_its_ratio():
    side = {"tok_s": 50.0, "token_ids": [1, 2], "prefill_s": 0.2, "prompt_tok_s": 100.0}
    result = {"cpu": "a CPU", "threads": 2, "gguf": "/x/m.gguf", "decode_tokens": 8, "prompt_tokens": 20,
              "repeats": 1, "artifact_recipe": "int4-g32, int8 embeddings", "peer_version": "0.3.36",
              "llmc": {**side, "tok_s": 125.0, "prefill_s": 0.05}, "llama.cpp": side}
    text = format_result(result)
    assert "llmc / llama.cpp: 2.50x (the same greedy tokens); the prompt 4.00x" in text
    assert "a CPU | threads 2 | m.gguf" in text


def test_depth_puts_the_chat_prompt_behind_filler_to_that_many_tokens(tiny_family, tmp_path):
    """--depth 160: the peer is given 160 prompt ids that end with the chat prompt's (both sides decode
    after the same context); a depth past the engine's context, or below 0, is one line and exit 1."""
    _, _, art = tiny_family("llama_hd32")
    peer = tmp_path / "python"
    peer.write_text(FAKE_PEER)
    peer.chmod(0o755)
    common = ("--llama-python", peer, "--artifact", art, "--gguf", tmp_path / "model.gguf", "--repeats", 1,
              "--decode-tokens", 3)
    out = tmp_path / "deep.json"
    for depth in (0, 160):
        proc = bench(*common, "--depth", depth, "--json", out)
        assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    chat, deep = (json.loads(line.rstrip("\t").split("\t")[6]) for line in calls)
    assert len(deep) == 160 == json.loads(out.read_text())["prompt_tokens"] and "160-token prompt" in proc.stdout
    assert len(chat) < 160 and deep[-len(chat):] == chat and deep[:len(chat)] != chat
    for bad in (-1, 10**6):
        proc = bench(*common, "--depth", bad)
        assert proc.returncode == 1 and "--depth" in proc.stderr and "Traceback" not in proc.stderr
