"""The OpenAI-compatible server, driven by the official `openai` client over a loopback port.

The model is a tiny random-weight Llama, so its text is noise; every check compares the
server with itself (streamed against whole, the same seed twice) or with the engine alone.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server import ServerConfig

from live_server import LiveServer
from test_engine_loop import POISON, fail_steps_with_poison

KEY = "test-key"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


@pytest.fixture(scope="module")
def server(artifact):
    live = LiveServer(Engine(artifact), ServerConfig(model_name="tiny", api_key=KEY))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def streamed_text(stream, chat: bool) -> tuple[str, list]:
    chunks = list(stream)
    pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    return "".join(pieces), chunks


# ------------------------------------------------------------------------------ completions


def test_completion_equals_the_engine_alone(client, artifact):
    got = client.completions.create(model="tiny", prompt="hello there", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    alone = Engine(artifact).generate(["hello there"], SamplingParams(max_tokens=12, temperature=0.0,
                                                                      ignore_eos=True))[0]
    assert got.choices[0].text == alone.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(alone.prompt_ids) and got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_whole_text_under_greedy(client, chat):
    if chat:
        whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0)
        stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        text, chunks = streamed_text(stream, chat=True)
        assert text == whole.choices[0].message.content and chunks[0].choices[0].delta.role == "assistant"
    else:
        whole = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0)
        stream = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        text, chunks = streamed_text(stream, chat=False)
        assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_the_same_seed_gives_the_same_text_and_another_seed_another(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="once upon", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_a_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="tiny", prompt="xyz", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    stop = full.text[6:8]
    cut = client.completions.create(model="tiny", prompt="xyz", max_tokens=24, temperature=0, stop=[stop, "@@@"],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"


def test_logprobs_are_greedy_consistent_and_sized(client):
    got = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == 6
    for logprob, top in zip(got.token_logprobs, got.top_logprobs):
        assert len(top) <= 3 and logprob == pytest.approx(max(top.values())) and logprob < 0
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(chat) >= 1 and all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in chat)


def test_n_choices_differ_and_a_list_of_prompts_gives_a_choice_each(client):
    got = client.completions.create(model="tiny", prompt="hi", max_tokens=10, temperature=1.0, n=3, seed=5,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in got.choices) == [0, 1, 2] and len({c.text for c in got.choices}) == 3
    assert got.usage.completion_tokens == 30
    again = client.completions.create(model="tiny", prompt="hi", max_tokens=10, temperature=1.0, n=3, seed=5,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    texts = client.completions.create(model="tiny", prompt=["ab", "cde"], max_tokens=4, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and texts.usage.prompt_tokens == 2 + 3
    ids = client.completions.create(model="tiny", prompt=[[40, 41], [42, 43, 44]], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2


def test_echo_prepends_the_prompt(client):
    got = client.completions.create(model="tiny", prompt="echo me", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="echo me", max_tokens=4, temperature=0)
    assert got.choices[0].text == "echo me" + plain.choices[0].text


def test_models_lists_the_served_model(client, server):
    assert [m.id for m in client.models.list().data] == [server.config.model_name]


# ----------------------------------------------------------------------------- bad input

LONG = [5] * 250       # the tiny model's context is 256 tokens
BAD_REQUESTS = [
    # (endpoint, body (dict, or raw bytes), status, words in the message, param)
    ("completions", b"{not json", 400, "not valid JSON", None),
    ("completions", b"[1, 2]", 400, "must be a JSON object", None),
    ("completions", {"max_tokens": 3}, 400, "prompt is required", "prompt"),
    ("completions", {"prompt": 12}, 400, "prompt must be a string", "prompt"),
    ("completions", {"prompt": []}, 400, "prompt is empty", "prompt"),
    ("completions", {"prompt": [99999]}, 400, "outside the vocabulary", "prompt"),
    ("completions", {"prompt": "a", "max_tokens": -5}, 400, "max_tokens=-5 must be at least 1", "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 10**9}, 400, "exceeds the model's context", "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": "ten"}, 400, "valid integer", "max_tokens"),
    ("completions", {"prompt": LONG, "max_tokens": 10}, 400, "exceeds the model's context of 256", "max_tokens"),
    ("completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature=-0.5", "temperature"),
    ("completions", {"prompt": "a", "temperature": "hot"}, 400, "valid number", "temperature"),
    ("completions", {"prompt": "a", "top_p": 0}, 400, "top_p=0", "top_p"),
    ("completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p=1.5", "top_p"),
    ("completions", {"prompt": "a", "top_k": -3}, 400, "top_k=-3", "top_k"),
    ("completions", {"prompt": "a", "n": 0}, 400, "n=0", "n"),
    ("completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs=50", "logprobs"),
    ("completions", {"prompt": "a", "frequency_penalty": 3}, 400, "frequency_penalty=3", "frequency_penalty"),
    ("completions", {"prompt": "a", "stop": [""]}, 400, "stop strings must not be empty", "stop"),
    ("completions", {"prompt": "a", "stop": 7}, 400, "stop must be a string", "stop"),
    ("completions", {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "/v1/chat/completions only", "tools"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias is not supported", "logit_bias"),
    ("completions", {"prompt": "a", "model": "gpt-9"}, 404, "'gpt-9' does not exist", "model"),
    ("completions", {"prompt": "a", "stream": "yes"}, 400, "valid boolean", "stream"),
    ("chat/completions", {"model": "tiny"}, 400, "messages is required", "messages"),
    ("chat/completions", {"messages": []}, 400, "at least 1 item", "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "input should be",
     "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "must be a string or a list",
     "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "must be a string or a list", "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "whole context of 256",
     "messages"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "needs logprobs", "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content is required",
     "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "system", "content": None}, *CHAT]}, 400,
     "messages[0].content is required for a system message", "messages[0].content"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                      for i in range(129)]}, 400, "129 tools", "tools"),
    ("completions", {"prompt": "a", "stop": ["x"] * 10000}, 400, "10000 stop strings are more than the 16", "stop"),
    ("completions", {"prompt": "a", "stop": ["x" * 300]}, 400, "longer than 256 characters", "stop"),
    ("completions", {"prompt": "a", "stop_token_ids": list(range(100))}, 400, "100 stop_token_ids", "stop_token_ids"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens=0", "max_tokens"),
    ("completions", {"prompt": "a", "cache_salt": ""}, 400, "cache_salt must be 1 to 1024", "cache_salt"),
    ("chat/completions", {"messages": CHAT, "cache_salt": "s" * 1025}, 400, "cache_salt must be 1 to 1024",
     "cache_salt"),
]


@pytest.mark.parametrize("endpoint, body, status, words, param", BAD_REQUESTS,
                         ids=[f"{i:02d}-{b[3][:30]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_its_status_and_a_sentence_naming_the_field(server, endpoint, body, status, words, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=raw, headers=server.headers())
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_a_missing_or_wrong_api_key_gets_401(server, headers):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200          # health needs no key


def test_unknown_routes_and_methods_get_openai_errors(server):
    r = httpx.get(f"{server.url}/v1/nothing", headers=server.headers())
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{server.url}/v1/completions", headers=server.headers()).status_code == 405


def test_server_is_healthy_and_serving_after_all_the_bad_requests(server, client):
    """Sends the whole table itself (so it holds alone or in any order); each refusal is counted once."""
    def rejected(m: dict, status: int) -> float:
        return m.get(f'llmc_rejected_requests_total{{status="{status}"}}', 0.0)

    before = server.wait_idle()
    for endpoint, body, *_ in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(f"{server.url}/v1/{endpoint}", content=raw, headers=server.headers())
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=3, temperature=0).choices
    after = server.wait_idle()
    for status in sorted({b[2] for b in BAD_REQUESTS}):
        assert rejected(after, status) - rejected(before, status) == sum(b[2] == status for b in BAD_REQUESTS), status


# ------------------------------------------------------------------ clients that go away


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Each engine step 2 ms longer: the tiny model alone can finish 16 x 240 tokens before a client
    is seen to leave, and these tests need its requests still running then."""
    runner = server.loop.engine.runner
    run = runner.run_step
    monkeypatch.setattr(runner, "run_step", lambda entry, step: (time.sleep(0.002), run(entry, step))[1])


