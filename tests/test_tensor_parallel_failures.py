"""Tensor parallelism when something is wrong: a rank killed mid-stream stops the server (the stream ends
with an error, the process exits 1 within the collective timeout, nothing hangs); --tp that is not the
artifact's rank count, fewer ranks started than --tp, and ranks given different artifacts are each
refused in one sentence. Ranks run on gloo over 127.0.0.1 (~10 s a test on 2 shared cores)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from test_bad_inputs import assert_process_error, run_llmc
from test_serve_cli import ServeProcess, start_stream
from tiny_models import build_hf_model, write_hf_folder

TIMEOUT = 10          # --tp-timeout of the servers here, seconds


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Two artifacts of the same tiny Llama's shapes compiled for 2 ranks, from different weights."""
    from llmc.compiler.driver import CompileConfig, compile_model

    root = tmp_path_factory.mktemp("tp")
    return [compile_model(write_hf_folder(build_hf_model("llama_hd32", seed=seed), root / f"hf{seed}"),
                          root / f"tp2_{seed}", CompileConfig(tp=2)) for seed in (0, 1)]


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of `pid`'s child processes (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """End a server a failed assertion left running, and its workers."""
    if proc.poll() is None:
        for pid, _ in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_killing_rank_1_ends_the_stream_with_an_error_and_the_server_exits_1(sharded):
    server = ServeProcess(sharded[0], "--port", 0, "--tp", 2, "--tp-timeout", TIMEOUT, "--backend", "torch",
                          step_delay=0.02)
    try:
        thread, events = start_stream(server.url, {"prompt": "x", "max_tokens": 200, "temperature": 0,
                                                   "ignore_eos": True})
        (worker,) = [pid for pid, cmd in children(server.proc.pid) if "tensor_parallel.worker" in cmd]
        os.kill(worker, signal.SIGKILL)
        assert server.proc.wait(timeout=TIMEOUT + 30) == 1, "".join(server.lines)
    finally:
        kill_tree(server.proc)
    thread.join(10)
    assert not thread.is_alive()
    errors = [json.loads(e)["error"]["message"] for e in events if e.startswith("{") and '"error"' in e]
    assert errors and "tensor-parallel rank 1 stopped" in errors[0], events[-3:]
    assert "llmc: tensor-parallel rank 1 stopped (" in "".join(server.lines)


def test_tp_other_than_the_artifacts_rank_count_is_refused(sharded, tiny_family):
    assert_process_error(run_llmc("generate", sharded[0], "x", "--tp", 3), "compiled for 2", "--tp is 3", "--tp 2")
    assert_process_error(run_llmc("generate", sharded[0], "x"), "compiled for 2", "--tp is 1", "--tp 2")
    one_rank = tiny_family("llama_hd32")[2]
    assert_process_error(run_llmc("generate", one_rank, "x", "--tp", 2), "compiled for 1", "--tp is 2")


def test_fewer_ranks_started_than_tp_is_refused(sharded):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    assert_process_error(run_llmc("generate", sharded[0], "x", "--tp", 2, env=env), "--tp 2 needs 2 ranks",
                         "WORLD_SIZE is 1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ranks_given_different_artifacts_are_refused(sharded):
    """The environment a second machine would have: each rank is `llmc generate ... --tp 2` of its own artifact."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    other = subprocess.Popen([sys.executable, "-m", "llmc.tools.cli", "generate", str(sharded[1]), "x", "--tp", "2"],
                             env={**env, "RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank0 = run_llmc("generate", sharded[0], "x", "--tp", 2, env={**env, "RANK": "0"})
    assert other.wait(timeout=60) == 1
    assert "differs from rank 0's" in other.stderr.read()
    assert_process_error(rank0, "rank 1's artifact differs from rank 0's", "give every rank the same artifact")


def test_an_idle_server_outlives_the_timeout_and_sigterm_stops_every_rank(sharded):
    """A worker waits for the next step however long the server idles (the step channel has no short
    timeout, the collectives do); SIGTERM on rank 0 tells every rank to stop, and all exit 0."""
    server = ServeProcess(sharded[0], "--port", 0, "--tp", 2, "--tp-timeout", 2, "--backend", "torch")
    try:
        (worker,) = [pid for pid, cmd in children(server.proc.pid) if "tensor_parallel.worker" in cmd]
        time.sleep(4)                                                 # idle for twice the collective timeout
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 8, "temperature": 0},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.stop() == 0, "".join(server.lines)
    finally:
        kill_tree(server.proc)
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text().lower()
