"""`llmc serve` as a real process: it starts, answers, shuts down gracefully on SIGTERM, and
refuses bad options in one sentence."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from test_bad_inputs import assert_process_error, run_llmc


# `llmc serve` with every model run (the engine's `run_step`) made a given number of seconds longer
# (the test's only change to the production process: a request of n tokens then certainly runs for at
# least n x that).
SLOWED_CLI = """
import sys, time
from llmc.runtime.model_runner import ModelRunner
delay, run = float(sys.argv.pop(1)), ModelRunner.run_step
ModelRunner.run_step = lambda self, entry, step: (time.sleep(delay), run(self, entry, step))[1]
from llmc.tools.cli import app
app()
"""


class ServeProcess:
    """`llmc serve ART --port 0 ...` in a child process; the port is read from its start line.
    With `step_delay`, each model run in it takes that many seconds longer."""

    def __init__(self, *args, step_delay: float = 0.0):
        cli = ["-c", SLOWED_CLI, str(step_delay)] if step_delay else ["-m", "llmc.tools.cli"]
        self.proc = subprocess.Popen([sys.executable, *cli, "serve", *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        for line in self.proc.stderr:
            self.lines.append(line)
            if m := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line):
                self.url = f"http://127.0.0.1:{m.group(1)}"
                break
        else:
            raise AssertionError(f"llmc serve did not start: {''.join(self.lines)}")
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def wait_until_it_stops_listening(self, timeout: float = 30) -> None:
        """Return once a new connection is refused: the shutdown has begun (the engine loop is told
        to stop before uvicorn closes its sockets)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
            except httpx.ConnectError:
                return
            assert time.monotonic() < deadline, f"still accepting connections {timeout} s after the signal"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


def stream_events(url: str, body: dict, started: threading.Event, events: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def start_stream(url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    started, events = threading.Event(), []
    thread = threading.Thread(target=stream_events, args=(url, body, started, events), daemon=True)
    thread.start()
    assert started.wait(30), "no first chunk in 30 s"
    return thread, events


STEP_DELAY = 0.02          # seconds added to each step of the server below


def test_sigterm_lets_a_running_stream_finish_then_exits_0(artifact):
    server = ServeProcess(artifact, "--port", 0, "--served-model-name", "tiny", step_delay=STEP_DELAY)
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"
    tokens = 100                                                  # >= 2 s of steps after the first token
    thread, events = start_stream(server.url, {"prompt": "x", "max_tokens": tokens, "temperature": 0,
                                               "ignore_eos": True, "stream_options": {"include_usage": True}})
    server.proc.send_signal(signal.SIGTERM)
    server.wait_until_it_stops_listening()
    seen_at_shutdown = list(events)
    assert server.proc.wait(timeout=60) == 0, "".join(server.lines)
    thread.join(30)
    chunks = [json.loads(e) for e in events[:-1]]
    assert "[DONE]" not in seen_at_shutdown and not any(
        c["choices"][0]["finish_reason"] for c in map(json.loads, seen_at_shutdown) if c["choices"])   # in flight
    assert events[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == tokens                 # every token, after the signal too
    assert "Traceback" not in "".join(server.lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_past_the_grace_period_running_requests_are_aborted_and_it_still_exits_0(artifact):
    server = ServeProcess(artifact, "--port", 0, "--grace-period", 0, "--max-num-seqs", 1)
    thread, events = start_stream(server.url, {"prompt": "x", "max_tokens": 240, "temperature": 0, "n": 4,
                                               "ignore_eos": True})
    assert server.stop() == 0, "".join(server.lines)
    thread.join(30)
    reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert events[-1] == "[DONE]" and "abort" in reasons and len(reasons) == 4
    assert "Traceback" not in "".join(server.lines)


def test_a_port_in_use_is_refused_in_one_sentence(artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = run_llmc("serve", artifact, "--port", taken.getsockname()[1])
    assert_process_error(proc, "cannot listen on 127.0.0.1", "--port")


@pytest.mark.parametrize("option, words", [
    (["--port", 70000], ["port 70000", "0..65535"]),
    (["--max-waiting", 0], ["max_waiting=0", "at least 1"]),
    (["--kv-memory", "lots"], ["'lots'", "512MiB"]),
    (["--grace-period", -1], ["grace_period=-1", "negative"]),
])
def test_bad_serve_options_are_refused_in_one_sentence(artifact, option, words):
    assert_process_error(run_llmc("serve", artifact, *option), *words)


def test_serving_a_missing_artifact_is_refused_in_one_sentence(tmp_path):
    assert_process_error(run_llmc("serve", tmp_path / "nothing", "--port", 0), "nothing")