@pytest.mark.usefixtures("slow_steps")
def test_clients_dropping_mid_stream_free_their_blocks(server, client):
    before = server.wait_idle()
    streams = []
    for i in range(16):
        s = client.completions.create(model="tiny", prompt=f"drop {i}", max_tokens=200, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(s))
        streams.append(s)
    for s in streams:
        s.close()
    after = server.wait_idle()
    aborted = after['llmc_requests_total{outcome="abort"}'] - before.get('llmc_requests_total{outcome="abort"}', 0)
    assert aborted == 16                                                  # ended by the drop, not by finishing
    assert client.completions.create(model="tiny", prompt="next", max_tokens=3, temperature=0).choices[0].text


@pytest.mark.usefixtures("slow_steps")
def test_a_non_streaming_client_that_goes_away_is_aborted(server):
    before = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=0.2,
                   json={"prompt": "slow", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "n": 16})
    after = server.wait_idle()
    assert after['llmc_requests_total{outcome="abort"}'] - before.get('llmc_requests_total{outcome="abort"}', 0) == 16


# ------------------------------------------------------------- back-pressure and failures


@pytest.fixture
def one_seat_server(artifact, request):
    """One sequence at a time, `max_waiting` (the test's param) may wait; steps computing the poison
    prompt fail."""
    engine = Engine(artifact, EngineConfig(max_num_seqs=1))
    fail_steps_with_poison(engine)
    live = LiveServer(engine, ServerConfig(model_name="tiny", max_waiting=request.param))
    yield live
    live.stop()


