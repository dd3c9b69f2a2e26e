"""The server's host work stays off its event loop: while one request's prompt is being tokenised
(or its chat template rendered), every other request is still answered.

The tokenizer's `encode` is made slow (it sleeps, then tokenises); a GET /health sent while a
completion or chat request sits in that sleep must answer before the sleep ends. Were the
tokenising done in the event loop's thread, /health could only answer after it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.server import ServerConfig

from live_server import LiveServer

ENCODE_DELAY_S = 1.5         # far longer than a /health round trip, even on busy shared cores


@pytest.fixture(scope="module")
def server(tiny_family):
    live = LiveServer(Engine(tiny_family("llama_hd32")[2]), ServerConfig(model_name="tiny"))
    yield live
    live.stop()


class SlowEncode:
    """Wraps a tokenizer's encode: each call sets `started`, sleeps, tokenises, then sets `done`."""

    def __init__(self, encode):
        self.encode, self.started, self.done = encode, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.started.set()
        time.sleep(ENCODE_DELAY_S)
        try:
            return self.encode(*args, **kwargs)
        finally:
            self.done.set()


@pytest.fixture
def slow_encode(server, monkeypatch) -> SlowEncode:
    tokenizer = server.loop.engine.tokenizer
    slow = SlowEncode(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", slow)
    return slow


@pytest.mark.parametrize("endpoint, body, choices", [
    ("completions", {"prompt": "tokenise me slowly"}, 1),
    ("completions", {"prompt": ["tokenise me", "and me"], "echo": True}, 2),
    ("chat/completions", {"messages": [{"role": "user", "content": "render me slowly"}]}, 1),
])
def test_health_answers_while_a_prompt_is_tokenised(server, slow_encode, endpoint, body, choices):
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{server.url}/v1/{endpoint}", json={**body, "max_tokens": 2}, timeout=60)
        assert slow_encode.started.wait(30), "the request never reached the tokenizer"
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert not slow_encode.done.is_set(), "/health waited for the tokenizer: the event loop was blocked"
        assert health.json() == {"status": "ok"}
        reply = pending.result()
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == choices


def test_a_template_error_from_the_worker_is_still_a_400_naming_messages(server, monkeypatch):
    """Errors raised in the worker thread keep their mapping (a chat template's RequestError)."""
    def refuse(*args, **kwargs):
        raise RequestError("the chat template refused these messages: roles must alternate")

    monkeypatch.setattr(server.loop.engine.tokenizer, "encode_chat", refuse)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and "Traceback" not in r.text
    assert r.json()["error"]["param"] == "messages" and "roles must alternate" in r.json()["error"]["message"]

