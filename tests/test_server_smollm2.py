"""The server under load on the real embedded SmolLM2-135M-Instruct: 64 concurrent streaming
clients each get the text they get alone, and /metrics adds up to what was sent."""

from __future__ import annotations

import asyncio

import openai
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server import ServerConfig

from live_server import LiveServer

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 2 plus 2?", "Say hello in Spanish.",
    "What do bees make?", "Name a planet.", "What is ice made of?", "Give me a synonym for happy.",
    "What color is the sky?", "Name a fruit.", "How many legs does a spider have?", "What is the opposite of hot?",
    "Name an ocean.", "What animal says moo?", "What is the freezing point of water in Celsius?", "Name a month.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(smollm2_artifact):
    live = LiveServer(Engine(smollm2_artifact), ServerConfig(model_name="smollm2"))
    yield live
    live.stop()


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


async def stream_one(client: openai.AsyncOpenAI, question: str) -> tuple[str, dict]:
    stream = await client.chat.completions.create(
        model="smollm2", messages=messages(question), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage.model_dump()
    return text, usage


async def all_at_once(url: str, questions: list[str]) -> list[tuple[str, dict]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    return await asyncio.gather(*(stream_one(client, q) for q in questions))


def test_the_capital_of_france_is_paris_through_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="smollm2", messages=messages(QUESTIONS[0]), temperature=0,
                                           max_tokens=32)
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


def test_64_concurrent_streams_each_get_the_text_they_get_alone(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    alone = {q: client.chat.completions.create(model="smollm2", messages=messages(q), max_tokens=MAX_TOKENS,
                                               temperature=0).choices[0].message.content for q in QUESTIONS}
    before = server.wait_idle()
    questions = QUESTIONS * 4
    results = asyncio.run(all_at_once(server.url, questions))
    assert [text for text, _ in results] == [alone[q] for q in questions]
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ended = delta('llmc_requests_total{outcome="stop"}') + delta('llmc_requests_total{outcome="length"}')
    assert ended == 64 and delta('llmc_requests_total{outcome="error"}') == 0
    assert delta("llmc_generation_tokens_total") == sum(u["completion_tokens"] for _, u in results)
    assert delta("llmc_prompt_tokens_total") == sum(u["prompt_tokens"] for _, u in results)
    assert delta("llmc_time_to_first_token_seconds_count") == 64
    assert delta("llmc_e2e_request_latency_seconds_count") == 64