@pytest.mark.parametrize("one_seat_server", [1], indirect=True)
def test_a_full_queue_gets_429_with_retry_after_and_accepted_requests_finish(one_seat_server):
    client = openai.OpenAI(base_url=f"{one_seat_server.url}/v1", api_key="none", max_retries=0)
    running = client.completions.create(model="tiny", prompt="a", max_tokens=200, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))                                  # it holds the one seat
    waiting = client.completions.create(model="tiny", prompt="b", max_tokens=5, temperature=0, stream=True)
    r = httpx.post(f"{one_seat_server.url}/v1/completions", json={"prompt": "c", "max_tokens": 5})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error" and "retry" in r.json()["error"]["message"]
    assert streamed_text(running, chat=False)[1][-1].choices[0].finish_reason == "length"
    assert streamed_text(waiting, chat=False)[1][-1].choices[0].finish_reason in ("length", "stop")
    one_seat_server.wait_idle()
    assert httpx.post(f"{one_seat_server.url}/v1/completions", json={"prompt": "c", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("one_seat_server", [4], indirect=True)
def test_a_failing_step_fails_only_its_own_request(one_seat_server, artifact):
    url = one_seat_server.url
    expected = Engine(artifact).generate(["fine"], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/completions",
                         json={"prompt": POISON, "max_tokens": 8, "stream": True}) as poisoned:
            fine = http.post(f"{url}/v1/completions", json={"prompt": "fine", "max_tokens": 8, "temperature": 0})
            events = [line for line in poisoned.iter_lines() if line.startswith("data: ")]
    assert "injected fault" in json.loads(events[0][6:])["error"]["message"] and events[-1] == "data: [DONE]"
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == expected
    whole = httpx.post(f"{url}/v1/completions", json={"prompt": POISON, "max_tokens": 4}, timeout=60)
    assert whole.status_code == 500 and "injected fault" in whole.json()["error"]["message"]
    m = one_seat_server.wait_idle()
    assert m['llmc_requests_total{outcome="error"}'] == 2


# --------------------------------------------------------------------- nothing crashes it

FIELD_VALUES = {
    "prompt": ["hi", "", [], [1, 2], [[3], [4, 5]], [[]], [-1], [2**40], 3.5, None, {"a": 1}, ["a", 1]],
    "messages": [CHAT, [], [{}], [{"role": "user"}], [{"role": "user", "content": None}], "hi", [1]],
    "max_tokens": [1, 3, 0, -1, 2**70, 1.5, "3", None, True],
    "temperature": [0, 0.7, 2, -1, 1e308, "x", None],
    "top_p": [0.5, 1, 0, -0.1, 2], "top_k": [0, -1, 5, -7, 10**12], "min_p": [0.1, 1.5, -1],
    "seed": [0, -1, 2**63, -(2**64), 7, "7"], "n": [1, 2, 0, 129, -3],
    "stop": ["a", ["b", "c"], [""], [1], "", None], "logprobs": [0, 2, 21, -1, True, None],
    "top_logprobs": [0, 3, 30, -1], "echo": [True, False, 1], "stream": [True, False, "no"],
    "presence_penalty": [0.5, 5, -5], "frequency_penalty": [1, -3], "repetition_penalty": [1.2, 0, -1],
    "stream_options": [{"include_usage": True}, {"include_usage": "y"}, 3], "ignore_eos": [True, 0],
    "user": ["u", 5], "model": ["tiny", "other", 1], "stop_token_ids": [[2], [-5], "x"],
}


def test_random_bodies_get_200_or_a_4xx_and_the_server_stays_healthy(server):
    import random

    rng = random.Random(0)
    statuses = []
    for i in range(80):
        fields = rng.sample(sorted(FIELD_VALUES), rng.randint(1, 8))
        body = {f: rng.choice(FIELD_VALUES[f]) for f in fields}
        endpoint = "chat/completions" if i % 2 else "completions"
        r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, headers=server.headers(), timeout=60)
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        assert r.status_code == 200 or r.json()["error"]["message"]
        statuses.append(r.status_code)
    assert 200 in statuses and 400 in statuses
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()
